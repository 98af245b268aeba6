"""Two-phase rounds with per-neighbour messages and per-edge state (the shape of FedADMM, ALGORITHMS §6.6).

``EdgeMean``: phase ``value`` sends ``θ_i`` to every neighbour; the owner ``max(i, j)`` of each
edge computes ``e_ij = (θ_i + θ_j) / 2`` and, in phase ``edge``, sends it only to the other
endpoint; every node keeps ``e_ij`` per edge and moves to ``θ_i ← (θ_i + Σ_j e_ij) / (1 + d_i)``.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np

from graphfl.p2p.algorithms import NodeContext, NodeState, Outgoing, P2PAlgorithm, Phase
from graphfl.p2p.algorithms.gossip import GossipParams
from graphfl.p2p.driver import run_network_inprocess, run_node
from graphfl.p2p.exchange import FailurePolicy, NeighbourExchange
from graphfl.p2p.oracles import ProblemSpec, make_oracle
from graphfl.p2p.topology import make_topology
from graphfl.p2p.transport import InProcessHub

VALUE, EDGE = Phase("value", ("value",)), Phase("edge", ("edge",))


class EdgeMean(P2PAlgorithm[GossipParams, object]):
    name = "edge-mean"
    phases = (VALUE, EDGE)

    def channels(self, state, ctx):
        spec = (state.theta.dtype.name, state.theta.shape)
        return {"value": {"x": spec}, "edge": {"e": spec}}

    def init(self, oracle, ctx):
        theta = np.asarray(oracle.initial_theta(), np.float64)
        return NodeState(t=0, theta=theta, edges={j: {"e": theta.copy()} for j in ctx.neighbours})

    def senders(self, phase, ctx):
        if phase.name == "edge":  # the owners of my other edges
            return tuple(j for j in ctx.neighbours if j > ctx.node)
        return ctx.neighbours

    def outgoing(self, state, phase, combined, ctx):
        if phase.name == "value":
            return Outgoing.to_all({"value": {"x": state.theta}})
        owned = {j: {"edge": {"e": combined[f"edge-{j}"]["e"]}} for j in ctx.neighbours
                 if j < ctx.node and f"edge-{j}" in combined}
        return Outgoing.per_neighbour(owned)

    def combine(self, state, inbox, ctx):
        if inbox.phase == "value":  # as owner: the edge step for every owned edge heard from
            return {f"edge-{j}": {"e": (state.theta + msg["value"]["x"]) / 2}
                    for j, msg in inbox.messages.items() if j < ctx.node}
        return {f"edge-{j}": msg["edge"] for j, msg in inbox.messages.items()}

    def step(self, state, combined, oracle, ctx):
        edges = dict(state.edges)
        for j in ctx.neighbours:
            if combined is not None and f"edge-{j}" in combined:
                edges[j] = {"e": combined[f"edge-{j}"]["e"]}
        total = state.theta + sum((e["e"] for e in edges.values()), np.zeros_like(state.theta))
        return replace(state, t=state.t + 1, theta=total / (1 + len(edges)), edges=edges)


def threaded(algo, n, iterations, down=(), round_timeout=10.0):
    topo = make_topology("ring", n)
    w = topo.mixing_matrix()
    spec = ProblemSpec("vector", num_nodes=n, dim=3)
    oracles = [make_oracle(i, spec) for i in range(n)]
    ctxs = [NodeContext.from_matrix(w, i) for i in range(n)]
    states = [algo.init(o, c) for o, c in zip(oracles, ctxs)]
    hub = InProcessHub()
    trs = [hub.transport(i, topo.neighbours(i)) for i in range(n)]
    for tr, st, c in zip(trs, states, ctxs):
        for ch, specs in algo.channels(st, c).items():
            tr.mailbox.expect(ch, specs)
    hub.down.update(down)
    runs = {}

    def go(i):
        ex = NeighbourExchange(trs[i], ctxs[i].row, FailurePolicy(round_timeout=round_timeout, send_timeout=2))
        runs[i] = run_node(algo, oracles[i], ex, iterations, ctx=ctxs[i], state=states[i])

    ths = [threading.Thread(target=go, args=(i,)) for i in range(n) if i not in down]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    for tr in trs:
        tr.close()
    return runs, w, oracles


def test_two_phases_per_neighbour_messages_same_in_both_drivers():
    runs, w, _ = threaded(EdgeMean(GossipParams()), 4, 5)
    ref = run_network_inprocess(EdgeMean(GossipParams()), [make_oracle(i, ProblemSpec("vector", num_nodes=4, dim=3))
                                                           for i in range(4)], w, 5)
    for i in range(4):
        np.testing.assert_array_equal(runs[i].state.theta, ref.states[i].theta)
        assert sorted(runs[i].state.edges) == sorted(ref.states[i].edges)
        for j, e in ref.states[i].edges.items():
            np.testing.assert_array_equal(runs[i].state.edges[j]["e"], e["e"])
    # both endpoints of every edge hold the same edge value (the owner computed it, the other was sent it)
    for i in range(4):
        for j in ref.states[i].edges:
            np.testing.assert_array_equal(ref.states[i].edges[j]["e"], ref.states[j].edges[i]["e"])
    assert runs[0].records[0]["missing"] == []


def test_hand_computed_first_iteration():
    spec = ProblemSpec("vector", num_nodes=3, dim=1)
    oracles = [make_oracle(i, spec) for i in range(3)]
    x = [float(o.initial_theta()[0]) for o in oracles]
    res = run_network_inprocess(EdgeMean(GossipParams()), oracles, make_topology("ring", 3).mixing_matrix(), 1)
    for i in range(3):  # triangle: θ_i ← (θ_i + Σ_j (θ_i + θ_j)/2) / 3
        want = (x[i] + sum((np.float64(x[i]) + x[j]) / 2 for j in range(3) if j != i)) / 3
        assert float(res.states[i].theta[0]) == want


def test_a_dead_owner_costs_no_extra_deadline_in_the_second_phase():
    """Node 2 is down: found unreachable in phase `value`, so phase `edge` does not wait for it."""
    runs, _, _ = threaded(EdgeMean(GossipParams()), 4, 3, down={2}, round_timeout=3.0)
    assert sorted(runs) == [0, 1, 3]
    for i in (1, 3):
        assert all(r["missing"] == [2] for r in runs[i].records)
        assert max(r["comm_s"] for r in runs[i].records) < 1.0
        np.testing.assert_array_equal(runs[i].state.edges[2]["e"], np.asarray(make_oracle(
            i, ProblemSpec("vector", num_nodes=4, dim=3)).initial_theta(), np.float64))  # edge to 2 never updated
