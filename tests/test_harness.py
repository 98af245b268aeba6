"""The benchmark harness (bench/harness.py, report.py, stats.py) on a toy benchmark of plain numbers."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from graphfl.bench import report
from graphfl.bench.harness import Bench, Cell, Metric, Tuning, plan, run_bench
from graphfl.bench.stats import mean_sd, paired_difference


class Boom(RuntimeError):
    pass


def toy(calls: list[Cell], tuning: Tuning | None = None, stop_after: int | None = None,
        fail: Any = None) -> Bench:
    """Loss = base[method] * size + seed / 100 (+ |lr − 0.2| with a tuned lr); val cells mirror test."""
    base = {"a": 1.0, "b": 2.0}

    def run_cell(cell: Cell) -> dict[str, Any]:
        if stop_after is not None and len(calls) >= stop_after:
            raise Boom("killed")
        calls.append(cell)
        if fail is not None and fail(cell):
            return {"diverged": f"{cell.method} lr {cell.settings.get('lr')}"}
        lr = cell.settings.get("lr", 0.2)
        loss = base[cell.method] * cell.at["size"] + cell.seed / 100 + abs(lr - 0.2)
        return {"final": {"loss": loss, "acc": 1 / loss},
                "curve": [{"round": r, "loss": loss * (3 - r)} for r in range(3)]}

    return Bench(name="toy", title="Toy", methods=("a", "b"), points=[{"size": 1}, {"size": 2}], seeds=(0, 1, 2),
                 metrics=(Metric("loss"), Metric("acc", lower_is_better=False)), run_cell=run_cell,
                 tuning=tuning, reference="a", curve_keys=("loss",), curve_sd_keys=("loss",))


def test_mean_sd_and_paired_difference() -> None:
    s = mean_sd([1.0, None, 3.0, float("nan")])
    assert s["mean"] == pytest.approx(2.0) and s["sd"] == pytest.approx(np.sqrt(2.0)) and s["n"] == 2
    assert mean_sd([5.0])["sd"] is None and mean_sd([None])["mean"] is None
    d = paired_difference([1.0, 4.0, 2.0], [2.0, 3.0, None])
    assert d["per_seed"] == pytest.approx([-1.0, 1.0]) and d["first_better"] == 1 and d["seeds"] == 2
    assert paired_difference([1.0, 4.0], [2.0, 3.0], lower_is_better=False)["first_better"] == 1


def test_cells_aggregate_to_mean_sd_and_paired_differences(tmp_path: Path) -> None:
    calls: list[Cell] = []
    out = run_bench(toy(calls), tmp_path)
    assert len(calls) == 2 * 2 * 3
    r = next(x for x in out.results if x["method"] == "b" and x["point"] == {"size": 2})
    assert r["metrics"]["loss"]["per_seed"] == pytest.approx([4.0, 4.01, 4.02])
    assert r["metrics"]["loss"]["mean"] == pytest.approx(4.01)
    assert r["metrics"]["loss"]["sd"] == pytest.approx(0.01)
    assert r["curve"][0]["loss"] == pytest.approx(3 * 4.01) and r["curve"][0]["loss_sd"] == pytest.approx(0.03)
    p = next(x for x in out.paired if x["a"] == "b" and x["point"] == {"size": 2})
    assert p["b"] == "a"
    assert p["metrics"]["loss"]["per_seed"] == pytest.approx([2.0, 2.0, 2.0])
    assert p["metrics"]["loss"]["first_better"] == 0  # b is worse on loss every seed
    assert p["metrics"]["acc"]["first_better"] == 0  # and on accuracy (higher is better)


def test_a_killed_bench_resumes_from_the_cache_and_logs_its_plan(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    calls: list[Cell] = []
    with pytest.raises(Boom):
        run_bench(toy(calls, stop_after=5), tmp_path)
    assert len(calls) == 5
    pending, cached = plan(toy([]), tmp_path)
    assert (len(pending), cached) == (7, 5)
    again: list[Cell] = []
    with caplog.at_level(logging.INFO, logger="graphfl.bench.harness"):
        out = run_bench(toy(again), tmp_path)
    assert len(again) == 7  # only what the killed run had not finished
    assert out.estimate["cells_cached"] == 5 and out.estimate["cells_to_run"] == 7
    assert out.estimate["from"] == "timed first cell" and out.estimate["seconds"] >= 0
    assert any("5 cells cached, 7 to run" in r.message for r in caplog.records)
    assert any("estimate: about" in r.message for r in caplog.records)
    assert (out.estimate["cells_computed"], out.estimate["cells_read"]) == (7, 5)
    third: list[Cell] = []
    out = run_bench(toy(third), tmp_path)
    assert third == [] and out.estimate["from"] == "cache"
    assert (out.estimate["cells_computed"], out.estimate["cells_read"]) == (0, 12)


def test_the_report_counts_the_cells_a_run_computed_not_the_plans_guess(tmp_path: Path) -> None:
    # the plan cannot see a tuning's extensions: the footer says what the run did
    calls: list[Cell] = []
    tn = Tuning(param="lr", grid=(0.05, 0.1), metric="loss", factor=2.0, max_extensions=2)
    out = run_bench(toy(calls, tuning=tn), tmp_path)
    assert out.estimate["cells_computed"] == len(calls) > out.estimate["cells_to_run"]
    doc = report.build_doc(toy([], tuning=tn), out, quick=True, config={})
    md = report.render_markdown(doc)
    assert (f"{len(calls)} cells computed in this run, 0 read from the cache "
            f"(planned at the start: {out.estimate['cells_to_run']} to run, 0 cached)") in md

    # a joint bench visits each joint cell again after the walk: computed once, never "read"
    joint = Bench(name="joint", title="Joint", methods=("a", "b"), points=[{"size": 1}, {"size": 2}],
                  seeds=(0, 1, 2), metrics=(Metric("loss"),), run_cell=joint_cell, joint=True, reference="a")
    out = run_bench(joint, tmp_path / "joint")
    assert (out.estimate["cells_computed"], out.estimate["cells_read"]) == (6, 0)
    out = run_bench(joint, tmp_path / "joint", cache_only=True)
    assert (out.estimate["cells_computed"], out.estimate["cells_read"], out.estimate["cells_missing"]) == (0, 6, 0)
    md = report.render_markdown(report.build_doc(joint, out, quick=True, config={}))
    assert "0 cells computed in this run, 6 read from the cache, 0 not in the cache (reported missing)" in md


def test_the_plan_of_a_per_method_tuning_counts_only_the_methods_not_cached(tmp_path: Path) -> None:
    # method a ran in full; b is new (as a method added to a form): only b's cells are to run
    tn = Tuning(param="lr", grid=(0.1, 0.2, 0.4), metric="loss")
    only_a = toy([], tuning=tn)
    only_a.methods = ("a",)
    run_bench(only_a, tmp_path)
    # a tuning shared by the methods is one walk: b's missing validation cells leave a's test
    # cells undetermined, so they are counted too
    shared = Tuning(param="lr", grid=(0.1, 0.2, 0.4), metric="loss", shared=True)
    pending, _ = plan(toy([], tuning=shared), tmp_path)
    assert {c.method for c in pending} == {"a", "b"}
    pending, cached = plan(toy([], tuning=tn), tmp_path)
    assert {c.method for c in pending} == {"b"}
    assert cached == 2 * (3 + 3)                     # a: per point 3 validation and 3 test cells
    assert len(pending) == 2 * (3 + 3)               # b: its initial grid on validation and its test seeds
    assert [c.split for c in pending] == (["val"] * 3 + ["test"] * 3) * 2   # per point, as they run
    calls: list[Cell] = []
    run_bench(toy(calls, tuning=tn), tmp_path)
    assert {c.method for c in calls} == {"b"} and len(calls) == len(pending)


def test_the_plan_walks_a_point_whole_where_its_tuning_point_has_other_methods(tmp_path: Path) -> None:
    # tuned at size 3, where only a runs; b runs at sizes 1 and 2 untuned: after a full run nothing is left
    tn = Tuning(param="lr", grid=(0.1, 0.2, 0.4), metric="loss", at=lambda p: {"size": 3})
    bench = toy([], tuning=tn)
    bench.methods_at = lambda p: ["a"] if p["size"] == 3 else ["a", "b"]
    calls: list[Cell] = []
    full = toy(calls, tuning=tn)
    full.methods_at = bench.methods_at
    run_bench(full, tmp_path)
    assert calls and plan(bench, tmp_path)[0] == []


def test_declared_cost_gives_the_estimate_before_any_cell(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bench = toy([])
    bench.seconds = lambda cell: 10.0 * cell.at["size"]
    with caplog.at_level(logging.INFO, logger="graphfl.bench.harness"):
        out = run_bench(bench, tmp_path)
    assert out.estimate["from"] == "declared cost" and out.estimate["seconds"] == pytest.approx(6 * 10 + 6 * 20)
    first = next(r.message for r in caplog.records if "to run" in r.message)
    assert "estimate from the declared cost: about 3 min" in first


def test_tuning_uses_validation_cells_only_and_one_value_per_method(tmp_path: Path) -> None:
    calls: list[Cell] = []
    tn = Tuning(param="lr", grid=(0.1, 0.2, 0.4), metric="loss", factor=2.0, max_extensions=1)
    out = run_bench(toy(calls, tuning=tn), tmp_path)
    val = [c for c in calls if c.split == "val"]
    assert {c.seed for c in val} == {0}  # the first seed tunes
    assert all(c.settings["lr"] == pytest.approx(0.2) for c in calls if c.split == "test")
    assert len(out.tuning) == 2 * 2  # per point and method
    t = out.tuning[0]
    assert t["chosen"] == pytest.approx(0.2) and not t["at_edge"] and t["extended"] == []
    assert t["scores"]["0.4"] == pytest.approx(1.0 + 0.2)


def test_shared_tuning_skips_values_where_a_method_fails_and_test_cells_back_off(tmp_path: Path) -> None:
    calls: list[Cell] = []
    # b fails at lr >= 0.4 everywhere; on test, seed 2 of b also fails at 0.2 and backs off below the grid
    tn = Tuning(param="lr", grid=(0.2, 0.4), metric="loss", shared=True, factor=2.0, max_extensions=0,
                backoff_halvings=2)

    def fail(c: Cell) -> bool:
        lr = c.settings["lr"]
        return c.method == "b" and (lr >= 0.4 or (c.split == "test" and c.seed == 2 and lr > 0.1))

    out = run_bench(toy(calls, tuning=tn, fail=fail), tmp_path)
    t = out.tuning[0]
    assert t["methods"] == ["a", "b"] and t["chosen"] == pytest.approx(0.2)
    assert t["scores"]["0.4"] is None and "b lr 0.4" in t["failed"]["0.4"]
    assert t["scores"]["0.2"] == pytest.approx((1.0 + 2.0) / 2)
    r = next(x for x in out.results if x["method"] == "b" and x["point"] == {"size": 1})
    assert [u["lr"] for u in r["params_per_seed"]] == pytest.approx([0.2, 0.2, 0.1])
    assert r["failed"] == 0 and len(r["failures"]) == 1


def test_report_writes_one_layout(tmp_path: Path) -> None:
    bench = toy([], tuning=Tuning(param="lr", grid=(0.1, 0.2, 0.4), metric="loss"))
    out = run_bench(bench, tmp_path / "cache-here")
    doc = report.build_doc(bench, out, quick=True, config={"rounds": 3}, extra={"verdict": ["ok"]})
    paths = report.write_report(tmp_path, doc, intro=["Toy intro."], sections=["## Verdict", "", "- ok"],
                                panels=report.curve_panels(doc, "loss", panel_axis="size")
                                + report.metric_panels(doc, "loss", "size"))
    loaded = json.loads(paths["json"].read_text())
    assert list(loaded)[:7] == ["name", "title", "quick", "config", "results", "paired", "tuning"]
    assert loaded["config"]["grid"] == {"size": [1, 2]} and loaded["config"]["seeds"] == [0, 1, 2]
    assert loaded["verdict"] == ["ok"] and loaded["estimate"]["cells_to_run"] == 2 * (2 * 3 + 2 * 3)
    assert report.result(loaded, "b", size=2)["metrics"]["loss"]["mean"] == pytest.approx(4.01)
    assert report.pair(loaded, "b", "a", size=1)["metrics"]["loss"]["mean"] == pytest.approx(1.0)
    with pytest.raises(KeyError, match="no result for c"):
        report.result(loaded, "c", size=1)
    md = paths["md"].read_text()
    assert "| 2 | b | lr=0.2 | 4.0100 ± 0.0100 |" in md
    assert "b − a" in md and "(0/3)" in md and "## Verdict" in md and "## Tuning on validation" in md
    assert paths["png"].stat().st_size > 1000


def test_skipped_cells_are_not_run_and_errors_are_not_stored(tmp_path: Path) -> None:
    calls: list[Cell] = []
    bench = toy(calls)
    inner = bench.run_cell
    flaky = {"on": True}

    def run_cell(cell: Cell) -> dict[str, Any]:
        if flaky["on"] and cell.method == "a" and cell.seed == 1:
            raise ValueError("transient")
        return inner(cell)

    bench.run_cell = run_cell
    bench.errors = (ValueError,)
    bench.skip = lambda cell: "unstable by construction" if cell.method == "b" and cell.at["size"] == 2 else None
    out = run_bench(bench, tmp_path)
    skipped = next(r for r in out.results if r["method"] == "b" and r["point"] == {"size": 2})
    assert skipped["skipped"] == "unstable by construction" and skipped["metrics"]["loss"]["n"] == 0
    assert not [c for c in calls if c.method == "b" and c.at["size"] == 2]
    a = next(r for r in out.results if r["method"] == "a" and r["point"] == {"size": 1})
    assert a["failed"] == 1 and "ValueError: transient" in a["failures"][0] and a["metrics"]["loss"]["n"] == 2
    flaky["on"] = False
    calls.clear()
    again = run_bench(bench, tmp_path)
    assert sorted((c.method, c.seed) for c in calls) == [("a", 1), ("a", 1)]  # only the failed cells, one per size
    assert next(r for r in again.results if r["method"] == "a")["failed"] == 0


def joint_cell(cell: Cell) -> dict[str, Any]:
    """Both methods of the toy on one draw (a module-level function: worker processes unpickle it)."""
    import os

    base = cell.at["size"] + cell.seed / 100
    return {"pid": os.getpid(), "methods": {"a": {"final": {"loss": base}}, "b": {"final": {"loss": 2 * base}}}}


def test_joint_cells_in_worker_processes_split_by_method_and_resume(tmp_path: Path) -> None:
    def bench() -> Bench:
        return Bench(name="joint", title="Joint", methods=("a", "b"), points=[{"size": 1}, {"size": 2}],
                     seeds=(0, 1, 2), metrics=(Metric("loss"),), run_cell=joint_cell, joint=True, workers=2,
                     reference="a")

    out = run_bench(bench(), tmp_path)
    assert out.estimate["cells_to_run"] == 2 * 3  # one cell per (point, seed), not per method
    b = next(r for r in out.results if r["method"] == "b" and r["point"] == {"size": 2})
    assert b["metrics"]["loss"]["per_seed"] == pytest.approx([4.0, 4.02, 4.04])
    assert (next(p for p in out.paired if p["point"] == {"size": 1})["metrics"]["loss"]["per_seed"]
            == pytest.approx([1.0, 1.01, 1.02]))
    import os

    pids = {r["pid"] for r in out.joint.values()}
    assert os.getpid() not in pids  # computed in the workers
    again = run_bench(bench(), tmp_path)
    assert again.estimate["cells_cached"] == 6 and again.estimate["cells_to_run"] == 0
    assert {r["pid"] for r in again.joint.values()} == pids  # read back, not recomputed
