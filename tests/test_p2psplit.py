"""The p2p layer split by job: packaging of every package folder, the commands after the move."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIP = {"tests", "build", "dist", "runs", "examples"}  # examples/: user projects with their own pyproject


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


# -- the vectorised engine runs each algorithm's own init / outgoing / step -------------------------

def _network(n: int = 6):
    from graphfl.p2p.topology import make_topology

    topo = make_topology("erdos-renyi", n, seed=1, p=0.5)
    return topo.mixing_matrix(), topo.adjacency()


def _same_run(algo_factory, problem: str = "linreg", n: int = 6, iterations: int = 9) -> None:
    """The vectorised engine and the per-node driver give the same iterates, losses and bytes."""
    import numpy as np
    import pytest

    from graphfl.p2p.driver import run_network_inprocess
    from graphfl.p2p.oracles import ProblemSpec, make_oracle
    from graphfl.p2p.vectorised import run_vectorised, supports

    w, adj = _network(n)
    spec = ProblemSpec(problem=problem, num_nodes=n, dim=5, samples=40, batch_size=8)
    ref = run_network_inprocess(algo_factory(), [make_oracle(i, spec) for i in range(n)], w, iterations, adjacency=adj)
    oracles = [make_oracle(i, spec) for i in range(n)]
    algo = algo_factory()
    assert supports(algo, oracles), f"{algo.name} is not run by the vectorised engine"
    states, curve, wire, payload = run_vectorised(algo, oracles, w, iterations)
    assert (wire, payload) == (ref.wire_bytes_per_round, ref.payload_bytes_per_round)
    assert [r["round"] for r in curve] == [r["round"] for r in ref.curve]
    for s, r in zip(states, ref.states, strict=True):
        assert s.t == r.t == iterations
        assert s.theta.dtype == r.theta.dtype
        np.testing.assert_allclose(s.theta, r.theta, rtol=1e-9, atol=1e-12)
        assert (s.tracker is None) == (r.tracker is None)
        if r.tracker is not None:
            np.testing.assert_allclose(s.tracker, r.tracker, rtol=1e-9, atol=1e-12)
        assert sorted(s.aux) == sorted(r.aux)
    for a, b in zip(curve, ref.curve, strict=True):
        for key in ("train_loss", "consensus", "test_loss"):
            if key in b and not np.isnan(b[key]):
                assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12), key


def test_an_algorithm_the_engine_has_never_heard_of_runs_vectorised() -> None:
    """No dispatch on names: a new algorithm whose step is elementwise says so and is vectorised."""
    from dataclasses import replace

    from graphfl.p2p.algorithms.base import PARAMS, THETA
    from graphfl.p2p.algorithms.dfl_sgd import DFLSGD, DFLSGDParams
    from graphfl.p2p.algorithms.steps import axpy

    class HalfStepSGD(DFLSGD):
        """DFL-SGD that moves half-way towards the mixed model before its gradient step."""

        name = "half-step-sgd"

        def step(self, state, combined, oracle, ctx):
            g, loss = oracle.grad(state.theta, oracle.sample())
            base = state.theta if combined is None else 0.5 * (state.theta + combined[PARAMS][THETA])
            return replace(state, t=state.t + 1, theta=axpy(base, self.step_size(state.t), g), loss=loss)

    _same_run(lambda: HalfStepSGD(DFLSGDParams(alpha0=0.02, tau=2)))


def test_every_stackable_algorithm_matches_the_per_node_driver() -> None:
    from graphfl.p2p.algorithms import registry

    stackable = [s.name for s in registry.all_specs() if s.create().stackable]
    assert {"gossip", "dfl-sgd", "dfl-gt"} <= set(stackable)
    for name in stackable:
        _same_run(lambda name=name: registry.create(name, **({} if name == "gossip" else {"alpha0": 0.02})))


def test_dfl_gt_with_the_same_batch_difference_runs_vectorised() -> None:
    from graphfl.p2p.algorithms import registry

    _same_run(lambda: registry.create("dfl-gt", alpha0=0.02, same_batch_difference=True))


def test_the_inprocess_engine_keeps_a_robust_combine(tmp_path) -> None:
    """``combine = "trimmed"`` replaces the algorithm's mixing; the vectorised rows only mix, so
    such a run must give the per-node driver's numbers (it runs there).
    """
    import numpy as np

    from graphfl.deploy.p2p_inprocess import launch_inprocess

    overrides = {"algorithm": "dfl-gt", "rounds": 4, "problem": "linreg", "alpha0": 0.02, "combine": "trimmed",
                 "combine-trim": 1}
    fast = launch_inprocess("complete", 5, overrides, out=tmp_path / "fast")
    slow = launch_inprocess("complete", 5, overrides, out=tmp_path / "slow", vectorise=False)
    assert fast["ok"] and slow["ok"]
    for i in range(5):
        with np.load(tmp_path / "fast" / f"peer-{i}.npz") as a, np.load(tmp_path / "slow" / f"peer-{i}.npz") as b:
            np.testing.assert_allclose(a["theta"], b["theta"], rtol=1e-9, atol=1e-12)
    assert fast["config"]["engine_path"] == "per-node"


# -- no module cycle inside a package --------------------------------------------------------------

def _runtime_imports(path: Path) -> set[str]:
    """Modules ``path`` imports when it runs: every import statement, inside functions included,
    except those under ``if TYPE_CHECKING:`` (never executed).
    """
    import ast

    tree = ast.parse(path.read_text(), str(path))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_common_modules_have_no_import_cycle() -> None:
    """``common/`` is the kernel: its modules import each other without a cycle (config and the
    registry held apart by an import inside a function was one).
    """
    mods = {f"graphfl.common.{p.stem}": p for p in (REPO / "common").glob("*.py") if p.stem != "__init__"}
    edges = {m: sorted(t for t in _runtime_imports(p) if t in mods and t != m) for m, p in mods.items()}
    state: dict[str, int] = {}

    def visit(m: str, trail: list[str]) -> None:
        state[m] = 1
        for nxt in edges[m]:
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join([*trail, m, nxt])}"
            if nxt not in state:
                visit(nxt, [*trail, m])
        state[m] = 2

    for m in sorted(mods):
        if m not in state:
            visit(m, [])


# -- e2e marks --------------------------------------------------------------------------------------

STARTS_PROCESSES = ("PeerProcesses(", "with LocalFederation(", '"-m", "graphfl.p2p", "peer"', "measure_ring(",
                    "measure_flower(")
"""Calls that start peer processes or a Flower deployment (what ``-m e2e`` selects)."""


def _starts_a_federation(text: str) -> bool:
    """A ``LocalFederation`` is started by ``with`` or ``.start()``; one only constructed starts nothing."""
    import re

    return "LocalFederation(" in text and (".start(" in text or ".start_supernode(" in text
                                           or re.search(r"\bwith\s+\w+\s*(:|\bas\b)", text) is not None)


def unmarked_process_tests(src: str) -> list[str]:
    """Test functions of one test module that start real processes (directly, through a helper of
    the module or a fixture of the module) without the ``e2e`` mark.
    """
    import ast

    tree = ast.parse(src)
    module_e2e = "pytestmark = pytest.mark.e2e" in src
    helpers = {n.name: ast.get_source_segment(src, n) or "" for n in tree.body
               if isinstance(n, ast.FunctionDef) and not n.name.startswith("test_")}

    def starts(text: str, seen: frozenset[str] = frozenset()) -> bool:
        if any(s in text for s in STARTS_PROCESSES) or _starts_a_federation(text):
            return True
        return any(name not in seen and f"{name}(" in text and starts(body, seen | {name})
                   for name, body in helpers.items())

    out = []
    scopes = [(n, False) for n in tree.body if isinstance(n, ast.FunctionDef)]
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        marked = any("e2e" in (ast.get_source_segment(src, d) or "") for d in cls.decorator_list)
        scopes += [(n, marked) for n in cls.body if isinstance(n, ast.FunctionDef)]
    for fn, class_marked in scopes:
        if not fn.name.startswith("test_"):
            continue
        marked = module_e2e or class_marked or any("e2e" in (ast.get_source_segment(src, d) or "")
                                                   for d in fn.decorator_list)
        body = ast.get_source_segment(src, fn) or ""
        fixtures = "".join(helpers.get(a.arg, "") + f"{a.arg}(" * (a.arg in helpers) for a in fn.args.args)
        if not marked and starts(body + fixtures):
            out.append(fn.name)
    return out


def test_every_test_that_starts_processes_is_marked_e2e() -> None:
    bad = {p.name: names for p in sorted((REPO / "tests").glob("test_*.py"))
           if (names := unmarked_process_tests(p.read_text()))}
    assert not bad, f"tests that start peer processes or a Flower deployment without @pytest.mark.e2e: {bad}"


def test_the_e2e_check_sees_a_peer_process_behind_a_helper() -> None:
    src = (
        "import subprocess, sys\nimport pytest\n"
        "def _peer(path):\n    return subprocess.Popen([sys.executable, \"-m\", \"graphfl.p2p\", \"peer\", path])\n"
        "def test_a():\n    _peer('x')\n"
        "@pytest.mark.e2e\ndef test_b():\n    _peer('x')\n"
        "def test_c():\n    assert 1\n"
    )
    assert unmarked_process_tests(src) == ["test_a"]


def test_the_e2e_check_tells_a_started_federation_from_a_constructed_one() -> None:
    src = (
        "import pytest\nfrom graphfl.deploy.federation import LocalFederation\n"
        "def test_with(tmp_path):\n    with LocalFederation(tmp_path, 2) as fed:\n        pass\n"
        "def test_started(tmp_path):\n    fed = LocalFederation(tmp_path, 2)\n    fed.start()\n"
        "def test_entered(tmp_path):\n    fed = LocalFederation(tmp_path, 2)\n    with fed:\n        pass\n"
        "def test_constructed(tmp_path):\n    assert LocalFederation(tmp_path, 2).group is not None\n"
    )
    assert unmarked_process_tests(src) == ["test_with", "test_started", "test_entered"]


def test_library_text_names_no_issue_numbers() -> None:
    """Docstrings and comments of the library describe the code; 'issue N' belongs in commit messages."""
    import re

    pattern = re.compile(r"\b[Ii]ssues? #?\d+")
    hits = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
            for pkg in ("p2p", "common", "tasks", "strategies", "client")
            for p in sorted((REPO / pkg).rglob("*.py")) if "proto" not in p.parts
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, "history in library text:\n" + "\n".join(hits)
