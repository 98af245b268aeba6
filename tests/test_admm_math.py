"""FedADMM pure math (p2p/algorithms/admm_math.py, ALGORITHMS.md §6): losses, prox, node/edge/dual steps,
edge selection, inaccessible devices, λ by cross-validation, and the all-nodes reference loop."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats

from graphfl.p2p.algorithms import admm_math as am

LS = am.LeastSquaresLoss()
LOGIT = am.LogisticLoss()


def linreg_data(rng, thetas, n, sigma=1.0):
    out = []
    for th in thetas:
        x = rng.normal(size=(n, len(th)))
        out.append((x, x @ th + sigma * rng.normal(size=n)))
    return out


def logit_data(rng, thetas, n):
    out = []
    for th in thetas:
        x = rng.normal(size=(n, len(th)))
        out.append((x, (rng.random(n) < 1.0 / (1.0 + np.exp(-x @ th))).astype(float)))
    return out


def ring(n):
    return [(i, (i + 1) % n) for i in range(n)]


CONST = am.StepSchedule(0.5, rule="constant")


# ----------------------------------------------------------------------------------- losses


@pytest.mark.parametrize("loss", [LS, LOGIT], ids=["least-squares", "logistic"])
def test_gradient_and_hessian_match_finite_differences(loss):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4))
    y = (rng.random(40) < 0.5).astype(float)
    theta = rng.normal(size=4)
    h = 1e-6
    eye = np.eye(4)
    fd_grad = np.array([(loss.value(theta + h * e, x, y) - loss.value(theta - h * e, x, y)) / (2 * h) for e in eye])
    fd_hess = np.stack([(loss.grad(theta + h * e, x, y) - loss.grad(theta - h * e, x, y)) / (2 * h) for e in eye])
    np.testing.assert_allclose(loss.grad(theta, x, y), fd_grad, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(loss.hessian(theta, x, y), fd_hess, rtol=1e-6, atol=1e-8)
    # per-sample scores average to the gradient
    np.testing.assert_allclose(loss.scores(theta, x, y).mean(axis=0), loss.grad(theta, x, y), atol=1e-14)


def test_logistic_is_stable_for_huge_margins():
    x = np.array([[1.0], [1.0], [-1.0]])
    y = np.array([0.0, 1.0, 1.0])
    theta = np.array([800.0])  # z = ±800: exp overflows in a naive implementation
    # m = log(1+e^z) − y z: z=800,y=0 -> 800; z=800,y=1 -> ~0; z=−800,y=1 -> 800
    assert LOGIT.value(theta, x, y) == pytest.approx(1600.0 / 3)
    np.testing.assert_allclose(LOGIT.grad(theta, x, y), [(1.0 + 0.0 + 1.0) / 3])
    h = LOGIT.hessian(theta, x, y)
    assert np.all(np.isfinite(h)) and 0.0 <= h[0, 0] < 1e-300
    with pytest.raises(ValueError, match="labels y in"):
        LOGIT.value(theta, x, np.array([0.0, 2.0, 1.0]))


def test_shape_errors_name_the_argument():
    x = np.zeros((5, 3))
    with pytest.raises(ValueError, match=r"theta must have length 3, got shape \(2,\)"):
        LS.grad(np.zeros(2), x, np.zeros(5))
    with pytest.raises(ValueError, match=r"y must have shape \(5,\)"):
        LS.grad(np.zeros(3), x, np.zeros(4))
    with pytest.raises(ValueError, match="rho must be finite and > 0"):
        am.node_step(np.zeros(2), np.zeros(2), [], rho=0.0, eta=0.1)
    with pytest.raises(ValueError, match=r"halves\[0\].beta must have length 2"):
        am.node_step(np.zeros(2), np.zeros(2), [am.EdgeState(np.zeros(3), np.zeros(3))], rho=1.0, eta=0.1)
    with pytest.raises(ValueError, match="phi must be one of"):
        am.prox_norm(np.zeros(2), 1.0, "linf")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="self loop"):
        am.canonical_edges([(1, 1)], 3)
    with pytest.raises(ValueError, match="outside"):
        am.canonical_edges([(0, 3)], 3)


# ----------------------------------------------------------------------------------- prox


def _numeric_prox_l1(v, tau):
    # smooth split x = u − w, u, w >= 0: min τ Σ(u+w) + ½‖u − w − v‖²  (a bound-constrained QP, SLSQP)
    p = v.size

    def f(z):
        u, w = z[:p], z[p:]
        r = u - w - v
        return tau * z.sum() + 0.5 * r @ r, np.concatenate([tau + r, tau - r])

    z0 = np.concatenate([np.maximum(v, 0), np.maximum(-v, 0)]) + 0.1
    res = optimize.minimize(f, z0, jac=True, method="SLSQP", bounds=[(0, None)] * (2 * p),
                            options={"ftol": 1e-15, "maxiter": 1000})
    return res.x[:p] - res.x[p:]


def _numeric_prox_l2(v, tau):
    # epigraph: min τ s + ½‖x − v‖²  s.t.  s² ≥ ‖x‖², s ≥ 0  (SLSQP)
    p = v.size
    res = optimize.minimize(
        lambda z: tau * z[-1] + 0.5 * np.sum((z[:-1] - v) ** 2),
        np.concatenate([0.5 * v, [np.linalg.norm(v)]]),
        jac=lambda z: np.concatenate([z[:-1] - v, [tau]]),
        method="SLSQP", bounds=[(None, None)] * p + [(0, None)],
        constraints=[{"type": "ineq", "fun": lambda z: z[-1] ** 2 - z[:-1] @ z[:-1],
                      "jac": lambda z: np.concatenate([-2 * z[:-1], [2 * z[-1]]])}],
        options={"ftol": 1e-15, "maxiter": 500})
    return res.x[:-1]


@pytest.mark.parametrize("phi", ["l1", "l2"])
def test_prox_closed_form_equals_numerical_minimiser(phi):
    numeric = _numeric_prox_l1 if phi == "l1" else _numeric_prox_l2
    norm = (lambda x: np.abs(x).sum()) if phi == "l1" else np.linalg.norm
    hits_zero = 0
    for seed in range(4):
        v = np.random.default_rng(seed).normal(scale=2.0, size=5)
        for tau in (0.0, 0.3, 1.5, 4.0, 20.0):
            closed = am.prox_norm(v, tau, phi)
            num = numeric(v, tau)
            np.testing.assert_allclose(closed, num, atol=1e-5)
            assert tau * norm(closed) + 0.5 * np.sum((closed - v) ** 2) <= tau * norm(num) + 0.5 * np.sum((num - v) ** 2) + 1e-10
            hits_zero += not np.any(closed)
    assert hits_zero >= 4  # τ = 20 thresholds everything to 0 (the e = 0 branch is exercised)
    assert not np.any(am.group_soft_threshold(np.zeros(3), 1.0))  # ‖e‖ = 0: δ = 0, no division


def test_prox_hand_computed():
    np.testing.assert_array_equal(am.soft_threshold(np.array([3.0, -0.5, -2.0]), 1.0), [2.0, 0.0, -1.0])
    # ‖(3, 4)‖ = 5, τ = 2: (1 − 2/5)(3, 4) = (1.8, 2.4)
    np.testing.assert_allclose(am.group_soft_threshold(np.array([3.0, 4.0]), 2.0), [1.8, 2.4])


def _numeric_eq15(a, b, lam, rho, phi):
    """Numerical (β_ij, β_ji) for eq. 15 with variables (β_ji, δ), β_ij = β_ji + δ."""
    p = a.size
    if phi == "l1":
        def f(z):  # z = (β_ji, u, w), δ = u − w, u, w ≥ 0
            bj, u, w = z[:p], z[p:2 * p], z[2 * p:]
            ri, rj = a - bj - u + w, b - bj
            val = lam * (u.sum() + w.sum()) + 0.5 * rho * (ri @ ri + rj @ rj)
            return val, np.concatenate([-rho * (ri + rj), lam - rho * ri, lam + rho * ri])

        res = optimize.minimize(f, np.zeros(3 * p) + 0.1, jac=True, method="SLSQP",
                                bounds=[(None, None)] * p + [(0, None)] * (2 * p),
                                options={"ftol": 1e-15, "maxiter": 1000})
        bj, d = res.x[:p], res.x[p:2 * p] - res.x[2 * p:]
        return bj + d, bj

    def g(z):  # z = (β_ji, δ, s), s² ≥ ‖δ‖², s ≥ 0
        bj, d, s = z[:p], z[p:2 * p], z[-1]
        ri, rj = a - bj - d, b - bj
        val = lam * s + 0.5 * rho * (ri @ ri + rj @ rj)
        return val, np.concatenate([-rho * (ri + rj), -rho * ri, [lam]])

    def cons(z):
        return z[-1] ** 2 - z[p:2 * p] @ z[p:2 * p]

    def cons_jac(z):
        return np.concatenate([np.zeros(p), -2 * z[p:2 * p], [2 * z[-1]]])

    res = optimize.minimize(g, np.concatenate([b, a - b, [np.linalg.norm(a - b)]]), jac=True, method="SLSQP",
                            bounds=[(None, None)] * (2 * p) + [(0, None)],
                            constraints=[{"type": "ineq", "fun": cons, "jac": cons_jac}],
                            options={"ftol": 1e-15, "maxiter": 1000})
    bj, d = res.x[:p], res.x[p:2 * p]
    return bj + d, bj


@pytest.mark.parametrize("phi", ["l1", "l2"])
def test_beta_step_minimises_eq15_numerically(phi):
    """(β_ij, β_ji) = argmin λφ(β_ij − β_ji) + (ρ/2)(‖a − β_ij‖² + ‖b − β_ji‖²) (eq. 15, §6.5)."""
    for seed, (lam, rho) in enumerate([(0.2, 1.0), (1.0, 0.5), (0.05, 2.0), (3.0, 1.0)]):
        rng = np.random.default_rng(10 + seed)
        ti, tj, aij, aji = (rng.normal(size=3) for _ in range(4))
        a, b = ti - aij / rho, tj - aji / rho
        bij, bji = am.beta_step(ti, tj, aij, aji, lam=lam, rho=rho, phi=phi)
        nij, nji = _numeric_eq15(a, b, lam, rho, phi)
        np.testing.assert_allclose(bij, nij, atol=1e-5)
        np.testing.assert_allclose(bji, nji, atol=1e-5)

        def obj(bi, bj, lam=lam, rho=rho, a=a, b=b):
            pen = np.abs(bi - bj).sum() if phi == "l1" else np.linalg.norm(bi - bj)
            return lam * pen + 0.5 * rho * (np.sum((a - bi) ** 2) + np.sum((b - bj) ** 2))

        assert obj(bij, bji) <= obj(nij, nji) + 1e-10


# ----------------------------------------------------------------------------------- steps


def test_node_step_hand_computed():
    # θ=1, g=2, ρ=2, η=0.1, halves (β, α) = (0.5, 0.25), (2, −1):
    # Σ_j ρ(θ − β_ij) − α_ij = 2·0.5 − 0.25 + 2·(−1) + 1 = −0.25;  θ' = 1 − 0.1 (2 − 0.25) = 0.825
    halves = [am.EdgeState(np.array([0.5]), np.array([0.25])), am.EdgeState(np.array([2.0]), np.array([-1.0]))]
    out = am.node_step(np.array([1.0]), np.array([2.0]), halves, rho=2.0, eta=0.1)
    assert out[0] == pytest.approx(0.825, abs=1e-15)
    # isolated node: plain gradient step
    assert am.node_step(np.array([1.0]), np.array([2.0]), [], rho=2.0, eta=0.1)[0] == pytest.approx(0.8)


def test_edge_step_hand_computed_l1():
    # θ_i=3, θ_j=0, α=0, ρ=1, λ=0.5: a=3, b=0, e=3, s=1.5, δ = 3 − 2λ/ρ = 2
    # β_ij = 2.5, β_ji = 0.5; α_ij = 0 − (3 − 2.5) = −0.5, α_ji = 0 − (0 − 0.5) = 0.5
    z = am.EdgeState(np.zeros(1), np.zeros(1))
    hij, hji = am.edge_step(np.array([3.0]), np.array([0.0]), z, z.copy(), lam=0.5, rho=1.0, phi="l1")
    assert (hij.beta[0], hji.beta[0], hij.alpha[0], hji.alpha[0]) == (2.5, 0.5, -0.5, 0.5)
    # λ = 0: β_ij = a, α = 0; λ huge: β_ij = β_ji = (a + b)/2
    hij, hji = am.edge_step(np.array([3.0]), np.array([0.0]), z, z.copy(), lam=0.0, rho=1.0, phi="l1")
    assert (hij.beta[0], hji.beta[0], hij.alpha[0], hji.alpha[0]) == (3.0, 0.0, 0.0, 0.0)
    hij, hji = am.edge_step(np.array([3.0]), np.array([0.0]), z, z.copy(), lam=1e6, rho=1.0, phi="l1")
    assert (hij.beta[0], hji.beta[0]) == (1.5, 1.5)


@pytest.mark.parametrize("phi", ["l1", "l2"])
def test_edge_step_dual_invariants(phi):
    """After every edge step α_ij = −λ s, s ∈ ∂φ(β_ij − β_ji): α_ij + α_ji = 0 and φ*(α_ij) ≤ λ."""
    rng = np.random.default_rng(3)
    lam, rho = 0.4, 1.3
    hij = am.EdgeState(rng.normal(size=4), rng.normal(size=4))
    hji = am.EdgeState(rng.normal(size=4), -hij.alpha)
    for _ in range(50):
        hij, hji = am.edge_step(rng.normal(size=4), rng.normal(size=4), hij, hji, lam=lam, rho=rho, phi=phi)
        np.testing.assert_allclose(hij.alpha + hji.alpha, 0.0, atol=1e-12)
        assert am.dual_norm(hij.alpha, phi) <= lam * (1 + 1e-12)
        d = hij.beta - hji.beta
        if phi == "l1":
            nz = np.abs(d) > 1e-12
            np.testing.assert_allclose(hij.alpha[nz], -lam * np.sign(d[nz]), atol=1e-12)
        elif np.linalg.norm(d) > 1e-12:
            np.testing.assert_allclose(hij.alpha, -lam * d / np.linalg.norm(d), atol=1e-12)


def test_owner_message_lets_the_other_endpoint_recompute_its_dual():
    """j can rebuild α_ji(t+1) from the received β_ji(t+1) and its own θ_j(t+1) (§6.6 redundancy)."""
    rng = np.random.default_rng(4)
    ti, tj = rng.normal(size=3), rng.normal(size=3)
    hij = am.init_edge_state(rng.normal(size=3))
    hji = am.init_edge_state(rng.normal(size=3))
    new_ij, new_ji = am.edge_step(ti, tj, hij, hji, lam=0.3, rho=0.7, phi="l2")
    np.testing.assert_allclose(am.dual_step(hji.alpha, tj, new_ji.beta, rho=0.7), new_ji.alpha, atol=0)
    assert am.owner_of(2, 5) == am.owner_of(5, 2) == 5
    assert am.canonical_edges([(0, 1), (2, 1), (1, 0)], 3) == [(1, 0), (2, 1)]
    assert am.complete_graph_edges(3) == [(1, 0), (2, 0), (2, 1)]
    adj = np.zeros((3, 3))
    adj[0, 2] = adj[2, 0] = 0.5
    assert am.edges_from_adjacency(adj) == [(2, 0)]


def test_step_schedule_hand_computed_and_linearized_prox():
    s = am.StepSchedule(c=2.0, t0=3.0)
    # η̃(1) = 2/(1+3) = 0.5; η = 0.5 / (1 + 1·2·0.5) = 0.25
    assert s.base(1) == 0.5 and s.eta(1, degree=2, rho=1.0) == 0.25
    assert am.StepSchedule(0.1, rule="constant").eta(100, 0, 1.0) == 0.1
    # η_i is the exact minimiser step of gᵀθ + (ρ/2)Σ‖θ − β + α/ρ‖² + ‖θ − θ(t)‖²/(2η̃)
    rng = np.random.default_rng(5)
    th, g = rng.normal(size=2), rng.normal(size=2)
    halves = [am.EdgeState(rng.normal(size=2), rng.normal(size=2)) for _ in range(3)]
    rho, base = 0.8, s.base(4)
    lhs = (1 / base + rho * 3) * np.eye(2)
    rhs = th / base - g + sum(rho * h.beta + h.alpha for h in halves)
    np.testing.assert_allclose(am.node_step(th, g, halves, rho=rho, eta=s.eta(4, 3, rho)),
                               np.linalg.solve(lhs, rhs), atol=1e-13)
    sched = am.default_step_schedule([np.diag([0.5, 2.0]), np.diag([1.0, 4.0])])
    assert (sched.c, sched.t0) == (4.0, 16.0)  # κ̂ = max(2, 1/0.5, 4, 1) = 4, t0 = ⌈4·4⌉
    with pytest.raises(ValueError, match="t0 must be finite and > 0"):
        am.StepSchedule(1.0, t0=0.0)


def test_theta_average_is_the_mean_of_iterates_0_to_T_minus_1():
    rng = np.random.default_rng(6)
    data = linreg_data(rng, rng.normal(size=(3, 2)), 20)
    seen = [np.zeros((3, 2))]
    res = am.run_admm_reference(LS, data, [(0, 1), (1, 2)], lam=0.1, n_iter=7, batch_size=5,
                                on_iteration=lambda t, th: seen.append(th))
    np.testing.assert_allclose(res.theta_avg, np.mean(seen[:-1], axis=0), atol=1e-14)
    np.testing.assert_array_equal(res.theta, seen[-1])
    avg = am.ThetaAverage.zeros(1)
    for v in (1.0, 2.0, 6.0):
        avg.add(np.array([v]))
    assert avg.mean()[0] == 3.0


# ----------------------------------------------------------------------------------- ADMM runs


@pytest.mark.parametrize("loss", [LS, LOGIT], ids=["least-squares", "logistic"])
def test_lambda_zero_gives_local_estimators(loss):
    rng = np.random.default_rng(7)
    thetas = rng.normal(size=(5, 3))
    data = linreg_data(rng, thetas, 40) if loss is LS else logit_data(rng, thetas, 80)
    # λ = 0 decouples the nodes (β_ij = θ_i, α = 0): gradient descent with η = η̃/(1 + 2ρη̃)
    res = am.run_admm_reference(loss, data, ring(5), lam=0.0, rho=1.0 if loss is LS else 0.1, n_iter=300,
                                step=am.StepSchedule(0.5 if loss is LS else 3.0, rule="constant"))
    local = np.stack([am.local_estimator(loss, x, y) for x, y in data])
    np.testing.assert_allclose(res.theta, local, atol=1e-7)
    assert np.abs(local - local.mean(axis=0)).max() > 0.1  # the nodes really differ


@pytest.mark.parametrize("phi", ["l1", "l2"])
def test_large_lambda_gives_global_estimator_on_a_connected_graph(phi):
    rng = np.random.default_rng(8)
    data = linreg_data(rng, rng.normal(size=(7, 3)), 40)
    edges = [(0, 1), (1, 2), (2, 3), (3, 4), (5, 0)]  # connected component 0..5; node 6 isolated
    res = am.run_admm_reference(LS, data, edges, lam=50.0, phi=phi, n_iter=250, step=CONST)
    glob = am.global_estimator(LS, data[:6])
    np.testing.assert_allclose(res.theta[:6], np.tile(glob, (6, 1)), atol=1e-7)
    np.testing.assert_allclose(res.theta[6], am.local_estimator(LS, *data[6]), atol=1e-7)
    assert np.abs(glob - am.local_estimator(LS, *data[0])).max() > 0.1


@pytest.mark.parametrize("phi", ["l1", "l2"])
def test_fixed_point_satisfies_the_fused_lasso_kkt_conditions(phi):
    """At convergence ∇M̂_i(θ_i) = Σ_j α_ij with α_ij = −λ s_ij, s_ij ∈ ∂φ(θ_i − θ_j): Θ is optimal."""
    rng = np.random.default_rng(9)
    thetas = np.repeat(rng.normal(size=(2, 3)), 3, axis=0)
    data = linreg_data(rng, thetas, 30)
    edges = ring(6) + [(0, 3)]
    lam = 0.05
    res = am.run_admm_reference(LS, data, edges, lam=lam, phi=phi, n_iter=400, step=CONST)
    assert res.primal_residual[-1] < 1e-9
    for i in range(6):
        s = sum(res.halves[(i, j)].alpha for j in am.neighbours(res.edges, 6)[i])
        np.testing.assert_allclose(LS.grad(res.theta[i], *data[i]), s, atol=1e-8)
    for i, j in res.edges:
        a = res.halves[(i, j)].alpha
        assert am.dual_norm(a, phi) <= lam * (1 + 1e-9)
        d = res.theta[i] - res.theta[j]
        if phi == "l1":
            nz = np.abs(d) > 1e-6
            np.testing.assert_allclose(a[nz], -lam * np.sign(d[nz]), atol=1e-8)
        elif np.linalg.norm(d) > 1e-6:
            np.testing.assert_allclose(a, -lam * d / np.linalg.norm(d), atol=1e-8)
    f = am.fused_objective(LS, data, res.theta, edges, lam=lam, phi=phi)
    local = np.stack([am.local_estimator(LS, x, y) for x, y in data])
    glob = np.tile(am.global_estimator(LS, data), (6, 1))
    assert f < am.fused_objective(LS, data, local, edges, lam=lam, phi=phi)
    assert f < am.fused_objective(LS, data, glob, edges, lam=lam, phi=phi)


def test_primal_residual_shrinks_with_minibatches_and_the_default_step():
    rng = np.random.default_rng(10)
    data = linreg_data(rng, rng.normal(size=(6, 3)), 60)
    res = am.run_admm_reference(LS, data, ring(6), lam=0.05, n_iter=300, batch_size=10, seed=1)
    early = res.primal_residual[:10].mean()
    late = res.primal_residual[-50:].mean()
    assert early > 0.05 and late < 0.05 * early
    assert res.dual_residual[-50:].mean() < 0.05 * res.dual_residual[:10].mean()
    # same seed, same iterates; another seed, other minibatches
    again = am.run_admm_reference(LS, data, ring(6), lam=0.05, n_iter=20, batch_size=10, seed=1)
    other = am.run_admm_reference(LS, data, ring(6), lam=0.05, n_iter=20, batch_size=10, seed=2)
    first = am.run_admm_reference(LS, data, ring(6), lam=0.05, n_iter=20, batch_size=10, seed=1)
    np.testing.assert_array_equal(again.theta, first.theta)
    assert np.abs(other.theta - first.theta).max() > 0


@pytest.mark.parametrize("case", ["l1-full", "l2-full-theta0", "l1-minibatch", "logistic-unequal-n"])
def test_stacked_runner_equals_the_reference_loop(case):
    """run_admm_stacked: the same iterates, output average, residuals and halves as the per-node loop."""
    rng = np.random.default_rng(16)
    edges = [(0, 1), (1, 2), (2, 3), (3, 0), (0, 2), (4, 2)]  # node 4 has one neighbour
    kw: dict = {"lam": 0.05, "rho": 1.5, "n_iter": 120, "seed": 3}
    loss = LS
    if case == "logistic-unequal-n":
        loss = LOGIT
        data = [logit_data(rng, [th], n)[0] for th, n in zip(rng.normal(size=(5, 3)), (30, 40, 30, 50, 35))]
    else:
        data = linreg_data(rng, rng.normal(size=(5, 3)), 30)
    if case == "l2-full-theta0":
        kw.update(phi="l2", theta0=rng.normal(size=3), step=CONST)
    if case == "l1-minibatch":
        kw.update(batch_size=7)
    seen: list[np.ndarray] = []
    ref = am.run_admm_reference(loss, data, edges, **kw)
    got = am.run_admm_stacked(loss, data, edges, **kw, on_iteration=lambda t, th: seen.append(th))
    for a, b in ((ref.theta, got.theta), (ref.theta_avg, got.theta_avg), (ref.primal_residual, got.primal_residual),
                 (ref.dual_residual, got.dual_residual)):
        np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-12)
    assert set(got.halves) == set(ref.halves) and got.edges == ref.edges
    for k, h in ref.halves.items():
        np.testing.assert_allclose(got.halves[k].beta, h.beta, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(got.halves[k].alpha, h.alpha, rtol=1e-9, atol=1e-12)
    assert len(seen) == kw["n_iter"] and np.array_equal(seen[-1], got.theta)
    assert np.abs(ref.theta - ref.theta_avg).max() > 1e-6  # the run moved: the comparison is not of constants


# ----------------------------------------------------------------------------------- §6.10


def test_ipw_gradient_is_unbiased_monte_carlo():
    """E_{R,B}[(R/p) g_B] = ∇M̂: Monte Carlo mean within z·σ̂/√N per coordinate (Bonferroni over p)."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(50, 4))
    y = (rng.random(50) < 0.5).astype(float)
    theta = rng.normal(size=4)
    full = LOGIT.grad(theta, x, y)
    p_avail, n_mc = 0.3, 2000
    draws = np.empty((n_mc, 4))
    for k in range(n_mc):
        online = bool(am.sample_availability(np.array([p_avail]), rng)[0])
        g = am.minibatch_gradient(LOGIT, theta, x, y, batch_size=5, rng=rng) if online else np.zeros(4)
        draws[k] = am.ipw_gradient(g, online, p_avail)
    z = stats.norm.isf(0.001 / (2 * 4))  # two-sided 0.1 % family level over the 4 coordinates
    tol = z * draws.std(axis=0, ddof=1) / math.sqrt(n_mc)
    assert np.all(np.abs(draws.mean(axis=0) - full) <= tol)
    # the un-weighted gradient is biased by the factor p (the test detects a missing 1/p)
    assert np.any(np.abs(p_avail * draws.mean(axis=0) - full) > tol)
    with pytest.raises(ValueError, match=r"p must lie in \(0, 1\]"):
        am.ipw_gradient(full, True, 0.0)


def test_availability_estimate_uses_the_past_with_a_floor():
    assert am.estimate_availability(0, 0) == 1.0
    assert am.estimate_availability(0, 3) == 0.25  # floor 1/(t+1)
    assert am.estimate_availability(3, 4) == 0.75
    tr = am.AvailabilityTracker()
    est = []
    for r in (True, False, False, True):
        est.append(tr.estimate())
        tr.record(r)
    assert est == [1.0, 1.0, 0.5, 1.0 / 3.0]
    with pytest.raises(ValueError, match="n_available <= n_observed"):
        am.estimate_availability(2, 1)


def test_inaccessible_devices_ipw_recovers_the_solution_and_no_weighting_is_biased():
    rng = np.random.default_rng(12)
    data = linreg_data(rng, 2 * rng.normal(size=(4, 2)), 30)
    ref = am.run_admm_reference(LS, data, ring(4), lam=0.1, n_iter=200, step=CONST).theta
    p_avail = np.array([0.3, 0.6, 0.9, 1.0])
    errs = {}
    for mode in ("known", "estimated", "none"):
        res = am.run_admm_reference(LS, data, ring(4), lam=0.1, n_iter=250, availability=p_avail, ipw=mode, seed=1)
        errs[mode] = np.abs(res.theta - ref).max()
    assert errs["known"] < 0.08 and errs["estimated"] < 0.08
    assert errs["none"] > 0.3


# ----------------------------------------------------------------------------------- §6.9


def test_wald_statistic_hand_computed():
    a = am.LocalStatistics(np.array([2.0]), np.array([[0.5]]), 10, 0.0)
    b = am.LocalStatistics(np.array([0.0]), np.array([[0.5]]), 10, 0.0)
    assert am.wald_statistic(a, b) == (4.0, 1)  # Δ² / (0.5 + 0.5)
    sel = am.select_edges([a, b], [(0, 1)], alpha=0.05)
    assert sel.pvalues[0] == pytest.approx(stats.chi2.sf(4.0, 1))
    assert sel.kept == () and sel.level == 0.05  # 4 > χ²_1(0.05) = 3.84
    assert am.select_edges([a, b], [(0, 1)], alpha=0.01).kept == ((1, 0),)  # 4 < 6.63
    assert am.select_edges([a, b], [], alpha=0.05).kept == ()


def _two_groups(rng, n, loss, per_group=5, sigma=1.0):
    centres = np.array([[1.0, -1.0, 0.5], [-1.0, 1.0, 0.0]])
    thetas = np.repeat(centres, per_group, axis=0)
    data = linreg_data(rng, thetas, n, sigma) if loss is LS else logit_data(rng, thetas, n)
    group = np.repeat([0, 1], per_group)
    return data, group


@pytest.mark.parametrize("loss,covariance", [(LS, "hessian"), (LS, "sandwich-hc3"), (LS, "sandwich"), (LOGIT, "hessian")],
                         ids=["ls-hessian", "ls-hc3", "ls-sandwich", "logit-hessian"])
def test_edge_selection_keeps_true_edges_and_drops_planted_false_ones(loss, covariance):
    rng = np.random.default_rng(13)
    data, group = _two_groups(rng, 150 if loss is LS else 1500, loss)
    stats_ = [am.local_statistics(loss, x, y, covariance=covariance) for x, y in data]
    within = [(i, j) for i in range(10) for j in range(i) if group[i] == group[j]]
    planted = [(5, 0), (7, 2), (9, 4)]
    sel = am.select_edges(stats_, within + planted, alpha=0.05)  # FedADMM-ES on the given graph
    assert set(sel.kept) == set(am.canonical_edges(within, 10))
    assert sel.level == pytest.approx(0.05 / (len(within) + 3))
    pv = dict(zip(sel.edges, sel.pvalues))
    assert all(pv[e] < sel.level for e in planted)
    local = am.select_edges(stats_, am.complete_graph_edges(10), alpha=0.05)  # FedADMM-Local-ES
    assert set(local.kept) == set(am.canonical_edges(within, 10))


def test_edge_selection_controls_the_familywise_error_and_needs_sigma2():
    """Under H0 (all θ equal) P(drop any edge) ≤ α (Bonferroni), up to Monte Carlo error, for every
    covariance at n = 200, p = 2. With noise σ = 3 the unscaled Hessian form Ĥ⁻¹/n (σ̂² left out,
    §6.9 note) drops true edges almost always."""
    rng = np.random.default_rng(14)
    reps, nodes, alpha = 80, 6, 0.05
    edges = am.complete_graph_edges(nodes)
    fails = dict.fromkeys((*am.COVARIANCES, "hessian-unscaled"), 0)
    for _ in range(reps):
        data = linreg_data(rng, np.zeros((nodes, 2)), 200, sigma=3.0)
        for cov in am.COVARIANCES:
            st = [am.local_statistics(LS, x, y, covariance=cov) for x, y in data]
            fails[cov] += len(am.select_edges(st, edges, alpha=alpha).kept) < len(edges)
        unscaled = [am.LocalStatistics(s.theta, np.linalg.inv(x.T @ x), s.n, s.ridge)
                    for s, (x, _) in zip((am.local_statistics(LS, x, y) for x, y in data), data)]
        fails["hessian-unscaled"] += len(am.select_edges(unscaled, edges, alpha=alpha).kept) < len(edges)
    for cov in am.COVARIANCES:
        assert fails[cov] / reps <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / reps), fails
    assert fails["hessian-unscaled"] / reps > 0.5


def test_local_statistics_auto_ridge_for_separable_or_underdetermined_data():
    x = np.array([[1.0, 0.0], [2.0, 0.0], [-1.0, 0.0], [-2.0, 0.0]])  # second column all zero
    y = np.array([1.0, 1.0, 0.0, 0.0])  # perfectly separated
    st = am.local_statistics(LOGIT, x, y, covariance="hessian")
    assert st.ridge > 0 and np.all(np.isfinite(st.theta)) and np.all(np.isfinite(st.cov))
    st = am.local_statistics(LS, np.ones((1, 3)), np.ones(1))  # n < p
    assert st.ridge > 0 and np.all(np.isfinite(st.cov))


# ----------------------------------------------------------------------------------- λ by CV


def test_cross_validation_picks_the_minimiser_and_breaks_ties_upward():
    calls = []

    def solve(lam, train):
        calls.append((lam, train))
        return lam

    res = am.cross_validate_lambda([0.0, 0.1, 0.3, 1.0], 3, solve, lambda lam, k: (lam - 0.3) ** 2 + 0.01 * k)
    assert res.best_lambda == 0.3
    assert calls[:3] == [(0.0, (1, 2)), (0.0, (0, 2)), (0.0, (0, 1))]
    np.testing.assert_allclose(res.mean_loss, (np.array([0.0, 0.1, 0.3, 1.0]) - 0.3) ** 2 + 0.01)
    flat = am.cross_validate_lambda([0.0, 0.5, 0.2], 2, lambda lam, tr: lam, lambda lam, k: 1.0)
    assert flat.best_lambda == 0.5
    ids = am.kfold_ids(11, 5, np.random.default_rng(0))
    assert sorted(np.bincount(ids).tolist()) == [2, 2, 2, 2, 3]


def test_admm_cv_prefers_fusion_on_a_homogeneous_graph():
    rng = np.random.default_rng(15)
    data = linreg_data(rng, np.tile([1.0, -1.0], (4, 1)), 15, sigma=2.0)
    res = am.admm_cv_lambda(LS, data, ring(4), [0.0, 1.0], n_folds=3, seed=0, n_iter=150, step=CONST)
    assert res.fold_losses.shape == (2, 3)
    assert res.best_lambda == 1.0 and res.mean_loss[1] < res.mean_loss[0]
