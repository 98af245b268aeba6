"""The server half of an algorithm as a pure core (numpy/torch, no Flower).

A :class:`ServerCore` decides what each client receives in a round (its own
:class:`Payload`, keyed by the client's *partition id*, which, unlike Flower node ids,
survives SuperNode restarts) and folds the clients' :class:`ClientUpdate` s back into its
state. Two drivers run the same core: :mod:`graphfl.strategies.flower_adapter` (Flower's
engines) and :mod:`graphfl.server.inprocess` (one process, for benchmarks and tests).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from graphfl.common.config import RunConfig

EVAL_PREFIX = "eval."
"""Reply metrics under this prefix are a client's evaluation (``eval.test_loss``); the others
describe its training. Shared by the client handler and the server's round loop."""

Arrays = dict[str, np.ndarray]
"""Named arrays in model ``state_dict`` order (parameters and buffers)."""

ConfigValue = bool | int | float | str
MetricValue = int | float | str | list


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
        return int(sum(a.nbytes for a in self.arrays.values()))


@dataclass(frozen=True)
class ClientUpdate:
    """A client's reply to a training round (already validated: finite, right shapes)."""

    partition_id: int
    arrays: Arrays
    num_examples: int
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerContext:
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
    client_graph, cluster_labels
        From the task (or ``graph_file``), when available.
    """

    config: "RunConfig"
    params: Any
    num_clients: int
    initial_arrays: Arrays
    param_keys: tuple[str, ...]
    num_examples: Mapping[int, int]
    client_graph: np.ndarray | None = None
    cluster_labels: np.ndarray | None = None
    seed: int = 0


class ServerCore(ABC):
    """Server-side state and math of one algorithm.

    Round protocol (both drivers): for each selected client, ``configure_train``; the
    client trains; ``aggregate_train`` with all valid replies (possibly none). For the
    final evaluation (and round 0) clients evaluate ``evaluation_payload``.

    ``piggyback_eval = True`` declares that a client evaluating its round-``r`` training
    payload (before training on it) measures the model produced by round ``r-1``; the
    drivers then skip a separate evaluation exchange each round.
    """

    piggyback_eval: bool = True

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

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


def validate_update(arrays: Arrays | None, template: Arrays) -> str | None:
    """Why a training reply is unusable (wrong keys/shapes/dtype, NaN or Inf), or ``None``."""
    if arrays is None:
        return "reply carries no arrays"
    missing = [k for k in template if k not in arrays]
    extra = [k for k in arrays if k not in template]
    if missing or extra:
        return f"array keys differ from the model: missing {missing[:5]}, unexpected {extra[:5]}"
    for key, ref in template.items():
        arr = arrays[key]
        if arr.shape != ref.shape:
            return f"array {key!r} has shape {arr.shape}, expected {ref.shape}"
        if arr.dtype.kind not in "fiub":
            return f"array {key!r} has unsupported dtype {arr.dtype}"
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
            return f"array {key!r} contains NaN or Inf"
    return None


def weighted_average(arrays: list[Arrays], weights: list[float]) -> Arrays:
    """``Σ_k w_k a_k / Σ_k w_k`` key by key, in float64, cast back to each array's dtype."""
    if not arrays:
        raise ValueError("weighted_average of no arrays")
    w = np.asarray(weights, dtype=np.float64)
    if np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be nonnegative with a positive sum, got {weights}")
    w = w / w.sum()
    out: Arrays = {}
    for key, ref in arrays[0].items():
        acc = np.zeros(ref.shape, dtype=np.float64)
        for a, wk in zip(arrays, w):
            acc += wk * a[key]
        out[key] = acc.astype(ref.dtype, copy=False)
    return out


def flatten_params(arrays: Arrays, keys: tuple[str, ...] | list[str]) -> np.ndarray:
    """θ = concatenation of ``arrays[k].ravel()`` for k in ``keys`` (float64)."""
    if not keys:
        return np.zeros(0)
    return np.concatenate([np.asarray(arrays[k], dtype=np.float64).ravel() for k in keys])


def unflatten_params(theta: np.ndarray, template: Arrays, keys: tuple[str, ...] | list[str]) -> Arrays:
    """Inverse of :func:`flatten_params`; keys not in ``keys`` are copied from ``template``."""
    out = dict(template)
    offset = 0
    for k in keys:
        ref = template[k]
        size = int(ref.size)
        if offset + size > theta.size:
            raise ValueError(f"theta has {theta.size} entries, too few for key {k!r}")
        out[k] = theta[offset : offset + size].reshape(ref.shape).astype(ref.dtype)
        offset += size
    if offset != theta.size:
        raise ValueError(f"theta has {theta.size} entries, the keys use {offset}")
    return out
