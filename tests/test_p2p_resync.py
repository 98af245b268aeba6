"""Peers whose rounds drifted apart (after a partition heals) meet again.

After a cut, one peer of a ring can run ahead of the others by more than the mailbox horizon: its
messages for the rounds the others are now in were refused as "too far ahead" when it sent them,
and are never sent again. The others (within one round of each other, so nobody has two
neighbours ahead) waited the full deadline for them every round, and the leader waited for them:
all moved at one round per deadline and never met again (seen in ``graphfl bench faults``'s
``p2p-partition`` row). A neighbour whose messages show it two communication rounds past ``t``
is no longer waited for in round ``t`` (:func:`graphfl.p2p.driver.passed_neighbours`,
:meth:`graphfl.p2p.exchange.NeighbourExchange.mark_passed`); the laggards then run at compute
speed and catch up.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from graphfl.p2p.algorithms import NodeContext, registry
from graphfl.p2p.driver import passed_neighbours, run_node
from graphfl.p2p.exchange import FailurePolicy, NeighbourExchange
from graphfl.p2p.oracles import ProblemSpec, make_oracle
from graphfl.p2p.topology import make_topology
from graphfl.p2p.transport import InProcessHub

DEADLINE = 0.3
ITERATIONS = 40


def test_passed_neighbours_rule():
    assert passed_neighbours({1: 7, 3: 6}, 5, period=1) == {1}          # 1 is two rounds past, 3 one
    assert passed_neighbours({1: 7, 3: 4}, 5, period=2) == set()        # one communication round past
    assert passed_neighbours({1: 9, 3: 8}, 5, period=2) == {1}
    assert passed_neighbours({}, 5, period=1) == set()


def _ring(start: dict[int, int], horizon: int) -> tuple[dict[int, Any], float]:
    spec = registry.get("dfl-sgd")
    algo = spec.create(spec.make_params({"alpha0": 0.05}))
    n = 4
    topo = make_topology("ring", n)
    w, adj = topo.mixing_matrix(), topo.adjacency()
    problem = ProblemSpec("linreg", num_nodes=n, seed=7, batch_size=5, dim=4, samples=40)
    oracles = [make_oracle(i, problem) for i in range(n)]
    ctxs = [NodeContext.from_matrix(w, i, adj) for i in range(n)]
    states = [algo.init(o, c) for o, c in zip(oracles, ctxs)]
    hub = InProcessHub()
    transports = [hub.transport(i, topo.neighbours(i), horizon=horizon) for i in range(n)]
    for tr, st, c in zip(transports, states, ctxs):
        for ch, specs in algo.channels(st, c).items():
            tr.mailbox.expect(ch, specs)
    runs: dict[int, Any] = {}

    def go(i: int) -> None:
        ex = NeighbourExchange(transports[i], ctxs[i].row, FailurePolicy(round_timeout=DEADLINE))
        runs[i] = run_node(algo, oracles[i], ex, ITERATIONS, ctx=ctxs[i], state=states[i], start_t=start[i])

    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(n)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join(ITERATIONS * DEADLINE * 4)
    for tr in transports:
        tr.close()
    assert sorted(runs) == list(range(n)), "a peer did not finish in time"
    return runs, time.monotonic() - t0


def test_a_peer_ahead_beyond_the_horizon_is_met_again(caplog):
    """Peer 0 starts 7 rounds ahead of a chain one round apart, the horizon is 3 rounds."""
    caplog.set_level(logging.ERROR, logger="graphfl")
    runs, wall = _ring({0: 10, 1: 3, 2: 4, 3: 2}, horizon=3)
    for i, run in runs.items():
        tail = [r["missing"] for r in run.records][-10:]
        assert tail and all(m == [] for m in tail), f"peer {i} still misses neighbours at the end: {tail}"
    # without the rule every one of the ~30 rounds lasts the deadline (about 9 s); with it the
    # laggards catch up at compute speed and most rounds hear both neighbours at once
    assert wall < 0.8 * (ITERATIONS - 10) * DEADLINE, wall
