"""APFLGate: APFL's personalisation with FedGATE's gradient tracking (ALGORITHMS.md §9.3; seed 004).

Each local step: ``w_i ← w_i − η (∇f_i(w_i; ξ) − δ_i)`` (FedGATE) and
``v_i ← v_i − η ∇_{v_i} ℓ(α_i h(v_i; x) + (1 − α_i) h(w_i; x), y)`` (APFL); the server forms
``ū`` and ``w ← w − γ ū`` and broadcasts both (:class:`~graphfl.strategies.fedgate.GateCore`);
the client then sets ``δ_i ← δ_i + (u_i − ū)/(η τ)`` with the variance-reduction parameter
``τ`` ("lower τ means more gradient tracking", seed 004). ``τ`` defaults to the local steps ``R``
run; a ``τ ≤ R/2`` is refused (unstable by construction, ALGORITHMS.md §0.1 C5;
:func:`~graphfl.strategies.fedgate.check_tau`), and ``tau-mode = multiple-of-steps`` reads the
poster's grid as multiples of ``R``.
Inference: ``α_i h(v_i; x) + (1 − α_i) h(w_i; x)`` with the locally trained ``w_i`` (C6), or the
server's ``w`` with ``personal-output = aggregated`` (:mod:`graphfl.strategies.apfl`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from graphfl.common.registry import AlgorithmSpec, register
from graphfl.strategies.apfl import PERSONAL_OUTPUTS
from graphfl.strategies.apfl_math import TAU_MODES
from graphfl.strategies.fedgate import GateCore, check_tau


@dataclass(frozen=True)
class APFLGateParams:
    """APFLGate hyperparameters (§9.3, §0.1 C5/C6; defaults: FedTorch's τ = R, APFL's α).

    Attributes
    ----------
    alpha
        Mixing weight ``α_i`` (poster grid {0.1, 0.25, 0.5, 0.75, 0.9}; higher = more personal).
    tau
        Variance-reduction parameter ``τ`` of the δ update; 0 = the local steps ``R`` run;
        otherwise it must give ``τ > R/2``.
    tau_mode
        ``absolute``: ``τ = tau``; ``multiple-of-steps``: ``τ = tau · R``.
    gamma
        Server step ``γ``.
    adaptive_alpha, alpha_lr
        As in APFL (optional; off in the poster's tables).
    personal_output
        ``local-copy`` (default) or ``aggregated``, as in APFL.
    """

    alpha: float = field(default=0.5, metadata={"min": 0.0, "max": 1.0})
    tau: float = field(default=0.0, metadata={"min": 0.0})
    tau_mode: str = field(default="absolute", metadata={"choices": TAU_MODES})
    gamma: float = field(default=1.0, metadata={"min": 0.0})
    adaptive_alpha: bool = False
    alpha_lr: float = field(default=0.0, metadata={"min": 0.0})
    personal_output: str = field(default="local-copy", metadata={"choices": PERSONAL_OUTPUTS})


register(AlgorithmSpec(
    "apflgate", APFLGateParams, GateCore[APFLGateParams],
    "APFLGate: APFL output mixing (alpha) + FedGATE gradient tracking (tau) on the global copy",
    preflight=check_tau,
))
