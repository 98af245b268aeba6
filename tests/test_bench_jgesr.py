"""`graphfl bench jgesr` / `jgesr-cost`: fair protocol and output files (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from graphfl.bench import jgesr as bj
from graphfl.bench import jgesr_cost as bc

TINY = bj.Form(nodes=3, rounds=1, local_steps=1, batch_size=8, seeds=3, noise_levels=(0.2, 0.4),
               missing_rates=(0.0, 0.3), lr_grid=(0.01, 0.1), max_samples=0)


def test_step_is_tuned_on_validation_and_reused_on_test(tmp_path, monkeypatch):
    calls = []

    def fake_run_one(method, task, form, seed, lr, noise, missing):
        calls.append((method, task, seed, lr, noise, missing))
        # validation prefers lr 0.1 for JGESR, 0.01 for the others; test scores depend on the seed
        if task.endswith("+val"):
            good = 0.1 if method.startswith("JGESR") else 0.01
            return {"final": 0.9 if lr == good else 0.5}
        return {"final": 0.6 + 0.01 * seed - 0.1 * missing}

    monkeypatch.setattr(bj, "QUICK", TINY)
    monkeypatch.setattr(bj, "run_one", fake_run_one)
    doc = bj.run(quick=True, seed=0, out=tmp_path, task="digits")
    tuning = [c for c in calls if c[1].endswith("+val")]
    assert {c[1] for c in tuning} == {"digits+val"} and {c[2] for c in tuning} == {0}
    assert all(c[5] == 0.0 and c[4] == TINY.noise_levels[0] for c in tuning)   # tuned at noise 1, no loss
    for method in bj.METHODS:
        lr = doc["tuned"][method]["lr"]
        assert lr == (0.1 if method.startswith("JGESR") else 0.01)
        test_calls = [c for c in calls if c[0] == method and c[1] == "digits"]
        assert {c[3] for c in test_calls} == {lr}                                 # the tuned step on test
        assert {c[2] for c in test_calls} == {0, 1, 2}                            # >= 3 seeds
        stat = doc["table"][method]["noise1"]
        assert stat["mean"] == pytest.approx(0.61) and stat["sd"] == pytest.approx(0.01) and stat["n"] == 3
        assert [p["missing"] for p in doc["missing_sweep"][method]] == [0.0, 0.3]
    assert len(doc["table"]) == 7
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"jgesr.{ext}").is_file()
    md = (tmp_path / "jgesr.md").read_text()
    assert "95.17" in md and "61.00 ± 1.00" in md and "Settings not given by the paper" in md
    assert json.loads((tmp_path / "jgesr.json").read_text())["unspecified"]


def test_unknown_task_is_refused():
    with pytest.raises(ValueError, match="digits"):
        bj.run(quick=True, task="svhn")


def test_cost_point_times_the_real_cores():
    row = bc.time_point("pdca", 6, 64, seed=0, repeats=1)
    assert row["seconds"] > 0 and row["seconds_warm"] > 0 and row["converged"]
    assert row["iterations_warm"] <= row["iterations_cold"]
    masked = bc.time_point("pdca-masked", 6, 64, seed=0, repeats=1)
    assert masked["impute_steps"] >= 2
    assert "iterations_cold" not in bc.time_point("fedavg", 6, 64, seed=0, repeats=1)


def test_a_diverging_step_is_a_failed_setting_not_a_crash(monkeypatch):
    from graphfl.server import inprocess
    from graphfl.server.rounds import RunError

    def boom(cfg):
        raise RunError("round 1, phase 'fit': 0 valid replies of 3 (NaN)")

    monkeypatch.setattr(inprocess, "run_federated_inprocess", boom)
    out = bj.run_one("FedAvg", "digits", TINY, 0, 10.0, 0.2, 0.0)
    assert out["final"] is None and "NaN" in out["error"]
