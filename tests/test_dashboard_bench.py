"""graphfl dashboard on benchmark result folders: the comparison view (methods with mean ± sd and
seeds, paired differences, verdicts) read from graphfl's own committed results, one reader for
every layout; plus the cache's one view per name and unreported link directions. No browser, no
processes: pure reads, fast.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest

from graphfl.dashboard import bench_results
from graphfl.dashboard.readers import SnapshotCache, snapshot

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
STATUSES = {"reproduced", "not reproduced", "not testable"}


def _doc(folder: str, name: str) -> dict:
    return json.loads((RESULTS / folder / name).read_text())


def _bench(folder: str) -> dict:
    snap = snapshot(RESULTS / folder)
    assert snap["kind"] == "bench", snap["messages"]
    assert snap["status"] == "results" and not snap["messages"] and snap["error"] is None
    (view,) = snap["bench"]
    assert len(json.dumps(snap)) < 200_000, "the snapshot stays small"
    return view


def _mean_sd(cell: str) -> tuple[float, float]:
    mean, sd = cell.split(" ± ")
    return float(mean), float(sd)


def _check_verdicts(view: dict, doc: dict) -> None:
    structured = {k: v["verdict"] for k, v in doc["verdicts"].items()}
    shown = {v["name"]: v["status"] for v in view["verdicts"] if v["status"] is not None}
    assert shown == structured
    assert set(structured.values()) <= STATUSES
    for v in view["verdicts"]:
        if v["status"] is not None:
            assert v["text"] and v["text"][:40] == doc["verdicts"][v["name"]]["claim"][:40]


@pytest.mark.parametrize("folder,name", [("dfl-full", "dfl.json"), ("admm-full", "admm.json")])
def test_harness_results_with_points_seeds_pairs_and_verdicts(folder, name):
    doc, view = _doc(folder, name), _bench(folder)
    assert view["layout"] == "harness"
    assert view["methods"] == len({r["method"] for r in doc["results"]})
    n = min(len(doc["results"]), bench_results.MAX_ROWS)
    assert len(view["rows"]) == n
    first, row = doc["results"][0], view["rows"][0]
    assert row["method"] == first["method"] and row["seeds"] == len(first["seeds"])
    assert all(f"{k}={v}" in row["point"] for k, v in first["point"].items())
    metric = next(iter(first["metrics"]))
    mean, sd = _mean_sd(row["cells"][metric])
    assert mean == pytest.approx(first["metrics"][metric]["mean"], rel=1e-3)
    assert sd == pytest.approx(first["metrics"][metric]["sd"], rel=1e-3)
    pair = doc["paired"][0]
    assert view["paired"]["rows"][0]["pair"] == f"{pair['a']} − {pair['b']}"
    m = next(iter(pair["metrics"]))
    assert f"better on {pair['metrics'][m]['first_better']}/{pair['metrics'][m]['seeds']}" in \
        view["paired"]["rows"][0]["cells"][m]
    _check_verdicts(view, doc)
    if len(doc["results"]) > bench_results.MAX_ROWS:
        assert any(f"of {len(doc['results'])} method rows" in c for c in view["caps"])


def test_dfl_regime_on_the_harness_and_its_cells():
    doc, view = _doc("dfl-regime", "dfl_regime.json"), _bench("dfl-regime")
    assert view["layout"] == "harness" and view["name"] == "dfl_regime"
    assert view["methods"] == len({r["method"] for r in doc["results"]}) == 4
    assert len(view["rows"]) == min(len(doc["results"]), bench_results.MAX_ROWS)
    first, row = doc["results"][0], view["rows"][0]
    assert row["method"] == first["method"] and row["seeds"] == len(first["seeds"])
    assert _mean_sd(row["cells"]["global"])[0] == pytest.approx(first["metrics"]["global"]["mean"], rel=1e-3)
    pair = doc["paired"][0]
    assert view["paired"]["rows"][0]["pair"] == "dfl-gt − dfl-sgd"
    assert f"better on {pair['metrics']['global']['first_better']}/{pair['metrics']['global']['seeds']}" in \
        view["paired"]["rows"][0]["cells"]["global"]
    assert [v["text"] for v in view["verdicts"]] == [bench_results.short(t) for t in
                                                     doc["summary"][: bench_results.MAX_VERDICTS]]
    # the same document without the harness's tables: the ``cells`` layout (results written before the harness)
    cells_doc = {k: v for k, v in doc.items() if k not in ("results", "paired")}
    view = bench_results.view("dfl_regime.json", cells_doc)
    assert view["layout"] == "cells"
    methods = {m for c in doc["cells"] for m in c["results"]}
    assert view["methods"] == len(methods) == 4
    total = sum(len(c["results"]) for c in doc["cells"])
    assert len(view["rows"]) == min(total, bench_results.MAX_ROWS)
    assert any(f"of {total} method rows" in c for c in view["caps"]), "the cap is said"
    cell, row = doc["cells"][0], view["rows"][0]
    m = next(iter(cell["results"]))
    assert row["method"] == m and row["seeds"] == cell["results"][m]["metrics"]["global"]["n"]
    assert _mean_sd(row["cells"]["global"])[0] == pytest.approx(cell["results"][m]["metrics"]["global"]["mean"],
                                                                rel=1e-3)
    p = view["paired"]["rows"][0]
    assert p["pair"] == "gt − sgd" and f"verdict: {cell['verdict']}" in p["note"]


def test_engine_table_rows():
    doc, view = _doc("engine-quick", "engine.json"), _bench("engine-quick")
    assert view["layout"] == "rows"
    assert len(view["rows"]) == len(doc["rows"])
    assert view["methods"] == len({r["engine"] for r in doc["rows"]})
    first, row = doc["rows"][0], view["rows"][0]
    assert row["method"] == first["engine"] and f"task={first['task']}" in row["point"]
    assert float(row["cells"]["round_s"]) == pytest.approx(first["round_s"], rel=1e-3)


@pytest.mark.parametrize("folder,name", [("multicenter-full", "multicenter.json"),
                                         ("multicenter-quick-bigfl-fix", "multicenter-bigfl.json")])
def test_multicenter_settings(folder, name):
    doc, view = _doc(folder, name), _bench(folder)
    assert view["layout"] == "settings"
    expected = []
    for setting, body in doc["results"].items():
        entries = body.get("methods") or {k: v for k, v in body.items() if isinstance(v, dict) and "final" in v}
        expected += [(setting, m, e) for m, e in entries.items()]
    assert view["methods"] == len({m for _, m, _ in expected}) and len(view["rows"]) == len(expected)
    setting, m, e = expected[0]
    row = view["rows"][0]
    assert row["point"].startswith(setting) and row["method"] == m
    assert row["seeds"] == len(e["final"]["per_seed"])
    mean, sd = _mean_sd(row["cells"]["test_loss"])
    assert mean == pytest.approx(e["final"]["test_loss"], rel=1e-3)
    assert sd == pytest.approx(e["final"]["test_loss_sd"], rel=1e-3)
    if "verdicts" in doc:
        _check_verdicts(view, doc)


def test_a_json_that_is_not_a_graphfl_result_gets_a_clear_message(tmp_path):
    (tmp_path / "package.json").write_text(json.dumps({"name": "left-pad", "version": "1.3.0",
                                                       "results": {"ok": True}}))
    snap = snapshot(tmp_path)
    assert snap["kind"] == "unknown" and snap["bench"] is None
    assert any("not a graphfl output folder" in m for m in snap["messages"])
    assert any(m.startswith("package.json: not a graphfl benchmark result") for m in snap["messages"])


def test_a_future_harness_bench_is_read_and_its_failures_shown(tmp_path):
    stat = {"mean": 0.5, "sd": 0.1, "per_seed": [0.4, 0.5, 0.6], "n": 3}
    results = [{"point": {"k": i}, "method": m, "seeds": [0, 1, 2], "failed": 0, "failures": [],
                "skipped": None, "metrics": {"acc": stat}} for i in range(100) for m in ("a", "b")]
    results[1] |= {"failed": 1, "failures": ["b, k=0, seed 2: loss non-finite at round 3"]}
    paired = [{"point": {"k": i}, "a": "a", "b": "b", "metrics": {"acc": {**stat, "first_better": 2, "seeds": 3}}}
              for i in range(100)]
    (tmp_path / "new.json").write_text(json.dumps({"name": "new", "results": results, "paired": paired}))
    snap = snapshot(tmp_path)
    (view,) = snap["bench"]
    assert view["methods"] == 2 and len(view["rows"]) == bench_results.MAX_ROWS
    assert view["rows"][1]["failed"] == 1 and "loss non-finite" in view["rows"][1]["error"]
    assert len(view["paired"]["rows"]) == bench_results.MAX_PAIRED
    assert "showing the first 120 of 200 method rows" in view["caps"]
    assert "showing the first 60 of 100 paired differences" in view["caps"]


def _run_json(folder: Path, rounds: int, stamp: float) -> None:
    curve = [{"round": r, "seconds": 0.1, "test_loss": 1.0 / (r + 1),
              "server": {"graph": [[0, 0.5], [0.5, 0]]}} for r in range(rounds + 1)]
    (folder / "run.json").write_text(json.dumps({"status": "running", "config": {"rounds": 50},
                                                 "methods": {"jgesr": {"curve": curve}}}))
    os.utime(folder / "run.json", (stamp, stamp))


def test_a_run_json_rewritten_every_poll_keeps_one_view_and_one_document(tmp_path):
    cache = SnapshotCache()
    other = tmp_path / "other"
    other.mkdir()
    _run_json(other, 1, 1000.0)
    snapshot(other, cache)
    for r in range(1, 30):
        _run_json(tmp_path, r, 1000.0 + r)
        snap = snapshot(tmp_path, cache)
        assert snap["graph"] is not None and snap["last_round"] == r
    names = list(cache._derived)
    assert len(names) == 2 and sorted(names) == sorted([f"graph {tmp_path}", f"graph {other}"])
    gc.collect()
    held = [d for d, _ in cache._derived.values()]
    assert held[names.index(f"graph {tmp_path}")]["methods"]["jgesr"]["curve"][-1]["round"] == 29
    # the other folder's view survived the 29 rewrites: computed once, returned again
    calls = []
    doc = held[names.index(f"graph {other}")]
    assert cache.derived(doc, f"graph {other}", lambda: calls.append(1)) is not None and not calls


def test_a_link_direction_nobody_reported_is_none_not_zero_bytes(tmp_path):
    (tmp_path / "network.toml").write_text(
        'peers = [{ id = 0, address = "127.0.0.1:1" }, { id = 1, address = "127.0.0.1:2" }]\n'
        '[network]\nname = "pair"\n[[edges]]\nnodes = [0, 1]\nweight = 1.0\n[run]\nalgorithm = "dfl-gt"\nrounds = 3\n')
    (tmp_path / "peer-0.json").write_text(json.dumps(
        {"peer": 0, "outcome": "done", "records": [], "links": {"1": {"bytes_sent": 100}}}))
    assert snapshot(tmp_path)["graph"]["edge_bytes"] == [[100, None]]
