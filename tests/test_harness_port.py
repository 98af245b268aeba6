"""The harness's tuning groups, a failed tuning that fails its test cells, and the measurement mode
(``Bench.cache = "none"``), on toy benchmarks of plain numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from graphfl.bench.harness import Bench, Cell, Metric, Tuning, run_bench

LR_BEST = {"a": 0.1, "b": 0.3, "c": 0.3, "d": 0.1}
"""The validation-best lr of each method alone (a and b together: the mean is lowest at 0.1 or 0.3)."""


def tuned_toy(calls: list[Cell]) -> Bench:
    def run_cell(cell: Cell) -> dict[str, Any]:
        calls.append(cell)
        if cell.method == "d":
            return {"diverged": "d always diverges"}
        lr = cell.settings["lr"]
        weight = {"a": 3.0, "b": 1.0, "c": 1.0}[cell.method]  # a dominates the mean of a and b
        return {"final": {"loss": weight * abs(lr - LR_BEST[cell.method]) + cell.seed}}

    return Bench(name="tuned", title="Tuned", methods=("a", "b", "c", "d"), points=[{"size": 1}], seeds=(0, 1),
                 metrics=(Metric("loss"),), run_cell=run_cell,
                 tuning=Tuning(param="lr", grid=(0.1, 0.3), metric="loss", groups=[("a", "b")], max_extensions=0,
                               fail_if_all_fail=True))


def test_a_group_shares_one_value_the_others_are_tuned_alone_and_an_all_failed_tuning_fails_its_cells() -> None:
    calls: list[Cell] = []
    out = run_bench(tuned_toy(calls), None)
    chosen = {r["method"]: r["params"]["lr"] for r in out.results}
    assert chosen["a"] == chosen["b"] == 0.1  # the group's mean: a's weight wins, b alone would take 0.3
    assert chosen["c"] == 0.3 and chosen["d"] is None
    d = next(r for r in out.results if r["method"] == "d")
    assert d["failed"] == 2 and d["failures"] == ["no eligible lr on validation"] * 2
    assert not [c for c in calls if c.method == "d" and c.split == "test"], "d's test cells are not run"
    records = {tuple(t["methods"]): t for t in out.tuning}
    assert set(records) == {("a", "b"), ("c",), ("d",)} and records[("d",)]["all_failed"]


def timing_toy(calls: list[Cell], cache: str) -> Bench:
    def run_cell(cell: Cell) -> dict[str, Any]:
        calls.append(cell)
        return {"final": {"seconds": cell.at["size"] * {"fast": 1.0, "slow": 2.0}[cell.method] + cell.seed / 10}}

    return Bench(name="timing", title="Timing", methods=("fast", "slow"), points=[{"size": 1}, {"size": 4}],
                 seeds=(0, 1, 2), metrics=(Metric("seconds"),), run_cell=run_cell, pairs=[("fast", "slow")],
                 cache=cache)


def test_measurement_mode_measures_every_cell_in_each_run_and_says_so(tmp_path: Path) -> None:
    from graphfl.bench import report

    calls: list[Cell] = []
    bench = timing_toy(calls, "none")
    for run in (1, 2):
        out = run_bench(bench, tmp_path)
        assert len(calls) == run * 2 * 2 * 3, "nothing is taken from an earlier run"
        assert out.estimate["cells_cached"] == 0 and out.estimate["cells_to_run"] == 12
    assert not (tmp_path / "cache").exists(), "no timing is stored for a later run"
    doc = report.build_doc(bench, out, False, {})
    assert doc["config"]["cache"] == "none" and "measured in this run" in doc["config"]["measurement"]
    r = report.result(doc, "slow", size=4)
    assert r["metrics"]["seconds"]["mean"] == pytest.approx(8.1)
    assert report.pair(doc, "fast", "slow", size=4)["metrics"]["seconds"]["first_better"] == 3
    paths = report.write_report(tmp_path, doc)
    assert "12 cells measured in this run" in paths["md"].read_text()
    # the default mode, for contrast: a second run reads every cell from the cache
    cached: list[Cell] = []
    for _ in (1, 2):
        run_bench(timing_toy(cached, "run"), tmp_path / "cached")
    assert len(cached) == 12


def test_measurement_mode_refuses_parallel_workers_and_unknown_modes() -> None:
    with pytest.raises(ValueError, match="one cell at a time"):
        Bench(**{**timing_toy([], "none").__dict__, "workers": 2})
    with pytest.raises(ValueError, match="cache='disk'"):
        timing_toy([], "disk")


def test_jgesr_cost_on_the_measurement_mode(tmp_path: Path) -> None:
    import json

    from graphfl.bench import jgesr_cost as bc
    from graphfl.dashboard import bench_results

    doc = bc.run(quick=True, seed=0, out=tmp_path, points=[(6, 64), (4, 200_000)])
    assert doc["config"]["cache"] == "none" and doc["estimate"]["cells_to_run"] == 7  # pdca-masked skipped once
    pdca = next(r for r in doc["results"] if r["method"] == "pdca" and r["point"] == {"n": 6, "d": 64})
    assert pdca["metrics"]["seconds"]["n"] == 1 and pdca["metrics"]["seconds"]["mean"] > 0
    assert pdca["metrics"]["iterations_warm"]["mean"] <= pdca["metrics"]["iterations_cold"]["mean"]
    masked = next(r for r in doc["results"] if r["method"] == "pdca-masked" and r["point"]["d"] == 200_000)
    assert masked["skipped"] == "not run (d > 1e5)"
    assert not (tmp_path / "cache").exists()
    saved = json.loads((tmp_path / "jgesr-cost.json").read_text())
    view = bench_results.view("jgesr-cost.json", saved)
    assert bench_results.is_result(saved) and view["layout"] == "harness" and view["methods"] == 4
    assert (tmp_path / "jgesr-cost.png").stat().st_size > 0
    assert "measured in this run" in (tmp_path / "jgesr-cost.md").read_text()


def test_p2p_throughput_assembles_each_case_on_the_measurement_mode(tmp_path: Path, monkeypatch) -> None:
    """The harness side of p2p-throughput: one joint cell per case, methods by case, ratios, skips, files.

    The measurements themselves (real peers, floors, Flower) are tested in test_bench_p2p_ring.py,
    test_ring_floor.py and test_bench_p2p_flower.py; here they are replaced by fixed numbers.
    """
    import json

    from graphfl.bench import p2p_throughput as pt
    from graphfl.dashboard import bench_results

    measured: list[tuple[Any, ...]] = []

    def floor(d: int, n: int, rounds: int = 5, timeout: float = 300.0, cert_dir: Path | None = None) -> dict:
        measured.append(("parallel", d, n, cert_dir is not None))
        return {"median_round_s": 0.1 * (2 if cert_dir else 1), "rss_mb": 30.0, "startup_s": 0.2}

    def ring(out: Path, d: int, n: int, rounds: int, insecure: bool, timeout: float, data_path: str = "grpc") -> dict:
        measured.append((data_path, d, n, insecure))
        ok = not (data_path == "socket" and not insecure)  # the TLS socket ring "fails"
        return {"params": d, "peers": n, "tls": not insecure, "ok": ok, "exit_codes": [0 if ok else 1] * n,
                "median_round_s": 0.3 if data_path == "grpc" else 0.2,
                "wire_over_payload": 1.01, "rss_mb_median": 80.0, "startup_s_median": 1.5}

    def flower(out: Path, d: int, n: int, rounds: int, insecure: bool, timeout: float) -> dict:
        measured.append(("flower", d, n, insecure))
        return {"ok": True, "median_round_s": 1.2}

    def vanilla(out: Path, d: int, n: int, rounds: int, insecure: bool, timeout: float) -> dict:
        measured.append(("vanilla", d, n, insecure))
        return {"ok": True, "median_round_s": 6.0}

    monkeypatch.setattr(pt, "raw_floor", lambda d, n: 0.05)
    monkeypatch.setattr(pt, "parallel_floor", floor)
    monkeypatch.setattr(pt, "measure_ring", ring)
    monkeypatch.setattr(pt, "measure_flower", flower)
    monkeypatch.setattr(pt, "measure_vanilla", vanilla)
    monkeypatch.setattr("graphfl.common.certs.generate_tls", lambda folder: None)
    monkeypatch.setattr(pt, "_mem_available_mb", lambda: 5000.0)  # the 128-peer case does not fit, Flower does
    monkeypatch.setattr(pt, "measure_inprocess", lambda out, nodes, rounds: {
        "nodes": nodes, "vectorised": {"ms_per_round": 1.0}, "per_node": {"ms_per_round": 9.0}, "speedup": 9.0})
    monkeypatch.setattr(pt, "measure_mixing", lambda: {
        "float32_in_place": {"median_ms": 1.0}, "float64_copies": {"median_ms": 3.0}, "speedup_median": 3.0,
        "speedup_min": 3.0, "max_abs_difference": 0.0})
    doc = pt.run(quick=True, seed=0, out=tmp_path,
                 cases=[(1000, 4, True), (1000, 4, False), (pt.SCALE_PARAMS, pt.SCALE_PEERS, True)])
    assert doc["config"]["cache"] == "none" and doc["estimate"]["cells_to_run"] == 2
    assert len(doc["rows"]) == 2 and len(doc["skipped"]) == 1 and "128 peers" in doc["skipped"][0]
    assert sum(m[0] == "flower" for m in measured) == 2 and sum(m[0] == "parallel" and m[3] for m in measured) == 1
    assert sum(m[0] == "vanilla" for m in measured) == 2
    assert [r["vanilla_over_flower"] for r in doc["rows"]] == pytest.approx([5.0, 5.0])
    assert report_result(doc, "vanilla-flower", tls=True)["metrics"]["round_s"]["mean"] == pytest.approx(6.0)
    grpc = report_result(doc, "grpc", params=1000, peers=4, tls=False)
    assert grpc["metrics"]["ratio_to_parallel_floor"]["mean"] == pytest.approx(3.0)
    assert report_result(doc, "parallel-floor-tls", tls=True)["metrics"]["round_s"]["mean"] == pytest.approx(0.2)
    assert not [r for r in doc["results"] if r["method"] == "parallel-floor-tls" and not r["point"]["tls"]]
    socket_tls = report_result(doc, "socket", tls=True)
    assert socket_tls["failed"] == 1 and "socket ring did not finish" in socket_tls["failures"][0]
    scale = report_result(doc, "grpc", peers=pt.SCALE_PEERS)
    assert scale["skipped"] and "128 peers" in scale["skipped"]
    saved = json.loads((tmp_path / "p2p_throughput.json").read_text())
    assert bench_results.view("p2p_throughput.json", saved)["layout"] == "harness"
    text = (tmp_path / "p2p_throughput.md").read_text()
    assert "measured in this run" in text and "gRPC round s (median)" in text
    assert "vanilla / graphfl Flower" in text and "stock Flower App" in text
    assert (tmp_path / "p2p_throughput.png").stat().st_size > 0


def report_result(doc: dict, method: str, **point: Any) -> dict:
    from graphfl.bench.report import result

    return result(doc, method, **point)


def test_fail_if_all_fail_wins_over_a_fallback_value() -> None:
    """With both ``fail_if_all_fail`` and ``if_all_fail`` set, an all-failed tuning still fails its
    test cells instead of running them at the fallback value."""
    import dataclasses

    calls: list[Cell] = []
    bench = tuned_toy(calls)
    bench = dataclasses.replace(bench, tuning=dataclasses.replace(bench.tuning, if_all_fail=0.1))
    out = run_bench(bench, None)
    d = next(r for r in out.results if r["method"] == "d")
    assert d["params"]["lr"] is None and d["failed"] == 2
    assert not [c for c in calls if c.method == "d" and c.split == "test"]


def test_below_if_all_fail_tunes_a_method_that_fails_on_the_whole_grid() -> None:
    """``Tuning.below_if_all_fail``: a method that fails at every grid step is tried below the grid
    (÷ factor, within ``max_extensions``) and tuned there; the record lists the steps tried."""
    import dataclasses

    def run_cell(cell: Cell) -> dict[str, Any]:
        lr = cell.settings["lr"]
        if lr > 0.05:
            return {"diverged": "step too large"}
        return {"final": {"loss": abs(lr - 0.03) + cell.seed}}

    bench = Bench(name="below", title="Below", methods=("e",), points=[{"size": 1}], seeds=(0, 1),
                  metrics=(Metric("loss"),), run_cell=run_cell,
                  tuning=Tuning(param="lr", grid=(0.1, 0.3), metric="loss", max_extensions=2, if_all_fail=0.1,
                                below_if_all_fail=True))
    out = run_bench(bench, None)
    (rec,) = out.tuning
    assert rec["extended"] == [0.0333333, 0.0111111] and rec["chosen"] == 0.0333333 and not rec.get("all_failed")
    (res,) = out.results
    assert res["params"]["lr"] == 0.0333333 and res["failed"] == 0
    # off: the same method falls back to if_all_fail, unvalidated, and its test cells fail there
    off = run_bench(dataclasses.replace(bench, tuning=dataclasses.replace(bench.tuning, below_if_all_fail=False)), None)
    (rec_off,) = off.tuning
    assert rec_off["all_failed"] and rec_off["chosen"] == 0.1 and rec_off["extended"] == []
    # on, but every step below fails too: the fallback applies and the record names the steps tried below
    worse = dataclasses.replace(bench, run_cell=lambda cell: {"diverged": "always"})
    (rec_worse,) = run_bench(worse, None).tuning
    assert rec_worse["all_failed"] and rec_worse["extended"] == [0.0333333, 0.0111111]
