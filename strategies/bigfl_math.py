"""Pure mathematics of BiG-FL (bilevel graph-aided FL; ALGORITHMS.md §5, seed 000 §10.4).

Everything here is torch (float64 by default) over plain tensors: no Flower, no clients.
Notation (row vectors, ALGORITHMS.md §5.1):

* ``Θ ∈ R^{n×d}`` stacked client models, ``Â ∈ R^{n×n}`` GCN propagation matrix of the client
  graph, ``â = diag(Â)``, ``φ ∈ R^{d×d}`` the upper-level (UL) parameter.
* Embedding ``H = Â Θ φ`` (eq. 10.13).
* UL loss (eqs. 10.14–10.15), ``P_i`` = ``q`` sampled negatives of node ``i``::

      f(φ, Θ) = (1/n) Σ_i Σ_{j∈N_i} (1 − cos(H_i, H_j))
              + (1/n) Σ_i (1/q) Σ_{j∈P_i} max(0, cos(H_i, H_j))
              + (λ_UL/2) ‖φ − I‖_F²

  with ``cos(a, b) = aᵀb / max(‖a‖‖b‖, ε)``. This is PyTorch's ``CosineEmbeddingLoss`` with
  margin 0 (label +1 on edges, −1 on negatives), summed and scaled by ``1/n`` and ``1/(nq)``.
* Lower-level (LL) loss of client i (eqs. 10.17–10.18)::

      g_i = data_i(θ_i) + (λ_LL/2) ‖r_i‖² + (κ/2) ‖θ_i‖²,
      r_i = m_i + â_i θ_i φ − θ_i,   m_i = Σ_{j≠i} Â_ij θ_j φ.

  Its regulariser gradient is ``λ_LL (â_i r_i φᵀ − r_i)`` (§5.3); stacked over clients
  ``F^R(φ, Θ) = λ_LL (diag(â) R φᵀ − R)`` with ``R = ÂΘφ − Θ``.
* Hypergradient (seed eq. 10.20, practical form §5.4): with ``F`` the stacked LL
  pseudo-gradients and ``J_Θ = ∂F/∂Θ``::

      ∇ℓ(φ) = ∇_φ f − (∂F/∂φ)ᵀ v,    v = J_Θ^{-ᵀ} ∇_Θ f,

  ``v`` by a truncated Neumann series (``neumann``), the same without the clients' data
  Hessians (``reg_only``), or ``v = 0`` (``first_order``). ``exact`` (dense solve) exists for
  tests on tiny problems only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

logger = logging.getLogger(__name__)

HYPERGRAD_MODES = ("neumann", "reg_only", "first_order")
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
    """``H = Â Θ φ`` (eq. 10.13)."""
    return (a_hat @ theta) @ phi


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
    lambda_ul: float,
) -> torch.Tensor:
    """UL loss ``f(φ, Θ)`` of eq. 10.14 (see the module docstring).

    Parameters
    ----------
    a_hat, theta, phi
        ``Â`` (n×n), ``Θ`` (n×d), ``φ`` (d×d).
    pos, neg
        ``(E, 2)`` directed edges and ``(M, 2)`` sampled negatives (``q`` per head that has any).
    q
        Negatives per head node (the ``1/q`` of the expectation over ``P_i``).
    lambda_ul
        Weight of ``(λ_UL/2)‖φ − I‖_F²``.
    """
    n = theta.shape[0]
    h = embed(a_hat, theta, phi)
    loss = h.new_zeros(())
    if pos.numel():
        loss = loss + (1.0 - pair_cosines(h, pos)).sum() / n
    if neg.numel():
        loss = loss + torch.clamp(pair_cosines(h, neg), min=0.0).sum() / (n * q)
    eye = torch.eye(phi.shape[0], dtype=phi.dtype, device=phi.device)
    return loss + 0.5 * lambda_ul * ((phi - eye) ** 2).sum()


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
    lambda_ll: float,
    kappa: float,
) -> torch.Tensor:
    """Gradient of ``(λ_LL/2)‖r_i‖² + (κ/2)‖θ_i‖²`` w.r.t. ``θ_i`` (ALGORITHMS.md §5.3).

    ``λ_LL (â_i r_i φᵀ − r_i) + κ θ_i``; the client adds it to its data-loss gradient in every
    one of its τ local steps (eq. 10.19), with ``m_i`` and ``φ`` frozen for the round.
    """
    r = ll_residual(theta_i, m_i, phi, a_ii)
    return lambda_ll * (a_ii * (r @ phi.T) - r) + kappa * theta_i


def ll_reg_loss(
    theta_i: torch.Tensor,
    m_i: torch.Tensor,
    phi: torch.Tensor,
    a_ii: float,
    lambda_ll: float,
    kappa: float,
) -> torch.Tensor:
    """``(λ_LL/2)‖r_i‖² + (κ/2)‖θ_i‖²`` (the non-data part of eq. 10.17)."""
    r = ll_residual(theta_i, m_i, phi, a_ii)
    return 0.5 * lambda_ll * (r**2).sum() + 0.5 * kappa * (theta_i**2).sum()


def reg_pseudo_grad(
    a_hat: torch.Tensor, theta: torch.Tensor, phi: torch.Tensor, lambda_ll: float
) -> torch.Tensor:
    """Stacked regulariser gradients ``F^R(φ, Θ) = λ_LL (diag(â) R φᵀ − R)``, ``R = ÂΘφ − Θ``."""
    r = embed(a_hat, theta, phi) - theta
    a_diag = torch.diagonal(a_hat)[:, None]
    return lambda_ll * (a_diag * (r @ phi.T) - r)


# ---------------------------------------------------------------------------------------
# hypergradient
# ---------------------------------------------------------------------------------------


@dataclass
class HypergradInfo:
    """Diagnostics of one hypergradient evaluation (logged as server metrics)."""

    ul_loss: float = 0.0
    mode: str = "first_order"
    grad_phi_direct_norm: float = 0.0
    correction_norm: float = 0.0
    neumann_c: float = 0.0
    neumann_halvings: int = 0
    fell_back: bool = False
    notes: list[str] = field(default_factory=list)


def hypergradient(
    a_hat: torch.Tensor,
    theta: torch.Tensor,
    phi: torch.Tensor,
    pos: torch.Tensor,
    neg: torch.Tensor,
    *,
    q: int,
    lambda_ul: float,
    lambda_ll: float,
    kappa: float,
    mode: str = "neumann",
    hessians: torch.Tensor | None = None,
    neumann_k: int = 3,
    neumann_c: float = 1e-3,
    max_halvings: int = 20,
) -> tuple[torch.Tensor, HypergradInfo]:
    """Hypergradient ``ĝ_φ`` of ``ℓ(φ) = f(φ, Θ*(φ))`` at ``(φ, Θ)`` (seed eq. 10.20, §5.4).

    ``ĝ_φ = ∇_φ f − (∂F^R/∂φ)ᵀ v`` with ``v ≈ J_Θ^{-ᵀ} ∇_Θ f`` and
    ``J_Θᵀ p = [H_i p_i]_i + (∂F^R/∂Θ)ᵀ p + κ p`` (``H_i`` = client i's data-loss Hessian).

    Parameters
    ----------
    mode
        ``neumann``: ``p ← ∇_Θ f; v ← c p; K times: p ← p − c J_Θᵀ p; v ← v + c p``, with
        the data Hessians ``hessians`` (``(n, d, d)``; ``None`` = zero, which is ``reg_only``).
        If a Neumann term grows in norm or turns non-finite, ``c`` is halved and the series
        restarted (safeguard of §5.4); after ``max_halvings`` halvings ``v = 0``
        (first-order) is used and ``info.fell_back`` is set.
        ``reg_only``: the same series without data Hessians. ``first_order``: ``v = 0``.
        ``exact``: dense solve of ``J_Θᵀ v = ∇_Θ f`` (tests only; ``O((nd)^3)``).
    neumann_k, neumann_c
        ``K`` and ``c`` of the series. ``K = 0, c = β`` is the one-step unrolled approximation.

    Returns
    -------
    grad, info
        ``ĝ_φ`` (``d×d``, detached) and diagnostics.
    """
    if mode not in HYPERGRAD_MODES + ("exact",):
        raise ValueError(f"hypergrad mode {mode!r} is not valid; choose one of {HYPERGRAD_MODES}")
    info = HypergradInfo(mode=mode)
    phi_v = phi.detach().clone().requires_grad_(True)
    theta_v = theta.detach().clone().requires_grad_(True)
    f = ul_loss(a_hat, theta_v, phi_v, pos, neg, q, lambda_ul)
    g_phi, g_theta = torch.autograd.grad(f, (phi_v, theta_v))
    info.ul_loss = float(f.detach())
    info.grad_phi_direct_norm = float(g_phi.norm())
    if mode == "first_order":
        return g_phi.detach(), info

    hess = hessians if mode in ("neumann", "exact") else None
    # F^R is linear in Θ (for fixed φ): build its graph once and reuse it for every VJP.
    theta_r = theta.detach().clone().requires_grad_(True)
    fr_theta = reg_pseudo_grad(a_hat, theta_r, phi.detach(), lambda_ll)

    def jt_apply(p: torch.Tensor) -> torch.Tensor:
        (vjp,) = torch.autograd.grad(fr_theta, theta_r, grad_outputs=p, retain_graph=True)
        out = vjp + kappa * p
        if hess is not None:
            out = out + torch.einsum("nij,nj->ni", hess, p.to(hess.dtype)).to(p.dtype)
        return out

    if mode == "exact":
        v = _exact_solve(jt_apply, g_theta)
    else:
        v, c, halvings, ok = _neumann(jt_apply, g_theta, neumann_k, neumann_c, max_halvings)
        info.neumann_c, info.neumann_halvings = c, halvings
        if not ok:
            info.fell_back = True
            info.notes.append("neumann series kept diverging; used first-order hypergradient")
            logger.warning(
                "BiG-FL: Neumann series diverged after %d halvings of c; "
                "falling back to the first-order hypergradient this round", halvings
            )
            return g_phi.detach(), info

    phi_r = phi.detach().clone().requires_grad_(True)
    fr_phi = reg_pseudo_grad(a_hat, theta.detach(), phi_r, lambda_ll)
    (corr,) = torch.autograd.grad(fr_phi, phi_r, grad_outputs=v)
    info.correction_norm = float(corr.norm())
    return (g_phi - corr).detach(), info


def _neumann(
    jt_apply: Callable[[torch.Tensor], torch.Tensor], g_theta: torch.Tensor, k: int, c0: float, max_halvings: int,
) -> tuple[torch.Tensor, float, int, bool]:
    """Truncated Neumann series ``v = c Σ_{k=0..K} (I − c J_Θᵀ)^k ∇_Θ f`` with safeguard."""
    c = float(c0)
    for halvings in range(max_halvings + 1):
        p = g_theta.clone()
        v = c * p
        prev = float(p.norm())
        ok = True
        for _ in range(k):
            p = p - c * jt_apply(p)
            cur = float(p.norm())
            if not math.isfinite(cur) or cur > prev * (1.0 + 1e-9) + 1e-300:
                ok = False
                break
            v = v + c * p
            prev = cur
        if ok and bool(torch.isfinite(v).all()):
            return v, c, halvings, True
        c *= 0.5
    return torch.zeros_like(g_theta), c, max_halvings, False


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
