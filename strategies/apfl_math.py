"""Pure update rules of APFL, FedGATE and APFLGate (ALGORITHMS.md §9; seed 004).

numpy only; the client halves (``client/gate_trainer.py``) and the server core
(:mod:`graphfl.strategies.fedgate`) call these, and tests check them by hand.

Notation (§9): ``w`` global model, ``w_i`` client i's copy of it during a round, ``v_i`` its
personal model, ``α_i`` its mixing weight, ``δ_i`` its gradient-tracking correction,
``η`` the local step size, ``γ`` the server step, ``τ`` the variance-reduction parameter,
``R`` the number of local steps a client ran in the round.

Stability of the δ update (ALGORITHMS.md §0.1 C5, derived): with a gradient that changes little
over the round, ``u_i ≈ ηR(g_i − δ_i)``, so ``δ_i ← δ_i + (u_i − ū)/(ητ)`` becomes
``δ_i ← (1 − R/τ) δ_i + (R/τ)(g_i − ḡ)``: a linear recursion with factor ``1 − R/τ``, which
converges only for ``|1 − R/τ| < 1``, i.e. ``τ > R/2``. ``τ = R`` (FedTorch: it divides by the
local steps run) sets ``δ_i`` to the last round's gradient difference in one step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from graphfl.common.types import Arrays

TAU_MODES = ("absolute", "multiple-of-steps")
"""How a configured ``tau`` is read: as ``τ`` itself, or as a factor of the local steps ``R``."""


def effective_tau(tau: float, mode: str, steps: int) -> float:
    """``τ`` of the δ update for a configured ``tau`` after ``steps`` (= R) local steps.

    ``tau = 0`` means ``τ = R`` in both modes (FedTorch's rule); otherwise ``τ = tau``
    (``absolute``) or ``τ = tau · R`` (``multiple-of-steps``). Raises ``ValueError`` for an
    unknown mode or ``R < 1``.
    """
    if mode not in TAU_MODES:
        raise ValueError(f"tau mode {mode!r} is not valid; choose one of {list(TAU_MODES)}")
    if steps < 1:
        raise ValueError(f"the δ update needs at least one local step, got R = {steps}")
    if tau == 0:
        return float(steps)
    return float(tau) * steps if mode == "multiple-of-steps" else float(tau)


def delta_contraction(tau: float, steps: int) -> float:
    """Factor ``1 − R/τ`` of the linearised δ recursion (module doc); stable iff ``|·| < 1``."""
    return 1.0 - steps / tau


def tau_problem(key: str, tau: float, mode: str, steps: int) -> str | None:
    """Why ``key = tau`` (read as ``mode``) is refused after ``steps`` local steps, or ``None``.

    Refused: ``τ ≤ R/2`` (``τ`` from :func:`effective_tau`), where ``|1 − R/τ| ≥ 1`` and the
    δ recursion does not converge (module doc; ALGORITHMS.md §0.1 C5).
    """
    t = effective_tau(tau, mode, steps)
    if t > steps / 2.0 and math.isfinite(t):
        return None
    shown = f"{tau:g} × R = {t:g}" if mode == "multiple-of-steps" else f"{t:g}"
    return (f"{key} = {tau:g} ({mode}) gives τ = {shown} with R = train.local-steps = {steps}, "
            f"but τ must exceed R/2 = {steps / 2.0:g}: the δ update δ ← (1 − R/τ)δ + (R/τ)(g_i − ḡ) "
            f"has factor 1 − R/τ = {delta_contraction(t, steps):g} and is unstable by construction; "
            "set it above the bound, or to 0 for τ = R (the local steps run)")


def client_update(w: Mapping[str, np.ndarray], w_i: Mapping[str, np.ndarray]) -> Arrays:
    """``u_i = w − w_i`` (FedGATE's ``Δ_i``, APFLGate's ``u_i``; §9.2, §9.3), in float64."""
    return {k: np.asarray(w[k], dtype=np.float64) - np.asarray(w_i[k], dtype=np.float64) for k in w}


def mean_update(updates: Sequence[Mapping[str, np.ndarray]]) -> Arrays:
    """``ū = (1/|S|) Σ_{i∈S} u_i`` (uniform weights, as FedTorch; §9.2), in float64.

    Terms are added in the order given (reproducible).
    """
    if not updates:
        raise ValueError("mean_update of no updates")
    out: Arrays = {}
    for key in updates[0]:
        acc = np.zeros(np.shape(updates[0][key]), dtype=np.float64)
        for u in updates:
            acc += np.asarray(u[key], dtype=np.float64)
        out[key] = acc / len(updates)
    return out


def server_step(w: Mapping[str, np.ndarray], u_bar: Mapping[str, np.ndarray], gamma: float) -> Arrays:
    """``w ← w − γ ū`` (§9.2 server; with ``γ = 1`` the plain average of the ``w_i``).

    Computed in float64 and cast back to each array's dtype.
    """
    return {k: (np.asarray(w[k], dtype=np.float64) - gamma * np.asarray(u_bar[k], dtype=np.float64))
            .astype(np.asarray(w[k]).dtype) for k in w}


def delta_update(delta: Mapping[str, np.ndarray], u_i: Mapping[str, np.ndarray],
                 u_bar: Mapping[str, np.ndarray], eta: float, tau: float) -> Arrays:
    """``δ_i ← δ_i + (Q(Δ_i) − Δ) / (η τ)`` (§9.2; APFLGate: ``(w̄ − w_i)/(ητ)``, §9.3).

    ``u_i`` is what the server received from client i (``Q(Δ_i)``), ``u_bar`` the server's
    mean. With full participation and no compression ``Σ_i (u_i − ū) = 0``, so ``Σ_i δ_i``
    stays 0 (the FedGATE invariant). Raises ``ValueError`` for ``η τ ≤ 0``.
    """
    scale = float(eta) * float(tau)
    if not scale > 0:
        raise ValueError(f"the δ update needs η·τ > 0, got η={eta}, τ={tau}")
    return {k: np.asarray(delta[k], dtype=np.float64)
            + (np.asarray(u_i[k], dtype=np.float64) - np.asarray(u_bar[k], dtype=np.float64)) / scale
            for k in delta}


def corrected_gradient(grad: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """FedGATE's local direction ``d = g − δ_i``; the step is ``w_i ← w_i − η d`` (§9.2)."""
    out: np.ndarray = np.asarray(grad) - np.asarray(delta)
    return out


def mix_outputs(h_v: np.ndarray, h_w: np.ndarray, alpha: float) -> np.ndarray:
    """APFL's personalised output ``ŷ = α h(v_i; x) + (1 − α) h(w; x)`` (§9.1, seed 004)."""
    out: np.ndarray = alpha * np.asarray(h_v) + (1.0 - alpha) * np.asarray(h_w)
    return out


def alpha_gradient(dloss_dyhat: np.ndarray, h_v: np.ndarray, h_w: np.ndarray) -> float:
    """``∂ℓ(ŷ)/∂α = ⟨∂ℓ/∂ŷ, h(v_i; x) − h(w; x)⟩`` for output mixing (§9.1, paper rule (3)
    written for the output mixture, which is what is trained here).
    """
    return float(np.sum(np.asarray(dloss_dyhat, dtype=np.float64)
                        * (np.asarray(h_v, dtype=np.float64) - np.asarray(h_w, dtype=np.float64))))


def alpha_step(alpha: float, grad: float, lr: float) -> float:
    """``α_i ← clip_[0,1](α_i − η_α ∂ℓ/∂α)`` (APFL adaptive α, §9.1)."""
    return float(np.clip(alpha - lr * grad, 0.0, 1.0))
