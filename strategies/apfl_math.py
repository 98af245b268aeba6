"""Pure update rules of APFL, FedGATE and APFLGate (ALGORITHMS.md §9; seed 004).

numpy only; the client halves (``client/gate_trainer.py``) and the server core
(:mod:`graphfl.strategies.fedgate`) call these, and tests check them by hand.

Notation (§9): ``w`` global model, ``w_i`` client i's copy of it during a round, ``v_i`` its
personal model, ``α_i`` its mixing weight, ``δ_i`` its gradient-tracking correction,
``η`` the local step size, ``γ`` the server step, ``τ`` the variance-reduction parameter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from graphfl.common.types import Arrays


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
