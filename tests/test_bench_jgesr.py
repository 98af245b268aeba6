"""`graphfl bench jgesr` / `jgesr-cost`: fair protocol and output files (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from graphfl.bench import jgesr as bj
from graphfl.bench import jgesr_cost as bc
from graphfl.bench.report import pair, result

TINY = bj.Form(nodes=3, rounds=1, local_steps=1, batch_size=8, seeds=3, noise_levels=(0.2, 0.4),
               missing_rates=(0.0, 0.3), lr_grid=(0.01, 0.1), max_samples=0, lam_grid=(0.1, 1.0, 10.0),
               alpha_grid=(0.01, 1.0), beta_grid=(0.001, 0.1))
BEST_GRAPH = (10.0, 0.01, 0.1)
"""The (λ, α, β) that the fake validation prefers."""


def _fake(calls):
    def fake_run_one(method, task, form, seed, lr, noise, missing, graph=None):
        calls.append((method, task, seed, lr, noise, missing, graph))
        jgesr = method.startswith("JGESR")
        # validation prefers lr 0.1 and BEST_GRAPH for JGESR, lr 0.01 for the others; test scores
        # depend on the seed
        if task.endswith("+val"):
            good = 0.1 if jgesr else 0.01
            score = 0.9 if lr == good else 0.5
            if jgesr:
                score -= 0.01 * sum(a != b for a, b in zip(graph or bj.GRAPH_DEFAULT, BEST_GRAPH))
            return {"final": score}
        out = {"final": 0.6 + 0.01 * seed - 0.1 * missing}
        if jgesr:
            out.update(shrink_ratio=[0.5, 0.6 + 0.1 * seed], graph_cv=[0.3, 0.4 + seed])
        return out
    return fake_run_one


@pytest.mark.parametrize("search", ["grid", "coordinate"])
def test_step_and_graph_are_tuned_on_validation_and_reused_on_test(tmp_path, monkeypatch, search):
    calls = []
    form = bj.Form(**{**TINY.__dict__, "graph_search": search})
    monkeypatch.setattr(bj, "QUICK", form)
    monkeypatch.setattr(bj, "run_one", _fake(calls))
    doc = bj.run(quick=True, seed=0, out=tmp_path, task="digits")
    tuning = [c for c in calls if c[1].endswith("+val")]
    assert {c[1] for c in tuning} == {"digits+val"} and {c[2] for c in tuning} == {0}
    assert all(c[5] == 0.0 and c[4] == TINY.noise_levels[0] for c in tuning)   # tuned at noise 1, no loss
    assert not [c for c in calls if c[1] == "digits" and c[2] == 0 and c[6] is None and c[0].startswith("JGESR")]
    for method in bj.METHODS:
        params = result(doc, method, noise=0.2, missing=0.0)["params"]
        lr = params["lr"]
        assert lr == (0.1 if method.startswith("JGESR") else 0.01)
        test_calls = [c for c in calls if c[0] == method and c[1] == "digits"]
        assert {c[3] for c in test_calls} == {lr}                                 # the tuned step on test
        assert {c[2] for c in test_calls} == {0, 1, 2}                            # >= 3 seeds
        stat = result(doc, method, noise=0.2, missing=0.0)["metrics"]["acc"]
        assert stat["mean"] == pytest.approx(0.61) and stat["sd"] == pytest.approx(0.01) and stat["n"] == 3
        assert result(doc, method, noise=0.2, missing=0.3)["metrics"]["acc"]["mean"] == pytest.approx(0.58)
        assert result(doc, method, noise=0.4, missing=0.0)["params"] == params  # one tuning for all points
        if method in bj.GRAPH_METHODS:
            g = next(t for t in doc["tuning"] if t["methods"] == [method])["refined"]
            assert tuple(params["graph"]) == BEST_GRAPH and g["search"] == search
            assert {c[6] for c in test_calls} == {BEST_GRAPH}                     # the tuned graph on test
            graph_points = {c[6] or bj.GRAPH_DEFAULT for c in tuning if c[0] == method and c[3] == lr}
            grid = {(a, b, c) for a in TINY.lam_grid for b in TINY.alpha_grid for c in TINY.beta_grid}
            assert graph_points <= grid | {bj.GRAPH_DEFAULT}
            # the grid tries every point, the coordinate search 3 + 2 + 2 (one shared per axis)
            assert len(g["validation_acc"]) == (len(grid) if search == "grid" else 7 - 2)
    assert len({r["method"] for r in doc["results"]}) == 8
    assert {tuple(sorted(r["point"].items())) for r in doc["results"]} == {
        (("missing", 0.0), ("noise", 0.2)), (("missing", 0.0), ("noise", 0.4)), (("missing", 0.3), ("noise", 0.2))}
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"jgesr.{ext}").is_file()
    md = (tmp_path / "jgesr.md").read_text()
    assert "95.17" in md and "61.00 ± 1.00" in md and "Settings not given by the paper" in md
    assert "(10, 0.01, 0.1)" in md and "collapse diagnostics" in md
    saved = json.loads((tmp_path / "jgesr.json").read_text())
    assert saved["unspecified"]
    d = saved["diagnostics"]["JGESR-PDCA"]["noise1"]
    assert [r["seed"] for r in d["runs"]] == [0, 1, 2] and d["runs"][2]["graph_cv"] == [0.3, 2.4]
    assert d["graph_cv"]["mean_per_round"] == pytest.approx([0.3, 1.4]) and d["graph_cv"]["min"] == 0.3
    assert d["shrink_ratio"]["last"] == pytest.approx(0.7)
    assert set(saved["diagnostics"]) == set(bj.GRAPH_METHODS)
    # paired against FedAvg: the fake gives every method the same test accuracy
    p = pair(saved, "Local", "FedAvg", noise=0.2, missing=0.0)["metrics"]["acc"]
    assert p["mean"] == pytest.approx(0.0) and p["seeds"] == 3


def test_quick_form_is_the_strongly_non_iid_setting_with_trivial_baselines():
    q = bj.QUICK
    assert q.dirichlet <= 0.1 and {"FedAvg", "Local"} <= set(q.methods) and set(bj.GRAPH_METHODS) <= set(q.methods)
    assert set(q.alpha_grid) == {0.01, 0.1, 1.0} and set(q.beta_grid) == {0.001, 0.01, 0.1}
    assert bj.nodes_for(q, "digits-permuted+val") == 12 and bj.nodes_for(q, "digits") == q.nodes
    assert bj.dirichlet_for(q, "digits") == q.dirichlet and bj.dirichlet_for(q, "digits-permuted+val") == 10.0
    assert "digits-permuted" in bj.TASKS


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


def test_a_jgesr_run_logs_its_diagnostics_per_round(tmp_path, monkeypatch):
    """A real in-process JGESR run: (λ, α, β) reach the strategy; shrink ratio and graph CV per round."""
    form = bj.Form(**{**TINY.__dict__, "nodes": 4, "rounds": 2})
    out = bj.run_one("JGESR-PDCA", "digits", form, 0, 0.1, 0.5, 0.0, graph=(0.3, 0.1, 0.01))
    assert out["final"] is not None and len(out["graph_cv"]) == 2 and len(out["shrink_ratio"]) == 2
    assert out["engine"]["engine"] == bj.ENGINE == "batched" and out["engine"]["batch_chunk"] >= 4   # batched, recorded
    assert all(0 <= v <= 1.0 + 1e-9 for v in out["shrink_ratio"]) and all(v >= 0 for v in out["graph_cv"])
    other = bj.run_one("JGESR-PDCA", "digits", form, 0, 0.1, 0.5, 0.0, graph=(10.0, 0.1, 0.01))
    assert other["shrink_ratio"] != out["shrink_ratio"]                      # the graph params are used
