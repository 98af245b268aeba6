"""Client halves of APFL, FedGATE and APFLGate (ALGORITHMS.md §9, §0.1 C5/C6; seed 004).

One local loop, three switches (``personal``: APFL's personal model, ``tracking``: FedGATE's
correction). Per round, with ``w`` the received global model, ``R = train.local-steps``::

    (tracking) on receipt: δ_i ← δ_i + (u_i − ū)/(η τ) if this client's last upload is in ū,
               τ from (tau, tau-mode, R' = the local steps run in that round), τ > R'/2
    w_i ← w
    repeat R times, minibatch (x, y):
        w_i ← w_i − η (∇ℓ(h(w_i; x), y) − δ_i)                       (δ_i = 0 without tracking)
        (personal) ŷ = α_i h(v_i; x) + (1 − α_i) h(w_i; x)           (h(w_i; x) detached)
                   v_i ← v_i − η ∇_{v_i} ℓ(ŷ, y)
                   (adaptive α) α_i ← clip_[0,1](α_i − η_α ∂ℓ(ŷ)/∂α)
    upload w_i;  keep u_i = w − Q(w_i) (what the server decodes) for the next δ update
    (personal) keep w_i itself (the locally trained copy, C6) for the personal output

Persistent client state (``context.state`` in Flower, keyed by the SuperNode's partition):
``model.*`` = ``v_i``, ``apfl.alpha`` = ``α_i``, ``apfl.w-local/*`` = the locally trained
``w_i`` of the client's last round, ``gate.delta/*`` = ``δ_i``, ``gate.up/*`` = ``u_i`` with
``gate.up-round`` / ``gate.up-steps``. Evaluation: FedGATE reports ``test_*`` of ``w``; personal
clients report ``test_*`` of the configured personal output
(``personal-output``: ``local-copy`` = ``α_i h(v_i) + (1 − α_i) h(w_i)``, ``aggregated`` = the
same with the received ``w``), both forms as ``mix_local_test_*`` / ``mix_aggregated_test_*``,
the global model alone as ``global_test_*`` and ``α_i``. Before a client has trained, its
local copy is the received ``w``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from graphfl.client.objective import (
    LocalObjective,
    OutputMix,
    PersonalModel,
    PersonalResult,
    linear_term,
    mixture_output,
)
from graphfl.client.trainers import state_model, store_model
from graphfl.client.training import (
    _batches,
    evaluate_client,
    get_arrays,
    model_input,
    set_arrays,
    sgd_steps,
    sgd_update,
)
from graphfl.common.core import EVALUATE_PHASE, FIT_PHASE, ClientContext, ClientTrainer
from graphfl.common.registry import ClientSpec, register_client
from graphfl.common.types import Arrays, ClientData, ClientState, FitResult, Payload
from graphfl.strategies.apfl import APFLParams
from graphfl.strategies.apfl_math import alpha_step, client_update, delta_update, effective_tau, tau_problem
from graphfl.strategies.apflgate import APFLGateParams
from graphfl.strategies.fedgate import ACCEPTED_KEY, ROUND_KEY, U_PREFIX, FedGATEParams
from graphfl.tasks.partition import client_rng

ALPHA_KEY = "apfl.alpha"
DELTA_PREFIX = "gate.delta/"
UP_PREFIX = "gate.up/"
UP_ROUND_KEY = "gate.up-round"
UP_STEPS_KEY = "gate.up-steps"
LOCAL_PREFIX = "apfl.w-local/"
"""State keys of the locally trained copy ``w_i`` (all model arrays) the personal output mixes with."""


class OutputMixture(nn.Module):
    """``x ↦ α v(x) + (1 − α) w(x)`` (APFL's personalised output, §9.1)."""

    def __init__(self, v: nn.Module, w: nn.Module, alpha: float) -> None:
        super().__init__()
        self.v, self.w, self.alpha = v, w, float(alpha)

    def forward(self, x: Any) -> torch.Tensor:
        out: torch.Tensor = self.alpha * self.v(x) + (1.0 - self.alpha) * self.w(x)
        return out


def minibatches(data: ClientData, steps: int, batch_size: int, rng: np.random.Generator,
                device: str) -> Iterator[tuple[Any, torch.Tensor]]:
    """``steps`` training minibatches, drawn exactly as :func:`graphfl.client.training.sgd_steps` does.

    The input goes through the task's ``collate`` when it has one (graph tasks: a PyG batch).
    """
    collate = data.collate
    x_all = torch.as_tensor(data.x_train) if collate is None else None
    y_all = torch.as_tensor(data.y_train)
    for idx in _batches(len(data.x_train), batch_size, steps, rng):
        idx_t = torch.as_tensor(idx)
        x = x_all[idx_t].to(device) if x_all is not None else model_input(data.x_train[idx], collate, device)
        yield x, y_all[idx_t].to(device)


def personal_step(
    model_v: nn.Module, h_w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, alpha: float,
    loss_fn: nn.Module, lr: float, buffers: list[torch.Tensor | None], adaptive: bool = False,
    alpha_lr: float = 0.0, momentum: float = 0.0, weight_decay: float = 0.0,
) -> tuple[float, float]:
    """One APFL personal step on ``v_i`` (output mixing, §9.1); returns (loss, new α).

    ``ŷ = α h(v; x) + (1 − α) h_w`` with ``h_w`` the (detached) global output;
    ``v ← v − lr ∇_v ℓ(ŷ, y)``; with ``adaptive``, ``α ← clip_[0,1](α − alpha_lr ∂ℓ/∂α)``
    where ``∂ℓ/∂α = ⟨∂ℓ/∂ŷ, h(v; x) − h_w⟩`` is taken at the pre-step ``v``.
    """
    params = [p for p in model_v.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    a = torch.tensor(float(alpha), dtype=h_w.dtype, device=h_w.device, requires_grad=adaptive)
    y_hat = mixture_output(a, model_v(x), h_w)
    loss = loss_fn(y_hat, y)
    loss.backward()
    sgd_update(params, buffers, lr, momentum, weight_decay)
    new_alpha = alpha
    if adaptive:
        assert a.grad is not None
        new_alpha = alpha_step(alpha, float(a.grad), alpha_lr)
    return float(loss.detach()), new_alpha


class GateTrainer(ClientTrainer[Any]):
    """Local loop of the gate family (module doc); ``personal`` / ``tracking`` pick the algorithm."""

    personal = True
    tracking = True

    def __init__(self, ctx: ClientContext[Any]) -> None:
        super().__init__(ctx)
        self.loss_fn = ctx.task.loss_fn()
        self._keys: tuple[str, ...] | None = None

    # -- state ---------------------------------------------------------------------------

    @staticmethod
    def model_arrays(payload: Payload) -> Arrays:
        """The global model ``w`` of a payload (without the broadcast ``ū``)."""
        return {k: v for k, v in payload.arrays.items() if not k.startswith(U_PREFIX)}

    def alpha(self, state: ClientState) -> float:
        """``α_i``: from state, else the configured initial value."""
        return float(state[ALPHA_KEY]) if ALPHA_KEY in state else float(self.params.alpha)

    @staticmethod
    def delta(state: ClientState, keys: tuple[str, ...]) -> Arrays:
        """``δ_i`` per trainable key (zeros before the first update), float64."""
        return {k: np.asarray(state[DELTA_PREFIX + k], dtype=np.float64) if DELTA_PREFIX + k in state
                else np.zeros(0) for k in keys}

    def apply_pending_delta(self, payload: Payload, state: ClientState) -> bool:
        """``δ_i ← δ_i + (u_i − ū)/(η τ)`` if the payload's ``ū`` includes this client's last
        upload (§9.2); the kept ``u_i`` is dropped either way. Returns whether δ moved.
        """
        if UP_ROUND_KEY not in state:
            return False
        up_round = int(state[UP_ROUND_KEY])
        steps = float(state.get(UP_STEPS_KEY, np.asarray(self.ctx.config.train.local_steps)))
        keys = tuple(k[len(UP_PREFIX):] for k in state if k.startswith(UP_PREFIX))
        u_i = {k: state.pop(UP_PREFIX + k) for k in keys}
        del state[UP_ROUND_KEY]
        state.pop(UP_STEPS_KEY, None)
        if int(payload.config.get(ROUND_KEY, 0)) != up_round or not bool(payload.config.get(ACCEPTED_KEY, False)):
            return False
        u_bar = {k: payload.arrays[U_PREFIX + k] for k in keys}
        old = {k: np.asarray(state[DELTA_PREFIX + k], dtype=np.float64) if DELTA_PREFIX + k in state
               else np.zeros(np.shape(u_i[k])) for k in keys}
        tau = self.tau(int(steps))
        for k, v in delta_update(old, u_i, u_bar, self.ctx.config.train.lr, tau).items():
            state[DELTA_PREFIX + k] = v
        return True

    def tau(self, steps: int) -> float:
        """``τ`` of the δ update after ``steps`` local steps (``tau``, ``tau-mode``; C5).

        Raises ``ValueError`` naming the key when ``τ ≤ steps/2`` (the run's preflight refuses
        such a configuration before any client starts; this guards other entry points).
        """
        tau, mode = float(self.params.tau), str(self.params.tau_mode)
        problem = tau_problem(f"{self.ctx.config.strategy}.tau", tau, mode, steps)
        if problem:
            raise ValueError(problem)
        return effective_tau(tau, mode, steps)

    @staticmethod
    def local_copy(state: ClientState) -> Arrays | None:
        """The locally trained ``w_i`` of the client's last round (C6), or ``None`` before it trained."""
        out = {k[len(LOCAL_PREFIX):]: v for k, v in state.items() if k.startswith(LOCAL_PREFIX)}
        return out or None

    # -- protocol ------------------------------------------------------------------------

    def objective(self, server_round: int, payload: Payload, state: ClientState) -> LocalObjective:
        """The round's local problem of ``w_i``: ``train.local-steps`` steps from the received ``w``
        on the data loss plus, with tracking, ``−⟨δ_i, θ⟩`` (gradient ``−δ_i``: the step
        ``w_i ← w_i − η(∇ℓ − δ_i)``), after the pending δ update (which changes ``state``); with
        a personal model, ``v_i`` (from state, else the received ``w``) and ``α_i`` beside it.
        """
        moved = self.apply_pending_delta(payload, state) if self.tracking else False
        keys = tuple(k for k in self.keys if self.tracking and DELTA_PREFIX + k in state)
        penalties = (linear_term({k: state[DELTA_PREFIX + k] for k in keys}, keys),) if keys else ()
        rng = client_rng(self.ctx.config.seed, 3, self.ctx.partition_id, server_round)
        extra = {"delta_updated": float(moved)} if self.tracking else {}
        start = self.model_arrays(payload)
        personal = None
        if self.personal:
            personal = PersonalModel(state_model(state) or start, self.alpha(state),
                                     bool(getattr(self.params, "adaptive_alpha", False)),
                                     float(getattr(self.params, "alpha_lr", 0.0)) or self.ctx.config.train.lr)
        return LocalObjective(start, self.ctx.config.train.local_steps, rng, penalties, extra, personal)

    @property
    def keys(self) -> tuple[str, ...]:
        """The trainable parameters' keys, in registration order."""
        if self._keys is None:
            self._keys = tuple(k for k, p in self.ctx.task.build_model().named_parameters() if p.requires_grad)
        return self._keys

    def finish(self, server_round: int, payload: Payload, state: ClientState, objective: LocalObjective,
               arrays: Arrays, loss: float, personal: PersonalResult | None = None) -> FitResult:
        """The upload ``w_i`` and its metrics; with tracking, keeps the steps run for the next δ
        update; with a personal model, keeps ``v_i``, ``α_i`` and the locally trained ``w_i`` (C6).
        """
        metrics = {"train_loss": loss}
        if personal is not None:
            store_model(state, personal.arrays)
            state[ALPHA_KEY] = np.asarray(personal.alpha, dtype=np.float64)
            for k, v in arrays.items():
                state[LOCAL_PREFIX + k] = v
        if self.tracking:
            state[UP_STEPS_KEY] = np.asarray(objective.steps, dtype=np.int64)   # R of this round's δ update
            metrics.update(objective.extra)
        if personal is not None:
            metrics.update(personal_loss=personal.loss, alpha=personal.alpha)
        return FitResult(arrays, self.ctx.data.num_train, metrics)

    def fit_by_objective(self, phase: str) -> bool:
        """Whether ``phase`` runs as objective → SGD steps → finish (batchable): the ``fit`` phase,
        unless a subclass replaced :meth:`fit` or ``fit_phase``.
        """
        cls = type(self)
        return phase == FIT_PHASE and cls.fit is GateTrainer.fit and cls.fit_phase is ClientTrainer.fit_phase

    def evaluate_by_arrays(self, phase: str) -> bool:
        """Whether ``phase`` is :meth:`evaluation_arrays` on the test split plus
        :meth:`evaluation_scalars` (the ``evaluate`` phase, unless a subclass replaced it).
        """
        cls = type(self)
        return (phase == EVALUATE_PHASE and cls.evaluate is GateTrainer.evaluate
                and cls.evaluate_phase is ClientTrainer.evaluate_phase)

    def evaluation_arrays(self, payload: Payload, state: ClientState) -> dict[str, Arrays | OutputMix]:
        """The models :meth:`evaluate` reports, by metric prefix (``""``: ``test_*`` and ``num_test``).

        FedGATE: the received ``w``. Personal clients: ``""`` is the configured personal output,
        ``mix_local_`` the mixture with the locally trained ``w_i`` (the received ``w`` before the
        client has trained), ``mix_aggregated_`` the mixture with the received ``w``, ``global_``
        the received ``w`` alone.
        """
        w = self.model_arrays(payload)
        if not self.personal:
            return {"": w}
        v, alpha = state_model(state) or w, self.alpha(state)
        forms = {"aggregated": OutputMix(v, w, alpha), "local-copy": OutputMix(v, self.local_copy(state) or w, alpha)}
        return {"": forms[str(self.params.personal_output)], "mix_local_": forms["local-copy"],
                "mix_aggregated_": forms["aggregated"], "global_": w}

    def evaluation_scalars(self, payload: Payload, state: ClientState) -> dict[str, float]:
        """Metrics beside the evaluated models: ``alpha`` (``α_i``) for personal clients."""
        return {"alpha": self.alpha(state)} if self.personal else {}

    def fit(self, server_round: int, payload: Payload, state: ClientState) -> FitResult:
        tc = self.ctx.config.train
        device = self.ctx.device
        objective = self.objective(server_round, payload, state)
        penalty = objective.penalty_on_model()
        model_w = self.ctx.task.build_model()
        set_arrays(model_w, objective.start)
        personal = objective.personal
        if personal is None:
            loss = sgd_steps(model_w, self.ctx.data, self.loss_fn, objective.steps, tc.batch_size, tc.lr,
                             objective.rng, penalty=penalty, momentum=tc.momentum, weight_decay=tc.weight_decay,
                             device=device)
            return self.finish(server_round, payload, state, objective, get_arrays(model_w), loss)
        model_w.to(device).train()
        params_w = [p for p in model_w.parameters() if p.requires_grad]
        bufs_w: list[torch.Tensor | None] = [None] * len(params_w)
        alpha = personal.alpha
        model_v = self.ctx.task.build_model()
        set_arrays(model_v, personal.start)
        model_v.to(device).train()
        bufs_v: list[torch.Tensor | None] = [None] * len(list(model_v.parameters()))
        total_w = total_v = 0.0
        ran = 0
        for x, y in minibatches(self.ctx.data, objective.steps, tc.batch_size, objective.rng, device):
            ran += 1
            for p in params_w:
                p.grad = None
            loss = self.loss_fn(model_w(x), y)
            total_w += float(loss.detach())
            (loss if penalty is None else loss + penalty(model_w)).backward()   # ∇ℓ − δ_i
            sgd_update(params_w, bufs_w, tc.lr, tc.momentum, tc.weight_decay)
            with torch.no_grad():
                h_w = model_w(x)
            lv, alpha = personal_step(model_v, h_w, x, y, alpha, self.loss_fn, tc.lr, bufs_v, personal.adaptive,
                                      personal.alpha_lr, tc.momentum, tc.weight_decay)
            total_v += lv
        steps = max(ran, 1)
        return self.finish(server_round, payload, state, objective, get_arrays(model_w), total_w / steps,
                           PersonalResult(get_arrays(model_v), alpha, total_v / steps))

    def after_upload(self, phase: str, server_round: int, payload: Payload, uploaded: Arrays,
                     state: ClientState) -> None:
        """Keep ``u_i = w − Q(w_i)`` (trainable keys) for the δ update of the next round (``fit``
        has stored the number of local steps it ran beside it).
        """
        if not self.tracking:
            return
        w = self.model_arrays(payload)
        keys = [k for k, _ in self.ctx.task.build_model().named_parameters()]
        u_i = client_update({k: w[k] for k in keys}, uploaded)
        for k in keys:
            state[UP_PREFIX + k] = u_i[k]
        state[UP_ROUND_KEY] = np.asarray(server_round, dtype=np.int64)

    def evaluate(self, payload: Payload, state: ClientState) -> dict[str, float]:
        """:meth:`evaluation_arrays` on the test split (each distinct model once), prefixed, plus
        :meth:`evaluation_scalars`.
        """
        task, d, dev = self.ctx.task, self.ctx.data, self.ctx.device
        seen: dict[int, dict[str, float]] = {}
        out: dict[str, float] = {}
        for prefix, item in self.evaluation_arrays(payload, state).items():
            if id(item) not in seen:
                seen[id(item)] = evaluate_client(self.eval_model(item), task, d, self.loss_fn, device=dev)
            metrics = seen[id(item)]
            out.update(metrics if not prefix else {f"{prefix}{k}": v for k, v in metrics.items() if k != "num_test"})
        out.update(self.evaluation_scalars(payload, state))
        return out

    def eval_model(self, item: Arrays | OutputMix) -> nn.Module:
        """The module of an :meth:`evaluation_arrays` item (an :class:`OutputMixture` for a mixture)."""
        def build(arrays: Arrays) -> nn.Module:
            model = self.ctx.task.build_model()
            set_arrays(model, arrays)
            return model

        if isinstance(item, OutputMix):
            return OutputMixture(build(item.v), build(item.w), item.alpha)
        return build(item)


class APFLTrainer(GateTrainer):
    """APFL: personal model, no tracking."""

    tracking = False


class FedGATETrainer(GateTrainer):
    """FedGATE: tracking, no personal model."""

    personal = False


register_client(ClientSpec[APFLParams]("apfl", APFLTrainer))
register_client(ClientSpec[FedGATEParams]("fedgate", FedGATETrainer))
register_client(ClientSpec[APFLGateParams]("apflgate", GateTrainer))
