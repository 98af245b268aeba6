"""graphfl dashboard: the learned graph over rounds (JGESR's graph, BiG-FL's φ), capped for the page,
and bytes per p2p link (the transport's per-neighbour counters, peer-<id>.json, the topology view).

Real in-process runs (2 rounds) and a real dashboard server on 127.0.0.1; no browser (the slider is
driven in tests/test_dashboard_browser.py).
"""

from __future__ import annotations

import copy
import json
import os
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from graphfl.common.config import parse_run_config
from graphfl.dashboard.readers import MAX_GRAPH_EDGES, MAX_GRAPH_ROUNDS, SnapshotCache, snapshot
from graphfl.dashboard.server import make_server, serve_in_thread
from graphfl.p2p.transport import InProcessHub
from graphfl.strategies.bigfl import PHI_LOGGED_EDGES, phi_edges


def _run(out: Path, **extra: object) -> Path:
    from graphfl.deploy.run import run_experiment

    values = {"engine": "inprocess", "rounds": 2, "nodes": 4, "train.local-steps": 3, "out-dir": str(out), **extra}
    return run_experiment(parse_run_config(values))


@pytest.fixture(scope="module")
def jgesr_folder(tmp_path_factory) -> Path:
    """A real JGESR run: 4 clients, 2 rounds, the learned graph logged every round."""
    return _run(tmp_path_factory.mktemp("dash") / "jgesr", strategy="jgesr")


@pytest.fixture(scope="module")
def bigfl_folder(tmp_path_factory) -> Path:
    """A real BiG-FL run on the multicenter task (6 clients in 2 groups, d = 512): φ's strongest entries logged every round."""
    return _run(tmp_path_factory.mktemp("dash") / "bigfl", strategy="bigfl", task="synthetic-multicenter", nodes=6,
                **{"bigfl.hypergrad-mode": "reg_only"})


def _curve(folder: Path) -> list[dict]:
    doc = json.loads((folder / "run.json").read_text())
    return next(iter(doc["methods"].values()))["curve"]


# -- the learned graph over rounds ------------------------------------------------------------------

def test_jgesr_learned_graph_of_every_round(jgesr_folder):
    graph = snapshot(jgesr_folder)["graph"]
    logged = [r for r in _curve(jgesr_folder) if "graph" in (r.get("server") or {})]
    assert [g["round"] for g in graph["rounds"]] == [r["round"] for r in logged] == [1, 2]
    assert graph["rounds_logged"] == 2 and graph["cap"] == ""
    for shown, row in zip(graph["rounds"], logged, strict=True):
        m = np.array(row["server"]["graph"])
        want = {(i, j): (m[i, j] + m[j, i]) / 2 for i in range(4) for j in range(i + 1, 4) if m[i, j] + m[j, i] != 0}
        got = {(int(i), int(j)): w for i, j, w in shown["edges"]}
        assert got.keys() == want.keys()
        assert [got[k] for k in want] == pytest.approx(list(want.values()), rel=1e-6)
        assert shown["nodes"] is None and shown["title"].endswith(f"after round {row['round']}")
    assert graph["edges"] == graph["rounds"][-1]["edges"], "the top-level graph is the newest round's"
    assert graph["rounds"][0]["edges"] != graph["rounds"][1]["edges"], "the graph is learned: it moves"
    assert len(graph["nodes"]) == 4


def _synthetic_run(folder: Path, template: Path, rounds: int, n: int) -> None:
    """``template``'s run.json with ``rounds`` curve rows, each logging a dense ``n x n`` graph."""
    doc = json.loads((template / "run.json").read_text())
    method = next(iter(doc["methods"]))
    row = doc["methods"][method]["curve"][-1]
    rng = np.random.default_rng(0)
    curve = []
    for r in range(1, rounds + 1):
        m = rng.uniform(0.01, 1.0, (n, n))
        m = (m + m.T) / 2
        np.fill_diagonal(m, 0.0)
        curve.append({**copy.deepcopy(row), "round": r, "server": {"graph": m.round(6).tolist()}})
    doc["methods"][method]["curve"] = curve
    doc["config"]["rounds"] = rounds
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.json").write_text(json.dumps(doc))


def test_many_rounds_and_clients_are_capped_and_the_page_says_so(jgesr_folder, tmp_path):
    rounds, n = 3 * MAX_GRAPH_ROUNDS + 7, 30  # 30 clients: 435 edges a round, over the edge cap
    _synthetic_run(tmp_path / "big", jgesr_folder, rounds, n)
    graph = snapshot(tmp_path / "big")["graph"]
    shown = [g["round"] for g in graph["rounds"]]
    assert len(shown) == MAX_GRAPH_ROUNDS and shown[0] == 1 and shown[-1] == rounds and shown == sorted(shown)
    assert graph["rounds_logged"] == rounds
    assert f"{MAX_GRAPH_ROUNDS} of the {rounds} rounds" in graph["cap"]
    assert f"{MAX_GRAPH_EDGES} strongest edges" in graph["cap"]
    doc = json.loads((tmp_path / "big" / "run.json").read_text())
    last = np.array(next(iter(doc["methods"].values()))["curve"][-1]["server"]["graph"])
    weights = sorted(last[np.triu_indices(n, 1)], reverse=True)
    newest = graph["rounds"][-1]
    assert len(newest["edges"]) == MAX_GRAPH_EDGES and newest["total_edges"] == n * (n - 1) // 2
    assert min(abs(e[2]) for e in newest["edges"]) == pytest.approx(weights[MAX_GRAPH_EDGES - 1], rel=1e-6), \
        "the edges kept are the strongest"
    # bounded: what the page polls is at most ~40 bytes per edge shown, whatever the run logged
    assert len(json.dumps(graph)) < 40 * MAX_GRAPH_ROUNDS * MAX_GRAPH_EDGES + 10_000


def test_the_graph_view_is_computed_once_per_version_of_run_json(jgesr_folder, tmp_path):
    _synthetic_run(tmp_path / "run", jgesr_folder, 5, 6)
    cache = SnapshotCache()
    first = snapshot(tmp_path / "run", cache)["graph"]
    assert snapshot(tmp_path / "run", cache)["graph"] is first, "recomputed although run.json did not change"
    _synthetic_run(tmp_path / "run", jgesr_folder, 6, 6)  # the next round: the file is rewritten
    os.utime(tmp_path / "run" / "run.json", (1, 1))
    again = snapshot(tmp_path / "run", cache)["graph"]
    assert [g["round"] for g in again["rounds"]] == [1, 2, 3, 4, 5, 6]


# -- BiG-FL's phi -------------------------------------------------------------------------------------

def test_phi_edges_are_the_largest_off_diagonal_entries():
    rng = np.random.default_rng(3)
    m = np.eye(12) + rng.normal(0, 0.1, (12, 12))
    got = phi_edges(torch.as_tensor(m), 10)
    off = np.abs(m - np.diag(np.diag(m)))
    want = sorted(zip(*np.unravel_index(np.argsort(-off, axis=None)[:10], m.shape), strict=True))
    assert [(i, j) for i, j, _ in got] == [(int(i), int(j)) for i, j in want]
    assert [v for _, _, v in got] == pytest.approx([m[i, j] for i, j in want], abs=1e-6)
    assert phi_edges(torch.eye(5, dtype=torch.float64), 10) == [], "phi = I has no off-diagonal entry"


def test_bigfl_writes_phi_every_round_and_the_dashboard_draws_it(bigfl_folder):
    rows = [r for r in _curve(bigfl_folder) if r.get("round", 0) > 0]
    assert [r["round"] for r in rows] == [1, 2]
    for r in rows:
        server = r["server"]
        assert server["phi_dim"] == 512
        assert len(server["phi_edges"]) == PHI_LOGGED_EDGES
        assert all(i != j and 0 <= i < 512 and 0 <= j < 512 for i, j, _ in server["phi_edges"])
        assert server["phi_minus_identity"] > 0
    snap = snapshot(bigfl_folder)
    graph = snap["graph"]
    assert [g["round"] for g in graph["rounds"]] == [1, 2]
    newest, last = graph["rounds"][-1], rows[-1]["server"]
    logged = {(i, j): v for i, j, v in last["phi_edges"]}
    drawn = {(min(i, j), max(i, j)) for i, j in logged}
    assert {(e[0], e[1]) for e in newest["edges"]} == drawn
    for (a, b, w), note in zip(newest["edges"], newest["edge_note"], strict=True):
        both = [v for k, v in logged.items() if k in ((a, b), (b, a))]
        assert w == max(both, key=abs) and "φ[" in note
    assert {nd["id"] for nd in newest["nodes"]} == {k for e in drawn for k in e}, "nodes are parameter indices"
    assert "‖φ − I‖_F" in newest["title"] and f"{last['phi_minus_identity']:.4g}" in newest["title"]
    assert graph["nodes"] == newest["nodes"]


def test_the_state_endpoint_serves_the_rounds(jgesr_folder, bigfl_folder):
    srv = make_server([jgesr_folder, bigfl_folder])
    serve_in_thread(srv)
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/api/state"
        with urllib.request.urlopen(url, timeout=30) as resp:
            state = json.loads(resp.read())
    finally:
        srv.shutdown()
        srv.server_close()
    jg, bf = state["folders"]
    assert [g["round"] for g in jg["graph"]["rounds"]] == [1, 2]
    assert [g["round"] for g in bf["graph"]["rounds"]] == [1, 2] and bf["graph"]["rounds"][0]["edge_note"]


# -- bytes per p2p link -----------------------------------------------------------------------------

def test_transport_counts_bytes_per_link():
    hub = InProcessHub()
    ring = {0: [1, 2], 1: [0, 2], 2: [0, 1]}
    ts = {i: hub.transport(i, nb) for i, nb in ring.items()}
    for t in ts.values():
        t.mailbox.expect("theta", None)
    sizes = {0: 10, 1: 1000, 2: 100}
    for i, nbs in ring.items():
        for j in nbs:
            assert ts[i].send(j, 0, "theta", {"x": np.zeros(sizes[i] * (1 + j))}).ok
    for i, t in ts.items():
        links, stats = t.link_stats(), t.stats()
        assert set(links) == {str(j) for j in ring[i]}
        assert sum(v["bytes_sent"] for v in links.values()) == stats["bytes_sent"]
        assert sum(v["bytes_received"] for v in links.values()) == stats["bytes_received"]
        for j in ring[i]:
            assert links[str(j)]["bytes_sent"] == ts[j].link_stats()[str(i)]["bytes_received"]
    assert ts[1].link_stats()["2"]["bytes_sent"] > ts[1].link_stats()["0"]["bytes_sent"] > 8000
    # a refused message (a duplicate) is not counted on the link
    before = ts[0].link_stats()
    assert not ts[0].send(1, 0, "theta", {"x": np.zeros(10)}).ok
    assert ts[0].link_stats() == before


def test_topology_edges_carry_the_bytes_of_their_link(tmp_path):
    network = """peers = [{ id = 0, address = "127.0.0.1:1" }, { id = 1, address = "127.0.0.1:2" },
    { id = 2, address = "127.0.0.1:3" }]
[network]
name = "path-3"
[[edges]]
nodes = [0, 1]
weight = 0.5
[[edges]]
nodes = [1, 2]
weight = 0.5
[run]
algorithm = "dfl-gt"
rounds = 3
"""
    (tmp_path / "network.toml").write_text(network)
    (tmp_path / "peer-0.json").write_text(json.dumps(
        {"peer": 0, "outcome": "done", "records": [], "links": {"1": {"bytes_sent": 100, "bytes_received": 70}}}))
    # peer 1 still running: its status file carries the links; peer 2 wrote nothing yet
    (tmp_path / "peer-1.status.json").write_text(json.dumps(
        {"peer": 1, "state": "running", "round": 2, "links": {"0": {"bytes_sent": 70, "bytes_received": 100},
                                                              "2": {"bytes_sent": 40, "bytes_received": 5}}}))
    graph = snapshot(tmp_path)["graph"]
    assert [e[:2] for e in graph["edges"]] == [[0, 1], [1, 2]]
    assert graph["edge_bytes"] == [[100, 70], [40, 5]], "2 -> 1 from what peer 1 received"
    assert "bytes sent both ways" in graph["title"]
    (tmp_path / "peer-1.status.json").unlink()
    assert snapshot(tmp_path)["graph"]["edge_bytes"] == [[100, 70], None]
