"""FedRelax: model-agnostic FL over networks by block-coordinate relaxation of GTV minimization
(ALGORITHMS.md §7; seed 003 = A. Jung, "Towards Model-Agnostic Federated Learning over Networks").

Pure mathematical core (numpy + scikit-learn, no graphfl imports).

Problem (seed 003 eqs. 5–8)::

    min_{h^(i) ∈ H^(i)}  Σ_i L_i(h^(i)) + λ Σ_{{i,i'}∈E} A_ii' d(h^(i), h^(i'))
    d(h, h') = (1/m') Σ_r [ L((x_r, h(x_r)), h') + L((x_r, h'(x_r)), h) ]   on the shared D' = {x_1..x_m'}

Per-node update (Algorithm 1 eq. 10, a Jacobi sweep: every node uses the neighbours'
predictions of iteration ``k``)::

    ĥ_{k+1}^(i) ∈ argmin_h  L_i(h) + (λ/2) Σ_{i'∈N_i} A_ii' d(h, ĥ_k^(i'))

For the squared loss this is weighted ERM on the local data augmented with ``D'`` pseudo-labelled
by each neighbour (§7.2, reference code)::

    X_aug = [X_i ; D' (once per neighbour i')],   y_aug = [y_i ; ĥ_k^(i')(D')]
    w_aug = [1 per local row ; λ · A_ii' · m_i / m' per row of block i']

which minimises ``m_i · [L_i(h) + (λ/m') Σ_i' A_ii' Σ_r (h(x_r) − ĥ_k^(i')(x_r))²]``.

Scaling convention (§7.2 factor-of-two note): this is the reference-code scaling ``λ/m'``; the
seed's eq. 12 writes ``λ/(2m')``, so *seed-eq.-12 λ = 2 × the λ used here*.

Messages (§7.4): each iteration node ``i`` sends its ``m'`` predictions ``ĥ_k^(i)(D')`` to every
neighbour (regression: ``m'`` floats; classification: ``m'`` predicted labels). Models never leave
the node.

Functions: :func:`augmented_dataset` (the weighted set above), :func:`fit_weighted` (any
scikit-learn estimator: ``sample_weight`` if its ``fit`` accepts it, else seeded weighted
resampling), :func:`node_update` (eq. 10 for one node), :func:`linear_closed_form` (Algorithm 2
eq. 12 for linear models, exact weighted least squares), :func:`squared_gtv`, and the all-nodes
reference loop :func:`run_fedrelax_reference`.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt
from sklearn.base import clone
from sklearn.utils.validation import has_fit_parameter

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]
Array = npt.NDArray[Any]


class Estimator(Protocol):
    """The only thing FedRelax needs from a local model (seed 003 §II-B: "a .fit() function")."""

    def fit(self, X: Array, y: Array, *args: Any, **kwargs: Any) -> Any: ...

    def predict(self, X: Array) -> Array: ...


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------


def _as_2d(name: str, a: npt.ArrayLike) -> FloatArray:
    x = np.asarray(a, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array (rows, features), got shape {x.shape}")
    return x


def _check_lam(lam: float) -> float:
    v = float(lam)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"lam must be finite and >= 0, got {lam!r}")
    return v


def _check_adjacency(adj: npt.ArrayLike, n_nodes: int) -> FloatArray:
    a = np.asarray(adj, dtype=np.float64)
    if a.shape != (n_nodes, n_nodes):
        raise ValueError(f"adjacency must have shape ({n_nodes}, {n_nodes}), got {a.shape}")
    if not np.all(np.isfinite(a)) or np.any(a < 0):
        raise ValueError("adjacency must be finite and nonnegative (edge weights A_ii' > 0 on edges)")
    if not np.array_equal(a, a.T):
        raise ValueError("adjacency must be symmetric (edges are undirected)")
    if np.any(np.diag(a) != 0):
        raise ValueError("adjacency must have a zero diagonal (no self loops)")
    return a


# ---------------------------------------------------------------------------------------------
# the weighted ERM instance of eq. 10
# ---------------------------------------------------------------------------------------------


def augmented_dataset(
    X_local: npt.ArrayLike,
    y_local: npt.ArrayLike,
    X_shared: npt.ArrayLike,
    neighbour_predictions: Sequence[npt.ArrayLike],
    edge_weights: Sequence[float],
    lam: float,
) -> tuple[FloatArray, Array, FloatArray]:
    """Node ``i``'s weighted training set for eq. 10 with squared-loss discrepancy (§7.2)::

        X_aug = [X_i ; D' (per neighbour)],  y_aug = [y_i ; ĥ^(i')(D')],
        w_aug = [1 (m_i rows) ; λ · A_ii' · m_i / m' (m' rows per neighbour)]

    Neighbour blocks are appended in the given order (pass ascending neighbour id). Blocks whose
    weight ``λ·A_ii'`` is 0 are *omitted* (a zero-weight row does not change the weighted
    objective, and dropping it keeps e.g. tree split candidates identical to the local fit), so
    ``λ = 0`` returns exactly ``(X_i, y_i, 1)``. The set is rebuilt from the original local data
    every call (never accumulated across iterations, §7.2).
    """
    x = _as_2d("X_local", X_local)
    y = np.asarray(y_local)
    if x.shape[0] == 0 or y.shape != (x.shape[0],):
        raise ValueError(f"X_local (m_i>=1, d) and y_local (m_i,) must match, got {x.shape} and {y.shape}")
    xs = _as_2d("X_shared", X_shared)
    if xs.shape[0] == 0 or xs.shape[1] != x.shape[1]:
        raise ValueError(f"X_shared must be (m'>=1, {x.shape[1]}), got shape {xs.shape}")
    if len(neighbour_predictions) != len(edge_weights):
        raise ValueError(f"need one edge weight per neighbour: {len(neighbour_predictions)} prediction "
                         f"blocks but {len(edge_weights)} edge weights")
    lam = _check_lam(lam)
    m_i, m_s = x.shape[0], xs.shape[0]
    xs_blocks: list[FloatArray] = [x]
    ys_blocks: list[Array] = [y]
    ws_blocks: list[FloatArray] = [np.ones(m_i)]
    for k, (pred, a) in enumerate(zip(neighbour_predictions, edge_weights)):
        pr = np.asarray(pred)
        if pr.shape != (m_s,):
            raise ValueError(f"neighbour_predictions[{k}] must have shape ({m_s},) (one per row of X_shared), "
                             f"got {pr.shape}")
        aw = float(a)
        if not math.isfinite(aw) or aw < 0:
            raise ValueError(f"edge_weights[{k}] must be finite and >= 0, got {a!r}")
        w = lam * aw * m_i / m_s
        if w == 0.0:
            continue
        xs_blocks.append(xs)
        ys_blocks.append(pr)
        ws_blocks.append(np.full(m_s, w))
    return np.concatenate(xs_blocks), np.concatenate(ys_blocks), np.concatenate(ws_blocks)


def _fresh(estimator: Estimator) -> Any:
    """An unfitted copy: ``sklearn.base.clone`` (keeps hyper-parameters and ``random_state``), or
    ``copy.deepcopy`` for an object that is not scikit-learn clonable (no ``get_params``).
    """
    try:
        return clone(estimator)
    except TypeError:
        return copy.deepcopy(estimator)


def fit_weighted(
    estimator: Estimator,
    X: npt.ArrayLike,
    y: npt.ArrayLike,
    sample_weight: npt.ArrayLike,
    *,
    rng: np.random.Generator | None = None,
    resample_size: int | None = None,
) -> Any:
    """Fit a fresh copy of ``estimator`` (``sklearn.base.clone``; ``deepcopy`` if not clonable) to
    minimise ``Σ_k w_k · loss_k``.

    * If all weights are 1, fit unweighted (the same objective; no randomness).
    * Else, if ``fit`` accepts ``sample_weight`` (``sklearn.utils.validation.has_fit_parameter``),
      ``fit(X, y, sample_weight=w)``.
    * Else **weighted resampling** (§7.6, reconstructed): draw ``resample_size`` (default: the
      number of rows) row indices *with replacement*, ``P(row k) = w_k / Σ w``, with the seeded
      ``rng`` (one ``rng.choice`` call; required), and fit unweighted on those rows. The empirical
      risk on the resample is an unbiased estimate of ``Σ w_k loss_k / Σ w``, so the fit is a
      randomised approximation of the weighted fit that converges as ``resample_size`` grows
      (the overall scale of ``w`` is lost, which matters only for models with an explicit
      regulariser: they see an unweighted set of ``resample_size`` rows).

    Rows with weight 0 are never drawn. Returns the fitted clone.
    """
    x = np.asarray(X)
    yy = np.asarray(y)
    w = np.asarray(sample_weight, dtype=np.float64)
    n = x.shape[0] if x.ndim >= 1 else 0
    if n == 0 or yy.shape[0] != n or w.shape != (n,):
        raise ValueError(f"X, y and sample_weight must have the same number of rows (>=1), got shapes "
                         f"{x.shape}, {yy.shape}, {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or not np.any(w > 0):
        raise ValueError("sample_weight must be finite, >= 0 and not all zero")
    model = _fresh(estimator)
    if np.all(w == 1.0):
        model.fit(x, yy)
        return model
    if has_fit_parameter(model, "sample_weight"):
        model.fit(x, yy, sample_weight=w)
        return model
    if rng is None:
        raise ValueError(f"{type(model).__name__}.fit has no sample_weight: weighted resampling needs a seeded rng")
    size = n if resample_size is None else int(resample_size)
    if size < 1:
        raise ValueError(f"resample_size must be >= 1, got {resample_size}")
    idx = rng.choice(n, size=size, replace=True, p=w / w.sum())
    logger.debug("fit_weighted: %s has no sample_weight; resampled %d of %d rows", type(model).__name__, size, n)
    model.fit(x[idx], yy[idx])
    return model


def node_update(
    estimator: Estimator,
    X_local: npt.ArrayLike,
    y_local: npt.ArrayLike,
    X_shared: npt.ArrayLike,
    neighbour_predictions: Sequence[npt.ArrayLike],
    edge_weights: Sequence[float],
    lam: float,
    *,
    rng: np.random.Generator | None = None,
    resample_size: int | None = None,
) -> Any:
    """One FedRelax update at node ``i`` (seed 003 Algorithm 1 eq. 10, squared-loss discrepancy)::

        ĥ_{k+1}^(i) = argmin_h L_i(h) + (λ/m') Σ_{i'∈N_i} A_ii' Σ_r (h(x_r) − ĥ_k^(i')(x_r))²

    as :func:`fit_weighted` on :func:`augmented_dataset`. Works for any scikit-learn regressor
    or classifier (for a classifier the neighbour blocks are its predicted labels, §7.6); an
    estimator without ``sample_weight`` uses seeded weighted resampling (``rng`` required then).
    Returns a fitted clone of ``estimator``.
    """
    xa, ya, wa = augmented_dataset(X_local, y_local, X_shared, neighbour_predictions, edge_weights, lam)
    return fit_weighted(estimator, xa, ya, wa, rng=rng, resample_size=resample_size)


@dataclass(frozen=True)
class LinearModel:
    """``h(x) = xᵀw + b`` as returned by :func:`linear_closed_form`."""

    coef: FloatArray
    intercept: float

    def predict(self, X: npt.ArrayLike) -> FloatArray:
        x = _as_2d("X", X)
        if x.shape[1] != self.coef.shape[0]:
            raise ValueError(f"X must have {self.coef.shape[0]} columns, got shape {x.shape}")
        out: FloatArray = x @ self.coef + self.intercept
        return out


def linear_closed_form(
    X_local: npt.ArrayLike,
    y_local: npt.ArrayLike,
    X_shared: npt.ArrayLike,
    neighbour_predictions: Sequence[npt.ArrayLike],
    edge_weights: Sequence[float],
    lam: float,
    *,
    fit_intercept: bool = True,
    ridge: float = 0.0,
) -> LinearModel:
    """Algorithm 2 eq. 12 for a linear model, in closed form (reference scaling, see module doc)::

        (w, b) = argmin Σ_k ω_k (y_k − x_kᵀw − b)² + ridge ‖w‖²       (ω, x, y from augmented_dataset)
               = solution of  Zᵀ Ω Z [w; b] + ridge·diag(1,…,1,0) [w; b] = Zᵀ Ω y,   Z = [X_aug, 1]

    i.e. ``m_i · [L_i + (λ/m') Σ_i' A_ii' Σ_r (h(x_r) − ĥ^(i')(x_r))²] + ridge‖w‖²`` — the same
    objective as ``sklearn.linear_model.Ridge(alpha=ridge)`` (or ``LinearRegression`` for
    ``ridge = 0``) fitted with ``sample_weight``. Solved by least squares on ``√ω``-scaled rows
    (minimum-norm solution if rank-deficient).
    """
    r = float(ridge)
    if not math.isfinite(r) or r < 0:
        raise ValueError(f"ridge must be finite and >= 0, got {ridge!r}")
    xa, ya, wa = augmented_dataset(X_local, y_local, X_shared, neighbour_predictions, edge_weights, lam)
    yf = np.asarray(ya, dtype=np.float64)
    d = xa.shape[1]
    z = np.hstack([xa, np.ones((xa.shape[0], 1))]) if fit_intercept else xa
    sw = np.sqrt(wa)
    a = z * sw[:, None]
    b = yf * sw
    if r > 0:
        pen = np.zeros((d, z.shape[1]))
        pen[:, :d] = math.sqrt(r) * np.eye(d)
        a = np.vstack([a, pen])
        b = np.concatenate([b, np.zeros(d)])
    sol = np.linalg.lstsq(a, b, rcond=None)[0]
    return LinearModel(coef=np.asarray(sol[:d], dtype=np.float64), intercept=float(sol[d]) if fit_intercept else 0.0)


def squared_gtv(predictions: npt.ArrayLike, adjacency: npt.ArrayLike) -> float:
    """GTV with squared loss (seed 003 eqs. 5, 7): ``Σ_{i<i'} A_ii' (2/m') Σ_r (ĥ^(i)(x_r) − ĥ^(i')(x_r))²``.

    ``predictions`` is ``(V, m')`` (row ``i`` = node ``i``'s predictions on ``D'``); both terms of
    the symmetric discrepancy equal the same squared difference, hence the factor 2. Pairs are
    summed in row-major order.
    """
    pr = _as_2d("predictions", predictions)
    a = _check_adjacency(adjacency, pr.shape[0])
    total = 0.0
    for i in range(pr.shape[0]):
        for j in range(i + 1, pr.shape[0]):
            if a[i, j] > 0:
                diff = pr[i] - pr[j]
                total += float(a[i, j]) * 2.0 * float(diff @ diff) / pr.shape[1]
    return total


# ---------------------------------------------------------------------------------------------
# all-nodes reference loop
# ---------------------------------------------------------------------------------------------


@dataclass
class FedRelaxResult:
    """Output of :func:`run_fedrelax_reference`.

    ``models[i]``: node ``i``'s final fitted model (``None`` only if it was never fitted);
    ``predictions``: ``(V, m')`` final predictions on ``D'``; ``history``: predictions on ``D'``
    after each iteration (``history[0]`` = initialization); ``iterations``: sweeps done;
    ``converged``: whether the early-stopping rule fired.
    """

    models: list[Any]
    predictions: Array
    history: list[Array] = field(default_factory=list)
    iterations: int = 0
    converged: bool = False


def run_fedrelax_reference(
    estimators: Estimator | Sequence[Estimator] | None,
    data: Sequence[tuple[npt.ArrayLike, npt.ArrayLike]],
    X_shared: npt.ArrayLike,
    adjacency: npt.ArrayLike,
    *,
    lam: float = 0.1,
    max_iter: int = 100,
    init: Literal["local", "zero"] = "local",
    tol: float | None = 1e-6,
    solver: Literal["generic", "linear"] = "generic",
    fit_intercept: bool = True,
    ridge: float = 0.0,
    seed: int = 0,
    resample_size: int | None = None,
) -> FedRelaxResult:
    """All nodes, one process: Algorithm 1 (``solver="generic"``) or Algorithm 2 in closed form for
    linear models (``solver="linear"``, :func:`linear_closed_form`; ``estimators`` is then ignored
    and may be ``None``).

    Each sweep ``k``: every node ``i`` (in id order) runs :func:`node_update` with its neighbours'
    predictions ``ĥ_k^(i')(D')`` (ascending ``i'``) and weights ``A_ii'`` — a Jacobi sweep: all nodes
    read iteration-``k`` predictions. Initialization (§7.3): ``"local"`` = ``fit(X_i, y_i)``
    (reference code, default), ``"zero"`` = ``ĥ_0 ≡ 0`` (seed Algorithm 1; predictions 0).
    Stops after ``max_iter`` sweeps or, if ``tol`` is not None, when
    ``max_i (1/m')‖ĥ_{k+1}^(i)(D') − ĥ_k^(i)(D')‖² ≤ tol · (1/m')‖ĥ_k^(i)(D')‖²`` (§7.3,
    reconstructed). Node ``i``'s resampling RNG is ``SeedSequence(seed).spawn(V)[i]``.
    """
    n_nodes = len(data)
    if n_nodes == 0:
        raise ValueError("data must hold at least one node's (X, y), got an empty sequence")
    ests: list[Estimator] = []
    if estimators is None:
        if solver != "linear":
            raise ValueError("estimators is None: pass a scikit-learn estimator (or one per node), or solver='linear'")
    elif isinstance(estimators, Sequence):
        if len(estimators) != n_nodes:
            raise ValueError(f"estimators must be one estimator or one per node ({n_nodes}), got {len(estimators)}")
        ests = list(estimators)
    else:
        ests = [estimators] * n_nodes
    xs = _as_2d("X_shared", X_shared)
    a = _check_adjacency(adjacency, n_nodes)
    lam = _check_lam(lam)
    if max_iter < 0:
        raise ValueError(f"max_iter must be >= 0, got {max_iter}")
    if init not in ("local", "zero"):
        raise ValueError(f"init must be 'local' or 'zero', got {init!r}")
    if solver not in ("generic", "linear"):
        raise ValueError(f"solver must be 'generic' or 'linear', got {solver!r}")
    nbrs = [[int(j) for j in np.flatnonzero(a[i] > 0)] for i in range(n_nodes)]
    rngs = [np.random.default_rng(c) for c in np.random.SeedSequence(seed).spawn(n_nodes)]
    locals_ = [(_as_2d(f"data[{i}] X", x), np.asarray(y)) for i, (x, y) in enumerate(data)]

    def fit_one(i: int, preds: Sequence[Array], weights: Sequence[float], lam_eff: float) -> Any:
        x, y = locals_[i]
        if solver == "linear":
            return linear_closed_form(x, y, xs, preds, weights, lam_eff, fit_intercept=fit_intercept, ridge=ridge)
        return node_update(ests[i], x, y, xs, preds, weights, lam_eff, rng=rngs[i], resample_size=resample_size)

    models: list[Any] = [None] * n_nodes
    if init == "local":
        models = [fit_one(i, [], [], 0.0) for i in range(n_nodes)]
        current: Array = np.stack([np.asarray(m.predict(xs)) for m in models])
    else:
        current = np.zeros((n_nodes, xs.shape[0]))
    history = [current.copy()]
    converged = False
    it = 0
    for it in range(1, max_iter + 1):
        new_models = [fit_one(i, [current[j] for j in nbrs[i]], [float(a[i, j]) for j in nbrs[i]], lam)
                      for i in range(n_nodes)]
        new = np.stack([np.asarray(m.predict(xs)) for m in new_models])
        models = new_models
        if tol is not None and np.issubdtype(new.dtype, np.number):
            change = np.mean((new.astype(np.float64) - current.astype(np.float64)) ** 2, axis=1)
            scale = np.mean(current.astype(np.float64) ** 2, axis=1)
            if np.all(change <= tol * scale):
                converged = True
        current = new
        history.append(current.copy())
        if converged:
            logger.info("run_fedrelax_reference: converged after %d sweeps", it)
            break
    return FedRelaxResult(models, current, history, it, converged)
