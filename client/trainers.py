"""Generic local-SGD trainers: start from the payload (FedAvg/FedProx) or from own state (local).

The update of one round (seed 000 Alg. 3 style; McMahan et al. 2017 for FedAvg): load the
starting model, run ``train.local-steps`` minibatch SGD steps on the local training split,
upload the result. FedProx adds ``μ/2 ‖θ − θ_global‖²`` to the local loss (Li et al. 2020).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from graphfl.client.objective import LocalObjective, Penalty, proximal_term
from graphfl.client.training import evaluate_client, get_arrays, param_keys, set_arrays, sgd_steps
from graphfl.common.core import EVALUATE_PHASE, FIT_PHASE, ClientContext, ClientTrainer, P
from graphfl.common.registry import ClientSpec, register_client
from graphfl.common.types import Arrays, ClientState, FitResult, Payload
from graphfl.strategies.fedavg import FedAvgParams, FedProxParams
from graphfl.strategies.local import LocalParams
from graphfl.tasks.partition import client_rng

STATE_MODEL_PREFIX = "model."
TRAINED_PREFIX = "trained."
"""Client-state prefix of the last locally trained model, kept when ``train.eval-local`` is on."""
EVAL_LOCAL_PREFIX = "local_"
"""Metric prefix of that model's evaluation (``local_test_acc``, as FeSEM reports its own)."""


def state_model(state: ClientState) -> Arrays | None:
    """The personal model kept in client state (keys prefixed ``model.``), if any."""
    arrays = {k[len(STATE_MODEL_PREFIX):]: v for k, v in state.items() if k.startswith(STATE_MODEL_PREFIX)}
    return arrays or None


def store_model(state: ClientState, arrays: Arrays) -> None:
    """Replace the personal model kept in client state by ``arrays``."""
    for k in [k for k in state if k.startswith(STATE_MODEL_PREFIX)]:
        del state[k]
    state.update({STATE_MODEL_PREFIX + k: v for k, v in arrays.items()})


class SGDTrainer(ClientTrainer[P]):
    """Local SGD from the received model; optional proximal term towards it (``mu``).

    A round is :meth:`objective` (the :class:`~graphfl.client.objective.LocalObjective`: start,
    steps, minibatch generator, penalty terms), the SGD steps, then :meth:`finish` (the upload,
    metrics and state). :meth:`fit` runs the three for one client; the batched engine
    (:mod:`graphfl.client.batched`) runs the steps of many clients at once between the same
    :meth:`objective` and :meth:`finish`. Evaluation is :meth:`evaluation_arrays` (the models to
    evaluate, by metric prefix) on the test split. With ``train.eval-local`` the model of the
    client's last training round is kept in client state and also evaluated, as ``local_test_*``
    (with partial participation or a failed fit that round may be older than the newest round).
    """

    mu: float = 0.0

    def __init__(self, ctx: ClientContext[P], mu: float = 0.0) -> None:
        super().__init__(ctx)
        self.mu = mu
        self.loss_fn = ctx.task.loss_fn()
        self._keys: tuple[str, ...] | None = None

    def start_arrays(self, payload: Payload, state: ClientState) -> Arrays:
        return payload.arrays

    def rng(self, server_round: int) -> np.random.Generator:
        return client_rng(self.ctx.config.seed, 3, self.ctx.partition_id, server_round)

    @property
    def keys(self) -> tuple[str, ...]:
        """The trainable parameters' keys (θ of ALGORITHMS.md §1.1), in registration order."""
        if self._keys is None:
            self._keys = param_keys(self.ctx.task.build_model())
        return self._keys

    def penalties(self, server_round: int, payload: Payload, state: ClientState,
                  start: Arrays) -> tuple[Penalty, ...]:
        """The terms added to the data loss this round: FedProx's ``μ/2 ‖θ − θ_start‖²`` when ``mu > 0``."""
        return (proximal_term(start, self.mu, self.keys),) if self.mu > 0 else ()

    def objective(self, server_round: int, payload: Payload, state: ClientState) -> LocalObjective:
        """The round's local problem: ``train.local-steps`` steps from :meth:`start_arrays`."""
        start = self.start_arrays(payload, state)
        return LocalObjective(start, self.ctx.config.train.local_steps, self.rng(server_round),
                              self.penalties(server_round, payload, state, start))

    def finish(self, server_round: int, payload: Payload, state: ClientState, objective: LocalObjective,
               arrays: Arrays, loss: float) -> FitResult:
        """The round's result from the trained ``arrays`` and mean data ``loss``; keeps what the
        trainer keeps (:meth:`after_fit`).
        """
        self.after_fit(arrays, state)
        if self.ctx.config.train.eval_local:
            for k in [k for k in state if k.startswith(TRAINED_PREFIX)]:
                del state[k]
            state.update({TRAINED_PREFIX + k: v for k, v in arrays.items()})
        return FitResult(arrays, self.ctx.data.num_train, {"train_loss": loss, **objective.extra})

    def fit(self, server_round: int, payload: Payload, state: ClientState) -> FitResult:
        objective = self.objective(server_round, payload, state)
        model = self.ctx.task.build_model()
        set_arrays(model, objective.start)
        tc = self.ctx.config.train
        loss = sgd_steps(
            model, self.ctx.data, self.loss_fn, objective.steps, tc.batch_size, tc.lr,
            objective.rng, penalty=objective.penalty_on_model(), momentum=tc.momentum,
            weight_decay=tc.weight_decay, device=self.ctx.device,
        )
        return self.finish(server_round, payload, state, objective, get_arrays(model), loss)

    def after_fit(self, arrays: Arrays, state: ClientState) -> None:
        """Hook for trainers that keep the trained model (local training)."""

    def fit_by_objective(self, phase: str) -> bool:
        """Whether ``phase`` is served as :meth:`objective` → SGD steps → :meth:`finish`: the
        ``fit`` phase, unless a subclass replaced :meth:`fit` or :meth:`fit_phase`.
        """
        cls = type(self)
        return phase == FIT_PHASE and cls.fit is SGDTrainer.fit and cls.fit_phase is ClientTrainer.fit_phase

    def evaluate_by_arrays(self, phase: str) -> bool:
        """Whether ``phase`` is evaluated as :meth:`evaluation_arrays` on the test split (the
        ``evaluate`` phase, unless a subclass replaced :meth:`evaluate` or :meth:`evaluate_phase`).
        """
        cls = type(self)
        return (phase == EVALUATE_PHASE and cls.evaluate is SGDTrainer.evaluate
                and cls.evaluate_phase is ClientTrainer.evaluate_phase)

    def evaluation_arrays(self, payload: Payload, state: ClientState) -> dict[str, Arrays]:
        """The models :meth:`evaluate` reports, by metric prefix: ``""`` (``test_*``, ``num_test``)
        is :meth:`start_arrays`; any other prefix adds ``<prefix>test_*`` (without ``num_test``).
        With ``train.eval-local``, once the client has trained, its last trained model adds
        ``local_test_*``.
        """
        out = {"": self.start_arrays(payload, state)}
        if self.ctx.config.train.eval_local:
            trained = {k[len(TRAINED_PREFIX):]: v for k, v in state.items() if k.startswith(TRAINED_PREFIX)}
            if trained:
                out[EVAL_LOCAL_PREFIX] = trained
        return out

    def evaluate(self, payload: Payload, state: ClientState) -> dict[str, float]:
        out: dict[str, float] = {}
        for prefix, arrays in self.evaluation_arrays(payload, state).items():
            model = self.ctx.task.build_model()
            set_arrays(model, arrays)
            metrics = evaluate_client(model, self.ctx.task, self.ctx.data, self.loss_fn, device=self.ctx.device)
            out.update(metrics if not prefix else {f"{prefix}{k}": v for k, v in metrics.items() if k != "num_test"})
        return out


def eval_local_problem(strategy: str, trainer: ClientTrainer[Any]) -> str | None:
    """Why ``trainer`` cannot serve ``train.eval-local`` (``None`` when it can).

    The option is served by :class:`SGDTrainer` itself: its :meth:`~SGDTrainer.finish` keeps
    the trained model and its :meth:`~SGDTrainer.evaluation_arrays` evaluates it; a trainer that
    replaces either (or is no :class:`SGDTrainer`) would silently drop it.
    """
    if isinstance(trainer, SGDTrainer):
        cls = type(trainer)
        if cls.finish is SGDTrainer.finish and cls.evaluation_arrays is SGDTrainer.evaluation_arrays:
            return None
    return (f"train.eval-local = true: strategy {strategy!r} evaluates its own models ({type(trainer).__name__}); only "
            "strategies with the generic SGD round and evaluation serve it (e.g. fedavg, fedprox, local)")


class LocalTrainer(SGDTrainer[LocalParams]):
    """Local-only training: the personal model lives in client state; the payload only
    seeds it in the first round.
    """

    def start_arrays(self, payload: Payload, state: ClientState) -> Arrays:
        own = state_model(state)
        if own is not None:
            return own
        if not payload.arrays:
            raise RuntimeError(
                f"client {self.ctx.partition_id} has no local model in its state and the "
                "server sent none (did the SuperNode restart mid-run?)"
            )
        return payload.arrays

    def after_fit(self, arrays: Arrays, state: ClientState) -> None:
        store_model(state, arrays)


def fedprox_trainer(ctx: ClientContext[FedProxParams]) -> SGDTrainer[FedProxParams]:
    """FedProx's client: local SGD with the proximal term ``mu/2 ‖θ − θ_global‖²``."""
    return SGDTrainer(ctx, mu=ctx.params.mu)


register_client(ClientSpec[FedAvgParams]("fedavg", SGDTrainer))
register_client(ClientSpec[FedProxParams]("fedprox", fedprox_trainer))
register_client(ClientSpec[LocalParams]("local", LocalTrainer))
