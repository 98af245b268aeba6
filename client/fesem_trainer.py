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

from graphfl.client.objective import LocalObjective, Penalty, proximal_term
from graphfl.client.trainers import SGDTrainer, state_model, store_model
from graphfl.common.registry import ClientSpec, register_client
from graphfl.common.types import Arrays, ClientState, FitResult, Payload
from graphfl.strategies.fesem import STEPS_KEY, WARMUP_KEY, FeSEMParams


class FeSEMTrainer(SGDTrainer[FeSEMParams]):
    """Local SGD from the assigned center with the optional proximal term of eq. 10.10."""

    def objective(self, server_round: int, payload: Payload, state: ClientState) -> LocalObjective:
        warmup = bool(payload.config.get(WARMUP_KEY, False))
        tc = self.ctx.config.train
        steps = int(payload.config.get(STEPS_KEY, tc.local_steps)) if warmup else tc.local_steps
        lam = self.params.prox_lambda
        penalties: tuple[Penalty, ...] = ()
        if lam > 0 and not warmup:
            # proximal_term is μ/2 ‖θ − a‖²; eq. 10.10 is λ‖θ − θ̄‖², so μ = 2λ.
            penalties = (proximal_term(payload.arrays, 2.0 * lam, self.keys),)
        return LocalObjective(payload.arrays, steps, self.rng(server_round), penalties,
                              extra={"warmup": float(warmup)})

    def finish(self, server_round: int, payload: Payload, state: ClientState, objective: LocalObjective,
               arrays: Arrays, loss: float) -> FitResult:
        store_model(state, arrays)
        return FitResult(arrays, self.ctx.data.num_train, {"train_loss": loss, **objective.extra})

    def evaluation_arrays(self, payload: Payload, state: ClientState) -> dict[str, Arrays]:
        """The center (``test_*``) and, once the client has trained, its last local model (``local_test_*``)."""
        out = {"": payload.arrays}
        own = state_model(state)
        if own is not None:
            out["local_"] = own
        return out


register_client(ClientSpec[FeSEMParams]("fesem", FeSEMTrainer))
