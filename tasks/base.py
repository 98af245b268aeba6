"""What a task is: data for each client, a model, a loss and metrics.

A task is pure data + model code (numpy / torch), deterministic in its seed, and knows
nothing about Flower or gRPC. It may also expose a ground-truth cluster label per client
and a client graph (the multicenter task has both); graph-aware strategies use them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from graphfl.common.types import ClientData

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from graphfl.common.config import DataConfig


class DataError(FileNotFoundError):
    """A data file is missing or malformed; the message names the file and how to get it."""




@dataclass(frozen=True)
class TaskSpec:
    """Static facts about a task."""

    name: str
    kind: Literal["classification", "regression"]
    default_nodes: int
    summary: str = ""
    needs_data_dir: bool = False


class Task(ABC):
    """Base class of every task; subclasses are registered in :mod:`graphfl.tasks.registry`."""

    spec: TaskSpec

    def __init__(self, data: DataConfig | None = None, data_dir: str = "", seed: int = 0) -> None:
        from graphfl.common.config import DataConfig

        self.data = data if data is not None else DataConfig()
        self.data_dir = data_dir
        self.seed = int(seed)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def kind(self) -> str:
        return self.spec.kind

    @abstractmethod
    def client_data(self, partition_id: int, num_partitions: int) -> ClientData:
        """Local train/test data of client ``partition_id`` out of ``num_partitions``.

        Deterministic in (seed, num_partitions, data config); independent of which process
        calls it, so a SuperNode and the in-process driver see the same data.
        """

    @abstractmethod
    def build_model(self) -> torch.nn.Module:
        """A freshly initialised model; identical for identical ``self.seed``."""

    def loss_fn(self) -> torch.nn.Module:
        import torch

        return torch.nn.CrossEntropyLoss() if self.kind == "classification" else torch.nn.MSELoss()

    def metrics(self, outputs: np.ndarray, targets: np.ndarray) -> dict[str, float]:
        """Extra evaluation metrics from a client's test outputs (model outputs, stacked) and targets.

        Reported beside ``test_loss`` / ``test_acc`` (e.g. ``test_auc``, ``test_mae``); a metric
        that is undefined on this client (ROC-AUC with one class) is ``nan`` and the server's
        mean skips it. Default: none.
        """
        return {}

    def describe(self) -> dict[str, Any]:
        """Facts about the loaded data for the result file (e.g. rows skipped); default none."""
        return {}

    def holdout_view(self, data: ClientData) -> ClientData:
        """``data`` after its training rows were re-split (validation, :mod:`graphfl.tasks.holdout`).

        A task whose batches depend on the training set as a whole (a graph built from the
        training edges) rebuilds ``collate`` from ``data.x_train`` here, so that held-out rows do
        not leak into it. Default: ``data`` unchanged (each sample's input is its own).
        """
        return data

    def cluster_labels(self, num_partitions: int) -> np.ndarray | None:
        """Ground-truth cluster of each client, if the task plants one."""
        return None

    def client_graph(self, num_partitions: int) -> np.ndarray | None:
        """Symmetric 0/1 (or weighted) adjacency between clients, zero diagonal, if any."""
        return None

    def check_num_partitions(self, num_partitions: int) -> None:
        if num_partitions < 1:
            raise ValueError(f"task {self.name}: num_partitions must be >= 1, got {num_partitions}")
