"""Benchmark verdicts see every seed: a diverged seed of the method claimed better is a loss, a diverged
seed of the other or a missing seed makes the claim not testable (B2 multicenter, dfl-regime, B4 ADMM);
B2's cell claims between processes are atomic, check the holder's identity and wait a bounded time;
a resumed B2 cell's partial wall time stays out of the time mean. Synthetic inputs, no runs."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from graphfl.bench import admm_verdicts as av
from graphfl.bench import dfl_regime as dr
from graphfl.bench import multicenter as mc
from graphfl.bench.runcache import RunCache
from graphfl.bench.stats import first_better_on_every_seed, paired_difference

NAN = float("nan")


# --- the shared rule ------------------------------------------------------------------------------


def test_paired_difference_reports_missing_and_non_finite_seeds() -> None:
    d = paired_difference([1.0, NAN, 1.0], [2.0, 2.0, 2.0], expected=3)
    assert d["seeds"] == 2 and d["first_better"] == 2
    assert d["first_nonfinite"] == [1] and d["second_nonfinite"] == [] and d["missing"] == 0
    assert first_better_on_every_seed(d) is False  # the method claimed better diverged on seed 1
    other = paired_difference([1.0, 1.0, 1.0], [2.0, math.inf, 2.0], expected=3)
    assert first_better_on_every_seed(other) is None
    short = paired_difference([1.0, 1.0], [2.0, 2.0], expected=3)
    assert short["missing"] == 1 and first_better_on_every_seed(short) is None
    assert first_better_on_every_seed(paired_difference([1.0] * 3, [2.0] * 3, expected=3)) is True
    with pytest.raises(ValueError, match="expected"):
        paired_difference([1.0] * 4, [2.0] * 4, expected=3)


# --- B2 multicenter: claims -----------------------------------------------------------------------


def _method(per_seed: list[float | None]) -> dict[str, Any]:
    vals = [v for v in per_seed if v is not None]
    return {"final": {"test_loss": sum(vals) / len(vals), "test_loss_sd": None, "per_seed": per_seed}}


def _block(methods: dict[str, list[float | None]], pairs: tuple[tuple[str, str], ...],
           expected: int | None = None) -> dict[str, Any]:
    mm = {m: _method(v) for m, v in methods.items()}
    table = mc.paired_table(mm, pairs) if expected is None else mc.paired_table(mm, pairs, expected)
    return {"methods": mm, "paired": table}


def _doc(results: dict[str, Any], testgraph: dict[str, Any], test_gens: list[str]) -> dict[str, Any]:
    return {"results": results, "testgraph": testgraph, "config": {"form": {}, "testgraph_generators": test_gens}}


def test_a_diverged_bigfl_seed_is_not_reproduced() -> None:
    block = _block({"bigfl": [0.5, None, 0.5], "fesem": [1.0, 1.0, 1.0]}, (("bigfl", "fesem"),))
    v = mc.claim_verdicts(_doc({"smooth": block}, {}, []))
    assert v["bigfl-beats-fesem"]["verdict"] == "not reproduced"


def test_a_diverged_baseline_seed_or_a_missing_seed_is_not_testable() -> None:
    block = _block({"bigfl": [0.5, 0.5, 0.5], "fesem": [1.0, None, 1.0]}, (("bigfl", "fesem"),))
    v = mc.claim_verdicts(_doc({"smooth": block}, {}, []))["bigfl-beats-fesem"]
    assert v["verdict"] == "not testable" and "non-finite" in v["reason"]
    short = _block({"bigfl": [0.5, 0.5], "fesem": [1.0, 1.0]}, (("bigfl", "fesem"),), expected=3)
    v = mc.claim_verdicts(_doc({"smooth": short}, {}, []))["bigfl-beats-fesem"]
    assert v["verdict"] == "not testable" and "1 of 3 seeds missing" in v["reason"]


def test_transfer_claim_is_not_testable_while_a_generator_is_unfinished() -> None:
    pair = (("bigfl", "bigfl (phi = I)"),)
    done = _block({"bigfl": [0.5, 0.5, 0.5], "bigfl (phi = I)": [1.0, 1.0, 1.0]}, pair)
    unfinished = _block({"fedavg": [1.0, 1.0, 1.0]}, pair)  # BiG-FL's cells not finished: no pair
    doc = _doc({}, {"mixture": unfinished, "smooth": done}, ["mixture", "smooth"])
    v = mc.claim_verdicts(doc)["bigfl-transfers"]
    assert v["verdict"] == "not testable" and "mixture" in v["reason"]
    doc = _doc({}, {"smooth": done}, ["mixture", "smooth"])  # a whole test-graph block absent
    assert mc.claim_verdicts(doc)["bigfl-transfers"]["verdict"] == "not testable"
    doc = _doc({}, {"smooth": done}, ["smooth"])
    assert mc.claim_verdicts(doc)["bigfl-transfers"]["verdict"] == "reproduced"
    lost = _block({"bigfl": [0.5, None, 0.5], "bigfl (phi = I)": [1.0, 1.0, 1.0]}, pair)
    doc = _doc({}, {"mixture": unfinished, "smooth": lost}, ["mixture", "smooth"])
    assert mc.claim_verdicts(doc)["bigfl-transfers"]["verdict"] == "not reproduced"


# --- dfl-regime ----------------------------------------------------------------------------------


def test_cell_verdict_counts_a_diverged_gt_seed_as_a_loss() -> None:
    assert dr.cell_verdict([1.0, NAN, 1.0], [2.0, 2.0, 2.0], 3) == "GT loses"
    assert dr.cell_verdict([1.0, None, 1.0], [2.0, 2.0, 2.0], 3) == "GT loses"
    assert dr.cell_verdict([1.0, 1.0, 1.0], [2.0, NAN, 2.0], 3) == "not testable"
    assert dr.cell_verdict([1.0, 1.0], [2.0, 2.0], 3) == "not testable"
    assert dr.cell_verdict([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], 3) == "GT wins"
    assert dr.cell_verdict([None] * 3, [None] * 3, 3) == "not run"


def test_run_cell_keeps_seeds_aligned_when_gt_diverges_on_one() -> None:
    """DFL-GT diverges on test seed 0 only: the cell is a loss for GT, not a win over misaligned seeds."""
    def go(method: str, cell: dict[str, Any], alpha0: float, seed: int, split: str) -> dict[str, Any]:
        if method == "dfl-gt" and split == "test" and seed == 0:
            return {"diverged": "synthetic"}
        base = {"dfl-gt": 1.0, "dfl-sgd": 2.0}.get(method, 3.0) + 0.5 * seed + alpha0
        return {"final": {k: base for k in ("global", "global_over_run", "own", "excess", "population",
                                             "dist_opt", "consensus")}}

    out = dr.run_cell(go, {"T": 10, "het": 1.0, "topology": "ring", "rule": "constant", "batch": "full"}, [0, 1, 2])
    assert out["verdict"] == "GT loses"
    assert out["gt_minus_sgd"]["global"]["first_nonfinite"] == [0]
    assert out["gt_minus_sgd"]["global"]["per_seed"] == pytest.approx([-1.0, -1.0], rel=1e-9)


# --- B4 ADMM -------------------------------------------------------------------------------------


def test_admm_paired_refuses_unmatched_or_non_finite_seeds() -> None:
    row = {"seeds": [0, 1, 2], "a": {"per_seed": [1.0, 1.0, 1.0]}, "b": {"per_seed": [2.0, 2.0]}}
    with pytest.raises(ValueError, match="seeds"):
        av.paired(row, "a", "b")
    row = {"seeds": [0, 1, 2], "a": {"per_seed": [1.0, NAN, 1.0]}, "b": {"per_seed": [2.0, 2.0, 2.0]}}
    with pytest.raises(ValueError, match="non-finite"):
        av.paired(row, "a", "b")
    row = {"seeds": [0, 1, 2], "a": {"per_seed": [1.0, 1.0, 1.0]}, "b": {"per_seed": [2.0, 2.0, 2.0]}}
    p = av.paired(row, "a", "b")
    assert p["a_better"] == p["seeds"] == 3


# --- B2 claim files and the wall time of a resumed cell -------------------------------------------


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunCache:
    c = RunCache(tmp_path / "cache")
    monkeypatch.setattr(mc, "_cache", c)
    monkeypatch.setattr(mc, "_CACHE_ONLY", False)
    return c


KEY_ARGS = ("bigfl", "synthetic-multicenter-smooth", 50, 200, 0, {"lr": 1.0}, mc.TRAIN)


def _start(pid: int) -> str:
    """Field 22 of ``/proc/<pid>/stat``: the process start time."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2:].split()[19]


def test_a_claim_held_by_a_live_process_is_not_overwritten(cache: RunCache) -> None:
    key = mc._cell_key(*KEY_ARGS)
    path = mc._claim_file(key)
    assert path is not None
    holder = f"{socket.gethostname()} {os.getppid()} {_start(os.getppid())}"
    path.write_text(holder + "\n")
    with mc.claim(key) as held:
        assert not held
        assert path.read_text().strip() == holder
    assert path.read_text().strip() == holder  # the other process's claim stays


def test_a_reused_pid_is_not_a_live_holder(cache: RunCache) -> None:
    key = mc._cell_key(*KEY_ARGS)
    path = mc._claim_file(key)
    assert path is not None
    start = _start(os.getppid())
    path.write_text(f"{socket.gethostname()} {os.getppid()} {int(start) + 1}\n")  # same pid, another start
    assert not mc.claimed(key)
    with mc.claim(key) as held:  # taken over
        assert held and path.read_text().split()[1] == str(os.getpid())
    assert not path.exists()


def test_waiting_for_a_claimed_cell_is_bounded(cache: RunCache) -> None:
    key = mc._cell_key(*KEY_ARGS)
    path = mc._claim_file(key)
    assert path is not None
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path.write_text(f"{socket.gethostname()} {proc.pid} {_start(proc.pid)}\n")
        assert mc.claimed(key)
        with pytest.raises(TimeoutError, match=rf"bigfl .* seed 0 .*{proc.pid}"):
            mc.wait_for_claim(key, poll=0.01, limit=0.1)
    finally:
        proc.kill()
        proc.wait()
    assert mc.claim_wait_limit("bigfl", 200) >= 200 * mc.SECONDS_PER_ROUND["bigfl"]


def test_a_resumed_cell_stays_out_of_the_wall_time_mean() -> None:
    def run(wall: float, resumed: bool) -> dict[str, Any]:
        return {"curve": [{"round": 0, "test_loss": 1.0}, {"round": 1, "test_loss": 0.5}],
                "aggregate_seconds": [], "wall_seconds": wall, "resumed": resumed}

    final = mc._combine([run(10.0, False), run(1.0, True), run(20.0, False)], "test_loss")["final"]
    assert final["wall_seconds"] == pytest.approx(15.0, rel=1e-9)
    assert final["wall_seconds_resumed_excluded"] == 1
