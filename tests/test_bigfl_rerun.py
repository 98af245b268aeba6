"""bench.multicenter_bigfl: BiG-FL's B2 rows re-run beside an earlier result (runs replaced by
recorded-shape curves; the pairing, tuning choice and report are the code under test)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from graphfl.bench import multicenter_bigfl as mb

EARLIER = Path(__file__).resolve().parents[1] / "docs" / "results" / "multicenter-quick" / "multicenter.json"


def _curve(final: float, rounds: int) -> dict:
    rows = [{"round": 0, "test_loss": 0.4}]
    rows += [{"round": r, "test_loss": final + 0.01 * (rounds - r),
              "server": {"phi_minus_identity": 0.02 * r, "hypergrad_norm": 1.0, "implicit_residual": 1e-7,
                         "ll_min_curvature": 0.05}} for r in range(1, rounds + 1)]
    return {"curve": rows, "aggregate_seconds": [0.1], "wall_seconds": 1.0, "phi": np.eye(2)}


def test_rerun_tunes_on_validation_pairs_per_seed_and_reports(tmp_path, monkeypatch):
    seen = []

    def fake(jobs, workers):
        out = []
        for _, task, rounds, seed, st, phi in jobs:
            seen.append((task, seed, dict(st), phi is not None))
            if st["lr"] == 3.0 and st["bigfl.kappa"] == 0.3:
                out.append(None)  # a diverged cell
                continue
            final = 0.2 + 0.01 * seed + (0.05 if st["bigfl.kappa"] == 0.3 else 0.0)
            out.append(_curve(final, rounds))
        return out

    monkeypatch.setattr(mb, "_run_all", fake)
    doc = mb.rerun(EARLIER, tmp_path, mb.RerunForm(generators=("smooth",), lambdas=(0.1, 1.0), kappas=(0.3, 0.03)),
                   tmp_path / "c")
    prev = json.loads(EARLIER.read_text())
    # tuning only on the validation task, first seed
    tuned = [s for s in seen if s[0].endswith("+val")]
    assert tuned and all(s[1] == prev["config"]["tuning_seed"] for s in tuned)
    assert all(not s[0].endswith("+val") for s in seen[len(tuned):])
    assert doc["tuning"]["step_kappa_grid"]["lr=3, kappa=0.3"]["val_mse"] is None
    assert doc["tuning"]["settings"]["bigfl.kappa"] == 0.03 and doc["tuning"]["settings"]["bigfl.ridge"] == "proximal"
    # paired per seed against the earlier rows: new − earlier
    res = doc["results"]["smooth"]
    new = res["bigfl"]["final"]["per_seed"]
    old = prev["results"]["smooth"]["methods"]["fesem"]["final"]["per_seed"]
    assert res["paired"]["bigfl_minus_fesem"]["per_seed"] == pytest.approx([a - b for a, b in zip(new, old)])
    zero = prev["results"]["smooth"]["constant_predictors"]["zero"]["per_seed"]
    assert res["paired"]["bigfl_minus_constant_zero"]["per_seed"] == pytest.approx([a - b for a, b in zip(new, zero)])
    # the test graph starts from the learned φ (and the φ = I control does not)
    tg = [s for s in seen if s[0].endswith("-testgraph")]
    assert sorted(s[3] for s in tg) == [False] * 3 + [True] * 3
    assert all(s[2]["bigfl.alpha"] == 0.0 for s in tg)
    text = (tmp_path / "multicenter-bigfl.md").read_text()
    assert "bigfl_minus_fesem" in text and "lr=3, kappa=0.3 | –" in text


def test_rerun_refuses_lambda_zero_before_the_lambda_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(mb, "_run_all", lambda jobs, workers: [_curve(0.2, j[2]) for j in jobs])
    with pytest.raises(ValueError, match="BiG-FL disabled"):
        mb.rerun(EARLIER, tmp_path, mb.RerunForm(generators=("smooth",), lambdas=(0.0, 0.1)), tmp_path / "c")


def test_b2_tunes_bigfl_step_per_kappa_and_keeps_the_chosen_kappa(monkeypatch):
    """bench.multicenter's BiG-FL tuning: a step search for every κ of the form, the best
    (κ, step) pair on validation, then λ × α at that κ; the chosen κ is in the settings."""
    from graphfl.bench import multicenter as mc

    calls = []

    def fake_run_any(method, task, nodes, rounds, seed, settings, train, params=None, hook=None, hook_key=""):
        calls.append((method, task, dict(settings)))
        kappa = settings.get("bigfl.kappa")
        val = 0.3 if method != "bigfl" else (0.25 if kappa == 0.03 else 0.34) + 0.01 * abs(settings["lr"] - 1.0)
        row = {"round": rounds, "test_loss": val, "server": {"phi_minus_identity": 0.1, "ari": 1.0}}
        return {"curve": [{"round": 0, "test_loss": 0.4}, row], "aggregate_seconds": [], "wall_seconds": 0.0,
                "local_test_loss": val}

    monkeypatch.setattr(mc, "run_any", fake_run_any)
    form = mc.Form(**{**mc.QUICK.__dict__, "bigfl_lambdas": (0.1, 1.0), "bigfl_alphas": (0.02,),
                      "bigfl_kappas": (0.3, 0.03)})
    out = mc.tune_generator("smooth", form, 0)
    assert all(task.endswith("+val") for _, task, _ in calls)
    bigfl = [s for m, _, s in calls if m == "bigfl"]
    assert {s["bigfl.kappa"] for s in bigfl} == {0.3, 0.03}
    assert out["bigfl"]["kappa"] == 0.03 and out["settings"]["bigfl"]["bigfl.kappa"] == 0.03
    assert out["settings"]["bigfl"]["lr"] == 1.0
    # the λ × α grid ran at the chosen κ
    assert all(s["bigfl.kappa"] == 0.03 for s in bigfl if s.get("bigfl.lam") == 1.0)
    assert set(out["bigfl"]["kappa_step_grid_val_mse"]) == {"kappa=0.3", "kappa=0.03"}
