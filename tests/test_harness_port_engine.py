"""``graphfl bench engine`` on the harness's measurement mode: how its joint cells (one per (task,
clients) point and repeat) assemble into the common layout — engines absent where the grid has no
row, FedJAX skipped with the reason, the paired comparisons, the ratios within one repeat — and its
own rows, growth and files. The engines' measurements are tested in test_batched_bench.py; here
they are replaced by fixed numbers, so the test takes seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from graphfl.bench.report import pair, result
from graphfl.dashboard import bench_results

SM = "synthetic-multicenter"
PER_CLIENT = {"batched": 0.001, "inprocess": 0.01, "simulation": 0.05}


def test_engine_assembly_absent_engines_skipped_fedjax_pairs(tmp_path: Path, monkeypatch) -> None:
    from graphfl.bench import engine

    real_run_row = engine.run_row
    calls: list[tuple[str, int, str, int]] = []

    def fake_row(row: dict[str, Any], seed: int, work: Path) -> dict[str, Any]:
        calls.append((row["task"], row["clients"], row["engine"], seed))
        if row["engine"] == "fedjax":
            return real_run_row(row, seed, work)   # not installed here: nothing runs
        out = {k: v for k, v in row.items() if k != "data-dir"}
        if row["task"] == "digits" and row["engine"] == "simulation":
            return {**out, "error": "RuntimeError: boom"}
        t = PER_CLIENT[row["engine"]] * row["clients"] * (1 + seed / 10)
        loss = 0.5 + seed / 100 + (1e-9 if row["engine"] == "batched" else 0.0)
        return {**out, "round_s": t, "setup_s": 2 * t, "test_loss": loss, "status": "completed",
                "rounds_run": row["rounds"], "chunk": 64 if row["engine"] == "batched" else None}

    monkeypatch.delenv(engine.FEDJAX_ENV, raising=False)
    monkeypatch.setattr(engine, "run_row", fake_row)
    monkeypatch.setattr(engine, "_warm_up", lambda engines, seed: None)
    doc = engine.run(quick=False, seed=0, out=tmp_path, repeats=2)

    # one joint cell per point and repeat, every engine of the point in it, points in the grid's order
    points = [(SM, 10), (SM, 100), (SM, 1000), (SM, 10_000), ("digits", 100)]
    assert doc["config"]["cache"] == "none" and doc["estimate"]["cells_to_run"] == len(points) * 2
    assert list(dict.fromkeys((t, n) for t, n, _, _ in calls)) == points
    assert {s for *_, s in calls} == {0, 1}
    # engines the grid has no row for are absent, not failed
    at = {(r["point"]["task"], r["point"]["clients"]): [] for r in doc["results"]}
    for r in doc["results"]:
        at[(r["point"]["task"], r["point"]["clients"])].append(r["method"])
    assert at[(SM, 10_000)] == ["batched"]
    assert at[(SM, 100)] == ["batched", "inprocess", "simulation", "fedjax"]
    assert at[(SM, 1000)] == ["batched", "inprocess", "fedjax"] and at[(SM, 10)] == ["batched", "inprocess"]
    with pytest.raises(KeyError):
        result(doc, "inprocess", task=SM, clients=10_000)
    # FedJAX not installed: a skipped cell with the reason, nothing paired
    fj = result(doc, "fedjax", task=SM, clients=100)
    assert engine.FEDJAX_ENV in fj["skipped"] and fj["failed"] == 2
    assert pair(doc, "batched", "fedjax", task=SM, clients=100)["metrics"]["round_s"]["seeds"] == 0
    assert any(engine.FEDJAX_ENV in s for s in doc["skipped"])
    # a row that failed is a failed cell naming why
    sim = result(doc, "simulation", task="digits", clients=100)
    assert sim["failed"] == 2 and "boom" in sim["failures"][0]
    # ratios within one repeat, over seeds; paired round-time differences
    b = result(doc, "batched", task=SM, clients=100)["metrics"]
    assert b["speedup_vs_inprocess"]["per_seed"] == pytest.approx([10.0, 10.0])
    assert b["speedup_vs_simulation"]["mean"] == pytest.approx(50.0)
    assert b["rel_diff_vs_inprocess"]["mean"] == pytest.approx(1e-9 / 0.505, rel=1e-3)
    assert b["round_s"]["per_seed"] == pytest.approx([0.1, 0.11]) and b["chunk"]["mean"] == 64
    p = pair(doc, "batched", "inprocess", task=SM, clients=100)["metrics"]["round_s"]
    assert p["mean"] == pytest.approx(-(0.9 + 0.99) / 2) and p["first_better"] == 2
    # the module's own parts: rows per engine and repeat, growth from the means over repeats
    assert len(doc["rows"]) == len(calls)
    steps = {(s["engine"], s["from"]): s for s in doc["scaling"]}
    assert steps[("batched", 1000)]["to"] == 10_000
    assert steps[("batched", 1000)]["round_s_exponent"] == pytest.approx(1.0)
    assert ("simulation", 100) not in steps     # one client count: no growth
    saved = json.loads((tmp_path / "engine.json").read_text())
    assert bench_results.view("engine.json", saved)["layout"] == "harness"
    md = (tmp_path / "engine.md").read_text()
    assert "measured in this run" in md and "## Rows" in md and "## Growth with the client count" in md
    assert (tmp_path / "engine.png").stat().st_size > 0
