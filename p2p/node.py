"""One iteration of one node, written once for every runtime.

:func:`node_iteration` is a generator: it yields ``(phase, outgoing, senders)`` for each exchange
of the iteration (``senders``: the neighbours the node waits for in that phase), receives the
phase's :class:`~graphfl.p2p.algorithms.base.Inbox`, and returns the new state. The in-process
driver answers all nodes' requests in lock-step from their outgoing messages; the gRPC node loop
answers them through
:class:`~graphfl.p2p.exchange.NeighbourExchange`. Both therefore run exactly the same
``outgoing -> combine -> step`` code (:func:`drive` for one node).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from graphfl.p2p import codec
from graphfl.p2p.algorithms.base import PARAMS, THETA, Channels, Inbox, NodeContext, NodeState, Outgoing, P2PAlgorithm, Phase

Request = tuple[Phase, Outgoing, tuple[int, ...]]
"""One exchange a node asks for: the phase, what it sends, and the neighbours it waits for."""
Iteration = Generator[Request, Inbox, tuple[NodeState, list[Inbox]]]
"""Yields ``(phase, outgoing, senders)``, is sent the phase's inbox, returns ``(new state, inboxes)``."""


def node_iteration(algo: P2PAlgorithm[Any, Any], state: NodeState, oracle: Any, ctx: NodeContext) -> Iteration:
    """Iteration ``t = state.t`` of one node (see the module docstring and ``p2p/algorithms/base.py``)::

    combined = None                          (no communication at this t)
    combined = ∪_phase combine(inbox_phase)  (communication: one exchange per active phase)
    state    = step(state, combined)
    """
    combined: Channels | None = None
    inboxes: list[Inbox] = []
    if algo.communicates(state.t):
        combined = {}
        for phase in algo.active_phases(state):
            out = algo.outgoing(state, phase, combined, ctx)
            inbox = yield phase, out, tuple(algo.expected_senders(phase, state, combined, ctx))
            inboxes.append(inbox)
            combined.update(algo.combine(state, inbox, ctx))
    return algo.step(state, combined, oracle, ctx), inboxes


def drive(iteration: Iteration,
          gather: Callable[[Phase, Outgoing, tuple[int, ...]], Inbox]) -> tuple[NodeState, list[Inbox]]:
    """Run one node's iteration, answering each phase with ``gather(phase, outgoing, senders)``."""
    try:
        request = next(iteration)
        while True:
            request = iteration.send(gather(*request))
    except StopIteration as done:
        result: tuple[NodeState, list[Inbox]] = done.value
        return result


DISAGREEMENT_BLOCK = 65_536
"""Elements per block of :func:`local_disagreement` (256 kB of float32: the block stays in cache)."""


def local_disagreement(own_theta: np.ndarray, inboxes: list[Inbox]) -> float:
    """Mean ``‖θ_i − θ_j‖²`` over the neighbours heard on channel ``params`` (NaN if none).

    Computed in blocks of :data:`DISAGREEMENT_BLOCK` elements: per block, the difference is taken
    in the parameters' float dtype into one cache-sized buffer and its squared norm is a BLAS dot
    in that dtype; the blocks' sums are added in Python floats (float64). For float32 parameters
    the result is the float64 one to ~1e-6 relative (tested); one pass over each neighbour's
    vector and no model-sized temporaries (float64 temporaries per neighbour would cost a large
    part of a big model's round: docs/p2p.md "Where the time goes").
    """
    others = [msg[PARAMS][THETA] for inbox in inboxes for msg in inbox.messages.values()
              if PARAMS in msg and THETA in msg[PARAMS]]
    if not others:
        return float("nan")
    own = np.asarray(own_theta)
    own = own.reshape(-1).astype(np.result_type(own.dtype, np.float32), copy=False)
    d = own.size
    buf = np.empty(min(d, DISAGREEMENT_BLOCK), dtype=own.dtype)
    total = 0.0
    for other in others:
        flat = np.asarray(other).reshape(-1)
        for start in range(0, d, DISAGREEMENT_BLOCK):
            stop = min(d, start + DISAGREEMENT_BLOCK)
            diff = buf[: stop - start]
            np.subtract(own[start:stop], flat[start:stop], out=diff, casting="unsafe")
            total += float(np.dot(diff, diff))
    return total / len(others)


class WireSizes:
    """Bytes one message takes on the wire (protobuf frames) and as raw tensors, cached by layout.

    The size of a message depends only on its channels' tensor names, dtypes and shapes
    (computed once per layout with sender 0 and round 0, as the in-process benchmarks always did).
    """

    def __init__(self) -> None:
        self._cache: dict[tuple[Any, ...], tuple[int, int]] = {}

    def __call__(self, message: Channels) -> tuple[int, int]:
        """``(wire bytes, payload bytes)`` of ``message``."""
        key = tuple((ch, tuple((name, a.dtype.str, a.shape) for name, a in arrs.items())) for ch, arrs in message.items())
        hit = self._cache.get(key)
        if hit is None:
            wire = sum(codec.wire_size(codec.encode(0, 0, ch, arrs)) for ch, arrs in message.items())
            payload = sum(int(np.asarray(a).nbytes) for arrs in message.values() for a in arrs.values())
            hit = self._cache[key] = (wire, payload)
        return hit
