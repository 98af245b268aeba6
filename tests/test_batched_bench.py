"""``graphfl bench engine``: rows measured on real runs, ratios from the same run, files written."""

from __future__ import annotations

import json

from graphfl.bench import engine


def test_rows_ratios_and_files_from_small_real_runs(tmp_path):
    rows = [engine.run_row({"task": "synthetic-multicenter", "clients": 6, "engine": e, "rounds": 2}, 0, tmp_path)
            for e in ("batched", "inprocess")]
    for row in rows:
        assert "error" not in row, row
        assert row["status"] == "completed" and row["rounds_run"] == 2
        assert row["round_s"] > 0 and row["setup_s"] > 0
    assert rows[0]["chunk"] >= 6 and rows[1]["chunk"] is None
    doc = engine._doc(True, 0, rows, {"cpus": 2}, 1.0)
    batched = doc["rows"][0]
    assert batched["speedup_vs_inprocess"] == rows[1]["round_s"] / rows[0]["round_s"]
    assert batched["rel_diff_vs_inprocess"] < 1e-5          # the same numbers on both engines
    engine.write(tmp_path / "out", doc)
    saved = json.loads((tmp_path / "out" / "engine.json").read_text())
    assert [r["engine"] for r in saved["rows"]] == ["batched", "inprocess"]
    assert "speedup_vs_inprocess" in (tmp_path / "out" / "engine.md").read_text()
    assert (tmp_path / "out" / "engine.png").stat().st_size > 0


def test_a_row_that_cannot_run_says_why_and_the_grid_names_its_rows():
    row = engine.run_row({"task": "no-such-task", "clients": 2, "engine": "batched", "rounds": 1}, 0, None)  # type: ignore[arg-type]
    assert "no-such-task" in row["error"]
    quick = engine.grid(True, None)
    assert {(r["task"], r["clients"]) for r in quick if r["engine"] == "batched"} == {
        ("synthetic-multicenter", 100), ("synthetic-multicenter", 1000), ("digits", 100)}
    assert any(r["engine"] == "simulation" for r in quick)
