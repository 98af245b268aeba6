"""JGESR math: cosine graph, Kalofolias w-step, PDCA / Two-step solvers (ALGORITHMS.md §8)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest

from graphfl.strategies import jgesr_math as jm

try:  # scikit-learn's dependency; only to keep these tiny problems off BLAS threads
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover
    threadpool_limits = None

S2 = 1.0 / math.sqrt(2.0)
FLOOR = jm.COS_FLOOR


def _planted(n_per: int = 5, d: int = 200, sigma: float = 0.8, miss: float = 0.3, seed: int = 0):
    """Two groups of clients with different true models; noisy uploads, ``miss`` lost entries."""
    rng = np.random.default_rng(seed)
    truth = np.repeat(rng.standard_normal((2, d)), n_per, axis=0)
    y = truth + sigma * rng.standard_normal(truth.shape)
    mask = rng.random(truth.shape) >= miss
    return truth, y, mask


@pytest.fixture(autouse=True, scope="module")
def _single_blas_thread() -> Iterator[None]:
    """The n x n algebra here is tiny: BLAS threads only contend (2-3x slower when loaded)."""
    if threadpool_limits is None:
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def _non_increasing(trace: np.ndarray, rtol: float = 1e-10) -> bool:
    slack = rtol * np.maximum(np.abs(trace[:-1]), 1.0)
    return bool(np.all(np.diff(trace) <= slack))


# ---------------------------------------------------------------------------------------
# hand-computed pieces
# ---------------------------------------------------------------------------------------


def test_cosine_graph_by_hand():
    y = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    w = jm.cosine_graph(y)
    expected = np.array([[0.0, S2, 0.0], [S2, 0.0, S2], [0.0, S2, 0.0]]) + FLOOR * (1 - np.eye(3))
    np.testing.assert_allclose(w, expected, rtol=0, atol=1e-15)
    # a negative cosine is clipped to 0 (+ floor)
    np.testing.assert_allclose(jm.cosine_graph(np.array([[1.0, 0.0], [-2.0, 0.0]])), [[0, FLOOR], [FLOOR, 0]])


def test_cosine_graph_uses_commonly_observed_entries_and_nan():
    y = np.array([[1.0, 2.0], [1.0, -5.0], [3.0, 4.0]])
    mask = np.array([[1, 1], [1, 0], [1, 1]])
    # (0,1) and (1,2) share column 0 only -> cos = 1; (0,2): (3 + 8) / (sqrt(5) * 5)
    c02 = 11.0 / (math.sqrt(5.0) * 5.0)
    expected = np.array([[0.0, 1.0, c02], [1.0, 0.0, 1.0], [c02, 1.0, 0.0]]) + FLOOR * (1 - np.eye(3))
    np.testing.assert_allclose(jm.cosine_graph(y, mask), expected, atol=1e-14)
    y_nan = y.copy()
    y_nan[1, 1] = np.nan
    np.testing.assert_allclose(jm.cosine_graph(y_nan), expected, atol=1e-14)
    # the unmasked cosine would differ: the mask really matters
    assert abs(jm.cosine_graph(y)[0, 1] - 1.0) > 0.1


def test_pairwise_sq_dists_and_laplacian_by_hand():
    x = np.array([[0.0, 0.0], [3.0, 4.0], [1e6, 1e6 + 1.0]])
    z = jm.pairwise_sq_dists(x)
    direct = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    np.testing.assert_allclose(z, direct, rtol=1e-12)
    assert z[0, 1] == pytest.approx(25.0, rel=1e-12)
    w = np.array([[0.0, 2.0, 0.0], [2.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    np.testing.assert_array_equal(jm.laplacian(w), [[2, -2, 0], [-2, 3, -1], [0, -1, 1]])
    # tr(Ψᵀ L Ψ) = Σ_{i<j} W_ij ‖ψ_i − ψ_j‖²
    psi = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    assert np.trace(psi.T @ jm.laplacian(w) @ psi) == pytest.approx(2 * 5.0 + 1 * 2.0)


def test_kalofolias_solution_satisfies_kkt():
    rng = np.random.default_rng(3)
    pts = np.concatenate([rng.normal(0, 0.3, (4, 3)), rng.normal(3, 0.3, (4, 3))])
    z = jm.pairwise_sq_dists(pts)
    alpha, beta = 1.0, 0.5
    w = jm.kalofolias_graph(z, alpha, beta, max_iter=20000, tol=1e-10)
    assert np.allclose(w, w.T) and np.all(w >= 0) and np.all(np.diag(w) == 0)
    deg = w.sum(axis=1)
    # vector form 2wᵀz − α1ᵀlog(Sw) + β‖w‖²: gradient 2z + 2βw − α(1/d_i + 1/d_j)
    grad = 2 * z + 2 * beta * w - alpha * (1 / deg[:, None] + 1 / deg[None, :])
    iu = np.triu_indices(8, 1)
    active = w[iu] > 1e-8
    np.testing.assert_allclose(grad[iu][active], 0.0, atol=1e-6)
    assert np.all(grad[iu][~active] >= -1e-6)
    # the two groups are disconnected (up to the FBF's last forward step)
    assert np.all(w[:4, 4:] < 1e-9)
    assert np.all(deg > 0.5)


# ---------------------------------------------------------------------------------------
# PDCA
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pdca_objective_non_increasing_on_random_problems(seed):
    rng = np.random.default_rng(seed)
    y = rng.standard_normal((7, 12)) * rng.uniform(0.5, 2.0, size=(7, 1))
    weights = rng.uniform(1, 5, size=7)
    res = jm.solve_pdca(y, weights=weights)
    assert res.objective.size == res.iterations + 1
    assert _non_increasing(res.objective)
    assert res.objective[-1] < res.objective[0]
    # the trace is F of §8.3 on the returned (Ψ, W), evaluated directly on n x d arrays
    direct = jm.jgesr_objective(res.psi, res.graph, y, weights=weights, scale=res.scale)
    assert direct == pytest.approx(res.objective[-1], rel=1e-9, abs=1e-9)
    g = res.graph
    assert np.allclose(g, g.T) and np.all(g >= 0) and np.all(np.diag(g) == 0)


def test_pdca_reduced_solve_equals_dense_solve():
    """The n x q reformulation (module docstring, item 3) reproduces the full-space PDCA."""
    rng = np.random.default_rng(7)
    y = rng.standard_normal((6, 40))
    prm = jm.JGESRParams(max_outer=200)
    res = jm.solve_pdca(y, params=prm)
    mu = y.mean(axis=0)
    prob = jm._Problem(np.ones(6), prm.lam, prm.alpha, prm.beta, total=jm.graph_total(6))
    yc = (y - mu) / res.scale
    w0 = jm.cosine_graph(y)
    w0 *= jm.graph_total(6) / (0.5 * w0.sum())  # the initial graph rescaled onto Σw = n
    dense = jm._pdca_dense(yc, yc.copy(), w0, prob, prm)
    np.testing.assert_allclose(dense.trace, res.objective, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dense.phi * res.scale + mu, res.psi, atol=1e-9)
    np.testing.assert_allclose(dense.w, res.graph, atol=1e-10)


def test_planted_two_clusters_recovered_and_restored(record_property):
    truth, y, mask = _planted()
    y_in, mask_in = y.copy(), mask.copy()
    res = jm.solve_pdca(y, mask)
    np.testing.assert_array_equal(y, y_in)  # inputs untouched
    np.testing.assert_array_equal(mask, mask_in)
    assert _non_increasing(res.objective)
    group = np.arange(10) // 5
    same = (group[:, None] == group[None, :]) & ~np.eye(10, dtype=bool)
    within = res.graph[same].mean()
    across = res.graph[group[:, None] != group[None, :]].mean()
    assert within > 20 * across + 0.1, (within, across)
    # every client's strongest neighbour is in its own group
    assert np.all(group[np.argmax(res.graph, axis=1)] == group)
    raw = float(np.mean((y[mask] - truth[mask]) ** 2))
    restored = float(np.mean((res.psi - truth) ** 2))  # all entries, missing ones included
    ratio = restored / raw
    record_property("mse_ratio_restored_over_raw", ratio)
    assert ratio < 0.5, ratio  # measured 0.33 (PDCA), ALGORITHMS.md §8.5 reports 0.23/0.64


def test_pdca_objective_non_increasing_with_masks_and_nan():
    truth, y, mask = _planted(n_per=4, d=60, seed=5)
    y = y.copy()
    y[2, :7] = np.nan  # NaN uploads count as missing
    y[:, 11] = np.nan  # an entry nobody observed
    res = jm.solve_pdca(y, mask)
    assert np.all(np.isfinite(res.psi))
    assert _non_increasing(res.objective)
    assert res.impute_steps >= 2
    # with masks the trace is an upper bound that touches F at each MM step's start
    direct = jm.jgesr_objective(res.psi, res.graph, y, mask, scale=res.scale)
    assert direct <= res.objective[-1] + 1e-9 * abs(res.objective[-1])


def test_mask_and_nan_are_equivalent():
    _, y, mask = _planted(n_per=3, d=40, seed=2)
    y_nan = np.where(mask, y, np.nan)
    a = jm.solve_pdca(y, mask)
    b = jm.solve_pdca(y_nan)
    c = jm.solve_pdca(np.where(mask, y, 123.0), mask.astype(int))  # garbage under the mask
    for other in (b, c):
        np.testing.assert_allclose(other.psi, a.psi, rtol=0, atol=1e-12)
        np.testing.assert_allclose(other.graph, a.graph, rtol=0, atol=1e-12)
    # observed entries still matter: changing one changes the result
    y2 = y.copy()
    i, j = np.argwhere(mask)[0]
    y2[i, j] += 5.0
    assert not np.allclose(jm.solve_pdca(y2, mask).psi, a.psi)


@pytest.mark.parametrize("miss", [0.0, 0.3])
def test_warm_start_same_objective_fewer_iterations(miss):
    _, y, mask = _planted(n_per=4, d=80, miss=miss, seed=4)
    m = mask if miss else None
    cold = jm.solve_pdca(y, m)
    assert cold.converged
    warm = jm.solve_pdca(y, m, graph_init=cold.graph, psi_init=cold.psi)
    # unmasked: 0 iterations (already stationary); masked: re-imputing with the final Ψ gives
    # a new MM surrogate, a few iterations away (measured 83 -> 0 and 202 -> 31)
    assert warm.iterations <= cold.iterations // 5
    assert warm.objective[-1] <= cold.objective[-1] + 1e-9 * abs(cold.objective[-1])
    # the MM loop stops on a decrease <= impute_tol x (sum of |terms| of F), larger than |F|
    assert warm.objective[-1] == pytest.approx(cold.objective[-1], rel=1e-3 if miss else 1e-4)
    # next round: slightly different uploads, the previous solution is a good start
    y_next = y + 0.05 * np.random.default_rng(9).standard_normal(y.shape)
    cold_next = jm.solve_pdca(y_next, m)
    warm_next = jm.solve_pdca(y_next, m, graph_init=cold.graph, psi_init=cold.psi)
    assert warm_next.iterations <= cold_next.iterations // 4  # measured 84 -> 18, 202 -> 33
    assert warm_next.objective[-1] == pytest.approx(cold_next.objective[-1], rel=1e-3 if miss else 1e-4)


def test_pdca_monotone_for_other_dc_scale_and_inner_steps():
    _, y, mask = _planted(n_per=3, d=30, seed=8)
    for prm in (jm.JGESRParams(dc_scale=3.0), jm.JGESRParams(max_inner=5, max_outer=100)):
        assert _non_increasing(jm.solve_pdca(y, mask, params=prm).objective)


# ---------------------------------------------------------------------------------------
# Two-step
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("miss", [0.0, 0.3])
def test_two_step_objective_non_increasing(miss):
    truth, y, mask = _planted(n_per=4, d=80, miss=miss, seed=6)
    res = jm.solve_two_step(y, mask if miss else None)
    assert _non_increasing(res.objective)
    assert res.objective[-1] < res.objective[0]
    assert res.converged
    assert np.mean((res.psi - truth) ** 2) < np.mean((np.where(mask, y, 0) - truth)[mask] ** 2)


def test_two_step_psi_step_is_the_laplacian_filter():
    """Without masks the Ψ-step is ``(P + λL)^{-1} P Y`` for the final graph (§8.1 eq. 6)."""
    rng = np.random.default_rng(11)
    y = rng.standard_normal((5, 9))
    prm = jm.JGESRParams(scale=False, lam=0.7)
    res = jm.solve_two_step(y, params=prm)
    expected = np.linalg.solve(np.eye(5) + 0.7 * jm.laplacian(res.graph), y)
    np.testing.assert_allclose(res.psi, expected, atol=1e-9)


# ---------------------------------------------------------------------------------------
# edge cases and validation
# ---------------------------------------------------------------------------------------


def test_single_client_and_identical_uploads():
    y = np.array([[1.0, np.nan, 3.0]])
    res = jm.solve_pdca(y, psi_init=np.array([[0.0, 7.0, 0.0]]))
    np.testing.assert_array_equal(res.psi, [[1.0, 7.0, 3.0]])
    assert res.graph.shape == (1, 1) and res.iterations == 0
    same = np.tile(np.arange(4.0), (3, 1))
    res = jm.solve_pdca(same)
    assert res.scale == 1.0
    np.testing.assert_allclose(res.psi, same, atol=1e-12)
    assert np.all(res.graph[~np.eye(3, dtype=bool)] > 0)


def test_float32_uploads_keep_dtype_and_match_float64():
    _, y, mask = _planted(n_per=3, d=50, seed=1)
    r64 = jm.solve_pdca(y, mask)
    r32 = jm.solve_pdca(y.astype(np.float32), mask, params=jm.JGESRParams(work_dtype="float32"))
    assert r32.psi.dtype == np.float32
    np.testing.assert_allclose(r32.psi, r64.psi, atol=2e-3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mask": np.ones((3, 5))}, r"mask must have the shape of y \(4, 6\)"),
        ({"weights": np.array([1.0, -1.0, 1.0, 1.0])}, "weights must be finite and > 0"),
        ({"weights": np.ones(3)}, r"weights must have shape \(4,\)"),
        ({"graph_init": np.triu(np.ones((4, 4)), 1)}, "graph_init must be symmetric"),
        ({"psi_init": np.ones((4, 5))}, r"psi_init must have the shape of y"),
    ],
)
def test_invalid_arguments_raise(kwargs, message):
    y = np.random.default_rng(0).standard_normal((4, 6))
    with pytest.raises(ValueError, match=message):
        jm.solve_pdca(y, **kwargs)


def test_invalid_params_and_uploads_raise():
    with pytest.raises(ValueError, match="JGESRParams.beta"):
        jm.JGESRParams(beta=0.0)
    with pytest.raises(ValueError, match="JGESRParams.max_inner"):
        jm.JGESRParams(max_inner=0)
    with pytest.raises(ValueError, match=r"y must be a 2-D .* got shape \(5,\)"):
        jm.solve_two_step(np.ones(5))
