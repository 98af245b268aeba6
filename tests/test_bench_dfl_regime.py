"""Benchmark dfl-regime: the plan, the verdict rule, and what the maths guarantees about the fixed points."""

from __future__ import annotations

import json

import numpy as np
import pytest

from graphfl.bench import dfl_regime as d
from graphfl.cli import BENCHMARKS


def test_plan_covers_every_cell_once() -> None:
    plan = d.cells(d.FULL)
    keys = {(c["T"], c["het"], c["topology"], c["rule"], c["batch"]) for c in plan}
    assert len(plan) == len(keys) == (len(d.FULL.budgets) * len(d.HET_LEVELS) * len(d.TOPOLOGIES) * len(d.RULES)
                                      * len(d.BATCHES))
    assert {c["topology"] for c in plan} == {"ring5", "ring20", "complete20"}
    assert {c["rule"] for c in plan} == {"constant", "inv-sqrt"} and 0.0 in {c["het"] for c in plan}
    assert BENCHMARKS["dfl-regime"] == "graphfl.bench.dfl_regime"


def test_spectral_factor_orders_the_graphs() -> None:
    f = {t: d.spectral_factor(t) for t in d.TOPOLOGIES}
    assert f["complete20"] < f["ring5"] < f["ring20"]
    assert f["ring20"] > 20  # slowly mixing: 1/(1 − λ₂) about 31 for the Metropolis 20-ring


def test_verdict_rule() -> None:
    sgd = [1.0, 2.0, 3.0]
    assert d.cell_verdict([0.9, 1.9, 2.9], sgd) == "GT wins"
    assert d.cell_verdict([1.1, 2.1, 3.1], sgd) == "GT loses"
    assert d.cell_verdict([0.9, 2.1, 2.9], sgd) == "tie"            # sign changes across seeds
    assert d.cell_verdict([1.0 - 1e-6] * 3, [1.0] * 3) == "tie"     # inside the tie band


def test_full_batch_is_deterministic() -> None:
    o = d.make_oracles(0, 5, 1.0, "full", "test")[0]
    assert np.array_equal(o.sample(), np.arange(d.TRAIN_ROWS))
    v = d.make_oracles(0, 5, 1.0, "full", "val")[0]
    assert len(v.sample()) == len(v.y_train) == round(d.TRAIN_ROWS * (1 - d.VAL_FRACTION))


def test_no_heterogeneity_both_reach_the_same_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """h = 0 and no noise: every node's gradient vanishes at w*, the fixed point of both methods."""
    monkeypatch.setattr(d, "NOISE", 0.0)
    runs = {m: d.run_one(m, "ring5", 0.0, "constant", "full", 0.02, 0, "test", 2000, 5) for m in d.SHARED}
    for m, r in runs.items():
        assert "diverged" not in r, m
        assert r["final"]["dist_opt"] < 1e-6 and r["final"]["consensus"] < 1e-10, (m, r["final"])
    assert runs["dfl-sgd"]["final"]["global"] == pytest.approx(runs["dfl-gt"]["final"]["global"], rel=1e-6, abs=1e-10)


def test_constant_step_heterogeneity_gt_exact_sgd_biased() -> None:
    """Strong heterogeneity, different Hessians, constant step, full batch: DFL-GT's θ̄ reaches the
    minimiser of F; DFL-SGD's fixed point leaves θ̄ off it (Σ_i H_i(θ_i − θ̄) ≠ 0)."""
    gt = d.run_one("dfl-gt", "ring20", 8.0, "constant", "full", 0.02, 0, "test", 1500, 5)["final"]
    sgd = d.run_one("dfl-sgd", "ring20", 8.0, "constant", "full", 0.02, 0, "test", 1500, 5)["final"]
    assert gt["dist_opt"] < 1e-5 and abs(gt["excess"]) < 1e-8, gt
    assert sgd["excess"] > 1e-4 and sgd["dist_opt"] > 100 * gt["dist_opt"], sgd
    assert sgd["consensus"] > 1e3 * max(gt["consensus"], 1e-12)


def test_run_writes_the_report(tmp_path) -> None:  # type: ignore[no-untyped-def]
    form = d.Form(budgets=(40,), seeds=2, eval_points=4, het_levels=(0.0, 8.0), topologies=("ring5",))
    doc = d.run(out=tmp_path, form=form)
    assert len(doc["cells"]) == 8
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"dfl_regime.{ext}").stat().st_size > 0
    saved = json.loads((tmp_path / "dfl_regime.json").read_text())
    for row in saved["cells"]:
        assert row["verdict"] in {"GT wins", "GT loses", "tie", "not run"}
        shared = row["tuning"]["shared"]["chosen"]
        assert row["results"]["dfl-sgd"]["alpha0"] == row["results"]["dfl-gt"]["alpha0"] == shared
        assert shared is None or shared in d.GRID
    assert "GT wins" in (tmp_path / "dfl_regime.md").read_text()
    fixed = saved["fixed_step"]
    assert fixed and all(r["alpha0"] in d.GRID and r["cell"]["rule"] == "constant" for r in fixed)
    assert (tmp_path / "cache").is_dir()  # a second run reads the cells from here
    again = d.run(out=tmp_path, form=form)
    assert again["cells"][0]["gt_minus_sgd"] == doc["cells"][0]["gt_minus_sgd"]
