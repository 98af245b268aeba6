"""Local-only training: every client trains its own model, nothing is aggregated.

The baseline that personalised / graph-aware methods must beat. The server sends the
common initial model in round 1 only; afterwards payloads are empty and the personal model
lives in the client's state (``context.state`` in Flower).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from graphfl.common.core import ServerContext, ServerCore
from graphfl.common.registry import AlgorithmSpec, register
from graphfl.common.types import ClientUpdate, MetricValue, Payload


@dataclass(frozen=True)
class LocalParams:
    """Local training has no hyperparameters beyond ``[train]``."""


class LocalCore(ServerCore[LocalParams]):
    """Keeps the latest uploaded model of each client only for reporting."""

    def __init__(self, ctx: ServerContext[LocalParams]) -> None:
        super().__init__(ctx)
        self._init = Payload(dict(ctx.initial_arrays))
        self._empty = Payload({})
        self.trained: set[int] = set()

    def configure_train(self, server_round: int, partition_id: int) -> Payload:
        return self._empty if partition_id in self.trained else self._init

    def aggregate_train(self, server_round: int, updates: Mapping[int, ClientUpdate]) -> dict[str, MetricValue]:
        self.trained.update(updates)
        return {"clients_trained": len(updates)}

    def evaluation_payload(self, partition_id: int) -> Payload:
        return self._empty if partition_id in self.trained else self._init


register(AlgorithmSpec("local", LocalParams, LocalCore,
                       "Local-only training (no communication after round 1)"))
