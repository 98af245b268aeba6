"""B8 ``apflgate`` benchmark: a tiny end-to-end run writes its files and keeps tuning off the test split."""

from __future__ import annotations

import json

from graphfl.bench import apflgate


def test_tiny_run_writes_results_with_grid_baselines_and_compression(tmp_path, monkeypatch):
    tiny = apflgate.Form(rounds=2, local_steps=2, seeds=2, lr_grid=(0.05, 0.2), alphas=(0.5,), taus=(0.1, 1.0),
                         nodes=3)
    monkeypatch.setattr(apflgate, "QUICK", tiny)
    doc = apflgate.run(quick=True, seed=0, out=tmp_path, task="digits")
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"apflgate.{ext}").stat().st_size > 0
    saved = json.loads((tmp_path / "apflgate.json").read_text())
    assert saved["metric"] == "test_acc" and saved["higher_is_better"] is True

    def at(method, point):
        (r,) = [r for r in saved["results"] if r["method"] == method and r["point"] == point]
        return r

    assert {(r["method"], tuple(r["point"].values())) for r in saved["results"]} == {
        ("fedavg", ()), ("local", ()), ("apfl", (0.5,)), ("fedgate", (0.1,)), ("fedgate", (1.0,)),
        ("apflgate", (0.5, 0.1)), ("apflgate", (0.5, 1.0)), *(("apflgate", (0.5, 1.0, c)) for c in apflgate.COMPRESSIONS)}
    # τ is read as a multiple of R = 2: τ = 0.1 R ≤ R/2 is refused with the reason, never run or "failed"
    assert saved["tau_mode"] == "multiple-of-steps"
    for c in (at("apflgate", {"alpha": 0.5, "tau": 0.1}), at("fedgate", {"tau": 0.1})):
        assert c["metrics"]["test_acc"]["per_seed"] == [] and "τ = 0.1 × R = 0.2 with R = train.local-steps = 2" \
            in c["skipped"]
    assert at("fedgate", {"tau": 1.0})["metrics"]["test_acc"]["n"] == 2
    md = (tmp_path / "apflgate.md").read_text()
    assert "| 0.5 | refused (τ ≤ R/2) | " in md and "|  | 0.1 |  | fedgate | lr=" in md and "| skipped |" in md
    # trivial baselines and local-only beside the methods (C7); both personal output forms (C6)
    trivial = saved["trivial"]
    assert set(trivial) == {"pooled", "per-client"} and len(trivial["pooled"]["values"]) == 2
    assert 0.0 < trivial["pooled"]["mean"] < 0.5                 # a constant class on 10-class digits
    assert at("local", {})["metrics"]["test_acc"]["n"] == 2 and any(t["methods"] == ["local"] for t in saved["tuning"])
    ref = at("apflgate", {"alpha": 0.5, "tau": 1.0})
    for view in ("mix_aggregated_test_acc", "global_test_acc"):
        assert ref["metrics"][view]["n"] == 2
    assert "| constant (pooled) |" in md and "mix_aggregated test_acc" in md
    for t in doc["tuning"]:                                      # steps come from the +val task's grid
        method = t["methods"][0]
        tried = {float(k): v for k, v in t["scores"].items()}
        assert {0.05, 0.2} <= set(tried) and len(tried) <= 2 + apflgate.GRID_EXTENSIONS, method
        assert set(tried) - {0.05, 0.2} == set(t["extended"]), method      # extensions are listed as such
        for x in t["extended"]:                                  # each one factor 3 past a tried step
            assert any(abs(x / s - 3) < 1e-6 or abs(s / x - 3) < 1e-6 for s in tried if s != x), (method, x)
        best = max(v for v in tried.values() if v is not None)   # test_acc: higher is better
        assert tried[t["chosen"]] == best, method
        assert all(r["params"]["lr"] == t["chosen"] for r in saved["results"] if r["method"] == method)
    assert ref["metrics"]["test_acc"]["sd"] is not None
    comp = saved["compression"]
    assert comp["none"]["values"] == ref["metrics"]["test_acc"]["per_seed"]   # the reference cell, same runs
    assert 0.7 < comp["quant-8bit"]["bytes_saved_fraction"] < 0.76  # 1 byte instead of 4, plus scales
    assert 0.85 < comp["quant-4bit"]["bytes_saved_fraction"] < 0.88  # half a byte per entry
    assert comp["topk-10%"]["bytes_saved_fraction"] > 0.7
    assert comp["quant-4bit"]["metric_change"]["seeds"] == 2
    assert "| quant-4bit |" in (tmp_path / "apflgate.md").read_text()


def test_form_with_explicit_cells_and_no_fedavg(tmp_path, monkeypatch):
    """The GNN tasks' quick forms run chosen (α, τ) cells, a subset of codecs and no FedAvg."""
    tiny = apflgate.Form(rounds=1, local_steps=1, seeds=2, lr_grid=(0.2,), alphas=(0.5,), taus=(10.0,), nodes=3,
                         codecs=("quant-4bit",), fedavg=False, cells=((0.5, 10.0), (0.1, 1.0)),
                         settings=(("data.max-samples", 300),))
    monkeypatch.setitem(apflgate.QUICK_BY_TASK, "digits", tiny)
    assert apflgate.form_for("digits", quick=True) is tiny and apflgate.form_for("digits", quick=False) is apflgate.FULL
    doc = apflgate.run(quick=True, seed=0, out=tmp_path, task="digits")
    cells = {tuple(r["point"].values()) for r in doc["results"] if r["method"] == "apflgate"}
    assert cells == {(0.5, 10.0), (0.1, 1.0), (0.5, 1.0), (0.5, 1.0, "quant-4bit")}   # + the codec's reference
    assert "fedavg" not in {r["method"] for r in doc["results"]}
    assert {t["methods"][0] for t in doc["tuning"]} == {"local", "apfl", "fedgate", "apflgate"}
    assert set(doc["compression"]) == {"none", "quant-4bit"}
    assert any("data.max-samples = 300" in s for s in doc["unspecified_settings"])
    md = (tmp_path / "apflgate.md").read_text()
    assert "| 0.5 | not run | " in md
    assert (tmp_path / "apflgate.png").stat().st_size > 0
    assert apflgate.form_for("bbbp", quick=True).nodes == 0 and apflgate.form_for("ciao", quick=True).seeds >= 3
