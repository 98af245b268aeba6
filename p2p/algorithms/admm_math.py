"""FedADMM: fused-lasso M-estimation on a graph by decentralized stochastic ADMM (ALGORITHMS.md §6).

Pure mathematical core (numpy/scipy only, no graphfl imports) of Wang, Zhao, Lin,
"Heterogeneous federated learning on a graph" (seed 001; full manuscript = "original paper").

Estimator (§6.1, original paper eq. 5, *without* the ``1/|V|`` of seed 001 eq. 1)::

    Θ̂ = argmin_Θ  Σ_u M̂_u(θ_u) + λ Σ_{{i,j}∈E} φ(θ_i − θ_j),     M̂_u(θ) = (1/n_u) Σ_k m(z_k^{(u)}; θ)

with ``φ = ‖·‖₁`` (``"l1"``) or ``‖·‖₂`` (``"l2"``).

Decentralized protocol (§6.4–§6.6), one iteration ``t → t+1``
-----------------------------------------------------------------
Edge ``{i, j}`` is *owned* by ``max(i, j)`` (:func:`owner_of`; the manuscript orients edges from
the larger to the smaller index). Every node ``i`` keeps, per neighbour ``j``, its *half-edge*
state :class:`EdgeState` ``(β_ij, α_ij)``; the owner ``i`` additionally keeps a mirror of the other
half ``(β_ji, α_ji)`` (it computes both, so the mirror never drifts).

1. **Node step** at every node ``i`` (:func:`node_step`, eq. 14)::

       θ_i(t+1) = θ_i(t) − η_i(t) [ g_i + ρ Σ_{j∈N_i} (θ_i(t) − β_ij(t) − α_ij(t)/ρ) ]

   with ``g_i`` the full-batch or mini-batch gradient (:func:`minibatch_gradient`), optionally
   inverse-probability weighted (:func:`ipw_gradient`, §6.10).
2. **Message node → owner**: node ``i`` sends ``θ_i(t+1)`` (``p`` floats) to every neighbour
   ``j`` that owns the edge (``j > i``). §6.6 sends it to *every* neighbour (``2|E|p`` floats);
   the non-owner never uses it, so a wrapper may skip that direction.
3. **Edge step** by the owner ``i`` of ``{i, j}`` (:func:`edge_step` = :func:`beta_step` eq. 15
   + :func:`dual_step` eq. 16), closed form derived in §6.5::

       a = θ_i(t+1) − α_ij(t)/ρ,  b = θ_j(t+1) − α_ji(t)/ρ,  e = a − b,  s = (a + b)/2
       δ = prox_{(2λ/ρ)φ}(e)
       β_ij(t+1) = s + δ/2,   β_ji(t+1) = s − δ/2
       α_ij(t+1) = α_ij(t) − ρ (θ_i(t+1) − β_ij(t+1)),   α_ji(t+1) likewise

4. **Message owner → other endpoint**: the owner sends the new half ``(β_ji(t+1), α_ji(t+1))``
   (``2p`` floats, an :class:`EdgeState`) to ``j``, which replaces its own half with it.
   (``α_ji(t+1)`` is also recomputable by ``j`` from ``β_ji(t+1)`` and its own ``θ_j(t+1)``
   with :func:`dual_step`; sending it follows §6.6.)

Output (§6.5): ``Θ̄ = (1/T) Σ_{t=0}^{T−1} Θ(t)`` (:class:`ThetaAverage`).

Invariants (derived, tested): after every edge step ``α_ij = −λ s_ij`` with
``s_ij ∈ ∂φ(β_ij − β_ji)``, hence ``α_ij + α_ji = 0`` and ``φ*(α_ij) ≤ λ``
(``‖α_ij‖_∞ ≤ λ`` for ℓ1, ``‖α_ij‖₂ ≤ λ`` for ℓ2). At a fixed point ``θ_i = β_ij`` and
``∇M̂_i(θ_i) = Σ_j α_ij``, which is the KKT condition of the estimator.

Also here: M-estimation losses (:class:`MLoss` protocol, :class:`LeastSquaresLoss`,
:class:`LogisticLoss`), local/global estimators (damped Newton), the step-size rule
(:class:`StepSchedule`), edge selection (§6.9, :func:`select_edges`), randomly inaccessible
devices (§6.10), λ by K-fold cross-validation (:func:`cross_validate_lambda`), the all-nodes
reference loop :func:`run_admm_reference` and the same iteration on stacked arrays
(:func:`run_admm_stacked`, for benchmarks). The edge test's covariance (:func:`local_statistics`)
is the σ̂²-scaled Hessian form by default, or the sandwich with or without the HC3 correction.

Reproducibility: all sums over neighbours run in ascending neighbour id; edge lists are kept in
the canonical order of :func:`canonical_edges`; mini-batch indices are sorted before summing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
from scipy import sparse, special, stats

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
Phi = Literal["l1", "l2"]
Edge = tuple[int, int]
Dataset = tuple[FloatArray, FloatArray]
ModelT = TypeVar("ModelT")

PHIS: tuple[str, ...] = ("l1", "l2")
Covariance = Literal["hessian", "sandwich-hc3", "sandwich"]
COVARIANCES: tuple[str, ...] = ("hessian", "sandwich-hc3", "sandwich")
"""Covariance estimators of the edge test (:func:`local_statistics`); the first is the default."""


# ---------------------------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------------------------


def _as_vector(name: str, v: npt.ArrayLike, dim: int | None = None) -> FloatArray:
    a = np.asarray(v, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError(f"{name} must be a 1-D vector, got shape {a.shape}")
    if dim is not None and a.shape[0] != dim:
        raise ValueError(f"{name} must have length {dim}, got shape {a.shape}")
    return a


def _check_xy(theta: npt.ArrayLike, X: npt.ArrayLike, y: npt.ArrayLike) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Validate ``θ (p,)``, ``X (n, p)``, ``y (n,)`` with ``n >= 1``; return float64 copies/views."""
    x = np.asarray(X, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"X must be a 2-D array (n, p), got shape {x.shape}")
    if x.shape[0] == 0:
        raise ValueError(f"X must have at least one row, got shape {x.shape}")
    yy = np.asarray(y, dtype=np.float64)
    if yy.shape != (x.shape[0],):
        raise ValueError(f"y must have shape ({x.shape[0]},) to match X {x.shape}, got shape {yy.shape}")
    th = _as_vector("theta", theta, x.shape[1])
    return th, x, yy


def _check_positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value!r}")
    return v


def _check_phi(phi: str) -> Phi:
    if phi == "l1":
        return "l1"
    if phi == "l2":
        return "l2"
    raise ValueError(f"phi must be one of {list(PHIS)}, got {phi!r}")


# ---------------------------------------------------------------------------------------------
# M-estimation losses
# ---------------------------------------------------------------------------------------------


class MLoss(Protocol):
    """A differentiable per-sample M-estimation loss ``m(z; θ)`` with ``z = (x, y)`` (§6.1).

    Every method receives ``θ (p,)``, ``X (n, p)``, ``y (n,)`` and *averages* over the ``n`` rows,
    i.e. it evaluates ``M̂(θ) = (1/n) Σ_k m(z_k; θ)`` and its derivatives. ``scores`` returns the
    per-sample gradients ``ψ(z_k; θ) = ∇_θ m(z_k; θ)`` as rows (needed by the sandwich
    covariance of §6.9). Any loss with these four methods plugs into every function here.

    Two optional methods refine the edge test's covariance (:func:`local_statistics`):
    ``dispersion(θ, X, y, dof)`` — the scale ``σ̂²`` of the Hessian form ``σ̂²·Ĥ⁻¹`` (a loss
    without it is taken as a negative log-likelihood with unit dispersion, ``σ̂² = 1``) — and
    ``sample_curvatures(θ, X, y)`` — ``w_k`` with ``∇²m(z_k; θ) = w_k x_k x_kᵀ`` (needed for the
    HC3 leverages).
    """

    def value(self, theta: FloatArray, X: FloatArray, y: FloatArray) -> float: ...

    def grad(self, theta: FloatArray, X: FloatArray, y: FloatArray) -> FloatArray: ...

    def hessian(self, theta: FloatArray, X: FloatArray, y: FloatArray) -> FloatArray: ...

    def scores(self, theta: FloatArray, X: FloatArray, y: FloatArray) -> FloatArray: ...


class LeastSquaresLoss:
    """``m((x, y); θ) = ½ (y − xᵀθ)²`` (§6.12 simulation loss).

    ``M̂ = (1/2n) ‖y − Xθ‖²``, ``∇M̂ = −Xᵀ(y − Xθ)/n``, ``∇²M̂ = XᵀX/n``, ``ψ_k = −(y_k − x_kᵀθ) x_k``.
    Not a likelihood: the noise variance is estimated, ``σ̂² = RSS/dof`` (:meth:`dispersion`).
    """

    def value(self, theta: FloatArray, X: FloatArray, y: FloatArray) -> float:
        th, x, yy = _check_xy(theta, X, y)
        r = yy - x @ th
        return float(0.5 * np.mean(r * r))

    def grad(self, theta: FloatArray, X: FloatArray, y: FloatArray) -> FloatArray:
        th, x, yy = _check_xy(theta, X, y)
        r = yy - x @ th
        out: FloatArray = -(x.T @ r) / x.shape[0]
        return out

    def hessian(self, theta: FloatArray, X: FloatArray, y: FloatArray) -> FloatArray:
        _, x, _ = _check_xy(theta, X, y)
        out: FloatArray = (x.T @ x) / x.shape[0]
        return out

    def scores(self, theta: FloatArray, X: FloatArray, y: FloatArray) -> FloatArray:
        th, x, yy = _check_xy(theta, X, y)
        r = yy - x @ th
        out: FloatArray = -r[:, None] * x
        return out

    def dispersion(self, theta: FloatArray, X: FloatArray, y: FloatArray, dof: float) -> float:
        """``σ̂² = RSS / dof`` with ``RSS = Σ_k (y_k − x_kᵀθ)²`` (``dof = n − p`` for an unpenalised fit)."""
        th, x, yy = _check_xy(theta, X, y)
        d = _check_positive("dof", dof)
        r = yy - x @ th
        return float(r @ r) / d

    def sample_curvatures(self, theta: FloatArray, X: FloatArray, y: FloatArray) -> FloatArray:
        """``w_k = 1``: ``∇²m(z_k; θ) = x_k x_kᵀ``."""
        _, x, _ = _check_xy(theta, X, y)
        return np.ones(x.shape[0])


class LogisticLoss:
    """Logistic regression, ``y ∈ [0, 1]`` (0/1 labels): ``m((x, y); θ) = log(1 + e^z) − y z``, ``z = xᵀθ``.

    Numerically stable: ``log(1 + e^z) = logaddexp(0, z)``, ``σ(z) = expit(z)`` and
    ``σ(z)(1 − σ(z)) = expit(z)·expit(−z)`` (no cancellation for large ``|z|``).
    ``∇M̂ = Xᵀ(σ(Xθ) − y)/n``, ``∇²M̂ = Xᵀ diag(σ(1−σ)) X / n``, ``ψ_k = (σ(z_k) − y_k) x_k``.
    """

    @staticmethod
    def _check_labels(y: FloatArray) -> None:
        if np.any(y < 0.0) or np.any(y > 1.0) or not np.all(np.isfinite(y)):
            raise ValueError(f"logistic loss needs labels y in [0, 1] (0/1 classes), got range "
                             f"[{float(np.min(y))!r}, {float(np.max(y))!r}] for y of shape {y.shape}")

    def value(self, theta: FloatArray, X: FloatArray, y: FloatArray) -> float:
        th, x, yy = _check_xy(theta, X, y)
        self._check_labels(yy)
        z = x @ th
        return float(np.mean(np.logaddexp(0.0, z) - yy * z))

    def grad(self, theta: FloatArray, X: FloatArray, y: FloatArray) -> FloatArray:
        th, x, yy = _check_xy(theta, X, y)
        self._check_labels(yy)
        r = special.expit(x @ th) - yy
        out: FloatArray = (x.T @ r) / x.shape[0]
        return out

    def hessian(self, theta: FloatArray, X: FloatArray, y: FloatArray) -> FloatArray:
        th, x, yy = _check_xy(theta, X, y)
        self._check_labels(yy)
        z = x @ th
        w = special.expit(z) * special.expit(-z)
        out: FloatArray = (x.T @ (w[:, None] * x)) / x.shape[0]
        return out

    def scores(self, theta: FloatArray, X: FloatArray, y: FloatArray) -> FloatArray:
        th, x, yy = _check_xy(theta, X, y)
        self._check_labels(yy)
        r = special.expit(x @ th) - yy
        out: FloatArray = r[:, None] * x
        return out

    def dispersion(self, theta: FloatArray, X: FloatArray, y: FloatArray, dof: float) -> float:
        """``1``: a Bernoulli negative log-likelihood has no free scale (Ω̂ = Ĥ⁻¹, seed 001 eq. 2)."""
        _check_xy(theta, X, y)
        return 1.0

    def sample_curvatures(self, theta: FloatArray, X: FloatArray, y: FloatArray) -> FloatArray:
        """``w_k = σ(z_k)(1 − σ(z_k))``: ``∇²m(z_k; θ) = w_k x_k x_kᵀ``."""
        th, x, yy = _check_xy(theta, X, y)
        self._check_labels(yy)
        z = x @ th
        out: FloatArray = special.expit(z) * special.expit(-z)
        return out


def _per_node_losses(loss: MLoss | Sequence[MLoss], n_nodes: int) -> list[MLoss]:
    if isinstance(loss, Sequence):
        if len(loss) != n_nodes:
            raise ValueError(f"loss must be one MLoss or one per node ({n_nodes}), got {len(loss)} losses")
        return list(loss)
    return [loss] * n_nodes


def _check_data(data: Sequence[Dataset]) -> tuple[list[Dataset], int]:
    """Validate a list of per-node ``(X_u (n_u, p), y_u (n_u,))``; return float64 arrays and ``p``."""
    if len(data) == 0:
        raise ValueError("data must hold at least one node's (X, y), got an empty sequence")
    out: list[Dataset] = []
    p: int | None = None
    for u, pair in enumerate(data):
        if len(pair) != 2:
            raise ValueError(f"data[{u}] must be a pair (X, y), got {len(pair)} items")
        x = np.asarray(pair[0], dtype=np.float64)
        yy = np.asarray(pair[1], dtype=np.float64)
        if x.ndim != 2 or x.shape[0] == 0 or yy.shape != (x.shape[0],):
            raise ValueError(f"data[{u}] must be X (n_u>=1, p) and y (n_u,), got shapes {x.shape} and {yy.shape}")
        if p is None:
            p = x.shape[1]
        elif x.shape[1] != p:
            raise ValueError(f"data[{u}] has X of shape {x.shape}; every node needs p = {p} columns")
        out.append((x, yy))
    assert p is not None
    return out, p


# ---------------------------------------------------------------------------------------------
# local / global estimators (damped Newton)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NewtonResult:
    """Outcome of :func:`newton_minimize`: the minimiser, iterations used, and convergence."""

    theta: FloatArray
    iterations: int
    converged: bool


def newton_minimize(
    value: Callable[[FloatArray], float],
    grad: Callable[[FloatArray], FloatArray],
    hessian: Callable[[FloatArray], FloatArray],
    theta0: FloatArray,
    *,
    ridge: float = 0.0,
    max_iter: int = 100,
    tol: float = 1e-12,
) -> NewtonResult:
    """Minimise ``f(θ) + (ridge/2)‖θ‖²`` by damped Newton with Armijo backtracking.

    Step ``d = (∇²f + ridge·I)⁻¹ (∇f + ridge·θ)`` (``lstsq`` if singular), ``θ ← θ − s d`` with the
    largest ``s ∈ {1, ½, ¼, …}`` satisfying ``F(θ − s d) ≤ F(θ) − 10⁻⁴ s ∇Fᵀd``. Stops when the
    Newton decrement ``∇Fᵀd / 2 ≤ tol`` (converged) or after ``max_iter`` steps (not converged,
    e.g. separable logistic data without a ridge).
    """
    _check_positive("ridge", ridge, allow_zero=True)
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter}")
    theta = np.array(theta0, dtype=np.float64)
    p = theta.shape[0]

    def objective(th: FloatArray) -> float:
        return value(th) + 0.5 * ridge * float(th @ th)

    f = objective(theta)
    for it in range(1, max_iter + 1):
        g = grad(theta) + ridge * theta
        h = hessian(theta) + ridge * np.eye(p)
        try:
            d = np.linalg.solve(h, g)
        except np.linalg.LinAlgError:
            d = np.linalg.lstsq(h, g, rcond=None)[0]
        decrement = float(g @ d)
        if not math.isfinite(decrement) or decrement < 0:
            # H is not positive definite along d: fall back to a gradient step.
            d = g
            decrement = float(g @ g)
        if 0.5 * decrement <= tol:
            return NewtonResult(theta, it - 1, True)
        step = 1.0
        while True:
            cand = theta - step * d
            f_cand = objective(cand)
            if f_cand <= f - 1e-4 * step * decrement or step < 1e-12:
                break
            step *= 0.5
        if step < 1e-12:
            logger.debug("newton_minimize: line search stalled at iteration %d", it)
            return NewtonResult(theta, it, 0.5 * decrement <= max(tol, 1e-10))
        theta, f = cand, f_cand
    g = grad(theta) + ridge * theta
    return NewtonResult(theta, max_iter, bool(float(np.max(np.abs(g))) <= math.sqrt(tol)))


def default_ridge(hessian: FloatArray) -> float:
    """The stabilising ridge of §6.11: ``1e-6 · tr(Ĥ) / p`` (reconstructed)."""
    h = np.asarray(hessian, dtype=np.float64)
    if h.ndim != 2 or h.shape[0] != h.shape[1]:
        raise ValueError(f"hessian must be square (p, p), got shape {h.shape}")
    return 1e-6 * float(np.trace(h)) / max(int(h.shape[0]), 1)


def local_estimator(
    loss: MLoss,
    X: FloatArray,
    y: FloatArray,
    *,
    ridge: float = 0.0,
    theta0: FloatArray | None = None,
    max_iter: int = 100,
    tol: float = 1e-14,
) -> FloatArray:
    """Local M-estimator ``θ̂_u = argmin_θ M̂_u(θ) + (ridge/2)‖θ‖²`` (§6.9; original paper eq. 4).

    Damped Newton (:func:`newton_minimize`), started at ``theta0`` (default 0). Logs a warning if
    Newton does not converge (separable logistic data: pass ``ridge > 0``).
    """
    x = np.asarray(X, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"X must be a 2-D array (n, p), got shape {x.shape}")
    th0 = np.zeros(x.shape[1]) if theta0 is None else _as_vector("theta0", theta0, x.shape[1])
    _check_xy(th0, x, y)
    yy = np.asarray(y, dtype=np.float64)
    res = newton_minimize(lambda t: loss.value(t, x, yy), lambda t: loss.grad(t, x, yy),
                          lambda t: loss.hessian(t, x, yy), th0, ridge=ridge, max_iter=max_iter, tol=tol)
    if not res.converged:
        logger.warning("local_estimator: Newton did not converge in %d iterations (ridge=%g)", max_iter, ridge)
    return res.theta


def global_estimator(
    loss: MLoss | Sequence[MLoss],
    data: Sequence[Dataset],
    *,
    weighting: Literal["node", "sample"] = "node",
    ridge: float = 0.0,
    max_iter: int = 100,
    tol: float = 1e-14,
) -> FloatArray:
    """One ``θ`` for all nodes: ``argmin_θ Σ_u w_u M̂_u(θ) + (ridge/2)‖θ‖²``.

    ``weighting="node"``: ``w_u = 1`` — the ``λ → ∞`` limit of eq. 5 on a connected graph.
    ``weighting="sample"``: ``w_u = n_u / Σ_v n_v`` — the pooled estimator over all samples
    (original paper eq. 3). The two coincide when all ``n_u`` are equal. Node sums run in node order.
    """
    d, p = _check_data(data)
    losses = _per_node_losses(loss, len(d))
    if weighting == "node":
        weights = [1.0] * len(d)
    elif weighting == "sample":
        total = float(sum(x.shape[0] for x, _ in d))
        weights = [x.shape[0] / total for x, _ in d]
    else:
        raise ValueError(f"weighting must be 'node' or 'sample', got {weighting!r}")

    def value(t: FloatArray) -> float:
        return math.fsum(w * m.value(t, x, yy) for w, m, (x, yy) in zip(weights, losses, d))

    def grad(t: FloatArray) -> FloatArray:
        acc = np.zeros(p)
        for w, m, (x, yy) in zip(weights, losses, d):
            acc += w * m.grad(t, x, yy)
        return acc

    def hess(t: FloatArray) -> FloatArray:
        acc = np.zeros((p, p))
        for w, m, (x, yy) in zip(weights, losses, d):
            acc += w * m.hessian(t, x, yy)
        return acc

    res = newton_minimize(value, grad, hess, np.zeros(p), ridge=ridge, max_iter=max_iter, tol=tol)
    if not res.converged:
        logger.warning("global_estimator: Newton did not converge in %d iterations", max_iter)
    return res.theta


# ---------------------------------------------------------------------------------------------
# graph helpers
# ---------------------------------------------------------------------------------------------


def owner_of(i: int, j: int) -> int:
    """The node that owns edge ``{i, j}`` and computes its edge step: ``max(i, j)`` (§6.4)."""
    if i == j:
        raise ValueError(f"an edge needs two distinct endpoints, got i = j = {i}")
    return max(i, j)


def canonical_edges(edges: Iterable[Sequence[int]], n_nodes: int) -> list[Edge]:
    """Edges as ``(owner, other) = (max, min)`` pairs, deduplicated, sorted ascending.

    Raises ``ValueError`` for self loops or endpoints outside ``[0, n_nodes)``.
    """
    out: set[Edge] = set()
    for k, e in enumerate(edges):
        if len(e) != 2:
            raise ValueError(f"edges[{k}] must be a pair (i, j), got {tuple(e)!r}")
        i, j = int(e[0]), int(e[1])
        if not (0 <= i < n_nodes and 0 <= j < n_nodes):
            raise ValueError(f"edges[{k}] = ({i}, {j}) has an endpoint outside [0, {n_nodes})")
        if i == j:
            raise ValueError(f"edges[{k}] = ({i}, {j}) is a self loop")
        out.add((max(i, j), min(i, j)))
    return sorted(out)


def edges_from_adjacency(adjacency: npt.ArrayLike) -> list[Edge]:
    """Canonical edge list of a symmetric ``V × V`` adjacency (entries ``> 0`` are edges)."""
    a = np.asarray(adjacency, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"adjacency must be a square (V, V) array, got shape {a.shape}")
    if not np.array_equal(a > 0, (a > 0).T):
        raise ValueError("adjacency must be symmetric (edges are undirected)")
    if np.any(np.diag(a) > 0):
        raise ValueError("adjacency must have a zero diagonal (no self loops)")
    return canonical_edges(np.argwhere(np.tril(a, -1) > 0).tolist(), a.shape[0])


def complete_graph_edges(n_nodes: int) -> list[Edge]:
    """All ``n(n−1)/2`` pairs in canonical order — the edge list of FedADMM-Local-ES (§6.9)."""
    if n_nodes < 0:
        raise ValueError(f"n_nodes must be >= 0, got {n_nodes}")
    return [(i, j) for i in range(n_nodes) for j in range(i)]


def neighbours(edges: Sequence[Edge], n_nodes: int) -> list[list[int]]:
    """Sorted neighbour lists ``N_i`` (ascending id — the summation order of :func:`node_step`)."""
    nb: list[list[int]] = [[] for _ in range(n_nodes)]
    for i, j in canonical_edges(edges, n_nodes):
        nb[i].append(j)
        nb[j].append(i)
    return [sorted(x) for x in nb]


# ---------------------------------------------------------------------------------------------
# proximal operators (edge step)
# ---------------------------------------------------------------------------------------------


def soft_threshold(v: FloatArray, tau: float) -> FloatArray:
    """``prox_{τ‖·‖₁}(v)``: elementwise ``sign(v_k) · max(|v_k| − τ, 0)``."""
    return _soft_threshold(_as_vector("v", v), _check_positive("tau", tau, allow_zero=True))


def _soft_threshold(v: FloatArray, tau: float) -> FloatArray:
    out: FloatArray = np.sign(v) * np.maximum(np.abs(v) - tau, 0.0)
    return out


def group_soft_threshold(v: FloatArray, tau: float) -> FloatArray:
    """``prox_{τ‖·‖₂}(v) = max(0, 1 − τ/‖v‖₂) · v`` (block soft threshold; 0 when ``‖v‖₂ ≤ τ``)."""
    return _group_soft_threshold(_as_vector("v", v), _check_positive("tau", tau, allow_zero=True))


def _group_soft_threshold(v: FloatArray, tau: float) -> FloatArray:
    norm = math.sqrt(float(v @ v))
    if norm <= tau:  # includes v = 0: no division
        return np.zeros_like(v)
    out: FloatArray = (1.0 - tau / norm) * v
    return out


def prox_norm(v: FloatArray, tau: float, phi: Phi) -> FloatArray:
    """``prox_{τφ}(v) = argmin_x τφ(x) + ½‖x − v‖²`` for ``φ ∈ {ℓ1, ℓ2}``."""
    if _check_phi(phi) == "l1":
        return soft_threshold(v, tau)
    return group_soft_threshold(v, tau)


def dual_norm(v: FloatArray, phi: Phi) -> float:
    """``φ*(v)``: ``‖v‖_∞`` for ``φ = ℓ1``, ``‖v‖₂`` for ``φ = ℓ2``."""
    a = _as_vector("v", v)
    if _check_phi(phi) == "l1":
        return float(np.max(np.abs(a), initial=0.0))
    return float(np.linalg.norm(a))


# ---------------------------------------------------------------------------------------------
# per-edge state and steps
# ---------------------------------------------------------------------------------------------


@dataclass
class EdgeState:
    """Node ``i``'s half of edge ``{i, j}``: ``β_ij`` (its copy of the edge variable, constraint
    ``θ_i = β_ij``) and ``α_ij`` (the dual of that constraint), both ``(p,)`` (§6.2, §6.4).

    The owner of the edge sends the other endpoint's new half as this object (§6.6).
    """

    beta: FloatArray
    alpha: FloatArray

    def copy(self) -> EdgeState:
        return EdgeState(self.beta.copy(), self.alpha.copy())


def init_edge_state(theta_i: FloatArray) -> EdgeState:
    """Initial half-edge: ``β_ij(0) = θ_i(0)``, ``α_ij(0) = 0`` (§6.3, reconstructed)."""
    th = _as_vector("theta_i", theta_i)
    return EdgeState(th.copy(), np.zeros_like(th))


def node_step(
    theta: FloatArray,
    grad: FloatArray,
    halves: Sequence[EdgeState],
    *,
    rho: float,
    eta: float,
) -> FloatArray:
    """Node step, original paper eq. 14 / ALGORITHMS §6.5::

        θ_i(t+1) = θ_i(t) − η [ g_i + ρ Σ_{j∈N_i} (θ_i(t) − β_ij(t) − α_ij(t)/ρ) ]

    computed as ``g_i + Σ_j (ρ(θ_i − β_ij) − α_ij)``, summed in the order of ``halves``
    (pass them in ascending neighbour id). ``grad`` may be IPW-weighted (eq. 19); an isolated
    node (no halves) takes a plain gradient step.
    """
    rho = _check_positive("rho", rho)
    eta = _check_positive("eta", eta, allow_zero=True)
    th = _as_vector("theta", theta)
    g = _as_vector("grad", grad, th.shape[0])
    for k, h in enumerate(halves):
        _as_vector(f"halves[{k}].beta", h.beta, th.shape[0])
        _as_vector(f"halves[{k}].alpha", h.alpha, th.shape[0])
    return _node_step(th, g, halves, rho, eta)


def _node_step(theta: FloatArray, grad: FloatArray, halves: Sequence[EdgeState], rho: float, eta: float) -> FloatArray:
    """:func:`node_step` without validation (float64 ``(p,)`` arrays, ``ρ > 0`` assumed)."""
    coupling = np.zeros_like(theta)
    for h in halves:
        coupling += rho * (theta - h.beta) - h.alpha
    out: FloatArray = theta - eta * (grad + coupling)
    return out


def beta_step(
    theta_i: FloatArray,
    theta_j: FloatArray,
    alpha_ij: FloatArray,
    alpha_ji: FloatArray,
    *,
    lam: float,
    rho: float,
    phi: Phi,
) -> tuple[FloatArray, FloatArray]:
    """Edge-variable step, eq. 15, in closed form (ALGORITHMS §6.5, derived)::

        (β_ij, β_ji) = argmin λφ(β_ij − β_ji) + (ρ/2)(‖θ_i − β_ij − α_ij/ρ‖² + ‖θ_j − β_ji − α_ji/ρ‖²)
        a = θ_i − α_ij/ρ, b = θ_j − α_ji/ρ, e = a − b, s = (a+b)/2, δ = prox_{(2λ/ρ)φ}(e)
        β_ij = s + δ/2,  β_ji = s − δ/2

    Returns ``(β_ij(t+1), β_ji(t+1))``.
    """
    lam = _check_positive("lam", lam, allow_zero=True)
    rho = _check_positive("rho", rho)
    ti = _as_vector("theta_i", theta_i)
    p = ti.shape[0]
    return _beta_step(ti, _as_vector("theta_j", theta_j, p), _as_vector("alpha_ij", alpha_ij, p),
                      _as_vector("alpha_ji", alpha_ji, p), lam, rho, _check_phi(phi))


def _beta_step(theta_i: FloatArray, theta_j: FloatArray, alpha_ij: FloatArray, alpha_ji: FloatArray,
               lam: float, rho: float, phi: Phi) -> tuple[FloatArray, FloatArray]:
    """:func:`beta_step` without validation."""
    a = theta_i - alpha_ij / rho
    b = theta_j - alpha_ji / rho
    s = 0.5 * (a + b)
    e = a - b
    tau = 2.0 * lam / rho
    delta = _soft_threshold(e, tau) if phi == "l1" else _group_soft_threshold(e, tau)
    return s + 0.5 * delta, s - 0.5 * delta


def dual_step(alpha: FloatArray, theta_new: FloatArray, beta_new: FloatArray, *, rho: float) -> FloatArray:
    """Dual step, eq. 16: ``α_ij(t+1) = α_ij(t) − ρ (θ_i(t+1) − β_ij(t+1))``."""
    rho = _check_positive("rho", rho)
    a = _as_vector("alpha", alpha)
    p = a.shape[0]
    out: FloatArray = a - rho * (_as_vector("theta_new", theta_new, p) - _as_vector("beta_new", beta_new, p))
    return out


def edge_step(
    theta_i: FloatArray,
    theta_j: FloatArray,
    half_ij: EdgeState,
    half_ji: EdgeState,
    *,
    lam: float,
    rho: float,
    phi: Phi,
) -> tuple[EdgeState, EdgeState]:
    """The owner's full edge step for ``{i, j}``: :func:`beta_step` (eq. 15) then :func:`dual_step`
    (eq. 16) on both halves, from ``θ_i(t+1)``, ``θ_j(t+1)`` and the halves at ``t``.

    Returns the new ``(half_ij, half_ji)``; ``half_ji`` is what the owner sends to ``j``.
    Invariant: ``α_ij + α_ji = 0`` and ``φ*(α_ij) ≤ λ`` on return.
    """
    lam = _check_positive("lam", lam, allow_zero=True)
    rho = _check_positive("rho", rho)
    ti = _as_vector("theta_i", theta_i)
    p = ti.shape[0]
    tj = _as_vector("theta_j", theta_j, p)
    for name, v in (("half_ij.beta", half_ij.beta), ("half_ij.alpha", half_ij.alpha),
                    ("half_ji.beta", half_ji.beta), ("half_ji.alpha", half_ji.alpha)):
        _as_vector(name, v, p)
    return _edge_step(ti, tj, half_ij, half_ji, lam, rho, _check_phi(phi))


def _edge_step(theta_i: FloatArray, theta_j: FloatArray, half_ij: EdgeState, half_ji: EdgeState,
               lam: float, rho: float, phi: Phi) -> tuple[EdgeState, EdgeState]:
    """:func:`edge_step` without validation."""
    b_ij, b_ji = _beta_step(theta_i, theta_j, half_ij.alpha, half_ji.alpha, lam, rho, phi)
    a_ij: FloatArray = half_ij.alpha - rho * (theta_i - b_ij)
    a_ji: FloatArray = half_ji.alpha - rho * (theta_j - b_ji)
    return EdgeState(b_ij, a_ij), EdgeState(b_ji, a_ji)


# ---------------------------------------------------------------------------------------------
# step size, gradients, projection, output average
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepSchedule:
    """Node step size of §6.3 (linearized proximal form of the original paper)::

        η̃(t) = c / (t + t0)   (rule="decay", t = 0, 1, … the iteration index; needs t0 > 0)
        η̃(t) = c              (rule="constant")
        η_i(t) = η̃(t) / (1 + ρ · deg_i · η̃(t))

    ``η_i`` is the exact minimiser step of ``gᵀθ + (ρ/2)Σ_j‖θ − β_ij + α_ij/ρ‖² + ‖θ − θ_i(t)‖²/(2η̃)``.
    """

    c: float
    t0: float = 1.0
    rule: Literal["decay", "constant"] = "decay"

    def __post_init__(self) -> None:
        _check_positive("c", self.c)
        if self.rule == "decay":
            _check_positive("t0", self.t0)
        elif self.rule != "constant":
            raise ValueError(f"rule must be 'decay' or 'constant', got {self.rule!r}")

    def base(self, t: int) -> float:
        """``η̃(t)``."""
        if t < 0:
            raise ValueError(f"iteration t must be >= 0, got {t}")
        return self.c if self.rule == "constant" else self.c / (t + self.t0)

    def eta(self, t: int, degree: int, rho: float) -> float:
        """``η_i(t) = η̃(t) / (1 + ρ · deg_i · η̃(t))``."""
        if degree < 0:
            raise ValueError(f"degree must be >= 0, got {degree}")
        rho = _check_positive("rho", rho)
        base = self.base(t)
        return base / (1.0 + rho * degree * base)


def hessian_spectrum(hessian: FloatArray) -> tuple[float, float]:
    """``(λ_min, λ_max)`` of a symmetric Hessian (``eigvalsh``; exact, fine for moderate ``p``)."""
    h = np.asarray(hessian, dtype=np.float64)
    if h.ndim != 2 or h.shape[0] != h.shape[1] or h.shape[0] == 0:
        raise ValueError(f"hessian must be a non-empty square (p, p) array, got shape {h.shape}")
    ev = np.linalg.eigvalsh(0.5 * (h + h.T))
    return float(ev[0]), float(ev[-1])


def default_step_schedule(hessians: Sequence[FloatArray], *, floor: float = 1e-8) -> StepSchedule:
    """``c = κ̂``, ``t0 = ⌈κ̂ λ̂_max⌉`` (§6.3, reconstructed) from the nodes' empirical Hessians.

    ``κ̂ = max_u max(λ_max(Ĥ_u), 1/max(λ_min(Ĥ_u), floor))`` (Condition 2: eigenvalues in
    ``[1/κ, κ]``), ``λ̂_max = max_u λ_max(Ĥ_u)``. Hence ``η̃(0) ≈ 1/λ̂_max``.
    """
    if len(hessians) == 0:
        raise ValueError("hessians must hold at least one (p, p) matrix, got an empty sequence")
    kappa = 0.0
    lam_max = 0.0
    for h in hessians:
        lo, hi = hessian_spectrum(h)
        kappa = max(kappa, hi, 1.0 / max(lo, floor))
        lam_max = max(lam_max, hi)
    t0 = float(math.ceil(kappa * lam_max)) if lam_max > 0 else 1.0
    return StepSchedule(c=kappa, t0=max(t0, 1.0), rule="decay")


def minibatch_gradient(
    loss: MLoss,
    theta: FloatArray,
    X: FloatArray,
    y: FloatArray,
    *,
    batch_size: int | None,
    rng: np.random.Generator | None = None,
) -> FloatArray:
    """``g_i = (1/|B|) Σ_{b∈B} ∇m(z_b; θ)`` (§6.5).

    ``batch_size=None`` or ``>= n`` gives the full-batch gradient ``∇M̂(θ)`` (no random draw).
    Otherwise ``B`` is drawn uniformly *without* replacement with ``rng`` (one
    ``rng.choice(n, b, replace=False)`` call) and sorted, so ``E[g_i] = ∇M̂(θ)``.
    """
    x = np.asarray(X, dtype=np.float64)
    n = x.shape[0] if x.ndim == 2 else 0
    if batch_size is None or batch_size >= n:
        return loss.grad(theta, x, np.asarray(y, dtype=np.float64))
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
    if rng is None:
        raise ValueError("rng is required for a mini-batch gradient (batch_size < n)")
    idx = np.sort(rng.choice(n, size=batch_size, replace=False))
    return loss.grad(theta, x[idx], np.asarray(y, dtype=np.float64)[idx])


def project_ball(theta: FloatArray, radius: float | None) -> FloatArray:
    """Optional projection onto ``B(0, r0)`` (§6.3, analysis assumption); ``None`` = identity."""
    th = _as_vector("theta", theta)
    if radius is None:
        return th
    r = _check_positive("radius", radius)
    norm = float(np.linalg.norm(th))
    if norm <= r:
        return th
    out: FloatArray = th * (r / norm)
    return out


@dataclass
class ThetaAverage:
    """Running output average ``θ̄ = (1/T) Σ_{t=0}^{T−1} θ(t)`` (§6.5); add ``θ(t)`` *before* step ``t``."""

    total: FloatArray
    count: int = 0

    @classmethod
    def zeros(cls, dim: int) -> ThetaAverage:
        return cls(np.zeros(dim), 0)

    def add(self, theta: FloatArray) -> None:
        self.total = self.total + _as_vector("theta", theta, self.total.shape[0])
        self.count += 1

    def mean(self) -> FloatArray:
        if self.count == 0:
            raise ValueError("ThetaAverage.mean: no iterate has been added (count = 0)")
        out: FloatArray = self.total / self.count
        return out


# ---------------------------------------------------------------------------------------------
# randomly inaccessible devices (§6.10)
# ---------------------------------------------------------------------------------------------


def sample_availability(p: FloatArray, rng: np.random.Generator) -> BoolArray:
    """``R_i(t) ~ Bernoulli(p_i)`` independently, one ``rng.random(n)`` call (node order)."""
    pp = _as_vector("p", p)
    if np.any(~np.isfinite(pp)) or np.any(pp <= 0) or np.any(pp > 1):
        raise ValueError(f"availability probabilities p must lie in (0, 1], got {pp!r}")
    out: BoolArray = rng.random(pp.shape[0]) < pp
    return out


def ipw_gradient(grad: FloatArray, available: bool, p: float) -> FloatArray:
    """Inverse-probability-weighted gradient ``g̃_i = (R_i / p_i) g_i`` (§6.10, eq. 19).

    ``E_R[g̃_i] = g_i`` when ``P(R_i = 1) = p_i``. Returns zeros when ``available`` is false.
    """
    g = _as_vector("grad", grad)
    pp = float(p)
    if not (0.0 < pp <= 1.0):
        raise ValueError(f"p must lie in (0, 1], got {p!r}")
    if not available:
        return np.zeros_like(g)
    out: FloatArray = g / pp
    return out


def estimate_availability(n_available: int, n_observed: int) -> float:
    """Plug-in ``p̂_i`` at iteration ``t = n_observed`` from the past iterations ``0..t−1`` (§6.10)::

        p̂_i(t) = max( (Σ_{s<t} R_i(s)) / t , 1/(t+1) ),     p̂_i(0) = 1

    (empirical frequency, original paper; floor ``1/(t+1)`` and the no-data value 1 are
    reconstructed). Only past iterations are used so ``p̂_i(t)`` is independent of ``R_i(t)``.
    """
    if n_observed < 0 or n_available < 0 or n_available > n_observed:
        raise ValueError(f"need 0 <= n_available <= n_observed, got n_available={n_available}, "
                         f"n_observed={n_observed}")
    if n_observed == 0:
        return 1.0
    return max(n_available / n_observed, 1.0 / (n_observed + 1))


@dataclass
class AvailabilityTracker:
    """Per-node counts for :func:`estimate_availability`: call :meth:`estimate` then :meth:`record`."""

    n_available: int = 0
    n_observed: int = 0

    def estimate(self) -> float:
        return estimate_availability(self.n_available, self.n_observed)

    def record(self, available: bool) -> None:
        self.n_observed += 1
        self.n_available += int(bool(available))


# ---------------------------------------------------------------------------------------------
# edge selection (§6.9)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalStatistics:
    """What node ``u`` sends its neighbours once for edge selection (§6.9): ``θ̂_u`` and the
    estimated covariance ``Ω̂_u / n_u`` of ``θ̂_u`` (``p + p²`` floats, :func:`local_statistics`),
    plus ``n_u`` and the ridge used.
    """

    theta: FloatArray
    cov: FloatArray
    n: int
    ridge: float


def local_statistics(
    loss: MLoss,
    X: FloatArray,
    y: FloatArray,
    *,
    covariance: Covariance = "hessian",
    ridge: float | None = None,
    max_iter: int = 100,
) -> LocalStatistics:
    """Local estimator and the estimated covariance of it for the edge test (§6.9, ALGORITHMS §0.1 C3)::

        θ̂_u = argmin M̂_u(θ) (+ ridge/2 ‖θ‖²)
        Ĥ_u = (1/n_u) Σ_k ∇²m(z_k; θ̂_u) (+ ridge·I),   ψ_k = ∇m(z_k; θ̂_u)
        returned cov = Ω̂_u / n_u

    ``covariance`` picks ``Ω̂_u``:

    ``"hessian"`` (default) — the Hessian form of seed 001 eq. 2, ``Ω̂_u/n_u = {n_u Ĥ_u}⁻¹``,
        scaled by the loss's dispersion::

            Ω̂_u = σ̂²_u Ĥ_u⁻¹,   σ̂²_u = RSS_u / (n_u − p_eff)   (least squares, RSS_u = Σ_k (y_k − x_kᵀθ̂_u)²)
            Ω̂_u = Ĥ_u⁻¹                                       (logistic and other negative log-likelihoods)

        ``p_eff = tr(Ĥ_u⁻¹ ∇²M̂_u)`` (``= p`` without a ridge; below ``p`` with one), and the
        residual degrees of freedom ``n_u − p_eff`` are floored at 1. For least squares this is
        the classical ``σ̂² (XᵀX)⁻¹``: exact under Gaussian noise up to the estimate of ``σ²``.
    ``"sandwich-hc3"`` — the sandwich with MacKinnon–White's HC3 small-sample correction::

            Ω̂_u = Ĥ_u⁻¹ Σ̃_u Ĥ_u⁻¹,   Σ̃_u = (1/n_u) Σ_k ψ_k ψ_kᵀ / (1 − h_k)²,
            h_k = w_k x_kᵀ (n_u Ĥ_u)⁻¹ x_k                     (the leverage; ∇²m(z_k) = w_k x_k x_kᵀ)

        For least squares: ``(XᵀX)⁻¹ Xᵀ diag(r_k²/(1 − h_k)²) X (XᵀX)⁻¹``. Robust to unequal
        noise, conservative in small samples. Needs ``loss.sample_curvatures``; leverages are
        clipped at ``1 − 1e-8`` (a sample of leverage 1 is fitted exactly).
    ``"sandwich"`` — the plug-in sandwich of the original paper (HC0)::

            Ω̂_u = Ĥ_u⁻¹ Σ̂_u Ĥ_u⁻¹,   Σ̂_u = (1/n_u) Σ_k ψ_k ψ_kᵀ

        Consistent, but it underestimates the variance when ``p/n_u`` is not small (the residuals
        are shrunk by ``1 − h_k``), so the test then drops true edges far beyond ``α``.

    ``ridge=None`` (automatic, §6.11): no ridge unless ``n_u < p``, ``Ĥ_u(0)`` is ill-conditioned
    (condition number > 1e10) or Newton fails to converge; then ``1e-6 · tr(Ĥ)/p``. ``Ĥ_u`` is
    inverted with ``pinv``.
    """
    x = np.asarray(X, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"X must be a 2-D array (n, p), got shape {x.shape}")
    th0, x, yy = _check_xy(np.zeros(x.shape[1]), x, y)
    n, p = x.shape
    if covariance not in COVARIANCES:
        raise ValueError(f"covariance must be one of {list(COVARIANCES)}, got {covariance!r}")
    curvatures = getattr(loss, "sample_curvatures", None)
    if covariance == "sandwich-hc3" and curvatures is None:
        raise ValueError(f"covariance 'sandwich-hc3' needs per-sample curvatures (leverages); "
                         f"{type(loss).__name__} has no sample_curvatures method")
    if ridge is None:
        h0 = loss.hessian(th0, x, yy)
        lo, hi = hessian_spectrum(h0)
        r = 0.0
        if n < p or lo <= 1e-10 * max(hi, 1e-300):
            r = default_ridge(h0) if hi > 0 else 1e-6
            logger.info("local_statistics: n=%d, p=%d, ill-conditioned Hessian; ridge %g", n, p, r)
        res = newton_minimize(lambda t: loss.value(t, x, yy), lambda t: loss.grad(t, x, yy),
                              lambda t: loss.hessian(t, x, yy), th0, ridge=r, max_iter=max_iter, tol=1e-14)
        if not res.converged and r == 0.0:
            r = default_ridge(loss.hessian(res.theta, x, yy))
            r = r if r > 0 else 1e-6
            logger.warning("local_statistics: local fit did not converge (separation?); refit with ridge %g", r)
            res = newton_minimize(lambda t: loss.value(t, x, yy), lambda t: loss.grad(t, x, yy),
                                  lambda t: loss.hessian(t, x, yy), th0, ridge=r, max_iter=max_iter, tol=1e-14)
        theta = res.theta
    else:
        r = _check_positive("ridge", ridge, allow_zero=True)
        theta = local_estimator(loss, x, yy, ridge=r, max_iter=max_iter)
    h_data = loss.hessian(theta, x, yy)
    h_inv = np.linalg.pinv(h_data + r * np.eye(p), hermitian=True)
    if covariance == "hessian":
        omega = dispersion(loss, theta, x, yy, n - float(np.trace(h_inv @ h_data))) * h_inv
    else:
        sc = loss.scores(theta, x, yy)
        if covariance == "sandwich-hc3":
            assert curvatures is not None
            lev = hc3_leverages(curvatures(theta, x, yy), x, h_inv)
            sc = sc / (1.0 - lev)[:, None]
        sigma = (sc.T @ sc) / n
        omega = h_inv @ sigma @ h_inv.T
    cov: FloatArray = 0.5 * (omega + omega.T) / n
    return LocalStatistics(theta=theta, cov=cov, n=n, ridge=r)


def dispersion(loss: MLoss, theta: FloatArray, X: FloatArray, y: FloatArray, dof: float) -> float:
    """The scale ``σ̂²`` of the Hessian-form covariance ``σ̂²·Ĥ⁻¹`` (:func:`local_statistics`).

    ``loss.dispersion(θ, X, y, max(dof, 1))`` when the loss has that method (least squares:
    ``RSS/dof``), else 1 (a negative log-likelihood). ``dof`` is the residual degrees of freedom
    ``n − p_eff``; below 1 (``n ≤ p``, the fit interpolates) it is floored at 1 with a warning.
    """
    method = getattr(loss, "dispersion", None)
    if method is None:
        return 1.0
    d = float(dof)
    if not d >= 1.0:
        logger.warning("local_statistics: %.3g residual degrees of freedom (n <= p); sigma^2 uses 1", d)
        d = 1.0
    return float(method(theta, X, y, d))


def hc3_leverages(curvatures: npt.ArrayLike, X: npt.ArrayLike, hessian_inv: npt.ArrayLike) -> FloatArray:
    """Leverages ``h_k = w_k x_kᵀ (n Ĥ)⁻¹ x_k`` of HC3 (``hessian_inv`` = ``Ĥ⁻¹`` of the averaged loss).

    For least squares (``w_k = 1``, ``Ĥ = XᵀX/n``) the diagonal of the hat matrix
    ``X(XᵀX)⁻¹Xᵀ``; for a GLM the working-weight leverages. Clipped to ``[0, 1 − 1e-8]``.
    """
    x = np.asarray(X, dtype=np.float64)
    w = _as_vector("curvatures", curvatures, x.shape[0])
    h = w * np.einsum("kj,jl,kl->k", x, np.asarray(hessian_inv, dtype=np.float64), x) / x.shape[0]
    out: FloatArray = np.clip(h, 0.0, 1.0 - 1e-8)
    return out


def wald_statistic(a: LocalStatistics, b: LocalStatistics) -> tuple[float, int]:
    """``W² = Δᵀ (Ω̂_i/n_i + Ω̂_j/n_j)⁺ Δ`` with ``Δ = θ̂_i − θ̂_j`` (§6.9, original paper eq. 10).

    Returns ``(W², df)`` where ``df`` is the numerical rank of the summed covariance ``S`` (``= p``
    normally; smaller only if ``S`` is singular, §6.11 ``pinv``). Computed from one ``eigh`` of
    ``S``: eigenvalues ``≤ p · eps · max(ev)`` are treated as zero. Under ``H0: θ_i = θ_j``,
    ``W² ~ χ²_df`` asymptotically. If ``S = 0`` (``df = 0``), ``W² = 0`` when ``Δ = 0`` and
    ``inf`` otherwise.
    """
    p = a.theta.shape[0]
    if b.theta.shape != (p,) or a.cov.shape != (p, p) or b.cov.shape != (p, p):
        raise ValueError(f"LocalStatistics do not match: theta shapes {a.theta.shape} vs {b.theta.shape}, "
                         f"cov shapes {a.cov.shape} vs {b.cov.shape}")
    delta = a.theta - b.theta
    s = a.cov + b.cov
    ev, vec = np.linalg.eigh(0.5 * (s + s.T))
    top = float(ev[-1]) if p else 0.0
    keep = ev > max(top, 0.0) * p * np.finfo(np.float64).eps if top > 0 else np.zeros(p, dtype=bool)
    df = int(np.count_nonzero(keep))
    if df < p:
        logger.warning("wald_statistic: summed covariance has rank %d < p = %d; using pinv", df, p)
    if df == 0:  # both estimates exact: the hypothesis is decided by Δ alone
        return (0.0 if not np.any(delta) else math.inf), 0
    z = vec.T @ delta
    w2 = float(np.sum(z[keep] ** 2 / ev[keep]))
    return w2, df


@dataclass(frozen=True)
class EdgeSelection:
    """Result of :func:`select_edges`: the tested edges (canonical order) with their ``W²``, degrees
    of freedom and raw p-values ``P(χ²_df ≥ W²)``, the per-test level ``α/|E|`` and the kept edges.
    """

    edges: tuple[Edge, ...]
    statistics: FloatArray
    dfs: IntArray
    pvalues: FloatArray
    level: float
    kept: tuple[Edge, ...]


def select_edges(
    stats_by_node: Sequence[LocalStatistics],
    edges: Iterable[Sequence[int]],
    *,
    alpha: float = 0.05,
) -> EdgeSelection:
    """Edge selection by multiple testing with Bonferroni (§6.9, seed 001 eq. 2, original paper eq. 11)::

        keep e = (i, j)  iff  W_e² ≤ χ²_{df}.isf(α / |E|)      (|E| = number of tested edges)

    FedADMM-ES: pass the given graph's edges; FedADMM-Local-ES: pass
    :func:`complete_graph_edges`. With no edges the result is empty. Edges are tested in
    canonical order (:func:`canonical_edges`).
    """
    a = float(alpha)
    if not (0.0 < a < 1.0):
        raise ValueError(f"alpha must lie in (0, 1), got {alpha!r}")
    es = canonical_edges(edges, len(stats_by_node))
    m = len(es)
    level = a / m if m else a
    w2 = np.zeros(m)
    dfs = np.zeros(m, dtype=np.int64)
    for k, (i, j) in enumerate(es):
        w2[k], dfs[k] = wald_statistic(stats_by_node[i], stats_by_node[j])
    pv = np.ones(m)
    keep = np.ones(m, dtype=bool)
    for df in np.unique(dfs):
        sel = dfs == df
        if df == 0:  # zero covariance: W² is 0 (equal estimates, keep) or inf (different, drop)
            pv[sel] = np.where(w2[sel] == 0.0, 1.0, 0.0)
            keep[sel] = w2[sel] == 0.0
            continue
        pv[sel] = stats.chi2.sf(w2[sel], int(df))
        keep[sel] = w2[sel] <= float(stats.chi2.isf(level, int(df)))
    kept = [e for e, ok in zip(es, keep) if ok]
    logger.info("select_edges: kept %d of %d edges at alpha=%g", len(kept), m, a)
    return EdgeSelection(tuple(es), w2, dfs, pv, level, tuple(kept))


# ---------------------------------------------------------------------------------------------
# objective and the all-nodes reference loop
# ---------------------------------------------------------------------------------------------


def fused_objective(
    loss: MLoss | Sequence[MLoss],
    data: Sequence[Dataset],
    theta: FloatArray,
    edges: Iterable[Sequence[int]],
    *,
    lam: float,
    phi: Phi,
) -> float:
    """``F(Θ) = Σ_u M̂_u(θ_u) + λ Σ_{{i,j}∈E} φ(θ_i − θ_j)`` (§6.1, eq. 5), node then edge order."""
    d, p = _check_data(data)
    th = np.asarray(theta, dtype=np.float64)
    if th.shape != (len(d), p):
        raise ValueError(f"theta must have shape ({len(d)}, {p}), got {th.shape}")
    losses = _per_node_losses(loss, len(d))
    phi = _check_phi(phi)
    terms = [m.value(th[u], x, yy) for u, (m, (x, yy)) in enumerate(zip(losses, d))]
    for i, j in canonical_edges(edges, len(d)):
        diff = th[i] - th[j]
        terms.append(lam * (float(np.sum(np.abs(diff))) if phi == "l1" else float(np.linalg.norm(diff))))
    return math.fsum(terms)


@dataclass
class ADMMResult:
    """Output of :func:`run_admm_reference`.

    ``theta``: last iterate ``Θ(T)`` (``V × p``); ``theta_avg``: ``Θ̄ = (1/T) Σ_{t<T} Θ(t)`` (§6.5);
    ``primal_residual[t] = sqrt(Σ_i Σ_{j∈N_i} ‖θ_i(t+1) − β_ij(t+1)‖²)``;
    ``dual_residual[t] = ρ sqrt(Σ_i Σ_{j∈N_i} ‖β_ij(t+1) − β_ij(t)‖²)``;
    ``halves[(i, j)]``: node ``i``'s final half-edge for neighbour ``j`` (both directions).
    """

    theta: FloatArray
    theta_avg: FloatArray
    primal_residual: FloatArray
    dual_residual: FloatArray
    halves: dict[Edge, EdgeState]
    edges: tuple[Edge, ...]


def run_admm_reference(
    loss: MLoss | Sequence[MLoss],
    data: Sequence[Dataset],
    edges: Iterable[Sequence[int]],
    *,
    lam: float,
    rho: float = 1.0,
    phi: Phi = "l1",
    n_iter: int = 600,
    step: StepSchedule | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    availability: FloatArray | None = None,
    ipw: Literal["known", "estimated", "none"] = "known",
    theta0: FloatArray | None = None,
    radius: float | None = None,
    on_iteration: Callable[[int, FloatArray], None] | None = None,
) -> ADMMResult:
    """All nodes, one process: FedADMM (Algorithm 1) or, with ``availability``, Algorithm 2.

    Per iteration ``t = 0..n_iter−1`` (exactly the per-node / per-edge functions a decentralized
    wrapper calls, in this order):

    1. every node adds ``θ_i(t)`` to its :class:`ThetaAverage`;
    2. if ``availability`` (``p_i``, shape ``(V,)``) is given: ``R(t) = sample_availability(p, rng_R)``;
       an offline node computes no gradient (``g̃_i = 0``, its RNG is not advanced) but its node step
       still applies the ρ-term (§6.10, done by a coordinator or a neighbour); the gradient of an
       online node is divided by ``p_i`` (``ipw="known"``), by ``p̂_i(t)`` from
       :class:`AvailabilityTracker` (``"estimated"``) or not at all (``"none"``, biased baseline);
    3. node step (eq. 14) at every node with ``η_i(t) = step.eta(t, deg_i, ρ)``, then the optional
       projection onto ``B(0, radius)``;
    4. edge step (eqs. 15–16) on every edge in canonical order, by its owner.

    Defaults: ``Θ(0) = theta0`` or 0 (broadcast to every node if 1-D), ``β_ij(0) = θ_i(0)``,
    ``α(0) = 0``; ``step=None`` uses :func:`default_step_schedule` from each node's full-data
    Hessian at ``θ_i(0)``. RNGs: ``SeedSequence(seed).spawn(V + 1)``; child ``u`` draws node ``u``'s
    mini-batches, child ``V`` draws the availability. ``on_iteration(t, Θ(t+1))`` is called after
    each iteration (with a copy).
    """
    d, p = _check_data(data)
    n_nodes = len(d)
    losses = _per_node_losses(loss, n_nodes)
    lam = _check_positive("lam", lam, allow_zero=True)
    rho = _check_positive("rho", rho)
    phi = _check_phi(phi)
    if n_iter < 1:
        raise ValueError(f"n_iter must be >= 1, got {n_iter}")
    if ipw not in ("known", "estimated", "none"):
        raise ValueError(f"ipw must be 'known', 'estimated' or 'none', got {ipw!r}")
    if radius is not None:
        _check_positive("radius", radius)
    es = canonical_edges(edges, n_nodes)
    nbrs = neighbours(es, n_nodes)

    if theta0 is None:
        theta = np.zeros((n_nodes, p))
    else:
        init = np.asarray(theta0, dtype=np.float64)
        if init.shape == (p,):
            theta = np.tile(init, (n_nodes, 1))
        elif init.shape == (n_nodes, p):
            theta = init.copy()
        else:
            raise ValueError(f"theta0 must have shape ({p},) or ({n_nodes}, {p}), got {init.shape}")
    if step is None:
        step = default_step_schedule([m.hessian(theta[u], x, yy) for u, (m, (x, yy)) in enumerate(zip(losses, d))])
        logger.info("run_admm_reference: default step c=%g t0=%g", step.c, step.t0)
    p_avail: FloatArray | None = None
    if availability is not None:
        p_avail = _as_vector("availability", availability, n_nodes)
        if np.any(~np.isfinite(p_avail)) or np.any(p_avail <= 0) or np.any(p_avail > 1):
            raise ValueError(f"availability must lie in (0, 1] for every node, got {p_avail!r}")

    children = np.random.SeedSequence(seed).spawn(n_nodes + 1)
    node_rngs = [np.random.default_rng(c) for c in children[:n_nodes]]
    avail_rng = np.random.default_rng(children[n_nodes])
    trackers = [AvailabilityTracker() for _ in range(n_nodes)]
    halves: dict[Edge, EdgeState] = {}
    for i, j in es:
        halves[(i, j)] = init_edge_state(theta[i])
        halves[(j, i)] = init_edge_state(theta[j])
    averages = [ThetaAverage.zeros(p) for _ in range(n_nodes)]
    primal = np.zeros(n_iter)
    dual = np.zeros(n_iter)

    for t in range(n_iter):
        for u in range(n_nodes):
            averages[u].add(theta[u])
        online = np.ones(n_nodes, dtype=bool) if p_avail is None else sample_availability(p_avail, avail_rng)
        new_theta = np.empty_like(theta)
        for u in range(n_nodes):
            x, yy = d[u]
            if online[u]:
                g = minibatch_gradient(losses[u], theta[u], x, yy, batch_size=batch_size, rng=node_rngs[u])
            else:
                g = np.zeros(p)
            if p_avail is not None:
                if ipw == "known":
                    g = ipw_gradient(g, bool(online[u]), float(p_avail[u]))
                elif ipw == "estimated":
                    g = ipw_gradient(g, bool(online[u]), trackers[u].estimate())
                trackers[u].record(bool(online[u]))
            eta = step.eta(t, len(nbrs[u]), rho)
            stepped = _node_step(theta[u], g, [halves[(u, j)] for j in nbrs[u]], rho, eta)
            new_theta[u] = stepped if radius is None else project_ball(stepped, radius)
        sq_primal = 0.0
        sq_dual = 0.0
        for i, j in es:
            old_ij, old_ji = halves[(i, j)], halves[(j, i)]
            h_ij, h_ji = _edge_step(new_theta[i], new_theta[j], old_ij, old_ji, lam, rho, phi)
            halves[(i, j)], halves[(j, i)] = h_ij, h_ji
            r_ij, r_ji = new_theta[i] - h_ij.beta, new_theta[j] - h_ji.beta
            s_ij, s_ji = h_ij.beta - old_ij.beta, h_ji.beta - old_ji.beta
            sq_primal += float(r_ij @ r_ij) + float(r_ji @ r_ji)
            sq_dual += float(s_ij @ s_ij) + float(s_ji @ s_ji)
        primal[t] = math.sqrt(sq_primal)
        dual[t] = rho * math.sqrt(sq_dual)
        theta = new_theta
        if on_iteration is not None:
            on_iteration(t, theta.copy())

    theta_avg = np.stack([a.mean() for a in averages])
    return ADMMResult(theta, theta_avg, primal, dual, halves, tuple(es))


def run_admm_stacked(
    loss: MLoss | Sequence[MLoss],
    data: Sequence[Dataset],
    edges: Iterable[Sequence[int]],
    *,
    lam: float,
    rho: float = 1.0,
    phi: Phi = "l1",
    n_iter: int = 600,
    step: StepSchedule | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    theta0: FloatArray | None = None,
    on_iteration: Callable[[int, FloatArray], None] | None = None,
) -> ADMMResult:
    """:func:`run_admm_reference` (Algorithm 1, every device always available, no projection) on
    stacked arrays: one iteration is a few array operations over all nodes and all edges.

    The same iteration, initialisation, step schedule and mini-batch draws (node ``u`` draws from
    ``SeedSequence(seed).spawn(V + 1)[u]`` in node order); only the order of floating-point sums
    differs (the coupling ``Σ_j (ρ(θ_i − β_ij) − α_ij)`` is one sparse product, the
    full-batch least-squares gradients of equal-size nodes with one ``einsum``), so the iterates
    agree with the reference to rounding (tested to 1e-9 relative), not bit for bit. Half-edges are
    rows of two ``(2|E|, p)`` arrays: row ``k`` is the owner's half ``(i, j)`` of canonical edge ``k``,
    row ``|E| + k`` the other half ``(j, i)``.
    """
    d, p = _check_data(data)
    n_nodes = len(d)
    losses = _per_node_losses(loss, n_nodes)
    lam = _check_positive("lam", lam, allow_zero=True)
    rho = _check_positive("rho", rho)
    phi = _check_phi(phi)
    if n_iter < 1:
        raise ValueError(f"n_iter must be >= 1, got {n_iter}")
    es = canonical_edges(edges, n_nodes)
    n_edges = len(es)
    owner = np.asarray([i for i, _ in es], dtype=np.int64)
    other = np.asarray([j for _, j in es], dtype=np.int64)
    holder = np.concatenate([owner, other])  # the node that holds half-row h
    degree = np.bincount(holder, minlength=n_nodes)
    gather = sparse.csr_matrix((np.ones(2 * n_edges), (holder, np.arange(2 * n_edges))), shape=(n_nodes, 2 * n_edges))

    if theta0 is None:
        theta = np.zeros((n_nodes, p))
    else:
        init = np.asarray(theta0, dtype=np.float64)
        if init.shape == (p,):
            theta = np.tile(init, (n_nodes, 1))
        elif init.shape == (n_nodes, p):
            theta = init.copy()
        else:
            raise ValueError(f"theta0 must have shape ({p},) or ({n_nodes}, {p}), got {init.shape}")
    if step is None:
        step = default_step_schedule([m.hessian(theta[u], x, yy) for u, (m, (x, yy)) in enumerate(zip(losses, d))])
        logger.info("run_admm_stacked: default step c=%g t0=%g", step.c, step.t0)
    children = np.random.SeedSequence(seed).spawn(n_nodes + 1)
    node_rngs = [np.random.default_rng(c) for c in children[:n_nodes]]
    full = batch_size is None or all(batch_size >= x.shape[0] for x, _ in d)
    stacked = (full and all(isinstance(m, LeastSquaresLoss) for m in losses)
               and len({x.shape for x, _ in d}) == 1)
    if stacked:
        xs = np.stack([x for x, _ in d])
        ys = np.stack([yy for _, yy in d])

    beta = theta[holder].copy()  # β_ij(0) = θ_i(0)
    alpha = np.zeros((2 * n_edges, p))
    total = np.zeros((n_nodes, p))
    primal = np.zeros(n_iter)
    dual = np.zeros(n_iter)
    tau = 2.0 * lam / rho
    for t in range(n_iter):
        total += theta
        if stacked:
            resid = np.einsum("vnp,vp->vn", xs, theta) - ys
            grad = np.einsum("vnp,vn->vp", xs, resid) / xs.shape[1]
        else:
            grad = np.stack([minibatch_gradient(losses[u], theta[u], x, yy, batch_size=batch_size, rng=node_rngs[u])
                             for u, (x, yy) in enumerate(d)])
        coupling = gather @ (rho * (theta[holder] - beta) - alpha) if n_edges else np.zeros((n_nodes, p))
        base = step.base(t)
        eta = base / (1.0 + rho * degree * base)  # StepSchedule.eta for every node
        theta = theta - eta[:, None] * (grad + coupling)
        if n_edges:
            a = theta[owner] - alpha[:n_edges] / rho
            b = theta[other] - alpha[n_edges:] / rho
            mid = 0.5 * (a + b)
            e = a - b
            if phi == "l1":
                delta = np.sign(e) * np.maximum(np.abs(e) - tau, 0.0)
            else:
                norm = np.sqrt(np.sum(e * e, axis=1, keepdims=True))
                delta = np.where(norm > tau, (1.0 - tau / np.where(norm > 0, norm, 1.0)) * e, 0.0)
            new_beta = np.concatenate([mid + 0.5 * delta, mid - 0.5 * delta])
            r = theta[holder] - new_beta
            alpha = alpha - rho * r
            primal[t] = math.sqrt(float(np.sum(r * r)))
            dual[t] = rho * math.sqrt(float(np.sum((new_beta - beta) ** 2)))
            beta = new_beta
        if on_iteration is not None:
            on_iteration(t, theta.copy())

    halves: dict[Edge, EdgeState] = {}
    for k, (i, j) in enumerate(es):
        halves[(i, j)] = EdgeState(beta[k].copy(), alpha[k].copy())
        halves[(j, i)] = EdgeState(beta[n_edges + k].copy(), alpha[n_edges + k].copy())
    return ADMMResult(theta, total / n_iter, primal, dual, halves, tuple(es))


# ---------------------------------------------------------------------------------------------
# λ by K-fold cross-validation
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CVResult:
    """K-fold CV curve: ``fold_losses[l, k]`` = held-out loss of λ_l on fold k; ``mean_loss``,
    ``se_loss = std(ddof=1)/√K`` over folds, and the chosen ``best_lambda``.
    """

    best_lambda: float
    lambdas: FloatArray
    mean_loss: FloatArray
    se_loss: FloatArray
    fold_losses: FloatArray


def kfold_ids(n_samples: int, n_folds: int, rng: np.random.Generator) -> IntArray:
    """Random balanced fold labels ``0..K−1`` for one node's ``n_samples`` rows (a permutation of
    ``[0, 1, …, K−1, 0, 1, …]``); each node splits only its own data.
    """
    if n_folds < 2:
        raise ValueError(f"n_folds must be >= 2, got {n_folds}")
    if n_samples < n_folds:
        raise ValueError(f"n_samples ({n_samples}) must be >= n_folds ({n_folds}) so every fold is non-empty")
    ids: IntArray = rng.permutation(np.arange(n_samples, dtype=np.int64) % n_folds)
    return ids


def cross_validate_lambda(
    lambdas: Sequence[float],
    n_folds: int,
    solve: Callable[[float, tuple[int, ...]], ModelT],
    held_out_loss: Callable[[ModelT, int], float],
) -> CVResult:
    """Choose λ by K-fold cross-validation (§6.3; the original paper uses K = 5).

    For every λ (in the given order) and fold ``k = 0..K−1``: ``model = solve(λ, train_folds)``
    with ``train_folds = all folds except k``, then ``held_out_loss(model, k)``. The chosen λ
    minimises the mean over folds; ties go to the *largest* such λ (the most fused model).
    """
    lam = np.asarray([float(v) for v in lambdas], dtype=np.float64)
    if lam.ndim != 1 or lam.shape[0] == 0:
        raise ValueError(f"lambdas must be a non-empty 1-D sequence, got shape {lam.shape}")
    if np.any(~np.isfinite(lam)) or np.any(lam < 0):
        raise ValueError(f"lambdas must be finite and >= 0, got {lam!r}")
    if n_folds < 2:
        raise ValueError(f"n_folds must be >= 2, got {n_folds}")
    fold_losses = np.zeros((lam.shape[0], n_folds))
    for li, lv in enumerate(lam):
        for k in range(n_folds):
            train = tuple(f for f in range(n_folds) if f != k)
            fold_losses[li, k] = float(held_out_loss(solve(float(lv), train), k))
    mean = fold_losses.mean(axis=1)
    se = fold_losses.std(axis=1, ddof=1) / math.sqrt(n_folds)
    best_val = float(np.min(mean))
    ties = np.flatnonzero(mean <= best_val)
    best = float(np.max(lam[ties]))
    logger.info("cross_validate_lambda: best lambda %g (mean held-out loss %g)", best, best_val)
    return CVResult(best, lam, mean, se, fold_losses)


def admm_cv_lambda(
    loss: MLoss | Sequence[MLoss],
    data: Sequence[Dataset],
    edges: Iterable[Sequence[int]],
    lambdas: Sequence[float],
    *,
    n_folds: int = 5,
    seed: int = 0,
    output: Literal["last", "average"] = "average",
    **run_kwargs: object,
) -> CVResult:
    """:func:`cross_validate_lambda` wired to :func:`run_admm_reference` (the paper's 5-fold CV).

    Node ``u`` splits its rows with :func:`kfold_ids` (RNG ``SeedSequence(seed).spawn(V)[u]``);
    ``solve`` runs ADMM on the training folds of every node (``run_kwargs`` forwarded, ``lam`` set
    by the CV) and keeps ``Θ̄`` (``output="average"``, §6.5) or ``Θ(T)``; the held-out loss is
    ``Σ_u Σ_{k∈fold} m_u(z_k; θ_u) / Σ_u |fold_u|`` (sample-weighted, reconstructed).
    """
    d, _ = _check_data(data)
    losses = _per_node_losses(loss, len(d))
    es = canonical_edges(edges, len(d))
    children = np.random.SeedSequence(seed).spawn(len(d))
    folds = [kfold_ids(x.shape[0], n_folds, np.random.default_rng(c)) for (x, _), c in zip(d, children)]
    if "lam" in run_kwargs:
        raise ValueError("run_kwargs must not contain 'lam'; the CV sets it")

    def solve(lam: float, train: tuple[int, ...]) -> FloatArray:
        sub: list[Dataset] = []
        for (x, yy), f in zip(d, folds):
            mask = np.isin(f, train)
            sub.append((x[mask], yy[mask]))
        res = run_admm_reference(losses, sub, es, lam=lam, **run_kwargs)  # type: ignore[arg-type]
        return res.theta_avg if output == "average" else res.theta

    def held_out(theta: FloatArray, k: int) -> float:
        total = 0.0
        count = 0
        for u, ((x, yy), f) in enumerate(zip(d, folds)):
            mask = f == k
            nk = int(mask.sum())
            total += nk * losses[u].value(theta[u], x[mask], yy[mask])
            count += nk
        return total / count

    return cross_validate_lambda(lambdas, n_folds, solve, held_out)
