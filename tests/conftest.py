"""Shared test set-up: data and cache locations, free ports, leak checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
if "GRAPHFL_DATA" not in os.environ and SHARED_DATA.is_dir():
    os.environ["GRAPHFL_DATA"] = str(SHARED_DATA)


@pytest.fixture(scope="session", autouse=True)
def _graphfl_cache(tmp_path_factory):
    """Decoded-dataset cache private to this test session (inherited by child processes)."""
    if "GRAPHFL_CACHE" not in os.environ:
        os.environ["GRAPHFL_CACHE"] = str(tmp_path_factory.mktemp("graphfl-cache"))
    yield


@pytest.fixture
def data_dir() -> Path:
    path = Path(os.environ.get("GRAPHFL_DATA", SHARED_DATA))
    if not (path / "mnist").is_dir():
        pytest.fail(f"test data not found at {path}: set GRAPHFL_DATA to the shared/data folder")
    return path
