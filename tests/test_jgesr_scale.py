"""JGESR's graph scale (ALGORITHMS.md §0.1 C4): the learned graph no longer collapses to consensus.

With §8.3's free scale the objective's minimum is consensus: on clustered clients whose uploads
are dominated by a common component and noise (as trained models are), the learned graph is
uniform (CV ≈ 0.01) and ψ_k = ȳ + 0.08(y_k − ȳ), i.e. FedAvg. With Σ_{i<j} w_ij = n enforced in
the graph step the graph keeps the clusters and the restored models keep their differences.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import numpy as np
import pytest

from graphfl.common.config import RunConfig
from graphfl.common.core import ServerContext
from graphfl.common.types import ClientUpdate
from graphfl.strategies import jgesr as js
from graphfl.strategies import jgesr_math as jm

try:  # scikit-learn's dependency; only to keep these tiny problems off BLAS threads
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover
    threadpool_limits = None

K, PER, D = 3, 4, 2000
N = K * PER
GROUP = np.arange(N) // PER
SAME = (GROUP[:, None] == GROUP[None, :]) & ~np.eye(N, dtype=bool)
ACROSS = GROUP[:, None] != GROUP[None, :]


@pytest.fixture(autouse=True, scope="module")
def _single_blas_thread() -> Iterator[None]:
    if threadpool_limits is None:
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def _clustered(sep: float = 0.5, sigma: float = 1.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """3 planted groups of 4 clients: a large common component, small group offsets, noise.

    Squared distances: within a group ≈ 2dσ², across ≈ 2dσ² + 2d·sep² — the clusters are
    there, but every pair is at a comparable distance (as for trained models under noise).
    """
    rng = np.random.default_rng(seed)
    common = 3.0 * rng.standard_normal(D)
    truth = np.repeat(common + sep * rng.standard_normal((K, D)), PER, axis=0)
    return truth, truth + sigma * rng.standard_normal(truth.shape)


def _non_increasing(trace: np.ndarray, rtol: float = 1e-10) -> bool:
    slack = rtol * np.maximum(np.abs(trace[:-1]), 1.0)
    return bool(np.all(np.diff(trace) <= slack))


def _on_scale(graph: np.ndarray, n: int) -> None:
    iu = np.triu_indices(n, 1)
    assert np.all(graph >= 0) and np.array_equal(graph, graph.T) and np.all(np.diag(graph) == 0)
    assert abs(float(graph[iu].sum()) - n) <= 1e-9


# ---------------------------------------------------------------------------------------
# the defect and its fix on clustered clients
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("solve", [jm.solve_pdca, jm.solve_two_step], ids=["pdca", "two-step"])
@pytest.mark.parametrize("seed", [0, 1])
def test_clustered_clients_give_a_clustered_graph_not_consensus(solve, seed):
    truth, y = _clustered(seed=seed)
    res = solve(y)
    assert res.graph_cv >= 0.2, res.graph_cv                     # not uniform (was 0.004)
    assert res.graph[SAME].mean() > 3 * res.graph[ACROSS].mean()
    assert np.all(GROUP[np.argmax(res.graph, axis=1)] == GROUP)  # strongest neighbour in the group
    assert res.shrink_ratio >= 0.4, res.shrink_ratio             # far from collapse (was 0.08)
    assert res.graph_cv == pytest.approx(jm.graph_cv(res.graph), rel=1e-12)
    assert res.shrink_ratio == pytest.approx(jm.shrink_ratio(res.psi, y), rel=1e-9)
    # the restoration helps: closer to the true models than the uploads (measured 0.30 vs 0.99;
    # FedAvg's mean is at 0.25 here: beating it needs a larger λ, chosen on validation in B7)
    assert float(np.mean((res.psi - truth) ** 2)) < 0.5 * float(np.mean((y - truth) ** 2))


def test_free_scale_of_section_8_3_collapses_to_fedavg():
    """The defect C4 names, kept reproducible: without the scale the graph is uniform."""
    _, y = _clustered()
    res = jm.solve_pdca(y, params=jm.JGESRParams(fixed_scale=False))
    assert res.graph_cv < 0.05 and res.shrink_ratio < 0.2, (res.graph_cv, res.shrink_ratio)
    fixed = jm.solve_pdca(y)
    assert fixed.shrink_ratio > 4 * res.shrink_ratio


def test_consensus_is_not_the_minimum():
    """F at the solution is below F at consensus with its best feasible graph (the uniform one)."""
    _, y = _clustered()
    res = jm.solve_pdca(y)
    consensus = np.tile(y.mean(axis=0), (N, 1))
    uniform = np.full((N, N), 2.0 / (N - 1))
    np.fill_diagonal(uniform, 0.0)
    assert abs(uniform[np.triu_indices(N, 1)].sum() - N) < 1e-9      # Σ_{i<j} w = n, mean degree 2
    f_cons = jm.jgesr_objective(consensus, uniform, y, scale=res.scale)
    assert res.objective[-1] < f_cons - 1.0, (res.objective[-1], f_cons)


# ---------------------------------------------------------------------------------------
# the graph step: feasibility, monotone objective, KKT
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("solve", [jm.solve_pdca, jm.solve_two_step], ids=["pdca", "two-step"])
@pytest.mark.parametrize("miss", [0.0, 0.3])
def test_solvers_keep_the_scale_and_decrease_the_objective(solve, miss):
    truth, y = _clustered(seed=3)
    y = y[:, :300]
    mask = np.random.default_rng(4).random(y.shape) >= miss if miss else None
    res = solve(y, mask)
    _on_scale(res.graph, N)
    assert _non_increasing(res.objective)
    assert res.objective[-1] < res.objective[0]
    # warm start from a graph that is not on the scale: rescaled onto it, still monotone
    warm = solve(y, mask, graph_init=3.0 * res.graph, psi_init=res.psi)
    _on_scale(warm.graph, N)
    assert _non_increasing(warm.objective)


def test_pdca_stationary_point_satisfies_kkt_on_the_scaled_simplex():
    """At convergence ∇_Ψ F = 0 and ∇_w F = −ν on the support, >= −ν off it (one multiplier ν)."""
    _, y = _clustered(seed=5)
    y = y[:, :200]
    prm = jm.JGESRParams(tol=1e-7, max_outer=20000)
    res = jm.solve_pdca(y, params=prm)
    assert res.converged
    s = res.scale
    psi, w = res.psi / s, res.graph
    yy = y / s
    deg = w.sum(axis=1)
    g_psi = 2 * (psi - yy) + 2 * prm.lam * jm.laplacian(w) @ psi
    z = jm.pairwise_sq_dists(psi)
    g_w = prm.lam * z + 2 * prm.beta * w - prm.alpha * (1 / deg[:, None] + 1 / deg[None, :])
    iu = np.triu_indices(N, 1)
    gw, wv = g_w[iu], w[iu]
    support = wv > 1e-6
    nu = -float(np.mean(gw[support]))
    assert np.max(np.abs(g_psi)) < 1e-5 * max(1.0, np.max(np.abs(yy)))
    np.testing.assert_allclose(gw[support], -nu, atol=1e-5)
    assert np.all(gw[~support] >= -nu - 1e-5)


def test_kalofolias_w_step_on_the_scale_satisfies_kkt():
    rng = np.random.default_rng(3)
    pts = np.concatenate([rng.normal(0, 0.3, (4, 3)), rng.normal(1, 0.3, (4, 3))])
    z = jm.pairwise_sq_dists(pts)
    alpha, beta, total = 0.5, 0.2, 8.0
    w = jm.kalofolias_graph(z, alpha, beta, max_iter=50000, tol=1e-12, total=total)
    _on_scale(w, 8)
    deg = w.sum(axis=1)
    grad = 2 * z + 2 * beta * w - alpha * (1 / deg[:, None] + 1 / deg[None, :])
    iu = np.triu_indices(8, 1)
    g, wv = grad[iu], w[iu]
    support = wv > 1e-8
    nu = -float(np.mean(g[support]))
    np.testing.assert_allclose(g[support], -nu, atol=1e-6)
    assert np.all(g[~support] >= -nu - 1e-6)
    # scaling z by a constant offset does not change the graph (the sum is fixed)
    w_off = jm.kalofolias_graph(z + 5.0 * (1 - np.eye(8)), alpha, beta, max_iter=50000, tol=1e-12, total=total)
    np.testing.assert_allclose(w_off, w, atol=1e-6)


def test_projection_onto_the_scaled_simplex_by_hand():
    np.testing.assert_allclose(jm.project_scaled_simplex(np.array([0.5, 0.2, -1.0]), 1.0), [0.65, 0.35, 0.0])
    np.testing.assert_allclose(jm.project_scaled_simplex(np.array([3.0, 0.0, 0.0]), 2.0), [2.0, 0.0, 0.0])
    np.testing.assert_allclose(jm.project_scaled_simplex(np.zeros(4), 2.0), [0.5] * 4)
    rng = np.random.default_rng(0)
    for _ in range(20):
        v = rng.normal(size=30) * 10
        x = jm.project_scaled_simplex(v, 7.0)
        assert np.all(x >= 0) and abs(x.sum() - 7.0) <= 1e-12 * 7
        # optimality: <v − x, u − x> <= 0 for every vertex u = 7 e_j of the simplex
        assert np.all(7.0 * (v - x) - (v - x) @ x <= 1e-9)
    with pytest.raises(ValueError, match="total"):
        jm.project_scaled_simplex(np.ones(3), 0.0)


def test_graph_cv_and_shrink_ratio_by_hand():
    uniform = np.ones((4, 4)) - np.eye(4)
    assert jm.graph_cv(uniform) == 0.0
    one = np.zeros((3, 3))
    one[0, 1] = one[1, 0] = 1.0
    assert jm.graph_cv(one) == pytest.approx(math.sqrt(2.0))   # weights (1, 0, 0): sd √2/3, mean 1/3
    assert math.isnan(jm.graph_cv(np.zeros((1, 1))))
    rng = np.random.default_rng(1)
    y = rng.normal(size=(5, 7))
    ybar = y.mean(axis=0)
    for rho in (0.0, 0.3, 1.0):
        assert jm.shrink_ratio(ybar + rho * (y - ybar), y) == pytest.approx(rho, abs=1e-12)
    # weighted mean and received entries only
    w = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    mask = rng.random(y.shape) > 0.3
    mask[:, 0] = True
    yw = (w[:, None] * mask * y).sum(0) / (w[:, None] * mask).sum(0)
    psi = yw + 0.5 * (np.where(mask, y, 99.0) - yw)
    assert jm.shrink_ratio(psi, np.where(mask, y, np.nan), weights=w) == pytest.approx(0.5, rel=1e-12)


# ---------------------------------------------------------------------------------------
# the strategy: per-round diagnostics, collapse warning, run.png panels
# ---------------------------------------------------------------------------------------


def _core(**params) -> js.JGESRCore:
    cfg = js.JGESRConfig(**params)
    ctx = ServerContext(config=RunConfig(strategy="jgesr", params=cfg), params=cfg, num_clients=N,
                        initial_arrays={"w": np.zeros(D, dtype=np.float32)}, param_keys=("w",),
                        num_examples={i: 100 for i in range(N)})
    return js.JGESRCore(ctx)


def _updates(seed: int) -> dict[int, ClientUpdate]:
    _, y = _clustered(seed=seed)
    return {pid: ClientUpdate(pid, {"w": y[pid].astype(np.float32)}, 100) for pid in range(N)}


def test_core_logs_shrink_ratio_and_graph_cv_and_no_collapse(caplog):
    core = _core()
    with caplog.at_level(logging.WARNING, logger="graphfl.strategies.jgesr"):
        for r in range(1, 4):
            m = core.aggregate_train(r, _updates(r))
            assert m["graph_cv"] >= 0.2 and m["shrink_ratio"] >= 0.4 and m["collapse"] == 0
            assert m["graph_cv"] == pytest.approx(jm.graph_cv(np.asarray(m["graph"])), rel=1e-4)
    assert not [r for r in caplog.records if "collapsed" in r.getMessage()]


def test_core_warns_when_jgesr_collapses_to_fedavg(caplog):
    core = _core(fixed_scale=False)
    with caplog.at_level(logging.WARNING, logger="graphfl.strategies.jgesr"):
        rounds = [core.aggregate_train(r, _updates(r)) for r in range(1, 4)]
    assert all(m["shrink_ratio"] < 0.2 for m in rounds)
    assert [m["collapse"] for m in rounds] == [1, 1, 1]
    messages = [r.getMessage() for r in caplog.records if "collapsed" in r.getMessage()]
    assert len(messages) == 3 and "shrink_ratio" in messages[0] and "graph_cv" not in messages[0]
    assert "graph_cv" in messages[2] and "3 rounds" in messages[2]          # uniform for 3 rounds


def test_run_plot_draws_the_diagnostics(tmp_path, monkeypatch):
    from graphfl.common import results

    curve = [{"round": 0, "test_loss": 1.0}] + [
        {"round": r, "test_loss": 1.0 / (r + 1), "server": {"shrink_ratio": 0.5 + 0.1 * r, "graph_cv": 0.3 * r}}
        for r in (1, 2)]
    other = [{"round": r, "test_loss": 1.0} for r in range(3)]
    seen = []
    real = results.plot_panels
    monkeypatch.setattr(results, "plot_panels", lambda path, panels, title="": seen.extend(panels) or real(path, panels))
    doc = {"name": "run", "methods": {"jgesr": {"curve": curve}, "fedavg": {"curve": other}}}
    assert results.plot_curves(doc, tmp_path / "run.png")
    by_y = {p.get("y"): p for p in seen}
    assert list(by_y["shrink_ratio"]["series"]) == ["jgesr"]                 # only methods that log it
    assert [pt["shrink_ratio"] for pt in by_y["shrink_ratio"]["series"]["jgesr"]] == [0.6, 0.7]
    assert [pt["graph_cv"] for pt in by_y["graph_cv"]["series"]["jgesr"]] == pytest.approx([0.3, 0.6])
    assert (tmp_path / "run.png").stat().st_size > 0
