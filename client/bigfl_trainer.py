"""Client half of BiG-FL (ALGORITHMS.md §5.5; seed 000 eq. 10.19, Algorithm 4 lines 4–7).

Client i receives its own model ``θ_i^t``, the message ``m_i`` (``bigfl/m``), ``φ``
(``bigfl/phi``) and ``â_i`` (config ``bigfl.a-ii``), runs ``train.local-steps`` minibatch SGD
steps on its LL loss (eq. 10.17)::

    data_i(θ) + (λ/2)‖m_i + â_i θ φ − θ‖² + (κ/2)‖θ − c_i‖²

with ``m_i``, ``φ`` and the ridge centre ``c_i`` frozen (``bigfl.ridge``: ``proximal`` = the
model ``θ_i^t`` the round starts from, ``origin`` = 0; :func:`ridge_centre`), and uploads
``θ_i^{t+1}``. The non-data part is one pure tensor function,
:func:`graphfl.strategies.bigfl_math.ll_reg_loss`. When the server asks for it
(``bigfl.hessian``), it also uploads the Hessian of its data loss w.r.t. ``θ`` at
``θ_i^{t+1}`` (``bigfl/hessian``, ``d×d``), which the ``implicit`` hypergradient needs.

With ``bigfl.layers`` set, ``θ`` is the concatenation of those parameters only; the others are
trained with the data loss alone and either come from the server (``others = fedavg``) or
live in this client's state (``others = local``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from graphfl.client.objective import LocalObjective, Penalty
from graphfl.client.trainers import state_model, store_model
from graphfl.client.training import evaluate_client, get_arrays, param_keys, set_arrays, sgd_steps
from graphfl.common.arrays import select_keys
from graphfl.common.core import EVALUATE_PHASE, FIT_PHASE, ClientContext, ClientTrainer
from graphfl.common.registry import ClientSpec, register_client
from graphfl.common.types import Arrays, ClientState, FitResult, Payload
from graphfl.strategies import bigfl_math as bm
from graphfl.strategies.bigfl import (
    A_II_KEY,
    HESS_KEY,
    M_KEY,
    PHI_KEY,
    RESERVED_PREFIX,
    WANT_HESS_KEY,
    BiGFLParams,
)
from graphfl.tasks.partition import client_rng


def flat_params(model: nn.Module, keys: tuple[str, ...]) -> torch.Tensor:
    """``θ`` = concatenation of the named parameters (differentiable)."""
    params = dict(model.named_parameters())
    flat: torch.Tensor = torch.cat([params[k].reshape(-1) for k in keys])
    return flat


def data_loss_hessian(
    model: nn.Module, keys: tuple[str, ...], x: np.ndarray, y: np.ndarray, loss_fn: nn.Module,
    device: str = "cpu",
) -> np.ndarray:
    """Hessian (``d×d``, float32) of ``loss_fn(model(x), y)`` w.r.t. the parameters ``keys``."""
    import warnings

    with warnings.catch_warnings():  # torch.func's import calls the deprecated torch.jit.script
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.func import functional_call, hessian

    model = model.to(device).eval()
    fixed = {k: v.detach() for k, v in model.named_parameters()}
    shapes = [fixed[k].shape for k in keys]
    sizes = [fixed[k].numel() for k in keys]
    flat0 = torch.cat([fixed[k].reshape(-1) for k in keys])
    xt = torch.as_tensor(x).to(device)
    yt = torch.as_tensor(y).to(device)

    def loss(flat: torch.Tensor) -> torch.Tensor:
        params = dict(fixed)
        offset = 0
        for k, shape, size in zip(keys, shapes, sizes):
            params[k] = flat[offset : offset + size].view(shape)
            offset += size
        value: torch.Tensor = loss_fn(functional_call(model, params, (xt,)), yt)
        return value

    h: torch.Tensor = hessian(loss)(flat0)
    out: np.ndarray = h.detach().cpu().numpy().astype(np.float32)
    return out


def ridge_centre(model: nn.Module, keys: tuple[str, ...], ridge: str) -> torch.Tensor:
    """The centre ``c_i`` of the LL ridge ``(κ/2)‖θ_i − c_i‖²`` for this round (detached).

    ``proximal``: the model the round starts from, ``θ_i^t`` (the ridge then penalises only the
    round's move and its fixed point is the LL game without the ridge); ``origin``: zeros (the
    paper's ``κ‖θ_i‖²``, which on small-scale data pulls the LL solution to the zero model).
    """
    theta = flat_params(model, keys).detach().clone()
    if ridge == "origin":
        return torch.zeros_like(theta)
    if ridge != "proximal":
        raise ValueError(f"bigfl.ridge = {ridge!r} is not valid; choose one of proximal, origin")
    return theta


def ll_term(params: Mapping[str, torch.Tensor], tensors: dict[str, torch.Tensor], keys: tuple[str, ...],
            lam: float, kappa: float) -> torch.Tensor:
    """The LL loss's non-data part as a penalty term (:class:`~graphfl.client.objective.Penalty`):
    :func:`graphfl.strategies.bigfl_math.ll_reg_loss` of ``θ`` = the concatenated ``keys``, with
    ``tensors`` ``m`` (``m_i``), ``phi``, ``a`` (``â_i``) and ``anchor`` (the ridge centre).
    """
    flat = torch.cat([params[k].reshape(-1) for k in keys])
    value: torch.Tensor = bm.ll_reg_loss(flat, tensors["m"], tensors["phi"], tensors["a"], lam, kappa,  # type: ignore[arg-type]
                                         tensors["anchor"])
    return value


class BiGFLTrainer(ClientTrainer[BiGFLParams]):
    """τ SGD steps on the BiG-FL LL loss; optional Hessian upload (see module docstring)."""

    def __init__(self, ctx: ClientContext[BiGFLParams]) -> None:
        super().__init__(ctx)
        self.loss_fn = ctx.task.loss_fn()

    def _model(self, payload: Payload, state: ClientState) -> tuple[nn.Module, tuple[str, ...]]:
        model = self.ctx.task.build_model()
        keys = select_keys(param_keys(model), self.params.layers)
        arrays: Arrays = get_arrays(model)
        if self.params.others == "local":
            own = state_model(state)
            if own is not None:
                arrays.update(own)
        arrays.update({k: v for k, v in payload.arrays.items() if not k.startswith(RESERVED_PREFIX)})
        set_arrays(model, arrays)
        return model, keys

    def objective(self, server_round: int, payload: Payload, state: ClientState) -> LocalObjective:
        """The round's LL problem: ``train.local-steps`` steps on the data loss plus
        :func:`ll_term` (:func:`graphfl.strategies.bigfl_math.ll_reg_loss` with this round's
        ``m_i``, ``φ``, ``â_i`` and ridge centre), from the received model.
        """
        for key in (M_KEY, PHI_KEY):
            if key not in payload.arrays:
                raise ValueError(f"bigfl client {self.ctx.partition_id}: payload lacks {key!r}")
        model, keys = self._model(payload, state)
        # torch.tensor copies: payload arrays may be read-only views into the received message
        m_i = torch.tensor(np.asarray(payload.arrays[M_KEY], dtype=np.float32))
        phi = torch.tensor(np.asarray(payload.arrays[PHI_KEY], dtype=np.float32))
        d = int(sum(p.numel() for k, p in model.named_parameters() if k in keys))
        if m_i.shape != (d,) or phi.shape != (d, d):
            raise ValueError(
                f"bigfl client {self.ctx.partition_id}: message/phi shapes {tuple(m_i.shape)}/"
                f"{tuple(phi.shape)} do not match the {d} BiG-FL parameters"
            )
        a_ii = torch.tensor(float(payload.config.get(A_II_KEY, 1.0)), dtype=torch.float32)
        anchor = ridge_centre(model, keys, self.params.ridge)
        term = Penalty(ll_term, {"m": m_i, "phi": phi, "a": a_ii, "anchor": anchor},
                       (keys, self.params.lam, self.params.kappa))
        rng = client_rng(self.ctx.config.seed, 5, self.ctx.partition_id, server_round)
        return LocalObjective(get_arrays(model), self.ctx.config.train.local_steps, rng, (term,), {"keys": keys})

    def finish(self, server_round: int, payload: Payload, state: ClientState, objective: LocalObjective,
               arrays: Arrays, loss: float) -> FitResult:
        """The upload (the BiG-FL parameters; all with ``others = fedavg``), ``ll_reg`` at the
        trained model and, when asked, the data loss's Hessian there.
        """
        keys: tuple[str, ...] = objective.extra["keys"]
        with torch.no_grad():
            reg = float(objective.penalties[0]({k: torch.as_tensor(arrays[k]) for k in keys}))
        full = arrays
        if self.params.others == "local":
            store_model(state, arrays)
            arrays = {k: v for k, v in arrays.items() if k in keys}
        if bool(payload.config.get(WANT_HESS_KEY, False)):
            model = self.ctx.task.build_model()
            set_arrays(model, full)
            x, y = self.ctx.data.x_train, self.ctx.data.y_train
            if self.params.hessian_samples and len(x) > self.params.hessian_samples:
                idx = objective.rng.choice(len(x), size=self.params.hessian_samples, replace=False)
                x, y = x[idx], y[idx]
            arrays = dict(arrays)
            arrays[HESS_KEY] = data_loss_hessian(model, keys, x, y, self.loss_fn, device=self.ctx.device)
        return FitResult(arrays, self.ctx.data.num_train, {"train_loss": loss, "ll_reg": reg})

    def fit(self, server_round: int, payload: Payload, state: ClientState) -> FitResult:
        objective = self.objective(server_round, payload, state)
        model = self.ctx.task.build_model()
        set_arrays(model, objective.start)
        tc = self.ctx.config.train
        loss = sgd_steps(model, self.ctx.data, self.loss_fn, objective.steps, tc.batch_size, tc.lr,
                         objective.rng, penalty=objective.penalty_on_model(), momentum=tc.momentum,
                         weight_decay=tc.weight_decay, device=self.ctx.device)
        return self.finish(server_round, payload, state, objective, get_arrays(model), loss)

    def fit_by_objective(self, phase: str) -> bool:
        """Whether ``phase`` runs as objective → SGD steps → finish (the batched engine's test)."""
        cls = type(self)
        return phase == FIT_PHASE and cls.fit is BiGFLTrainer.fit and cls.fit_phase is ClientTrainer.fit_phase

    def evaluate_by_arrays(self, phase: str) -> bool:
        """Whether ``phase`` evaluates :meth:`evaluation_arrays` on the test split."""
        cls = type(self)
        return (phase == EVALUATE_PHASE and cls.evaluate is BiGFLTrainer.evaluate
                and cls.evaluate_phase is ClientTrainer.evaluate_phase)

    def evaluation_arrays(self, payload: Payload, state: ClientState) -> dict[str, Arrays]:
        """The model :meth:`evaluate` reports (``test_*``): the payload's over this client's own."""
        model, _ = self._model(payload, state)
        return {"": get_arrays(model)}

    def evaluate(self, payload: Payload, state: ClientState) -> dict[str, float]:
        model, _ = self._model(payload, state)
        return evaluate_client(model, self.ctx.task, self.ctx.data, self.loss_fn, device=self.ctx.device)


register_client(ClientSpec[BiGFLParams]("bigfl", BiGFLTrainer))
