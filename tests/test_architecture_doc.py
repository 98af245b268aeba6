"""docs/architecture.md matches the tree: every module path it names exists, every package is in its diagram."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "architecture.md").read_text()
TOP_LEVEL = ("common", "flowerx", "tasks", "strategies", "client", "server", "p2p", "flower", "deploy", "bench",
             "dashboard")


def _named_paths() -> list[str]:
    """Back-quoted paths like `server/rounds.py` or `p2p/algorithms/` under a top-level package."""
    out = []
    for token in re.findall(r"`([^`\s]+)`", DOC):
        head = token.split("/")[0]
        if "/" in token and head in TOP_LEVEL and not token.startswith(("http", "<")):
            out.append(token.split(":")[0].rstrip(","))
    return sorted(set(out))


def test_every_named_module_exists() -> None:
    named = _named_paths()
    assert len(named) > 30, f"the parser found too few module paths in docs/architecture.md: {named}"
    missing = [p for p in named if not (REPO / p).exists()]
    assert not missing, f"docs/architecture.md names paths that are not in the tree: {missing}"


def test_every_package_is_in_the_diagram() -> None:
    diagram = DOC[DOC.index("```\n rank 7"):]
    diagram = diagram[:diagram.index("```", 4)]
    packages = sorted(d.name for d in REPO.iterdir()
                      if d.is_dir() and (d / "__init__.py").exists() and d.name != "tests")
    absent = [p for p in packages if f"{p}/" not in diagram]
    assert not absent, f"packages missing from docs/architecture.md's layer diagram: {absent}"
    assert set(packages) <= set(TOP_LEVEL), f"a new package: add it to TOP_LEVEL and the diagram: {packages}"
