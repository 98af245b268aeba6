"""B4 ``admm``: the ``paper`` form's plan and the verdicts computed from a result (pure, fast)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from typer.testing import CliRunner

from graphfl.bench import admm
from graphfl.bench.admm_verdicts import CLAIMS, verdicts


def test_paper_form_plan_has_the_settings_it_claims():
    plan = admm.make_plan(False, 5, form="paper")
    assert plan.form == "paper" and plan.seeds == (5, 6, 7)
    assert {v for v, _, _ in plan.flip_settings} == {40, 60, 80} == set(admm.PAPER_V)
    for n, flips in admm.PAPER_FLIPS.items():
        for v in admm.PAPER_V:
            assert sorted(f for vv, nn, f in plan.flip_settings if (vv, nn) == (v, n)) == sorted(flips)
    assert {n for _, n, _ in plan.flip_settings} == {50, 100}                        # grid B's n
    assert {0.0, 0.1, 0.5, 0.9} <= set(admm.PAPER_FLIPS[50])                         # both ends of grid B's ϱ
    assert len(plan.flip_settings) == 3 * sum(len(f) for f in admm.PAPER_FLIPS.values())
    # the V panel (grid A at ϱ ∈ {0.1, 0.2}) reuses draws of the ϱ panel: no extra cells
    assert {(v, n, f) for v, n, f in plan.v_settings} <= set(plan.flip_settings)
    assert {v for v, _, _ in plan.v_settings} == {40, 60, 80} and {f for *_, f in plan.v_settings} == {0.1, 0.2}
    assert len(plan.fixed_lambdas) >= 2 and len(plan.lambdas) >= 5 and plan.conv_setting in plan.settings()
    assert plan.cuts and all(isinstance(c, str) for c in plan.cuts)
    # sized for the 2-core machine: the estimate before the start is at most an hour
    assert admm.expected_seconds(plan, admm.SECONDS_PER_STEP_PRIOR) <= 3600
    # between quick and full
    quick, full = admm.make_plan(True, 5), admm.make_plan(False, 5)
    assert len(quick.settings()) < len(plan.settings()) < len(full.settings())
    assert quick.form == "quick" and full.form == "full"
    assert set(admm.UNSPECIFIED) >= {"replications", "lambda_grid", "cv", "n_iter", "edge_selection"}


def test_form_choice_errors_name_the_problem():
    assert admm.resolve_form(True, None) == "quick" and admm.resolve_form(False, None) == "full"
    with pytest.raises(ValueError, match="unknown form 'huge'.*quick, paper, full"):
        admm.resolve_form(False, "huge")
    with pytest.raises(ValueError, match="--quick and --form paper"):
        admm.make_plan(True, 0, form="paper")


def test_cli_refuses_form_for_a_bench_without_one(tmp_path):
    from graphfl.cli import app

    res = CliRunner().invoke(app, ["bench", "dfl", "--form", "paper", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "takes no --form" in res.output


# ---------------------------------------------------------------------------------------------
# verdicts on a synthetic result
# ---------------------------------------------------------------------------------------------

def _entry(errs: list[float], **extra: Any) -> dict[str, Any]:
    mean = sum(errs) / len(errs)
    sd = (sum((e - mean) ** 2 for e in errs) / (len(errs) - 1)) ** 0.5
    return {"error": mean, "error_sd": sd, "per_seed": list(errs), **extra}


def _admm_entry(errs: list[float], lam: float, fixed: dict[float, float], missing: float = 0.0) -> dict[str, Any]:
    return _entry(errs, **{"lambda": [lam] * 3, "edges": 100.0, "false_edges": 0.0, "true_edges_missing": missing,
                  "fixed_lambda": {repr(k): _entry([v] * 3) for k, v in fixed.items()}})


def _tests(true_kept: int, true_tested: int = 100) -> dict[str, Any]:
    one = {"true_tested": true_tested, "true_kept": true_kept, "false_tested": 200, "false_kept": 1}
    return {"hessian": {"es": dict(one), "local-es": dict(one)}}


def synthetic_table() -> dict[tuple[int, int, float], dict[str, Any]]:
    """ES rises with ϱ (0.05 → 0.4), Local 0.7, Local-ES flat 0.05, Oracle 0.05·40/V, FedADMM below Local
    at every ϱ (CV shrinks λ) but above it at fixed λ = 0.1."""
    table = {}
    for v in (40, 80):
        for n in (50, 100):
            for f in (0.0, 0.2, 0.9):
                scale = 40 / v * 50 / n
                es = {0.0: 0.05, 0.2: 0.06, 0.9: 0.4}[f] * scale
                table[(v, n, f)] = {
                    "V": v, "n": n, "flip": f,
                    "local": _entry([0.70, 0.72, 0.68]),
                    "global": _entry([3.0, 3.1, 2.9]),
                    "fedadmm": _admm_entry([0.05 * scale + f * 0.6, 0.06 * scale + f * 0.6, 0.05 * scale + f * 0.6],
                                           1e-4 if f else 0.1, {0.01: 0.5, 0.1: 2.0 if f else 0.05}),
                    "fedadmm-es": _admm_entry([es, es * 1.01, es * 0.99], 1.0, {0.01: 0.3, 0.1: es}, missing=10 * f),
                    "fedadmm-local-es": _admm_entry([0.05 * scale] * 3, 1.0, {0.01: 0.2, 0.1: 0.05 * scale}),
                    "oracle": _admm_entry([0.05 * scale * 0.99, 0.05 * scale, 0.05 * scale * 1.01], 1.0,
                                          {0.01: 0.2, 0.1: 0.05 * scale}),
                    "edge_tests": _tests(98),
                }
    return table


def _conv(fa_first: int, gd_first: int, b10: float, sgd: float) -> dict[str, list[dict[str, Any]]]:
    """Full-batch curves that drop from 1 to 1e-6 at ``*_first``; batch-10 curves: the final point only."""
    def curve(first: int) -> list[dict[str, Any]]:
        return [{"round": r, "dist_to_estimator": 1e-6 if r >= first else 1.0} for r in (1, 100, 200, 300, 600)]
    return {"fedadmm": curve(fa_first), "d-gd": curve(gd_first),
            "fedadmm-b10": [{"round": 600, "dist_to_estimator": b10}],
            "fedadmm-b10-avg": [{"round": 600, "dist_to_estimator": b10 * 2}],
            "d-sgd": [{"round": 600, "dist_to_estimator": sgd}]}


def _run(table: dict[Any, Any], conv: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    flips = [s for s in table]
    v_panel = [s for s in table if s[2] == 0.2]
    return verdicts(table, flips, v_panel, (0.01, 0.1), conv or {})


def test_verdicts_are_computed_from_the_numbers():
    table = synthetic_table()
    out = _run(table, _conv(100, 300, 0.005, 0.004))
    assert set(out) == set(CLAIMS)
    v = {k: x["verdict"] for k, x in out.items()}
    assert v["es-beats-local-at-0.9"] == "reproduced"
    assert v["es-beats-fedadmm-and-local"] == "reproduced"
    assert v["es-flat-in-flip"] == "not reproduced" and "true edges" in out["es-flat-in-flip"]["reason"]
    assert v["local-es-insensitive-to-flip"] == "reproduced"
    assert v["fedadmm-worse-than-local"] == "not reproduced"
    assert "at fixed λ = 0.01, FedADMM's mean error exceeds Local's at 0/8" in out["fedadmm-worse-than-local"]["reason"]
    assert "at fixed λ = 0.1, FedADMM's mean error exceeds Local's at 8/8" in out["fedadmm-worse-than-local"]["reason"]
    assert v["fedadmm-flat-in-V"] == "not reproduced" and v["es-falls-with-V"] == "reproduced"
    assert v["es-approaches-oracle-large-n"] == "not reproduced"          # the ratio is the same at both n
    assert "ϱ=0.9" in out["es-approaches-oracle-large-n"]["reason"]
    assert "ϱ=0 (" not in out["es-approaches-oracle-large-n"]["reason"]   # ES already at Oracle there
    assert v["edge-test-keeps-true-edges"] == "reproduced"
    assert any("98.0 %" in e for e in out["edge-test-keeps-true-edges"]["evidence"])
    assert v["convergence-full-batch"] == "reproduced" and v["convergence-mini-batch"] == "not reproduced"
    # 'much faster': 200 vs 300 iterations is faster, not much faster
    slow = _run(table, _conv(200, 300, 0.003, 0.004))
    assert slow["convergence-full-batch"]["verdict"] == "not reproduced"
    assert slow["convergence-mini-batch"]["verdict"] == "reproduced"
    # paired evidence carries the per-seed differences
    ev = " ".join(out["es-beats-local-at-0.9"]["evidence"])
    assert "per seed" in ev and "better on 3/3" in ev


def test_verdicts_follow_single_seeds_and_missing_settings():
    table = synthetic_table()
    # one seed where ES loses to Local at ϱ = 0.9: the claim is no longer reproduced
    bad = copy.deepcopy(table)
    bad[(80, 100, 0.9)]["fedadmm-es"]["per_seed"][2] = 0.9
    out = _run(bad)
    assert out["es-beats-local-at-0.9"]["verdict"] == "not reproduced"
    assert out["es-beats-fedadmm-and-local"]["verdict"] == "not reproduced"
    assert any("V=80, n=100, ϱ=0.9" in e for e in out["es-beats-fedadmm-and-local"]["evidence"])
    # FedADMM above Local on every seed at ϱ ≥ 0.2: reproduced
    worse = copy.deepcopy(table)
    for s, row in worse.items():
        if s[2] >= 0.2:
            row["fedadmm"]["per_seed"] = [0.8, 0.9, 0.85]
    assert _run(worse)["fedadmm-worse-than-local"]["verdict"] == "reproduced"
    # an edge test that drops true edges
    drops = copy.deepcopy(table)
    drops[(40, 50, 0.0)]["edge_tests"] = _tests(10)
    e = _run(drops)["edge-test-keeps-true-edges"]
    assert e["verdict"] == "not reproduced" and any("es at V=40, n=50, ϱ=0" in x for x in e["evidence"])
    # without ϱ = 0.9, a second n or convergence curves: not testable
    only = {s: r for s, r in table.items() if s[1] == 50 and s[2] < 0.9}
    out = _run(only)
    assert out["es-beats-local-at-0.9"]["verdict"] == "not testable"
    assert out["es-approaches-oracle-large-n"]["verdict"] == "not testable"
    assert out["convergence-full-batch"]["verdict"] == "not testable"
    assert out["es-flat-in-flip"]["verdict"] == "not testable"             # two ϱ values per (V, n)
