"""The two halves of a server-coordinated algorithm, as pure contracts (no Flower, no torch).

* :class:`ServerCore` — the server's state and math. It decides what each client receives
  (its own :class:`~graphfl.common.types.Payload`, keyed by *partition id*, which unlike
  Flower node ids survives SuperNode restarts) and folds the clients'
  :class:`~graphfl.common.types.ClientUpdate` s back into its state.
* :class:`ClientTrainer` — one client's local update and evaluation.

Both are generic in the algorithm's hyperparameter dataclass ``P`` and are registered
separately under one name (:mod:`graphfl.common.registry`). The runtimes that drive them
(``server/``: Flower engines and the in-process driver) never change when an algorithm is
added.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np

from graphfl.common.types import (
    Arrays, ClientData, ClientState, ClientUpdate, FitResult, MetricValue, Neighbourhood, Payload,
)

if TYPE_CHECKING:  # pragma: no cover
    from graphfl.common.config import RunConfig

P = TypeVar("P")
"""The algorithm's frozen hyperparameter dataclass."""


@dataclass(frozen=True)
class ServerContext(Generic[P]):
    """Everything a core may read at construction time.

    Attributes
    ----------
    config, params
        The resolved run config and this algorithm's hyperparameters.
    num_clients
        Number of partitions (= clients) in the federation.
    initial_arrays
        The common initial model (``state_dict`` order).
    param_keys
        Keys of trainable parameters, in registration order; θ of ALGORITHMS.md §1.1 is the
        concatenation of these arrays flattened. The other keys are buffers (kept local).
    num_examples
        Training examples per partition id (reported by the clients when they join).
    client_graph, graph_source
        The resolved client adjacency (:func:`graphfl.common.graph.resolve_client_graph`)
        and where it came from (``"task"``, ``"file PATH"``, ``"complete"``, ...), or ``None``.
    cluster_labels
        Planted cluster of each client, when the task has one (for ARI logging).
    """

    config: "RunConfig"
    params: P
    num_clients: int
    initial_arrays: Arrays
    param_keys: tuple[str, ...]
    num_examples: Mapping[int, int]
    client_graph: np.ndarray | None = None
    cluster_labels: np.ndarray | None = None
    seed: int = 0
    graph_source: str = ""


class ServerCore(ABC, Generic[P]):
    """Server-side state and math of one algorithm.

    Round protocol (every driver): for each selected client, ``configure_train``; the
    client trains; ``aggregate_train`` with all valid replies (possibly none). For the
    final evaluation (and round 0) clients evaluate ``evaluation_payload``.

    ``piggyback_eval = True`` declares that a client evaluating its round-``r`` training
    payload (before training on it) measures the model produced by round ``r-1``; the
    drivers then skip a separate evaluation exchange each round.
    """

    piggyback_eval: bool = True

    def __init__(self, ctx: ServerContext[P]) -> None:
        self.ctx = ctx
        self.params: P = ctx.params

    @abstractmethod
    def configure_train(self, server_round: int, partition_id: int) -> Payload | None:
        """Payload for ``partition_id`` in ``server_round`` (``None`` = leave it out)."""

    @abstractmethod
    def aggregate_train(
        self, server_round: int, updates: Mapping[int, ClientUpdate]
    ) -> dict[str, MetricValue]:
        """Fold valid updates (keyed by partition id; may be empty) into the state.

        Returns server-side metrics to log for this round (e.g. cluster assignments).
        """

    @abstractmethod
    def evaluation_payload(self, partition_id: int) -> Payload:
        """What client ``partition_id`` evaluates on its own test split right now."""

    def update_template(self, partition_id: int) -> Arrays:
        """Keys, shapes and dtypes a training reply of ``partition_id`` must have.

        Replies that differ, or contain NaN/Inf, are rejected before ``aggregate_train``.
        """
        return self.ctx.initial_arrays

    def final_arrays(self) -> Arrays | None:
        """A single model to save at the end, if the algorithm has one (e.g. FedAvg)."""
        return None


class TaskView(Protocol):
    """What a trainer may use of its task (implemented by :class:`graphfl.tasks.base.Task`)."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...

    def build_model(self) -> Any:
        """A freshly initialised ``torch.nn.Module``, identical for identical seeds."""

    def loss_fn(self) -> Any:
        """The task's loss module."""


@dataclass(frozen=True)
class ClientContext(Generic[P]):
    """What a trainer may read.

    ``neighbourhood`` is the client's neighbours in the run's client graph (ids and
    weights), empty when the run has none.
    """

    config: "RunConfig"
    params: P
    partition_id: int
    num_partitions: int
    task: TaskView
    data: ClientData
    device: str = "cpu"
    neighbourhood: Neighbourhood = Neighbourhood()


class ClientTrainer(ABC, Generic[P]):
    """Local update and evaluation of one algorithm on one client.

    Built per message from a :class:`ClientContext`; must be deterministic given (seed,
    partition id, round), so the Flower ClientApp and the in-process driver produce identical
    updates. State that must survive across rounds (personal models, control variates, ...)
    goes into the ``state`` dict the runtime hands in and persists (``context.state`` in
    Flower, a dict in the in-process driver).
    """

    def __init__(self, ctx: ClientContext[P]) -> None:
        self.ctx = ctx
        self.params: P = ctx.params

    @abstractmethod
    def fit(self, server_round: int, payload: Payload, state: ClientState) -> FitResult:
        """Train on the local training split starting from what ``payload`` says.

        May read and update ``state`` in place.
        """

    @abstractmethod
    def evaluate(self, payload: Payload, state: ClientState) -> dict[str, float]:
        """Metrics of this client's model (given ``payload`` and ``state``) on its test split.

        Returns at least ``test_loss`` and ``num_test``; classification tasks add ``test_acc``.
        """
