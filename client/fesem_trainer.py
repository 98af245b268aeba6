"""Client half of FeSEM (ALGORITHMS.md §4.5, seed 000 Algorithm 3 / eq. 10.10).

``Local_Update(i, θ̄)``: start from the received center ``θ̄`` and run ``train.local-steps``
minibatch SGD steps on ``F_i(θ) + λ‖θ − θ̄‖²`` (``fesem.prox-lambda = λ``; the penalty's
gradient is ``2λ(θ − θ̄)``). In the warm-up round (payload config ``fesem.warmup``) the client
trains ``fesem.steps`` plain SGD steps from the common initial model instead.

Evaluation reports the center's test loss as ``test_loss`` (the personalised model the server
hands out) and, once the client has trained, its last local model's loss as
``local_test_loss`` (ALGORITHMS.md §4.5 asks for both).
"""

from __future__ import annotations

from graphfl.client.trainers import SGDTrainer, state_model, store_model
from graphfl.client.training import (
    evaluate_client,
    get_arrays,
    param_keys,
    proximal_penalty,
    set_arrays,
    sgd_steps,
)
from graphfl.common.registry import ClientSpec, register_client
from graphfl.common.types import ClientState, FitResult, Payload
from graphfl.strategies.fesem import STEPS_KEY, WARMUP_KEY, FeSEMParams


class FeSEMTrainer(SGDTrainer[FeSEMParams]):
    """Local SGD from the assigned center with the optional proximal term of eq. 10.10."""

    def fit(self, server_round: int, payload: Payload, state: ClientState) -> FitResult:
        warmup = bool(payload.config.get(WARMUP_KEY, False))
        tc = self.ctx.config.train
        steps = int(payload.config.get(STEPS_KEY, tc.local_steps)) if warmup else tc.local_steps
        lam = self.params.prox_lambda
        model = self.ctx.task.build_model()
        set_arrays(model, payload.arrays)
        penalty = None
        if lam > 0 and not warmup:
            # proximal_penalty is μ/2 ‖θ − a‖²; eq. 10.10 is λ‖θ − θ̄‖², so μ = 2λ.
            penalty = proximal_penalty(payload.arrays, 2.0 * lam, param_keys(model))
        loss = sgd_steps(
            model, self.ctx.data, self.loss_fn, steps, tc.batch_size, tc.lr,
            self.rng(server_round), penalty=penalty, momentum=tc.momentum,
            weight_decay=tc.weight_decay, device=self.ctx.device,
        )
        arrays = get_arrays(model)
        store_model(state, arrays)
        return FitResult(arrays, self.ctx.data.num_train,
                         {"train_loss": loss, "warmup": float(warmup)})

    def evaluate(self, payload: Payload, state: ClientState) -> dict[str, float]:
        out = super().evaluate(payload, state)
        own = state_model(state)
        if own is not None:
            model = self.ctx.task.build_model()
            set_arrays(model, own)
            local = evaluate_client(model, self.ctx.task, self.ctx.data, self.loss_fn, device=self.ctx.device)
            for key, value in local.items():
                if key != "num_test":
                    out[f"local_{key}"] = value
        return out


register_client(ClientSpec[FeSEMParams]("fesem", FeSEMTrainer))
