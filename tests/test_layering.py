"""The package layers import downwards only (docs/architecture.md "Layers").

Every ``import`` / ``from ... import`` statement of every module is parsed with ``ast``
(including the ones inside functions and ``if TYPE_CHECKING`` blocks); a statement that names
a graphfl package of a higher layer, or a sibling of the same rank, fails the test with the
file and line. The registry's lazy loading of built-in modules by name (``importlib``) is how
plug-ins work and is not an import statement.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# rank of each top-level package (and root module): a module may import ranks strictly below its own
RANKS: dict[str, int] = {
    "common": 0,       # kernel: types, contracts, config, registry, results, graph, certs, ports
    "flowerx": 0,      # the Flower seam: every non-public flwr name (imports only flwr and the standard library)
    "tasks": 1,        # datasets, partitions, models
    "strategies": 2,   # server halves (pure cores) and their hyperparameters
    "client": 3,       # client halves (trainers) and the ClientApp
    "server": 4,       # Flower ServerApp, strategy adapter, round loop, in-process driver
    "p2p": 4,          # gRPC peer runtime, transport, topologies, decentralized algorithms
    "flower": 4,       # Flower-native strategy classes and client mods for a user's own Flower App
    "deploy": 5,       # launching real processes
    "bench": 6,        # paper reproductions and system benchmarks
    "dashboard": 6,    # the read-only live web view of result folders (reads files; imports only itself)
    "cli": 7,          # the command line (root module cli.py)
    "__init__": 0,
}
SAME_RANK_ALLOWED: set[tuple[str, str]] = set()


def _package(path: Path) -> str:
    rel = path.relative_to(REPO)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_packages(tree: ast.AST) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "graphfl":
                names = [f"graphfl.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "graphfl" and len(parts) > 1:
                out.append((node.lineno, parts[1]))
    return out


def _modules() -> list[Path]:
    # not packages: examples/ (user apps) and hidden folders (.venv, .git, local scratch)
    skip = {"tests", "build", "dist", "runs", "examples"}
    return sorted(p for p in REPO.rglob("*.py")
                  if not (set(p.relative_to(REPO).parts) & skip or any(x.startswith(".") for x in p.relative_to(REPO).parts)))


def test_every_package_has_a_rank() -> None:
    unknown = sorted({_package(p) for p in _modules()} - set(RANKS))
    assert not unknown, f"packages without a layer in tests/test_layering.py: {unknown}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_imports_point_down(path: Path) -> None:
    pkg = _package(path)
    rank = RANKS[pkg]
    bad = []
    for lineno, target in _imported_packages(ast.parse(path.read_text(), str(path))):
        if target == pkg or target == "__version__":
            continue
        if target not in RANKS:
            bad.append(f"line {lineno}: graphfl.{target} is not a known package")
        elif RANKS[target] > rank or (RANKS[target] == rank and (pkg, target) not in SAME_RANK_ALLOWED):
            bad.append(f"line {lineno}: {pkg} (layer {rank}) imports {target} (layer {RANKS[target]})")
    assert not bad, f"{path.relative_to(REPO)} imports upwards:\n" + "\n".join(bad)


def test_no_cycles_between_packages() -> None:
    """Follows from the ranks, but checked directly so a rank change cannot hide a cycle."""
    edges: dict[str, set[str]] = {}
    for path in _modules():
        pkg = _package(path)
        for _, target in _imported_packages(ast.parse(path.read_text())):
            if target != pkg and target in RANKS:
                edges.setdefault(pkg, set()).add(target)
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(trail + [node, nxt])}")
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [])


def test_the_checker_sees_imports_inside_functions_and_type_checking_blocks() -> None:
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from graphfl.server.rounds import Reply\n"
        "def f():\n    import graphfl.deploy.run\n    from graphfl import bench\n"
    )
    assert _imported_packages(ast.parse(src)) == [(3, "server"), (5, "deploy"), (6, "bench")]
