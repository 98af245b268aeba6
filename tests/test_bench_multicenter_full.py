"""B2's full form: the batched engine, its time estimate, resuming from the run cache, the claims
between processes sharing that cache, the cache-only (partial) report and the per-claim verdicts."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from graphfl.bench import multicenter as mc
from graphfl.bench.runcache import RunCache

TASK = "synthetic-multicenter-smooth"


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunCache:
    c = RunCache(tmp_path / "cache")
    monkeypatch.setattr(mc, "_cache", c)
    monkeypatch.setattr(mc, "_CACHE_ONLY", False)
    return c


def test_cells_ask_for_the_batched_engine() -> None:
    cfg = mc.cell_config("fesem", TASK, 50, 200, 0, {**mc.TRAIN, "train.lr": 1.0, "fesem.k": 3})
    assert mc.ENGINE == "batched" and cfg.engine == "batched"
    assert mc._cell_key("bigfl", TASK, 50, 200, 0, {"lr": 1.0}, mc.TRAIN)["engine"] == "batched"
    assert mc._cell_key("dfl", TASK, 50, 200, 0, {"lr": 1.0}, mc.TRAIN)["engine"] == "p2p-inprocess"


def test_an_interrupted_run_resumes_from_its_cache(cache: RunCache, monkeypatch: pytest.MonkeyPatch) -> None:
    real = mc.run_method
    calls: list[float] = []

    def counted(strategy: str, task: str, nodes: int, rounds: int, seed: int, overrides: dict[str, Any],
                hook: Any = None, work_dir: Path | None = None) -> dict[str, Any]:
        calls.append(overrides["train.lr"])
        if overrides["train.lr"] == 0.3 and len(calls) == 2:
            raise KeyboardInterrupt  # the run is killed inside its second cell
        return real(strategy, task, nodes, rounds, seed, overrides, hook, work_dir)

    monkeypatch.setattr(mc, "run_method", counted)
    first = mc.run_any("fedavg", TASK, 6, 2, 0, {"lr": 1.0}, mc.TRAIN)
    assert first["engine"] == "batched" and first["batched_clients"] > 0
    with pytest.raises(KeyboardInterrupt):
        mc.run_any("fedavg", TASK, 6, 2, 0, {"lr": 0.3}, mc.TRAIN)
    assert cache.folder is not None
    assert not list(cache.folder.glob("*.running")), "an interrupted cell leaves no claim behind"
    assert len(list(cache.folder.glob("*.json"))) == 1, "the interrupted cell stored nothing"
    # the rerun: the finished cell comes from the cache, the interrupted one is computed
    again = mc.run_any("fedavg", TASK, 6, 2, 0, {"lr": 1.0}, mc.TRAIN)
    second = mc.run_any("fedavg", TASK, 6, 2, 0, {"lr": 0.3}, mc.TRAIN)
    assert calls == [1.0, 0.3, 0.3]
    assert again["curve"][-1]["test_loss"] == pytest.approx(first["curve"][-1]["test_loss"], rel=1e-6)
    assert second["curve"][-1]["test_loss"] is not None


def test_cache_only_raises_for_a_missing_cell(cache: RunCache, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mc, "_CACHE_ONLY", True)
    key = mc._cell_key("fedavg", TASK, 6, 2, 0, {"lr": 1.0}, mc.TRAIN)
    path = mc._claim_file(key)
    assert path is not None
    path.write_text(f"{os.getppid()}\n")  # claimed by a live process: a report does not wait for it

    def waits(key: dict[str, Any], poll: float = 0.0) -> None:
        raise AssertionError("a cache-only report waited for a claimed cell")

    monkeypatch.setattr(mc, "wait_for_claim", waits)
    with pytest.raises(mc.MissingCell, match="fedavg seed 0"):
        mc.run_any("fedavg", TASK, 6, 2, 0, {"lr": 1.0}, mc.TRAIN)


def test_a_claimed_cell_waits_only_for_a_live_process(cache: RunCache) -> None:
    key = mc._cell_key("bigfl", TASK, 50, 200, 0, {"lr": 1.0}, mc.TRAIN)
    path = mc._claim_file(key)
    assert path is not None
    path.write_text(f"{os.getppid()}\n")
    assert mc.claimed(key)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    path.write_text(f"{proc.pid}\n")
    assert not mc.claimed(key)
    mc.wait_for_claim(key, poll=0.01)  # a dead claimer: returns at once


def test_the_estimate_and_the_reductions_are_written() -> None:
    full = mc.estimate(mc.FULL)
    assert full["cells"]["bigfl"] > 2 * 3 and full["serial_seconds"] > 0 and "min serial" in full["text"]
    reduced = dataclasses.replace(mc.FULL, generators=("smooth",), tune_generators=("smooth",), testgraph=("smooth",),
                                  digits=False, bigfl_settings={"lr": 1.0, "bigfl.lam": 0.1}, workers=3,
                                  bigfl_settings_source="earlier.json")
    est = mc.estimate(reduced)
    assert est["serial_seconds"] < full["serial_seconds"]
    assert est["seconds_with_workers"] < est["serial_seconds"]
    text = " ".join(mc.reductions(reduced))
    assert "['mixture']" in text and "digits" in text and "earlier.json" in text
    assert mc.reductions(mc.FULL) == []


def _method(per_seed: list[float], **extra: Any) -> dict[str, Any]:
    mean, sd = mc._stats(list(per_seed))
    return {"final": {"test_loss": mean, "test_loss_sd": sd, "per_seed": per_seed, **extra}, "curve": []}


def _doc(bigfl: list[float], phi: list[float]) -> dict[str, Any]:
    mm = {"fedavg": _method([0.30, 0.31, 0.32]), "dfl": _method([0.21, 0.22, 0.23]),
          "fesem": _method([0.10, 0.11, 0.12], ari=0.5), "local": _method([0.15, 0.15, 0.14]),
          "bigfl": _method(bigfl)}
    res = {"methods": mm, "paired": mc.paired_table(mm, mc.TRAIN_PAIRS), "fesem_planted": {},
           "bigfl_phi": {"final_phi_minus_identity": phi, "threshold": mc.PHI_MOVED,
                         "degenerate": [s for s, v in enumerate(phi) if v < mc.PHI_MOVED]}}
    return {"results": {"smooth": res}, "testgraph": {}, "config": {"form": {}}}


def test_verdicts_follow_the_paired_differences() -> None:
    v = mc.claim_verdicts(_doc([0.05, 0.06, 0.07], [0.2, 0.3, 0.2]))
    assert v["fesem-beats-consensus"]["verdict"] == "reproduced"
    assert v["bigfl-beats-fesem"]["verdict"] == "reproduced"
    assert v["bigfl-beats-consensus"]["verdict"] == "reproduced"
    assert v["bigfl-transfers"]["verdict"] == "not testable"
    # BiG-FL worse than FeSEM on one seed: not reproduced, with the evidence and a reason
    v = mc.claim_verdicts(_doc([0.05, 0.06, 0.40], [0.2, 0.3, 0.2]))
    b = v["bigfl-beats-fesem"]
    assert b["verdict"] == "not reproduced" and "first better in 2/3" in " ".join(b["evidence"])
    assert "local-only training" in b["reason"]
    assert v["bigfl-beats-consensus"]["verdict"] == "not reproduced"
    assert v["fesem-beats-consensus"]["verdict"] == "reproduced"


def test_a_bigfl_whose_phi_did_not_move_is_not_a_result() -> None:
    v = mc.claim_verdicts(_doc([0.05, 0.06, 0.07], [0.2, 5e-4, 0.2]))
    assert v["bigfl-beats-fesem"]["verdict"] == "not testable"
    assert "did not act" in v["bigfl-beats-fesem"]["reason"]
    assert v["fesem-beats-consensus"]["verdict"] == "reproduced"


def test_missing_methods_make_a_claim_not_testable() -> None:
    doc = _doc([0.05, 0.06, 0.07], [0.2, 0.3, 0.2])
    res = doc["results"]["smooth"]
    del res["methods"]["bigfl"], res["bigfl_phi"]
    res["paired"] = mc.paired_table(res["methods"], mc.TRAIN_PAIRS)
    v = mc.claim_verdicts(doc)
    assert v["bigfl-beats-fesem"]["verdict"] == "not testable"
    assert v["fesem-beats-consensus"]["verdict"] == "reproduced"
    # one of the two consensus methods missing: the pair that holds is not enough
    del res["methods"]["dfl"]
    res["paired"] = mc.paired_table(res["methods"], mc.TRAIN_PAIRS)
    v = mc.claim_verdicts(doc)
    assert v["fesem-beats-consensus"]["verdict"] == "not testable"
    assert "fesem − dfl" in v["fesem-beats-consensus"]["reason"]
    # a contradiction stands even when a pair is missing
    res["methods"]["fesem"] = _method([0.40, 0.41, 0.42])
    res["paired"] = mc.paired_table(res["methods"], mc.TRAIN_PAIRS)
    assert mc.claim_verdicts(doc)["fesem-beats-consensus"]["verdict"] == "not reproduced"
    lines = "\n".join(mc.verdict_lines(v))
    assert "**bigfl-beats-fesem: not testable**" in lines


_KILLED_CELL = """
import sys
from pathlib import Path
from graphfl.bench import multicenter as mc
from graphfl.bench.runcache import RunCache
mc._cache = RunCache(Path(sys.argv[1]))
mc.run_any("local", "synthetic-multicenter-smooth", 6, int(sys.argv[2]), 0, {"lr": 1.0}, mc.TRAIN)
"""


def test_a_cell_killed_mid_run_continues_after_its_last_round(cache: RunCache, tmp_path: Path) -> None:
    import json
    import signal
    import time

    from graphfl.server import checkpoint

    rounds = 200
    assert cache.folder is not None
    key = mc._cell_key("local", TASK, 6, rounds, 0, {"lr": 1.0}, mc.TRAIN)
    work = cache._path(key).with_suffix(".run")
    meta = checkpoint.checkpoint_dir(work) / checkpoint.META
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_CELL, str(cache.folder), str(rounds)])
    try:
        deadline = time.monotonic() + 240
        done = 0
        while time.monotonic() < deadline and proc.poll() is None:
            if meta.is_file():
                done = int(json.loads(meta.read_text())["round"])
                if done >= 2:
                    break
            time.sleep(0.2)
        assert done >= 2, "the cell wrote no checkpoint within 240 s"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert not cache.has(key)
    resumed = mc.run_any("local", TASK, 6, rounds, 0, {"lr": 1.0}, mc.TRAIN)
    assert resumed["resumed"] is True and not work.exists()
    assert [row["round"] for row in resumed["curve"]] == list(range(rounds + 1))
    whole = mc.run_method("local", TASK, 6, rounds, 0, {**mc.TRAIN, "train.lr": 1.0})
    assert resumed["curve"][-1]["test_loss"] == pytest.approx(whole["curve"][-1]["test_loss"], rel=1e-5)


def test_a_partial_report_shows_an_unfinished_cell_at_its_last_checkpoint(
        cache: RunCache, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    monkeypatch.setattr(mc, "_CACHE_ONLY", True)
    monkeypatch.setattr(mc, "IN_PROGRESS", [])
    key = mc._cell_key("bigfl", TASK, 6, 200, 1, {"lr": 1.0}, mc.TRAIN)
    work = cache._path(key).with_suffix(".run")
    work.mkdir()
    curve = [{"round": 0, "test_loss": 0.3}, {"round": 37, "test_loss": 0.2283, "server": {"phi_minus_identity": 0.237}}]
    (work / f"{mc.NAME}-bigfl.json").write_text(json.dumps({"methods": {"bigfl": {"curve": curve}}}))
    with pytest.raises(mc.MissingCell, match="checkpointed at round 37 of 200"):
        mc.run_any("bigfl", TASK, 6, 200, 1, {"lr": 1.0}, mc.TRAIN)
    assert mc.IN_PROGRESS == [{"method": "bigfl", "task": TASK, "seed": 1, "round": 37, "rounds": 200,
                               "test_loss": 0.2283, "phi_minus_identity": 0.237, "hypergrad_norm": None,
                               "best_test_loss": 0.2283, "best_round": 37, "min_ll_curvature": None}]
    doc = {"in_progress": mc.IN_PROGRESS, "testgraph": {},
           "results": {"smooth": {"task": TASK, "methods": {"fedavg": {"curve": [{"round": 37, "test_loss": 0.2357}]}}}}}
    text = "\n".join(mc.in_progress_lines(doc))
    assert ("| bigfl seed 1 on synthetic-multicenter-smooth | 37 of 200 | 0.2283 (best 0.2283 at round 37) | 0.237 | "
            "– | fedavg 0.2357 |") in text


def test_a_diverging_unfinished_bigfl_is_named_in_its_verdicts() -> None:
    doc = _doc([0.05, 0.06, 0.07], [0.2, 0.3, 0.2])
    res = doc["results"]["smooth"]
    del res["methods"]["bigfl"], res["bigfl_phi"]
    res["paired"] = mc.paired_table(res["methods"], mc.TRAIN_PAIRS)
    doc["in_progress"] = [{"method": "bigfl", "task": TASK, "seed": 0, "round": 66, "rounds": 200, "test_loss": 0.85,
                           "phi_minus_identity": 0.25, "hypergrad_norm": 0.17, "best_test_loss": 0.20,
                           "best_round": 30, "min_ll_curvature": -0.34}]
    v = mc.claim_verdicts(doc)["bigfl-beats-fesem"]
    assert v["verdict"] == "not testable"
    assert "round 66 of 200" in " ".join(v["evidence"]) and "diverging" in v["reason"]
