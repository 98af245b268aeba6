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


def test_the_fedjax_row_says_not_installed_without_its_python(monkeypatch):
    monkeypatch.delenv(engine.FEDJAX_ENV, raising=False)
    row = engine.run_row({"task": "synthetic-multicenter", "clients": 100, "engine": "fedjax", "rounds": 4}, 0, None)  # type: ignore[arg-type]
    assert row["status"] == "not installed" and engine.FEDJAX_ENV in row["error"] and "round_s" not in row
    assert {(r["clients"], r["engine"]) for r in engine.grid(True, None) if r["engine"] == "fedjax"} == {
        (100, "fedjax"), (1000, "fedjax")}


def test_the_fedjax_row_with_a_python_that_lacks_fedjax_fails_naming_it(monkeypatch):
    import sys

    monkeypatch.setenv(engine.FEDJAX_ENV, sys.executable)     # graphfl's own Python: no FedJAX there
    row = engine.run_row({"task": "synthetic-multicenter", "clients": 3, "engine": "fedjax", "rounds": 2}, 0, None)  # type: ignore[arg-type]
    assert row["status"] == "failed" and "fedjax" in row["error"], row


def test_the_fedjax_comparator_runs_where_it_is_installed():
    import os

    import pytest

    if not os.environ.get(engine.FEDJAX_ENV):
        pytest.skip(f"{engine.FEDJAX_ENV} is not set (scripts/install-fedjax.sh)")
    row = engine.run_row({"task": "synthetic-multicenter", "clients": 3, "engine": "fedjax", "rounds": 2}, 0, None)  # type: ignore[arg-type]
    assert row["status"] == "completed" and row["round_s"] > 0 and row["setup_s"] > 0, row
    doc = engine._doc(True, 0, [{"task": "synthetic-multicenter", "clients": 3, "engine": "batched",
                                 "round_s": row["round_s"] / 2}, row], {}, 1.0)
    assert doc["rows"][0]["speedup_vs_fedjax"] == 2.0
