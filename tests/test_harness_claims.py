"""The harness's cell runner on a shared cache: claim files between processes, cache-only reports,
fixed per-method settings (what bench multicenter's stages use)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from graphfl.bench import claims
from graphfl.bench.harness import Bench, Cell, CellRunner, Metric, MissingCell, run_bench
from graphfl.bench.runcache import RunCache

CALLS: list[str] = []


def _cell(cell: Cell) -> dict[str, Any]:
    CALLS.append(cell.label())
    return {"final": {"loss": float(cell.settings.get("lr", 1.0)) + cell.seed}, "pid": os.getpid()}


def _slow(cell: Cell) -> dict[str, Any]:
    time.sleep(2.0)
    return {"final": {"loss": 1.0}, "pid": os.getpid()}


def _bench(run_cell: Any = _cell, **kw: Any) -> Bench:
    return Bench(name="claims", title="t", points=[{"task": "x"}], seeds=[0, 1], metrics=[Metric("loss")],
                 run_cell=run_cell, **{"methods": ["a", "b"], "claim_wait": lambda c: 60.0, **kw})


def _start(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2:].split()[19]


def test_fixed_settings_reach_the_cells_and_no_claim_is_left(tmp_path: Path) -> None:
    CALLS.clear()
    out = run_bench(_bench(params=lambda p, m: {"lr": 0.5 if m == "a" else 2.0}), tmp_path)
    loss = {r["method"]: r["metrics"]["loss"]["per_seed"] for r in out.results}
    assert loss == {"a": [0.5, 1.5], "b": [2.0, 3.0]}
    assert len(CALLS) == 4 and not list((tmp_path / "cache").glob("*.running"))


def test_cache_only_computes_nothing_and_names_the_missing_cells(tmp_path: Path) -> None:
    CALLS.clear()
    bench = _bench(missing=lambda c: f"{c.method} seed {c.seed} is missing")
    cache = RunCache(tmp_path / "cache")
    CellRunner(bench, cache)(Cell((("task", "x"),), "a", 0))  # one cell is there
    CALLS.clear()
    out = run_bench(bench, tmp_path, cache_only=True)
    assert CALLS == []
    assert [(c.method, c.seed) for c in out.missing] == [("a", 1), ("b", 0), ("b", 1)]
    a = next(r for r in out.results if r["method"] == "a")
    assert a["failed"] == 1 and a["failures"] == ["a seed 1 is missing"]
    with pytest.raises(MissingCell, match="b seed 0 is missing"):
        CellRunner(bench, cache, cache_only=True).require(Cell((("task", "x"),), "b", 0))


def test_a_cell_claimed_by_a_live_process_is_waited_for_at_most_claim_wait(tmp_path: Path) -> None:
    CALLS.clear()
    cache = RunCache(tmp_path / "cache")
    bench = _bench(claim_wait=lambda c: 0.3)
    cell = Cell((("task", "x"),), "a", 0)
    path = claims.claim_file(cache, bench.cell_key(cell))
    assert path is not None
    path.write_text(f"{socket.gethostname()} {os.getppid()} {_start(os.getppid())}\n")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="still claimed"):
        CellRunner(bench, cache)(cell)
    assert time.monotonic() - t0 < 5 and CALLS == []
    path.write_text(f"{socket.gethostname()} {os.getppid()} {int(_start(os.getppid())) + 1}\n")  # a reused pid
    assert CellRunner(bench, cache)(cell)["pid"] == os.getpid()  # the ended holder's claim is taken over
    assert CALLS == ["task=x a seed 0"] and not path.exists()


_OTHER = """
import sys
from pathlib import Path
from graphfl.bench.harness import Cell, CellRunner
from graphfl.bench.runcache import RunCache
sys.path.insert(0, sys.argv[2])
import test_harness_claims as t
CellRunner(t._bench(t._slow), RunCache(Path(sys.argv[1])))(Cell((("task", "x"),), "a", 0))
"""


def test_two_processes_on_one_cache_compute_a_cell_once(tmp_path: Path) -> None:
    CALLS.clear()
    cache = RunCache(tmp_path / "cache")
    bench = _bench()
    cell = Cell((("task", "x"),), "a", 0)
    path = claims.claim_file(cache, bench.cell_key(cell))
    assert path is not None
    proc = subprocess.Popen([sys.executable, "-c", _OTHER, str(cache.folder), str(Path(__file__).parent)])
    try:
        deadline = time.monotonic() + 60
        while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert path.exists(), "the other process never claimed the cell"
        result = CellRunner(bench, cache)(cell)  # waits for the other process's result
    finally:
        proc.wait(timeout=60)
    assert result["pid"] == proc.pid and CALLS == [], "this process computed a cell another process held"
    assert proc.returncode == 0 and not path.exists()


class _Refused(ValueError):
    pass


def _tuned(cell: Cell) -> dict[str, Any]:
    lr = float(cell.settings["lr"])
    if lr > 2:
        raise RuntimeError("diverged")
    if lr == 0.5 and cell.method == "b":
        raise _Refused("refused configuration")
    return {"final": {"loss": (lr - 1.0) ** 2}}


def test_tune_counts_a_failing_setting_but_raises_a_fatal_one_and_cache_only_never_chooses_on_part_of_a_grid(
        tmp_path: Path) -> None:
    from graphfl.bench.harness import Tuning, tune

    tn = Tuning(param="lr", grid=(0.3, 1.0, 3.0), metric="loss")
    bench = _bench(_tuned, tuning=tn, errors=(RuntimeError, ValueError), fatal=(_Refused,), methods=["a"])
    rec = tune(bench, {"task": "x"}, CellRunner(bench, RunCache(tmp_path / "cache")))[("a",)]
    assert rec["chosen"] == 1.0 and rec["scores"]["3"] is None and "diverged" in rec["failed"]["3"]
    refused = _bench(_tuned, tuning=Tuning(param="lr", grid=(0.5, 1.0), metric="loss"),
                     errors=(RuntimeError, ValueError), fatal=(_Refused,), methods=["b"])
    with pytest.raises(_Refused):
        tune(refused, {"task": "x"}, CellRunner(refused, RunCache(None)))
    partial = _bench(_tuned, tuning=Tuning(param="lr", grid=(0.3, 1.0, 0.1), metric="loss"), methods=["a"])
    with pytest.raises(MissingCell, match="not in the cache"):  # 0.1 was never run
        tune(partial, {"task": "x"}, CellRunner(partial, RunCache(tmp_path / "cache"), cache_only=True))


def test_an_empty_recent_claim_is_held_and_an_old_one_taken_over(tmp_path):
    """A claim file seen before its creator wrote its identity (a creator that writes after
    creating) is not taken over while recent; an empty file left long ago is."""
    import os
    import time as _time

    from graphfl.bench import claims
    from graphfl.bench.runcache import RunCache

    cache = RunCache(tmp_path / "cache")
    key = {"cell": "empty"}
    path = claims.claim_file(cache, key)
    assert path is not None
    path.write_text("")
    assert claims._try_claim(path) is False
    assert claims.holder(cache, key) is not None
    old = _time.time() - 2 * claims.UNWRITTEN_GRACE_SECONDS
    os.utime(path, (old, old))
    assert claims.holder(cache, key) is None
    assert claims._try_claim(path) is True
    assert path.read_text().strip() == claims.identity()
    assert not list(path.parent.glob("*.tmp"))


def test_a_claim_is_created_whole(tmp_path):
    """The claim file appears with the identity already in it, and a second claim loses."""
    from graphfl.bench import claims
    from graphfl.bench.runcache import RunCache

    cache = RunCache(tmp_path / "cache")
    key = {"cell": "whole"}
    path = claims.claim_file(cache, key)
    assert path is not None
    assert claims._create_with(path, "someone 1 2\n") is True
    assert path.read_text() == "someone 1 2\n"
    assert claims._create_with(path, "other 3 4\n") is False
    assert path.read_text() == "someone 1 2\n"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
