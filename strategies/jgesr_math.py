"""Pure mathematics of JGESR: joint graph estimation and signal restoration (ALGORITHMS.md §8).

Server-side aggregation of seed 002 (Fukuhara, Hara, Higashi, Tanaka 2025). NumPy/SciPy only;
no Flower, no torch, no graphfl imports: the functions take plain arrays and return plain
arrays and small dataclasses.

Problem (ALGORITHMS.md §8.3 with the graph scale of §0.1 C4, on the scaled problem of §8.4)::

    min_{Ψ, w ∈ C} F(Ψ, w) = Σ_k p_k ‖m_k ⊙ (ψ_k − y_k)‖² + λ wᵀ z(Ψ) − α 1ᵀ log(S w) + β ‖w‖²
    C = {w >= 0, Σ_{i<j} w_ij = n}

* ``y_k`` client k's upload (row k of ``Y``, ``n x d``), ``m_k ∈ {0,1}^d`` which entries
  arrived (NaN/Inf entries count as missing), ``ψ_k`` the restored model sent back.
* ``w ∈ R^{n(n−1)/2}`` the upper triangle of the symmetric graph ``W`` (zero diagonal);
  ``(Sw)_i = Σ_j W_ij`` the degrees; ``z_ij(Ψ) = ‖ψ_i − ψ_j‖²``, so ``wᵀz = tr(Ψᵀ L(W) Ψ)``.
  In code the graph is always the ``n x n`` matrix ``W``; ``‖w‖² = ½‖W‖_F²``.

Graph scale (§0.1 C4; the trace constraint ``tr L = const`` of Dong et al. 2016, the fixed-scale
form of Kalofolias 2016). Over ``w >= 0`` alone (§8.3) the minimum is consensus: as Ψ contracts,
``z(Ψ) → 0``, the graph grows without cost in ``λwᵀz`` and ``−α Σ log deg`` decreases without
bound until ``β‖w‖²`` stops it, so every solve drifts to ``ψ_k ≈ ȳ`` on a uniform graph (FedAvg).
On ``C`` the total weight is ``n`` (mean degree 2): ``−α Σ log deg >= −α n log 2`` is bounded,
shrinking Ψ no longer buys weight, and adding a constant to every ``z_ij`` (e.g. the ``2dσ²``
of the uplink noise) changes ``F`` by a constant, so the graph depends only on which pairs are
*closer* than others. The solvers keep ``w ∈ C`` throughout: the initial graph is rescaled onto
``C`` (a positive multiple), PDCA's inner steps and stationarity test project onto ``C``
(:func:`project_graph`, the exact sort-based projection of ``w`` onto the scaled simplex), the
Two-step's w-step solves the Kalofolias problem over ``C`` (:func:`kalofolias_graph` with
``total``). ``fixed_scale=False`` restores §8.3 (only to show the collapse). Every result
carries the collapse diagnostics of C4: ``shrink_ratio = ‖Ψ − ȳ‖/‖Y − ȳ‖`` and ``graph_cv`` (the
coefficient of variation of the off-diagonal weights). The scale bounds the graph, not the
smoothing: a large ``λ`` still contracts Ψ (``(P + λL)^{-1}`` shrinks a graph's non-constant
components by ``1/(1 + λμ_i)``), so ``λ`` is chosen on validation and the diagnostics logged.

PDCA (§8.5; Gotoh, Takeda, Tono 2018). With ``wᵀz = (1/2c)(‖cw + z‖² − c²‖w‖² − ‖z‖²)``
(``c = dc_scale``; ``c = 1`` is the split of §8.3) the DC split ``F = f + g − h`` is::

    f = Σ_k p_k ‖m_k⊙ψ_k − y_k‖² + β‖w‖²            (smooth, L_f = 2 max(max_k p_k, β))
    g = (λ/2c)‖c w + z(Ψ)‖² − α 1ᵀlog(Sw) + ι_C(w)   (convex: c w + z >= 0 on w >= 0)
    h = (λ/2c)(c²‖w‖² + ‖z(Ψ)‖²)                     (convex; ∇_w h = λ c w, ∇_Ψ h = (2λ/c) L(z) Ψ)

    x^{k+1} = argmin_x  g(x) + <∇f(x^k) − ∇h(x^k), x> + (L_f/2) ‖x − x^k‖²

The proximal subproblem is solved inexactly by projected gradient (projection of ``w`` onto
``C``) with Armijo backtracking started at ``x^k``. Any inner point whose subproblem value is not above the value at ``x^k``
gives ``F(x^{k+1}) <= F(x^k)`` (convexity of ``h``, ``L_f``-smoothness of ``f``), so the
objective is non-increasing whatever the number of inner steps.

Two-step (§8.6; Dong et al. 2016): alternate the w-step (Kalofolias' log-degree graph learning
over the same ``C``, solved by the forward–backward–forward primal–dual iteration of GSPBox
``gsp_learn_graph_log_degrees`` with the prox ``max(0, ·)`` replaced by the projection onto
``C``) and the Ψ-step ``Ψ = (P + λ L(W))^{-1} P X``.

Implementation choices (what §8 said → what is done here → why)
-----------------------------------------------------------------
1. *Client weights.* §8.1 writes ``p_k = n_k / Σ n_l`` (sum 1). Here ``p`` is normalised to
   **mean 1** (``p_k = n · n_k / Σ n_l``), uniform when no weights are given. With sum-1
   weights the fidelity shrinks like ``1/n`` while the learned degrees grow with ``n``, so the
   same (λ, α, β) would smooth ever harder as clients are added. Spec values convert as
   ``(λ, α, β)_here = (λ, α, β)_spec · n``.
2. *Scaling* (§8.4). ``s² = mean_{i<j} ẑ_ij`` with ``ẑ_ij = d / c_ij · Σ_{c common} (y_ic −
   y_jc)²`` (the distance on the ``c_ij`` commonly observed entries extrapolated to ``d``
   entries; pairs with no common entry are skipped). When ``d > SCALE_COLUMNS`` the sum runs
   over every ``ceil(d / SCALE_COLUMNS)``-th column (a strided sample: the scale is a
   normaliser, 1e-3 relative accuracy is plenty, and it saves three ``n²d`` products).
   ``s = 1`` if every pair is at distance 0. All of ``F`` (and ``W``) refer to ``Y/s``, ``Ψ/s``.
3. *Exact low-dimensional reformulation (speed).* Without masks every PDCA/Two-step iterate
   lies in ``μ + span(rows of Y − μ)`` (the gradients ``2P(Ψ − Y)`` and ``2L(u)Ψ`` are left
   multiplications by ``n x n`` matrices, and ``L(u)1 = 0`` makes the translation ``μ``
   harmless). With the Gram matrix ``G = B Bᵀ = U Λ Uᵀ`` of the centred rows ``B`` and the
   orthonormal rows ``Q = Λ^{-1/2} Uᵀ B``, the coordinates ``Φ = Ψ̃ Qᵀ ∈ R^{n x q}`` (``q <=
   rank G``) turn the problem into the *same* Euclidean problem in dimension ``q`` instead of
   ``d``; ``Ψ = μ + Φ Λ^{-1/2} Uᵀ B`` at the end. Cost: two ``n²d`` products (Gram, output)
   plus ``O(n³)`` per inner step, instead of ``O(n²d)`` per inner step. Eigenvalues below
   ``EIG_RTOL · λ_max`` are dropped (directions of numerically zero length).
4. *Masks by majorisation–minimisation.* With missing entries the span argument fails. Write
   the masked fidelity as ``min_X Σ p_k ‖ψ_k − x_k‖²`` over ``X`` equal to ``Y`` on observed
   entries; at ``Ψ^t`` the minimiser is ``X^t = M⊙Y + (1−M)⊙Ψ^t`` and the unmasked surrogate
   touches ``F`` at ``Ψ^t``. Each MM step solves the surrogate in the exact reduced
   coordinates of the basis ``[X^t; Ψ^t]`` (``2n`` rows, so that the solve can *start at*
   ``Ψ^t``), then re-imputes. The chained trace ``F(Ψ^0) >= S_0(Ψ^1) >= F(Ψ^1) = S_1(Ψ^1) >=
   …`` is non-increasing in the true objective. At most ``max_impute`` MM steps; stop when
   the surrogate's decrease over the step is ``<= impute_tol`` times the magnitude of ``F``
   (sum of the absolute values of its four terms). The MM iterates converge only linearly (on
   the planted problems ‖Ψ^{t+1} − Ψ^t‖ shrinks by ≈ 0.8 per step while ``F`` has stopped
   moving at 1e-5), so the test is on ``F``; each MM step costs three ``n²d`` products. This replaces §8.5's single masked solve
   (whose inner steps would each cost ``O(n²d)``) and gives the Two-step its masked Ψ-step
   without one ``n x n`` solve per column (a fixed point of the MM is a solution of the
   column-wise systems of §8.6).
5. *Initialisation* (§8.5). ``W0_ij = max(cos(y_i, y_j), 0) + 1e-6`` with the cosine over the
   entries both clients observed (raw, uncentred uploads, as the seed says). Missing entries
   of ``X^0``: the ``W0``-weighted mean of the clients observing the entry (0 when nobody
   observes it; §8.5's "previous round's ψ_k" is what ``psi_init`` provides). With
   ``psi_init`` given, *all* missing entries are taken from it instead: that is the MM state
   of a warm start, so an unmasked solution restarted this way does 0 iterations (a masked one
   a few, see item 4). The solve starts at ``Ψ = X^0``
   or at ``psi_init``; ``graph_init`` replaces ``W0`` (floored at 1e-6 off the diagonal when a
   degree is 0, or always with the free scale, so every degree is positive). Either is
   rescaled onto ``Σ_{i<j} w_ij = n`` (a warm start from the previous round is already there).
6. *Inner solver.* §8.5's Armijo test ``sub(x') <= sub(x) − 1e-4·s·‖∇‖²`` can fail for every
   ``s`` once the projection ``w >= 0`` is active; the projected-gradient form ``sub(x') <=
   sub(x) − (1e-4/s)‖x' − x‖²`` is used (the same when nothing is projected). The step ``s``
   is carried across inner steps, outer iterations and MM steps. §8.5 proposes ``J_in = 20``
   inner steps and ``K_out = 50``; the defaults here are ``J_in = 1`` and ``K_out = 1000``.
   At ``x^k`` the subproblem's gradient *equals* ``∇F(x^k)``, so one inner step is a
   projected gradient step on ``F`` whose length is certified on the majorant; extra inner
   steps refine the minimiser of a majorant that is discarded at the next iteration: on the
   planted problem they cost many more distance evaluations for the same final ``F``
   (docs/jgesr.md, "Solver settings"). Outer iterations are then cheap, hence ``K_out = 1000``.
7. *Stopping.* §8.5 stops on the relative step ``‖x^{k+1} − x^k‖ <= tol‖x^k‖``. With
   inexact inner solves the step is short whenever the step size is, not only near a
   stationary point (the MM steps then stop after one or two iterations each and the MM loop
   does not settle). PDCA therefore stops, before a step, on the projected-gradient
   residual ``‖x^k − P_{w>=0}(x^k − ∇F(x^k)/L_f)‖ <= tol · ‖x^k‖`` (zero exactly at
   stationary points; a warm start at a solution does 0 iterations). The Two-step keeps the
   relative-step test (each half-step is an exact block minimisation, so a short step does
   mean near-stationarity). ``x = (Ψ̃/s, w)`` with ``Ψ̃`` centred by the observer mean ``μ``
   and ``‖w‖`` the vector norm, so the tests scale with the spread of the models, not with
   their (much larger, common) magnitude; ``tol = 1e-4`` (§8.5).
8. *Two-step safeguards.* The FBF dual starts at ``v = −α / (S w)`` (the optimal dual for
   ``w``) instead of ``S w`` when warm-started; its output is clipped at 0, and a w-step that
   would raise ``F`` (inexact inner solve) is rejected, so the trace is non-increasing.
9. *Entries nobody observed* (§8.8 "keep the previous round's value"). They are free
   variables of ``F``: they start at ``psi_init`` (or 0) and are smoothed over the learned
   graph like every other missing entry; freezing them would not be a minimiser of ``F``.
10. *Precision.* ``n x d`` work arrays are float64 when ``n·d <= AUTO_FLOAT64_MAX`` and
    float32 above (``work_dtype`` overrides). All ``n x n`` quantities, the reduced problem and
    cross-block sums are float64; ``n x d`` products run per block of ``CHUNK`` columns with
    float64 accumulation across blocks. Rows are centred before any Gram matrix is formed, so
    the cancellation in ``‖a‖² + ‖b‖² − 2aᵀb`` is relative to the spread of the models.
    Memory: the input, the mask, and three work arrays of ``n x d``; no ``n² x d`` temporary.
12. *BLAS threads.* A solve runs under ``threadpoolctl``'s one-BLAS-thread limit. The reduced
    iterations multiply ``n x n`` matrices a few thousand times, where threads gain nothing; and
    on a loaded host OpenBLAS' threads spin against each other in every product, many times
    slower than one thread (docs/jgesr.md, "Solver settings"). On an idle many-core host the
    ``n²d`` products (Gram matrix, output) could go faster threaded; robustness under load is
    preferred.
11. *DC scale* ``c`` (``dc_scale``, default 1 = §8.3). Any ``c > 0`` gives a valid DC split;
    it trades the curvature of ``h`` in ``Ψ`` (``∝ 1/c``) against that in ``w`` (``∝ c``).
    Exposed for experiments only.

Returned graph ``W`` is the learned weight matrix of the scaled problem (dimensionless).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

logger = logging.getLogger(__name__)

FloatArray = NDArray[np.float64]
AnyFloatArray = NDArray[np.floating[Any]]
BoolArray = NDArray[np.bool_]

COS_FLOOR = 1e-6
"""Floor added to every off-diagonal initial weight (§8.5) so that all degrees are positive."""
ARMIJO_SIGMA = 1e-4
MAX_BACKTRACK = 60
EIG_RTOL = 1e-10
CHUNK = 1 << 16
"""Columns per block in every ``n x d`` pass."""
SCALE_COLUMNS = 1 << 16
AUTO_FLOAT64_MAX = 1 << 22


# ---------------------------------------------------------------------------------------
# parameters and results
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JGESRParams:
    """Hyperparameters of JGESR (ALGORITHMS.md §8.5–8.6; values refer to the scaled problem).

    Attributes
    ----------
    lam, alpha, beta
        ``λ`` (smoothness), ``α`` (log-degree barrier), ``β`` (edge-weight ridge); defaults
        (1, 1, 0.1) of §8.5 with the mean-1 client weights of the module docstring (item 1).
    max_outer
        PDCA outer iterations ``K_out`` (or Two-step alternations ``J_alt``) per MM step
        (module docstring, item 6).
    max_inner
        Projected-gradient steps ``J_in`` per PDCA subproblem (item 6).
    tol
        Outer-loop tolerance: PDCA projected-gradient residual, Two-step step, both relative
        to ``‖x‖`` (module docstring, item 7).
    max_impute, impute_tol
        MM (re-imputation) steps when entries are missing, and the relative objective
        decrease per MM step below which they stop (item 4).
    kalofolias_iter, kalofolias_tol
        FBF iterations / relative tolerance of the Two-step w-step.
    scale
        Apply the scaling of §8.4 (else ``s = 1``).
    work_dtype
        ``"auto"`` | ``"float32"`` | ``"float64"``: dtype of the ``n x d`` work arrays.
    dc_scale
        ``c > 0`` of the DC split (module docstring, item 11); 1 is §8.3.
    fixed_scale
        Constrain the graph to ``Σ_{i<j} w_ij = n`` (ALGORITHMS.md §0.1 C4; module docstring,
        "Graph scale"). ``False`` is the free scale of §8.3, whose minimum is consensus; it is
        kept only to show that defect.
    """

    lam: float = 1.0
    alpha: float = 1.0
    beta: float = 0.1
    max_outer: int = 1000
    max_inner: int = 1
    tol: float = 1e-4
    max_impute: int = 10
    impute_tol: float = 1e-4
    kalofolias_iter: int = 1000
    kalofolias_tol: float = 1e-5
    scale: bool = True
    work_dtype: Literal["auto", "float32", "float64"] = "auto"
    dc_scale: float = 1.0
    fixed_scale: bool = True

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "tol", "impute_tol", "kalofolias_tol", "dc_scale"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"JGESRParams.{name} must be finite and > 0, got {value!r}")
        if not (math.isfinite(self.lam) and self.lam >= 0):
            raise ValueError(f"JGESRParams.lam must be finite and >= 0, got {self.lam!r}")
        for name in ("max_outer", "max_inner", "max_impute", "kalofolias_iter"):
            value = getattr(self, name)
            if int(value) != value or value < 1:
                raise ValueError(f"JGESRParams.{name} must be an integer >= 1, got {value!r}")
        if self.work_dtype not in ("auto", "float32", "float64"):
            raise ValueError(f"JGESRParams.work_dtype must be 'auto', 'float32' or 'float64', got {self.work_dtype!r}")


@dataclass(frozen=True)
class JGESRResult:
    """Output of :func:`solve_pdca` / :func:`solve_two_step`.

    Attributes
    ----------
    psi
        ``n x d`` restored models ``Ψ`` (row k goes to client k), dtype of the uploads
        (float64 for integer input).
    graph
        ``n x n`` learned weights ``W`` (symmetric, nonnegative, zero diagonal).
    objective
        ``F`` of the scaled problem: entry 0 at the start, then one entry per outer iteration
        (with masks: the MM surrogate, an upper bound of ``F`` equal to it at every MM step's
        start; see the module docstring, item 4). Non-increasing.
    iterations
        Outer iterations (PDCA iterations or Two-step alternations) over all MM steps.
    converged
        The last outer loop met ``tol`` and (with masks) the MM loop met ``impute_tol``.
    scale
        ``s`` of §8.4 (``Y/s`` is what ``objective`` and ``graph`` refer to).
    impute_steps
        MM steps run (1 without missing entries).
    shrink_ratio
        ``‖Ψ − 1ȳᵀ‖ / ‖Y − 1ȳᵀ‖`` (Frobenius over clients, on the received entries; ``ȳ`` the
        weighted mean of the uploads): 1 = no smoothing, 0 = every client gets the mean
        (FedAvg). See :func:`shrink_ratio`.
    graph_cv
        :func:`graph_cv` of ``graph`` (0 = uniform graph).
    """

    psi: AnyFloatArray
    graph: FloatArray
    objective: FloatArray
    iterations: int
    converged: bool
    scale: float
    impute_steps: int
    shrink_ratio: float = math.nan
    graph_cv: float = math.nan


# ---------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------


def _as_uploads(y: ArrayLike, name: str = "y") -> AnyFloatArray:
    arr = np.asarray(y)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"{name} must be a 2-D (n clients x d params) array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.floating):
        arr = arr.astype(np.float64)
    return arr


def _observed(y: AnyFloatArray, mask: ArrayLike | None) -> BoolArray | None:
    """Mask of received entries: ``mask & isfinite(y)``; ``None`` when everything arrived."""
    finite = np.isfinite(y)
    if mask is None:
        return None if bool(finite.all()) else finite
    m = np.asarray(mask)
    if m.shape != y.shape:
        raise ValueError(f"mask must have the shape of y {y.shape}, got shape {m.shape}")
    if m.dtype != np.bool_:
        if not np.all((m == 0) | (m == 1)):
            raise ValueError("mask must contain only 0/1 (or booleans)")
        m = m.astype(bool)
    obs = m & finite
    return None if bool(obs.all()) else obs


def _check_weights(weights: ArrayLike | None, n: int) -> FloatArray:
    """Client weights normalised to mean 1 (module docstring, item 1)."""
    if weights is None:
        return np.ones(n)
    p = np.asarray(weights, dtype=np.float64)
    if p.shape != (n,):
        raise ValueError(f"weights must have shape ({n},), got shape {p.shape}")
    if not np.all(np.isfinite(p)) or np.any(p <= 0):
        raise ValueError("weights must be finite and > 0")
    return p * (n / float(p.sum()))


def _check_graph(graph: ArrayLike, n: int, name: str = "graph_init") -> FloatArray:
    w = np.array(graph, dtype=np.float64)
    if w.shape != (n, n):
        raise ValueError(f"{name} must have shape ({n}, {n}), got shape {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"{name} must be finite and nonnegative")
    if not np.allclose(w, w.T, rtol=1e-10, atol=1e-12):
        raise ValueError(f"{name} must be symmetric")
    w = 0.5 * (w + w.T)
    np.fill_diagonal(w, 0.0)
    return w


def _work_dtype(y: AnyFloatArray, choice: str) -> np.dtype[Any]:
    if choice == "float32":
        return np.dtype(np.float32)
    if choice == "float64":
        return np.dtype(np.float64)
    return np.dtype(np.float64 if y.size <= AUTO_FLOAT64_MAX else np.float32)


def _blocks(d: int, size: int = CHUNK) -> Iterator[slice]:
    for start in range(0, d, size):
        yield slice(start, min(start + size, d))


# ---------------------------------------------------------------------------------------
# graph operators (matrix form of w)
# ---------------------------------------------------------------------------------------


def sq_dists_from_gram(gram: ArrayLike) -> FloatArray:
    """``Z_ij = K_ii + K_jj − 2 K_ij`` from a Gram matrix ``K`` (clipped at 0, zero diagonal).

    Parameters
    ----------
    gram
        ``n x n`` symmetric Gram matrix of (preferably centred) rows.
    """
    k = np.asarray(gram, dtype=np.float64)
    if k.ndim != 2 or k.shape[0] != k.shape[1]:
        raise ValueError(f"gram must be a square matrix, got shape {k.shape}")
    dg = np.diag(k)
    z = dg[:, None] + dg[None, :] - 2.0 * k
    z = 0.5 * (z + z.T)
    np.maximum(z, 0.0, out=z)
    np.fill_diagonal(z, 0.0)
    return z


def pairwise_sq_dists(x: ArrayLike) -> FloatArray:
    """``Z_ij = ‖x_i − x_j‖²`` through the Gram matrix of the centred rows (float64).

    No ``n x n x d`` temporary: rows are centred by their mean and the Gram matrix
    ``X̃ X̃ᵀ`` is accumulated in float64 over blocks of :data:`CHUNK` columns.
    """
    arr = _as_uploads(x, "x")
    n, d = arr.shape
    g = np.zeros((n, n))
    for sl in _blocks(d):
        blk = np.asarray(arr[:, sl], dtype=np.float64)
        blk = blk - blk.mean(axis=0, keepdims=True)
        g += blk @ blk.T
    return sq_dists_from_gram(g)


def laplacian(w: ArrayLike) -> FloatArray:
    """Combinatorial Laplacian ``L(W) = diag(W 1) − W`` of a symmetric weight matrix."""
    a = np.asarray(w, dtype=np.float64)
    return np.diag(a.sum(axis=1)) - a


def _lap_apply(u: FloatArray, x: FloatArray) -> FloatArray:
    """``L(U) X = diag(U 1) X − U X`` without forming ``L``."""
    out: FloatArray = u.sum(axis=1)[:, None] * x - u @ x
    return out


def project_scaled_simplex(v: ArrayLike, total: float) -> FloatArray:
    """Euclidean projection of a vector onto ``{x >= 0, Σx = total}`` (sort-based, exact).

    ``x_e = max(v_e − τ, 0)`` with the threshold ``τ`` that makes the sum ``total``:
    ``τ = (Σ_{e<=ρ} u_e − total) / ρ`` over the values ``u`` sorted in decreasing order, ``ρ`` the
    largest index with ``u_ρ > τ`` (Held, Wolfe, Crowder 1974; Duchi et al. 2008, Fig. 1).

    Parameters
    ----------
    v
        1-D array.
    total
        Target sum (> 0).
    """
    vec = np.asarray(v, dtype=np.float64)
    if vec.ndim != 1 or vec.size == 0:
        raise ValueError(f"v must be a non-empty 1-D array, got shape {vec.shape}")
    if not (math.isfinite(total) and total > 0):
        raise ValueError(f"total must be finite and > 0, got {total!r}")
    u = np.sort(vec)[::-1]
    css = np.cumsum(u) - total
    ks = np.arange(1, u.size + 1)
    rho = int(np.nonzero(u - css / ks > 0)[0][-1]) + 1
    tau = css[rho - 1] / rho
    out: FloatArray = np.maximum(vec - tau, 0.0)
    # one correction for rounding: the sum is exact to a few ulps of ``total``
    pos = out > 0
    out[pos] += (total - float(out.sum())) / max(int(pos.sum()), 1)
    np.maximum(out, 0.0, out=out)
    return out


def project_graph(w: ArrayLike, total: float) -> FloatArray:
    """Project a symmetric ``n x n`` weight matrix onto ``{W >= 0, diag 0, Σ_{i<j} W_ij = total}``.

    The variable is the upper triangle ``w`` (ALGORITHMS.md §8.3: ``‖w‖² = ½‖W‖_F²``), so this is
    :func:`project_scaled_simplex` of ``w``, mirrored.
    """
    a = np.asarray(w, dtype=np.float64)
    n = a.shape[0]
    out = np.zeros((n, n))
    if n < 2:
        return out
    iu, ju = np.triu_indices(n, 1)
    out[iu, ju] = project_scaled_simplex(a[iu, ju], total)
    out += out.T
    return out


def graph_cv(w: ArrayLike) -> float:
    """Coefficient of variation ``sd / mean`` of the off-diagonal weights ``w_ij, i < j``.

    0 for a uniform graph; ``nan`` when there is no off-diagonal weight (``n < 2``) or their mean
    is 0. The population sd (``ddof = 0``) is used.
    """
    a = np.asarray(w, dtype=np.float64)
    n = a.shape[0]
    if n < 2:
        return math.nan
    vals = a[np.triu_indices(n, 1)]
    mean = float(vals.mean())
    if not mean > 0:
        return math.nan
    return float(vals.std()) / mean


# ---------------------------------------------------------------------------------------
# initial graph (§8.5: cosine similarity)
# ---------------------------------------------------------------------------------------


def cosine_graph(y: ArrayLike, mask: ArrayLike | None = None, floor: float = COS_FLOOR) -> FloatArray:
    """Initial graph of §8.5: ``W0_ij = max(cos(y_i, y_j), 0) + floor`` for ``i ≠ j``.

    The cosine is taken over the entries both clients observed (``mask`` and finite)::

        cos_ij = Σ_c m_ic m_jc y_ic y_jc / sqrt(Σ_c m_ic m_jc y_ic² · Σ_c m_ic m_jc y_jc²)

    (0 when a norm is 0). Computed as ``Y0 Y0ᵀ / sqrt(N ∘ Nᵀ)`` with ``Y0 = m ⊙ y`` and
    ``N = (Y0 ⊙ Y0) Mᵀ``, accumulated in float64 over column blocks.

    Parameters
    ----------
    y
        ``n x d`` uploads (NaN/Inf = missing).
    mask
        Optional ``n x d`` 0/1 mask of received entries.
    floor
        Added off the diagonal (§8.5 ``w0 = triu(W0) + 1e-6``); must be >= 0.

    Returns
    -------
    numpy.ndarray
        ``n x n`` symmetric, nonnegative, zero diagonal.
    """
    arr = _as_uploads(y)
    if not (math.isfinite(floor) and floor >= 0):
        raise ValueError(f"floor must be finite and >= 0, got {floor!r}")
    return _cosine_observed(arr, _observed(arr, mask), floor)


def _cosine_observed(arr: AnyFloatArray, obs: BoolArray | None, floor: float) -> FloatArray:
    """:func:`cosine_graph` with the observation mask already computed (``None``: all)."""
    n, d = arr.shape
    g = np.zeros((n, n))
    nn = np.zeros((n, n))
    for sl in _blocks(d):
        blk = arr[:, sl]
        if obs is None:
            g += (blk @ blk.T).astype(np.float64)
            continue
        mb = obs[:, sl]
        y0 = np.where(mb, blk, blk.dtype.type(0))
        nn += (np.square(y0) @ mb.T.astype(blk.dtype)).astype(np.float64)
        g += (y0 @ y0.T).astype(np.float64)
    if obs is None:
        sq = np.diag(g).copy()
        nn = np.broadcast_to(sq[:, None], (n, n)).copy()
    return _cosine_weights(g, nn, floor)


def _cosine_weights(g: FloatArray, nn: FloatArray, floor: float) -> FloatArray:
    """``max(G_ij / sqrt(N_ij N_ji), 0) + floor`` off the diagonal (0 where a norm is 0)."""
    denom = np.sqrt(nn * nn.T)
    cos = np.divide(g, denom, out=np.zeros_like(g), where=denom > 0)
    clipped = np.clip(cos, 0.0, 1.0)
    w: FloatArray = 0.5 * (clipped + clipped.T) + floor
    np.fill_diagonal(w, 0.0)
    return w


def _cosine_from_centred(gram: FloatArray, xmu: FloatArray, mumu: float) -> FloatArray:
    """Cosine graph of unmasked uploads ``y_i = x̃_i + μ`` from ``X̃X̃ᵀ``, ``X̃μ`` and ``‖μ‖²``::

    y_iᵀy_j = x̃_iᵀx̃_j + x̃_iᵀμ + x̃_jᵀμ + ‖μ‖²   (saves one ``n²d`` product)
    """
    g = gram + xmu[:, None] + xmu[None, :] + mumu
    sq = np.maximum(np.diag(g), 0.0)
    return _cosine_weights(g, np.broadcast_to(sq[:, None], g.shape).copy(), COS_FLOOR)


# ---------------------------------------------------------------------------------------
# the scaled, reduced problem (Euclidean, n x q)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Problem:
    p: FloatArray
    lam: float
    alpha: float
    beta: float
    c: float = 1.0
    total: float | None = None  # Σ_{i<j} w_ij on the feasible set; None: w >= 0 only (free scale)

    def project(self, w: FloatArray) -> FloatArray:
        """Euclidean projection (in ``w``) onto the feasible graphs: ``w >= 0`` (and ``Σw = total``)."""
        if self.total is None:
            return np.maximum(w, 0.0)
        return project_graph(w, self.total)


def _sqdist(phi: FloatArray) -> FloatArray:
    """``Z_ij = ‖φ_i − φ_j‖²`` (``φ φᵀ`` is computed by SYRK, hence exactly symmetric)."""
    k = phi @ phi.T
    dg = k.diagonal()
    z = dg[:, None] + dg[None, :]
    z -= 2.0 * k
    np.maximum(z, 0.0, out=z)
    return z


def _sq(a: FloatArray) -> float:
    flat = a.ravel()
    return float(flat @ flat)


def _objective_dense(phi: FloatArray, target: FloatArray, w: FloatArray, prob: _Problem) -> float:
    """``F`` with a full fidelity term: ``Σ p_k‖φ_k − t_k‖² + λ½ΣW∘Z − αΣlog deg + β½‖W‖_F²``.

    ``+inf`` when a degree is not positive (outside the domain of ``log``).
    """
    return _objective(phi, target, w, _sqdist(phi), w.sum(axis=1), prob)


def _objective(phi: FloatArray, target: FloatArray, w: FloatArray, z: FloatArray, deg: FloatArray, prob: _Problem) -> float:
    if np.any(deg <= 0):
        return math.inf
    r = phi - target
    fid = float(prob.p @ np.einsum("ij,ij->i", r, r))
    return _graph_terms(fid, z, w, deg, prob)


def _magnitude(phi: FloatArray, target: FloatArray, w: FloatArray, prob: _Problem) -> float:
    """Sum of the absolute values of the four terms of ``F`` (scale for relative tests)."""
    deg = np.maximum(w.sum(axis=1), np.finfo(float).tiny)
    r = phi - target
    return (
        float(prob.p @ np.einsum("ij,ij->i", r, r))
        + prob.lam * 0.5 * abs(float(w.ravel() @ _sqdist(phi).ravel()))
        + prob.alpha * float(np.abs(np.log(deg)).sum())
        + prob.beta * 0.5 * _sq(w)
    )


def _graph_terms(fid: float, z: FloatArray, w: FloatArray, deg: FloatArray, prob: _Problem) -> float:
    return fid + prob.lam * 0.5 * float(w.ravel() @ z.ravel()) - prob.alpha * float(np.log(deg).sum()) + prob.beta * 0.5 * _sq(w)


@dataclass
class _Run:
    """State and diagnostics of one reduced solve."""

    phi: FloatArray
    w: FloatArray
    trace: list[float]
    iterations: int
    converged: bool
    step: float


def _rel_step(phi0: FloatArray, w0: FloatArray, phi1: FloatArray, w1: FloatArray) -> tuple[float, float]:
    """``(‖x1 − x0‖, ‖x0‖)`` with ``x = (Φ, w)`` and ``‖w‖² = ½‖W‖_F²``."""
    dx = math.sqrt(_sq(phi1 - phi0) + 0.5 * _sq(w1 - w0))
    xn = math.sqrt(_sq(phi0) + 0.5 * _sq(w0))
    return dx, xn


@dataclass(frozen=True)
class _Sub:
    """PDCA subproblem at ``V = x^k − (∇f − ∇h)(x^k)/L``::

    sub(Ψ, w) = (λ/2c)‖c w + z(Ψ)‖² − α 1ᵀlog(Sw) + (L/2)(‖Ψ − V_Ψ‖² + ‖w − V_w‖²)
    """

    v_phi: FloatArray
    v_w: FloatArray
    lf: float
    prob: _Problem

    def value(self, phi: FloatArray, w: FloatArray, z: FloatArray, deg: FloatArray) -> float:
        if np.any(deg <= 0):
            return math.inf
        c = self.prob.c
        u = c * w + z
        return (
            self.prob.lam * 0.25 / c * _sq(u)
            - self.prob.alpha * float(np.log(deg).sum())
            + 0.5 * self.lf * (_sq(phi - self.v_phi) + 0.5 * _sq(w - self.v_w))
        )

    def grad(self, phi: FloatArray, w: FloatArray, z: FloatArray, deg: FloatArray) -> tuple[FloatArray, FloatArray]:
        """``∇_Ψ = (2λ/c) L(cw + z) Ψ + L(Ψ − V_Ψ)``, ``∇_w = λ(cw + z) − αSᵀ(1/Sw) + L(w − V_w)``."""
        c, lam = self.prob.c, self.prob.lam
        u = c * w + z
        g_phi = 2.0 * lam / c * _lap_apply(u, phi) + self.lf * (phi - self.v_phi)
        inv = 1.0 / deg
        g_w = lam * u - self.prob.alpha * (inv[:, None] + inv[None, :]) + self.lf * (w - self.v_w)
        np.fill_diagonal(g_w, 0.0)
        return g_phi, g_w


@dataclass
class _Point:
    phi: FloatArray
    w: FloatArray
    z: FloatArray
    deg: FloatArray

    @classmethod
    def at(cls, phi: FloatArray, w: FloatArray) -> _Point:
        return cls(phi, w, _sqdist(phi), w.sum(axis=1))


def _prox_inner(sub: _Sub, x: _Point, grad: tuple[FloatArray, FloatArray], max_inner: int, step: float) -> tuple[_Point, float]:
    """``J_in`` projected-gradient steps with Armijo backtracking on the PDCA subproblem.

    Accept ``x' = P(x − s∇)`` (``P``: projection of ``w`` onto the feasible set, ``w >= 0`` and,
    with a fixed scale, ``Σw = total``) iff every degree stays positive and
    ``sub(x') <= sub(x) − (σ/s)‖x' − x‖²`` (module docstring, item 6); ``s ← 2s`` after an
    accepted step, ``s ← s/2`` after a rejected trial. Never increases the subproblem value.
    ``grad`` is ``∇sub(x)`` (at ``x = x^k`` it equals ``∇F(x^k)``).
    """
    val = sub.value(x.phi, x.w, x.z, x.deg)
    g_phi, g_w = grad
    for j in range(max_inner):
        if j > 0:
            g_phi, g_w = sub.grad(x.phi, x.w, x.z, x.deg)
        trial: _Point | None = None
        for _ in range(MAX_BACKTRACK):
            phi_t = x.phi - step * g_phi
            w_t = sub.prob.project(x.w - step * g_w)
            d2 = _sq(phi_t - x.phi) + 0.5 * _sq(w_t - x.w)
            if d2 == 0.0:
                return x, step
            cand = _Point.at(phi_t, w_t)
            val_t = sub.value(cand.phi, cand.w, cand.z, cand.deg)
            if val_t <= val - ARMIJO_SIGMA / step * d2:
                trial = cand
                break
            step *= 0.5
        if trial is None:
            break
        x, val = trial, val_t
        step *= 2.0
    return x, step


def _norm(phi: FloatArray, w: FloatArray) -> float:
    """``‖(Φ, w)‖`` with ``‖w‖² = ½‖W‖_F²``."""
    return math.sqrt(_sq(phi) + 0.5 * _sq(w))


def _grad_objective(x: _Point, grad_fid: FloatArray, prob: _Problem) -> tuple[FloatArray, FloatArray]:
    """``∇F = (2P(Φ − T) + 2λ L(W) Φ,  λ z + 2β w − α Sᵀ(1/Sw))`` (``grad_fid`` = first term)."""
    inv = 1.0 / x.deg
    g_w = prob.lam * x.z + 2.0 * prob.beta * x.w - prob.alpha * (inv[:, None] + inv[None, :])
    np.fill_diagonal(g_w, 0.0)
    return grad_fid + 2.0 * prob.lam * _lap_apply(x.w, x.phi), g_w


def _stationarity(x: _Point, grad: tuple[FloatArray, FloatArray], lf: float, prob: _Problem) -> float:
    """Projected-gradient residual ``‖x − P_C(x − ∇F(x)/L_f)‖`` (0 iff ``x`` is stationary).

    ``C`` is the feasible set of ``w`` (``w >= 0``, and ``Σw = total`` with a fixed scale).
    """
    w_step = x.w - prob.project(x.w - grad[1] / lf)
    return _norm(grad[0] / lf, w_step)


def _pdca_dense(
    target: FloatArray,
    phi: FloatArray,
    w: FloatArray,
    prob: _Problem,
    params: JGESRParams,
    step: float = 1.0,
) -> _Run:
    """JGESR-PDCA (§8.5) on a dense problem with full fidelity ``Σ p_k ‖φ_k − t_k‖²``.

    Iteration (``L = L_f = 2 max(max_k p_k, β)``, DC scale ``c``, ``c = 1`` in §8.5)::

        G_Ψ = 2P(Ψ^k − T) − (2λ/c) L(z(Ψ^k)) Ψ^k,      G_w = (2β − λc) w^k
        V = x^k − G / L
        x^{k+1} ≈ argmin_{Ψ, w∈C} (λ/2c)‖c w + z(Ψ)‖² − α1ᵀlog(Sw) + (L/2)‖x − V‖²

    (``C = {w >= 0, Σw = total}``, or ``{w >= 0}`` with a free scale), stopping (before the
    step) when ``‖x^k − P_C(x^k − ∇F(x^k)/L)‖ <= tol ‖x^k‖`` (module docstring, item 7).
    ``F(x^{k+1}) <= F(x^k)`` because the inner solver never increases the subproblem and
    ``L >= L_f``.
    """
    lf = 2.0 * max(float(prob.p.max()), prob.beta)
    c, lam = prob.c, prob.lam
    x = _Point.at(phi, w)
    trace = [_objective(x.phi, target, x.w, x.z, x.deg, prob)]
    converged = False
    it = 0
    while it < params.max_outer:
        grad_f = 2.0 * prob.p[:, None] * (x.phi - target)
        grad_F = _grad_objective(x, grad_f, prob)
        if _stationarity(x, grad_F, lf, prob) <= params.tol * _norm(x.phi, x.w):
            converged = True
            break
        it += 1
        sub = _Sub(
            v_phi=x.phi - (grad_f - 2.0 * lam / c * _lap_apply(x.z, x.phi)) / lf,
            v_w=x.w * (1.0 - (2.0 * prob.beta - lam * c) / lf),
            lf=lf,
            prob=prob,
        )
        x, step = _prox_inner(sub, x, grad_F, params.max_inner, step)
        trace.append(_objective(x.phi, target, x.w, x.z, x.deg, prob))
    return _Run(x.phi, x.w, trace, it, converged, step)


# ---------------------------------------------------------------------------------------
# Two-step (§8.6)
# ---------------------------------------------------------------------------------------


def kalofolias_graph(
    z: ArrayLike,
    alpha: float,
    beta: float,
    w_init: ArrayLike | None = None,
    max_iter: int = 1000,
    tol: float = 1e-5,
    total: float | None = None,
) -> FloatArray:
    """Kalofolias' log-degree graph learning (§8.6; GSPBox ``gsp_learn_graph_log_degrees``).

    Solves ``min_{w∈C} ΣΣ W∘Z − α Σ_i log(Σ_j W_ij) + (β/2)‖W‖_F²``, i.e. in vector form
    ``2wᵀz − α1ᵀlog(Sw) + β‖w‖²``, over ``C = {w >= 0}`` (Kalofolias 2016) or, with ``total``,
    ``C = {w >= 0, Σ_{i<j} w_ij = total}`` (the scale constraint of ALGORITHMS.md §0.1 C4, as the
    trace constraint of Dong et al. 2016), by the forward–backward–forward primal–dual iteration
    (``μ = 2β + √(2(n−1))``, ``γ = 0.5/μ``)::

        Y = w − γ(2βw + Sᵀv),        ŷ = v + γSw
        P = P_C(Y − 2γz),            p̂ = (ŷ − sqrt(ŷ² + 4αγ)) / 2
        Q = P − γ(2βP + Sᵀp̂),        q̂ = p̂ + γSP
        w ← w − Y + Q,               v ← v − ŷ + q̂

    until the relative changes of ``w`` and ``v`` are both ``<= tol``. ``P_C`` is the prox of
    ``ι_C + 2wᵀz`` (``max(0, ·)``, or :func:`project_scaled_simplex`); the returned graph is the
    final ``w`` projected onto ``C`` (exactly feasible).

    Parameters
    ----------
    z
        ``n x n`` symmetric nonnegative "distance" matrix (for the JGESR w-step
        ``Z = (λ/2)·[‖ψ_i − ψ_j‖²]``).
    alpha, beta
        Barrier and ridge weights (> 0).
    w_init
        Optional warm start (``n x n``); the dual then starts at ``v = −α / (S w)``.
    total
        Fixed ``Σ_{i<j} w_ij`` (> 0), or ``None`` for the free scale.

    Returns
    -------
    numpy.ndarray
        ``n x n`` symmetric nonnegative weights with zero diagonal.
    """
    zm = np.asarray(z, dtype=np.float64)
    if zm.ndim != 2 or zm.shape[0] != zm.shape[1]:
        raise ValueError(f"z must be a square matrix, got shape {zm.shape}")
    if not (alpha > 0 and beta > 0):
        raise ValueError(f"alpha and beta must be > 0, got alpha={alpha!r}, beta={beta!r}")
    if total is not None and not (math.isfinite(total) and total > 0):
        raise ValueError(f"total must be finite and > 0, got {total!r}")
    n = zm.shape[0]
    if n < 2:
        return np.zeros((n, n))
    iu, ju = np.triu_indices(n, 1)
    zv = zm[iu, ju]

    def prox(vec: FloatArray) -> FloatArray:
        return np.maximum(0.0, vec) if total is None else project_scaled_simplex(vec, total)

    def s_op(vec: FloatArray) -> FloatArray:
        out: FloatArray = np.asarray(np.bincount(iu, vec, n) + np.bincount(ju, vec, n), dtype=np.float64)
        return out

    def st_op(deg: FloatArray) -> FloatArray:
        out: FloatArray = deg[iu] + deg[ju]
        return out

    wv: FloatArray = np.zeros(iu.size)
    v: FloatArray = np.zeros(n)
    if w_init is not None:
        wv = _check_graph(w_init, n, "w_init")[iu, ju]
        deg0 = s_op(wv)
        np.divide(-alpha, deg0, out=v, where=deg0 > 0)
    mu = 2.0 * beta + math.sqrt(2.0 * (n - 1))
    gamma = 0.5 / mu
    for _ in range(max_iter):
        y1 = wv - gamma * (2.0 * beta * wv + st_op(v))
        yd = v + gamma * s_op(wv)
        p1 = prox(y1 - 2.0 * gamma * zv)
        pd = 0.5 * (yd - np.sqrt(yd * yd + 4.0 * alpha * gamma))
        q1 = p1 - gamma * (2.0 * beta * p1 + st_op(pd))
        qd = pd + gamma * s_op(p1)
        w_new = wv - y1 + q1
        v_new = v - yd + qd
        dw = float(np.linalg.norm(w_new - wv)) / max(float(np.linalg.norm(w_new)), 1e-300)
        dv = float(np.linalg.norm(v_new - v)) / max(float(np.linalg.norm(v_new)), 1e-300)
        wv, v = w_new, v_new
        if dw <= tol and dv <= tol:
            break
    out = np.zeros((n, n))
    out[iu, ju] = prox(wv)
    out += out.T
    return out


def _two_step_dense(
    target: FloatArray,
    phi: FloatArray,
    w: FloatArray,
    prob: _Problem,
    params: JGESRParams,
    step: float = 1.0,
) -> _Run:
    """Two-step alternation (§8.6) on a dense problem with full fidelity.

    ``w ← argmin_{w∈C} λwᵀz(Ψ) − α1ᵀlog(Sw) + β‖w‖²`` (:func:`kalofolias_graph` with
    ``Z = (λ/2) z`` and the same feasible set ``C`` as PDCA; rejected if it raises ``F``), then
    ``Ψ ← (P + λL(W))^{-1} P T``.
    ``step`` is unused (same signature as :func:`_pdca_dense`).
    """
    del step
    trace = [_objective_dense(phi, target, w, prob)]
    converged = False
    it = 0
    while it < params.max_outer and not converged:
        it += 1
        w_new = kalofolias_graph(
            0.5 * prob.lam * _sqdist(phi),
            prob.alpha,
            prob.beta,
            w,
            params.kalofolias_iter,
            params.kalofolias_tol,
            prob.total,
        )
        if _objective_dense(phi, target, w_new, prob) > _objective_dense(phi, target, w, prob):
            w_new = w
        system = np.diag(prob.p) + prob.lam * laplacian(w_new)
        phi_new: FloatArray = np.asarray(np.linalg.solve(system, prob.p[:, None] * target), dtype=np.float64)
        trace.append(_objective_dense(phi_new, target, w_new, prob))
        dx, xn = _rel_step(phi, w, phi_new, w_new)
        phi, w = phi_new, w_new
        converged = dx <= params.tol * xn
    return _Run(phi, w, trace, it, converged, 1.0)


# ---------------------------------------------------------------------------------------
# exact reduction of the n x d problem (module docstring, item 3)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Basis:
    """Orthonormal coordinates of ``span(rows of B)``: ``coords = U Λ^{1/2}``, ``back = Λ^{-1/2} Uᵀ``."""

    coords: FloatArray
    back: FloatArray


def _basis_from_gram(gram: FloatArray) -> _Basis:
    evals, evecs = np.linalg.eigh(0.5 * (gram + gram.T))
    top = float(evals.max()) if evals.size else 0.0
    keep = evals > EIG_RTOL * top if top > 0 else np.zeros(evals.shape, dtype=bool)
    lam = evals[keep]
    u = evecs[:, keep]
    return _Basis(coords=u * np.sqrt(lam)[None, :], back=(u / np.sqrt(lam)[None, :]).T)


def _gram(arrays: Sequence[AnyFloatArray]) -> FloatArray:
    """Gram matrix of the stacked rows of ``arrays`` (float64 over column blocks)."""
    n = arrays[0].shape[0]
    k = len(arrays)
    g = np.zeros((k * n, k * n))
    for sl in _blocks(arrays[0].shape[1]):
        blocks = [a[:, sl] for a in arrays]
        for i in range(k):
            for j in range(i, k):
                prod = (blocks[i] @ blocks[j].T).astype(np.float64)
                g[i * n : (i + 1) * n, j * n : (j + 1) * n] += prod
    for i in range(k):
        for j in range(i):
            g[i * n : (i + 1) * n, j * n : (j + 1) * n] = g[j * n : (j + 1) * n, i * n : (i + 1) * n].T
    return g


def _combine(
    coef: FloatArray,
    arrays: Sequence[AnyFloatArray],
    out: AnyFloatArray,
    missing: BoolArray | None = None,
) -> None:
    """``out = Σ_a coef_a @ a`` over column blocks (``coef`` split into ``n x n`` blocks).

    With ``missing``, also re-impute ``arrays[0] ← where(missing, out, arrays[0])`` block by
    block (the MM step of the module docstring, item 4). ``out`` must not alias ``arrays``.
    """
    n = out.shape[0]
    parts = [coef[:, i * n : (i + 1) * n].astype(a.dtype) for i, a in enumerate(arrays)]
    for sl in _blocks(out.shape[1]):
        ob = out[:, sl]
        np.matmul(parts[0], arrays[0][:, sl], out=ob)
        for part, arr in zip(parts[1:], arrays[1:]):
            ob += part @ arr[:, sl]
        if missing is not None:
            np.copyto(arrays[0][:, sl], ob, where=missing[:, sl])


# ---------------------------------------------------------------------------------------
# preprocessing: observer mean, imputation, centring, scale
# ---------------------------------------------------------------------------------------


@dataclass
class _Prepared:
    x: AnyFloatArray  # centred, imputed uploads X̃ = X^0 − μ (work dtype)
    mu: FloatArray  # d-vector used for centring
    missing: BoolArray | None  # ~observed, None when all observed
    gram: FloatArray  # X̃ X̃ᵀ
    xmu: FloatArray  # X̃ μ (for the unmasked cosine graph)
    mumu: float  # ‖μ‖²


def _prepare(
    y: AnyFloatArray,
    obs: BoolArray | None,
    p: FloatArray,
    w0: FloatArray | None,
    psi_init: AnyFloatArray | None,
    wd: np.dtype[Any],
) -> _Prepared:
    """One pass over column blocks: ``μ``, imputed and centred ``X̃`` and its Gram matrix.

    ``μ_c = Σ_k p_k m_kc y_kc / Σ_k p_k m_kc`` (observer mean; ``psi_init``'s weighted mean or
    0 where nobody observed ``c``). Missing ``x_kc``: ``psi_init`` if given, else
    ``Σ_j W0_kj m_jc y_jc / Σ_j W0_kj m_jc``, else ``μ_c`` (module docstring, item 5).
    """
    n, d = y.shape
    x = np.empty((n, d), dtype=wd)
    mu = np.zeros(d)
    gram = np.zeros((n, n))
    xmu = np.zeros(n)
    pw = (p / p.sum()).astype(wd)
    w0w = None if w0 is None else w0.astype(wd)
    for sl in _blocks(d):
        blk = y[:, sl].astype(wd, copy=False)
        xb = x[:, sl]
        if obs is None:
            mu_b = pw @ blk
            np.subtract(blk, mu_b[None, :], out=xb)
        else:
            mu_b = _impute_block(blk, obs[:, sl], pw, w0w, psi_init, sl, xb)
        mu[sl] = mu_b
        gram += (xb @ xb.T).astype(np.float64)
        xmu += (xb @ mu_b).astype(np.float64)
    return _Prepared(x, mu, None if obs is None else ~obs, gram, xmu, float(mu @ mu))


def _impute_block(
    blk: AnyFloatArray,
    mb: BoolArray,
    pw: AnyFloatArray,
    w0: AnyFloatArray | None,
    psi_init: AnyFloatArray | None,
    sl: slice,
    out: AnyFloatArray,
) -> AnyFloatArray:
    """Write ``where(m, y, imputed) − μ`` of one column block into ``out``; return ``μ``.

    ``w0`` (cast to the work dtype) is required unless ``psi_init`` is given.
    """
    wd = out.dtype
    mf = mb.astype(wd)
    y0 = np.where(mb, blk, wd.type(0))
    cnt = pw @ mf
    mu_b = np.divide(pw @ y0, cnt, out=np.zeros_like(cnt), where=cnt > 0)
    if psi_init is not None:
        imp = psi_init[:, sl].astype(wd, copy=False)
        mu_b = np.where(cnt > 0, mu_b, pw @ imp)
        np.copyto(out, imp)
    else:
        if w0 is None:
            raise ValueError("w0 is required to impute missing entries without psi_init")
        den = w0 @ mf
        known = den > 0
        np.divide(w0 @ y0, den, out=out, where=known)
        np.copyto(out, np.broadcast_to(mu_b[None, :], out.shape), where=~known)
    np.copyto(out, blk, where=mb)
    out -= mu_b[None, :]
    out_mu: AnyFloatArray = mu_b
    return out_mu


def _scale(y: AnyFloatArray, obs: BoolArray | None, mu: FloatArray, gram: FloatArray) -> float:
    """``s`` of §8.4 (module docstring, item 2)."""
    n, d = y.shape
    if n < 2:
        return 1.0
    iu, ju = np.triu_indices(n, 1)
    if obs is None:
        z = sq_dists_from_gram(gram)[iu, ju]
        s2 = float(z.mean())
    else:
        stride = max(1, math.ceil(d / SCALE_COLUMNS))
        cols = slice(0, d, stride)
        mb = obs[:, cols]
        yc = np.where(mb, y[:, cols].astype(np.float64) - mu[cols][None, :], 0.0)
        mf = mb.astype(np.float64)
        sq = (yc * yc) @ mf.T
        dist = sq + sq.T - 2.0 * (yc @ yc.T)
        common = mf @ mf.T
        dsub = float(mb.shape[1])
        ok = common[iu, ju] > 0
        if not ok.any():
            return 1.0
        est = np.maximum(dist[iu, ju][ok], 0.0) * (d / dsub) * (dsub / common[iu, ju][ok])
        s2 = float(est.mean())
    if not (math.isfinite(s2) and s2 > 0):
        logger.debug("JGESR scale: all uploads coincide; using s = 1")
        return 1.0
    return math.sqrt(s2)


def graph_total(n: int) -> float:
    """The fixed graph scale ``Σ_{i<j} w_ij = n`` (ALGORITHMS.md §0.1 C4): mean degree 2."""
    return float(n)


def _shrink_centred(psi_c: AnyFloatArray, x_c: AnyFloatArray, missing: BoolArray | None) -> float:
    """``‖Ψ̃‖ / ‖X̃‖`` over the received entries (both centred by the same ``ȳ``; float64 sums)."""
    num = 0.0
    den = 0.0
    for sl in _blocks(psi_c.shape[1]):
        pb = psi_c[:, sl].astype(np.float64)
        xb = x_c[:, sl].astype(np.float64)
        if missing is not None:
            keep = ~missing[:, sl]
            pb = np.where(keep, pb, 0.0)
            xb = np.where(keep, xb, 0.0)
        num += _sq(pb)
        den += _sq(xb)
    return math.sqrt(num / den) if den > 0 else 1.0


def shrink_ratio(psi: ArrayLike, y: ArrayLike, mask: ArrayLike | None = None, weights: ArrayLike | None = None) -> float:
    """How far the restored models stay from the mean: ``‖Ψ − 1ȳᵀ‖_F / ‖Y − 1ȳᵀ‖_F``.

    ``ȳ_c = Σ_k p_k m_kc y_kc / Σ_k p_k m_kc`` is the weighted mean of the received uploads (the
    FedAvg model); both norms run over the received entries only (``mask`` and finite ``y``).
    1 when ``Ψ = Y`` (no aggregation), 0 when every client receives ``ȳ``: a JGESR that returns
    ``ȳ + ρ(y_k − ȳ)`` has ratio ``ρ``. 1 when all uploads coincide.
    """
    yy = _as_uploads(y)
    ps = np.asarray(psi, dtype=np.float64)
    if ps.shape != yy.shape:
        raise ValueError(f"psi must have the shape of y {yy.shape}, got shape {ps.shape}")
    p = _check_weights(weights, yy.shape[0])
    obs = _observed(yy, mask)
    y0 = np.asarray(yy, dtype=np.float64) if obs is None else np.where(obs, yy, 0.0)
    mf = np.ones(yy.shape) if obs is None else obs.astype(np.float64)
    cnt = p @ mf
    mu = np.divide(p @ y0, cnt, out=np.zeros_like(cnt), where=cnt > 0)
    return _shrink_centred(ps - mu[None, :], y0 - mu[None, :], None if obs is None else ~obs)


# ---------------------------------------------------------------------------------------
# public objective and solvers
# ---------------------------------------------------------------------------------------


def jgesr_objective(
    psi: ArrayLike,
    graph: ArrayLike,
    y: ArrayLike,
    mask: ArrayLike | None = None,
    weights: ArrayLike | None = None,
    params: JGESRParams | None = None,
    scale: float = 1.0,
) -> float:
    """``F(Ψ/s, w)`` of §8.3 evaluated directly on ``n x d`` arrays (float64; for checks).

    ``F = Σ_k p_k ‖m_k⊙(ψ_k − y_k)‖²/s² + λ wᵀz(Ψ/s) − α1ᵀlog(Sw) + β‖w‖²`` with ``p``
    normalised to mean 1; ``+inf`` if a degree of ``graph`` is not positive.
    """
    prm = params if params is not None else JGESRParams()
    yy = _as_uploads(y)
    n, d = yy.shape
    ps = np.asarray(psi, dtype=np.float64)
    if ps.shape != (n, d):
        raise ValueError(f"psi must have the shape of y {yy.shape}, got shape {ps.shape}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale!r}")
    w = _check_graph(graph, n, "graph")
    p = _check_weights(weights, n)
    obs = _observed(yy, mask)
    resid = np.where(obs, ps - yy, 0.0) if obs is not None else ps - yy
    fid = float(np.sum(p * np.sum(resid * resid, axis=1))) / scale**2
    if n == 1:
        return fid
    deg = w.sum(axis=1)
    if np.any(deg <= 0):
        return math.inf
    z = pairwise_sq_dists(ps) / scale**2
    return _graph_terms(fid, z, w, deg, _Problem(p, prm.lam, prm.alpha, prm.beta))


Solver = Callable[[FloatArray, FloatArray, FloatArray, _Problem, JGESRParams, float], _Run]


@dataclass
class _Outcome:
    psi_c: AnyFloatArray
    w: FloatArray
    trace: list[float]
    iterations: int
    converged: bool
    impute_steps: int


def _validate(
    y: ArrayLike, mask: ArrayLike | None, weights: ArrayLike | None, psi_init: ArrayLike | None
) -> tuple[AnyFloatArray, BoolArray | None, FloatArray, AnyFloatArray | None]:
    yy = _as_uploads(y)
    p = _check_weights(weights, yy.shape[0])
    obs = _observed(yy, mask)
    if psi_init is None:
        return yy, obs, p, None
    pin = _as_uploads(psi_init, "psi_init")
    if pin.shape != yy.shape:
        raise ValueError(f"psi_init must have the shape of y {yy.shape}, got shape {pin.shape}")
    if not np.all(np.isfinite(pin)):
        raise ValueError("psi_init must be finite")
    return yy, obs, p, pin


def _solve(
    method: str,
    y: ArrayLike,
    mask: ArrayLike | None,
    weights: ArrayLike | None,
    params: JGESRParams | None,
    graph_init: ArrayLike | None,
    psi_init: ArrayLike | None,
) -> JGESRResult:
    with _one_blas_thread():
        return _solve_body(method, y, mask, weights, params, graph_init, psi_init)


def _solve_body(
    method: str,
    y: ArrayLike,
    mask: ArrayLike | None,
    weights: ArrayLike | None,
    params: JGESRParams | None,
    graph_init: ArrayLike | None,
    psi_init: ArrayLike | None,
) -> JGESRResult:
    prm = params if params is not None else JGESRParams()
    yy, obs, p, pin = _validate(y, mask, weights, psi_init)
    n, d = yy.shape
    if n == 1:
        return _single_client(yy, obs, pin)
    w0: FloatArray | None = None
    if graph_init is not None:
        w0 = _check_graph(graph_init, n)
        if np.any(w0.sum(axis=1) <= 0) or not prm.fixed_scale:
            w0 += COS_FLOOR * (1.0 - np.eye(n))
    elif obs is not None:
        w0 = _cosine_observed(yy, obs, COS_FLOOR)
    prep = _prepare(yy, obs, p, w0, pin, _work_dtype(yy, prm.work_dtype))
    if w0 is None:
        w0 = _cosine_from_centred(prep.gram, prep.xmu, prep.mumu)
    total = graph_total(n) if prm.fixed_scale else None
    if total is not None:
        w0 = w0 * (total / (0.5 * float(w0.sum())))  # positive rescaling onto Σw = total
    s = _scale(yy, obs, prep.mu, prep.gram) if prm.scale else 1.0
    logger.debug("JGESR %s: n=%d d=%d scale=%.6g masked=%s", method, n, d, s, obs is not None)
    prob = _Problem(p, prm.lam, prm.alpha, prm.beta, prm.dc_scale, total)
    solver: Solver = _pdca_dense if method == "pdca" else _two_step_dense
    res = _mm_loop(solver, prep, pin, w0, s, prob, prm)
    shrink = _shrink_centred(res.psi_c, prep.x, prep.missing)
    psi = _uncentre(res.psi_c, prep.mu, yy.dtype)
    logger.debug(
        "JGESR %s: %d iterations, %d MM steps, converged=%s, F %.6g -> %.6g",
        method,
        res.iterations,
        res.impute_steps,
        res.converged,
        res.trace[0],
        res.trace[-1],
    )
    return JGESRResult(
        psi=psi,
        graph=res.w,
        objective=np.asarray(res.trace),
        iterations=res.iterations,
        converged=res.converged,
        scale=s,
        impute_steps=res.impute_steps,
        shrink_ratio=shrink,
        graph_cv=graph_cv(res.w),
    )


def _mm_loop(
    solver: Solver,
    prep: _Prepared,
    pin: AnyFloatArray | None,
    w: FloatArray,
    s: float,
    prob: _Problem,
    prm: JGESRParams,
) -> _Outcome:
    """Reduced solves in the basis ``[X̃^t (; Ψ̃^t)]`` with re-imputation between them.

    Without missing entries this is a single solve (basis ``X̃``, or ``[X̃; Ψ̃_init]``).
    """
    n, d = prep.x.shape
    arrays: list[AnyFloatArray] = [prep.x]
    gram = prep.gram
    if pin is not None:
        psi_c = np.empty((n, d), dtype=prep.x.dtype)
        for sl in _blocks(d):
            psi_c[:, sl] = pin[:, sl] - prep.mu[sl][None, :]
        arrays.append(psi_c)
        gram = _gram(arrays)
    out = _Outcome(np.empty((n, d), dtype=prep.x.dtype), w, [], 0, False, 0)
    step = 1.0
    for mm in range(1, prm.max_impute + 1):
        basis = _basis_from_gram(gram / s**2)
        target = basis.coords[:n]
        phi0 = basis.coords[n:] if len(arrays) == 2 else target
        run = solver(target, phi0.copy(), out.w, prob, prm, step)
        out.trace.extend(run.trace if not out.trace else run.trace[1:])
        out.iterations += run.iterations
        out.impute_steps = mm
        step, out.w = run.step, run.w
        coef = run.phi @ basis.back
        decrease = run.trace[0] - run.trace[-1]
        mm_done = prep.missing is None or decrease <= prm.impute_tol * _magnitude(run.phi, target, run.w, prob)
        out.converged = run.converged and mm_done
        if mm_done or mm == prm.max_impute:
            _combine(coef, arrays, out.psi_c)
            break
        _combine(coef, arrays, out.psi_c, prep.missing)
        if len(arrays) == 1:
            arrays.append(out.psi_c)
            out.psi_c = np.empty((n, d), dtype=prep.x.dtype)
        else:
            arrays[1], out.psi_c = out.psi_c, arrays[1]
        gram = _gram(arrays)
    return out


@contextlib.contextmanager
def _one_blas_thread() -> Iterator[None]:
    """Run a whole solve on one BLAS thread (item 12 of the module docstring)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - scikit-learn's dependency, normally present
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def _uncentre(psi_c: AnyFloatArray, mu: FloatArray, dtype: np.dtype[Any]) -> AnyFloatArray:
    """``Ψ = Ψ̃ + μ`` (in place when the dtypes agree)."""
    out = psi_c if psi_c.dtype == dtype else np.empty(psi_c.shape, dtype=dtype)
    for sl in _blocks(psi_c.shape[1]):
        np.add(psi_c[:, sl], mu[sl].astype(psi_c.dtype)[None, :], out=out[:, sl], casting="unsafe")
    return out


def _single_client(y: AnyFloatArray, obs: BoolArray | None, pin: AnyFloatArray | None) -> JGESRResult:
    """``n = 1`` (§8.8): return the upload, missing entries from ``psi_init`` (else 0)."""
    psi = np.array(y, copy=True)
    if obs is not None:
        fill = pin if pin is not None else np.zeros_like(psi)
        psi = np.where(obs, psi, fill).astype(y.dtype)
    return JGESRResult(
        psi=psi,
        graph=np.zeros((1, 1)),
        objective=np.zeros(1),
        iterations=0,
        converged=True,
        scale=1.0,
        impute_steps=0,
        shrink_ratio=1.0,
        graph_cv=math.nan,
    )


def solve_pdca(
    y: ArrayLike,
    mask: ArrayLike | None = None,
    weights: ArrayLike | None = None,
    params: JGESRParams | None = None,
    *,
    graph_init: ArrayLike | None = None,
    psi_init: ArrayLike | None = None,
) -> JGESRResult:
    """JGESR aggregation by PDCA (ALGORITHMS.md §8.5; module docstring for every choice).

    Parameters
    ----------
    y
        ``n x d`` uploads ``y_k = m_k ⊙ θ_k + n_k`` (NaN/Inf = missing).
    mask
        Optional ``n x d`` 0/1 mask of received entries.
    weights
        Optional positive client weights (data sizes); normalised to mean 1.
    params
        :class:`JGESRParams` (defaults of §8.5).
    graph_init
        Warm start for ``W`` (e.g. the previous round's ``result.graph``); default: cosine.
    psi_init
        Warm start for ``Ψ`` (e.g. the previous round's ``result.psi``); also fills entries
        that are missing.

    Returns
    -------
    JGESRResult
        ``Ψ``, ``W`` and diagnostics; ``objective`` is non-increasing.
    """
    return _solve("pdca", y, mask, weights, params, graph_init, psi_init)


def solve_two_step(
    y: ArrayLike,
    mask: ArrayLike | None = None,
    weights: ArrayLike | None = None,
    params: JGESRParams | None = None,
    *,
    graph_init: ArrayLike | None = None,
    psi_init: ArrayLike | None = None,
) -> JGESRResult:
    """JGESR's "Two-step" baseline: alternating w-step / Ψ-step (ALGORITHMS.md §8.6).

    Same arguments and result as :func:`solve_pdca`; ``params.max_outer`` is ``J_alt``.
    """
    return _solve("two-step", y, mask, weights, params, graph_init, psi_init)
