"""`graphfl bench heterogeneity --form personal`: APFL / APFLGate / FedGATE declared with their grids and the
FedAvg-FT baseline, the step grid extended past a winning edge, a tiny run."""

from __future__ import annotations

import dataclasses
import json

import pytest

from graphfl.bench import heterogeneity as bh
from graphfl.bench.report import result
from graphfl.strategies.apfl_math import tau_problem

TINY = dataclasses.replace(bh.PERSONAL, nodes=3, rounds=2, local_steps=2, batch_size=8, seeds=2, lr_grid=(0.3,),
                           dirichlet=(0.1,), tasks=("digits",), apfl_alpha=(0.5,), gate_tau=(1.0, 10.0),
                           max_extensions=1)


def test_personal_form_declares_the_gate_methods_their_grids_and_pairs():
    form = bh.FORMS["personal"]
    bench = bh.declare(form, seed=0)
    assert set(bench.methods) == {"FedAvg", "FedAvg-FT", "Local", "APFL", "APFLGate", "FedGATE", "Const-own",
                                  "Const-pooled"}
    assert {0.05, 0.1, 0.5} <= set(form.dirichlet) and form.engine == "batched" and len(bench.seeds) >= 3
    pairs = set(bench.pair_list())
    for m in ("APFL", "APFLGate", "FedGATE"):
        assert (m, "FedAvg") in pairs and (m, "Local") in pairs
    assert ("APFLGate", "APFL") in pairs and ("APFLGate", "APFL") not in set(bh.declare(bh.QUICK, seed=0).pair_list())
    # the mixing methods' fine-tuning baseline: FedAvg runs with train.eval-local, paired with them
    for m in ("APFL", "APFLGate", "FedGATE"):
        assert (m, "FedAvg-FT") in pairs
    assert ("FedAvg-FT", "FedAvg") in pairs and not any(r == "FedAvg-FT" for _, r in bh.pair_list(bh.QUICK))
    ft = bh.run_values("FedAvg-FT", "digits", form, 0, 0.1, {"lr": 0.3})
    plain = bh.run_values("FedAvg", "digits", form, 0, 0.1, {"lr": 0.3})
    assert ft.pop("train.eval-local") is True and ft == plain
    # the step grid extends past a winning edge for every method in the personal form only
    assert bench.tuning.max_extensions == 2
    assert bh.declare(bh.QUICK, seed=0).tuning.max_extensions == 0 == bh.declare(bh.FULL, seed=0).tuning.max_extensions
    assert "max_extensions" in bh.unused_fields(bh.QUICK) and "max_extensions" not in bh.unused_fields(form)
    # τ is a multiple of R, every value above R/2 (C5), and the strategies read it so
    assert form.gate_tau and all(t > 0.5 for t in form.gate_tau)
    assert all(tau_problem("fedgate.tau", t, bh.TAU_MODE, form.local_steps) is None for t in form.gate_tau)
    # the candidates: APFL α grid (+ adaptive), FedGATE τ grid, APFLGate their product; the default first
    apfl = bh.gate_candidates("APFL", form)
    assert apfl[0] == (("alpha", 0.5),) and (("adaptive", True), ("alpha", 0.5)) in apfl
    assert {dict(c)["alpha"] for c in apfl} == set(form.apfl_alpha) | {0.5}
    assert [dict(c)["tau"] for c in bh.gate_candidates("FedGATE", form)] == [1.0, 10.0, 100.0]
    assert len(bh.gate_candidates("APFLGate", form)) == len(apfl) * len(form.gate_tau)
    v = bh.run_values("APFLGate", "digits", form, 0, 0.1, {"lr": 0.3, "alpha": 0.25, "tau": 10.0, "adaptive": True})
    assert v["strategy"] == "apflgate" and v["apflgate.tau"] == 10.0 and v["apflgate.tau-mode"] == "multiple-of-steps"
    assert v["apflgate.alpha"] == 0.25 and v["apflgate.adaptive-alpha"] is True
    assert v["apflgate.personal-output"] == "local-copy" and v["engine"] == "batched"
    # a default named or left out is one cache entry
    assert bh.run_values("APFL", "digits", form, 0, 0.1, {"lr": 0.3}) == \
        bh.run_values("APFL", "digits", form, 0, 0.1, {"lr": 0.3, "alpha": 0.5})
    # the quick form keeps its graph-aware methods and its config (no gate fields)
    assert set(bh.QUICK.methods) == set(bh.GRAPH_METHODS)
    assert {"apfl_alpha", "gate_tau"} <= bh.unused_fields(bh.QUICK)


def test_tau_grid_at_or_below_half_r_and_unknown_form_are_refused():
    for bad in ((0.5, 1.0), (0.0,), (0.3,)):
        with pytest.raises(ValueError, match=r"R/2|> 1/2"):
            bh.declare(dataclasses.replace(TINY, gate_tau=bad), seed=0)
    # without a τ method the grid is not read
    bh.declare(dataclasses.replace(TINY, gate_tau=(0.5,), methods=("FedAvg", "APFL")), seed=0)
    with pytest.raises(ValueError, match="unknown form 'nope'"):
        bh.form_named(False, "nope")


def test_tiny_personal_run_through_the_harness(tmp_path, monkeypatch):
    monkeypatch.setitem(bh.FORMS, "personal", TINY)
    doc = bh.run(seed=0, out=tmp_path, form="personal")
    assert json.loads((tmp_path / "heterogeneity.json").read_text())["config"]["form"] == "personal"
    assert (tmp_path / "heterogeneity.png").is_file()
    for method in TINY.methods:
        r = result(doc, method, task="digits", dirichlet=0.1)
        assert r["failed"] == 0 and r["metrics"]["acc"]["n"] == 2
        assert 0.0 <= r["metrics"]["acc"]["mean"] <= 1.0
    chosen = {m: result(doc, m, task="digits", dirichlet=0.1)["params"] for m in ("APFL", "APFLGate", "FedGATE")}
    assert chosen["APFL"]["alpha"] in TINY.apfl_alpha and "tau" not in chosen["APFL"]
    assert chosen["FedGATE"]["tau"] in TINY.gate_tau and "alpha" not in chosen["FedGATE"]
    assert chosen["APFLGate"]["alpha"] in TINY.apfl_alpha and chosen["APFLGate"]["tau"] in TINY.gate_tau
    # the personal views of the mixing methods are kept per seed (C6)
    diag = {d["method"]: d for d in doc["diagnostics"]}
    for m in ("APFL", "APFLGate"):
        assert diag[m]["global_acc"]["n"] == 2 and diag[m]["mix_aggregated_acc"]["n"] == 2
    assert "FedGATE" not in diag
    # FedAvg-FT is scored on the locally trained models; its global model is FedAvg's (same step: same runs)
    ft, fedavg = (result(doc, m, task="digits", dirichlet=0.1) for m in ("FedAvg-FT", "FedAvg"))
    assert diag["FedAvg-FT"]["global_acc"]["n"] == 2
    assert ft["metrics"]["acc"]["mean"] != pytest.approx(diag["FedAvg-FT"]["global_acc"]["mean"], rel=1e-6)
    if ft["params"]["lr"] == fedavg["params"]["lr"]:
        assert diag["FedAvg-FT"]["global_acc"]["mean"] == pytest.approx(fedavg["metrics"]["acc"]["mean"], rel=1e-6)
    # the single-step grid is at both edges: one step beyond it was tried (max_extensions = 1)
    fedavg_tuning = next(t for t in doc["tuning"] if t["methods"] == ["FedAvg"])
    assert fedavg_tuning["initial_grid"] == [0.3] and len(fedavg_tuning["extended"]) == 1
    md = (tmp_path / "heterogeneity.md").read_text()
    assert "paired differences against FedAvg" in md and "paired differences against Local" in md
    assert "paired differences against FedAvg-FT" in md and "APFLGate − FedAvg-FT" in md
    assert "train.eval-local" in md and "extended past a winning edge" in md
    assert "Personal outputs (C6)" in md and "tau-mode multiple-of-steps" in md
