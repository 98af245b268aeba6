"""The Flower seam (flowerx/): no non-public Flower name outside it, and one version policy.

Rule checked on every graphfl module outside ``flowerx/`` and ``tests/`` (parsed with ``ast``,
statements inside functions included); a violation fails with ``file:line``:

* an import of a ``flwr`` module that is not in :data:`PUBLIC_FLWR` (Flower's documented API);
* a private attribute (``_name``, or ``__dict__``) read, written or passed to ``getattr`` /
  ``setattr`` / ``hasattr`` / ``delattr`` on anything bound by a ``flwr`` import or annotated
  with a Flower type (``grid: Grid``);
* an assignment to an attribute of a ``flwr`` module (patching or swapping a Flower name);
* ``inspect.getsource`` of a Flower object (a source-text check).

``tests/`` may reach Flower's internals: the seam's own tests check it against the real internals.

The policy half: on a Flower version the seam was not verified on, every fast path switches
itself off with one log line, and a real ``graphfl run`` completes on stock Flower behaviour.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphfl.flowerx import policy

REPO = Path(__file__).resolve().parents[1]

PUBLIC_FLWR: dict[str, str] = {
    "flwr": "the package itself (its __version__)",
    "flwr.app": "Message API: records, Message, Context, Error, MessageType",
    "flwr.serverapp": "ServerApp and Grid",
    "flwr.serverapp.strategy": "Flower's strategies and their Strategy / Result types",
    "flwr.clientapp": "ClientApp",
    "flwr.clientapp.mod": "Flower's built-in ClientApp mods",
    "flwr.clientapp.typing": "ClientAppCallable / Mod, the types a mod is written against (Flower's mods guide)",
    "flwr.simulation": "run_simulation",
    "flwr.common": "the names flwr.common exports (its __all__)",
    "flwr.server": "the legacy server API's exports",
    "flwr.client": "the legacy client API's exports",
}
"""Flower's public modules (documented API), the only ``flwr`` modules graphfl imports outside flowerx/."""

FLOWERX_MAY_IMPORT = {"flwr", "starlette", "httpx", "graphfl"}
"""Beyond the standard library, what flowerx/ imports: Flower, the two Flower dependencies whose
objects the wrapped code hands around (Starlette middleware, httpx errors), and itself."""


def _library_modules() -> list[Path]:
    skip = {"tests", "build", "dist", "runs", "flowerx"}
    return sorted(p for p in REPO.rglob("*.py")
                  if not (set(p.relative_to(REPO).parts) & skip
                          or any(x.startswith(".") for x in p.relative_to(REPO).parts)))


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _private(attr: str) -> bool:
    return attr == "__dict__" or (attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__")))


def seam_violations(source: str, filename: str = "<string>") -> list[str]:
    """``file:line: what`` for each use of a non-public Flower name in ``source`` (see the module docstring)."""
    tree = ast.parse(source, filename)
    flower: set[str] = set()    # names bound to Flower modules or objects
    modules: set[str] = set()   # names bound to Flower modules
    out: list[str] = []

    def bad(node: ast.AST, what: str) -> None:
        out.append(f"{filename}:{getattr(node, 'lineno', 0)}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "flwr":
                    continue
                if alias.name not in PUBLIC_FLWR:
                    bad(node, f"import of non-public Flower module {alias.name}")
                bound = alias.asname or alias.name.split(".")[0]
                flower.add(bound)
                modules.add(bound)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "flwr":
                continue
            if node.module not in PUBLIC_FLWR:
                bad(node, f"import from non-public Flower module {node.module}")
            for alias in node.names:
                if alias.name.startswith("_"):
                    bad(node, f"import of private Flower name {node.module}.{alias.name}")
                bound = alias.asname or alias.name
                flower.add(bound)
                if _is_module(f"{node.module}.{alias.name}"):
                    modules.add(bound)
                    if f"{node.module}.{alias.name}" not in PUBLIC_FLWR:
                        bad(node, f"import of non-public Flower module {node.module}.{alias.name}")
    for node in ast.walk(tree):   # parameters annotated with a Flower type hold Flower objects
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                ann = arg.annotation
                names = ({n.id for n in ast.walk(ann) if isinstance(n, ast.Name)} if ann is not None else set())
                if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
                    names = {part.strip("[] ") for part in ann.value.replace("|", " ").split()}
                if names & (flower - modules):
                    flower.add(arg.arg)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and _root(node.value) in flower:
            bad(node, f"private attribute {node.attr} of a Flower object ({_root(node.value)})")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if (name in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
                    and _root(node.args[0]) in flower and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
                bad(node, f"{name} of private attribute {node.args[1].value} of a Flower object")
            if name == "setattr" and node.args and _root(node.args[0]) in modules:
                bad(node, f"setattr on Flower module {_root(node.args[0])} (patching Flower)")
            if name == "getsource" and node.args and _root(node.args[0]) in flower:
                bad(node, "inspect.getsource of a Flower object (a source-text check)")
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and _root(target) in modules:
                bad(node, f"assignment to {ast.unparse(target)} (patching a Flower module)")
    return sorted(set(out), key=lambda s: (s.split(":")[0], int(s.split(":")[1])))


# ---------------------------------------------------------------------------------------------
# the rule
# ---------------------------------------------------------------------------------------------
def test_no_non_public_flower_name_outside_the_seam() -> None:
    found: list[str] = []
    for path in _library_modules():
        found += seam_violations(path.read_text(), str(path.relative_to(REPO)))
    assert not found, "non-public Flower names outside flowerx/ (move them into the seam):\n" + "\n".join(found)


def test_the_check_finds_each_kind_of_violation() -> None:
    code = (
        "import flwr.superlink.main as m\n"                            # 1 private module
        "from flwr.supercore.retry import RetryInvoker\n"              # 2 private module
        "from flwr.serverapp import Grid\n"
        "from flwr.supernode import start_client_internal as sci\n"    # 4 private module
        "from flwr.app import Message\n"
        "def f(grid: Grid, msg: 'Message | None') -> None:\n"
        "    grid._retry_invoker.x = 1\n"                              # 7 private attribute
        "    getattr(grid, '_retry_invoker', None)\n"                  # 8 getattr of private
        "    msg.metadata.__dict__['_message_id'] = 'x'\n"             # 9 __dict__
        "    grid.pull_messages([])\n"                                 # public: fine
        "    m._get_middleware = None\n"                               # 11 patching + private
        "    sci.time = None\n"                                        # 12 patching
        "    import inspect; inspect.getsource(sci)\n"                 # 13 source check
        "    other._private = 1\n"                                     # not Flower's: fine
    )
    lines = sorted({int(v.split(":")[1]) for v in seam_violations(code)})
    assert lines == [1, 2, 4, 7, 8, 9, 11, 12, 13], seam_violations(code)
    clean = "from flwr.app import Context, Message\nfrom flwr.serverapp import Grid, ServerApp\nimport flwr\n"
    assert seam_violations(clean) == []


def test_the_public_list_names_real_public_modules() -> None:
    for name in PUBLIC_FLWR:
        assert _is_module(name), name
        assert not any(part.startswith("_") for part in name.split(".")), name


def test_flowerx_imports_only_flower_its_http_stack_and_the_standard_library() -> None:
    stdlib = set(sys.stdlib_module_names)
    bad = []
    for path in sorted((REPO / "flowerx").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            for name in names:
                top = name.split(".")[0]
                if top not in stdlib and top not in FLOWERX_MAY_IMPORT:
                    bad.append(f"flowerx/{path.name}:{node.lineno}: {name}")
                if top == "graphfl" and not name.startswith("graphfl.flowerx"):
                    bad.append(f"flowerx/{path.name}:{node.lineno}: {name} (the seam is layer 0)")
    assert not bad, bad


# ---------------------------------------------------------------------------------------------
# the policy
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.delenv(policy.VERSION_ENV, raising=False)
    monkeypatch.delenv(policy.OFF_ENV, raising=False)
    policy.forget()
    yield monkeypatch
    policy.forget()


PROBE = policy.FastPath("probe-path", "a probe", "the stock probe runs")


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "graphfl.flowerx"]


def test_on_where_verified_and_checked(fresh, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="graphfl.flowerx"):
        assert policy.decide(PROBE, lambda: None) is True
    assert policy.installed_flower() in policy.VERIFIED_FLOWER and _lines(caplog) == []
    assert policy.decisions() == {"probe-path": True}


def test_an_unverified_version_switches_off_with_one_line_and_never_runs_the_check(fresh, caplog) -> None:
    fresh.setenv(policy.VERSION_ENV, "1.43.0")
    checked: list[int] = []
    with caplog.at_level(logging.WARNING, logger="graphfl.flowerx"):
        for _ in range(3):
            assert policy.decide(PROBE, lambda: checked.append(1)) is False  # type: ignore[func-returns-value]
    assert checked == []
    assert _lines(caplog) == ["graphfl fast path 'probe-path' (a probe) is off: flwr 1.43.0 is not a version it "
                              "was verified on (1.41.0, 1.42.0); the stock probe runs"]


def test_a_failing_or_raising_check_switches_off_with_its_reason(fresh, caplog) -> None:
    def boom() -> str | None:
        raise ImportError("no module named flwr.moved")

    with caplog.at_level(logging.WARNING, logger="graphfl.flowerx"):
        assert policy.decide(PROBE, lambda: "Flower's loop no longer contains ['time.sleep(3)']") is False
        policy.forget()
        assert policy.decide(PROBE, boom) is False
        policy.forget()
        fresh.setenv(policy.OFF_ENV, "other, probe-path")
        assert policy.decide(PROBE, lambda: None) is False
    lines = _lines(caplog)
    assert len(lines) == 3
    assert "time.sleep(3)" in lines[0] and "ImportError: no module named flwr.moved" in lines[1]
    assert f"switched off by {policy.OFF_ENV}" in lines[2]


def test_a_warm_supernode_on_an_unverified_flower_runs_stock_flower(fresh, caplog) -> None:
    """The SuperNode wrapper in warm mode, fast polls, on a Flower it was not verified on: no executor,
    no ``--isolation process``, Flower's loop untouched, the ready-or-off line for the launcher."""
    import flwr.supernode.cli as flower_cli
    from flwr.supernode import start_client_internal as sci

    from graphfl.deploy import supernode as wrapper

    fresh.setenv(policy.VERSION_ENV, "1.99.0")
    before = {name: getattr(sci, name) for name in ("_pull_and_store_message", "pull_objects", "time")}
    ran: list[list[str]] = []
    fresh.setattr(sys, "argv", list(sys.argv))
    fresh.setattr(flower_cli, "flower_supernode", lambda: ran.append(list(sys.argv)))
    started: list[object] = []
    fresh.setattr(wrapper, "ExecutorChild", lambda *a, **k: started.append(a))
    wrapper_lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: wrapper_lines.append(record.getMessage())  # type: ignore[method-assign]
    wrapper.logger.addHandler(handler)   # the wrapper's logger does not propagate (its own stderr handler)
    try:
        with caplog.at_level(logging.INFO):
            code = wrapper.main(["--clientapp-mode", "warm", "--polls", "fast", "--", "--insecure", "--superlink", "x:9",
                                 "--isolation", "process"])
    finally:
        wrapper.logger.removeHandler(handler)
    assert code == 1   # the stand-in main loop returned: a failure for a supervisor, as with stock Flower
    assert ran == [["flower-supernode", "--insecure", "--superlink", "x:9"]] and started == []
    assert {name: getattr(sci, name) for name in before} == before
    off = {line.split("'")[1] for line in _lines(caplog)}
    assert {"warm-clientapp", "supernode-fast-polls", "object-io-threads", "fleet-handshake-retry"} <= off
    assert any(wrapper.WARM_OFF_LINE in line for line in wrapper_lines), wrapper_lines


@pytest.mark.e2e
def test_graphfl_run_completes_on_stock_flower_behaviour_when_the_version_is_unverified(tmp_path) -> None:
    """A real ``graphfl run`` (TLS SuperLink, 2 warm SuperNodes) told that Flower is 1.99.0: each fast
    path logs that it is off, nothing refuses, and the run completes with every round; run.json
    records the ServerApp's fast paths as off."""
    out = tmp_path / "run"
    env = {**os.environ, policy.VERSION_ENV: "1.99.0"}
    env.pop(policy.OFF_ENV, None)
    exe = Path(sys.executable).with_name("graphfl")
    proc = subprocess.run([str(exe), "run", "--nodes", "2", "--rounds", "2", "--set", "train.local-steps=5",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "run.json").read_text())
    assert doc["status"] == "completed"
    curve = doc["methods"]["fedavg"]["curve"]
    assert [r["round"] for r in curve] == [0, 1, 2]
    # the ServerApp's own fast paths, decided in its process (Flower keeps its log), recorded in run.json
    assert doc["env"]["flower_fast_paths"] == {"grid-handshake-retry": False, "bounded-pull": False,
                                               "object-io-threads": False, "array-fewer-copies": False}
    logs = "\n".join(p.read_text(errors="replace") for p in (out / "logs").glob("*.log"))
    for name in ("superlink-gates", "warm-clientapp", "supernode-fast-polls", "fleet-handshake-retry"):
        assert f"graphfl fast path '{name}'" in logs and "flwr 1.99.0 is not a version" in logs, name
    assert "Traceback" not in logs
    assert "graphfl warm worker ready" not in logs   # no executor ran: stock flwr-clientapp processes
