"""Server checkpoints of a federated run (every engine that uses the round loop), for ``graphfl run --resume``.

Files (in ``<out-dir>/checkpoint/``)::

    checkpoint.json           # the commit point: format, round, the config fingerprint, run key,
                              # active clients, the pickle's name and sha256, earlier resumes
    server-r<round>.pkl       # the server core, the sampling RNG state, the recorder's rows

Written after every completed round r (its replies aggregated, its rows flushed to ``run.json``):
the pickle under a temporary name, fsync-ed and renamed, then the json replaced the same way,
then older pickles removed. A crash at any moment leaves the previous checkpoint intact.

Why pickle: a core's state is whatever its algorithm keeps (models, cluster tables, dual
variables, hyper-gradient caches, ...); every registered core pickles (tests/test_resume.py
checks them all and that a resumed run equals an uninterrupted one), so one ``pickle.dumps(core)``
captures all of it without a per-algorithm state API that could forget a field.
**Trust note**: unpickling runs code. Only resume from checkpoints this installation wrote; the
sha256 in the json detects a partial write, not tampering. The config fingerprint is checked
from the json *before* the pickle is read.

What a resume keeps, and may change (DESIGN: results never lie)
----------------------------------------------------------------
Every run-config key must be equal except :data:`RESUMABLE_KEYS`: ``rounds`` (at least the
checkpoint's round; more rounds continue the run), the output / data folders, the device and
the timeouts. A differing key is refused with one line naming each key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import pickle
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphfl.common.config import ConfigError, RunConfig, Scalar
from graphfl.common.core import ServerCore
from graphfl.common.results import atomic_write_bytes, atomic_write_text, clean_json

logger = logging.getLogger(__name__)

FORMAT = 1
DIRNAME = "checkpoint"
META = "checkpoint.json"
RESUMABLE_KEYS = ("rounds", "out-dir", "data-dir", "device", "round-timeout", "connect-timeout", "resume")
"""Run-config keys a resume may change; every other key must equal the checkpoint's."""


class CheckpointError(ConfigError):
    """A checkpoint is missing, inconsistent, or belongs to another run configuration."""


def fingerprint(cfg: RunConfig) -> dict[str, Scalar]:
    """The flat run config without :data:`RESUMABLE_KEYS` (what a resumed run must share)."""
    return {k: v for k, v in sorted(cfg.to_flat().items()) if k not in RESUMABLE_KEYS}


ADDED_KEYS: dict[str, Scalar] = {"data.client-samples": 0, "data.cluster-std": 0.0, "train.eval-local": False}
"""Configuration keys added after checkpoints existed, with the value that keeps the earlier
behaviour: a checkpoint without such a key resumes while the run has it at that value. Any other
key missing from a checkpoint's configuration is a difference."""


def checkpoint_dir(out_dir: str | Path) -> Path:
    """``<out_dir>/checkpoint``."""
    return Path(out_dir) / DIRNAME


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save(directory: str | Path, *, server_round: int, cfg: RunConfig, core: ServerCore[Any], rng: random.Random,
         active: list[int], rows: dict[int, dict[str, Any]], extra: dict[str, Any]) -> Path:
    """Write the checkpoint after round ``server_round`` (atomically, see the module doc); returns the json path.

    ``rows`` / ``extra`` are the recorder's rows and extra fields so far (restored on resume, so
    ``run.json`` keeps the rounds before the interruption).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    blob = pickle.dumps({"core": core, "rng": rng.getstate(), "rows": rows, "extra": extra},
                        protocol=pickle.HIGHEST_PROTOCOL)
    target = d / f"server-r{server_round:07d}.pkl"
    atomic_write_bytes(target, lambda fh: fh.write(blob))
    meta = {
        "format": FORMAT, "round": int(server_round), "strategy": cfg.strategy, "rounds": cfg.rounds,
        "run_key": cfg.run_key, "config": fingerprint(cfg), "active": [int(p) for p in active],
        "pickle": target.name, "sha256": hashlib.sha256(blob).hexdigest(), "saved_at": time.time(),
        "resumes": clean_json(extra.get("resumes", [])),
    }
    atomic_write_text(d / META, json.dumps(clean_json(meta), indent=1) + "\n")
    for old in d.glob("server-r*.pkl"):
        if old.name != target.name:
            old.unlink(missing_ok=True)
    return d / META


def read_meta(directory: str | Path) -> dict[str, Any]:
    """The checkpoint's json (nothing unpickled).

    Raises
    ------
    CheckpointError
        No checkpoint there, not valid JSON, or another format.
    """
    path = Path(directory) / META
    if not path.is_file():
        raise CheckpointError(f"no checkpoint: {path} not found (a run writes one after each completed round)")
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format') if isinstance(meta, dict) else None!r}, "
                              f"this graphfl reads {FORMAT}")
    check_meta(meta, path)
    return meta


_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_meta(meta: dict[str, Any], path: str | Path) -> None:
    """Validate every field of a checkpoint's json (types and ranges) before anything uses it.

    ``round`` an integer >= 0, ``rounds`` an integer >= 1, ``strategy`` / ``run_key`` strings,
    ``config`` a table, ``active`` a list of partition ids (integers >= 0), ``pickle`` exactly
    ``server-r<round, 7 digits>.pkl`` (a name in the checkpoint folder), ``sha256`` 64 hex digits,
    ``resumes`` a list, ``saved_at`` a finite number.

    Raises
    ------
    CheckpointError
        Naming the file, the key and the bad value.
    """
    def bad(key: str, expected: str) -> CheckpointError:
        return CheckpointError(f"{path}: key {key!r} is {meta.get(key)!r}; expected {expected} "
                               f"(a damaged or hand-edited checkpoint)")

    for key in ("round", "rounds", "strategy", "run_key", "config", "active", "pickle", "sha256"):
        if key not in meta:
            raise CheckpointError(f"{path}: key {key!r} is missing (a damaged or hand-edited checkpoint)")
    if not _is_int(meta["round"]) or meta["round"] < 0:
        raise bad("round", "an integer >= 0")
    if not _is_int(meta["rounds"]) or meta["rounds"] < 1:
        raise bad("rounds", "an integer >= 1")
    for key in ("strategy", "run_key"):
        if not isinstance(meta[key], str):
            raise bad(key, "a string")
    if not isinstance(meta["config"], dict):
        raise bad("config", "a table of run-config keys")
    if not isinstance(meta["active"], list) or not all(_is_int(p) and p >= 0 for p in meta["active"]):
        raise bad("active", "a list of partition ids (integers >= 0)")
    if meta["pickle"] != f"server-r{meta['round']:07d}.pkl":
        raise bad("pickle", f"'server-r{meta['round']:07d}.pkl' (the state file of its round)")
    if not isinstance(meta["sha256"], str) or not _SHA256_RE.fullmatch(meta["sha256"]):
        raise bad("sha256", "64 hexadecimal digits")
    if "resumes" in meta and not isinstance(meta["resumes"], list):
        raise bad("resumes", "a list")
    saved_at = meta.get("saved_at", 0.0)
    if isinstance(saved_at, bool) or not isinstance(saved_at, (int, float)) or not math.isfinite(saved_at):
        raise bad("saved_at", "a finite number (seconds since the epoch)")


def check_config(meta: dict[str, Any], cfg: RunConfig, where: str | Path = "checkpoint") -> None:
    """Refuse to resume ``meta``'s run with ``cfg`` when a non-resumable key differs or ``rounds`` is
    below the checkpoint's round; the message names every differing key with both values.
    """
    saved = dict(meta.get("config", {}))
    if "strategy" not in saved:
        raise CheckpointError(f"{where}: its configuration names no strategy; it is not a checkpoint of this run")
    mine = fingerprint(cfg)
    diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k)
                  and not (k not in saved and k in ADDED_KEYS and mine.get(k) == ADDED_KEYS[k]))
    if diff:
        shown = ", ".join(f"{k}: {saved.get(k)!r} (checkpoint) != {mine.get(k)!r}" for k in diff[:8])
        raise CheckpointError(f"{where}: cannot resume with another configuration ({shown}"
                              f"{' ...' if len(diff) > 8 else ''}); only {', '.join(RESUMABLE_KEYS)} may change")
    if cfg.rounds < int(meta["round"]):
        raise CheckpointError(f"{where}: rounds = {cfg.rounds} is below the checkpoint's round {meta['round']}; "
                              f"a resume continues with rounds >= {meta['round']}")


@dataclass
class ServerCheckpoint:
    """A loaded checkpoint: the run continues at round ``round + 1``."""

    round: int
    core: ServerCore[Any]
    rng: random.Random
    active: list[int]
    rows: dict[int, dict[str, Any]]
    extra: dict[str, Any]
    meta: dict[str, Any]


def load(directory: str | Path, cfg: RunConfig) -> ServerCheckpoint:
    """Read the checkpoint in ``directory`` for a resume with ``cfg`` (config checked before unpickling).

    Raises
    ------
    CheckpointError
        Missing or inconsistent files, or a configuration it cannot resume with.
    """
    d = Path(directory)
    meta = read_meta(d)
    check_config(meta, cfg, d / META)
    path = d / str(meta["pickle"])
    if not path.is_file():
        raise CheckpointError(f"{d / META}: its state file {path.name} is missing")
    if _sha256(path) != meta["sha256"]:
        raise CheckpointError(f"{d / META}: {path.name} does not match the checksum in the json (partial write?)")
    with path.open("rb") as fh:
        state = pickle.load(fh)  # our own file, checksummed; see the trust note
    rng = random.Random()
    rng.setstate(state["rng"])
    return ServerCheckpoint(round=int(meta["round"]), core=state["core"], rng=rng, active=list(meta["active"]),
                            rows=state["rows"], extra=dict(state["extra"]), meta=meta)


def previous_outcome(out_dir: Path | None) -> dict[str, Any]:
    """How the interrupted run ended, from its ``run.json`` (``status``, ``error``), before a resume rewrites it."""
    if out_dir is None:
        return {}
    try:
        doc = json.loads((Path(out_dir) / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: doc.get(k) for k in ("status", "error") if doc.get(k) is not None}


def resume_hint(out_dir: str | Path) -> str:
    """``"nothing written before is lost: `graphfl run --resume OUT` continues from the checkpoint of round R"``,
    or ``""`` when ``out_dir`` holds no readable checkpoint.
    """
    try:
        at = read_meta(checkpoint_dir(out_dir))["round"]
    except (CheckpointError, KeyError):
        return ""
    return f"nothing written before is lost: `graphfl run --resume {out_dir}` continues from the checkpoint of round {at}"
