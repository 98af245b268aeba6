"""All nodes of a network as stacked arrays: the in-process engine's fast path (``graphfl p2p --engine inprocess``).

An algorithm whose node functions are elementwise arithmetic plus calls of its local problem
(:attr:`~graphfl.p2p.algorithms.base.P2PAlgorithm.stackable`: gossip, DFL-SGD, DFL-GT) runs here
on all ``n`` nodes at once, through its own ``init``, ``outgoing`` and ``step`` — the code a peer
runs — on a :class:`~graphfl.p2p.algorithms.base.NodeState` whose arrays carry the node axis
first (``θ`` is ``(n, d)``), instead of ``n`` Python calls per iteration:

* **mixing** ``x̃_i = Σ_{j ∈ N̄_i} W_ij x_j`` (:func:`graphfl.p2p.mixing.mix`) of every tensor of
  each phase's broadcast message, over padded neighbour slots: slot ``s`` holds every node's
  ``s``-th neighbour in ascending ``j``, and the slots are added in order, so each node's terms are
  summed in exactly the order and precision of ``mix`` — the result is bit-identical to the
  default ``combine`` of the per-node driver (tested);
* **steps** are the algorithm's own ``step`` on the stacked state (the float64 update of
  :func:`graphfl.p2p.algorithms.steps.axpy` works on rows as it does on one vector);
* **the local problem** is every node's stacked: :class:`LinearBatch` for least squares with equal
  data shapes (``linreg``, ``clusters``, ``csv``): gradients of ``f_i(θ) = ‖A_i θ − b_i‖² / (2m)``
  for all nodes at once, each node drawing its minibatch from its own RNG in the same order as
  the per-node driver; :class:`StackedVectors` for ``vector`` problems (no gradients). The batched
  products (``einsum``) may round differently from the per-node BLAS calls, so iterates agree to
  ~1e-12 relative, not bit for bit (tested).

Everything else (ADMM, FedRelax, a robust ``combine``, torch tasks, unequal data shapes) runs on
the generic per-node driver :func:`graphfl.p2p.driver.run_network_inprocess`; :func:`supports`
says which.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from graphfl.p2p.algorithms.base import Channels, NodeContext, NodeState, P2PAlgorithm
from graphfl.p2p.driver import is_record_point
from graphfl.p2p.mixing import accumulator_dtype
from graphfl.p2p.node import WireSizes
from graphfl.p2p.oracles import LinRegOracle, TabularOracle, VectorOracle


class MixingSlots:
    """``W``'s rows as padded slots: ``idx[i, s]`` is node ``i``'s ``s``-th term (ascending ``j``, self included)."""

    def __init__(self, w: npt.ArrayLike) -> None:
        wm = np.asarray(w, dtype=np.float64)
        n = wm.shape[0]
        rows = [np.flatnonzero(wm[i]) for i in range(n)]
        k = max((len(r) for r in rows), default=0)
        self.idx = np.zeros((n, k), dtype=np.int64)
        self.weights = np.zeros((n, k), dtype=np.float64)
        self.valid = np.zeros((n, k), dtype=bool)
        for i, r in enumerate(rows):
            self.idx[i, :len(r)] = r
            self.weights[i, :len(r)] = wm[i, r]
            self.valid[i, :len(r)] = True
        self.full = [bool(self.valid[:, s].all()) for s in range(k)]
        self.degrees = self.valid.sum(axis=1) - 1

    def mix(self, x: np.ndarray) -> np.ndarray:
        """Row ``i`` = ``Σ_s w[i, s] x[idx[i, s]]``: the operations of :func:`graphfl.p2p.mixing.mix`
        (accumulator dtype, weights rounded to it once, terms added in ascending ``j``) on all rows at once.
        """
        acc_dtype = accumulator_dtype(x.dtype)
        w = self.weights.astype(acc_dtype)
        acc = np.empty(x.shape, dtype=acc_dtype)
        if not self.full or not self.full[0]:
            raise ValueError("a row of the mixing matrix has no nonzero weight")
        np.multiply(x[self.idx[:, 0]], w[:, 0, None], out=acc, casting="same_kind")
        term = np.empty_like(acc)
        for s in range(1, len(self.full)):
            if self.full[s]:
                np.multiply(x[self.idx[:, s]], w[:, s, None], out=term, casting="same_kind")
                acc += term
            else:
                rows = np.flatnonzero(self.valid[:, s])
                acc[rows] += (x[self.idx[rows, s]] * w[rows, s, None]).astype(acc_dtype, copy=False)
        return acc.astype(x.dtype, copy=False)


class LinearBatch:
    """The least-squares problems of all nodes, stacked (``linreg``, ``clusters``, ``csv`` with equal shapes)."""

    def __init__(self, oracles: Sequence[Any]) -> None:
        self.oracles = list(oracles)
        self.x = np.stack([np.asarray(o.x_train, np.float64) for o in oracles])
        self.y = np.stack([np.asarray(o.y_train, np.float64) for o in oracles])
        n, m, d = self.x.shape
        self.x_rows = self.x.reshape(n * m, d)        # node i's row k is row i*m + k
        self.y_rows = self.y.reshape(n * m)
        self.offsets = (np.arange(n) * m)[:, None]
        self.dim = d

    @staticmethod
    def fits(oracles: Sequence[Any]) -> bool:
        """Whether every oracle is a linear least-squares problem and all have the same shapes."""
        if not oracles or not all(type(o) in (LinRegOracle, TabularOracle) for o in oracles):
            return False
        if any(getattr(o, "name", "") == "clusters-logistic" for o in oracles):
            return False  # its gradient oracle is still least squares, but keep the generic path for it
        shapes = {(np.shape(o.x_train), np.shape(o.y_train), o.batch_size) for o in oracles}
        return len(shapes) == 1

    def initial_theta(self) -> np.ndarray:
        """``(n, d)``: row ``i`` is node ``i``'s ``initial_theta()``."""
        return np.stack([np.array(o.initial_theta(), copy=True) for o in self.oracles])

    def sample(self) -> np.ndarray:
        """``(n, batch)`` row indices, node ``i``'s drawn from its own RNG (the per-node draws)."""
        return np.stack([o.sample() for o in self.oracles])

    def grad(self, theta: np.ndarray, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``g_i = A_iᵀ(A_i θ_i − b_i)/|B|`` on each node's batch, and the batch losses ``½ mean r²``."""
        flat = batch + self.offsets
        a = np.take(self.x_rows, flat, axis=0)               # (n, B, d)
        r = np.einsum("nbd,nd->nb", a, theta) - np.take(self.y_rows, flat)
        g = np.einsum("nbd,nb->nd", a, r) / batch.shape[1]
        return g, 0.5 * np.mean(r * r, axis=1)


class StackedVectors:
    """The ``vector`` problems of all nodes, stacked: their starting points; no gradients."""

    def __init__(self, oracles: Sequence[VectorOracle]) -> None:
        self.oracles = list(oracles)
        self.dim = oracles[0].dim

    @staticmethod
    def fits(oracles: Sequence[Any]) -> bool:
        """Whether every oracle is a ``vector`` problem and all have the same dimension."""
        return bool(oracles) and all(type(o) is VectorOracle for o in oracles) and len({o.dim for o in oracles}) == 1

    def initial_theta(self) -> np.ndarray:
        """``(n, d)``: row ``i`` is node ``i``'s ``initial_theta()``."""
        return np.stack([o.initial_theta() for o in self.oracles])

    def sample(self) -> None:
        return None

    def grad(self, theta: np.ndarray, batch: None) -> tuple[np.ndarray, np.ndarray]:
        """A ``vector`` problem has no gradient: the nodes' own error (:class:`~graphfl.p2p.oracles.VectorOracle`)."""
        g, loss = self.oracles[0].grad(theta[0], batch)  # raises ConfigError
        return np.asarray(g), np.asarray(loss)


def stacked_problem(oracles: Sequence[Any]) -> LinearBatch | StackedVectors | None:
    """All nodes' local problems as one stacked problem, or ``None`` when they do not stack."""
    if LinearBatch.fits(oracles):
        return LinearBatch(oracles)
    if StackedVectors.fits(oracles):
        return StackedVectors(oracles)
    return None


def _consensus(theta: np.ndarray) -> float:
    """:func:`graphfl.p2p.driver.consensus_distance` of the rows of ``theta``."""
    x = theta.astype(np.float64)
    return float(np.mean(np.sum((x - x.mean(axis=0)) ** 2, axis=1)))


def mixes_broadcasts(algo: P2PAlgorithm[Any, Any]) -> bool:
    """Whether ``algo`` combines with the default mixing (no ``combine`` of its class or instance:
    :func:`~graphfl.p2p.algorithms.robust.with_robust_combine` sets one on the instance).
    """
    return type(algo).combine is P2PAlgorithm.combine and "combine" not in vars(algo)


def supports(algo: P2PAlgorithm[Any, Any], oracles: Sequence[Any]) -> bool:
    """Whether :func:`run_vectorised` can run ``algo`` on ``oracles`` (else use the per-node driver):
    the algorithm is :attr:`~graphfl.p2p.algorithms.base.P2PAlgorithm.stackable`, mixes by default,
    and the local problems stack (:func:`stacked_problem`).
    """
    return algo.stackable and mixes_broadcasts(algo) and (LinearBatch.fits(oracles) or StackedVectors.fits(oracles))


def _split(state: NodeState, n: int) -> list[NodeState]:
    """The stacked state as one :class:`NodeState` per node (row ``i`` of every array)."""
    loss = np.broadcast_to(np.asarray(state.loss, dtype=np.float64), (n,))
    return [NodeState(t=state.t, theta=state.theta[i], tracker=None if state.tracker is None else state.tracker[i],
                      aux={k: v[i] for k, v in state.aux.items()}, loss=float(loss[i])) for i in range(n)]


def run_vectorised(algo: P2PAlgorithm[Any, Any], oracles: Sequence[Any], w: npt.ArrayLike, iterations: int, *,
                   eval_every: int = 1) -> tuple[list[NodeState], list[dict[str, Any]], int, int]:
    """Iterations ``0 .. iterations−1`` of a stackable algorithm on all nodes as arrays.

    Each iteration is the node loop's (:func:`graphfl.p2p.node.node_iteration`) on the stacked
    state: on a communication step, every active phase's broadcast message
    (``algo.outgoing``) is mixed row-wise (:class:`MixingSlots`, the default ``combine``), then
    ``algo.step`` runs once for all nodes. Returns ``(final states, curve, wire bytes per round,
    payload bytes per round)`` with the curve records of
    :func:`graphfl.p2p.driver.run_network_inprocess` (``bytes_model="gossip"``).

    Raises
    ------
    ValueError
        When :func:`supports` is false for ``algo`` and ``oracles``, or a phase sends
        per-neighbour messages.
    """
    problem = stacked_problem(oracles)
    if problem is None or not supports(algo, oracles):
        raise ValueError(f"the vectorised engine cannot run {algo.name!r} on these problems; use the per-node driver")
    slots = MixingSlots(w)
    n = slots.idx.shape[0]
    ctx = NodeContext.stacked(n)
    state = algo.init(problem, ctx)
    sizes = WireSizes()
    directed = int(slots.degrees.sum())
    wire_round = payload_round = 0
    curve: list[dict[str, Any]] = []
    comm_rounds = total_wire = total_payload = 0
    t0 = time.perf_counter()
    for t in range(iterations):
        combined: Channels | None = None
        if algo.communicates(t):
            combined = {}
            wire_round = payload_round = 0
            for phase in algo.active_phases(state):
                out = algo.outgoing(state, phase, combined, ctx)
                if out.messages is not None or out.own is None:
                    raise ValueError(f"{algo.name!r} phase {phase.name!r}: the vectorised engine needs one "
                                     "broadcast message per node (Outgoing.to_all)")
                # one message layout for every node: the wire size of one message times the directed edges
                wb, pb = sizes({ch: {k: a[0] for k, a in arrs.items()} for ch, arrs in out.own.items()})
                wire_round, payload_round = wire_round + directed * wb, payload_round + directed * pb
                combined.update({ch: {k: slots.mix(a) for k, a in arrs.items()} for ch, arrs in out.own.items()})
            comm_rounds += 1
            total_wire, total_payload = total_wire + wire_round, total_payload + payload_round
        state = algo.step(state, combined, problem, ctx)
        if is_record_point(algo, t, iterations):
            theta = state.theta
            rec: dict[str, Any] = {
                "round": comm_rounds, "t": t + 1,
                "train_loss": float(np.mean(state.loss)),
                "consensus": _consensus(theta),
                "bytes": total_wire, "payload_bytes": total_payload,
                "seconds": time.perf_counter() - t0,
            }
            if comm_rounds % eval_every == 0 or t + 1 == iterations:
                rec["test_loss"] = float(np.mean([o.test_loss(th) for th, o in zip(theta, oracles)]))
                theta_bar = np.mean(theta.astype(np.float64), axis=0).astype(theta.dtype)
                rec["avg_model_test_loss"] = float(np.mean([o.test_loss(theta_bar) for o in oracles]))
            curve.append(rec)
    return _split(state, n), curve, (wire_round if comm_rounds else 0), (payload_round if comm_rounds else 0)
