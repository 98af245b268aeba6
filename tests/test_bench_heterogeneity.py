"""`graphfl bench heterogeneity`: the declared grid, and a tiny sweep end to end with real in-process runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from graphfl import cli
from graphfl.bench import heterogeneity as bh
from graphfl.bench.report import pair, result

TINY = bh.Form(nodes=3, rounds=2, local_steps=2, batch_size=8, seeds=3, lr_grid=(0.3,), dirichlet=(0.3,),
               fesem_k=(2, 3), pfedgraph_alpha=(0.8, 3.0), lam_grid=(1.0, 10.0), alpha_grid=(1.0,),
               beta_grid=(0.1,), permuted_nodes=6)


def test_quick_form_declares_the_grid_methods_seeds_and_pairs():
    bench = bh.declare(bh.QUICK, seed=0)
    assert [dict(p) for p in bench.points] == [{"task": t, "dirichlet": a} for t in ("digits", "digits-permuted")
                                                for a in (0.05, 0.1, 0.3, 1.0)]
    assert set(bench.methods) == {"FedAvg", "Local", "FeSEM", "JGESR", "pFedGraph", "Const-own", "Const-pooled"}
    assert len(bench.seeds) >= 3
    pairs = set(bench.pair_list())
    for m in bench.methods:
        if m != "FedAvg":
            assert (m, "FedAvg") in pairs
        if m != "Local":
            assert (m, "Local") in pairs
    assert bench.tuning is not None and bench.tuning.metric == "acc" and not bench.tuning.lower_is_better
    assert bh.QUICK.fesem_k == (2, 3, 4)
    # the full form is declared and larger
    full = bh.declare(bh.FULL, seed=0)
    assert len(full.points) > len(bench.points) and len(full.seeds) >= len(bench.seeds)
    assert bh.FULL.rounds > bh.QUICK.rounds
    assert cli.BENCHMARKS["heterogeneity"] == "graphfl.bench.heterogeneity"


def test_unknown_method_or_task_is_refused_by_name():
    with pytest.raises(ValueError, match="FedFoo"):
        bh.declare(bh.Form(**{**TINY.__dict__, "methods": ("FedAvg", "FedFoo")}), seed=0)
    with pytest.raises(ValueError, match="mnist"):
        bh.declare(bh.Form(**{**TINY.__dict__, "tasks": ("mnist",)}), seed=0)


def test_graph_diagnostics_rules():
    n = 6
    groups = np.arange(n) % 3
    uniform = np.ones((n, n)) - np.eye(n)
    assert bh.offdiag_cv(uniform) == pytest.approx(0.0, abs=1e-12)
    assert bh.within_share(uniform, groups) == pytest.approx((n / 3 - 1) / (n - 1), rel=1e-9)
    block = (groups[:, None] == groups[None, :]).astype(float) - np.eye(n)
    assert bh.within_share(block, groups) == pytest.approx(1.0)
    assert bh.offdiag_cv(block) > 1.0
    assert bh.offdiag_cv(np.zeros((n, n))) is None and bh.within_share(np.zeros((n, n)), groups) is None


def test_tiny_sweep_runs_end_to_end_tuned_on_validation_only(tmp_path, monkeypatch):
    calls: list[tuple[str, str, int, dict]] = []
    real = bh.run_one

    def recording(method, task, form, seed, dirichlet, params):
        calls.append((method, task, seed, dict(params)))
        return real(method, task, form, seed, dirichlet, params)

    monkeypatch.setattr(bh, "QUICK", TINY)
    monkeypatch.setattr(bh, "run_one", recording)
    doc = bh.run(quick=True, seed=0, out=tmp_path)

    for name in ("heterogeneity.json", "heterogeneity.md", "heterogeneity.png"):
        assert (tmp_path / name).is_file()
    assert json.loads((tmp_path / "heterogeneity.json").read_text())["name"] == "heterogeneity"

    val = [c for c in calls if c[1].endswith("+val")]
    test = [c for c in calls if not c[1].endswith("+val")]
    assert val and {c[2] for c in val} == {0}                     # tuning: first seed, validation view only
    for task in TINY.tasks:
        for method in TINY.methods:
            r = result(doc, method, task=task, dirichlet=0.3)
            assert r["failed"] == 0 and r["metrics"]["acc"]["n"] == 3
            assert 0.0 <= r["metrics"]["acc"]["mean"] <= 1.0
            if method in bh.CONSTANTS:
                continue
            chosen = r["params"]
            assert chosen["lr"] in TINY.lr_grid
            ran = [c for c in test if c[0] == method and c[1] == task]
            assert {c[2] for c in ran} == {0, 1, 2}                # every seed on test, at the tuned settings only
            assert all(c[3] == chosen for c in ran)
        assert result(doc, "FeSEM", task=task, dirichlet=0.3)["params"]["k"] in TINY.fesem_k
        assert result(doc, "pFedGraph", task=task, dirichlet=0.3)["params"]["alpha"] in TINY.pfedgraph_alpha
        lam, alpha, beta = result(doc, "JGESR", task=task, dirichlet=0.3)["params"]["graph"]
        assert lam in TINY.lam_grid and alpha in TINY.alpha_grid and beta in TINY.beta_grid
        # paired differences are the per-seed differences of the results
        for ref in ("FedAvg", "Local"):
            d = pair(doc, "JGESR", ref, task=task, dirichlet=0.3)["metrics"]["acc"]
            a = result(doc, "JGESR", task=task, dirichlet=0.3)["metrics"]["acc"]["per_seed"]
            b = result(doc, ref, task=task, dirichlet=0.3)["metrics"]["acc"]["per_seed"]
            np.testing.assert_allclose(d["per_seed"], np.subtract(a, b), rtol=1e-9, atol=1e-12)

    diag = {(d["point"]["task"], d["method"]): d for d in doc["diagnostics"]}
    for task in TINY.tasks:
        assert diag[(task, "JGESR")]["graph_cv"]["n"] == 3 and diag[(task, "JGESR")]["shrink_ratio"]["n"] == 3
        assert diag[(task, "FeSEM")]["nonempty"]["n"] == 3
        assert all(sum(s) == (TINY.permuted_nodes if task == "digits-permuted" else TINY.nodes)
                   for s in diag[(task, "FeSEM")]["cluster_sizes"])
        pf = diag[(task, "pFedGraph")]
        assert pf.get("graph_cv", {"n": 0})["n"] + pf["identity_graph_seeds"] == 3   # a CV, or graph = I, per seed
    assert diag[("digits-permuted", "JGESR")]["within"]["n"] == 3
    assert diag[("digits-permuted", "FeSEM")]["ari"]["n"] == 3
    md = (tmp_path / "heterogeneity.md").read_text()
    assert "paired differences against FedAvg" in md and "paired differences against Local" in md
    assert "did a graph-aware method degenerate" in md
