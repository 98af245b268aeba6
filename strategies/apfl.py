"""APFL: adaptive personalised FL (ALGORITHMS.md §9.1; Deng, Kamani, Mahdavi 2020).

Client i keeps a personal model ``v_i`` and a mixing weight ``α_i`` across rounds; each local
step trains its copy ``w_i`` of the global model by plain SGD and ``v_i`` on the loss of the
output mixture ``ŷ = α_i h(v_i; x) + (1 − α_i) h(w_i; x)`` (``w_i`` not updated by it), and,
with ``adaptive_alpha``, ``α_i ← clip_[0,1](α_i − η_α ∂ℓ(ŷ)/∂α)``. The server averages the
``w_i`` (:class:`~graphfl.strategies.fedgate.GateCore` with ``γ = 1`` and no ``ū`` broadcast).

Inference (ALGORITHMS.md §0.1 C6): ``ŷ = α_i h(v_i; x) + (1 − α_i) h(w_i; x)`` with ``w_i`` the
client's locally trained copy after its last round's local steps, before aggregation, as
FedTorch evaluates it (``personal-output = local-copy``, the default); ``aggregated`` mixes
with the server's current ``w`` instead. The evaluation reports both forms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from graphfl.common.registry import AlgorithmSpec, register
from graphfl.strategies.fedgate import GateCore

PERSONAL_OUTPUTS = ("local-copy", "aggregated")
"""Which global-model copy the personal output mixes with (module doc)."""


@dataclass(frozen=True)
class APFLParams:
    """APFL hyperparameters (§9.1; FedTorch defaults).

    Attributes
    ----------
    alpha
        Initial (or fixed) mixing weight ``α_i`` (``--fed_personal_alpha`` 0.5).
    adaptive_alpha
        Update ``α_i`` by gradient descent every local step (paper rule, output mixing).
    alpha_lr
        Step size ``η_α`` of the α update; 0 = ``train.lr``.
    personal_output
        ``local-copy``: ``α_i h(v_i) + (1 − α_i) h(w_i)`` with the locally trained ``w_i``;
        ``aggregated``: with the server's ``w`` (module doc).
    """

    alpha: float = field(default=0.5, metadata={"min": 0.0, "max": 1.0})
    adaptive_alpha: bool = False
    alpha_lr: float = field(default=0.0, metadata={"min": 0.0})
    personal_output: str = field(default="local-copy", metadata={"choices": PERSONAL_OUTPUTS})

    @property
    def gamma(self) -> float:
        """APFL's server step is 1 (plain averaging)."""
        return 1.0


class APFLCore(GateCore[APFLParams]):
    """``w ← mean_i w_i``; no ``ū`` broadcast (APFL has no tracking)."""

    tracking = False


register(AlgorithmSpec(
    "apfl", APFLParams, APFLCore,
    "APFL: personal model v_i mixed with the global model at the output, weight alpha_i (optional adaptive)",
))
