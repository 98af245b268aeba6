"""BiG-FL: UL loss, LL gradient and hypergradient against references (ALGORITHMS.md §5, §0.1 C2)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from graphfl.strategies import bigfl_math as bm


@pytest.fixture(autouse=True)
def _float64(request):
    """Double precision for the math tests' finite differences (not for real runs), restored
    afterwards (global torch state)."""
    old = torch.get_default_dtype()
    if "inprocess" not in request.node.name:
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


HYP = dict(q=Q, lam=0.7, kappa=1.0)


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
    h = p["a_hat"] @ (p["theta"] - p["theta"].mean(0)) @ p["phi"]  # centred parameters (C2 a)
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
    th = _theta_star(p, phi, HYP["kappa"], HYP["lam"])
    return float(bm.ul_loss(p["a_hat"], th, phi, p["pos"], p["neg"], Q, HYP["lam"]))


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
                                             HYP["lam"])), p["phi"])
    assert torch.allclose(g, fd, atol=1e-7)
    assert info.mode == "first_order" and info.correction_norm == 0.0


def test_exact_and_neumann_hypergradient_match_fd_of_bilevel_objective(problem):
    p = problem
    phi = p["phi"]
    theta = _theta_star(p, phi, HYP["kappa"], HYP["lam"])
    # the LL solution is a fixed point: F(φ, Θ*) = 0
    assert float(_pseudo_grad(p, theta, phi, HYP["kappa"], HYP["lam"]).abs().max()) < 1e-9
    fd = _fd_phi(lambda ph: _ell(p, ph), phi)
    hess = _hessians(p)
    exact, _ = bm.hypergradient(p["a_hat"], theta, phi, p["pos"], p["neg"], mode="exact",
                                hessians=hess, **HYP)
    assert torch.allclose(exact, fd, atol=1e-6), (exact - fd).abs().max()
    # Neumann with many terms and a step below 1/‖J‖ converges to the same vector
    c = 0.5 / float(torch.linalg.matrix_norm(hess, ord=2).max() + 3.0)
    neu, info = bm.hypergradient(p["a_hat"], theta, phi, p["pos"], p["neg"], mode="implicit", solver="neumann",
                                 hessians=hess, max_iter=3000, neumann_c=c, tol=1e-10, **HYP)
    assert info.neumann_halvings == 0 and not info.fell_back and info.converged
    assert torch.allclose(neu, fd, atol=1e-5), (neu - fd).abs().max()
    # GMRES (the default solver) reaches its tolerance and the same vector
    gm, info = bm.hypergradient(p["a_hat"], theta, phi, p["pos"], p["neg"], hessians=hess, tol=1e-10, **HYP)
    assert info.solver == "gmres" and info.converged and info.residual <= 1e-10
    assert torch.allclose(gm, fd, atol=1e-6), (gm - fd).abs().max()
    # and the correction matters: first-order differs from the true hypergradient
    fo, _ = bm.hypergradient(p["a_hat"], theta, phi, p["pos"], p["neg"], mode="first_order", **HYP)
    assert float((fo - fd).abs().max()) > 1e-3


def test_reg_only_is_neumann_without_data_hessians(problem):
    p = problem
    kw = dict(solver="neumann", max_iter=5, neumann_c=0.05, **HYP)
    a, _ = bm.hypergradient(p["a_hat"], p["theta"], p["phi"], p["pos"], p["neg"],
                            mode="reg_only", hessians=_hessians(p), **kw)
    b, _ = bm.hypergradient(p["a_hat"], p["theta"], p["phi"], p["pos"], p["neg"],
                            mode="implicit", hessians=None, **kw)
    c, _ = bm.hypergradient(p["a_hat"], p["theta"], p["phi"], p["pos"], p["neg"],
                            mode="implicit", hessians=_hessians(p), **kw)
    assert torch.allclose(a, b, atol=1e-14)
    assert not torch.allclose(a, c, atol=1e-8)


def test_neumann_safeguard_halves_step(problem):
    p = problem
    g, info = bm.hypergradient(p["a_hat"], p["theta"], p["phi"], p["pos"], p["neg"],
                               mode="implicit", solver="neumann", hessians=_hessians(p) * 100.0,
                               max_iter=5, neumann_c=10.0, **HYP)
    assert info.neumann_halvings > 0
    assert info.neumann_c < 10.0
    assert torch.isfinite(g).all()
    # impossible to fix within 0 halvings -> first-order fallback
    g2, info2 = bm.hypergradient(p["a_hat"], p["theta"], p["phi"], p["pos"], p["neg"],
                                 mode="implicit", solver="neumann", hessians=_hessians(p) * 100.0,
                                 max_iter=5, neumann_c=10.0, max_halvings=0, **HYP)
    fo, _ = bm.hypergradient(p["a_hat"], p["theta"], p["phi"], p["pos"], p["neg"],
                             mode="first_order", **HYP)
    assert info2.fell_back and torch.allclose(g2, fo)


def test_unknown_mode_is_an_error(problem):
    p = problem
    with pytest.raises(ValueError, match="implicit"):
        bm.hypergradient(p["a_hat"], p["theta"], p["phi"], p["pos"], p["neg"], mode="bogus",
                         **HYP)


# ---------------------------------------------------------------------------------------
# server core
# ---------------------------------------------------------------------------------------

from graphfl.common.config import ConfigError, RunConfig  # noqa: E402
from graphfl.common.core import ServerContext  # noqa: E402
from graphfl.common.types import ClientUpdate  # noqa: E402
from graphfl.strategies import bigfl as bg  # noqa: E402

TEMPLATE = {"l1.weight": np.zeros((2, 2), dtype=np.float32), "l2.weight": np.ones(3, dtype=np.float32)}


def _core_ctx(adj=None, n=4, cfg=None, **params):
    return ServerContext(
        config=cfg or RunConfig(), params=bg.BiGFLParams(**params), num_clients=n,
        initial_arrays=TEMPLATE, param_keys=tuple(TEMPLATE), num_examples={i: 10 for i in range(n)},
        client_graph=adj, seed=0,
    )


def _reply(core, i, value, hess=True):
    arrays = {k: np.full(v.shape, value, dtype=np.float32) for k, v in core.update_template(i).items()
              if not k.startswith("bigfl/")}
    if hess and core.want_hessian:
        arrays[bg.HESS_KEY] = np.eye(core.dim, dtype=np.float32)
    return ClientUpdate(i, arrays, 10)


def test_core_payload_messages_and_phi_update():
    adj = _adj(4, [(0, 1), (1, 2)])  # node 3 isolated
    core = bg.BiGFLCore(_core_ctx(adj, alpha=0.5))
    p1 = core.configure_train(1, 1)
    assert set(p1.arrays) == {"l1.weight", "l2.weight", bg.M_KEY, bg.PHI_KEY}
    assert p1.arrays[bg.PHI_KEY].shape == (7, 7)
    np.testing.assert_allclose(p1.arrays[bg.PHI_KEY], np.eye(7))
    assert p1.config[bg.A_II_KEY] == pytest.approx(1 / 3)
    assert core.configure_train(1, 3).config[bg.A_II_KEY] == pytest.approx(1.0)
    np.testing.assert_allclose(core.configure_train(1, 3).arrays[bg.M_KEY], 0.0)  # isolated
    assert core.configure_train(1, 0).arrays[bg.PHI_KEY] is core.configure_train(1, 2).arrays[bg.PHI_KEY]
    assert bg.HESS_KEY in core.update_template(0)
    ups = {i: _reply(core, i, float(i + 1)) for i in range(4)}
    m = core.aggregate_train(1, ups)
    assert m["clients_aggregated"] == 4
    assert m["phi_minus_identity"] == pytest.approx(0.5) and np.isfinite(m["ul_loss"])  # normalised step
    # messages use the new Θ and φ: m_i = Σ_{j≠i} Â_ij θ_j φ
    a_hat = core.a_hat.numpy()
    theta = core.theta.numpy()
    expect = ((a_hat - np.diag(np.diag(a_hat))) @ theta @ core.phi.numpy())[1]
    np.testing.assert_allclose(core.configure_train(2, 1).arrays[bg.M_KEY], expect, rtol=1e-5)
    # the client's own model comes back to it
    np.testing.assert_allclose(core.evaluation_payload(2).arrays["l1.weight"], 3.0)


def test_core_excludes_nan_and_survives_empty_round(caplog):
    import logging

    core = bg.BiGFLCore(_core_ctx(_adj(4, [(0, 1), (2, 3)])))
    phi0 = core.phi.clone()
    assert core.aggregate_train(1, {})["clients_aggregated"] == 0
    assert torch.equal(core.phi, phi0)
    bad = _reply(core, 0, 1.0)
    bad.arrays["l2.weight"][0] = np.nan
    with caplog.at_level(logging.WARNING, logger="graphfl.strategies.bigfl"):
        m = core.aggregate_train(2, {0: bad, 1: _reply(core, 1, 2.0)})
    assert m["clients_excluded"] == 1 and m["clients_aggregated"] == 1
    assert "client 0" in caplog.text and "NaN" in caplog.text
    assert torch.isfinite(core.theta).all() and torch.isfinite(core.phi).all()


def test_graph_sources_and_errors(tmp_path, caplog):
    """The run's graph is resolved once (common.graph); BiG-FL falls back per missing-graph."""
    import logging

    from graphfl.common.graph import resolve_client_graph

    with pytest.raises(ConfigError, match="shape"):
        resolve_client_graph(4, _adj(3, [(0, 1)]))
    with pytest.raises(ConfigError, match="needs a client graph"):
        bg.BiGFLCore(_core_ctx(None, missing_graph="error"))
    with caplog.at_level(logging.WARNING, logger="graphfl.common.graph"):
        core = bg.BiGFLCore(_core_ctx(None))
    assert core.graph_source.startswith("complete") and "no client graph" in caplog.text
    assert core.pos.shape[0] == 12
    iso = bg.BiGFLCore(_core_ctx(None, missing_graph="isolated"))
    assert iso.pos.shape[0] == 0 and np.allclose(iso.a_diag, 1.0)
    edges = tmp_path / "edges.txt"
    edges.write_text("# ring\n0 1\n1 2\n2 3\n3 0\n")
    adj, source = resolve_client_graph(4, _adj(4, [(0, 1)]), str(edges))  # the file wins over the task
    core = bg.BiGFLCore(dataclasses.replace(_core_ctx(adj), graph_source=source))
    assert core.graph_source.startswith("file") and core.pos.shape[0] == 8
    edges.write_text("0 7\n")
    with pytest.raises(ConfigError, match="outside"):
        resolve_client_graph(4, None, str(edges))


def test_layer_subset_and_local_others():
    core = bg.BiGFLCore(_core_ctx(_adj(4, [(0, 1)]), layers="l2", others="local",
                                  hypergrad_mode="reg_only"))
    assert core.dim == 3 and core.keys == ("l2.weight",)
    p = core.configure_train(1, 0)
    assert set(p.arrays) == {"l2.weight", bg.M_KEY, bg.PHI_KEY}
    assert p.arrays[bg.PHI_KEY].shape == (3, 3)
    assert set(core.update_template(0)) == {"l2.weight"}  # no Hessian, nothing else uploaded
    core.aggregate_train(1, {i: _reply(core, i, 1.0 + i) for i in range(4)})
    fed = bg.BiGFLCore(_core_ctx(_adj(4, [(0, 1)]), layers="l2", others="fedavg"))
    ups = {i: _reply(fed, i, 1.0 + i) for i in range(4)}
    fed.aggregate_train(1, ups)
    np.testing.assert_allclose(fed.configure_train(2, 0).arrays["l1.weight"], 2.5)  # FedAvg mean
    np.testing.assert_allclose(fed.configure_train(2, 3).arrays["l2.weight"], 4.0)  # own θ
    with pytest.raises(ConfigError, match="bigfl.layers"):
        bg.BiGFLCore(_core_ctx(_adj(4, [(0, 1)]), layers="conv9"))
    big = bg.BiGFLCore(_core_ctx(_adj(4, [(0, 1)]), max_hessian_dim=3))
    assert not big.want_hessian and bg.HESS_KEY not in big.update_template(0)


# ---------------------------------------------------------------------------------------
# in-process run (real trainers incl. Hessian upload, real round loop)
# ---------------------------------------------------------------------------------------


def test_inprocess_two_rounds_implicit_with_nan_reply():
    import graphfl.strategies.bigfl  # noqa: F401  (registers "bigfl")
    from graphfl.common.config import parse_run_config
    from graphfl.server.inprocess import run_federated_inprocess

    cfg = parse_run_config({"strategy": "bigfl", "task": "synthetic-multicenter", "nodes": 8,
                            "rounds": 2, "engine": "inprocess", "train.local-steps": 3,
                            "bigfl.alpha": 0.5})
    doc, core = run_federated_inprocess(cfg, fail={(2, 3): "nan"})
    curve = doc["methods"]["bigfl"]["curve"]
    assert core.graph_source == "task" and core.dim == 512
    # the uploaded Hessians are the data-loss Hessians at the uploaded models, on each client's
    # training split (client 3's NaN reply of round 2 was dropped whole: both are from round 1)
    from graphfl.client.bigfl_trainer import data_loss_hessian
    from graphfl.client.handler import build_runtime
    from graphfl.client.training import set_arrays

    assert core.want_hessian
    for pid in (0, 3):
        rt = build_runtime(cfg, pid, 8)
        model = rt.ctx.task.build_model()
        set_arrays(model, core.evaluation_payload(pid).arrays)
        want = data_loss_hessian(model, core.keys, rt.ctx.data.x_train, rt.ctx.data.y_train, rt.ctx.task.loss_fn())
        np.testing.assert_allclose(core.hessians[pid].numpy(), want, rtol=1e-5, atol=1e-7)
        assert np.abs(want).max() > 1e-3
    assert curve[1]["server"]["clients_aggregated"] == 8
    assert "3" in curve[2]["failed"] and curve[2]["server"]["clients_aggregated"] == 7
    assert curve[2]["server"]["phi_minus_identity"] > 0
    assert all(np.isfinite(row["test_loss"]) for row in curve)
    # per-client payload: own model + message + phi (d×d float32)
    assert curve[1]["bytes_down"] >= 8 * 512 * 512 * 4


def test_client_hessian_equals_autograd_hessian_on_a_small_model():
    """``data_loss_hessian`` (torch.func over the flattened chosen parameters) against
    ``torch.autograd.functional.hessian`` of the same loss written out by hand."""
    from torch import nn

    from graphfl.client.bigfl_trainer import data_loss_hessian

    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Sigmoid(), nn.Linear(4, 2, bias=False)).to(torch.float64)
    x = torch.randn(7, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(7, 2, generator=gen, dtype=torch.float64)
    w1, b1, w2 = (p.detach().clone() for p in model.parameters())

    def loss_all(flat):
        a, b, c = flat[:12].view(4, 3), flat[12:16], flat[16:].view(2, 4)
        return ((torch.sigmoid(x @ a.T + b) @ c.T - y) ** 2).mean()

    def loss_last(flat):
        return ((torch.sigmoid(x @ w1.T + b1) @ flat.view(2, 4).T - y) ** 2).mean()

    keys = ("0.weight", "0.bias", "2.weight")
    got = data_loss_hessian(model, keys, x.numpy(), y.numpy(), nn.MSELoss())
    want = torch.autograd.functional.hessian(loss_all, torch.cat([w1.reshape(-1), b1, w2.reshape(-1)]))
    assert got.shape == (24, 24) and got.dtype == np.float32
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-7)
    got_last = data_loss_hessian(model, ("2.weight",), x.numpy(), y.numpy(), nn.MSELoss())
    np.testing.assert_allclose(got_last, torch.autograd.functional.hessian(loss_last, w2.reshape(-1)).numpy(),
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got_last, got[16:, 16:], rtol=1e-5, atol=1e-7)  # a block of the full one


def test_phi_dtype_float16_halves_phi_and_the_client_result_stays_within_float16_error():
    """``bigfl.phi-dtype = float16``: φ goes out as float16 (half the bytes); a client trained on
    it ends within float16 rounding of the client trained on the float32 φ."""
    from graphfl.client.handler import build_runtime
    from graphfl.common.config import parse_run_config
    from graphfl.common.types import Payload
    from graphfl.server.inprocess import server_inputs
    from graphfl.server.rounds import build_server_context

    torch.set_default_dtype(torch.float32)  # real runs' dtype (the fixture restores it)

    def core_and_payload(dtype):
        cfg = parse_run_config({"strategy": "bigfl", "task": "synthetic-multicenter", "nodes": 6, "engine": "inprocess",
                                "train.local-steps": 5, "bigfl.hypergrad-mode": "reg_only", "bigfl.phi-dtype": dtype})
        core = bg.BiGFLCore(build_server_context(cfg, server_inputs(cfg), {i: 80 for i in range(6)}))
        rng = np.random.default_rng(0)   # a φ away from I (I itself is exact in float16)
        core.phi = core.phi + 0.02 * torch.as_tensor(rng.standard_normal((core.dim, core.dim)))
        core._refresh()
        return cfg, core, core.configure_train(1, 2)

    cfg16, core16, p16 = core_and_payload("float16")
    cfg32, core32, p32 = core_and_payload("float32")
    assert p16.arrays[bg.PHI_KEY].dtype == np.float16 and p32.arrays[bg.PHI_KEY].dtype == np.float32
    assert p16.arrays[bg.PHI_KEY].nbytes * 2 == p32.arrays[bg.PHI_KEY].nbytes
    phi_err = np.abs(p16.arrays[bg.PHI_KEY].astype(np.float64) - core32.phi.numpy()).max()
    assert 0 < phi_err <= 2.0 ** -11 * np.abs(core32.phi.numpy()).max()     # float16 rounding, not more

    def fit(cfg, payload):
        rt = build_runtime(cfg, 2, 6)
        return rt.trainer.fit(1, Payload(dict(payload.arrays), dict(payload.config)), {})

    r16, r32 = fit(cfg16, p16), fit(cfg32, p32)
    start = {k: v for k, v in p32.arrays.items() if not k.startswith(bg.RESERVED_PREFIX)}
    moved = max(np.abs(r32.arrays[k] - start[k]).max() for k in start)
    gap = max(np.abs(r16.arrays[k] - r32.arrays[k]).max() for k in start)
    # φ16 was really used (gap > 0), and the client's step deviates by less than φ's own
    # relative float16 precision (measured: gap/moved ≈ 4e-5 against 2^-11 ≈ 4.9e-4)
    assert 0 < gap <= 2.0 ** -11 * moved, (gap, moved)
    assert r16.metrics["ll_reg"] == pytest.approx(r32.metrics["ll_reg"], rel=1e-2)
