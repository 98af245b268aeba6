"""The two runtimes of a :class:`~graphfl.p2p.algorithms.base.P2PAlgorithm`.

* :func:`run_network_inprocess` — all nodes in one process, in lock-step, no threads and no
  sockets (benchmarks, tests): each phase's outgoing messages are handed to the receivers
  directly, with the full weights row (no neighbour is ever missing).
* :func:`run_node` — one node's loop over a :class:`~graphfl.p2p.exchange.NeighbourExchange`
  (any :class:`~graphfl.p2p.transport.Transport`); the gRPC peer process runs exactly this.

Both run every iteration through :func:`graphfl.p2p.node.node_iteration` (the same
``outgoing -> combine -> step`` code), so for the same seed, topology and oracles they produce
the same iterates (tested).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from graphfl.p2p import checkpoint
from graphfl.p2p.algorithms.base import PARAMS, THETA, Inbox, NodeContext, NodeState, Outgoing, P2PAlgorithm, Phase
from graphfl.p2p.exchange import ExchangeInfo, NeighbourExchange
from graphfl.p2p.mixing import reweight
from graphfl.p2p.node import Iteration, Request, WireSizes, drive, local_disagreement, node_iteration

logger = logging.getLogger(__name__)

BYTES_MODELS = ("gossip", "server")


def consensus_distance(thetas: Sequence[np.ndarray]) -> float:
    """``(1/n) Σ_i ‖θ_i − θ̄‖²`` (ALGORITHMS §2.7)."""
    x = np.stack([np.asarray(t, np.float64) for t in thetas])
    return float(np.mean(np.sum((x - x.mean(axis=0)) ** 2, axis=1)))


def is_record_point(algo: P2PAlgorithm[Any, Any], t: int, iterations: int) -> bool:
    """Record after the last iteration of each round (just before the next exchange) and at the end."""
    return (t + 1) % algo.period == 0 or t + 1 == iterations


def rounds_before(algo: P2PAlgorithm[Any, Any], t: int) -> int:
    """Communication rounds among iterations ``0 .. t−1`` (``⌈t / period⌉``)."""
    return -(-t // algo.period)


@dataclass
class InProcessResult:
    """Final states, the curve (one record per round) and the traffic of one round."""

    states: list[NodeState]
    curve: list[dict[str, Any]]
    wire_bytes_per_round: int
    payload_bytes_per_round: int


_Step = tuple[str, Any]


def _advance(gen: Iteration, value: Inbox | None) -> _Step:
    """Resume a node's iteration: ``("phase", (phase, outgoing))`` or ``("done", (state, inboxes))``."""
    try:
        return ("phase", next(gen) if value is None else gen.send(value))
    except StopIteration as done:
        return ("done", done.value)


def _deliver(t: int, phase: Phase, outs: Sequence[Outgoing], senders: Sequence[tuple[int, ...]],
             ctxs: Sequence[NodeContext]) -> list[Inbox]:
    """Every node's inbox of one phase: what its senders addressed to it, with its full weights row."""
    inboxes = []
    for i, ctx in enumerate(ctxs):
        heard = {}
        for j in senders[i]:
            msg = outs[j].to(i)
            if msg is not None:
                heard[j] = msg
        inboxes.append(Inbox(round=t, phase=phase.name, own=outs[i].own, messages=heard,
                             weights=reweight(dict(ctx.row), i, set(heard), "self")))
    return inboxes


def _traffic(outs: Sequence[Outgoing], ctxs: Sequence[NodeContext], sizes: WireSizes, bytes_model: str) -> tuple[int, int]:
    """``(wire, payload)`` bytes of one phase: every message to every neighbour (``gossip``), or
    each node's own message up and down once (``server``).
    """
    wire = payload = 0
    for out, ctx in zip(outs, ctxs):
        if bytes_model == "gossip":
            for j in out.targets(ctx.neighbours):
                msg = out.to(j)
                if msg is not None:
                    wb, pb = sizes(msg)
                    wire, payload = wire + wb, payload + pb
        elif out.own is not None:
            wb, pb = sizes(out.own)
            wire, payload = wire + 2 * wb, payload + 2 * pb
    return wire, payload


def run_network_inprocess(
    algo: P2PAlgorithm[Any, Any],
    oracles: Sequence[Any],
    w: npt.ArrayLike,
    iterations: int,
    *,
    adjacency: npt.ArrayLike | None = None,
    eval_every: int = 1,
    bytes_model: str = "gossip",
    on_step: Callable[[int, list[NodeState]], None] | None = None,
    checkpoint_dir: str | Path | None = None,
    resume_from: str | Path | None = None,
) -> InProcessResult:
    """Run iterations ``0 .. iterations−1`` of ``algo`` on all nodes in lock-step.

    Parameters
    ----------
    w
        Mixing matrix (``n x n``); its nonzeros define the neighbours. ``np.full((n, n), 1/n)``
        turns DFL-SGD into FedAvg.
    adjacency
        Weighted adjacency (edge weights ``A_ij`` for :attr:`NodeContext.edge_weights`);
        default: the pattern of ``w`` with weight 1.
    eval_every
        Every this many rounds (and at the end) record ``test_loss`` (mean over nodes of node
        i's model on node i's test split) and ``avg_model_test_loss`` (mean over nodes of the
        average model θ̄ on node i's test split: the objective of eq. 10.1).
    bytes_model
        ``"gossip"``: every message to every neighbour counts; ``"server"``: each node uploads
        and downloads its own message once per round (FedAvg through a server).
    on_step
        Called as ``on_step(t, states)`` after every iteration (tests use it).
    checkpoint_dir
        Write every node's checkpoint there after each round (:mod:`graphfl.p2p.checkpoint`).
    resume_from
        Start from the nodes' checkpoints in that folder (state and minibatch RNGs) instead of
        ``algo.init``; the run continues at the checkpoint's iteration.
    """
    if bytes_model not in BYTES_MODELS:
        raise ValueError(f"bytes_model must be one of {list(BYTES_MODELS)}, got {bytes_model!r}")
    n = len(oracles)
    ctxs = NodeContext.for_network(w, adjacency)
    if len(ctxs) != n:
        raise ValueError(f"{n} oracles but a {len(ctxs)}-node mixing matrix")
    if resume_from is not None:
        states = []
        for i, o in enumerate(oracles):
            ck = checkpoint.load(resume_from, i)
            ck.check(algo.name, algo.params)
            ck.restore_oracle_rng(o)
            states.append(ck.state)
        if len({s.t for s in states}) != 1:
            raise checkpoint.CheckpointError(f"{resume_from}: nodes' checkpoints are at different iterations "
                                             f"{[s.t for s in states]}; the in-process driver runs in lock-step")
    else:
        states = [algo.init(o, c) for o, c in zip(oracles, ctxs)]
    start_t = states[0].t if states else 0
    sizes = WireSizes()
    curve: list[dict[str, Any]] = []
    comm_rounds = rounds_before(algo, start_t)
    total_wire = total_payload = 0
    first_round: tuple[int, int] | None = None
    t0 = time.perf_counter()
    for t in range(start_t, iterations):
        gens = [node_iteration(algo, s, o, c) for s, o, c in zip(states, oracles, ctxs)]
        steps = [_advance(g, None) for g in gens]
        wire = payload = 0
        while any(kind == "phase" for kind, _ in steps):
            if not all(kind == "phase" for kind, _ in steps):
                raise RuntimeError(f"iteration {t}: nodes disagree on the number of phases")
            requests: list[Request] = [value for _, value in steps]
            phase = requests[0][0]
            if any(p.name != phase.name for p, _, _ in requests):
                raise RuntimeError(f"iteration {t}: nodes are in different phases {[p.name for p, _, _ in requests]}")
            outs = [out for _, out, _ in requests]
            wb, pb = _traffic(outs, ctxs, sizes, bytes_model)
            wire, payload = wire + wb, payload + pb
            inboxes = _deliver(t, phase, outs, [senders for _, _, senders in requests], ctxs)
            steps = [_advance(g, inbox) for g, inbox in zip(gens, inboxes)]
        states = [value[0] for _, value in steps]
        if algo.communicates(t):
            comm_rounds += 1
            total_wire, total_payload = total_wire + wire, total_payload + payload
            if first_round is None:
                first_round = (wire, payload)
        if on_step is not None:
            on_step(t, states)
        if is_record_point(algo, t, iterations):
            rec: dict[str, Any] = {
                "round": comm_rounds,
                "t": t + 1,
                "train_loss": float(np.mean([s.loss for s in states])),
                "consensus": consensus_distance([s.theta for s in states]),
                "bytes": total_wire,
                "payload_bytes": total_payload,
                "seconds": time.perf_counter() - t0,
            }
            if comm_rounds % eval_every == 0 or t + 1 == iterations:
                rec["test_loss"] = float(np.mean([algo.evaluate(s, o) for s, o in zip(states, oracles)]))
                if algo.theta_is_model:
                    theta_bar = np.mean([np.asarray(s.theta, np.float64) for s in states], axis=0).astype(states[0].theta.dtype)
                    rec["avg_model_test_loss"] = float(np.mean([o.test_loss(theta_bar) for o in oracles]))
            curve.append(rec)
            if checkpoint_dir is not None:
                for i, (s, o) in enumerate(zip(states, oracles)):
                    checkpoint.save(checkpoint_dir, i, s, algorithm=algo.name, params=algo.params,
                                    round_=comm_rounds, oracle=o)
    wire_round, payload_round = first_round if first_round is not None else (0, 0)
    return InProcessResult(states, curve, wire_round, payload_round)


@dataclass
class NodeRun:
    """One node's outcome: final state and per-round records."""

    state: NodeState
    records: list[dict[str, Any]] = field(default_factory=list)
    start_t: int = 0


def skip_target(latest: dict[int, int], t: int, num_neighbours: int) -> int:
    """The round a node at iteration ``t`` may skip to, or ``-1`` to stay.

    ``latest`` holds, per neighbour, the round its messages show (``Mailbox.witness_rounds``):
    the highest *accepted* round, or a round refused only for lying beyond the horizon, clamped
    to ``t + horizon`` (rounds beyond the run never count), so one skip moves a node at most
    ``horizon`` rounds and a node restarted far behind still catches up. Skipping needs evidence from two neighbours
    when the node has two or more: the target is the slowest of the neighbours at or past
    ``t``, and at least two of them must be there. A node with a single neighbour can only
    have one witness; its jump is bounded by the mailbox horizon (``max-ahead`` rounds).
    Neighbours whose last message is older than ``t`` (dead or lagging) do not count.
    """
    current = sorted(r for r in latest.values() if r >= t)
    if not current or len(current) < min(2, num_neighbours):
        return -1
    return current[0]


def passed_neighbours(latest: dict[int, int], t: int, period: int) -> set[int]:
    """The neighbours whose messages show them at least two communication rounds past ``t``.

    ``latest`` is :meth:`~graphfl.p2p.transport.Mailbox.witness_rounds` (a round refused as beyond
    the horizon counts, clamped to ``t + horizon``). A neighbour at round ``t + 2·period`` or later
    has finished round ``t + period``, for which it needed this node's message (not sent yet) or
    its deadline; so its round-``t`` message left at least one deadline before, and if it is not
    here it never will be. Waiting for it would make every round last the full deadline while the
    rounds of a healed partition stay apart (a chain of peers one round apart never closes).
    """
    return {j for j, r in latest.items() if r >= t + 2 * period}


def run_node(
    algo: P2PAlgorithm[Any, Any],
    oracle: Any,
    exchange: NeighbourExchange,
    iterations: int,
    *,
    ctx: NodeContext,
    state: NodeState | None = None,
    start_t: int | None = None,
    eval_every: int = 1,
    min_round_seconds: float = 0.0,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    on_checkpoint: Callable[[NodeState, int], None] | None = None,
    stop: threading.Event | None = None,
) -> NodeRun:
    """One node's loop up to iteration ``iterations``: local steps, and an exchange every ``period`` steps.

    Parameters
    ----------
    ctx
        The node's place in the network (id, neighbours, weights row, edge weights).
    state
        Where to start (a restored checkpoint, or a state from ``algo.init`` whose channel
        specs were registered with the transport); default ``algo.init(oracle, ctx)``.
    start_t
        A rejoin: start at iteration ``start_t`` (the round the neighbours are in) with
        ``state``'s model. A node that finds itself more than one communication round behind its
        neighbours (their messages are for a later round) skips ahead to their round (logged,
        recorded as ``skipped_from``) rather than never meeting them.
    eval_every
        ``test_loss`` and ``local_disagreement`` are recorded every ``eval_every`` communication
        rounds and at the last one (``None`` in the other records): both are metrics, and each
        costs a pass over the model (the disagreement one over every neighbour's vector).
    min_round_seconds
        Paces communication rounds (tests and demos); 0 by default.
    on_round
        Called with each round's record.
    on_checkpoint
        Called as ``on_checkpoint(state, round)`` at the end of every round (the peer writes
        its checkpoint there).
    """
    state = state if state is not None else algo.init(oracle, ctx)
    if start_t is not None and start_t > state.t:
        state = replace(state, t=start_t)
    first_t = state.t
    records: list[dict[str, Any]] = []
    transport = exchange.transport
    stats0 = transport.stats()
    compute_s = comm_s = 0.0
    block_start = time.monotonic()
    missing: set[int] = set()
    disagreement = float("nan")
    comm_rounds = rounds_before(algo, state.t)
    total_rounds = rounds_before(algo, iterations)
    t_start = time.monotonic()
    jumped: list[int] = []
    skips: list[dict[str, Any]] = []
    t = state.t
    while t < iterations:
        if stop is not None and stop.is_set():
            logger.info("peer %d: stop requested at iteration %d", exchange.own, t)
            break
        communicates = algo.communicates(t)
        if communicates:
            latest = transport.mailbox.witness_rounds(t)
            ahead = skip_target(latest, t, len(exchange.neighbours))
            if ahead > t + algo.period and algo.communicates(ahead) and ahead < iterations:
                # more than one communication round behind (e.g. after a pause or a restart):
                # skip to the neighbours' round instead of never meeting them again
                witnesses = sorted(j for j, r in latest.items() if r >= ahead)
                logger.warning("peer %d is behind its neighbours (iteration %d < %d, witnesses %s): skipping ahead",
                               exchange.own, t, ahead, witnesses)
                jumped.append(t)
                skips.append({"from": t, "to": ahead, "witnesses": witnesses})
                comm_rounds += rounds_before(algo, ahead) - rounds_before(algo, t)
                t = ahead
                state = replace(state, t=ahead)
                transport.advance(ahead)
                latest = transport.mailbox.witness_rounds(t)
            passed = passed_neighbours(latest, t, algo.period)
            exchange.mark_passed(t, passed)
            comm_rounds += 1
        infos: list[ExchangeInfo] = []
        loss = float(state.loss)

        def gather(phase: Phase, out: Outgoing, senders: tuple[int, ...], t: int = t, loss: float = loss,
                   infos: list[ExchangeInfo] = infos) -> Inbox:
            inbox, info = exchange.exchange(t, phase.name, phase.channels, out, senders, {"loss": loss})
            infos.append(info)
            return inbox

        c0 = time.monotonic()
        state, inboxes = drive(node_iteration(algo, state, oracle, ctx), gather)
        exchange_s = sum(info.seconds for info in infos)
        comm_s += exchange_s
        compute_s += time.monotonic() - c0 - exchange_s
        # this round's metrics are taken (every eval_every rounds and the last one); the last
        # round's record point is the run's last iteration, since rounds start at t mod period == 0
        evaluates = comm_rounds % eval_every == 0 or comm_rounds == total_rounds
        if communicates:
            exchange.finish_round(t)
            for inbox in inboxes:
                missing.update(inbox.missing)
            # a metric like test_loss, at the same rounds: a pass over every neighbour's vector
            if evaluates:
                sent = next((ib.own[PARAMS][THETA] for ib in inboxes if ib.own and THETA in ib.own.get(PARAMS, {})),
                            None)
                disagreement = local_disagreement(sent, inboxes) if sent is not None else float("nan")
        if is_record_point(algo, t, iterations):
            c0 = time.monotonic()
            test_loss = None
            if evaluates:
                tl = algo.evaluate(state, oracle)
                test_loss = None if np.isnan(tl) else tl
            compute_s += time.monotonic() - c0
            if on_checkpoint is not None:
                on_checkpoint(state, comm_rounds)
            if min_round_seconds > 0:
                left = min_round_seconds - (time.monotonic() - block_start)
                if left > 0:
                    time.sleep(left)
            stats = transport.stats()
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
                "skips": skips,
                "seconds": time.monotonic() - t_start,
                "wall": time.time(),  # end of the round on the wall clock: peers' rounds on one time line
            }
            records.append(rec)
            if on_round is not None:
                on_round(rec)
            stats0 = stats
            compute_s = comm_s = 0.0
            missing = set()
            jumped = []
            skips = []
            disagreement = float("nan")
            block_start = time.monotonic()
        t += 1
    return NodeRun(state, records, first_t)
