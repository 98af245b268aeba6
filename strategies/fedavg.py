"""FedAvg and FedProx (ALGORITHMS.md §10; McMahan et al. 2017, Li et al. 2020).

Server update: ``θ ← Σ_i n_i θ_i / Σ_i n_i`` over the clients that replied (uniform weights
with ``weighted = false``). Every client receives the same global model. FedProx differs
only on the client: local loss ``F_i(θ) + μ/2 ‖θ − θ_global‖²``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from graphfl.common.arrays import weighted_average
from graphfl.common.core import ServerContext, ServerCore
from graphfl.common.registry import AlgorithmSpec, register
from graphfl.common.types import Arrays, ClientUpdate, MetricValue, Payload

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FedAvgParams:
    """FedAvg hyperparameters."""

    weighted: bool = True  # weight clients by their number of training samples


@dataclass(frozen=True)
class FedProxParams:
    """FedProx hyperparameters (``mu`` default as in FedTorch)."""

    mu: float = field(default=0.002, metadata={"min": 0.0})
    weighted: bool = True


class AveragingParams(Protocol):
    """What FedAvg's server reads of its hyperparameters (FedAvg's and FedProx's have it)."""

    @property
    def weighted(self) -> bool: ...


A = TypeVar("A", bound=AveragingParams)


class FedAvgCore(ServerCore[A]):
    """Global-model averaging; the same payload object goes to every client.

    Generic in its hyperparameters: FedAvg and FedProx share it (FedProx differs on the client).
    """

    def __init__(self, ctx: ServerContext[A]) -> None:
        super().__init__(ctx)
        self.global_arrays = dict(ctx.initial_arrays)
        self._payload = Payload(self.global_arrays)

    def configure_train(self, server_round: int, partition_id: int) -> Payload:
        return self._payload

    def aggregate_train(self, server_round: int, updates: Mapping[int, ClientUpdate]) -> dict[str, MetricValue]:
        if not updates:
            logger.warning("round %d: no valid client update; the global model is unchanged", server_round)
            return {"clients_aggregated": 0}
        ups = list(updates.values())
        weights = [u.num_examples if self.params.weighted else 1.0 for u in ups]
        self.global_arrays = weighted_average([u.arrays for u in ups], weights)
        self._payload = Payload(self.global_arrays)
        return {"clients_aggregated": len(ups)}

    def evaluation_payload(self, partition_id: int) -> Payload:
        return self._payload

    def final_arrays(self) -> Arrays:
        return self.global_arrays


register(AlgorithmSpec(
    "fedavg", FedAvgParams, FedAvgCore[FedAvgParams], "FedAvg: sample-weighted averaging of local SGD models"))
register(AlgorithmSpec(
    "fedprox", FedProxParams, FedAvgCore[FedProxParams], "FedProx: FedAvg with a proximal term mu/2 |theta - global|^2"))
