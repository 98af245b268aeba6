"""Bench ``multicenter-regime``, BiG-FL form: its declared cells and grids, the exclusion of an
inadmissible BiG-FL tuning run, the degenerate-φ flag, and the default form left unchanged."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from graphfl.bench import multicenter_regime as mr
from graphfl.bench.harness import Cell


def _cell(method: str, point: dict[str, Any], params: dict[str, Any], split: str = "test", seed: int = 0) -> Cell:
    return Cell(tuple(point.items()), method, seed, tuple(params.items()), split)


def test_bigfl_form_declares_its_points_grids_and_settings() -> None:
    form, spec = mr.FORMS["bigfl"]
    bench = mr.declare(form, 0, spec)
    assert bench.name == mr.BIGFL_NAME
    assert list(bench.methods) == [*mr.METHODS, mr.BIGFL]
    assert [dict(p) for p in bench.points] == [
        {"nodes": 20, "samples": m, "std": s, "rounds": 50} for m in (5, 10, 20, 100) for s in (0.05, 0.15, 0.5)]
    first = [(p["samples"], p["std"]) for p in mr.bigfl_points(form)]
    assert first[:4] == [(5, 0.05), (5, 0.5), (100, 0.05), (100, 0.5)] and len(set(first)) == 12
    assert list(bench.seeds) == [0, 1, 2]
    assert form.lr_grid == mr.FULL.lr_grid and form.fesem_warmups == mr.FULL.fesem_warmups
    assert (spec.steps, spec.lambdas, spec.base_lam, spec.kappa, spec.other_kappas, spec.alpha) == (
        (0.1, 0.3, 1.0, 3.0, 9.0), (0.01, 0.1, 1.0, 10.0), 0.1, 0.3, (0.1,), 0.005)
    assert (mr.BIGFL, "FedAvg") in bench.pair_list() and (mr.BIGFL, "Local") in bench.pair_list()
    assert (mr.BIGFL, "FeSEM") in bench.pair_list()
    point = dict(bench.points[0])
    big = mr.run_values(mr.BIGFL, mr.TASK, form, 1, point, {"lr": 0.3}, spec)
    fedavg = mr.run_values("FedAvg", mr.TASK, form, 1, point, {"lr": 0.3})
    assert big["strategy"] == "bigfl"
    assert (big["bigfl.kappa"], big["bigfl.lam"], big["bigfl.alpha"]) == (0.3, 0.1, 0.005)
    same = ("rounds", "engine", "train.lr", "train.momentum", "train.local-steps", "train.batch-size", "nodes",
            "data.client-samples", "data.cluster-std", "seed")
    assert {k: big[k] for k in same} == {k: fedavg[k] for k in same}  # the same budget as the other methods
    other = mr.run_values(mr.BIGFL, mr.TASK, form, 1, point, {"lr": 0.3, "lam": 1.0, "kappa": 0.1}, spec)
    assert (other["bigfl.lam"], other["bigfl.kappa"]) == (1.0, 0.1)
    assert list(other) == list(big)  # same key layout: a kappa-0.3 cell's key is the step search's
    assert bench.skip is not None
    assert bench.skip(_cell(mr.BIGFL, point, {"lr": 0.3}, "val")) is None
    assert bench.skip(_cell(mr.BIGFL, point, {"lr": 27.0}, "val")) == (
        "step 27 is not in BiG-FL's step grid [0.1, 0.3, 1.0, 3.0, 9.0]")
    assert bench.skip(_cell("FedAvg", point, {"lr": 27.0}, "val")) is None
    assert bench.skip(_cell(mr.BIGFL, point, {"lr": 0.3, "lam": None})) == mr.NO_ADMISSIBLE
    settings = " ".join(mr.bigfl_settings(form, spec))
    assert "alpha = 0.005 FIXED" in settings and "kappa [0.1] each get their best step" in settings
    assert "4-NN graph" in settings


def test_a_bigfl_grid_with_lambda_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="lambda = 0"):
        mr.BigflSpec(lambdas=(0.0, 0.1))
    with pytest.raises(ValueError, match="base_lam"):
        mr.BigflSpec(lambdas=(0.01, 1.0), base_lam=0.1)


def test_default_form_is_unchanged() -> None:
    bench = mr.declare(mr.FULL, 0)
    assert bench.name == mr.NAME and list(bench.methods) == list(mr.METHODS)
    assert mr.BIGFL not in bench.methods and bench.skip is None and bench.seconds is None
    assert len(bench.points) == 4 * 3 * 2 + 6
    cell = _cell("FeSEM", {"nodes": 20, "samples": 5, "std": 0.05, "rounds": 50}, {"lr": 1.0, "warmup": 10})
    assert bench.cell_key(cell) == {
        "bench": "multicenter-regime", "method": "FeSEM", "task": "synthetic-multicenter", "nodes": 20, "seed": 0,
        "data.client-samples": 5, "data.cluster-std": 0.05, "strategy": "fesem", "rounds": 50, "engine": "batched",
        "train.lr": 1.0, "train.momentum": 0.0, "train.local-steps": 10, "train.batch-size": 20, "fesem.k": 3,
        "fesem.warmup-steps": 10}
    # the BiG-FL form's other cells are the default form's (one run cache serves both)
    form, spec = mr.FORMS["bigfl"]
    assert mr.declare(form, 0, spec).cell_key(cell) == bench.cell_key(cell)


def _fake_run(curvature: float, mse: float, phi: float, rounds: int) -> dict[str, Any]:
    rows = [{"round": r, "test_loss": mse,
             "server": {"ll_min_curvature": curvature, "phi_minus_identity": phi, "hypergrad_norm": 0.1,
                        "implicit_converged": 1.0}} for r in range(1, rounds + 1)]
    return {"curve": rows}


def test_inadmissible_validation_run_is_excluded() -> None:
    bad = mr.bigfl_result(_fake_run(-0.5, 0.01, 0.3, 2), validation=True)
    assert bad["excluded"].startswith("excluded: LL not strongly convex at round 1")
    assert mr.bigfl_result(_fake_run(-0.5, 0.01, 0.3, 2), validation=False).get("excluded") is None  # test: flagged
    assert mr.bigfl_result(_fake_run(-0.5, 0.01, 0.3, 2), validation=False)["diag"]["inadmissible"]
    good = mr.bigfl_result(_fake_run(0.2, 0.5, 0.3, 2), validation=True)
    assert "excluded" not in good and good["final"] == pytest.approx(0.5, rel=1e-6)


TINY = mr.Form(rounds=2, seeds=2, samples=(5,), stds=(0.1,), nodes=(6,), lr_grid=(0.3, 1.0), fesem_warmups=(10,))
POINT = {"nodes": 6, "samples": 5, "std": 0.1, "rounds": 2}


def test_tuning_excludes_inadmissible_runs_and_flags_a_phi_that_stays_at_identity(tmp_path, monkeypatch) -> None:
    seen: list[dict[str, Any]] = []

    def fake(values: dict[str, Any]) -> dict[str, Any]:
        seen.append(values)
        # step 1.0: the lowest validation MSE, but its lower level is not strongly convex -> never chosen
        # lambda 1.0: inadmissible too; every admissible run keeps phi at I (degenerate)
        # kappa 0.1: admissible only at step 0.3, and worse there than kappa 0.3
        bad = values["train.lr"] == 1.0 or values["bigfl.lam"] == 1.0
        mse = 0.01 if bad else 0.5 - values["bigfl.lam"] + (0.05 if values["bigfl.kappa"] == 0.1 else 0.0)
        run = _fake_run(-0.5 if bad else 0.2, mse, 0.0, int(values["rounds"]))
        return mr.bigfl_result(run, validation=values["task"] != mr.TASK)

    monkeypatch.setattr(mr, "run_bigfl", fake)
    spec = mr.BigflSpec(steps=(0.3, 1.0), lambdas=(0.01, 0.1, 1.0), base_lam=0.1, other_kappas=(0.1,))
    doc = mr.run(seed=0, out=tmp_path, spec=TINY, bigfl=spec)
    (rec,) = [t for t in doc["tuning"] if t["methods"] == [mr.BIGFL]]
    assert rec["chosen"] == pytest.approx(0.3, rel=1e-9)
    assert "not strongly convex" in rec["failed"]["1"]
    assert rec["refined"]["lam"] == pytest.approx(0.1, rel=1e-9)
    assert rec["refined"]["kappa"] == pytest.approx(0.3, rel=1e-9)
    assert rec["refined"]["per_kappa"]["0.1"]["lr"] == pytest.approx(0.3, rel=1e-9)
    assert rec["refined"]["per_kappa"]["0.1"]["validation_mse"]["1"] is None  # excluded at kappa 0.1 too
    assert rec["refined"]["validation_mse"]["1.0"] is None  # excluded
    tested = [v for v in seen if v["task"] == mr.TASK]
    assert {v["seed"] for v in tested} == {0, 1}
    assert all(v["train.lr"] == 0.3 and v["bigfl.lam"] == 0.1 and v["bigfl.kappa"] == 0.3 for v in tested)
    (diag,) = doc["bigfl_diagnostics"]
    assert diag["degenerate_seeds"] == [0, 1]
    md = (tmp_path / f"{mr.BIGFL_NAME}.md").read_text()
    assert "Diagnostics: did BiG-FL's φ move?" in md and "[0, 1]" in md
    (v,) = doc["verdicts"]
    assert set(v) >= {"BiG-FL vs FedAvg", "BiG-FL vs Local", "BiG-FL vs FeSEM"}
    assert v["BiG-FL vs FeSEM"]["verdict"] in {"BiG-FL wins", "BiG-FL loses", "tie"}
    stat = mr.result(doc, mr.BIGFL, **POINT)["metrics"]["mse"]
    assert stat["mean"] == pytest.approx(0.4, rel=1e-6) and np.isfinite(stat["mean"])
    assert doc["missing_points"] == [] and doc["missing_cells"] == []


def test_no_admissible_setting_runs_no_test_cell(tmp_path, monkeypatch) -> None:
    calls: list[str] = []

    def fake(values: dict[str, Any]) -> dict[str, Any]:
        calls.append(values["task"])
        return mr.bigfl_result(_fake_run(-1.0, 0.01, 0.4, int(values["rounds"])),
                               validation=values["task"] != mr.TASK)

    monkeypatch.setattr(mr, "run_bigfl", fake)
    doc = mr.run(seed=0, out=tmp_path, spec=TINY, bigfl=mr.BigflSpec(steps=(0.3,), lambdas=(0.1,), base_lam=0.1))
    assert calls and all(t != mr.TASK for t in calls)  # only validation runs
    stat = mr.result(doc, mr.BIGFL, **POINT)
    assert stat["metrics"]["mse"].get("mean") is None
    assert mr.NO_ADMISSIBLE in str(stat)


def test_a_missing_cell_makes_the_verdict_not_testable_not_a_loss() -> None:
    key = repr(sorted(POINT.items()))
    runs = {key: {m: [0.5, 0.4, 0.45] for m in ("FedAvg", "Local", "FeSEM", "Const-own", "Const-pooled")}}
    runs[key][mr.BIGFL] = [0.1, None, None]
    doc = {"config": {"points": [POINT]},
           "results": [{"method": m, "point": POINT, "metrics": {"mse": {"mean": 0.4}}} for m in runs[key]]}
    spec, form = mr.BigflSpec(), dataclasses.replace(TINY, seeds=3)
    failed = mr.verdicts(doc, form, runs, spec)[0]
    assert failed["BiG-FL vs FedAvg"]["verdict"] == "BiG-FL loses"  # a failed run is a loss
    gone = mr.verdicts(doc, form, runs, spec, missing={(key, mr.BIGFL, 1), (key, mr.BIGFL, 2)})[0]
    assert gone["BiG-FL vs FedAvg"]["verdict"] == "not testable"  # a cell not computed is not
    assert gone["FeSEM vs FedAvg"]["verdict"] == mr.verdicts(doc, form, runs)[0]["FeSEM vs FedAvg"]["verdict"]


def test_lambda_winning_its_lower_edge_is_searched_beyond_it() -> None:
    form = mr.BIGFL_FORM
    spec = mr.BigflSpec(other_kappas=())
    seen: list[float] = []

    def evaluate(params: dict) -> float | None:  # validation MSE falls with λ down to 1e-3, then rises
        lam = params.get("lam", spec.base_lam)
        seen.append(lam)
        return abs(np.log10(lam) + 3.0) + 0.1

    settings, record = mr.refine_bigfl(form, spec, {"lr": 1.0}, evaluate)
    assert settings["lam"] == 0.001 and record["lam"] == 0.001
    assert record["lambda_extended"] == [0.001, 0.0001] and not record["lambda_at_edge"]
    assert set(record["validation_mse"]) == {"0.0001", "0.001", "0.01", "0.1", "1.0", "10.0"}
    spec_once = mr.BigflSpec(other_kappas=(), lambda_extensions=1)
    _, rec = mr.refine_bigfl(form, spec_once, {"lr": 1.0}, lambda p: p.get("lam", 0.1))  # smaller is better
    assert rec["lam"] == 0.001 and rec["lambda_at_edge"]


def test_best_method_needs_a_result_on_every_seed() -> None:
    key = repr(sorted(POINT.items()))
    runs = {key: {m: [0.5, 0.4, 0.45] for m in ("FedAvg", "Local", "FeSEM", "Const-own", "Const-pooled")}}
    runs[key]["Local"] = [0.3, 0.32, 0.31]
    runs[key][mr.BIGFL] = [0.1, 0.12, 0.11]
    means = {m: float(np.mean(v)) for m, v in runs[key].items()}
    doc = {"config": {"points": [POINT]},
           "results": [{"method": m, "point": POINT, "metrics": {"mse": {"mean": means[m]}}} for m in runs[key]]}
    spec, form = mr.BigflSpec(), dataclasses.replace(TINY, seeds=3)
    assert mr.verdicts(doc, form, runs, spec)[0]["best"] == mr.BIGFL
    # the same mean over two seeds (one missing from a cache-only render, or one failed) is not compared
    missing = mr.verdicts(doc, form, runs, spec, missing={(key, mr.BIGFL, 2)})[0]
    assert missing["best"] == "Local"
    runs[key][mr.BIGFL][2] = None
    assert mr.verdicts(doc, form, runs, spec)[0]["best"] == "Local"


def test_kappa_at_its_grid_edge_is_searched_beyond_it_at_the_chosen_lambda() -> None:
    form = mr.BIGFL_FORM
    spec = mr.BigflSpec()  # κ 0.3 (step search), 0.1; one κ beyond a winning edge
    seen: list[dict] = []

    def evaluate(params: dict) -> float | None:  # smaller κ is better down to 0.0333, step 1 best, λ 0.01 best
        seen.append(dict(params))
        kappa, lr, lam = params["kappa"], params["lr"], params.get("lam", 0.1)
        return kappa + 0.01 * abs(lr - 1.0) + 0.01 * abs(np.log10(lam) + 2.0)

    settings, record = mr.refine_bigfl(form, spec, {"lr": 1.0}, evaluate)
    assert record["kappa_extended"] == [0.0333333] and record["kappa_at_edge"]
    assert settings == {"lr": 1.0, "kappa": 0.0333333, "lam": 0.01} and record["kappa"] == 0.0333333
    beyond = record["per_kappa"]["0.0333333"]
    assert beyond["at_lambda"] == 0.01 and set(beyond["validation_mse"]) == {f"{s:g}" for s in form.lr_grid}
    assert all(p.get("lam") == 0.01 for p in seen if p["kappa"] == 0.0333333)  # run at the chosen λ
    assert record["validation_mse_final"] == pytest.approx(evaluate({"kappa": 0.0333333, "lr": 1.0, "lam": 0.01}))

    def inadmissible_below(params: dict) -> float | None:  # κ 0.0333 loses strong convexity at every step
        return None if params["kappa"] < 0.05 else evaluate(params)

    settings, record = mr.refine_bigfl(form, spec, {"lr": 1.0}, inadmissible_below)
    assert settings == {"lr": 1.0, "kappa": 0.1, "lam": 0.01}
    assert record["kappa_extended"] == [0.0333333] and not record["kappa_at_edge"]
    assert record["per_kappa"]["0.0333333"]["lr"] is None
    # an interior κ needs no extension
    _, record = mr.refine_bigfl(form, mr.BigflSpec(other_kappas=(0.1, 1.0)), {"lr": 1.0},
                                lambda p: abs(p["kappa"] - 0.3) + 0.01 * abs(p["lr"] - 1.0))
    assert record["kappa"] == 0.3 and record["kappa_extended"] == [] and not record["kappa_at_edge"]


def test_kappa_beyond_the_grid_never_raises_the_final_validation_mse() -> None:
    """κ 0.0333 wins at the base λ 0.1 but not at the λ chosen for κ 0.1: the κ pass runs at the
    chosen λ, so it keeps κ 0.1 (a κ chosen at the base λ and its own λ search would end at 0.127
    while κ 0.1 with λ 0.01 reaches 0.090, as seen at m = 100, std 0.05)."""
    table = {(0.1, 0.1): 0.144, (0.1, 0.01): 0.090, (0.1, 0.001): 0.098, (0.1, 1.0): 2.0, (0.1, 10.0): None,
             (0.3, 0.1): 0.227, (0.0333333, 0.1): 0.127, (0.0333333, 0.01): 0.197}

    def evaluate(params: dict) -> float | None:
        if params["lr"] != 1.0:
            return None
        return table.get((params["kappa"], params.get("lam", 0.1)))

    settings, record = mr.refine_bigfl(mr.BIGFL_FORM, mr.BigflSpec(), {"lr": 1.0}, evaluate)
    assert settings == {"lr": 1.0, "kappa": 0.1, "lam": 0.01}
    assert record["validation_mse_final"] == 0.090 and record["kappa_extended"] == [0.0333333]
    assert not record["kappa_at_edge"]


def test_estimate_counts_every_validation_and_test_run_of_a_point() -> None:
    form, spec = mr.BIGFL_FORM, mr.BigflSpec()
    bench = mr.declare(form, 0, spec, only=mr.bigfl_points(form)[:1])
    runs = (len(form.lr_grid) + 1  # step search, one extension
            + (len(spec.other_kappas) + spec.kappa_extensions) * len(form.lr_grid)  # κ, each with its steps
            + len(spec.lambdas) - 1 + spec.lambda_extensions  # λ (the base λ's run is the step search's)
            + form.seeds)  # test runs
    assert mr._estimate(bench, form, spec) == runs * form.rounds * spec.seconds_per_round
