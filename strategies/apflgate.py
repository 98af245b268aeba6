"""APFLGate: APFL's personalisation with FedGATE's gradient tracking (ALGORITHMS.md §9.3; seed 004).

Each local step: ``w_i ← w_i − η (∇f_i(w_i; ξ) − δ_i)`` (FedGATE) and
``v_i ← v_i − η ∇_{v_i} ℓ(α_i h(v_i; x) + (1 − α_i) h(w_i; x), y)`` (APFL); the server forms
``ū`` and ``w ← w − γ ū`` and broadcasts both (:class:`~graphfl.strategies.fedgate.GateCore`);
the client then sets ``δ_i ← δ_i + (u_i − ū)/(η τ)`` with the free variance-reduction
parameter ``τ`` (poster grid 0.1…100; "lower τ means more gradient tracking").
Inference: ``α_i h(v_i; x) + (1 − α_i) h(w; x)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from graphfl.common.registry import AlgorithmSpec, register
from graphfl.strategies.fedgate import GateCore


@dataclass(frozen=True)
class APFLGateParams:
    """APFLGate hyperparameters (§9.3; defaults: the poster's best BBBP cell τ = 10, APFL's α).

    Attributes
    ----------
    alpha
        Mixing weight ``α_i`` (poster grid {0.1, 0.25, 0.5, 0.75, 0.9}; higher = more personal).
    tau
        Variance-reduction parameter ``τ`` of the δ update; 0 = the local step count.
    gamma
        Server step ``γ``.
    adaptive_alpha, alpha_lr
        As in APFL (optional; off in the poster's tables).
    """

    alpha: float = field(default=0.5, metadata={"min": 0.0, "max": 1.0})
    tau: float = field(default=10.0, metadata={"min": 0.0})
    gamma: float = field(default=1.0, metadata={"min": 0.0})
    adaptive_alpha: bool = False
    alpha_lr: float = field(default=0.0, metadata={"min": 0.0})


register(AlgorithmSpec(
    "apflgate", APFLGateParams, GateCore[APFLGateParams],
    "APFLGate: APFL output mixing (alpha) + FedGATE gradient tracking (tau) on the global copy",
))
