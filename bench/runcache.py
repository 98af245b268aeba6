"""Per-run cache of long benchmarks: an interrupted benchmark continues where it stopped.

Each finished run (a JSON-able dict; numpy/torch arrays under ``ARRAY_KEYS`` go to ``.npy``
files) is stored under ``<out>/cache/<sha1 of its key>.json``. The key holds everything that
determines the run (method, task, seed, settings, rounds, form) plus :data:`VERSION`; change the
version when a change of code changes results, or delete the folder to recompute.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.common.results import atomic_write_text

logger = logging.getLogger(__name__)

VERSION = 1
ARRAY_KEYS = ("phi",)


class RunCache:
    """``RunCache(folder)(key, fn)`` returns the stored result of ``key`` or stores ``fn()``'s.

    ``folder = None`` caches nothing; ``create = False`` does not create the folder (a reader).
    """

    def __init__(self, folder: Path | None, create: bool = True) -> None:
        self.folder = folder
        if folder is not None and create:
            folder.mkdir(parents=True, exist_ok=True)

    def path(self, key: dict[str, Any]) -> Path:
        """``<folder>/<sha1 of the key>.json``; a cell's other files share its stem (``.run``, ``.running``)."""
        return self._path(key)

    def work_dir(self, key: dict[str, Any]) -> Path:
        """``<folder>/<key hash>.run``: where a resumable cell keeps its checkpoints until it is stored."""
        return self._path(key).with_suffix(".run")

    def _path(self, key: dict[str, Any]) -> Path:
        assert self.folder is not None
        text = json.dumps({"version": VERSION, **key}, sort_keys=True, default=str)
        return self.folder / (hashlib.sha1(text.encode()).hexdigest()[:20] + ".json")

    def has(self, key: dict[str, Any]) -> bool:
        """Whether ``key``'s result is stored."""
        return self.folder is not None and self._path(key).is_file()

    def get(self, key: dict[str, Any]) -> dict[str, Any] | None:
        """The stored result of ``key``, or ``None``."""
        if not self.has(key):
            return None
        path = self._path(key)
        doc: dict[str, Any] = json.loads(path.read_text())
        for name in doc.pop("_arrays", []):
            doc[name] = _as_tensor(np.load(path.with_suffix(f".{name}.npy")))
        logger.debug("cached: %s", key)
        return doc

    def __call__(self, key: dict[str, Any], fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        if self.folder is None:
            return fn()
        found = self.get(key)
        if found is not None:
            return found
        path = self._path(key)
        result = fn()
        stored = {k: v for k, v in result.items() if k not in ARRAY_KEYS}
        arrays = [k for k in ARRAY_KEYS if k in result]
        for name in arrays:
            np.save(path.with_suffix(f".{name}.npy"), np.asarray(result[name]))
        stored["_arrays"] = arrays
        stored["_key"] = key
        atomic_write_text(path, json.dumps(stored, default=_plain))
        return result


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def _as_tensor(a: np.ndarray) -> Any:
    import torch

    return torch.as_tensor(a)
