"""Shared test set-up: data and cache locations, the real-data gate, Flower's quiet defaults.

Real datasets (MNIST, CIFAR-10) are looked up in ``$GRAPHFL_DATA``, else in ``../shared/data``
beside the repository. Tests that need them ask the :func:`real_data` fixture for the files:
when a file is missing the test is skipped with the reason (``-ra`` prints it), and under
``CI=true`` it fails instead, so CI can never pass by skipping them. Every other test makes
its own data (tiny fixtures written under ``tmp_path``), so a fresh clone passes on its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
if "GRAPHFL_DATA" not in os.environ and SHARED_DATA.is_dir():
    os.environ["GRAPHFL_DATA"] = str(SHARED_DATA)


def in_ci() -> bool:
    """``CI`` set to a true value (``true``, ``1``, ``yes``), as CI services and ``.ci/run`` do."""
    return os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}


def real_data_root() -> Path:
    """Where the real datasets are looked up: ``$GRAPHFL_DATA``, else ``../shared/data``."""
    env = os.environ.get("GRAPHFL_DATA")
    return Path(env) if env else SHARED_DATA


def require_real_data(*files: str) -> Path:
    """The real-data root holding every one of ``files`` (paths relative to it).

    Missing files skip the calling test with the reason, or fail it when ``CI=true``.
    """
    root = real_data_root()
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        reason = (f"real dataset file(s) {', '.join(missing)} not found under {root} "
                  "(set GRAPHFL_DATA to a folder in the layout of docs/data.md, e.g. the project's shared/data)")
        if in_ci():
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason)
    return root


@pytest.fixture
def real_data() -> Callable[..., Path]:
    """``real_data("mnist/train-images-idx3-ubyte.gz", ...)`` -> the data root (see module docs)."""
    return require_real_data


@pytest.fixture(scope="session", autouse=True)
def _graphfl_cache(tmp_path_factory):
    """Decoded-dataset cache private to this test session (inherited by child processes)."""
    if "GRAPHFL_CACHE" not in os.environ:
        os.environ["GRAPHFL_CACHE"] = str(tmp_path_factory.mktemp("graphfl-cache"))
    yield
