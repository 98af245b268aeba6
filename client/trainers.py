"""Generic local-SGD trainers: start from the payload (FedAvg/FedProx) or from own state (local).

The update of one round (seed 000 Alg. 3 style; McMahan et al. 2017 for FedAvg): load the
starting model, run ``train.local-steps`` minibatch SGD steps on the local training split,
upload the result. FedProx adds ``μ/2 ‖θ − θ_global‖²`` to the local loss (Li et al. 2020).
"""

from __future__ import annotations

import numpy as np

from graphfl.client.training import (
    evaluate_client,
    get_arrays,
    param_keys,
    proximal_penalty,
    set_arrays,
    sgd_steps,
)
from graphfl.common.core import ClientContext, ClientTrainer, P
from graphfl.common.registry import ClientSpec, register_client
from graphfl.common.types import Arrays, ClientState, FitResult, Payload
from graphfl.strategies.fedavg import FedAvgParams, FedProxParams
from graphfl.strategies.local import LocalParams
from graphfl.tasks.partition import client_rng

STATE_MODEL_PREFIX = "model."


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
    """Local SGD from the received model; optional proximal term towards it (``mu``)."""

    mu: float = 0.0

    def __init__(self, ctx: ClientContext[P], mu: float = 0.0) -> None:
        super().__init__(ctx)
        self.mu = mu
        self.loss_fn = ctx.task.loss_fn()

    def start_arrays(self, payload: Payload, state: ClientState) -> Arrays:
        return payload.arrays

    def rng(self, server_round: int) -> np.random.Generator:
        return client_rng(self.ctx.config.seed, 3, self.ctx.partition_id, server_round)

    def fit(self, server_round: int, payload: Payload, state: ClientState) -> FitResult:
        model = self.ctx.task.build_model()
        start = self.start_arrays(payload, state)
        set_arrays(model, start)
        penalty = proximal_penalty(start, self.mu, param_keys(model)) if self.mu > 0 else None
        tc = self.ctx.config.train
        loss = sgd_steps(
            model, self.ctx.data, self.loss_fn, tc.local_steps, tc.batch_size, tc.lr,
            self.rng(server_round), penalty=penalty, momentum=tc.momentum,
            weight_decay=tc.weight_decay, device=self.ctx.device,
        )
        arrays = get_arrays(model)
        self.after_fit(arrays, state)
        return FitResult(arrays, self.ctx.data.num_train, {"train_loss": loss})

    def after_fit(self, arrays: Arrays, state: ClientState) -> None:
        """Hook for trainers that keep the trained model (local training)."""

    def evaluate(self, payload: Payload, state: ClientState) -> dict[str, float]:
        model = self.ctx.task.build_model()
        set_arrays(model, self.start_arrays(payload, state))
        return evaluate_client(model, self.ctx.task, self.ctx.data, self.loss_fn, device=self.ctx.device)


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
