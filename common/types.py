"""Array and message types shared by every layer (the data that crosses a boundary).

Nothing here imports Flower, gRPC or torch: these are the plain values that server cores,
client trainers, the round loop and the p2p layer exchange.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Arrays = dict[str, np.ndarray]
"""Named arrays in model ``state_dict`` order (parameters and buffers)."""

ClientState = dict[str, np.ndarray]
"""Per-client persistent arrays (scalars as 0-d arrays), kept by the runtime across rounds."""

ConfigValue = bool | int | float | str
"""A scalar a server sends to a client next to the arrays."""

MetricValue = int | float | str | list  # type: ignore[type-arg]
"""A value a core logs for one round (lists for per-client assignments and the like)."""


@dataclass(frozen=True)
class Payload:
    """What one client receives: named arrays plus scalar config values.

    Cores should return the *same* ``arrays`` dict object to every client that gets the same
    arrays (e.g. FedAvg's global model): the Flower adapter then uploads it once.
    """

    arrays: Arrays
    config: Mapping[str, ConfigValue] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (the payload's size on the wire, less framing)."""
        return int(sum(a.nbytes for a in self.arrays.values()))


@dataclass(frozen=True)
class ClientUpdate:
    """A client's reply to a training round (already validated: finite, right shapes)."""

    partition_id: int
    arrays: Arrays
    num_examples: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    mask: Arrays | None = None
    """Which entries arrived (bool, ``True`` = received), for the float arrays that passed the
    noisy uplink (:mod:`graphfl.client.noisy_channel`); ``None`` = everything arrived."""


@dataclass(frozen=True)
class FitResult:
    """A client's training result: arrays to upload, sample count, metrics."""

    arrays: Arrays
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ClientData:
    """One client's local data, already split into train and test (numpy, float32 / int64).

    ``collate`` turns a slice of ``x_train`` / ``x_test`` (the rows of one minibatch) into the
    model's input, an object with ``.to(device)``; ``None`` means ``torch.as_tensor`` (plain
    feature arrays). Graph tasks keep sample ids in ``x`` and batch their graphs here (a
    molecule id → a PyG ``Batch``; a (user, item) pair → the client's graph plus the pairs).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    collate: Callable[[np.ndarray], Any] | None = field(default=None, compare=False, repr=False)

    @property
    def num_train(self) -> int:
        """Number of training examples."""
        return int(len(self.x_train))

    @property
    def num_test(self) -> int:
        """Number of test examples."""
        return int(len(self.x_test))


@dataclass(frozen=True)
class Neighbourhood:
    """A client's neighbours in the client graph and the edge weights (ids are partition ids).

    Empty when the run has no client graph. ``weights[k]`` is ``A[self, ids[k]] > 0``.
    """

    ids: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.weights):
            raise ValueError(f"neighbourhood has {len(self.ids)} ids but {len(self.weights)} weights")

    def __len__(self) -> int:
        return len(self.ids)
