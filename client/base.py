"""The client half of an algorithm: a local trainer over one client's data.

A :class:`ClientTrainer` is built per message from a :class:`ClientContext` and must be
deterministic given (seed, partition id, round): the Flower ClientApp and the in-process
driver then produce identical updates. State that must survive across rounds (personal
models, control variates, ...) goes into the ``state`` dict the runtime hands in; the
runtime persists it (``context.state`` in Flower, a dict in the in-process driver).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from graphfl.common.config import RunConfig
    from graphfl.strategies.base import Arrays, Payload
    from graphfl.tasks.base import ClientData, Task

ClientState = dict[str, np.ndarray]
"""Per-client persistent arrays (scalars as 0-d arrays)."""


@dataclass(frozen=True)
class ClientContext:
    """What a trainer may read."""

    config: "RunConfig"
    params: Any
    partition_id: int
    num_partitions: int
    task: "Task"
    data: "ClientData"
    device: str = "cpu"


@dataclass(frozen=True)
class FitResult:
    """A client's training result: arrays to upload, sample count, metrics."""

    arrays: "Arrays"
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)


class ClientTrainer(ABC):
    """Local update and evaluation of one algorithm on one client."""

    def __init__(self, ctx: ClientContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def fit(self, server_round: int, payload: "Payload", state: ClientState) -> FitResult:
        """Train on the local training split starting from what ``payload`` says.

        May read and update ``state`` in place.
        """

    @abstractmethod
    def evaluate(self, payload: "Payload", state: ClientState) -> dict[str, float]:
        """Metrics of this client's model (given ``payload`` and ``state``) on its test split.

        Returns at least ``test_loss`` and ``num_test``; classification tasks add ``test_acc``.
        """
