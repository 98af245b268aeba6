"""The one-node loop over a transport (threads + InProcessTransport): same iterates, failure policy,
skip-ahead, and local errors that must raise instead of looking like an unreachable neighbour."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from graphfl.p2p.algorithms import NodeContext, Outgoing, registry
from graphfl.p2p.algorithms.gossip import Gossip, GossipParams
from graphfl.p2p.codec import WireError
from graphfl.p2p.driver import run_network_inprocess, run_node
from graphfl.p2p.exchange import FailurePolicy, NeighbourExchange, RoundFailed
from graphfl.p2p.oracles import ProblemSpec, make_oracle
from graphfl.p2p.topology import make_topology
from graphfl.p2p.transport import InProcessHub


class Network:
    """n nodes on a ring, one thread each, InProcessTransport (encode/decode through the codec)."""

    def __init__(self, algo, n, spec, policy=None, down=(), horizon=64):
        self.algo, self.n, self.spec = algo, n, spec
        self.topo = make_topology("ring", n)
        self.w = self.topo.mixing_matrix()
        self.hub = InProcessHub()
        self.oracles = [make_oracle(i, spec) for i in range(n)]
        self.ctxs = [NodeContext.from_matrix(self.w, i, self.topo.adjacency()) for i in range(n)]
        self.states = [algo.init(o, c) for o, c in zip(self.oracles, self.ctxs)]
        self.transports = [self.hub.transport(i, self.topo.neighbours(i), horizon) for i in range(n)]
        for tr, st, ctx in zip(self.transports, self.states, self.ctxs):
            for ch, specs in algo.channels(st, ctx).items():
                tr.mailbox.expect(ch, specs)
        self.hub.down.update(down)
        self.policy = policy or FailurePolicy(round_timeout=10)
        self.runs, self.errors, self.threads = {}, {}, {}

    def start(self, i, iterations, **kw):
        def go():
            try:
                ex = NeighbourExchange(self.transports[i], self.ctxs[i].row, self.policy)
                self.runs[i] = run_node(self.algo, self.oracles[i], ex, iterations, ctx=self.ctxs[i],
                                        state=self.states[i], **kw)
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                self.errors[i] = exc

        th = self.threads[i] = threading.Thread(target=go, daemon=True)
        th.start()

    def join(self, timeout=60):
        for th in self.threads.values():
            th.join(timeout)
        for t in self.transports:
            t.close()
        return self


def run_all(algo, n, iterations, spec, **kw):
    net = Network(algo, n, spec, **kw)
    for i in range(n):
        if i not in net.hub.down:
            net.start(i, iterations)
    return net.join()


@pytest.mark.parametrize("name", registry.names())
def test_threaded_transport_matches_inprocess(name):
    spec_ = registry.get(name)
    params = spec_.make_params({k: v for k, v in spec_.example.items() if k in spec_.param_keys()})
    problem = ProblemSpec(str(spec_.example.get("problem", "linreg")), num_nodes=4, dim=5, batch_size=5, seed=3)
    algo = spec_.create(params)
    iterations = 6 * algo.period
    net = run_all(algo, 4, iterations, problem)
    assert not net.errors
    ref = run_network_inprocess(spec_.create(params), [make_oracle(i, problem) for i in range(4)], net.w, iterations,
                                adjacency=net.topo.adjacency())
    for i in range(4):
        np.testing.assert_array_equal(net.runs[i].state.theta, ref.states[i].theta)
        if ref.states[i].tracker is not None:
            np.testing.assert_array_equal(net.runs[i].state.tracker, ref.states[i].tracker)
    rec = net.runs[0].records[-1]
    assert rec["bytes_sent"] > rec["payload_sent"] > 0 and rec["missing"] == []


def test_dfl_sgd_tau_2_threaded_matches_inprocess():
    algo = registry.create("dfl-sgd", tau=2, alpha0=0.05)
    problem = ProblemSpec("linreg", num_nodes=4, dim=7, batch_size=5, seed=3)
    net = run_all(algo, 4, 12, problem)
    ref = run_network_inprocess(registry.create("dfl-sgd", tau=2, alpha0=0.05), [make_oracle(i, problem) for i in range(4)],
                                net.w, 12)
    for i in range(4):
        np.testing.assert_array_equal(net.runs[i].state.theta, ref.states[i].theta)
    assert [r["round"] for r in net.runs[1].records] == [r["round"] for r in ref.curve] == [1, 2, 3, 4, 5, 6]


def test_skip_policy_with_a_dead_peer():
    net = run_all(registry.create("dfl-sgd", alpha0=0.02), 4, 10, ProblemSpec("linreg", num_nodes=4, dim=3), down={2})
    assert not net.errors and sorted(net.runs) == [0, 1, 3]
    assert net.runs[1].records[0]["missing"] == [2] and net.runs[0].records[0]["missing"] == []
    assert np.all(np.isfinite(net.runs[1].state.theta))


def test_fail_policy_names_the_missing_peer():
    net = run_all(registry.create("dfl-sgd"), 4, 5, ProblemSpec("linreg", num_nodes=4, dim=3),
                  policy=FailurePolicy("fail", round_timeout=0.3), down={2})
    assert isinstance(net.errors.get(1), RoundFailed) and "[2]" in str(net.errors[1])


def test_a_lagging_node_skips_ahead_to_its_neighbours_round():
    """Node 2 starts late, at t = 0, while its neighbours are past round 10: it jumps to their round."""
    net = Network(Gossip(GossipParams()), 3, ProblemSpec("vector", num_nodes=3, dim=4), down={2},
                  policy=FailurePolicy(round_timeout=5, send_timeout=5))
    for i in (0, 1):
        net.start(i, 40, min_round_seconds=0.02)
    deadline = time.monotonic() + 30
    while len(net.transports[2].mailbox.latest_rounds()) < 2 and time.monotonic() < deadline:
        if net.transports[0].mailbox.latest_round() >= 10:
            net.hub.down.discard(2)  # node 2's mailbox starts receiving; its loop has not started yet
        time.sleep(0.01)
    assert min(net.transports[2].mailbox.latest_rounds().values()) >= 10
    net.start(2, 40)
    net.join()
    assert not net.errors, net.errors
    recs = net.runs[2].records
    assert recs[0]["skipped_from"] == [0] and recs[0]["round"] > 10
    assert recs[-1]["round"] == 40 and all(r["skipped_from"] == [] for r in recs[1:])
    assert net.runs[0].records[-1]["missing"] == []  # node 2 is heard again by the end
    assert recs[-1]["missing"] == []


class ComplexGossip(Gossip):
    """Sends complex numbers, which the wire cannot carry: a local bug, not an unreachable neighbour."""

    def outgoing(self, state, phase, combined, ctx):
        return Outgoing.to_all({"params": {"theta": state.theta.astype(np.complex128)}})


def test_a_local_encoding_error_raises_instead_of_skipping_the_neighbour():
    net = run_all(ComplexGossip(GossipParams()), 3, 2, ProblemSpec("vector", num_nodes=3, dim=4))
    assert sorted(net.errors) == [0, 1, 2]
    assert all(isinstance(e, WireError) and "complex128" in str(e) for e in net.errors.values())
