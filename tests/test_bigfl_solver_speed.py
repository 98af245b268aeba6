"""BiG-FL's implicit solve: block-Jacobi preconditioned GMRES gives the same hypergradient as
plain GMRES and the dense solve, in far fewer iterations when the LL is nearly singular; its
Cholesky factorisation reports, every round, which clients' LL is not strongly convex
(ALGORITHMS.md §0.1 C2 c, d)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphfl.common.config import RunConfig
from graphfl.common.core import ServerContext
from graphfl.common.types import ClientUpdate
from graphfl.strategies import bigfl as bg
from graphfl.strategies import bigfl_math as bm

N, D, Q, LAM = 12, 16, 3, 0.1


def _problem(kappa: float, min_eig: float = -0.05, bad: int | None = None, seed: int = 0) -> dict:
    """A random BiG-FL problem: ring-plus-chords graph, data Hessians with eigenvalues in
    ``[min_eig, 2]`` (client ``bad``'s lowest eigenvalue −1: its LL block is indefinite)."""
    rng = np.random.default_rng(seed)
    adj = np.zeros((N, N))
    for i in range(N):
        for j in (i + 1, i + 3):
            adj[i, j % N] = adj[j % N, i] = 1.0
    a = adj + np.eye(N)
    s = 1.0 / np.sqrt(a.sum(1))
    hess = []
    for i in range(N):
        q, _ = np.linalg.qr(rng.standard_normal((D, D)))
        eig = rng.uniform(min_eig, 2.0, D)
        eig[0] = -1.0 if i == bad else min_eig
        hess.append(q @ np.diag(eig) @ q.T)
    return {
        "a_hat": torch.tensor(s[:, None] * a * s[None, :]),
        "theta": torch.tensor(rng.standard_normal((N, D))),
        "phi": torch.eye(D, dtype=torch.float64) + 0.1 * torch.tensor(rng.standard_normal((D, D))),
        "pos": torch.tensor(bm.positive_pairs(adj)),
        "neg": torch.tensor(bm.sample_negatives(adj, Q, np.random.default_rng(1))),
        "hess": torch.tensor(np.stack(hess)),
        "kappa": kappa,
    }


def _grad(p: dict, **kw) -> tuple[torch.Tensor, bm.HypergradInfo]:
    return bm.hypergradient(p["a_hat"], p["theta"], p["phi"], p["pos"], p["neg"], q=Q, lam=LAM,
                            kappa=p["kappa"], hessians=p["hess"], **kw)


def test_preconditioned_gmres_equals_plain_gmres_and_the_dense_solve_in_fewer_iterations():
    p = _problem(kappa=0.06)  # λ_min of every LL block ≈ 0.01: nearly singular, as a small κ makes it
    pre, ipre = _grad(p, tol=1e-12, max_iter=3000, precondition="always")
    plain, iplain = _grad(p, tol=1e-12, max_iter=3000, precondition="never")
    auto, iauto = _grad(p, tol=1e-12, max_iter=3000)  # plain first, preconditioned after the budget
    exact, _ = _grad(p, mode="exact")
    assert ipre.converged and iplain.converged and ipre.preconditioned and not iplain.preconditioned
    assert torch.allclose(pre, plain, rtol=1e-6, atol=1e-12)
    assert torch.allclose(pre, exact, rtol=1e-6, atol=1e-12)
    assert iauto.converged and iauto.preconditioned and torch.allclose(auto, exact, rtol=1e-6, atol=1e-12)
    assert iauto.iterations < iplain.iterations
    assert ipre.correction_norm > 1e-3 * ipre.grad_phi_direct_norm  # the implicit term is not negligible
    assert ipre.iterations * 5 <= iplain.iterations, (ipre.iterations, iplain.iterations)
    assert ipre.iterations <= 30
    assert ipre.not_strongly_convex == []


def test_indefinite_block_is_named_and_the_solve_stays_exact():
    p = _problem(kappa=0.3, bad=4)  # client 4: λ_min(H_4) = −1 < −κ − λ‖B_4‖²
    g, info = _grad(p, tol=1e-12, max_iter=3000, precondition="always")
    exact, _ = _grad(p, mode="exact")
    assert info.not_strongly_convex == [4]
    assert info.converged and torch.allclose(g, exact, rtol=1e-6, atol=1e-12)
    curv = bm.min_curvature(p["hess"], p["kappa"], LAM, torch.diagonal(p["a_hat"]), p["phi"])
    assert curv < 0  # the same verdict as the eigenvalue check


def test_block_jacobi_inverts_the_diagonal_blocks_of_the_operator():
    p = _problem(kappa=0.3)
    pc = bm.block_jacobi(p["hess"], torch.diagonal(p["a_hat"]), p["phi"], LAM, p["kappa"])
    # the dense J_Θᵀ of the exact solver, restricted to client 0's block
    cols = []
    for idx in range(D):
        e = torch.zeros(N, D, dtype=torch.float64)
        e[0, idx] = 1.0
        cols.append(_jt(p, e)[0])
    block0 = torch.stack(cols, dim=1)
    y = torch.zeros(N, D, dtype=torch.float64)
    y[0] = torch.arange(1.0, D + 1, dtype=torch.float64)
    assert torch.allclose(block0 @ pc.apply(y)[0], y[0], rtol=1e-9, atol=1e-9)


def _jt(p: dict, e: torch.Tensor) -> torch.Tensor:
    """``J_Θᵀ e`` as the hypergradient applies it (regulariser VJP + κ + data Hessian)."""
    theta = p["theta"].clone().requires_grad_(True)
    fr = bm.reg_pseudo_grad(p["a_hat"], theta, p["phi"], LAM)
    (vjp,) = torch.autograd.grad(fr, theta, grad_outputs=e)
    return vjp + p["kappa"] * e + torch.einsum("nij,nj->ni", p["hess"], e)


TEMPLATE = {"l1.weight": np.zeros((2, 2), dtype=np.float32), "l2.weight": np.ones(3, dtype=np.float32)}


def _core(**params) -> bg.BiGFLCore:
    ctx = ServerContext(config=RunConfig(), params=bg.BiGFLParams(**params), num_clients=4,
                        initial_arrays=TEMPLATE, param_keys=tuple(TEMPLATE),
                        num_examples={i: 10 for i in range(4)}, client_graph=_adj4(), seed=0)
    return bg.BiGFLCore(ctx)


def _adj4() -> np.ndarray:
    a = np.zeros((4, 4))
    for i, j in [(0, 1), (2, 3), (1, 2)]:
        a[i, j] = a[j, i] = 1.0
    return a


def _updates(core: bg.BiGFLCore, hess: list[float], seed: int) -> dict[int, ClientUpdate]:
    rng = np.random.default_rng(seed)
    ups = {}
    for i in range(4):
        arrays = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in TEMPLATE.items()}
        arrays[bg.HESS_KEY] = (hess[i] * np.eye(core.dim)).astype(np.float32)
        ups[i] = ClientUpdate(i, arrays, 10)
    return ups


def test_well_conditioned_solve_stays_plain():
    p = _problem(kappa=1.0, min_eig=0.5)
    g, info = _grad(p, tol=1e-10, max_iter=300)
    exact, _ = _grad(p, mode="exact")
    assert info.converged and not info.preconditioned and info.iterations <= bm.PLAIN_GMRES_ITERATIONS
    assert torch.allclose(g, exact, rtol=1e-6, atol=1e-12)


def test_unknown_precondition_is_an_error():
    with pytest.raises(ValueError, match="precondition"):
        _grad(_problem(kappa=1.0), precondition="sometimes")


def test_core_reports_strong_convexity_and_the_deficit_in_the_round_it_is_lost(monkeypatch):
    # on this 4-client toy problem plain GMRES converges within its budget; a budget of 0 makes
    # every round take the preconditioned path, as a badly conditioned B2 round does
    monkeypatch.setattr(bm, "PLAIN_GMRES_ITERATIONS", 0)
    core = _core(kappa=0.2, curvature_every=10)
    m1 = core.aggregate_train(1, _updates(core, [0.1] * 4, 1))
    assert m1["ll_strongly_convex"] == 1 and m1["ll_not_strongly_convex_clients"] == 0
    assert m1["ll_min_curvature"] > 0
    # round 2 is not a scheduled check (every 10 rounds), but two clients' LL lost strong convexity
    m2 = core.aggregate_train(2, _updates(core, [0.1, -0.9, 0.1, -0.9], 2))
    assert m2["ll_strongly_convex"] == 0 and m2["ll_not_strongly_convex_clients"] == 2
    assert m2["ll_min_curvature"] < 0  # this round's value, not round 1's
    assert m2["implicit_converged"] == 1


def test_a_core_pickled_without_the_new_attribute_still_runs(monkeypatch):
    monkeypatch.setattr(bm, "PLAIN_GMRES_ITERATIONS", 0)
    core = _core(kappa=0.2)
    del core.__dict__["_curvature_round"]
    m = core.aggregate_train(1, _updates(core, [0.1, -0.9, 0.1, 0.1], 3))
    assert m["ll_strongly_convex"] == 0 and m["ll_min_curvature"] == pytest.approx(
        bm.min_curvature(core.hessians, 0.2, core.params.lam, torch.as_tensor(core.a_diag),
                         torch.eye(core.dim, dtype=torch.float64)), rel=1e-6)


def test_a_checkpoint_written_before_a_config_key_existed_resumes_while_the_key_keeps_its_default():
    from graphfl.common.config import parse_run_config
    from graphfl.server import checkpoint

    base = {"strategy": "bigfl", "task": "synthetic-multicenter-smooth", "nodes": 4, "rounds": 3}
    cfg = parse_run_config(base)
    old = {k: v for k, v in checkpoint.fingerprint(cfg).items() if k != "data.client-samples"}
    checkpoint.check_config({"config": old, "round": 1}, cfg)  # the new key at its default: resumes
    with pytest.raises(checkpoint.CheckpointError, match="data.client-samples"):
        checkpoint.check_config({"config": old, "round": 1}, parse_run_config({**base, "data.client-samples": 50}))
    with pytest.raises(checkpoint.CheckpointError, match="bigfl.kappa"):
        checkpoint.check_config({"config": old, "round": 1}, parse_run_config({**base, "bigfl.kappa": 1.0}))
