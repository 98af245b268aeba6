"""All nodes of a network as stacked arrays: the in-process engine's fast path (``graphfl p2p --engine inprocess``).

For algorithms whose node step is elementwise arithmetic plus a gradient of a linear model
(gossip, DFL-SGD, DFL-GT) on problems with the same data shape on every node (``linreg``,
``clusters``, ``vector``), one iteration of all ``n`` nodes is a handful of array operations on
``(n, d)`` matrices instead of ``n`` Python calls:

* **mixing** ``x̃_i = Σ_{j ∈ N̄_i} W_ij x_j`` (:func:`graphfl.p2p.mixing.mix`) over padded
  neighbour slots: slot ``s`` holds every node's ``s``-th neighbour in ascending ``j``, and the
  slots are added in order, so each node's terms are summed in exactly the order and precision
  of ``mix`` — the result is bit-identical to the per-node driver (tested);
* **steps** are the update rules of :mod:`graphfl.p2p.algorithms.dfl_sgd` /
  :mod:`~graphfl.p2p.algorithms.dfl_gt` / :mod:`~graphfl.p2p.algorithms.gossip` written on rows
  (``θ ← base − α_t g``, ``ϑ ← base_ϑ + g_new − g_old``, float64, one rounding);
* **gradients** of ``f_i(θ) = ‖A_i θ − b_i‖² / (2m)`` for all nodes at once
  (:class:`LinearBatch`); each node still draws its minibatch from its own RNG in the same order,
  so the draws are the per-node driver's. The batched products (``einsum``) may round differently
  from the per-node BLAS calls, so iterates agree to ~1e-12 relative, not bit for bit (tested).

Everything else (ADMM, FedRelax, torch tasks, unequal data shapes) runs on the generic
per-node driver :func:`graphfl.p2p.driver.run_network_inprocess`; :func:`supports` says which.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from graphfl.p2p.algorithms.base import PARAMS, THETA, NodeState, P2PAlgorithm
from graphfl.p2p.mixing import accumulator_dtype
from graphfl.p2p.node import WireSizes

VECTORISED_ALGORITHMS = ("gossip", "dfl-sgd", "dfl-gt")


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

    @staticmethod
    def fits(oracles: Sequence[Any]) -> bool:
        """Whether every oracle is a linear least-squares problem and all have the same shapes."""
        from graphfl.p2p.oracles import LinRegOracle, TabularOracle

        if not oracles or not all(type(o) in (LinRegOracle, TabularOracle) for o in oracles):
            return False
        if any(getattr(o, "name", "") == "clusters-logistic" for o in oracles):
            return False  # its gradient oracle is still least squares, but keep the generic path for it
        shapes = {(np.shape(o.x_train), np.shape(o.y_train), o.batch_size) for o in oracles}
        return len(shapes) == 1

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


def _consensus(theta: np.ndarray) -> float:
    """:func:`graphfl.p2p.driver.consensus_distance` of the rows of ``theta``."""
    x = theta.astype(np.float64)
    return float(np.mean(np.sum((x - x.mean(axis=0)) ** 2, axis=1)))


def supports(algo: P2PAlgorithm[Any, Any], oracles: Sequence[Any]) -> bool:
    """Whether :func:`run_vectorised` can run ``algo`` on ``oracles`` (else use the per-node driver)."""
    from graphfl.p2p.oracles import VectorOracle

    if algo.name not in VECTORISED_ALGORITHMS:
        return False
    if algo.name == "dfl-gt" and getattr(algo.params, "same_batch_difference", False):
        return False
    if algo.name == "gossip":
        return LinearBatch.fits(oracles) or (bool(oracles) and all(type(o) is VectorOracle for o in oracles))
    return LinearBatch.fits(oracles)


def run_vectorised(algo: P2PAlgorithm[Any, Any], oracles: Sequence[Any], w: npt.ArrayLike, iterations: int, *,
                   eval_every: int = 1) -> tuple[list[NodeState], list[dict[str, Any]], int, int]:
    """Iterations ``0 .. iterations−1`` of gossip / DFL-SGD / DFL-GT on all nodes as arrays.

    Returns ``(final states, curve, wire bytes per round, payload bytes per round)`` with the
    curve records of :func:`graphfl.p2p.driver.run_network_inprocess` (``bytes_model="gossip"``).
    """
    from graphfl.p2p.driver import is_record_point

    name = algo.name
    slots = MixingSlots(w)
    n = slots.idx.shape[0]
    theta0 = [np.array(o.initial_theta(), copy=True) for o in oracles]
    theta = np.stack(theta0)
    dtype = theta.dtype
    batch_problem = LinearBatch(oracles) if name != "gossip" else None
    tracker = g_prev = None
    loss = np.full(n, np.nan)
    if name == "dfl-gt":
        assert batch_problem is not None
        g_prev, loss = batch_problem.grad(theta, batch_problem.sample())
        tracker = g_prev.copy() if algo.params.init_tracker == "gnsd" else np.zeros_like(g_prev)
    step_size = getattr(algo, "step_size", None)
    # one message layout for every node: the wire size of one message times the directed edges
    sizes = WireSizes()
    message: dict[str, dict[str, np.ndarray]] = {PARAMS: {THETA: theta[0]}}
    if tracker is not None:
        message["tracker"] = {"tracker": tracker[0].astype(dtype)}
    one_wire, one_payload = sizes(message)
    directed = int(slots.degrees.sum())
    wire_round, payload_round = directed * one_wire, directed * one_payload
    curve: list[dict[str, Any]] = []
    comm_rounds = total_wire = total_payload = 0
    t0 = time.perf_counter()
    for t in range(iterations):
        communicates = algo.communicates(t)
        base = slots.mix(theta) if communicates else theta
        if name == "gossip":
            theta = base
        else:
            assert batch_problem is not None and step_size is not None
            alpha = step_size(t)
            if name == "dfl-sgd":
                g, loss = batch_problem.grad(theta, batch_problem.sample())
                theta = (base.astype(np.float64) - alpha * g.astype(np.float64)).astype(dtype, copy=False)
            else:
                assert tracker is not None and g_prev is not None
                base_tracker = slots.mix(tracker) if communicates else tracker
                theta = (base.astype(np.float64) - alpha * tracker.astype(np.float64)).astype(dtype, copy=False)
                g_new, loss = batch_problem.grad(theta, batch_problem.sample())
                tracker = (base_tracker.astype(np.float64) + g_new - g_prev).astype(tracker.dtype, copy=False)
                g_prev = g_new
        if communicates:
            comm_rounds += 1
            total_wire, total_payload = total_wire + wire_round, total_payload + payload_round
        if is_record_point(algo, t, iterations):
            rec: dict[str, Any] = {
                "round": comm_rounds, "t": t + 1,
                "train_loss": float(np.mean(loss)),
                "consensus": _consensus(theta),
                "bytes": total_wire, "payload_bytes": total_payload,
                "seconds": time.perf_counter() - t0,
            }
            if comm_rounds % eval_every == 0 or t + 1 == iterations:
                rec["test_loss"] = float(np.mean([o.test_loss(th) for th, o in zip(theta, oracles)]))
                theta_bar = np.mean(theta.astype(np.float64), axis=0).astype(dtype)
                rec["avg_model_test_loss"] = float(np.mean([o.test_loss(theta_bar) for o in oracles]))
            curve.append(rec)
    states = []
    for i in range(n):
        aux = {} if g_prev is None else {"g_prev": g_prev[i]}
        states.append(NodeState(t=iterations, theta=theta[i], tracker=None if tracker is None else tracker[i], aux=aux,
                                loss=float(loss[i])))
    return states, curve, (wire_round if comm_rounds else 0), (payload_round if comm_rounds else 0)
