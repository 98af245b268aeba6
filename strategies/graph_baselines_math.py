"""Per-round server mathematics of three graph-based FL baselines (ALGORITHMS.md §10, seed 002 §5).

NumPy only; no Flower, no torch, no graphfl imports. Models and updates are ``n x d`` arrays
(row ``i`` = client ``i``'s flattened parameters, ALGORITHMS.md §1.1); any state is passed in
and returned as a small frozen dataclass.

* **CFL** (Sattler, Müller, Samek, "Clustered federated learning", IEEE TNNLS 32(8), 2021). FedAvg
  inside each cluster; a cluster ``c`` is bipartitioned when its clients sit near a
  stationary point of the joint objective but not of their own::

      mean_norm = ‖Σ_{i∈c} ω_i Δθ_i‖ < ε1     and     max_norm = max_{i∈c} ‖Δθ_i‖ > ε2

  (``ω`` normalised over ``c``; uniform in the official notebook) and ``|c| >=
  min_cluster_size`` (``len(idc) > 2`` there) and the round is past ``warmup_rounds``
  (``c_round > 20`` there). The split is by cosine similarity of the updates
  ``α_ij = <Δθ_i, Δθ_j> / (‖Δθ_i‖‖Δθ_j‖)``: agglomerative clustering into two groups, with
  ``linkage="complete"`` (official code: scikit-learn ``AgglomerativeClustering`` on ``−α``) or
  ``"single"`` (the paper's optimal bipartition ``argmin max_{i∈c1, j∈c2} α_ij``, which single
  linkage attains). Then every client receives its cluster's average update
  ``Δθ̄_c = Σ_{i∈c} ω_i Δθ_i``. Defaults ``ε1 = 0.4``, ``ε2 = 1.6`` are those of the authors'
  notebook; the pFedGraph repository's CFL uses ``ε1 = 2.0``, ``ε2 = 2.5`` and no warm-up.
  Both thresholds depend on the model and learning rate and must be tuned.
* **FedAMP** (Huang et al., AAAI 2021, eq. 8 and the attention function of §4)::

      u_i = Σ_j ξ_ij w_j,   ξ_ij = α_k A'(‖w_i − w_j‖²) (j ≠ i),   ξ_ii = 1 − Σ_{j≠i} ξ_ij,
      A(x) = 1 − exp(−x/σ),  A'(x) = exp(−x/σ)/σ

  (:func:`fedamp_weights`). The paper requires ``α_k`` small enough for ``ξ_ii >= 0``; a
  negative self weight is kept (it is the formula) and logged as a warning. The heuristic
  variant used for deep networks (HeurFedAMP; the pFedGraph repository's FedAMP, the form
  summarised in ALGORITHMS.md §10) fixes ``ξ_ii`` and takes a softmax of scaled cosine
  similarities for the rest (:func:`fedamp_heuristic_weights`)::

      ξ_ii = s,   ξ_ij = (1 − s) exp(κ cos(v_i, v_j)) / Σ_{h≠i} exp(κ cos(v_i, v_h))

  with ``s = 0.3``, ``κ = 10`` and ``v_i = θ_i − θ^0`` in that repository. The client then
  minimises ``F_i(θ) + (λ/2)‖θ − u_i‖²`` (not here).
* **pFedGraph** (Ye et al., ICML 2023; official code ``MediaBrain-SJTU/pFedGraph``,
  ``optimizing_graph_matrix_neighbor``). Per client ``i`` the collaboration weights solve the
  small QP ``min_{a ∈ Δ} α‖a‖² + (d_i − 2αp)ᵀa`` with ``d_ij = −cos(v_i, v_j)`` (``v = θ −
  θ^0``; a similarity above 0.9 is set to 1, the diagonal included) and ``p`` the data-size
  proportions. Completing the square gives the closed form used here instead of a QP solver::

      a_i = Proj_Δ(p + cos_i / (2α))         (Euclidean projection onto the simplex)

  with ``α = 0.8`` (code default). The personalised model is ``θ̃_i = Σ_j a_ij θ_j``; the
  "cluster model" for the client's cosine regulariser is ``c_i = Σ_j a_ij θ_j / ‖θ_j‖``.

Invariants: every weight matrix returned has rows summing to 1 up to rounding (FedAMP by
construction, pFedGraph by the simplex projection); combinations ``W @ X`` are accumulated in float64
over column blocks in ascending column order and cast back to the input dtype.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

logger = logging.getLogger(__name__)

FloatArray = NDArray[np.float64]
AnyFloatArray = NDArray[np.floating[Any]]
IntArray = NDArray[np.int64]

CHUNK = 1 << 16
"""Columns per block in every ``n x d`` pass."""
COS_EPS = 1e-12
"""Added to ``‖a‖‖b‖`` in cosine similarities (official CFL code)."""
LINKAGES = ("complete", "single")


# ---------------------------------------------------------------------------------------
# shared helpers
# ---------------------------------------------------------------------------------------


def _as_rows(x: ArrayLike, name: str) -> AnyFloatArray:
    arr = np.asarray(x)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"{name} must be a 2-D (n clients x d params) array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.floating):
        arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)):
        bad = sorted({int(i) for i in np.argwhere(~np.isfinite(arr))[:, 0]})
        raise ValueError(f"{name} has non-finite entries in rows {bad}")
    return arr


def _as_weights(weights: ArrayLike | None, n: int, name: str = "weights") -> FloatArray:
    """Positive weights normalised to sum 1 (uniform when ``None``)."""
    if weights is None:
        return np.full(n, 1.0 / n)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), got shape {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"{name} must be finite and > 0")
    return w / float(w.sum())


def _blocks(d: int) -> Iterator[slice]:
    for start in range(0, d, CHUNK):
        yield slice(start, min(start + CHUNK, d))


def gram_matrix(x: ArrayLike) -> FloatArray:
    """``X Xᵀ`` accumulated in float64 over column blocks (no ``n x n x d`` temporary)."""
    arr = _as_rows(x, "x")
    n = arr.shape[0]
    g = np.zeros((n, n))
    for sl in _blocks(arr.shape[1]):
        blk = arr[:, sl]
        g += (blk @ blk.T).astype(np.float64)
    return g


def cosine_similarity_matrix(x: ArrayLike) -> FloatArray:
    """``α_ij = <x_i, x_j> / (‖x_i‖‖x_j‖ + 1e-12)`` through the Gram matrix.

    A zero row has similarity 0 with everything (itself included).
    """
    g = gram_matrix(x)
    norms = np.sqrt(np.maximum(np.diag(g), 0.0))
    sim: FloatArray = g / (norms[:, None] * norms[None, :] + COS_EPS)
    return np.clip(0.5 * (sim + sim.T), -1.0, 1.0)


def pairwise_sq_dists(x: ArrayLike) -> FloatArray:
    """``‖x_i − x_j‖²`` through the Gram matrix of the mean-centred rows (float64, >= 0)."""
    arr = _as_rows(x, "x")
    n = arr.shape[0]
    g = np.zeros((n, n))
    for sl in _blocks(arr.shape[1]):
        blk = np.asarray(arr[:, sl], dtype=np.float64)
        blk = blk - blk.mean(axis=0, keepdims=True)
        g += blk @ blk.T
    dg = np.diag(g)
    z = dg[:, None] + dg[None, :] - 2.0 * g
    z = np.maximum(0.5 * (z + z.T), 0.0)
    np.fill_diagonal(z, 0.0)
    return z


def mix(weights: ArrayLike, models: ArrayLike) -> AnyFloatArray:
    """``out_i = Σ_j W_ij x_j`` (float64 accumulation per column block, input dtype out).

    Parameters
    ----------
    weights
        ``n_out x n`` weight matrix.
    models
        ``n x d`` rows to combine.
    """
    x = _as_rows(models, "models")
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 2 or w.shape[1] != x.shape[0]:
        raise ValueError(f"weights must have shape (m, {x.shape[0]}), got shape {w.shape}")
    out = np.empty((w.shape[0], x.shape[1]), dtype=x.dtype)
    for sl in _blocks(x.shape[1]):
        out[:, sl] = w @ np.asarray(x[:, sl], dtype=np.float64)
    return out


# ---------------------------------------------------------------------------------------
# CFL
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CFLParams:
    """CFL hyperparameters (module docstring; defaults of the authors' notebook).

    Attributes
    ----------
    eps1
        Split only if the cluster's mean-update norm is below ``eps1``.
    eps2
        ... and its largest client-update norm is above ``eps2``.
    min_cluster_size
        Split only clusters with at least this many clients (``len(idc) > 2``: 3).
    warmup_rounds
        No split in rounds ``<= warmup_rounds`` (1-based; ``c_round > 20``: 20).
    linkage
        ``"complete"`` (official code) or ``"single"`` (paper's optimal bipartition).
    """

    eps1: float = 0.4
    eps2: float = 1.6
    min_cluster_size: int = 3
    warmup_rounds: int = 20
    linkage: Literal["complete", "single"] = "complete"

    def __post_init__(self) -> None:
        if not (self.eps1 >= 0 and self.eps2 >= 0):
            raise ValueError(f"CFLParams.eps1/eps2 must be >= 0, got {self.eps1!r}, {self.eps2!r}")
        if self.min_cluster_size < 2:
            raise ValueError(f"CFLParams.min_cluster_size must be >= 2, got {self.min_cluster_size!r}")
        if self.warmup_rounds < 0:
            raise ValueError(f"CFLParams.warmup_rounds must be >= 0, got {self.warmup_rounds!r}")
        if self.linkage not in LINKAGES:
            raise ValueError(f"CFLParams.linkage must be one of {list(LINKAGES)}, got {self.linkage!r}")


@dataclass(frozen=True)
class CFLState:
    """Cluster structure carried between rounds.

    Attributes
    ----------
    clusters
        Disjoint sorted tuples of client indices covering ``0..n-1``.
    round
        Rounds completed so far (the next :func:`cfl_step` is round ``round + 1``).
    """

    clusters: tuple[tuple[int, ...], ...]
    round: int = 0

    @classmethod
    def initial(cls, n: int) -> CFLState:
        """All ``n`` clients in one cluster, round 0."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n!r}")
        return cls(clusters=(tuple(range(n)),), round=0)

    def assignment(self) -> IntArray:
        """Cluster index of every client (``clusters`` order)."""
        n = sum(len(c) for c in self.clusters)
        out = np.full(n, -1, dtype=np.int64)
        for k, members in enumerate(self.clusters):
            out[list(members)] = k
        return out


@dataclass(frozen=True)
class CFLSplitCheck:
    """Split test of one cluster in one round."""

    cluster: tuple[int, ...]
    mean_norm: float
    max_norm: float
    split: bool
    parts: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class CFLResult:
    """Output of :func:`cfl_step`: new state, per-client averaged update, the split tests."""

    state: CFLState
    updates: AnyFloatArray
    checks: tuple[CFLSplitCheck, ...]


def _check_state(state: CFLState, n: int) -> None:
    members = sorted(i for c in state.clusters for i in c)
    if members != list(range(n)) or any(len(c) == 0 for c in state.clusters):
        raise ValueError(f"state.clusters must partition 0..{n - 1} into non-empty clusters, got {state.clusters}")


def cfl_split_criterion(
    updates: ArrayLike, weights: ArrayLike | None = None, eps1: float = 0.4, eps2: float = 1.6
) -> tuple[float, float, bool]:
    """CFL's split test on one cluster's updates (Sattler et al., module docstring).

    ``mean_norm = ‖Σ_i ω_i Δθ_i‖`` (``ω`` normalised to sum 1, uniform by default),
    ``max_norm = max_i ‖Δθ_i‖``; split iff ``mean_norm < eps1`` and ``max_norm > eps2``.

    Returns
    -------
    tuple
        ``(mean_norm, max_norm, split)``.
    """
    du = _as_rows(updates, "updates")
    w = _as_weights(weights, du.shape[0])
    mean = np.zeros(du.shape[1])
    for sl in _blocks(du.shape[1]):
        mean[sl] = w @ np.asarray(du[:, sl], dtype=np.float64)
    mean_norm = float(np.linalg.norm(mean))
    max_norm = float(np.sqrt(np.max(np.diag(gram_matrix(du)))))
    return mean_norm, max_norm, bool(mean_norm < eps1 and max_norm > eps2)


def bipartition(similarity: ArrayLike, linkage: Literal["complete", "single"] = "complete") -> tuple[IntArray, IntArray]:
    """Split ``m >= 2`` items into two groups by agglomerative clustering on similarity.

    Repeatedly merge the two groups with the largest linkage similarity — ``min`` over member
    pairs (``complete``) or ``max`` (``single``) — until two groups remain. Ties go to the
    lexicographically smallest pair of group representatives (deterministic). Single linkage
    returns the bipartition minimising the largest cross similarity (CFL's optimal split).

    Returns
    -------
    tuple
        Two sorted index arrays; the one holding item 0 first.
    """
    s = np.asarray(similarity, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] != s.shape[1] or s.shape[0] < 2:
        raise ValueError(f"similarity must be a square matrix with m >= 2, got shape {s.shape}")
    if linkage not in LINKAGES:
        raise ValueError(f"linkage must be one of {list(LINKAGES)}, got {linkage!r}")
    groups: list[list[int]] = [[i] for i in range(s.shape[0])]
    link = s.copy()
    np.fill_diagonal(link, -np.inf)
    combine = np.minimum if linkage == "complete" else np.maximum
    while len(groups) > 2:
        r, c = np.unravel_index(int(np.argmax(link)), link.shape)
        a, b = min(int(r), int(c)), max(int(r), int(c))
        groups[a] = sorted(groups[a] + groups[b])
        merged = combine(link[a], link[b])
        link[a, :] = merged
        link[:, a] = merged
        link[a, a] = -np.inf
        link = np.delete(np.delete(link, b, axis=0), b, axis=1)
        del groups[b]
    first, second = (groups[0], groups[1]) if 0 in groups[0] else (groups[1], groups[0])
    return np.asarray(first, dtype=np.int64), np.asarray(second, dtype=np.int64)


def cfl_step(
    updates: ArrayLike,
    state: CFLState,
    weights: ArrayLike | None = None,
    params: CFLParams | None = None,
) -> CFLResult:
    """One CFL server round: split tests, bipartitions, then cluster-wise averaging.

    Parameters
    ----------
    updates
        ``n x d`` client updates ``Δθ_i = θ_i^{after} − θ_i^{before}`` of this round.
    state
        Clusters before the round (:meth:`CFLState.initial` at the start).
    weights
        Optional positive client weights (data sizes) for the averages and ``mean_norm``;
        uniform (the official code) when ``None``.
    params
        :class:`CFLParams`.

    Returns
    -------
    CFLResult
        ``updates[i] = Σ_{j∈c(i)} ω_j Δθ_j / Σ_{j∈c(i)} ω_j`` for the new cluster ``c(i)``
        (add it to client ``i``'s model), the new state (``round + 1``) and the tests run.
    """
    prm = params if params is not None else CFLParams()
    du = _as_rows(updates, "updates")
    n = du.shape[0]
    _check_state(state, n)
    w = _as_weights(weights, n)
    rnd = state.round + 1
    sim: FloatArray | None = None
    new_clusters: list[tuple[int, ...]] = []
    checks: list[CFLSplitCheck] = []
    for members in state.clusters:
        idx = np.asarray(members, dtype=np.int64)
        mean_norm, max_norm, crit = cfl_split_criterion(du[idx], w[idx], prm.eps1, prm.eps2)
        split = crit and len(members) >= prm.min_cluster_size and rnd > prm.warmup_rounds
        parts: tuple[tuple[int, ...], ...] = (members,)
        if split:
            if sim is None:
                sim = cosine_similarity_matrix(du)
            left, right = bipartition(sim[np.ix_(idx, idx)], prm.linkage)
            parts = (tuple(int(i) for i in idx[left]), tuple(int(i) for i in idx[right]))
            logger.info("CFL round %d: split %s into %s", rnd, members, parts)
        checks.append(CFLSplitCheck(members, mean_norm, max_norm, split, parts))
        new_clusters.extend(parts)
    out = _cluster_average(du, w, new_clusters)
    return CFLResult(CFLState(tuple(new_clusters), rnd), out, tuple(checks))


def _cluster_average(du: AnyFloatArray, w: FloatArray, clusters: Sequence[tuple[int, ...]]) -> AnyFloatArray:
    """Every row replaced by its cluster's ``ω``-weighted mean (float64 accumulation)."""
    out = np.empty_like(du)
    for members in clusters:
        idx = np.asarray(members, dtype=np.int64)
        wc = w[idx] / float(w[idx].sum())
        for sl in _blocks(du.shape[1]):
            out[idx, sl] = (wc @ np.asarray(du[idx, sl], dtype=np.float64))[None, :]
    return out


# ---------------------------------------------------------------------------------------
# FedAMP
# ---------------------------------------------------------------------------------------


def fedamp_weights(models: ArrayLike, alpha_k: float = 1.0, sigma: float = 1.0) -> FloatArray:
    """FedAMP attention weights (Huang et al. 2021, eq. 8)::

        ξ_ij = α_k · exp(−‖w_i − w_j‖² / σ) / σ   (j ≠ i),     ξ_ii = 1 − Σ_{j≠i} ξ_ij

    i.e. ``α_k A'(‖w_i − w_j‖²)`` for ``A(x) = 1 − exp(−x/σ)``. Rows sum to 1.

    Parameters
    ----------
    models
        ``n x d`` client models ``w_i`` (uploaded this round).
    alpha_k
        Server step ``α_k`` (> 0).
    sigma
        Attention scale ``σ`` (> 0), in the units of ``‖w_i − w_j‖²``.

    The defaults ``α_k = σ = 1`` are placeholders, not values from the paper: ``σ`` must be
    set on the scale of the squared model distances and ``α_k <= σ / (n − 1)`` guarantees
    ``ξ_ii >= 0`` (since ``A' <= 1/σ``).
    """
    if not (math.isfinite(alpha_k) and alpha_k > 0):
        raise ValueError(f"alpha_k must be finite and > 0, got {alpha_k!r}")
    if not (math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma must be finite and > 0, got {sigma!r}")
    dist = pairwise_sq_dists(models)
    xi = alpha_k * np.exp(-dist / sigma) / sigma
    np.fill_diagonal(xi, 0.0)
    np.fill_diagonal(xi, 1.0 - xi.sum(axis=1))
    if np.any(np.diag(xi) < 0):
        bad = [int(i) for i in np.flatnonzero(np.diag(xi) < 0)]
        logger.warning("FedAMP self weights ξ_ii < 0 for clients %s: decrease alpha_k", bad)
    return xi


def fedamp_heuristic_weights(vectors: ArrayLike, self_weight: float = 0.3, scale: float = 10.0) -> FloatArray:
    """Heuristic FedAMP weights (HeurFedAMP; pFedGraph repository's ``calculate_graph_matrix``)::

        ξ_ii = s,   ξ_ij = (1 − s) · exp(κ α_ij) / Σ_{h≠i} exp(κ α_ih),   α = cos(v_i, v_j)

    Parameters
    ----------
    vectors
        ``n x d`` vectors compared by cosine (``θ_i − θ^0`` in the reference code).
    self_weight
        ``s ∈ [0, 1]``.
    scale
        ``κ`` (>= 0).

    Returns
    -------
    numpy.ndarray
        ``n x n`` nonnegative, rows summing to 1 (``ξ = [[1]]`` for one client).
    """
    if not (0.0 <= self_weight <= 1.0):
        raise ValueError(f"self_weight must be in [0, 1], got {self_weight!r}")
    if not (math.isfinite(scale) and scale >= 0):
        raise ValueError(f"scale must be finite and >= 0, got {scale!r}")
    sim = cosine_similarity_matrix(vectors)
    n = sim.shape[0]
    if n == 1:
        return np.ones((1, 1))
    logits = scale * sim
    np.fill_diagonal(logits, -np.inf)
    logits -= logits.max(axis=1, keepdims=True)
    e = np.exp(logits)
    xi: FloatArray = (1.0 - self_weight) * e / e.sum(axis=1, keepdims=True)
    np.fill_diagonal(xi, self_weight)
    return xi


def fedamp_aggregate(models: ArrayLike, xi: ArrayLike) -> AnyFloatArray:
    """Personalised cloud models ``u_i = Σ_j ξ_ij w_j`` (FedAMP's message passing)."""
    x = _as_rows(models, "models")
    w = np.asarray(xi, dtype=np.float64)
    n = x.shape[0]
    if w.shape != (n, n):
        raise ValueError(f"xi must have shape ({n}, {n}), got shape {w.shape}")
    return mix(w, x)


# ---------------------------------------------------------------------------------------
# pFedGraph
# ---------------------------------------------------------------------------------------


def project_simplex(v: ArrayLike) -> FloatArray:
    """Euclidean projection onto the simplex ``Δ = {x >= 0, Σ x = 1}``.

    Sort and threshold (Held, Wolfe, Crowder 1974)::

        x = max(v − τ, 0),  τ = (Σ_{k<=ρ} u_k − 1)/ρ,  u = sort(v)↓,
        ρ = max{k : u_k − (Σ_{h<=k} u_h − 1)/k > 0}
    """
    x = np.asarray(v, dtype=np.float64)
    if x.ndim != 1 or x.size == 0 or not np.all(np.isfinite(x)):
        raise ValueError(f"v must be a finite non-empty vector, got shape {x.shape}")
    u = np.sort(x)[::-1]
    css = np.cumsum(u) - 1.0
    k = np.arange(1, x.size + 1)
    rho = int(np.flatnonzero(u - css / k > 0)[-1]) + 1
    tau = css[rho - 1] / rho
    out: FloatArray = np.maximum(x - tau, 0.0)
    return out


def pfedgraph_graph(
    vectors: ArrayLike,
    sizes: ArrayLike | None = None,
    alpha: float = 0.8,
    clip_above: float | None = 0.9,
) -> FloatArray:
    """Collaboration graph of pFedGraph (Ye et al. 2023; ``optimizing_graph_matrix_neighbor``).

    Row ``i`` solves ``min_{a∈Δ} α‖a‖² − Σ_j a_j cos(v_i, v_j) − 2α pᵀa``, i.e.
    ``a_i = Proj_Δ(p + cos_i / (2α))``, with ``p`` the data-size proportions and the cosine
    of every pair including ``i = j``; cosines above ``clip_above`` are set to 1 (as in the
    official code; ``None`` disables).

    Parameters
    ----------
    vectors
        ``n x d`` vectors compared by cosine (``θ_i − θ^0`` in the official code).
    sizes
        Optional positive data sizes (uniform when ``None``).
    alpha
        ``α > 0`` ("to avoid concentration"; code default 0.8).

    Returns
    -------
    numpy.ndarray
        ``n x n`` row-stochastic, nonnegative (not symmetric in general).
    """
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be finite and > 0, got {alpha!r}")
    sim = cosine_similarity_matrix(vectors)
    n = sim.shape[0]
    p = _as_weights(sizes, n, "sizes")
    if clip_above is not None:
        sim = np.where(sim > clip_above, 1.0, sim)
    return np.stack([project_simplex(p + sim[i] / (2.0 * alpha)) for i in range(n)])


def pfedgraph_aggregate(models: ArrayLike, graph: ArrayLike) -> tuple[AnyFloatArray, AnyFloatArray]:
    """Personalised models and cosine-regulariser targets of pFedGraph::

        θ̃_i = Σ_j a_ij θ_j,        c_i = Σ_j a_ij θ_j / ‖θ_j‖

    Returns
    -------
    tuple
        ``(θ̃, c)``, both ``n x d`` in the input dtype (a zero model contributes 0 to ``c``).
    """
    x = _as_rows(models, "models")
    a = np.asarray(graph, dtype=np.float64)
    n = x.shape[0]
    if a.shape != (n, n):
        raise ValueError(f"graph must have shape ({n}, {n}), got shape {a.shape}")
    norms = np.sqrt(np.maximum(np.diag(gram_matrix(x)), 0.0))
    inv = np.divide(1.0, norms, out=np.zeros(n), where=norms > 0)
    return mix(a, x), mix(a * inv[None, :], x)
