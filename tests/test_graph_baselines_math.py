"""CFL, FedAMP and pFedGraph server math: hand-computed small cases (ALGORITHMS.md §10)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from graphfl.strategies import graph_baselines_math as gb

# ---------------------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------------------


def test_cosine_similarity_and_distances_by_hand():
    x = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, -2.0], [0.0, 0.0]])
    sim = gb.cosine_similarity_matrix(x)
    s2 = 1 / math.sqrt(2)
    np.testing.assert_allclose(sim[:3, :3], [[1, s2, 0], [s2, 1, -s2], [0, -s2, 1]], atol=1e-11)
    np.testing.assert_array_equal(sim[3], 0.0)  # zero row: similarity 0
    z = gb.pairwise_sq_dists(x)
    np.testing.assert_allclose(z[:3, :3], [[0, 1, 5], [1, 0, 10], [5, 10, 0]], atol=1e-12)


def test_mix_by_hand_and_dtype():
    models = np.array([[1.0, 2.0], [3.0, 6.0]], dtype=np.float32)
    out = gb.mix(np.array([[0.25, 0.75], [1.0, 0.0]]), models)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [[2.5, 5.0], [1.0, 2.0]])
    with pytest.raises(ValueError, match=r"weights must have shape \(m, 2\)"):
        gb.mix(np.ones((2, 3)), models)
    with pytest.raises(ValueError, match=r"models has non-finite entries in rows \[1\]"):
        gb.mix(np.eye(2), np.array([[0.0, 1.0], [np.nan, 1.0]]))


# ---------------------------------------------------------------------------------------
# CFL
# ---------------------------------------------------------------------------------------

# two groups of opposite updates: the mean update vanishes, every update has norm 5
OPPOSITE = np.array([[3.0, 4.0], [3.0, 4.0], [-3.0, -4.0], [-3.0, -4.0]])


def test_cfl_split_criterion_by_hand():
    mean_norm, max_norm, split = gb.cfl_split_criterion(OPPOSITE, eps1=0.4, eps2=1.6)
    assert (mean_norm, max_norm, split) == (pytest.approx(0.0), pytest.approx(5.0), True)
    # weights (3,1,1,1)/6: mean = (3+1-1-1)/6 (3,4) = (1, 4/3), norm 5/3 > eps1: no split
    mean_norm, max_norm, split = gb.cfl_split_criterion(OPPOSITE, [3, 1, 1, 1], eps1=0.4, eps2=1.6)
    assert mean_norm == pytest.approx(5 / 3) and not split
    # mean (0.5, 0.5): norm 0.7071 < 1; max norm 1 is not > eps2 = 1.6: no split
    mean_norm, max_norm, split = gb.cfl_split_criterion(np.eye(2), eps1=1.0, eps2=1.6)
    assert mean_norm == pytest.approx(math.sqrt(0.5)) and max_norm == pytest.approx(1.0) and not split
    assert gb.cfl_split_criterion(np.eye(2), eps1=1.0, eps2=0.9)[2]


def test_bipartition_by_hand_both_linkages():
    # chain 0 - 1 - 2 - 3 with a weak link 1-2
    s = np.array(
        [
            [1.0, 0.9, 0.1, -0.5],
            [0.9, 1.0, 0.3, 0.1],
            [0.1, 0.3, 1.0, 0.8],
            [-0.5, 0.1, 0.8, 1.0],
        ]
    )
    for linkage in ("complete", "single"):
        a, b = gb.bipartition(s, linkage)
        assert a.tolist() == [0, 1] and b.tolist() == [2, 3]
    # complete and single linkage differ: single chains 0-1-2 (0.9, 0.85), complete keeps
    # 2 with 3 because 2 is dissimilar to 0
    s = np.array(
        [
            [1.0, 0.9, 0.0, 0.0],
            [0.9, 1.0, 0.85, 0.0],
            [0.0, 0.85, 1.0, 0.8],
            [0.0, 0.0, 0.8, 1.0],
        ]
    )
    assert [g.tolist() for g in gb.bipartition(s, "single")] == [[0, 1, 2], [3]]
    assert [g.tolist() for g in gb.bipartition(s, "complete")] == [[0, 1], [2, 3]]


def test_single_linkage_is_the_optimal_bipartition():
    """CFL's optimal split minimises the largest cross-cluster similarity (brute force, m = 6)."""
    rng = np.random.default_rng(0)
    for _ in range(5):
        u = rng.standard_normal((6, 4))
        s = gb.cosine_similarity_matrix(u)
        a, b = gb.bipartition(s, "single")
        got = s[np.ix_(a, b)].max()
        best = min(
            s[np.ix_(list(c), [j for j in range(6) if j not in c])].max()
            for k in range(1, 6)
            for c in itertools.combinations(range(6), k)
        )
        assert got == pytest.approx(best)


def test_cfl_step_splits_then_averages_per_cluster():
    state = gb.CFLState.initial(4)
    res = gb.cfl_step(OPPOSITE, state, params=gb.CFLParams(warmup_rounds=0))
    assert res.state.clusters == ((0, 1), (2, 3)) and res.state.round == 1
    assert res.checks[0].split and res.checks[0].parts == ((0, 1), (2, 3))
    np.testing.assert_allclose(res.updates, OPPOSITE)  # each cluster's mean update
    np.testing.assert_array_equal(res.state.assignment(), [0, 0, 1, 1])
    # next round: clusters of two are never split (min_cluster_size 3); weighted averages
    upd = np.array([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, 4.0]])
    res2 = gb.cfl_step(upd, res.state, weights=[1, 3, 1, 1], params=gb.CFLParams(warmup_rounds=0))
    assert res2.state.clusters == ((0, 1), (2, 3)) and res2.state.round == 2
    np.testing.assert_allclose(res2.updates, [[2.5, 0.0], [2.5, 0.0], [0.0, 3.0], [0.0, 3.0]])


def test_cfl_no_split_during_warmup():
    res = gb.cfl_step(OPPOSITE, gb.CFLState.initial(4))  # default warm-up: 20 rounds
    assert res.state.clusters == ((0, 1, 2, 3),)
    assert not res.checks[0].split
    np.testing.assert_allclose(res.updates, 0.0, atol=1e-15)  # FedAvg of opposite updates
    later = gb.cfl_step(OPPOSITE, gb.CFLState(((0, 1, 2, 3),), round=20))
    assert later.state.clusters == ((0, 1), (2, 3))


def test_cfl_rejects_bad_state_and_params():
    with pytest.raises(ValueError, match="state.clusters must partition 0..3"):
        gb.cfl_step(OPPOSITE, gb.CFLState(((0, 1), (1, 2, 3))))
    with pytest.raises(ValueError, match="CFLParams.linkage"):
        gb.CFLParams(linkage="average")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# FedAMP
# ---------------------------------------------------------------------------------------


def test_fedamp_weights_by_hand():
    w = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])  # ‖·‖²: d01 = 1, d02 = 4, d12 = 5
    xi = gb.fedamp_weights(w, alpha_k=0.5, sigma=1.0)
    e = math.exp
    expected = np.array(
        [
            [1 - 0.5 * (e(-1) + e(-4)), 0.5 * e(-1), 0.5 * e(-4)],
            [0.5 * e(-1), 1 - 0.5 * (e(-1) + e(-5)), 0.5 * e(-5)],
            [0.5 * e(-4), 0.5 * e(-5), 1 - 0.5 * (e(-4) + e(-5))],
        ]
    )
    np.testing.assert_allclose(xi, expected, rtol=1e-12)
    np.testing.assert_allclose(xi.sum(axis=1), 1.0)
    # σ rescales both the distance and A' = exp(−x/σ)/σ
    xi2 = gb.fedamp_weights(w, alpha_k=0.5, sigma=2.0)
    assert xi2[0, 1] == pytest.approx(0.5 * e(-0.5) / 2)
    u = gb.fedamp_aggregate(w, xi)
    np.testing.assert_allclose(u[0], [0.5 * e(-1), 2 * 0.5 * e(-4)], rtol=1e-12)


def test_fedamp_negative_self_weight_is_reported(caplog):
    with caplog.at_level("WARNING"):
        xi = gb.fedamp_weights(np.zeros((3, 2)), alpha_k=1.0, sigma=1.0)
    assert xi[0, 0] == pytest.approx(-1.0)  # 1 − 2·exp(0)
    assert "decrease alpha_k" in caplog.text


def test_fedamp_heuristic_weights_by_hand():
    v = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # cos: 1 between 0 and 1, 0 with 2
    xi = gb.fedamp_heuristic_weights(v, self_weight=0.3, scale=10.0)
    e10 = math.exp(10.0)
    np.testing.assert_allclose(xi[0], [0.3, 0.7 * e10 / (e10 + 1), 0.7 / (e10 + 1)], rtol=1e-9)  # cos has +1e-12
    np.testing.assert_allclose(xi[2], [0.35, 0.35, 0.3], rtol=1e-12)  # equal cosines 0, 0
    np.testing.assert_allclose(xi.sum(axis=1), 1.0)
    np.testing.assert_array_equal(gb.fedamp_heuristic_weights(v[:1]), [[1.0]])


# ---------------------------------------------------------------------------------------
# pFedGraph
# ---------------------------------------------------------------------------------------


def test_project_simplex_by_hand():
    # sorted (1.125, 0.5): τ = (1.625 − 1)/2 = 0.3125
    np.testing.assert_allclose(gb.project_simplex([1.125, 0.5]), [0.8125, 0.1875])
    np.testing.assert_allclose(gb.project_simplex([1.375, 0.25]), [1.0, 0.0])  # τ = 0.375
    np.testing.assert_allclose(gb.project_simplex([0.2, 0.3, 0.5]), [0.2, 0.3, 0.5])
    np.testing.assert_allclose(gb.project_simplex([0.0, 0.0]), [0.5, 0.5])


def test_project_simplex_solves_the_qp():
    """Against the KKT conditions of min ‖x − v‖² over the simplex."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        v = rng.normal(size=7) * 2
        x = gb.project_simplex(v)
        assert x.sum() == pytest.approx(1.0) and np.all(x >= 0)
        g = x - v  # gradient/2; KKT: g_i = −τ on the support, >= −τ off it
        tau = -g[x > 0].mean()
        np.testing.assert_allclose(g[x > 0], -tau, atol=1e-12)
        assert np.all(g[x == 0] >= -tau - 1e-12)


def test_pfedgraph_graph_by_hand():
    v = np.array([[1.0, 0.0], [0.0, 1.0]])  # cos = I (the diagonal counts, clipped to 1)
    a = gb.pfedgraph_graph(v, alpha=0.8)  # rows Proj(p + cos_i / 1.6), p = (.5, .5)
    np.testing.assert_allclose(a, [[0.8125, 0.1875], [0.1875, 0.8125]])
    a = gb.pfedgraph_graph(v, sizes=[300, 100], alpha=0.8)  # p = (.75, .25)
    np.testing.assert_allclose(a, [[1.0, 0.0], [0.4375, 0.5625]])
    # cosine 0.95 > 0.9 is treated as 1 (official code), 0.85 is not
    v = np.array([[1.0, 0.0], [0.95, math.sqrt(1 - 0.95**2)], [0.85, math.sqrt(1 - 0.85**2)]])
    a = gb.pfedgraph_graph(v[:2], alpha=0.8)
    np.testing.assert_allclose(a, 0.5)
    a = gb.pfedgraph_graph(v[[0, 2]], alpha=0.8, clip_above=None)
    np.testing.assert_allclose(a[0], gb.project_simplex([0.5 + 1 / 1.6, 0.5 + 0.85 / 1.6]))


def test_pfedgraph_rows_match_the_official_qp_objective():
    """Each row minimises α‖a‖² + (d − 2αp)ᵀa, d = −cos, over the simplex (random trials)."""
    rng = np.random.default_rng(2)
    v = rng.standard_normal((5, 8))
    sizes = rng.uniform(10, 100, size=5)
    alpha = 0.8
    a = gb.pfedgraph_graph(v, sizes, alpha)
    p = sizes / sizes.sum()
    sim = gb.cosine_similarity_matrix(v)
    sim = np.where(sim > 0.9, 1.0, sim)
    for i in range(5):
        q = -sim[i] - 2 * alpha * p

        def obj(x, q=q):
            return alpha * x @ x + q @ x

        best = obj(a[i])
        for _ in range(200):
            trial = rng.dirichlet(np.ones(5))
            assert obj(trial) >= best - 1e-12
    np.testing.assert_allclose(a.sum(axis=1), 1.0, atol=1e-12)


def test_pfedgraph_aggregate_by_hand():
    models = np.array([[3.0, 4.0], [0.0, 2.0]])
    graph = np.array([[0.5, 0.5], [0.25, 0.75]])
    personalised, targets = gb.pfedgraph_aggregate(models, graph)
    np.testing.assert_allclose(personalised, [[1.5, 3.0], [0.75, 2.5]])
    # c_i = Σ_j a_ij θ_j / ‖θ_j‖ with ‖θ_0‖ = 5, ‖θ_1‖ = 2
    np.testing.assert_allclose(targets, [[0.3, 0.4 + 0.5], [0.15, 0.2 + 0.75]])
    with pytest.raises(ValueError, match=r"graph must have shape \(2, 2\)"):
        gb.pfedgraph_aggregate(models, np.ones((3, 3)))
