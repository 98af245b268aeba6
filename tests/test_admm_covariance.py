"""The edge test's covariance (ALGORITHMS §0.1 C3, §6.9; seed 001 eq. 2): the σ̂²-scaled Hessian
form by default, the sandwich with the HC3 correction, the plain sandwich; checked against
direct formulas, and on the paper's simulation (§6.12) for the share of true edges kept.
"""

from __future__ import annotations

import numpy as np
import pytest

from graphfl.bench.admm import simulate
from graphfl.common.config import ConfigError
from graphfl.p2p.algorithms import admm_math as am
from graphfl.p2p.algorithms.admm import COVARIANCES, selected_edges
from graphfl.p2p.config import parse_p2p_config
from graphfl.p2p.oracles import TabularOracle

LS = am.LeastSquaresLoss()
LOGIT = am.LogisticLoss()


def tiny_ls(seed: int = 0, n: int = 9, p: int = 3, noise: float = 1.0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, p))
    eps = rng.normal(size=n)
    return x, x @ np.array([1.0, -2.0, 0.5][:p]) + noise * eps, eps


def tiny_logit(seed: int = 1, n: int = 40):
    rng = np.random.default_rng(seed)
    x = np.column_stack([np.ones(n), rng.normal(size=(n, 2))])
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-x @ np.array([0.3, 1.0, -0.7])))).astype(float)
    return x, y


# ------------------------------------------------------------------------------------- formulas


def test_hessian_form_is_sigma2_times_the_inverse_gram_matrix_for_least_squares():
    x, y, _ = tiny_ls()
    n, p = x.shape
    st = am.local_statistics(LS, x, y)  # the default
    beta = np.linalg.lstsq(x, y, rcond=None)[0]
    rss = float(np.sum((y - x @ beta) ** 2))
    np.testing.assert_allclose(st.theta, beta, rtol=1e-9)
    np.testing.assert_allclose(st.cov, rss / (n - p) * np.linalg.inv(x.T @ x), rtol=1e-9)
    assert LS.dispersion(beta, x, y, n - p) == pytest.approx(rss / (n - p), rel=1e-12)


def test_hessian_form_scales_with_the_noise_variance():
    """y = Xθ + c·ε: the residuals scale by c, so σ̂² and the covariance by c² (the unscaled Ĥ⁻¹ would not move)."""
    x, _, eps = tiny_ls(seed=3, n=12)
    truth = np.array([1.0, -2.0, 0.5])
    one = am.local_statistics(LS, x, x @ truth + eps)
    three = am.local_statistics(LS, x, x @ truth + 3.0 * eps)
    np.testing.assert_allclose(three.cov, 9.0 * one.cov, rtol=1e-9)
    unscaled = np.linalg.inv(x.T @ x)
    assert not np.allclose(one.cov, unscaled, rtol=0.05)


def test_hessian_form_for_logistic_is_the_inverse_fisher_information():
    x, y = tiny_logit()
    st = am.local_statistics(LOGIT, x, y)
    z = x @ st.theta
    w = 1.0 / (1.0 + np.exp(-z)) / (1.0 + np.exp(z))
    np.testing.assert_allclose(st.cov, np.linalg.inv(x.T @ (w[:, None] * x)), rtol=1e-8)


def test_hc3_and_plain_sandwich_match_the_direct_formulas_for_least_squares():
    x, y, _ = tiny_ls(seed=5, n=8)
    n, _ = x.shape
    beta = np.linalg.solve(x.T @ x, x.T @ y)
    r = y - x @ beta
    g_inv = np.linalg.inv(x.T @ x)
    lev = np.array([x[k] @ g_inv @ x[k] for k in range(n)])   # diag of the hat matrix, one by one
    meat3 = sum((r[k] / (1 - lev[k])) ** 2 * np.outer(x[k], x[k]) for k in range(n))
    meat0 = sum(r[k] ** 2 * np.outer(x[k], x[k]) for k in range(n))
    np.testing.assert_allclose(am.local_statistics(LS, x, y, covariance="sandwich-hc3").cov, g_inv @ meat3 @ g_inv,
                               rtol=1e-9)
    np.testing.assert_allclose(am.local_statistics(LS, x, y, covariance="sandwich").cov, g_inv @ meat0 @ g_inv,
                               rtol=1e-9)
    np.testing.assert_allclose(np.sum(lev), x.shape[1], rtol=1e-12)  # trace of the hat matrix = p


def test_hc3_for_logistic_uses_the_working_weight_leverages():
    x, y = tiny_logit(n=30)
    st = am.local_statistics(LOGIT, x, y, covariance="sandwich-hc3")
    mu = 1.0 / (1.0 + np.exp(-x @ st.theta))
    w = mu * (1 - mu)
    info_inv = np.linalg.inv(x.T @ (w[:, None] * x))
    lev = np.array([w[k] * x[k] @ info_inv @ x[k] for k in range(len(y))])
    meat = sum(((mu[k] - y[k]) / (1 - lev[k])) ** 2 * np.outer(x[k], x[k]) for k in range(len(y)))
    np.testing.assert_allclose(st.cov, info_inv @ meat @ info_inv, rtol=1e-7)


def test_covariance_names_are_checked_and_hc3_needs_curvatures():
    x, y, _ = tiny_ls()
    with pytest.raises(ValueError, match=r"one of \['hessian', 'sandwich-hc3', 'sandwich'\].*'hc3'"):
        am.local_statistics(LS, x, y, covariance="hc3")  # type: ignore[arg-type]

    class Bare:  # an MLoss with only the four required methods
        value, grad, hessian, scores = LS.value, LS.grad, LS.hessian, LS.scores

    with pytest.raises(ValueError, match="Bare has no sample_curvatures"):
        am.local_statistics(Bare(), x, y, covariance="sandwich-hc3")
    # without a dispersion method a loss is a unit-dispersion likelihood: Ω̂ = Ĥ⁻¹ (seed 001 eq. 2)
    np.testing.assert_allclose(am.local_statistics(Bare(), x, y).cov, np.linalg.inv(x.T @ x), rtol=1e-9)
    assert COVARIANCES == am.COVARIANCES  # the p2p key's choices are the core's
    with pytest.raises(ConfigError, match=r"es-covariance = 'hc3' is not valid; choose one of .*sandwich-hc3"):
        parse_p2p_config({"algorithm": "admm", "es-covariance": "hc3"})
    assert parse_p2p_config({"algorithm": "admm"}).params.es_covariance == "hessian"


def test_underdetermined_fit_floors_the_residual_degrees_of_freedom():
    x, y, _ = tiny_ls(n=2)  # n < p: ridge, p_eff ≈ n, the fit interpolates
    st = am.local_statistics(LS, x, y)
    assert st.ridge > 0 and np.all(np.isfinite(st.cov))


# ------------------------------------------------------------------- the paper's simulation


def _share_of_true_edges_kept(covariance: str, tested: str, v: int = 40, n: int = 50, flip: float = 0.5,
                              seeds: tuple[int, ...] = (0, 1, 2)) -> tuple[float, float]:
    """(true edges kept / true edges tested, false edges kept / false edges tested) over ``seeds``."""
    kept_true = n_true = kept_false = n_false = 0
    for seed in seeds:
        sim = simulate(v, n, flip, seed)
        st = [am.local_statistics(LS, x, y, covariance=covariance) for x, y in sim.data]  # type: ignore[arg-type]
        edges = sim.graph_edges if tested == "given" else am.complete_graph_edges(v)
        kept = set(am.select_edges(st, edges, alpha=0.05).kept)
        for i, j in edges:
            if sim.clusters[i] == sim.clusters[j]:
                n_true += 1
                kept_true += (i, j) in kept
            else:
                n_false += 1
                kept_false += (i, j) in kept
    return kept_true / n_true, kept_false / n_false


@pytest.mark.parametrize("tested", ["given", "complete"])
def test_default_covariance_keeps_95_percent_of_true_edges_on_the_paper_simulation(tested):
    """§6.12 at V = 40, n = 50, p = 20, ϱ = 0.5, α = 0.05, 3 seeds: FedADMM-ES (the given graph's
    edges) and Local-ES (every pair). The default and HC3 keep ≥ 95 % of the true edges and drop
    ≥ 95 % of the false ones; the plain sandwich drops far more true edges than α allows."""
    for covariance in ("hessian", "sandwich-hc3"):
        kept, false_kept = _share_of_true_edges_kept(covariance, tested)
        assert kept >= 0.95, (covariance, kept)
        assert false_kept <= 0.05, (covariance, false_kept)
    kept, _ = _share_of_true_edges_kept("sandwich", tested)
    assert kept < 0.8, kept


def test_p2p_default_keeps_the_true_edges_the_sandwich_dropped():
    """``graphfl p2p --algorithm admm --set edge-selection=complete`` on the paper's simulation
    (V = 20: 30 true edges per draw): the default key keeps ≥ 95 % of them; es-covariance = sandwich does not."""
    kept = {"default": 0, "sandwich": 0}
    total = 0
    for seed in (0, 1, 2):
        sim = simulate(20, 50, 0.0, seed)
        nodes = [TabularOracle(u, "sim", x, y, x[:0], y[:0], seed=seed, batch_size=10) for u, (x, y) in enumerate(sim.data)]
        total += len(sim.true_edges)
        for name, extra in (("default", {}), ("sandwich", {"es-covariance": "sandwich"})):
            params = parse_p2p_config({"algorithm": "admm", "edge-selection": "complete", **extra}).params
            edges, _ = selected_edges(params, nodes, [])
            kept[name] += sum(1 for i, j in edges if sim.clusters[i] == sim.clusters[j])
    assert kept["default"] >= 0.95 * total
    assert kept["sandwich"] < 0.8 * total
