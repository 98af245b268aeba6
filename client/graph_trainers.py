"""Client halves of JGESR, CFL, FedAMP and pFedGraph (ALGORITHMS.md §8, §10).

* ``jgesr``, ``cfl``: plain local SGD (``train.*``) from the received model (the restored
  ``ψ_k`` / the cluster's model), as FedAvg's client.
* ``fedamp``: local SGD on ``F_i(θ) + (μ/2)‖θ − u_i‖²`` from the cloud model ``u_i``
  (``fedamp.prox-mu`` = μ).
* ``pfedgraph``: local SGD from ``θ̃_i`` on ``F_i(θ) − λ ⟨c_i, θ⟩/‖θ‖`` with the cluster model
  ``c_i`` sent as ``pfedgraph/c/<key>`` arrays (``pfedgraph.lam`` = λ; absent ``c_i``: no term).
  The model itself is the payload without those arrays.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from graphfl.client.trainers import SGDTrainer
from graphfl.client.training import get_arrays, param_keys, set_arrays, sgd_steps
from graphfl.common.core import ClientContext
from graphfl.common.registry import ClientSpec, register_client
from graphfl.common.types import Arrays, ClientState, FitResult, Payload
from graphfl.strategies.cfl import CFLConfig
from graphfl.strategies.fedamp import FedAMPConfig
from graphfl.strategies.jgesr import JGESRConfig
from graphfl.strategies.pfedgraph import CLUSTER_PREFIX, PFedGraphConfig


def fedamp_trainer(ctx: ClientContext[FedAMPConfig]) -> SGDTrainer[FedAMPConfig]:
    """FedAMP's client: local SGD with ``μ/2 ‖θ − u_i‖²`` towards the cloud model."""
    return SGDTrainer(ctx, mu=ctx.params.prox_mu)


def cosine_penalty(cluster: Arrays, lam: float, keys: tuple[str, ...]) -> Callable[[nn.Module], torch.Tensor]:
    """``−λ ⟨c, θ⟩ / ‖θ‖`` over the trainable parameters ``keys`` (pFedGraph's regulariser)."""
    anchor = torch.cat([torch.as_tensor(np.asarray(cluster[k], dtype=np.float32)).reshape(-1) for k in keys])

    def penalty(model: nn.Module) -> torch.Tensor:
        params = dict(model.named_parameters())
        flat = torch.cat([params[k].reshape(-1) for k in keys])
        return -lam * torch.dot(anchor.to(flat.device), flat) / torch.linalg.norm(flat).clamp_min(1e-12)

    return penalty


class PFedGraphTrainer(SGDTrainer[PFedGraphConfig]):
    """Local SGD from ``θ̃_i`` with pFedGraph's similarity regulariser (module docstring)."""

    def start_arrays(self, payload: Payload, state: ClientState) -> Arrays:
        return {k: v for k, v in payload.arrays.items() if not k.startswith(CLUSTER_PREFIX)}

    def fit(self, server_round: int, payload: Payload, state: ClientState) -> FitResult:
        model = self.ctx.task.build_model()
        set_arrays(model, self.start_arrays(payload, state))
        keys = param_keys(model)
        cluster = {k[len(CLUSTER_PREFIX):]: v for k, v in payload.arrays.items() if k.startswith(CLUSTER_PREFIX)}
        lam = self.params.lam
        penalty = cosine_penalty(cluster, lam, keys) if lam > 0 and all(k in cluster for k in keys) else None
        tc = self.ctx.config.train
        loss = sgd_steps(
            model, self.ctx.data, self.loss_fn, tc.local_steps, tc.batch_size, tc.lr,
            self.rng(server_round), penalty=penalty, momentum=tc.momentum,
            weight_decay=tc.weight_decay, device=self.ctx.device,
        )
        return FitResult(get_arrays(model), self.ctx.data.num_train, {"train_loss": loss})


register_client(ClientSpec[JGESRConfig]("jgesr", SGDTrainer))
register_client(ClientSpec[CFLConfig]("cfl", SGDTrainer))
register_client(ClientSpec[FedAMPConfig]("fedamp", fedamp_trainer))
register_client(ClientSpec[PFedGraphConfig]("pfedgraph", PFedGraphTrainer))
