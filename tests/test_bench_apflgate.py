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
    assert set(saved["methods"]["apflgate"]) == {"0.5,0.1", "0.5,1"} and set(saved["methods"]["fedgate"]) == {"0.1", "1"}
    # τ is read as a multiple of R = 2: τ = 0.1 R ≤ R/2 is refused with the reason, never run or "failed"
    assert saved["tau_mode"] == "multiple-of-steps"
    for c in (saved["methods"]["apflgate"]["0.5,0.1"], saved["methods"]["fedgate"]["0.1"]):
        assert c["values"] == [] and "τ = 0.1 × R = 0.2 with R = train.local-steps = 2" in c["refused"]
    assert saved["methods"]["fedgate"]["1"]["values"][0] is not None
    md = (tmp_path / "apflgate.md").read_text()
    assert "| 0.5 | refused (τ ≤ R/2) | " in md and "| FedGATE | τ = 0.1 (× R) | refused (τ ≤ R/2) |" in md
    # trivial baselines and local-only beside the methods (C7); both personal output forms (C6)
    trivial = saved["trivial"]
    assert set(trivial) == {"pooled", "per-client"} and len(trivial["pooled"]["values"]) == 2
    assert 0.0 < trivial["pooled"]["mean"] < 0.5                 # a constant class on 10-class digits
    assert len(saved["methods"]["local"]["values"]) == 2 and "local" in saved["tuning"]
    views = saved["methods"]["apflgate"]["0.5,1"]["views"]
    assert set(views) == {"mix_aggregated", "global"} and all(len(v["values"]) == 2 for v in views.values())
    assert "| constant (pooled) |" in md and "| APFLGate | (α, τ (× R)) = (0.5,1) |" in md
    for method, t in doc["tuning"].items():                      # steps come from the +val task's grid
        tried = {float(k): v for k, v in t["grid"].items()}
        assert {0.05, 0.2} <= set(tried) and len(tried) <= 2 + apflgate.GRID_EXTENSIONS, method
        assert set(tried) - {0.05, 0.2} == set(t["extended"]), method      # extensions are listed as such
        for x in t["extended"]:                                  # each one factor 3 past a tried step
            assert any(abs(x / s - 3) < 1e-6 or abs(s / x - 3) < 1e-6 for s in tried if s != x), (method, x)
        best = max(v for v in tried.values() if v is not None)   # test_acc: higher is better
        assert tried[t["lr"]] == best, method
    cell = saved["methods"]["apflgate"]["0.5,1"]
    assert len(cell["values"]) == 2 and cell["sd"] is not None
    comp = saved["compression"]
    assert comp["none"]["values"] == cell["values"]              # the reference cell, same runs
    assert 0.7 < comp["quant-8bit"]["bytes_saved_fraction"] < 0.76  # 1 byte instead of 4, plus scales
    assert 0.85 < comp["quant-4bit"]["bytes_saved_fraction"] < 0.88  # half a byte per entry
    assert comp["topk-10%"]["bytes_saved_fraction"] > 0.7
    assert "| quant-4bit |" in (tmp_path / "apflgate.md").read_text()


def test_form_with_explicit_cells_and_no_fedavg(tmp_path, monkeypatch):
    """The GNN tasks' quick forms run chosen (α, τ) cells, a subset of codecs and no FedAvg."""
    tiny = apflgate.Form(rounds=1, local_steps=1, seeds=2, lr_grid=(0.2,), alphas=(0.5,), taus=(10.0,), nodes=3,
                         codecs=("quant-4bit",), fedavg=False, cells=((0.5, 10.0), (0.1, 1.0)),
                         settings=(("data.max-samples", 300),))
    monkeypatch.setitem(apflgate.QUICK_BY_TASK, "digits", tiny)
    assert apflgate.form_for("digits", quick=True) is tiny and apflgate.form_for("digits", quick=False) is apflgate.FULL
    doc = apflgate.run(quick=True, seed=0, out=tmp_path, task="digits")
    assert set(doc["methods"]["apflgate"]) == {"0.5,10", "0.1,1"} and doc["methods"]["fedavg"] is None
    assert set(doc["tuning"]) == {"local", "apfl", "fedgate", "apflgate"}
    assert set(doc["compression"]) == {"none", "quant-4bit"}
    assert any("data.max-samples = 300" in s for s in doc["unspecified_settings"])
    md = (tmp_path / "apflgate.md").read_text()
    assert "| 0.5 | not run | " in md and "| FedAvg | — | not run |" in md
    assert (tmp_path / "apflgate.png").stat().st_size > 0
    assert apflgate.form_for("bbbp", quick=True).nodes == 0 and apflgate.form_for("ciao", quick=True).seeds >= 3
