"""The two halves of a server-coordinated algorithm, as pure contracts (no Flower, no torch).

* :class:`ServerCore` — the server's state and math. A round is a plan of one or more
  :class:`Phase` s; in each, the core decides what each client receives (its own
  :class:`~graphfl.common.types.Payload`, keyed by *partition id*, which unlike Flower node
  ids survives SuperNode restarts) and folds the clients'
  :class:`~graphfl.common.types.ClientUpdate` s back into its state before the next phase.
* :class:`ClientTrainer` — one client's local update and evaluation, per phase.

Both are generic in the algorithm's hyperparameter dataclass ``P`` and are registered
separately under one name (:mod:`graphfl.common.registry`). The runtimes that drive them
(``server/``: Flower engines and the in-process driver) never change when an algorithm is
added.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np

from graphfl.common import wire
from graphfl.common.types import (
    Arrays,
    ClientData,
    ClientState,
    ClientUpdate,
    FitResult,
    MetricValue,
    Neighbourhood,
    Payload,
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

    config: RunConfig
    params: P
    num_clients: int
    initial_arrays: Arrays
    param_keys: tuple[str, ...]
    num_examples: Mapping[int, int]
    client_graph: np.ndarray | None = None
    cluster_labels: np.ndarray | None = None
    seed: int = 0
    graph_source: str = ""


FIT_PHASE = "fit"
"""Name of the default training phase (:meth:`ClientTrainer.fit`)."""
EVALUATE_PHASE = "evaluate"
"""Name of the default evaluation phase (:meth:`ClientTrainer.evaluate`)."""
PHASE_KINDS = (wire.TRAIN, wire.EVALUATE)

Configure = Callable[[int, int], Payload | None]
"""``configure(server_round, partition_id) -> Payload | None`` (``None`` = leave the client out)."""
Aggregate = Callable[[int, Mapping[int, ClientUpdate]], dict[str, MetricValue]]
"""``aggregate(server_round, updates) -> server metrics``; ``updates`` are the valid replies."""
Template = Callable[[int], Arrays]
"""``template(partition_id) -> Arrays``: keys, shapes and dtypes a reply must have."""


@dataclass(frozen=True)
class Phase:
    """One exchange of a round: who receives what, what they do, how the replies are folded.

    The round loop calls ``configure`` for each client selected for the round (a client for
    which it returns ``None`` sits this phase out), sends the payloads, validates the replies
    and hands the valid ones to ``aggregate``, all before the next phase is configured. So a
    later phase's ``configure`` sees the state that the earlier phases' ``aggregate`` left.

    Attributes
    ----------
    name
        What the client does: the trainer's :meth:`ClientTrainer.fit_phase` (``kind`` train)
        or :meth:`ClientTrainer.evaluate_phase` (``kind`` evaluate) is called with it.
        ``"fit"`` / ``"evaluate"`` are :meth:`ClientTrainer.fit` / :meth:`ClientTrainer.evaluate`.
    configure, aggregate
        See :data:`Configure` and :data:`Aggregate`.
    template
        For ``kind`` train: the arrays a reply of a client must have (keys, shapes, dtypes;
        replies that differ or hold NaN/Inf are rejected before ``aggregate``). Ignored for
        ``kind`` evaluate, whose replies carry metrics only (``ClientUpdate.arrays`` is empty,
        ``ClientUpdate.metrics`` holds the evaluation).
    kind
        ``"train"`` (the reply uploads arrays) or ``"evaluate"`` (the reply is metrics).
    """

    name: str
    configure: Configure
    aggregate: Aggregate
    template: Template | None = None
    kind: str = wire.TRAIN

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a Phase needs a name")
        if self.kind not in PHASE_KINDS:
            raise ValueError(f"phase {self.name!r}: kind {self.kind!r} is not one of {list(PHASE_KINDS)}")
        if self.kind == wire.TRAIN and self.template is None:
            raise ValueError(f"phase {self.name!r}: a train phase needs a reply template")


class ServerCore(ABC, Generic[P]):
    """Server-side state and math of one algorithm.

    A round is a *plan* of one or more :class:`Phase` s (:meth:`round_plan`). The default plan
    is one phase, ``fit``, built from :meth:`configure_train`, :meth:`aggregate_train` and
    :meth:`update_template`, so a single-exchange algorithm implements exactly those (plus
    :meth:`evaluation_payload`). A multi-exchange algorithm overrides :meth:`round_plan`
    instead; the round loop does not change. For the final evaluation (and after every
    round when evaluation is not piggy-backed) clients evaluate ``evaluation_payload``.

    ``piggyback_eval = True`` declares that a client evaluating its round-``r`` payload of
    the *first* phase (before working on it) measures the model produced by round ``r-1``;
    the loop then skips a separate evaluation exchange each round.
    """

    piggyback_eval: bool = True

    def __init__(self, ctx: ServerContext[P]) -> None:
        cls = type(self)
        if cls.round_plan is ServerCore.round_plan and (
            cls.configure_train is ServerCore.configure_train or cls.aggregate_train is ServerCore.aggregate_train
        ):
            raise TypeError(f"{cls.__name__} must implement configure_train and aggregate_train "
                            "(a one-phase round) or override round_plan")
        self.ctx = ctx
        self.params: P = ctx.params

    def round_plan(self, server_round: int) -> Iterable[Phase]:
        """The phases of round ``server_round``, in order.

        Consumed lazily: a generator may decide a later phase from the state the earlier
        phases' ``aggregate`` left. The default is the one phase ``fit`` (see the class doc).
        """
        return (Phase(FIT_PHASE, self.configure_train, self.aggregate_train, self.update_template),)

    def configure_train(self, server_round: int, partition_id: int) -> Payload | None:
        """Payload for ``partition_id`` in ``server_round`` (``None`` = leave it out)."""
        raise NotImplementedError(f"{type(self).__name__}.configure_train")

    def aggregate_train(
        self, server_round: int, updates: Mapping[int, ClientUpdate]
    ) -> dict[str, MetricValue]:
        """Fold valid updates (keyed by partition id; may be empty) into the state.

        Returns server-side metrics to log for this round (e.g. cluster assignments).
        """
        raise NotImplementedError(f"{type(self).__name__}.aggregate_train")

    @abstractmethod
    def evaluation_payload(self, partition_id: int) -> Payload:
        """What client ``partition_id`` evaluates on its own test split right now."""

    def update_template(self, partition_id: int) -> Arrays:
        """Keys, shapes and dtypes a ``fit`` reply of ``partition_id`` must have.

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

    config: RunConfig
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
    Flower, a dict in the in-process driver); it also carries what one phase of a round leaves
    for the next.

    A request names a phase (:class:`Phase`); :meth:`fit_phase` and :meth:`evaluate_phase`
    dispatch on it. A trainer of a multi-phase algorithm overrides them for its own phase
    names and defers to the base class for ``fit`` / ``evaluate``.
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

    def after_upload(self, phase: str, server_round: int, payload: Payload, uploaded: Arrays,
                     state: ClientState) -> None:
        """Called after a train-kind phase with the arrays the server will decode (``Q`` of the
        upload when ``[compress]`` is on, else the upload itself); may update ``state``.

        The default does nothing; FedGATE keeps ``Q(Δ_i)`` for its δ update (ALGORITHMS.md §9.2).
        """

    def fit_phase(self, phase: str, server_round: int, payload: Payload, state: ClientState) -> FitResult:
        """Serve a train-kind request of phase ``phase``: ``fit`` for :data:`FIT_PHASE`.

        Raises
        ------
        ValueError
            For a phase this trainer does not know (the message names it).
        """
        if phase == FIT_PHASE:
            return self.fit(server_round, payload, state)
        raise ValueError(f"{type(self).__name__} (client {self.ctx.partition_id}) has no train phase "
                         f"{phase!r}; it knows {[FIT_PHASE]}")

    def evaluate_phase(self, phase: str, payload: Payload, state: ClientState) -> dict[str, float]:
        """Serve an evaluate-kind request of phase ``phase``: ``evaluate`` for :data:`EVALUATE_PHASE`."""
        if phase == EVALUATE_PHASE:
            return self.evaluate(payload, state)
        raise ValueError(f"{type(self).__name__} (client {self.ctx.partition_id}) has no evaluate phase "
                         f"{phase!r}; it knows {[EVALUATE_PHASE]}")
