"""Pure mathematics of BiG-FL (bilevel graph-aided FL; ALGORITHMS.md §5 with §0.1 C2, seed 000 §10.4).

Everything here is torch (float64 by default) over plain tensors: no Flower, no clients.
Notation (row vectors, ALGORITHMS.md §5.1):

* ``Θ ∈ R^{n×d}`` stacked client models, ``Â ∈ R^{n×n}`` GCN propagation matrix of the client
  graph, ``â = diag(Â)``, ``φ ∈ R^{d×d}`` the upper-level (UL) parameter, ``λ`` one weight for
  both levels (seed 000 eqs. 10.14 and 10.17 use the same symbol).
* UL embedding on *centred* parameters (C2 a)::

      H = Â (Θ − 1 θ̄ᵀ) φ,    θ̄ = (1/n) Σ_i θ_i.

  Clients start from one common model and move little per round, so the raw rows of ``ÂΘφ``
  are almost parallel and every cosine is ≈ 1: the link-prediction loss is saturated and its
  gradient vanishes. Subtracting the mean model leaves only what distinguishes the clients.
  The current mean (not the initial model ``Θ⁰``) is subtracted because the clients' common
  drift away from ``Θ⁰`` grows with the rounds and would make ``Θ − Θ⁰`` parallel again; the
  mean also needs no state and makes ``f`` invariant to a shift shared by all clients.
* UL loss (eqs. 10.14–10.15), ``P_i`` = ``q`` sampled negatives of node ``i``::

      f(φ, Θ) = (1/n) Σ_i Σ_{j∈N_i} (1 − cos(H_i, H_j))
              + (1/n) Σ_i (1/q) Σ_{j∈P_i} max(0, cos(H_i, H_j))
              + (λ/2) ‖φ − I‖_F²

  with ``cos(a, b) = aᵀb / max(‖a‖‖b‖, ε)``: PyTorch's ``CosineEmbeddingLoss`` with margin 0
  (label +1 on edges, −1 on negatives), summed and scaled by ``1/n`` and ``1/(nq)``.
* Lower-level (LL) loss of client i (eqs. 10.17–10.18; the paper's embedding, not centred)::

      g_i = data_i(θ_i) + (λ/2) ‖r_i‖² + (κ/2) ‖θ_i − c_i‖²,
      r_i = m_i + â_i θ_i φ − θ_i,   m_i = Σ_{j≠i} Â_ij θ_j φ,

  with the ridge centre ``c_i`` fixed for the round: 0 in the paper, the round's starting model
  ``θ_i^t`` for the proximal ridge (``bigfl.ridge``; :mod:`graphfl.strategies.bigfl`). ``c_i``
  does not depend on ``φ`` and adds only a constant to ``F``, so ``J_Θ``, ``∂F/∂φ`` and the
  hypergradient below are the same for every centre.

  Its regulariser gradient is ``λ (â_i r_i φᵀ − r_i)`` (§5.3); stacked over clients
  ``F^R(φ, Θ) = λ (diag(â) R φᵀ − R)`` with ``R = ÂΘφ − Θ``. ``g_i`` is strongly convex in
  ``θ_i`` (seed 000 l.245) when ``κ > −λ_min(∇²data_i + λ B_i B_iᵀ)`` (``B_i = â_i φ − I``; the
  regulariser's own block ``λ B_i B_iᵀ`` is positive semi-definite, so ``κ > −λ_min(∇²data_i)``
  suffices) (C2 c).
* Hypergradient (seed eq. 10.20, practical form §5.4): with ``F`` the stacked LL
  pseudo-gradients and ``J_Θ = ∂F/∂Θ`` (not symmetric: the LL is a game)::

      ĝ = ∇_φ f − (∂F/∂φ)ᵀ v,    J_Θᵀ v = ∇_Θ f,

  ``J_Θᵀ p = [∇²data_i p_i]_i + (∂F^R/∂Θ)ᵀ p + κ p``. The linear system is solved to a
  residual tolerance (C2 d) by GMRES (a Krylov method for non-symmetric systems; conjugate
  gradients need a symmetric ``J_Θ``, and the off-diagonal blocks ``λ Â_ij φ B_iᵀ`` are not)
  or by a Neumann series with ``c ≈ 1/‖J_Θ‖`` and ``K ≈ L/μ`` terms; the achieved relative
  residual is reported. GMRES is right-preconditioned by the block diagonal of ``J_Θᵀ``
  (block Jacobi, :func:`block_jacobi`): client i's block is the curvature of ``g_i`` in
  ``θ_i``, ``M_i = sym(∇²data_i) + κI + λ B_i B_iᵀ``, factorised once per hypergradient
  when plain GMRES has not converged within :data:`PLAIN_GMRES_ITERATIONS` iterations.
  Only the client-to-client coupling ``λ Â_ij`` is then left to the Krylov iterations, which
  helps when small or negative client curvatures make the system badly conditioned (a
  system that is nearly singular as a whole still converges slowly: that κ is below the
  LL's curvature deficit, C2 c). Right preconditioning leaves GMRES's residual the true one,
  ``‖J_Θᵀ v − ∇_Θ f‖``: the solution is the same to the tolerance. The Cholesky
  factorisation of the blocks also says whether each client's LL is strongly convex
  (``M_i`` positive definite ⇔ ``ll_min_curvature > 0``, C2 c). ``implicit`` uses the
  clients' data Hessians, ``reg_only`` drops them, ``first_order`` takes ``v = 0``; ``exact``
  (dense solve) exists for tests on tiny problems only.
* UL step (C2 b): ``φ ← φ − α ĝ / ‖ĝ‖_F``, so ``‖Δφ‖_F = α`` per round whatever the scale of
  the cosine loss.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

logger = logging.getLogger(__name__)

HYPERGRAD_MODES = ("implicit", "reg_only", "first_order")
SOLVERS = ("gmres", "neumann")
PRECONDITION = ("auto", "always", "never")
PLAIN_GMRES_ITERATIONS = 25
"""GMRES iterations without preconditioner before ``precondition = "auto"`` factorises the block
Jacobi preconditioner. A well-conditioned implicit system (a κ well above the LL's curvature
deficit) converges within them, and the factorisation (``n`` Cholesky factorisations and
inverses of ``d×d``) would cost more than it saves."""
COS_EPS = 1e-8


# ---------------------------------------------------------------------------------------
# graph pieces
# ---------------------------------------------------------------------------------------


def positive_pairs(adj: np.ndarray) -> np.ndarray:
    """Directed edge list ``(i, j)`` for every ``A_ij > 0`` (each undirected edge twice).

    Returns an ``(E, 2)`` int64 array sorted by ``(i, j)``; the positive term of eq. 10.14
    sums over ``j ∈ N_i`` for every ``i``, so both directions appear.
    """
    i, j = np.nonzero(np.asarray(adj) > 0)
    return np.stack([i, j], axis=1).astype(np.int64)


def sample_negatives(adj: np.ndarray, q: int, rng: np.random.Generator) -> np.ndarray:
    """``q`` negative tails per head node: uniform over non-neighbours ``j ≠ i``.

    Without replacement when a node has at least ``q`` non-neighbours, with replacement
    otherwise; a node adjacent to every other node gets none (its negative term is skipped,
    ALGORITHMS.md §5.8). Returns an ``(M, 2)`` int64 array of ``(head, tail)``.
    """
    a = np.asarray(adj) > 0
    n = a.shape[0]
    out: list[np.ndarray] = []
    for i in range(n):
        cand = np.flatnonzero(~a[i])
        cand = cand[cand != i]
        if cand.size == 0 or q <= 0:
            continue
        tails = rng.choice(cand, size=q, replace=cand.size < q)
        out.append(np.stack([np.full(q, i), tails], axis=1))
    if not out:
        return np.zeros((0, 2), dtype=np.int64)
    return np.concatenate(out).astype(np.int64)


# ---------------------------------------------------------------------------------------
# upper level
# ---------------------------------------------------------------------------------------


def embed(a_hat: torch.Tensor, theta: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """``ÂΘφ`` (eq. 10.13 on raw parameters; the LL regulariser's embedding)."""
    return (a_hat @ theta) @ phi


def ul_embed(a_hat: torch.Tensor, theta: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """UL embedding on centred parameters ``H = Â(Θ − 1θ̄ᵀ)φ`` (module docstring, C2 a)."""
    return embed(a_hat, theta - theta.mean(dim=0, keepdim=True), phi)


def pair_cosines(h: torch.Tensor, pairs: torch.Tensor, eps: float = COS_EPS) -> torch.Tensor:
    """``cos(H_i, H_j) = H_i·H_j / max(‖H_i‖‖H_j‖, ε)`` for each row ``(i, j)`` of ``pairs``."""
    if pairs.numel() == 0:
        return h.new_zeros(0)
    a, b = h[pairs[:, 0]], h[pairs[:, 1]]
    return torch.nn.functional.cosine_similarity(a, b, dim=1, eps=eps)


def ul_loss(
    a_hat: torch.Tensor,
    theta: torch.Tensor,
    phi: torch.Tensor,
    pos: torch.Tensor,
    neg: torch.Tensor,
    q: int,
    lam: float,
) -> torch.Tensor:
    """UL loss ``f(φ, Θ)`` of eq. 10.14 on the centred embedding (see the module docstring).

    Parameters
    ----------
    a_hat, theta, phi
        ``Â`` (n×n), ``Θ`` (n×d), ``φ`` (d×d).
    pos, neg
        ``(E, 2)`` directed edges and ``(M, 2)`` sampled negatives (``q`` per head that has any).
    q
        Negatives per head node (the ``1/q`` of the expectation over ``P_i``).
    lam
        ``λ`` of ``(λ/2)‖φ − I‖_F²`` (the same ``λ`` as the LL regulariser's).
    """
    n = theta.shape[0]
    h = ul_embed(a_hat, theta, phi)
    loss = h.new_zeros(())
    if pos.numel():
        loss = loss + (1.0 - pair_cosines(h, pos)).sum() / n
    if neg.numel():
        loss = loss + torch.clamp(pair_cosines(h, neg), min=0.0).sum() / (n * q)
    eye = torch.eye(phi.shape[0], dtype=phi.dtype, device=phi.device)
    return loss + 0.5 * lam * ((phi - eye) ** 2).sum()


def normalised_step(phi: torch.Tensor, grad: torch.Tensor, alpha: float) -> tuple[torch.Tensor, float]:
    """UL update ``φ − α ĝ/‖ĝ‖_F`` (C2 b); a zero or non-finite ``ĝ`` leaves ``φ`` unchanged.

    Returns the new ``φ`` and the Frobenius length of the step taken (``α`` or 0).
    """
    norm = float(grad.norm())
    if not math.isfinite(norm) or norm == 0.0 or alpha == 0.0:
        return phi.clone(), 0.0
    return phi - (alpha / norm) * grad, float(alpha)


# ---------------------------------------------------------------------------------------
# lower level
# ---------------------------------------------------------------------------------------


def messages(a_hat: torch.Tensor, theta: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """Per-client messages ``m_i = Σ_{j≠i} Â_ij θ_j φ``, stacked: ``(Â − diag(â)) Θ φ``."""
    off = a_hat - torch.diag(torch.diagonal(a_hat))
    return (off @ theta) @ phi


def ll_residual(
    theta_i: torch.Tensor, m_i: torch.Tensor, phi: torch.Tensor, a_ii: float
) -> torch.Tensor:
    """``r_i = m_i + â_i θ_i φ − θ_i`` (eq. 10.18 inside the norm)."""
    return m_i + a_ii * (theta_i @ phi) - theta_i


def ll_reg_grad(
    theta_i: torch.Tensor,
    m_i: torch.Tensor,
    phi: torch.Tensor,
    a_ii: float,
    lam: float,
    kappa: float,
    anchor: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient of ``(λ/2)‖r_i‖² + (κ/2)‖θ_i − c_i‖²`` w.r.t. ``θ_i`` (ALGORITHMS.md §5.3).

    ``λ (â_i r_i φᵀ − r_i) + κ (θ_i − c_i)``; the client adds it to its data-loss gradient in
    every one of its τ local steps (eq. 10.19), with ``m_i``, ``φ`` and the ridge centre
    ``c_i`` (``anchor``; ``None`` = 0, the paper's ``κ‖θ_i‖²``) frozen for the round.
    """
    r = ll_residual(theta_i, m_i, phi, a_ii)
    ridge = theta_i if anchor is None else theta_i - anchor
    return lam * (a_ii * (r @ phi.T) - r) + kappa * ridge


def ll_reg_loss(
    theta_i: torch.Tensor,
    m_i: torch.Tensor,
    phi: torch.Tensor,
    a_ii: float,
    lam: float,
    kappa: float,
    anchor: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(λ/2)‖r_i‖² + (κ/2)‖θ_i − c_i‖²``: the non-data part of the LL loss (eq. 10.17).

    ``c_i = anchor`` is the ridge centre, fixed for the round: ``None`` (= 0) is the paper's
    ``κ‖θ_i‖²``; the client's model at the round start gives the proximal ridge (module
    docstring, "Ridge centre"). A pure tensor function of its arguments.
    """
    r = ll_residual(theta_i, m_i, phi, a_ii)
    ridge = theta_i if anchor is None else theta_i - anchor
    return 0.5 * lam * (r**2).sum() + 0.5 * kappa * (ridge**2).sum()


def reg_pseudo_grad(
    a_hat: torch.Tensor, theta: torch.Tensor, phi: torch.Tensor, lam: float
) -> torch.Tensor:
    """Stacked regulariser gradients ``F^R(φ, Θ) = λ (diag(â) R φᵀ − R)``, ``R = ÂΘφ − Θ``."""
    r = embed(a_hat, theta, phi) - theta
    a_diag = torch.diagonal(a_hat)[:, None]
    return lam * (a_diag * (r @ phi.T) - r)


def min_curvature(
    hessians: torch.Tensor, kappa: float, lam: float = 0.0, a_diag: torch.Tensor | None = None,
    phi: torch.Tensor | None = None,
) -> float:
    """``min_i λ_min(∇²data_i + λ B_i B_iᵀ) + κ``, ``B_i = â_i φ − I``: the smallest curvature of
    any client's LL loss ``g_i`` in its own ``θ_i`` at the uploaded models.

    Positive means every client's LL problem is strongly convex there (seed 000 l.245). Without
    ``a_diag``/``phi`` (or with ``lam = 0``) the regulariser's positive semi-definite block is
    left out, which gives a lower bound. One batched symmetric eigenvalue solve over the
    ``(n, d, d)`` data Hessians.
    """
    sym = 0.5 * (hessians + hessians.transpose(1, 2)).to(torch.float64)
    if lam > 0 and a_diag is not None and phi is not None:
        ph = phi.to(torch.float64)
        a = a_diag.to(torch.float64)[:, None, None]
        eye = torch.eye(ph.shape[0], dtype=torch.float64)
        # B Bᵀ = â² φφᵀ − â (φ + φᵀ) + I
        sym = sym + lam * (a**2 * (ph @ ph.T) - a * (ph + ph.T) + eye)
    lam_min = torch.linalg.eigvalsh(sym)[:, 0]
    return float(lam_min.min()) + float(kappa)


# ---------------------------------------------------------------------------------------
# hypergradient
# ---------------------------------------------------------------------------------------


@dataclass
class HypergradInfo:
    """Diagnostics of one hypergradient evaluation (logged as server metrics)."""

    ul_loss: float = 0.0
    mode: str = "first_order"
    solver: str = ""
    grad_phi_direct_norm: float = 0.0
    correction_norm: float = 0.0
    residual: float = 0.0
    """Relative residual ``‖J_Θᵀ v − ∇_Θ f‖ / ‖∇_Θ f‖`` of the implicit term (0 for first-order)."""
    iterations: int = 0
    converged: bool = True
    neumann_c: float = 0.0
    neumann_halvings: int = 0
    fell_back: bool = False
    preconditioned: bool = False
    not_strongly_convex: list[int] = field(default_factory=list)
    """Clients whose LL block ``M_i`` (:func:`block_jacobi`) is not positive definite; only
    meaningful when the data Hessians were given (``implicit``)."""
    notes: list[str] = field(default_factory=list)


def hypergradient(
    a_hat: torch.Tensor,
    theta: torch.Tensor,
    phi: torch.Tensor,
    pos: torch.Tensor,
    neg: torch.Tensor,
    *,
    q: int,
    lam: float,
    kappa: float,
    mode: str = "implicit",
    hessians: torch.Tensor | None = None,
    solver: str = "gmres",
    tol: float = 1e-6,
    max_iter: int = 300,
    neumann_c: float = 0.0,
    max_halvings: int = 20,
    a_diag: torch.Tensor | None = None,
    precondition: str = "auto",
) -> tuple[torch.Tensor, HypergradInfo]:
    """Hypergradient ``ĝ`` of ``ℓ(φ) = f(φ, Θ*(φ))`` at ``(φ, Θ)`` (seed eq. 10.20, §5.4, C2 d).

    ``ĝ = ∇_φ f − (∂F^R/∂φ)ᵀ v`` with ``J_Θᵀ v = ∇_Θ f`` and
    ``J_Θᵀ p = [H_i p_i]_i + (∂F^R/∂Θ)ᵀ p + κ p`` (``H_i`` = client i's data-loss Hessian).

    Parameters
    ----------
    mode
        ``implicit``: the full ``J_Θ`` with the data Hessians ``hessians`` (``(n, d, d)``;
        ``None`` = zero, which is ``reg_only``). ``reg_only``: without data Hessians.
        ``first_order``: ``v = 0``. ``exact``: dense solve (tests only; ``O((nd)^3)``).
    solver
        ``gmres``: GMRES until the relative residual is at most ``tol`` or ``max_iter``
        iterations. ``neumann``: ``v = c Σ_{k=0..K} (I − c J_Θᵀ)^k ∇_Θ f`` with
        ``K = max_iter`` terms (stopped early once the residual is below ``tol``) and
        ``c = neumann_c`` (0: ``1/ρ̂``, ``ρ̂`` a power-iteration estimate of ``J_Θ``'s spectral
        radius); if a term grows or turns non-finite, ``c`` is halved and the series
        restarted; after ``max_halvings`` halvings ``v = 0`` and ``info.fell_back`` is set.
    tol, max_iter
        Relative residual tolerance and iteration cap of the solver. A solve that stops at
        the cap is used as it is; ``info.converged`` is False and ``info.residual`` says how
        far it got.
    a_diag, precondition
        ``diag(Â)`` (default: taken from ``a_hat``) and when GMRES is right-preconditioned by
        the block Jacobi :func:`block_jacobi`: ``auto`` (default) runs plain GMRES for at
        most :data:`PLAIN_GMRES_ITERATIONS` iterations and, if the tolerance is not met yet,
        continues preconditioned from there with the iterations left; ``always`` from the
        start; ``never`` not at all. The blocks' Cholesky factorisation, when it runs, fills
        ``info.not_strongly_convex`` (and sets ``info.preconditioned``).

    Returns
    -------
    grad, info
        ``ĝ`` (``d×d``, detached) and diagnostics.
    """
    if mode not in HYPERGRAD_MODES + ("exact",):
        raise ValueError(f"hypergrad mode {mode!r} is not valid; choose one of {HYPERGRAD_MODES}")
    if solver not in SOLVERS:
        raise ValueError(f"solver {solver!r} is not valid; choose one of {SOLVERS}")
    info = HypergradInfo(mode=mode)
    phi_v = phi.detach().clone().requires_grad_(True)
    theta_v = theta.detach().clone().requires_grad_(True)
    f = ul_loss(a_hat, theta_v, phi_v, pos, neg, q, lam)
    g_phi, g_theta = torch.autograd.grad(f, (phi_v, theta_v))
    info.ul_loss = float(f.detach())
    info.grad_phi_direct_norm = float(g_phi.norm())
    if mode == "first_order":
        return g_phi.detach(), info

    hess = hessians if mode in ("implicit", "exact") else None
    # F^R is linear in Θ (for fixed φ): build its graph once and reuse it for every VJP.
    theta_r = theta.detach().clone().requires_grad_(True)
    fr_theta = reg_pseudo_grad(a_hat, theta_r, phi.detach(), lam)

    def jt_apply(p: torch.Tensor) -> torch.Tensor:
        (vjp,) = torch.autograd.grad(fr_theta, theta_r, grad_outputs=p, retain_graph=True)
        out = vjp + kappa * p
        if hess is not None:
            out = out + torch.einsum("nij,nj->ni", hess, p.to(hess.dtype)).to(p.dtype)
        return out

    if mode == "exact":
        v = _exact_solve(jt_apply, g_theta)
        info.solver = "exact"
    elif solver == "gmres":
        info.solver = "gmres"
        if precondition not in PRECONDITION:
            raise ValueError(f"precondition {precondition!r} is not valid; choose one of {PRECONDITION}")
        plain = {"never": max_iter, "always": 0}.get(precondition, min(max_iter, PLAIN_GMRES_ITERATIONS))
        v, info.iterations = gmres(jt_apply, g_theta, tol=tol, max_iter=plain)
        left = max_iter - info.iterations
        r = g_theta - jt_apply(v)
        b_norm = float(g_theta.norm())
        if precondition != "never" and left > 0 and float(r.norm()) > tol * b_norm:
            diag = torch.diagonal(a_hat) if a_diag is None else a_diag
            pc = block_jacobi(hess, diag, phi.detach(), lam, kappa)
            info.preconditioned = True
            if hess is not None:
                info.not_strongly_convex = pc.not_positive_definite
            y, k = gmres(lambda z: jt_apply(pc.apply(z)), r, tol=tol * b_norm / float(r.norm()), max_iter=left)
            v, info.iterations = v + pc.apply(y), info.iterations + k
    else:
        info.solver = "neumann"
        c0 = neumann_c if neumann_c > 0 else 1.0 / max(spectral_radius(jt_apply, g_theta), 1e-12)
        v, c, halvings, ok, iters = _neumann(jt_apply, g_theta, max_iter, c0, max_halvings, tol)
        info.neumann_c, info.neumann_halvings, info.iterations = c, halvings, iters
        if not ok:
            info.fell_back = True
            info.converged = False
            info.residual = 1.0
            info.notes.append("neumann series kept diverging; used first-order hypergradient")
            logger.warning(
                "BiG-FL: Neumann series diverged after %d halvings of c; "
                "falling back to the first-order hypergradient this round", halvings
            )
            return g_phi.detach(), info
    gnorm = float(g_theta.norm())
    info.residual = float((jt_apply(v) - g_theta).norm()) / gnorm if gnorm > 0 else 0.0
    info.converged = bool(info.residual <= tol * (1.0 + 1e-9)) or mode == "exact"

    phi_r = phi.detach().clone().requires_grad_(True)
    fr_phi = reg_pseudo_grad(a_hat, theta.detach(), phi_r, lam)
    (corr,) = torch.autograd.grad(fr_phi, phi_r, grad_outputs=v)
    info.correction_norm = float(corr.norm())
    return (g_phi - corr).detach(), info


class BlockJacobi:
    """Block Jacobi preconditioner of ``J_Θᵀ``: ``p ↦ [M_i⁻¹ p_i]_i`` (see :func:`block_jacobi`).

    The blocks are factorised by Cholesky; a block that is not positive definite (its client's
    LL is not strongly convex) is inverted through LU instead, and an exactly singular one is
    left out (identity on its rows). The inverses are kept explicitly, so one application is a
    batched matrix-vector product (a batched triangular solve with one right-hand side is
    several times slower on a CPU).
    """

    def __init__(self, blocks: torch.Tensor) -> None:
        chol, info = torch.linalg.cholesky_ex(blocks)
        bad = torch.nonzero(info != 0).flatten()
        self.not_positive_definite: list[int] = [int(i) for i in bad]
        self.inverse = torch.cholesky_inverse(chol)
        if bad.numel():
            inv, singular = torch.linalg.inv_ex(blocks[bad])
            eye = torch.eye(blocks.shape[-1], dtype=blocks.dtype)
            self.inverse[bad] = torch.where((singular != 0)[:, None, None], eye, inv)

    def apply(self, p: torch.Tensor) -> torch.Tensor:
        """``[M_i⁻¹ p_i]_i`` for ``p`` of shape ``(n, d)`` (returned in ``p``'s dtype)."""
        out = torch.bmm(self.inverse, p.to(self.inverse.dtype)[:, :, None])[:, :, 0]
        return out.to(p.dtype)


def block_jacobi(
    hessians: torch.Tensor | None, a_diag: torch.Tensor, phi: torch.Tensor, lam: float, kappa: float,
) -> BlockJacobi:
    """The block diagonal of ``J_Θᵀ``, factorised: ``M_i = sym(H_i) + κI + λ B_i B_iᵀ``.

    ``B_i B_iᵀ = â_i² φφᵀ − â_i (φ + φᵀ) + I`` is the regulariser's own block (the derivative of
    ``F^R_i`` in ``θ_i``), ``H_i`` client i's data Hessian (``None``: left out, ``reg_only``).
    ``M_i`` is the Hessian of ``g_i`` in ``θ_i``, so it is positive definite exactly when client
    i's LL is strongly convex (:func:`min_curvature` > 0). One batched float64 factorisation
    of ``n`` blocks of ``d×d``; nothing of size ``(nd)²`` is formed.
    """
    ph = phi.to(torch.float64)
    d = ph.shape[0]
    a = a_diag.to(torch.float64)[:, None, None]
    eye = torch.eye(d, dtype=torch.float64)
    blocks = lam * (a**2 * (ph @ ph.T) - a * (ph + ph.T) + eye) + kappa * eye
    if hessians is not None:
        h = hessians.to(torch.float64)
        blocks = blocks + 0.5 * (h + h.transpose(1, 2))
    return BlockJacobi(blocks)


def gmres(
    apply: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, *, tol: float, max_iter: int
) -> tuple[torch.Tensor, int]:
    """Solve ``apply(x) = b`` by GMRES (Saad & Schultz 1986) from ``x = 0``.

    Stops when the true residual ``‖b − apply(x)‖`` is at most ``tol ‖b‖`` or after
    ``max_iter`` iterations in all. A cycle (:func:`_gmres_cycle`) ends when its recurrence
    says the tolerance is met; if the true residual (one extra product) is still above it, GMRES
    restarts on that residual with the iterations left. Returns ``x`` and the iterations run.
    """
    b_norm = float(b.norm())
    x = torch.zeros_like(b)
    used = 0
    r = b
    while used < max_iter and b_norm > 0:
        dx, k = _gmres_cycle(apply, r, tol=tol * b_norm / float(r.norm()), max_iter=max_iter - used)
        x, used = x + dx, used + k
        r = b - apply(x)
        if k == 0 or float(r.norm()) <= tol * b_norm or not bool(torch.isfinite(r).all()):
            break
    return x, used


def _gmres_cycle(
    apply: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, *, tol: float, max_iter: int
) -> tuple[torch.Tensor, int]:
    """One unrestarted GMRES cycle from ``x = 0``.

    Arnoldi with modified Gram–Schmidt and Givens rotations; stops when the recurrence's
    residual is at most ``tol ‖b‖`` or after ``max_iter`` iterations. Memory: ``max_iter``
    vectors of ``b``'s size. Returns ``x`` (``b``'s shape) and the iterations run.
    """
    shape = b.shape
    r = b.reshape(-1)
    beta = float(r.norm())
    if beta == 0.0 or max_iter <= 0:
        return torch.zeros_like(b), 0
    basis = [r / beta]
    h = np.zeros((max_iter + 1, max_iter))
    cs, sn = np.zeros(max_iter), np.zeros(max_iter)
    g = np.zeros(max_iter + 1)
    g[0] = beta
    k = 0
    for j in range(max_iter):
        w = apply(basis[j].view(shape)).reshape(-1)
        for i in range(j + 1):
            h[i, j] = float(w @ basis[i])
            w = w - h[i, j] * basis[i]
        h[j + 1, j] = float(w.norm())
        for i in range(j):  # earlier rotations on the new column
            a_, b_ = h[i, j], h[i + 1, j]
            h[i, j], h[i + 1, j] = cs[i] * a_ + sn[i] * b_, -sn[i] * a_ + cs[i] * b_
        denom = math.hypot(h[j, j], h[j + 1, j])
        cs[j], sn[j] = (1.0, 0.0) if denom == 0.0 else (h[j, j] / denom, h[j + 1, j] / denom)
        breakdown = h[j + 1, j] <= 1e-14 * beta
        h[j, j], h[j + 1, j] = denom, 0.0
        g[j + 1], g[j] = -sn[j] * g[j], cs[j] * g[j]
        k = j + 1
        if abs(g[j + 1]) <= tol * beta or breakdown or not math.isfinite(g[j + 1]):
            break
        basis.append(w / float(w.norm()))
    y = np.zeros(k)
    for i in range(k - 1, -1, -1):  # back substitution on the k×k triangle
        y[i] = (g[i] - h[i, i + 1 : k] @ y[i + 1 : k]) / h[i, i] if h[i, i] != 0.0 else 0.0
    x = torch.zeros_like(r)
    for i in range(k):
        x = x + float(y[i]) * basis[i]
    return x.view(shape), k


def spectral_radius(apply: Callable[[torch.Tensor], torch.Tensor], like: torch.Tensor, iters: int = 30) -> float:
    """Power-iteration estimate of the largest ``|eigenvalue|`` of the operator ``apply``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(like.shape, generator=gen, dtype=like.dtype)
    x = x / x.norm()
    est = 0.0
    for _ in range(iters):
        y = apply(x)
        est = float(y.norm())
        if est == 0.0 or not math.isfinite(est):
            break
        x = y / est
    return est


def _neumann(
    jt_apply: Callable[[torch.Tensor], torch.Tensor], g_theta: torch.Tensor, k: int, c0: float,
    max_halvings: int, tol: float,
) -> tuple[torch.Tensor, float, int, bool, int]:
    """Neumann series ``v = c Σ_{k=0..K} (I − c J_Θᵀ)^k ∇_Θ f`` with safeguard.

    The residual of the partial sum is ``‖(I − cJ_Θᵀ)^{k+1} ∇_Θ f‖``, the next term's ``p``,
    so the series stops once ``‖p‖ ≤ tol ‖∇_Θ f‖``.
    """
    c = float(c0)
    b = float(g_theta.norm())
    for halvings in range(max_halvings + 1):
        p = g_theta.clone()
        v = c * p
        prev = b
        ok = True
        iters = 0
        for _ in range(k):
            p = p - c * jt_apply(p)
            iters += 1
            cur = float(p.norm())
            if not math.isfinite(cur) or cur > prev * (1.0 + 1e-9) + 1e-300:
                ok = False
                break
            v = v + c * p
            prev = cur
            if cur <= tol * b:
                break
        if ok and bool(torch.isfinite(v).all()):
            return v, c, halvings, True, iters
        c *= 0.5
    return torch.zeros_like(g_theta), c, max_halvings, False, 0


def _exact_solve(jt_apply: Callable[[torch.Tensor], torch.Tensor], g_theta: torch.Tensor) -> torch.Tensor:
    """Solve ``J_Θᵀ v = ∇_Θ f`` densely (tiny problems only)."""
    n, d = g_theta.shape
    size = n * d
    if size > 4096:
        raise ValueError(f"exact hypergradient only for n*d <= 4096 (got {size})")
    cols = []
    for idx in range(size):
        e = torch.zeros(size, dtype=g_theta.dtype)
        e[idx] = 1.0
        cols.append(jt_apply(e.view(n, d)).reshape(-1))
    jt = torch.stack(cols, dim=1)  # jt[:, idx] = J_Θᵀ e_idx
    v: torch.Tensor = torch.linalg.solve(jt, g_theta.reshape(-1)).view(n, d)
    return v
