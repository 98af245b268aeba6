"""The p2p layer split by job: packaging of every package folder, the commands after the move."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIP = {"tests", "build", "dist", "runs"}


def _package_folders() -> set[str]:
    out = set()
    for init in REPO.rglob("__init__.py"):
        rel = init.parent.relative_to(REPO)
        if set(rel.parts) & SKIP or any(p.startswith(".") for p in rel.parts):
            continue
        out.add(".".join(("graphfl", *rel.parts)))
    return out


def test_every_package_folder_is_listed_in_pyproject() -> None:
    """A folder with an ``__init__.py`` that ``[tool.setuptools] packages`` does not list is left out
    of a wheel (an editable install does not show it).
    """
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    missing = sorted(_package_folders() - listed)
    assert not missing, f"packages missing from pyproject.toml [tool.setuptools] packages: {missing}"


def test_python_m_graphfl_p2p_still_has_both_commands() -> None:
    """``python -m graphfl.p2p`` (p2p layer) reaches the commands, which live in graphfl.deploy."""
    res = subprocess.run([sys.executable, "-m", "graphfl.p2p", "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "peer" in res.stdout and "p2p" in res.stdout
    res = subprocess.run([sys.executable, "-m", "graphfl.p2p", "p2p", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "--engine" in res.stdout
