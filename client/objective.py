"""A client's local objective of one round, written once for every engine.

A round of local training (ALGORITHMS.md §1.1) is ``steps`` minibatch SGD steps from a starting
model on::

    ℓ(θ; batch) + Σ_t penalty_t(θ)

:class:`LocalObjective` says which starting model, how many steps, which minibatch generator and
which penalties. A penalty is a *functional* term :class:`Penalty`: ``fn(params, tensors,
*static)`` with ``params`` a mapping from parameter key to tensor. The same object is used by

* the per-client trainers (:func:`graphfl.client.training.sgd_steps` through
  :meth:`LocalObjective.penalty_on_model`), with ``params`` the model's own parameters, and
* the batched engine (:mod:`graphfl.client.batched`), which stacks every client's ``tensors``
  on a client axis and calls ``fn`` under ``torch.func.vmap``, one client's slice at a time.

So ``fn`` must be a pure tensor function (no ``float()``, no data-dependent Python branches);
``static`` holds what is not a tensor (parameter keys) and must be equal for clients that train
together. The terms in use: FedProx / FeSEM / FedAMP's proximal term (:func:`proximal_term`),
pFedGraph's cosine similarity (:func:`cosine_term`) and FedGATE's tracking correction
(:func:`linear_term`).

APFL's personal model (ALGORITHMS.md §9.1) is a second model trained beside the first on the
loss of the output mixture: :class:`PersonalModel` says where it starts, its mixing weight and
whether the weight adapts; :func:`mixture_output` is the mixture both engines compute, per
step, after the step of the first model; :class:`OutputMix` names a mixture to evaluate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from graphfl.common.types import Arrays

Params = Mapping[str, torch.Tensor]
PenaltyFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Penalty:
    """``fn(params, tensors, *static)``: one term of the local loss (module docstring).

    ``tensors`` is a dict of per-client tensors (stacked on a client axis by the batched engine);
    ``static`` is shared by every client that trains in the same batch.
    """

    fn: PenaltyFn
    tensors: dict[str, Any]
    static: tuple[Any, ...] = ()

    def __call__(self, params: Params) -> torch.Tensor:
        return self.fn(params, self.tensors, *self.static)

    @property
    def signature(self) -> tuple[Any, ...]:
        """What must be equal for two clients' terms to be evaluated in one batch."""
        return (self.fn, self.static, tuple(sorted(self.tensors)))

    def to(self, device: str) -> Penalty:
        """The same term with its tensors on ``device``."""
        return Penalty(self.fn, {k: _to(v, device) for k, v in self.tensors.items()}, self.static)


def _to(value: Any, device: str) -> Any:
    if isinstance(value, dict):
        return {k: v.to(device) for k, v in value.items()}
    return value.to(device)


def mixture_output(alpha: torch.Tensor, h_v: torch.Tensor, h_w: torch.Tensor) -> torch.Tensor:
    """``ŷ = α h(v; x) + (1 − α) h(w; x)`` with ``h(w; x)`` detached (APFL's output mixing, §9.1).

    ``alpha`` broadcasts against the outputs: a scalar for one client, one value per client
    (shaped ``clients × 1 × …``) for stacked outputs.
    """
    return alpha * h_v + (1.0 - alpha) * h_w.detach()


@dataclass
class PersonalModel:
    """APFL's personal model ``v_i`` of one round (§9.1; module docstring).

    ``start``: ``v_i`` before the round (all arrays of the model's ``state_dict``); ``alpha``:
    ``α_i``; with ``adaptive``, every step moves ``α_i ← clip_[0,1](α_i − alpha_lr ∂ℓ(ŷ)/∂α)``
    (:func:`graphfl.strategies.apfl_math.alpha_step`), the derivative taken at the pre-step ``v_i``.
    Each local step, after the step of ``w_i``: ``ŷ = mixture_output(α_i, h(v_i; x), h(w_i; x))``,
    ``v_i ← v_i − η ∇_{v_i} ℓ(ŷ, y)`` (the same SGD rule, momentum and weight decay as ``w_i``).
    """

    start: Arrays
    alpha: float
    adaptive: bool = False
    alpha_lr: float = 0.0

    @property
    def signature(self) -> tuple[Any, ...]:
        """What must be equal for two clients' personal models to train in one batch."""
        return (self.adaptive, self.alpha_lr)


@dataclass
class PersonalResult:
    """A trained :class:`PersonalModel`: ``arrays`` (``v_i``), the final ``alpha`` and the mean
    ``loss`` of the mixture over the round's steps.
    """

    arrays: Arrays
    alpha: float
    loss: float


@dataclass(frozen=True)
class OutputMix:
    """The model ``x ↦ α h(v; x) + (1 − α) h(w; x)`` to evaluate (APFL's personalised output)."""

    v: Arrays
    w: Arrays
    alpha: float


@dataclass
class LocalObjective:
    """One round of a client's local training (module docstring).

    ``start``: the model the steps start from (all arrays of the model's ``state_dict``);
    ``steps``: the number of SGD steps; ``rng``: the generator the minibatch indices are drawn
    from (:func:`graphfl.client.training.sgd_steps`'s order); ``penalties``: the terms added to
    the data loss; ``extra``: what the trainer needs to finish the round (its metrics, say);
    ``personal``: a personal model trained beside it (APFL), or ``None``.
    """

    start: Arrays
    steps: int
    rng: np.random.Generator
    penalties: tuple[Penalty, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    personal: PersonalModel | None = None

    def penalty_on_model(self) -> Callable[[nn.Module], torch.Tensor] | None:
        """The sum of the penalties as a function of a model (``sgd_steps``'s ``penalty``), or ``None``."""
        if not self.penalties:
            return None
        moved: dict[str, tuple[Penalty, ...]] = {}

        def penalty(model: nn.Module) -> torch.Tensor:
            params = dict(model.named_parameters())
            device = str(next(iter(params.values())).device)
            if device not in moved:
                moved[device] = tuple(t.to(device) for t in self.penalties)
            terms = moved[device]
            total = terms[0](params)
            for term in terms[1:]:
                total = total + term(params)
            return total

        return penalty

    @property
    def signature(self) -> tuple[Any, ...]:
        """Clients whose objectives have equal signatures train in one batch."""
        return (self.steps, tuple(t.signature for t in self.penalties),
                None if self.personal is None else self.personal.signature)


def _tensor(a: np.ndarray) -> torch.Tensor:
    """``a`` as a float32 tensor; a read-only array (a view into a received message) is copied,
    never shared with torch, which would ignore the flag.
    """
    arr = np.asarray(a, dtype=np.float32)
    return torch.as_tensor(arr if arr.flags.writeable else arr.copy())


def _proximal(params: Params, tensors: dict[str, Any], keys: tuple[str, ...]) -> torch.Tensor:
    anchors = tensors["anchor"]
    total = torch.zeros((), dtype=torch.float32, device=anchors[keys[0]].device)
    for k in keys:
        total = total + ((params[k] - anchors[k]) ** 2).sum()
    return 0.5 * tensors["mu"] * total


def proximal_term(anchor: Arrays, mu: float, keys: tuple[str, ...]) -> Penalty:
    """``μ/2 Σ_k ‖θ_k − anchor_k‖²`` over the trainable parameters ``keys`` (FedProx, Li et al. 2020;
    FeSEM eq. 10.10 with ``μ = 2λ``; FedAMP towards the cloud model).
    """
    return Penalty(_proximal, {"anchor": {k: _tensor(anchor[k]) for k in keys},
                               "mu": torch.tensor(float(mu), dtype=torch.float32)}, (tuple(keys),))


def _cosine(params: Params, tensors: dict[str, Any], keys: tuple[str, ...]) -> torch.Tensor:
    flat = torch.cat([params[k].reshape(-1) for k in keys])
    anchor = tensors["anchor"]
    return -tensors["lam"] * torch.dot(anchor, flat) / torch.linalg.norm(flat).clamp_min(1e-12)


def cosine_term(cluster: Arrays, lam: float, keys: tuple[str, ...]) -> Penalty:
    """``−λ ⟨c, θ⟩ / ‖θ‖`` over the trainable parameters ``keys`` (pFedGraph's regulariser, §10)."""
    anchor = torch.cat([_tensor(cluster[k]).reshape(-1) for k in keys])
    return Penalty(_cosine, {"anchor": anchor, "lam": torch.tensor(float(lam), dtype=torch.float32)}, (tuple(keys),))


def _linear(params: Params, tensors: dict[str, Any], keys: tuple[str, ...]) -> torch.Tensor:
    delta = tensors["delta"]
    total = torch.zeros((), dtype=torch.float32, device=delta[keys[0]].device)
    for k in keys:
        total = total - (params[k] * delta[k]).sum()
    return total


def linear_term(delta: Arrays, keys: tuple[str, ...]) -> Penalty:
    """``−Σ_k ⟨δ_k, θ_k⟩``: its gradient is ``−δ``, so a step on the data loss plus this term is
    FedGATE's corrected step ``θ ← θ − η(∇ℓ − δ)`` (ALGORITHMS.md §9.2).
    """
    return Penalty(_linear, {"delta": {k: _tensor(delta[k]) for k in keys}}, (tuple(keys),))
