"""Drivers of the per-node step functions of :mod:`graphfl.p2p.algorithms`.

* :func:`run_network_inprocess` — all nodes in one process, in lock-step, no threads and no sockets
  (benchmarks, tests). Mixing uses the full matrix ``W`` row by row through
  :func:`graphfl.p2p.mixing.mix`.
* :func:`run_node` — one node's loop over an :class:`~graphfl.p2p.exchange.Exchange` (any
  :class:`~graphfl.p2p.transport.Transport`); the gRPC peer process runs exactly this.

For the same seed, topology and oracles both produce the same iterates (tested).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from graphfl.p2p import codec
from graphfl.p2p.algorithms import DFLAlgorithm, GradientOracle, NodeState
from graphfl.p2p.exchange import NeighbourExchange
from graphfl.p2p.mixing import mix, mixing_row

logger = logging.getLogger(__name__)


def consensus_distance(thetas: Sequence[np.ndarray]) -> float:
    """``(1/n) Σ_i ‖θ_i − θ̄‖²`` (ALGORITHMS §2.7)."""
    x = np.stack([np.asarray(t, np.float64) for t in thetas])
    return float(np.mean(np.sum((x - x.mean(axis=0)) ** 2, axis=1)))


def _is_record_point(algo: DFLAlgorithm, t: int, iterations: int) -> bool:
    """Record after the last iteration of each gossip block (just before the next exchange)."""
    return (t + 1) % algo.tau == 0 or t + 1 == iterations


@dataclass
class InProcessResult:
    states: list[NodeState]
    curve: list[dict[str, Any]]
    wire_bytes_per_round: int
    payload_bytes_per_round: int


def run_network_inprocess(
    algo: DFLAlgorithm,
    oracles: Sequence[GradientOracle],
    w: np.ndarray,
    iterations: int,
    *,
    eval_every: int = 1,
    bytes_model: str = "gossip",
    on_step: Callable[[int, list[NodeState]], None] | None = None,
) -> InProcessResult:
    """Run ``iterations`` steps of ``algo`` on all nodes in lock-step.

    Parameters
    ----------
    w
        Mixing matrix (``n x n``); ``np.full((n, n), 1/n)`` turns DFL-SGD into FedAvg.
    eval_every
        Every this many communication rounds (and at the end) record ``test_loss`` (mean over
        nodes of node i's model on node i's test split) and ``avg_model_test_loss`` (mean over
        nodes of the average model θ̄ on node i's test split: the objective of eq. 10.1).
    bytes_model
        ``"gossip"``: each node sends its channels to each neighbour (``W_ij > 0``);
        ``"server"``: each node uploads and downloads its channels once (FedAvg through a server).
    on_step
        Called as ``on_step(t, states)`` after every iteration (tests use it).
    """
    n = len(oracles)
    rows = [mixing_row(w, i) for i in range(n)]
    states = [algo.init(o) for o in oracles]
    msg_wire = msg_payload = 0
    for ch, arrs in algo.outgoing(states[0]).items():
        msg_wire += codec.wire_size(codec.encode(0, 0, ch, arrs))
        msg_payload += sum(a.nbytes for a in arrs.values())
    if bytes_model == "gossip":
        sends = sum(len(r) - 1 for r in rows)
    elif bytes_model == "server":
        sends = 2 * n
    else:
        raise ValueError(f"bytes_model must be 'gossip' or 'server', got {bytes_model!r}")
    curve: list[dict[str, Any]] = []
    comm_rounds = 0
    t0 = time.perf_counter()
    for t in range(iterations):
        mixed: list[dict[str, dict[str, np.ndarray]] | None] = [None] * n
        if algo.communicates(t):
            comm_rounds += 1
            outs = [algo.outgoing(s) for s in states]
            for i in range(n):
                mixed[i] = {
                    ch: {name: mix(rows[i], {j: outs[j][ch][name] for j in rows[i]}) for name in arrs}
                    for ch, arrs in outs[i].items()
                }
        states = [algo.step(s, o, m) for s, o, m in zip(states, oracles, mixed)]
        if on_step is not None:
            on_step(t, states)
        if _is_record_point(algo, t, iterations):
            rec: dict[str, Any] = {
                "round": comm_rounds,
                "t": t + 1,
                "train_loss": float(np.mean([s.loss for s in states])),
                "consensus": consensus_distance([s.theta for s in states]),
                "bytes": comm_rounds * sends * msg_wire,
                "payload_bytes": comm_rounds * sends * msg_payload,
                "seconds": time.perf_counter() - t0,
            }
            if comm_rounds % eval_every == 0 or t + 1 == iterations:
                rec["test_loss"] = float(np.mean([o.test_loss(s.theta) for s, o in zip(states, oracles)]))
                theta_bar = np.mean([np.asarray(s.theta, np.float64) for s in states], axis=0).astype(states[0].theta.dtype)
                rec["avg_model_test_loss"] = float(np.mean([o.test_loss(theta_bar) for o in oracles]))
            curve.append(rec)
    return InProcessResult(states, curve, sends * msg_wire, sends * msg_payload)


@dataclass
class NodeRun:
    """One node's outcome: final state and per-round records."""

    state: NodeState
    records: list[dict[str, Any]] = field(default_factory=list)
    start_t: int = 0


def run_node(
    algo: DFLAlgorithm,
    oracle: GradientOracle,
    exchange: NeighbourExchange,
    iterations: int,
    *,
    start_t: int = 0,
    eval_every: int = 1,
    min_round_seconds: float = 0.0,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    stop: threading.Event | None = None,
) -> NodeRun:
    """One node's loop: local steps, and an exchange every ``tau`` steps.

    ``start_t > 0`` is a rejoin: the node starts from its initial state at iteration
    ``start_t`` (the round its neighbours are in). A node that finds itself more than one
    communication round behind its neighbours (their messages are for a later round) skips
    ahead to their round (logged, recorded as ``skipped_from``) rather than never meeting them. ``min_round_seconds`` paces communication
    rounds (tests and demos); it is 0 by default.
    """
    state = algo.init(oracle)
    state.t = start_t
    records: list[dict[str, Any]] = []
    stats0 = exchange.transport.stats()
    compute_s = comm_s = 0.0
    block_start = time.monotonic()
    missing: set[int] = set()
    disagreement = float("nan")
    comm_rounds = start_t // algo.tau
    t_start = time.monotonic()
    jumped: list[int] = []
    t = start_t
    while t < iterations:
        if stop is not None and stop.is_set():
            logger.info("peer %d: stop requested at iteration %d", exchange.own, t)
            break
        mixed = None
        if algo.communicates(t):
            ahead = exchange.transport.mailbox.latest_round()
            if ahead > t + algo.tau and algo.communicates(ahead) and ahead < iterations:
                # more than one communication round behind (e.g. after a pause or a restart):
                # skip to the neighbours' round instead of never meeting them again
                logger.warning("peer %d is behind its neighbours (iteration %d < %d): skipping ahead",
                               exchange.own, t, ahead)
                jumped.append(t)
                comm_rounds += (ahead - t) // algo.tau
                t = ahead
                state.t = ahead
                exchange.transport.advance(ahead)
            comm_rounds += 1
            c0 = time.monotonic()
            mixed, info = exchange.exchange(t, algo.outgoing(state), {"loss": float(state.loss)})
            comm_s += time.monotonic() - c0
            missing.update(info.missing)
            disagreement = info.local_disagreement
        c0 = time.monotonic()
        state = algo.step(state, oracle, mixed)
        compute_s += time.monotonic() - c0
        if _is_record_point(algo, t, iterations):
            c0 = time.monotonic()
            test_loss = None
            if comm_rounds % eval_every == 0 or t + 1 == iterations:
                tl = oracle.test_loss(state.theta)
                test_loss = None if np.isnan(tl) else tl
            compute_s += time.monotonic() - c0
            if min_round_seconds > 0:
                left = min_round_seconds - (time.monotonic() - block_start)
                if left > 0:
                    time.sleep(left)
            stats = exchange.transport.stats()
            rec = {
                "round": comm_rounds,
                "t": t + 1,
                "train_loss": None if np.isnan(state.loss) else float(state.loss),
                "test_loss": test_loss,
                "local_disagreement": None if np.isnan(disagreement) else disagreement,
                "compute_s": compute_s,
                "comm_s": comm_s,
                "bytes_sent": stats["bytes_sent"] - stats0["bytes_sent"],
                "bytes_received": stats["bytes_received"] - stats0["bytes_received"],
                "payload_sent": stats["payload_sent"] - stats0["payload_sent"],
                "payload_received": stats["payload_received"] - stats0["payload_received"],
                "missing": sorted(missing),
                "skipped_from": jumped,
                "seconds": time.monotonic() - t_start,
            }
            records.append(rec)
            if on_round is not None:
                on_round(rec)
            stats0 = stats
            compute_s = comm_s = 0.0
            missing = set()
            jumped = []
            disagreement = float("nan")
            block_start = time.monotonic()
        t += 1
    return NodeRun(state, records, start_t)
