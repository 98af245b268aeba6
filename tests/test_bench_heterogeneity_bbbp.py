"""`graphfl bench heterogeneity --form personal-bbbp`: the personalised form on B8's task (BBBP,
ROC-AUC) is declared as written, and the digits forms' grid points, run-cache keys and settings
are what they were before the bbbp form was added (their caches stay valid)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from graphfl.bench import heterogeneity as bh
from graphfl.bench.harness import Cell
from graphfl.common.config import parse_run_config

PARAMS = ((("lr", 0.3),), (("alpha", 0.25), ("lr", 0.1), ("tau", 10.0)), (("k", 4), ("lr", 1.0)))
"""Tuned settings the digest's keys are built with (a step; mixing + τ; FeSEM's K)."""
DIGITS_DIGESTS = {
    "QUICK": "2239671bf0ba62cd2989dcfda97396531ee688c1d5c4aff3943e2d9ffc0471bd",
    "FULL": "d126f47eb4823aa985fa5af77b617b7478433ed1d965dc5a051de2120e3855ab",
    "PERSONAL": "0b6d6c064c9e0da9fd6ea18de54ae82eae64ef4198f83a811a07d5ba1ef32c97",
}
"""SHA-256 of each digits form's points, seeds, run-cache keys of every (point, method, split,
params), metric names and written settings, taken from the module before the bbbp form existed."""


def form_digest(form: bh.Form) -> str:
    bench = bh.declare(form, seed=0)
    keys = [bench.key(Cell(tuple(sorted(pt.items())), m, 1, p, split))
            for pt in bench.points for m in bench.methods for split in ("val", "test") for p in PARAMS]
    blob = json.dumps({"points": bench.points, "seeds": list(bench.seeds), "keys": keys,
                       "metrics": [m.name for m in bench.metrics], "settings": bh.unspecified(form)},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


@pytest.mark.parametrize("name", sorted(DIGITS_DIGESTS))
def test_digits_forms_points_keys_and_settings_are_unchanged(name):
    form = getattr(bh, name)
    assert form.metric == "acc" and "metric" in bh.unused_fields(form)
    assert form_digest(form) == DIGITS_DIGESTS[name]


def test_the_digest_sees_a_changed_key():
    # the digest test can fail: one more run-config value in a digits form changes it
    changed = dataclasses.replace(bh.QUICK, local_steps=bh.QUICK.local_steps + 1)
    assert form_digest(changed) != DIGITS_DIGESTS["QUICK"]


def test_bbbp_form_is_declared_as_written():
    form = bh.FORMS["personal-bbbp"]
    assert form is bh.PERSONAL_BBBP and bh.FORMS["personal"] is bh.PERSONAL
    bench = bh.declare(form, seed=0)
    assert bench.points == [{"task": "bbbp", "dirichlet": a} for a in (0.2, 0.5, 1.0)]
    assert list(bench.seeds) == [0, 1, 2, 3, 4]
    assert set(bench.methods) == {"FedAvg", "FedAvg-FT", "Local", "APFL", "APFLGate", "FedGATE", "Const-pooled"}
    assert [m.name for m in bench.metrics] == ["auc"] and not bench.metrics[0].lower_is_better
    assert bench.tuning.metric == "auc" and bench.tuning.grid == bh.PERSONAL.lr_grid
    assert bench.tuning.max_extensions == bh.PERSONAL.max_extensions
    # the gate family's own grids are the digits personal form's; τ (multiples of R = 4) above R/2
    assert (form.apfl_alpha, form.apfl_adaptive, form.gate_tau) == (bh.PERSONAL.apfl_alpha, True, bh.PERSONAL.gate_tau)
    assert bh.tau_grid_problem(form) is None
    pairs = set(bench.pair_list())
    for m in ("APFL", "APFLGate"):
        assert {(m, "FedAvg-FT"), (m, "Local"), (m, "FedAvg")} <= pairs
    v = bh.run_values("FedAvg-FT", "bbbp", form, 1, 0.5, {"lr": 0.1})
    assert (v["task"], v["nodes"], v["rounds"], v["train.local-steps"]) == ("bbbp", 16, 5, 4)
    assert v["train.eval-local"] is True and v["data.dirichlet-alpha"] == 0.5
    assert "model: the task's GIN (3 layers x 64)" in bh.unspecified(form)
    assert any("both classes" in line for line in bh.unspecified(form))


def short_tuning_below() -> bool:
    tuning = bh.declare(bh.PERSONAL_BBBP, seed=0).tuning
    assert tuning is not None
    return tuning.below_if_all_fail


def test_bbbp_r20_form_is_the_bbbp_form_at_20_rounds_and_the_papers_skew():
    form = bh.FORMS["personal-bbbp-r20"]
    assert form is bh.PERSONAL_BBBP_R20
    changed = {f.name for f in dataclasses.fields(form) if getattr(form, f.name) != getattr(bh.PERSONAL_BBBP, f.name)}
    assert changed == {"rounds", "dirichlet", "step_below_if_all_fail"}
    assert (form.rounds, form.dirichlet, form.step_below_if_all_fail) == (20, (0.5,), True)
    assert bh.declare(form, seed=0).tuning.below_if_all_fail and not short_tuning_below()
    assert any("or below the smallest step tried while every step failed" in line for line in bh.unspecified(form))
    assert "step_below_if_all_fail" in bh.unused_fields(bh.PERSONAL_BBBP)
    bench, short = bh.declare(form, seed=0), bh.declare(bh.PERSONAL_BBBP, seed=0)
    assert bench.points == [{"task": "bbbp", "dirichlet": 0.5}]
    v = bh.run_values("APFLGate", "bbbp", form, 0, 0.5, {"lr": 0.1, "alpha": 0.25, "tau": 10.0})
    assert (v["rounds"], v["train.local-steps"], v["nodes"]) == (20, 4, 16)
    assert any(line.startswith("20 rounds, 4 local SGD steps") for line in bh.unspecified(form))
    # a 5-round cell of the quick-scale form is never read back as a 20-round one (a constant
    # predictor trains nothing: its cells are shared)
    point = tuple(sorted(bench.points[0].items()))
    trained = [m for m in form.methods if m not in bh.CONSTANTS]
    assert trained and len(trained) == len(form.methods) - 1
    const = Cell(point, "Const-pooled", 0, (), "test")
    assert bench.key(const) == short.key(const)
    for method in trained:
        for split in ("val", "test"):
            cell = Cell(point, method, 0, (("lr", 0.1),), split)
            assert bench.key(cell) != short.key(cell)


def test_bbbp_r20_skews_form_only_widens_the_skews_and_shares_the_r20_cells():
    form = bh.FORMS["personal-bbbp-r20-skews"]
    changed = {f.name for f in dataclasses.fields(form) if getattr(form, f.name) != getattr(bh.PERSONAL_BBBP_R20, f.name)}
    assert changed == {"dirichlet", "methods"} and form.dirichlet == (0.2, 0.5, 1.0)
    assert set(form.methods) - set(bh.PERSONAL_BBBP_R20.methods) == {bh.UNIFORM}
    bench, r20 = bh.declare(form, seed=0), bh.declare(bh.PERSONAL_BBBP_R20, seed=0)
    assert [p["dirichlet"] for p in bench.points] == [0.2, 0.5, 1.0]
    assert bench.tuning.below_if_all_fail
    # the α = 0.5 cells of the methods both forms run are the ones personal-bbbp-r20 computed
    point = tuple(sorted(r20.points[0].items()))
    for method in bh.PERSONAL_BBBP_R20.methods:
        cell = Cell(point, method, 0, (("lr", 0.1),), "val")
        assert bench.key(cell) == r20.key(cell)


def test_fedavg_uniform_is_fedavg_with_uniform_weights_compared_with_the_gate_family():
    form = bh.PERSONAL_BBBP_R20_SKEWS
    uniform = bh.run_values(bh.UNIFORM, "bbbp", form, 1, 0.2, {"lr": 0.1})
    weighted = bh.run_values("FedAvg", "bbbp", form, 1, 0.2, {"lr": 0.1})
    assert uniform.pop("fedavg.weighted") is False and uniform == weighted
    assert parse_run_config(bh.run_values(bh.UNIFORM, "bbbp", form, 1, 0.2, {"lr": 0.1})).params.weighted is False
    pairs = bh.pair_list(form)
    assert {(m, bh.UNIFORM) for m in ("APFL", "APFLGate", "FedGATE")} <= set(pairs)
    assert (bh.UNIFORM, "FedAvg") in pairs and (bh.UNIFORM, "Local") in pairs
    assert not any(bh.UNIFORM in p for p in bh.pair_list(bh.PERSONAL_BBBP_R20))
    assert any(line.startswith("FedAvg-uniform: FedAvg with uniform client weights") for line in bh.unspecified(form))


def test_bbbp_r20x16_form_only_adds_local_steps():
    form = bh.FORMS["personal-bbbp-r20x16"]
    changed = {f.name for f in dataclasses.fields(form) if getattr(form, f.name) != getattr(bh.PERSONAL_BBBP_R20, f.name)}
    assert changed == {"local_steps"} and form.local_steps == 16
    assert bh.tau_grid_problem(form) is None
    v = bh.run_values("FedGATE", "bbbp", form, 0, 0.5, {"lr": 0.1, "tau": 10.0})
    assert (v["rounds"], v["train.local-steps"]) == (20, 16)
    assert any(line.startswith("20 rounds, 16 local SGD steps") for line in bh.unspecified(form))
    assert any("multiple of R = 16 local steps" in line for line in bh.unspecified(form))


def test_unknown_task_or_metric_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown tasks"):
        bh.declare(dataclasses.replace(bh.PERSONAL_BBBP, tasks=("ciao",)), seed=0)
    with pytest.raises(ValueError, match="unknown metric 'mae'"):
        bh.declare(dataclasses.replace(bh.PERSONAL_BBBP, metric="mae"), seed=0)


def test_the_recorder_keeps_the_locally_trained_models_auc():
    # FedAvg-FT on bbbp is scored on local_test_auc (train.eval-local): the curve must record it,
    # the mean over the clients where it is defined (a one-class test split reports nan)
    from graphfl.common.config import parse_run_config
    from graphfl.server.recorder import RunRecorder

    rec = RunRecorder(parse_run_config({"strategy": "fedavg", "task": "digits", "nodes": 3}), "fedavg", None)
    rec.record_eval(1, {0: {"test_auc": 0.6, "local_test_auc": 0.7}, 1: {"test_auc": 0.8, "local_test_auc": 0.9},
                        2: {"test_auc": float("nan"), "local_test_auc": float("nan")}})
    row = rec.row(1)
    assert row["local_test_auc"] == pytest.approx(0.8, rel=1e-9)
    assert len(row["local_test_auc_per_client"]) == 3


def test_a_run_with_roc_auc_on_one_client_is_a_failed_setting():
    # Local at a too large step: 15 of 16 clients' outputs are NaN, the "mean" is one client's AUC
    form = bh.PERSONAL_BBBP
    assert "defined on 1 of 16" in bh.run_failure({"final": 0.74, "diag": {"auc_undefined": 15}}, form)
    assert bh.run_failure({"final": 0.7, "diag": {"auc_undefined": 11}}, form) is None
    assert bh.run_failure({"final": None}, form) == "no final auc"
    # the digits forms score accuracy: the rule does not apply
    assert bh.run_failure({"final": 0.9, "diag": {"auc_undefined": 15}}, bh.PERSONAL) is None
    assert bh.run_failure({"final": None}, bh.PERSONAL) == "no final accuracy"


def test_a_run_with_a_diverged_two_class_client_is_a_failed_setting():
    """One-class clients are left out of the mean; a client with both classes but no finite
    ROC-AUC (non-finite outputs) fails the setting however many others are defined."""
    form = bh.PERSONAL_BBBP
    diverged = {"final": 0.7, "diag": {"auc_undefined": 9, "auc_nonfinite": 3, "clients": 16}}
    assert "no finite ROC-AUC on 3 client(s)" in bh.run_failure(diverged, form)
    assert bh.run_failure({"final": 0.7, "diag": {"auc_undefined": 9, "auc_nonfinite": 0, "clients": 16}},
                          form) is None
    # the count is against the run's own clients
    assert "defined on 1 of 4" in bh.run_failure({"final": 0.7, "diag": {"auc_undefined": 3, "clients": 4}}, form)
