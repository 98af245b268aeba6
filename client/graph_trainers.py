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

from graphfl.client.objective import Penalty, cosine_term
from graphfl.client.trainers import SGDTrainer
from graphfl.common.core import ClientContext
from graphfl.common.registry import ClientSpec, register_client
from graphfl.common.types import Arrays, ClientState, Payload
from graphfl.strategies.cfl import CFLConfig
from graphfl.strategies.fedamp import FedAMPConfig
from graphfl.strategies.jgesr import JGESRConfig
from graphfl.strategies.pfedgraph import CLUSTER_PREFIX, PFedGraphConfig


def fedamp_trainer(ctx: ClientContext[FedAMPConfig]) -> SGDTrainer[FedAMPConfig]:
    """FedAMP's client: local SGD with ``μ/2 ‖θ − u_i‖²`` towards the cloud model."""
    return SGDTrainer(ctx, mu=ctx.params.prox_mu)


class PFedGraphTrainer(SGDTrainer[PFedGraphConfig]):
    """Local SGD from ``θ̃_i`` with pFedGraph's similarity regulariser (module docstring)."""

    def start_arrays(self, payload: Payload, state: ClientState) -> Arrays:
        return {k: v for k, v in payload.arrays.items() if not k.startswith(CLUSTER_PREFIX)}

    def penalties(self, server_round: int, payload: Payload, state: ClientState,
                  start: Arrays) -> tuple[Penalty, ...]:
        """``−λ ⟨c_i, θ⟩/‖θ‖`` when ``λ > 0`` and the payload carries every ``c_i`` array."""
        keys = self.keys
        cluster = {k[len(CLUSTER_PREFIX):]: v for k, v in payload.arrays.items() if k.startswith(CLUSTER_PREFIX)}
        lam = self.params.lam
        return (cosine_term(cluster, lam, keys),) if lam > 0 and all(k in cluster for k in keys) else ()


register_client(ClientSpec[JGESRConfig]("jgesr", SGDTrainer))
register_client(ClientSpec[CFLConfig]("cfl", SGDTrainer))
register_client(ClientSpec[FedAMPConfig]("fedamp", fedamp_trainer))
register_client(ClientSpec[PFedGraphConfig]("pfedgraph", PFedGraphTrainer))
