"""``graphfl p2p --engine inprocess``: the vectorised engine against the per-node driver, and the command."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from typer.testing import CliRunner

from graphfl.deploy.p2p_cli import make_app
from graphfl.deploy.p2p_inprocess import launch_inprocess
from graphfl.p2p.algorithms import registry
from graphfl.p2p.algorithms.base import NodeContext
from graphfl.p2p.driver import run_network_inprocess
from graphfl.p2p.mixing import mix, mixing_matrix
from graphfl.p2p.oracles import ProblemSpec, make_oracle
from graphfl.p2p.topology import make_topology
from graphfl.p2p.vectorised import MixingSlots, run_vectorised, supports


def _irregular_w(n: int = 9, seed: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    adj = np.zeros((n, n))
    for i in range(n - 1):  # a path, plus random chords: degrees 1 .. several
        adj[i, i + 1] = adj[i + 1, i] = 1
    for _ in range(2 * n):
        i, j = rng.integers(0, n, 2)
        if i != j:
            adj[i, j] = adj[j, i] = 1
    return mixing_matrix(adj)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_mixing_is_bit_identical_to_per_node_mix(dtype):
    w = _irregular_w()
    n = w.shape[0]
    x = np.random.default_rng(0).standard_normal((n, 257)).astype(dtype)
    got = MixingSlots(w).mix(x)
    assert got.dtype == dtype
    for i in range(n):
        row = {int(j): float(w[i, j]) for j in np.flatnonzero(w[i])}
        want = mix(row, {j: x[j] for j in row})
        assert np.array_equal(got[i], want), i
        # and it is the weighted sum (up to float rounding of the dtype)
        np.testing.assert_allclose(want, (w[i] @ x.astype(np.float64)), rtol=0, atol=1e-5 if dtype == np.float32 else 1e-12)


def test_contexts_for_network_equal_per_node_contexts():
    w = _irregular_w()
    adj = (w > 0).astype(float) * 2.0
    np.fill_diagonal(adj, 0)
    assert NodeContext.for_network(w, adj) == [NodeContext.from_matrix(w, i, adj) for i in range(w.shape[0])]
    assert NodeContext.for_network(w) == [NodeContext.from_matrix(w, i) for i in range(w.shape[0])]


@pytest.mark.parametrize("name,params,problem", [
    ("dfl-gt", {"alpha0": 0.02, "tau": 2}, "linreg"),
    ("dfl-sgd", {"alpha0": 0.02, "step_rule": "constant"}, "linreg"),
    ("gossip", {}, "vector"),
])
def test_vectorised_engine_matches_the_per_node_driver(name, params, problem):
    n, iterations = 6, 8
    topo = make_topology("erdos-renyi", n, seed=1, p=0.5)
    w, adj = topo.mixing_matrix(), topo.adjacency()
    spec = ProblemSpec(problem=problem, num_nodes=n, dim=5, samples=40, batch_size=8)
    algo = registry.create(name, **params)
    ref = run_network_inprocess(algo, [make_oracle(i, spec) for i in range(n)], w, iterations, adjacency=adj)
    oracles = [make_oracle(i, spec) for i in range(n)]
    assert supports(algo, oracles)
    states, curve, wire, payload = run_vectorised(algo, oracles, w, iterations)
    assert (wire, payload) == (ref.wire_bytes_per_round, ref.payload_bytes_per_round)
    assert [r["round"] for r in curve] == [r["round"] for r in ref.curve]
    assert [r["bytes"] for r in curve] == [r["bytes"] for r in ref.curve]
    for s, r in zip(states, ref.states):
        assert s.t == r.t == iterations
        if name == "gossip":  # only mixing: bit-identical
            assert np.array_equal(s.theta, r.theta)
        else:  # batched gradients round differently from per-node BLAS calls
            np.testing.assert_allclose(s.theta, r.theta, rtol=1e-10, atol=1e-12)
            assert s.theta.dtype == r.theta.dtype
        if r.tracker is not None:
            np.testing.assert_allclose(s.tracker, r.tracker, rtol=1e-10, atol=1e-12)
    for a, b in zip(curve, ref.curve):
        for key in ("train_loss", "consensus", "test_loss", "avg_model_test_loss"):
            if key in b and not np.isnan(b[key]):
                assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12), key


def test_unsupported_algorithms_fall_back_to_the_per_node_driver(tmp_path):
    algo = registry.create("admm")  # per-neighbour messages and a combine of its own: not stackable
    spec = ProblemSpec(problem="linreg", num_nodes=3)
    assert not supports(algo, [make_oracle(i, spec) for i in range(3)])
    doc = launch_inprocess("ring", 3, {"algorithm": "admm", "rounds": 3, "problem": "linreg"}, out=tmp_path / "o")
    assert doc["ok"] and doc["config"]["engine_path"] == "per-node"
    torch_spec = ProblemSpec(problem="synthetic-dfl", num_nodes=3)  # a torch task does not stack
    assert not supports(registry.create("dfl-gt"), [make_oracle(i, torch_spec) for i in range(3)])


def test_launch_inprocess_equals_per_node_path_and_writes_the_result_files(tmp_path):
    overrides = {"algorithm": "dfl-gt", "rounds": 5, "problem": "linreg", "alpha0": 0.02, "seed": 4}
    fast = launch_inprocess("ring", 5, overrides, out=tmp_path / "fast")
    slow = launch_inprocess("ring", 5, overrides, out=tmp_path / "slow", vectorise=False)
    assert fast["config"]["engine_path"] == "vectorised" and slow["config"]["engine_path"] == "per-node"
    assert fast["ok"] and slow["ok"]
    for i in range(5):
        with np.load(tmp_path / "fast" / f"peer-{i}.npz") as a, np.load(tmp_path / "slow" / f"peer-{i}.npz") as b:
            np.testing.assert_allclose(a["theta"], b["theta"], rtol=1e-10, atol=1e-12)
    for f in ("p2p.json", "p2p.md", "p2p.png", "network.toml"):
        assert (tmp_path / "fast" / f).is_file(), f
    fin_f, fin_s = fast["methods"]["dfl-gt"]["final"], slow["methods"]["dfl-gt"]["final"]
    assert fin_f["test_loss"] == pytest.approx(fin_s["test_loss"], rel=1e-9)
    assert fin_f["bytes_sent"] == fin_s["bytes_sent"] > 0
    # per-peer byte shares add up to the network's bytes (a ring: every peer sends two messages a round)
    assert sum(p["bytes_sent"] for p in fast["peers"].values()) == fin_f["bytes_sent"]


def test_a_diverged_run_is_not_reported_as_done(tmp_path):
    doc = launch_inprocess("ring", 4, {"algorithm": "dfl-sgd", "rounds": 400, "problem": "linreg", "alpha0": 1e3,
                                       "step-rule": "constant"}, out=tmp_path / "o")
    assert not doc["ok"]
    assert {p["outcome"] for p in doc["peers"].values()} == {"diverged"}


def test_cli_engine_inprocess_smoke(tmp_path):
    runner = CliRunner()
    out = tmp_path / "cli"
    res = runner.invoke(make_app(), ["p2p", "--engine", "inprocess", "--peers", "12", "--rounds", "4", "--problem",
                                     "linreg", "--topology", "ring", "--out", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "p2p.json").read_text())
    assert doc["ok"] and doc["config"]["engine"] == "inprocess" and doc["config"]["peers"] == 12
    assert doc["methods"]["dfl-gt"]["curve"][-1]["round"] == 4
    res = runner.invoke(make_app(), ["p2p", "--engine", "threads", "--out", str(tmp_path / "x"), "--quiet"])
    assert res.exit_code == 2 and "inprocess" in res.output


def test_numpy_peer_import_path_does_not_import_torch(tmp_path):
    """A peer on a numpy problem (linreg, vector, ADMM least squares) never imports torch."""
    code = textwrap.dedent(f"""
        import sys
        from graphfl.deploy.p2p_cli import make_app
        import graphfl.p2p.peer, graphfl.deploy.p2p_inprocess
        from graphfl.p2p.algorithms import registry
        registry.names()
        from graphfl.deploy.p2p_inprocess import launch_inprocess
        for algo, problem in [("dfl-gt", "linreg"), ("gossip", "vector"), ("admm", "clusters"), ("fedrelax", "clusters")]:
            doc = launch_inprocess("ring", 3, {{"algorithm": algo, "rounds": 2, "problem": problem}},
                                   out={str(tmp_path)!r} + "/" + algo, vectorise=False)
            assert doc["ok"], doc["text"]
        assert "torch" not in sys.modules, [m for m in sys.modules if m.startswith("torch")][:5]
        print("no torch")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "no torch" in res.stdout


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size", [1000, 2 * 65_536 + 123])  # one block; several blocks and a remainder
def test_local_disagreement_is_the_mean_squared_distance(dtype, size):
    from graphfl.p2p.algorithms.base import Inbox
    from graphfl.p2p.node import DISAGREEMENT_BLOCK, local_disagreement

    assert size == 1000 or size > 2 * DISAGREEMENT_BLOCK
    rng = np.random.default_rng(1)
    own = rng.standard_normal(size).astype(dtype)
    others = {j: rng.standard_normal(size).astype(dtype) for j in (2, 5)}
    others[7] = (own + 1e-4 * rng.standard_normal(size)).astype(dtype)  # nearly equal: small differences
    inbox = Inbox(0, "gossip", None, {j: {"params": {"theta": x}} for j, x in others.items()}, {})
    want = np.mean([np.sum((own.astype(np.float64) - x.astype(np.float64)) ** 2) for x in others.values()])
    # float32: each difference is rounded to float32 once (relative 6e-8)
    assert local_disagreement(own, [inbox]) == pytest.approx(want, rel=1e-6 if dtype == np.float32 else 1e-12)
    assert np.isnan(local_disagreement(own, [Inbox(0, "gossip", None, {}, {})]))
