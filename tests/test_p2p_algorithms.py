"""DFL-SGD / DFL-GT / gossip step functions, the registry, and the in-process driver (hand-computed numbers)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from graphfl.common.config import ConfigError
from graphfl.p2p.algorithms import NodeContext, NodeState, Outgoing, P2PAlgorithm, Phase, registry
from graphfl.p2p.algorithms.dfl_gt import DFLGT, G_PREV, DFLGTParams
from graphfl.p2p.algorithms.dfl_sgd import DFLSGD, DFLSGDParams
from graphfl.p2p.algorithms.gossip import Gossip, GossipParams
from graphfl.p2p.driver import consensus_distance, run_network_inprocess
from graphfl.p2p.oracles import ProblemSpec, make_oracle
from graphfl.p2p.topology import make_topology


class Quadratic:
    """f_i(θ) = ½‖θ − c_i‖², deterministic gradient; optimum of the average = mean(c_i)."""

    def __init__(self, c, theta0=None):
        self.c = np.asarray(c, np.float64)
        self.dim = self.c.size
        self.theta0 = np.zeros(self.dim) if theta0 is None else np.asarray(theta0, np.float64)

    def initial_theta(self):
        return self.theta0.copy()

    def sample(self):
        return None

    def grad(self, theta, batch):
        r = theta - self.c
        return r.copy(), float(0.5 * r @ r)

    def test_loss(self, theta):
        return float(0.5 * np.sum((theta - self.c) ** 2))


def ring_w(n):
    return make_topology("ring", n).mixing_matrix()


def sgd(tau=1, alpha0=0.5, rule="constant"):
    return DFLSGD(DFLSGDParams(tau=tau, alpha0=alpha0, step_rule=rule))


def gt(tau=1, alpha0=0.5, rule="constant", **kw):
    return DFLGT(DFLGTParams(tau=tau, alpha0=alpha0, step_rule=rule, **kw))


def test_dfl_sgd_hand_computed_first_steps():
    # 2 nodes, W = [[.5,.5],[.5,.5]] (complete graph), constant step 0.5, c = (2, -2) in 1-D.
    oracles = [Quadratic([2.0]), Quadratic([-2.0])]
    res = run_network_inprocess(sgd(), oracles, np.full((2, 2), 0.5), 1)
    # θ^1 = W θ^0 − α ∇f_i(θ^0) = 0 − 0.5 * (0 − c_i) = c_i / 2
    assert [float(s.theta[0]) for s in res.states] == [1.0, -1.0]
    res = run_network_inprocess(sgd(), oracles, np.full((2, 2), 0.5), 2)
    # θ^2 = mean(θ^1) − 0.5 (θ^1 − c_i) = 0 − 0.5 * (1 − 2) = 0.5 for node 0
    assert [float(s.theta[0]) for s in res.states] == [0.5, -0.5]


def test_dfl_gt_hand_computed_first_step_and_zero_init():
    oracles = [Quadratic([2.0]), Quadratic([-2.0])]
    w = np.full((2, 2), 0.5)
    res = run_network_inprocess(gt(), oracles, w, 1)
    # ϑ^0 = g^0 = −c_i; θ^1 = 0 − 0.5 ϑ^0 = c_i/2; ϑ^1 = mean(ϑ^0) + g(θ^1) − g^0 = 0 + (c/2 − c) + c = c/2
    assert [float(s.theta[0]) for s in res.states] == [1.0, -1.0]
    assert [float(s.tracker[0]) for s in res.states] == [1.0, -1.0]
    # seed-literal zero tracker with identical starts never moves (ALGORITHMS §3.3)
    res = run_network_inprocess(gt(init_tracker="zero"), [Quadratic([2.0]), Quadratic([2.0])], w, 5)
    assert all(float(s.theta[0]) == 0.0 for s in res.states)
    with pytest.raises(ConfigError, match="init-tracker"):
        DFLGTParams(init_tracker="random")


def test_gossip_hand_computed_consensus_step():
    """Path 0-1-2, Metropolis: W = [[1/2,1/2,0],[1/2,0,1/2]... ] — one step by hand, then the average is kept."""
    topo = make_topology("ring", 3)  # C_3 = triangle: Metropolis weights 1/3 everywhere
    w = topo.mixing_matrix()
    np.testing.assert_allclose(w, np.full((3, 3), 1 / 3), atol=1e-15)
    path_w = np.array([[0.5, 0.5, 0.0], [0.5, 0.0, 0.5], [0.0, 0.5, 0.5]])  # Metropolis on the path 0-1-2
    oracles = [Quadratic([0.0], theta0=[x]) for x in (3.0, 0.0, -6.0)]
    res = run_network_inprocess(Gossip(GossipParams()), oracles, path_w, 1)
    # θ_0 = (3 + 0)/2 = 1.5; θ_1 = (3 + (−6))/2 = −1.5; θ_2 = (0 + (−6))/2 = −3
    assert [float(s.theta[0]) for s in res.states] == [1.5, -1.5, -3.0]
    assert np.isnan(res.curve[0]["train_loss"])
    # tau = 2: iteration 1 is a local step (no change), iteration 2 mixes again
    res2 = run_network_inprocess(Gossip(GossipParams(tau=2)), oracles, path_w, 3)
    # after t=0: [1.5, −1.5, −3]; t=1 local: same; t=2: [0, −0.75, −2.25]
    assert [float(s.theta[0]) for s in res2.states] == [0.0, -0.75, -2.25]
    assert [r["round"] for r in res2.curve] == [1, 2]
    # doubly stochastic W keeps the average; many steps reach it
    res3 = run_network_inprocess(Gossip(GossipParams()), oracles, path_w, 200)
    np.testing.assert_allclose([s.theta[0] for s in res3.states], [-1.0] * 3, atol=1e-12)


@pytest.mark.parametrize("tau", [1, 3])
def test_tracker_invariant(tau):
    """(1/n) Σ ϑ_i^t = (1/n) Σ g_i^prev at every t (ALGORITHMS §3.4), stochastic gradients."""
    spec = ProblemSpec("linreg", num_nodes=5, dim=6, batch_size=8, seed=1)
    oracles = [make_oracle(i, spec) for i in range(5)]
    gaps = []

    def check(t, states):
        tr = np.mean([s.tracker for s in states], axis=0)
        gp = np.mean([s.aux[G_PREV] for s in states], axis=0)
        gaps.append(float(np.max(np.abs(tr - gp))))

    run_network_inprocess(gt(tau, 0.02), oracles, ring_w(5), 60, on_step=check)
    assert len(gaps) == 60 and max(gaps) < 1e-10
    # and with the seed's zero init the invariant is off by the initial mean gradient
    gaps.clear()
    oracles = [make_oracle(i, spec) for i in range(5)]
    run_network_inprocess(gt(tau, 0.02, init_tracker="zero"), oracles, ring_w(5), 5, on_step=check)
    assert max(gaps) > 1e-3


def test_gt_reaches_the_average_optimum_where_sgd_is_biased():
    """Heterogeneous quadratics, constant step: DFL-GT converges to mean(c); DFL-SGD does not."""
    cs = [[4.0, 0.0], [0.0, 4.0], [-4.0, 0.0], [0.0, -8.0], [1.0, 1.0]]
    target = np.mean(cs, axis=0)
    w = ring_w(5)
    res_gt = run_network_inprocess(gt(1, 0.3), [Quadratic(c) for c in cs], w, 700)
    res_sgd = run_network_inprocess(sgd(1, 0.3), [Quadratic(c) for c in cs], w, 100)
    gt_err = max(float(np.abs(s.theta - target).max()) for s in res_gt.states)
    sgd_err = max(float(np.abs(s.theta - target).max()) for s in res_sgd.states)
    assert gt_err < 1e-7
    assert sgd_err > 0.1
    assert res_gt.curve[-1]["consensus"] < 1e-12


def test_fedavg_is_dfl_sgd_with_uniform_w_and_tau():
    spec = ProblemSpec("linreg", num_nodes=4, dim=5, seed=2)
    oracles = [make_oracle(i, spec) for i in range(4)]
    res = run_network_inprocess(sgd(5, 0.01), oracles, np.full((4, 4), 0.25), 20, bytes_model="server")
    assert [r["round"] for r in res.curve] == [1, 2, 3, 4]
    assert res.curve[-1]["bytes"] == 4 * res.wire_bytes_per_round
    assert res.wire_bytes_per_round > res.payload_bytes_per_round == 2 * 4 * 5 * 8
    assert res.curve[-1]["test_loss"] < res.curve[0]["test_loss"]


def test_registry_names_params_and_errors():
    assert {"dfl-sgd", "dfl-gt", "gossip"} <= set(registry.names())
    for spec in registry.all_specs():
        algo = spec.create()
        assert isinstance(algo, P2PAlgorithm) and algo.name == spec.name
        assert set(algo.channel_names) and len(set(algo.channel_names)) == len(algo.channel_names)
    assert registry.create("dfl-gt", tau=2).period == 2
    assert registry.get("dfl-gt").make_params({"init-tracker": "zero"}) == DFLGTParams(init_tracker="zero")
    with pytest.raises(ConfigError, match="dfl-sgd"):
        registry.get("dsgd")
    with pytest.raises(ConfigError, match="tau"):
        registry.create("dfl-sgd", tau=0)
    with pytest.raises(ConfigError, match="unknown key"):
        registry.create("gossip", alpha0=0.1)
    with pytest.raises(ConfigError, match="takes GossipParams"):
        registry.get("gossip").create(DFLSGDParams())


class EdgeCounter(P2PAlgorithm[GossipParams, Quadratic]):
    """A toy with per-neighbour messages and per-edge state: node i sends (i + j) to j and keeps a sum per edge."""

    name = "edge-counter"
    phases = (Phase("count", ("count",)),)

    def channels(self, state, ctx):
        return {"count": {"x": ("float64", (1,))}}

    def init(self, oracle, ctx):
        return NodeState(t=0, theta=np.zeros(1), edges={j: {"sum": np.zeros(1)} for j in ctx.neighbours})

    def outgoing(self, state, phase, combined, ctx):
        return Outgoing.per_neighbour({j: {"count": {"x": np.array([float(ctx.node + 10 * j)])}} for j in ctx.neighbours})

    def combine(self, state, inbox, ctx):
        return {f"from-{j}": msg["count"] for j, msg in inbox.messages.items()}

    def step(self, state, combined, oracle, ctx):
        edges = {j: {"sum": e["sum"] + combined[f"from-{j}"]["x"]} for j, e in state.edges.items()}
        return NodeState(t=state.t + 1, theta=state.theta, edges=edges)


def test_per_neighbour_messages_and_edge_state_in_process():
    w = ring_w(4)
    res = run_network_inprocess(EdgeCounter(GossipParams()), [Quadratic([0.0]) for _ in range(4)], w, 2)
    for i, s in enumerate(res.states):
        ctx = NodeContext.from_matrix(w, i)
        assert sorted(s.edges) == list(ctx.neighbours)
        for j in ctx.neighbours:  # j sent (j + 10 i) to i, twice
            assert float(s.edges[j]["sum"][0]) == 2 * (j + 10 * i)


def test_consensus_distance():
    assert consensus_distance([np.array([1.0, 0.0]), np.array([-1.0, 0.0])]) == 1.0


def test_the_documented_example_algorithm_registers_and_runs(monkeypatch):
    """The worked example of docs/p2p.md ("Writing a p2p algorithm"), executed as written."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "p2p.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "class MaxConsensus" in b)
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # the toy stays out of other tests
    exec(compile(block, "docs/p2p.md", "exec"), {"__name__": "mymax"})
    assert "max-consensus" in registry.names()
    spec = ProblemSpec("vector", num_nodes=5, dim=3)
    oracles = [make_oracle(i, spec) for i in range(5)]
    target = np.max([o.initial_theta() for o in oracles], axis=0)
    res = run_network_inprocess(registry.create("max-consensus"), oracles, ring_w(5), 2)  # C_5 has diameter 2
    for s in res.states:
        np.testing.assert_array_equal(s.theta, target)
        assert len(s.edges) == 2  # per-edge state: the last value heard from each ring neighbour
