"""BiG-FL: UL loss, LL gradient and hypergradient against references (ALGORITHMS.md §5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphfl.strategies import bigfl_math as bm



@pytest.fixture(autouse=True)
def _float64():
    """Double precision for finite differences, restored afterwards (global torch state)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)

N, D, Q = 5, 3, 2
# path 0-1-2, edge 3-4 ... plus node-level variety; every node has non-neighbours.
EDGES = [(0, 1), (1, 2), (3, 4), (0, 4)]


def _adj(n: int = N, edges=EDGES) -> np.ndarray:
    a = np.zeros((n, n))
    for i, j in edges:
        a[i, j] = a[j, i] = 1.0
    return a


def _gcn(adj: np.ndarray) -> np.ndarray:
    a = adj + np.eye(len(adj))
    s = 1.0 / np.sqrt(a.sum(1))
    return s[:, None] * a * s[None, :]


@pytest.fixture()
def problem():
    rng = np.random.default_rng(0)
    adj = _adj()
    a_hat = torch.tensor(_gcn(adj))
    theta = torch.tensor(rng.standard_normal((N, D)))
    phi = torch.eye(D) + 0.2 * torch.tensor(rng.standard_normal((D, D)))
    pos = torch.tensor(bm.positive_pairs(adj))
    neg = torch.tensor(bm.sample_negatives(adj, Q, np.random.default_rng(1)))
    # quadratic data losses data_i(θ) = ½‖A_i θ − b_i‖²: Hessian A_iᵀA_i
    amat = torch.tensor(rng.standard_normal((N, 6, D)))
    bvec = torch.tensor(rng.standard_normal((N, 6)))
    return dict(adj=adj, a_hat=a_hat, theta=theta, phi=phi, pos=pos, neg=neg, amat=amat, bvec=bvec)


HYP = dict(q=Q, lambda_ul=0.05, lambda_ll=0.7, kappa=1.0)


def test_pairs_and_negatives():
    adj = _adj()
    pos = bm.positive_pairs(adj)
    assert len(pos) == 2 * len(EDGES)
    assert all(adj[i, j] == 1 for i, j in pos)
    neg = bm.sample_negatives(adj, Q, np.random.default_rng(0))
    assert len(neg) == N * Q
    for i, j in neg:
        assert i != j and adj[i, j] == 0
    # node adjacent to all others gets no negatives; isolated node samples from everyone
    star = np.zeros((4, 4))
    star[0, 1:] = star[1:, 0] = 1
    neg = bm.sample_negatives(star, 5, np.random.default_rng(0))
    assert 0 not in set(neg[:, 0].tolist())
    assert np.sum(neg[:, 0] == 1) == 5  # with replacement (only 2 candidates)


def test_ul_loss_equals_cosine_embedding_loss(problem):
    p = problem
    f = bm.ul_loss(p["a_hat"], p["theta"], p["phi"], p["pos"], p["neg"], Q, 0.3)
    h = p["a_hat"] @ p["theta"] @ p["phi"]
    cel = torch.nn.CosineEmbeddingLoss(margin=0.0, reduction="sum")
    pos, neg = p["pos"], p["neg"]
    ref = cel(h[pos[:, 0]], h[pos[:, 1]], torch.ones(len(pos))) / N
    ref = ref + cel(h[neg[:, 0]], h[neg[:, 1]], -torch.ones(len(neg))) / (N * Q)
    ref = ref + 0.15 * ((p["phi"] - torch.eye(D)) ** 2).sum()
    assert float(f) == pytest.approx(float(ref), rel=1e-9, abs=1e-12)
    # with negatives that are actually anti-aligned the clamp must bite
    g = bm.ul_loss(p["a_hat"], p["theta"], p["phi"], pos[:0], neg, Q, 0.0)
    cos = torch.nn.functional.cosine_similarity(h[neg[:, 0]], h[neg[:, 1]])
    assert float(g) == pytest.approx(float(torch.clamp(cos, min=0).sum() / (N * Q)))


def test_zero_embedding_row_is_finite(problem):
    p = problem
    theta = p["theta"].clone()
    theta[:] = 0.0
    f = bm.ul_loss(p["a_hat"], theta, p["phi"], p["pos"], p["neg"], Q, 0.0)
    assert torch.isfinite(f)
    assert float(f) == pytest.approx(len(p["pos"]) / N)  # cos = 0 on every edge


def test_ll_grad_matches_autograd_and_finite_differences(problem):
    p = problem
    phi, a_hat, theta = p["phi"], p["a_hat"], p["theta"]
    m = bm.messages(a_hat, theta, phi)
    for i in range(N):
        a_ii = float(a_hat[i, i])
        th = theta[i].clone().requires_grad_(True)
        loss = bm.ll_reg_loss(th, m[i], phi, a_ii, 0.7, 0.3)
        (auto,) = torch.autograd.grad(loss, th)
        g = bm.ll_reg_grad(theta[i], m[i], phi, a_ii, 0.7, 0.3)
        assert torch.allclose(g, auto, atol=1e-12)
        eps = 1e-6
        fd = torch.zeros(D)
        for k in range(D):
            e = torch.zeros(D)
            e[k] = eps
            fd[k] = (
                bm.ll_reg_loss(theta[i] + e, m[i], phi, a_ii, 0.7, 0.3)
                - bm.ll_reg_loss(theta[i] - e, m[i], phi, a_ii, 0.7, 0.3)
            ) / (2 * eps)
        assert torch.allclose(g, fd, atol=1e-7)
    # the stacked server-side form agrees with the per-client form (κ excluded)
    fr = bm.reg_pseudo_grad(a_hat, theta, phi, 0.7)
    for i in range(N):
        gi = bm.ll_reg_grad(theta[i], m[i], phi, float(a_hat[i, i]), 0.7, 0.0)
        assert torch.allclose(fr[i], gi, atol=1e-12)
    # message excludes θ_i: changing θ_i leaves m_i unchanged
    t2 = theta.clone()
    t2[2] += 5.0
    assert torch.allclose(bm.messages(a_hat, t2, phi)[2], m[2])


def _pseudo_grad(p, theta, phi, kappa, lambda_ll):
    """Full LL pseudo-gradient F(φ, Θ) with the quadratic data losses."""
    a, b = p["amat"], p["bvec"]
    data = torch.einsum("nki,nk->ni", a, torch.einsum("nki,ni->nk", a, theta) - b)
    return data + bm.reg_pseudo_grad(p["a_hat"], theta, phi, lambda_ll) + kappa * theta


def _theta_star(p, phi, kappa, lambda_ll):
    """Θ*(φ): F is affine in Θ, so solve the (nd)×(nd) linear system exactly."""
    f0 = _pseudo_grad(p, torch.zeros(N, D), phi, kappa, lambda_ll).reshape(-1)
    cols = []
    for idx in range(N * D):
        e = torch.zeros(N * D)
        e[idx] = 1.0
        cols.append(_pseudo_grad(p, e.view(N, D), phi, kappa, lambda_ll).reshape(-1) - f0)
    jac = torch.stack(cols, dim=1)
    return torch.linalg.solve(jac, -f0).view(N, D)


def _ell(p, phi):
    th = _theta_star(p, phi, HYP["kappa"], HYP["lambda_ll"])
    return float(bm.ul_loss(p["a_hat"], th, phi, p["pos"], p["neg"], Q, HYP["lambda_ul"]))


def _fd_phi(fun, phi, eps=1e-6):
    g = torch.zeros_like(phi)
    for a in range(D):
        for b in range(D):
            e = torch.zeros_like(phi)
            e[a, b] = eps
            g[a, b] = (fun(phi + e) - fun(phi - e)) / (2 * eps)
    return g


def _hessians(p):
    return torch.einsum("nki,nkj->nij", p["amat"], p["amat"])


def test_first_order_is_partial_gradient_fd(problem):
    p = problem
    g, info = bm.hypergradient(p["a_hat"], p["theta"], p["phi"], p["pos"], p["neg"],
                               mode="first_order", **HYP)
    fd = _fd_phi(lambda ph: float(bm.ul_loss(p["a_hat"], p["theta"], ph, p["pos"], p["neg"], Q,
                                             HYP["lambda_ul"])), p["phi"])
    assert torch.allclose(g, fd, atol=1e-7)
    assert info.mode == "first_order" and info.correction_norm == 0.0


def test_exact_and_neumann_hypergradient_match_fd_of_bilevel_objective(problem):
    p = problem
    phi = p["phi"]
    theta = _theta_star(p, phi, HYP["kappa"], HYP["lambda_ll"])
    # the LL solution is a fixed point: F(φ, Θ*) = 0
    assert float(_pseudo_grad(p, theta, phi, HYP["kappa"], HYP["lambda_ll"]).abs().max()) < 1e-9
    fd = _fd_phi(lambda ph: _ell(p, ph), phi)
    hess = _hessians(p)
    exact, _ = bm.hypergradient(p["a_hat"], theta, phi, p["pos"], p["neg"], mode="exact",
                                hessians=hess, **HYP)
    assert torch.allclose(exact, fd, atol=1e-6), (exact - fd).abs().max()
    # Neumann with many terms and a step below 1/‖J‖ converges to the same vector
    c = 0.5 / float(torch.linalg.matrix_norm(hess, ord=2).max() + 3.0)
    neu, info = bm.hypergradient(p["a_hat"], theta, phi, p["pos"], p["neg"], mode="neumann",
                                 hessians=hess, neumann_k=3000, neumann_c=c, **HYP)
    assert info.neumann_halvings == 0 and not info.fell_back
    assert torch.allclose(neu, fd, atol=1e-5), (neu - fd).abs().max()
    # and the correction matters: first-order differs from the true hypergradient
    fo, _ = bm.hypergradient(p["a_hat"], theta, phi, p["pos"], p["neg"], mode="first_order", **HYP)
    assert float((fo - fd).abs().max()) > 1e-3


def test_reg_only_is_neumann_without_data_hessians(problem):
    p = problem
    kw = dict(neumann_k=5, neumann_c=0.05, **HYP)
    a, _ = bm.hypergradient(p["a_hat"], p["theta"], p["phi"], p["pos"], p["neg"],
                            mode="reg_only", hessians=_hessians(p), **kw)
    b, _ = bm.hypergradient(p["a_hat"], p["theta"], p["phi"], p["pos"], p["neg"],
                            mode="neumann", hessians=None, **kw)
    c, _ = bm.hypergradient(p["a_hat"], p["theta"], p["phi"], p["pos"], p["neg"],
                            mode="neumann", hessians=_hessians(p), **kw)
    assert torch.allclose(a, b, atol=1e-14)
    assert not torch.allclose(a, c, atol=1e-8)


def test_neumann_safeguard_halves_step(problem):
    p = problem
    g, info = bm.hypergradient(p["a_hat"], p["theta"], p["phi"], p["pos"], p["neg"],
                               mode="neumann", hessians=_hessians(p) * 100.0,
                               neumann_k=5, neumann_c=10.0, **HYP)
    assert info.neumann_halvings > 0
    assert info.neumann_c < 10.0
    assert torch.isfinite(g).all()
    # impossible to fix within 0 halvings -> first-order fallback
    g2, info2 = bm.hypergradient(p["a_hat"], p["theta"], p["phi"], p["pos"], p["neg"],
                                 mode="neumann", hessians=_hessians(p) * 100.0,
                                 neumann_k=5, neumann_c=10.0, max_halvings=0, **HYP)
    fo, _ = bm.hypergradient(p["a_hat"], p["theta"], p["phi"], p["pos"], p["neg"],
                             mode="first_order", **HYP)
    assert info2.fell_back and torch.allclose(g2, fo)


def test_unknown_mode_is_an_error(problem):
    p = problem
    with pytest.raises(ValueError, match="neumann"):
        bm.hypergradient(p["a_hat"], p["theta"], p["phi"], p["pos"], p["neg"], mode="bogus",
                         **HYP)
