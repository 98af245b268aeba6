"""The p2p node contract: per-neighbour messages on named channels -> ``combine`` -> ``step``.

A decentralized algorithm is written once, for one node, as a :class:`P2PAlgorithm`. The
runtimes (the in-process driver and the gRPC peer, :mod:`graphfl.p2p.driver`) call it the same
way, one iteration ``t`` at a time (:func:`graphfl.p2p.node.node_iteration`)::

    combined = None
    if algo.communicates(t):                       # e.g. t mod tau == 0
        combined = {}
        for phase in algo.phases:                  # one exchange per phase; most algorithms: one
            out   = algo.outgoing(state, phase, combined, ctx)   # to all, or per neighbour
            inbox = <gather phase.channels from algo.senders(phase, ctx), failure policy>
            combined.update(algo.combine(state, inbox, ctx))    # default: mix with W_i·
    state = algo.step(state, combined, oracle, ctx)              # t -> t + 1

* **Channels.** A message is ``{channel: {tensor name: array}}``; an algorithm declares the
  tensors each channel carries (:meth:`P2PAlgorithm.channels`, ``(dtype, shape)`` per tensor)
  and inbound messages are validated against that before they reach it.
* **Outgoing** (:class:`Outgoing`): the same channels to every neighbour (the common case,
  :meth:`Outgoing.to_all`), or a different message per neighbour
  (:meth:`Outgoing.per_neighbour`; e.g. ADMM's edge owner sends ``(β_ji, α_ji)`` only to ``j``).
* **Inbox** (:class:`Inbox`): ``{neighbour id: {channel: {tensor: array}}}`` of the neighbours
  heard in time, the node's own message, and the weights row ``W_i·`` re-weighted over the
  neighbours heard (the failure policy, :func:`graphfl.p2p.mixing.reweight`).
* **combine** defaults to mixing every channel with the weights,
  ``x̃_i = Σ_{j ∈ N̄_i} W_ij x_j`` (:func:`mix_inbox`, ALGORITHMS §1.2); an algorithm that
  needs the neighbours' own messages (ADMM's edge step, FedRelax's pseudo-labels) overrides it.
* **State** (:class:`NodeState`): ``t``, ``θ_i``, an optional tracker, other per-node arrays,
  per-edge state keyed by neighbour id (first class: checkpointed with the node), an optional
  algorithm RNG. Everything in it is checkpointed by :mod:`graphfl.p2p.checkpoint`.

Algorithms register under one name in :mod:`graphfl.p2p.algorithms.registry`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from graphfl.p2p.mixing import mix

Array = npt.NDArray[Any]
"""One tensor (any dtype the wire supports, :data:`graphfl.p2p.codec.SUPPORTED_DTYPES`)."""
Arrays = dict[str, Array]
"""Named tensors of one channel: ``{tensor name: array}``."""
Channels = dict[str, Arrays]
"""One message: ``{channel: {tensor name: array}}``."""
TensorSpec = tuple[str, tuple[int, ...]]
"""``(dtype name, shape)`` of one tensor."""
ChannelSpecs = dict[str, dict[str, TensorSpec]]
"""``{channel: {tensor name: (dtype name, shape)}}``: what inbound messages must carry."""

PARAMS = "params"
"""Conventional channel of the model parameters ``θ`` (tensor :data:`THETA`)."""
THETA = "theta"


class LocalProblem(Protocol):
    """What every runtime needs from a node's local problem: a start and an evaluation."""

    def initial_theta(self) -> Array: ...

    def test_loss(self, theta: Array) -> float: ...


class GradientOracle(LocalProblem, Protocol):
    """A node's local problem ``f_i`` for first-order algorithms (a model + loss + local data).

    ``sample`` draws a fresh minibatch from the node's own seeded RNG (attribute ``rng``, a
    :class:`numpy.random.Generator`, checkpointed with the node when present); ``grad``
    returns the stochastic gradient ``∇̂f_i(θ; batch)`` (same dtype and shape as θ) and the
    batch loss.
    """

    dim: int

    def sample(self) -> Any: ...

    def grad(self, theta: Array, batch: Any) -> tuple[Array, float]: ...


P = TypeVar("P")
"""An algorithm's frozen hyperparameter dataclass."""
O_contra = TypeVar("O_contra", bound=LocalProblem, contravariant=True)
"""The local problem an algorithm works on (e.g. :class:`GradientOracle`)."""


@dataclass(frozen=True)
class NodeContext:
    """What a node knows about its place in the network (fixed for a run).

    Attributes
    ----------
    node
        This node's id.
    neighbours
        Its neighbours' ids, ascending (``N_i``, without ``node``).
    row
        The nonzero mixing weights ``{j: W_ij}`` of its row, ``node`` included.
    edge_weights
        ``{j: A_ij}``, the graph's edge weights to its neighbours (1.0 on unweighted graphs);
        FedRelax's ``A_ii'`` (ALGORITHMS §7.1).
    num_nodes
        ``n``, the number of nodes of the network.
    num_edges
        ``|E|``, the number of edges of the whole graph (FedADMM's Bonferroni correction over
        the tested edges); ``-1`` when unknown.
    """

    node: int
    neighbours: tuple[int, ...]
    row: Mapping[int, float]
    edge_weights: Mapping[int, float]
    num_nodes: int
    num_edges: int = -1

    @property
    def degree(self) -> int:
        """``d_i = |N_i|``."""
        return len(self.neighbours)

    @classmethod
    def from_matrix(cls, w: npt.ArrayLike, node: int, adjacency: npt.ArrayLike | None = None) -> NodeContext:
        """The context of ``node`` from a mixing matrix ``W`` (and the graph's weighted adjacency).

        The neighbours are the off-diagonal nonzeros of row ``node`` of ``W``; ``adjacency``, when
        given, must have the same pattern and supplies the edge weights.
        """
        wm = np.asarray(w, dtype=np.float64)
        row = {int(j): float(wm[node, j]) for j in np.nonzero(wm[node])[0]}
        if adjacency is None:
            nbrs = tuple(j for j in sorted(row) if j != node)
            ew = {j: 1.0 for j in nbrs}
        else:
            adj = np.asarray(adjacency, dtype=np.float64)
            nbrs = tuple(int(j) for j in np.nonzero(adj[node])[0] if int(j) != node)
            by_w = tuple(j for j in sorted(row) if j != node)
            if nbrs != by_w:
                raise ValueError(f"node {node}: the adjacency's neighbours {list(nbrs)} differ from the mixing "
                                 f"matrix's {list(by_w)}")
            ew = {j: float(adj[node, j]) for j in nbrs}
        pattern = (wm if adjacency is None else np.asarray(adjacency, dtype=np.float64)) != 0
        np.fill_diagonal(pattern, False)
        return cls(node, nbrs, row, ew, int(wm.shape[0]), int(np.count_nonzero(np.triu(pattern | pattern.T, 1))))

    @classmethod
    def stacked(cls, num_nodes: int, num_edges: int = -1) -> NodeContext:
        """The context of a state that holds all ``num_nodes`` nodes at once (the vectorised engine):
        ``node = -1``, no neighbours, no weights.
        """
        return cls(-1, (), {}, {}, num_nodes, num_edges)

    @classmethod
    def for_network(cls, w: npt.ArrayLike, adjacency: npt.ArrayLike | None = None) -> list[NodeContext]:
        """Every node's context, the same as :meth:`from_matrix` for each node but in ``O(n²)`` in all
        (``from_matrix`` counts the edges for each node: ``O(n³)`` for a whole network).
        """
        wm = np.asarray(w, dtype=np.float64)
        adj = None if adjacency is None else np.asarray(adjacency, dtype=np.float64)
        pattern = (wm if adj is None else adj) != 0
        pattern = pattern.copy()
        np.fill_diagonal(pattern, False)
        num_edges = int(np.count_nonzero(np.triu(pattern | pattern.T, 1)))
        out = []
        for node in range(wm.shape[0]):
            cols = np.flatnonzero(wm[node])
            row = {int(j): float(wm[node, j]) for j in cols}
            by_w = tuple(int(j) for j in cols if int(j) != node)
            if adj is None:
                nbrs, ew = by_w, {j: 1.0 for j in by_w}
            else:
                nbrs = tuple(int(j) for j in np.flatnonzero(adj[node]) if int(j) != node)
                if nbrs != by_w:
                    raise ValueError(f"node {node}: the adjacency's neighbours {list(nbrs)} differ from the mixing "
                                     f"matrix's {list(by_w)}")
                ew = {j: float(adj[node, j]) for j in nbrs}
            out.append(cls(node, nbrs, row, ew, int(wm.shape[0]), num_edges))
        return out


@dataclass
class NodeState:
    """One node's state; the runtimes checkpoint all of it (:mod:`graphfl.p2p.checkpoint`).

    Attributes
    ----------
    t
        Iterations done (the next iteration is ``t``).
    theta
        The node's model ``θ_i`` (what is evaluated and reported).
    tracker
        DFL-GT's gradient tracker ``ϑ_i`` (ALGORITHMS §3.2), ``None`` for other algorithms.
    aux
        Other per-node arrays (DFL-GT: ``g_prev``; ADMM: the running sum of ``θ_i(t)``;
        FedRelax: the last pseudo-labels), by name.
    edges
        Per-edge state keyed by neighbour id: ``{j: {name: array}}`` (ADMM: ``β_ij``, ``α_ij``
        and, on edges this node owns, the mirror ``β_ji``, ``α_ji``; ALGORITHMS §6.4).
    loss
        Last minibatch training loss (NaN when there is none).
    rng
        An RNG of the algorithm's own (e.g. ADMM's availability draws), or ``None``; the
        local problem's minibatch RNG lives in the oracle.
    """

    t: int
    theta: Array
    tracker: Array | None = None
    aux: dict[str, Array] = field(default_factory=dict)
    edges: dict[int, dict[str, Array]] = field(default_factory=dict)
    loss: float = float("nan")
    rng: np.random.Generator | None = None


@dataclass(frozen=True)
class Phase:
    """One exchange of an iteration: a name and the channels sent in it (unique per algorithm)."""

    name: str
    channels: tuple[str, ...]


@dataclass(frozen=True)
class Outgoing:
    """What a node sends in one phase: build it with :meth:`to_all` or :meth:`per_neighbour`.

    Attributes
    ----------
    own
        The node's own message: what :meth:`to_all` sends to everyone, and the node's own term
        in the default mixing (:func:`mix_inbox`).
    messages
        ``{j: message}`` for per-neighbour sending, ``None`` when every neighbour gets ``own``.
    """

    own: Channels | None = None
    messages: Mapping[int, Channels] | None = None

    @classmethod
    def to_all(cls, channels: Channels) -> Outgoing:
        """The same ``channels`` to every neighbour (DFL-SGD, DFL-GT, gossip, FedRelax)."""
        return cls(own=channels)

    @classmethod
    def per_neighbour(cls, messages: Mapping[int, Channels], own: Channels | None = None) -> Outgoing:
        """``messages[j]`` to neighbour ``j``; no message to a neighbour not in ``messages`` (ADMM's edges).

        ``own`` (optional) is the node's own message for :func:`mix_inbox`; it is not sent. It
        reaches ``combine`` as ``inbox.own``, so it may also carry the node's own values of this
        phase (FedADMM: its new ``θ_i`` and the edges it keeps).
        """
        return cls(own=own, messages=dict(messages))

    def to(self, j: int) -> Channels | None:
        """The message for neighbour ``j`` (``None``: nothing is sent to ``j``)."""
        return self.own if self.messages is None else self.messages.get(j)

    def targets(self, neighbours: tuple[int, ...]) -> list[int]:
        """The neighbours that get a message, ascending."""
        return [j for j in neighbours if self.to(j) is not None]


@dataclass(frozen=True)
class Inbox:
    """What a node received in one phase of one round.

    Attributes
    ----------
    round
        The iteration ``t`` the messages belong to.
    phase
        The phase's name.
    own
        The node's own broadcast message (``None`` if it sent per-neighbour messages only).
    messages
        ``{j: {channel: {tensor: array}}}`` for every neighbour heard in time, ascending ``j``.
    weights
        ``W_i·`` over ``{node} ∪ heard``, re-weighted for the missing ones (sums to 1).
    missing
        Neighbours expected in this phase but not heard (skipped by the failure policy).
    """

    round: int
    phase: str
    own: Channels | None
    messages: Mapping[int, Channels]
    weights: Mapping[int, float]
    missing: tuple[int, ...] = ()


def mix_inbox(node: int, inbox: Inbox) -> Channels:
    """Default ``combine``: ``x̃_i = Σ_{j ∈ {i} ∪ heard} w_j x_j`` for every channel and tensor.

    ``w`` is ``inbox.weights`` (``W_i·``, re-weighted when a neighbour is missing); summation in
    the parameters' dtype in ascending ``j`` by :func:`graphfl.p2p.mixing.mix`, so every runtime gets the
    same bits. Needs the node's own broadcast message.
    """
    if inbox.own is None:
        raise ValueError(f"node {node}: phase {inbox.phase!r} has no own broadcast message to mix; "
                         "an algorithm with per-neighbour messages must override combine()")
    mixed: Channels = {}
    for ch, arrays in inbox.own.items():
        mixed[ch] = {}
        for name, own_arr in arrays.items():
            stack = {node: own_arr}
            stack.update({j: msg[ch][name] for j, msg in inbox.messages.items()})
            mixed[ch][name] = mix(dict(inbox.weights), stack)
    return mixed


class P2PAlgorithm(ABC, Generic[P, O_contra]):
    """A decentralized algorithm as one node's functions (see the module docstring).

    Subclasses set ``name`` (the one registry name), ``phases`` and implement
    :meth:`channels`, :meth:`init`, :meth:`outgoing` and :meth:`step`; they may override
    :attr:`period`, :meth:`senders`, :meth:`combine` and :meth:`evaluate`.
    Implementations must be deterministic functions of (state, inbox, the oracle's RNG, the
    state's RNG) so that every runtime reproduces the same iterates.
    """

    name: ClassVar[str] = ""
    phases: ClassVar[tuple[Phase, ...]] = ()
    theta_is_model: ClassVar[bool] = True
    """Whether ``θ_i`` are model parameters that can be averaged and evaluated by the local
    problem's ``test_loss`` (FedRelax: ``θ_i`` are predictions on ``D'``, so no)."""
    stackable: ClassVar[bool] = False
    """Whether :meth:`init`, :meth:`outgoing` and :meth:`step` run unchanged on all nodes at once.

    They must then be elementwise arithmetic on the state's arrays and calls of the local problem's
    ``initial_theta`` / ``sample`` / ``grad``, broadcast one message to every neighbour, keep no
    per-edge state and no RNG of their own, and use the context only to name the node in an error.
    The vectorised engine (:mod:`graphfl.p2p.vectorised`) then runs these same methods on a state
    whose arrays carry the node axis first, with a stacked local problem as the oracle
    (:class:`~graphfl.p2p.vectorised.LinearBatch`), mixing each broadcast tensor as the default
    :meth:`combine` does; an algorithm or instance with a :meth:`combine` of its own runs on the
    per-node driver."""

    def __init__(self, params: P) -> None:
        self.params = params
        seen: set[str] = set()
        for ph in self.phases:
            dup = seen & set(ph.channels)
            if dup:
                raise ValueError(f"algorithm {self.name!r}: channel(s) {sorted(dup)} appear in two phases")
            seen |= set(ph.channels)

    # -- schedule ---------------------------------------------------------------------------
    @property
    def period(self) -> int:
        """Communicate every ``period`` iterations (DFL's ``tau``); one round = ``period`` iterations."""
        return 1

    def communicates(self, t: int) -> bool:
        """Iteration ``t`` exchanges messages iff ``t mod period == 0`` (seed 000 eqs. 10.3/10.4)."""
        return t % self.period == 0

    @property
    def channel_names(self) -> tuple[str, ...]:
        """All channels, in phase order."""
        return tuple(ch for ph in self.phases for ch in ph.channels)

    # -- the node ---------------------------------------------------------------------------
    @abstractmethod
    def channels(self, state: NodeState, ctx: NodeContext) -> ChannelSpecs:
        """The tensors each channel carries, ``{channel: {tensor: (dtype, shape)}}``, for validation."""

    @abstractmethod
    def init(self, oracle: O_contra, ctx: NodeContext) -> NodeState:
        """The node's state at ``t = 0`` (every node of a network starts this way)."""

    @abstractmethod
    def outgoing(self, state: NodeState, phase: Phase, combined: Channels, ctx: NodeContext) -> Outgoing:
        """What the node sends in ``phase`` (``combined``: what earlier phases of this round combined)."""

    def senders(self, phase: Phase, ctx: NodeContext) -> tuple[int, ...]:
        """The neighbours that send to this node in ``phase`` (default: all of them)."""
        return ctx.neighbours

    def active_phases(self, state: NodeState) -> tuple[Phase, ...]:
        """The phases of iteration ``state.t`` (default: all of :attr:`phases`, every round).

        An algorithm with a one-off protocol phase before training (FedADMM's edge selection)
        returns it only at ``t = 0``. Every node of a network must return the same phases for
        the same ``t``.
        """
        return self.phases

    def expected_senders(self, phase: Phase, state: NodeState, combined: Channels, ctx: NodeContext) -> tuple[int, ...]:
        """The neighbours this node waits for in ``phase`` (default: :meth:`senders`), given its
        ``state`` and what the earlier phases of this round ``combined``.

        Override when the senders depend on them (FedADMM after edge selection waits only for
        the endpoints of the edges it kept).
        """
        return self.senders(phase, ctx)

    def combine(self, state: NodeState, inbox: Inbox, ctx: NodeContext) -> Channels:
        """Turn one phase's inbox into inputs of :meth:`step`; default: mix with ``W_i·`` (:func:`mix_inbox`)."""
        return mix_inbox(ctx.node, inbox)

    @abstractmethod
    def step(self, state: NodeState, combined: Channels | None, oracle: O_contra, ctx: NodeContext) -> NodeState:
        """Iteration ``t -> t + 1``; ``combined`` is ``None`` on iterations without communication."""

    def evaluate(self, state: NodeState, oracle: O_contra) -> float:
        """The node's test loss (default: the local problem's ``test_loss(θ_i)``)."""
        return float(oracle.test_loss(state.theta))

    # -- results ----------------------------------------------------------------------------
    def output(self, state: NodeState, oracle: O_contra) -> dict[str, Array]:
        """The node's result arrays (written to ``peer-<id>.npz``); default ``theta`` (and ``tracker``).

        ``estimate``, when present, is the node's final estimate reported in ``p2p.json``
        (FedADMM: the averaged iterate ``θ̄_i``).
        """
        out: dict[str, Array] = {THETA: state.theta}
        if state.tracker is not None:
            out["tracker"] = state.tracker
        return out

    def report(self, state: NodeState, oracle: O_contra, ctx: NodeContext) -> dict[str, Any]:
        """JSON-ready results of the node beyond the per-round records (test metrics, selected
        edges, ...), written to ``peer-<id>.json`` under ``report``; default none.
        """
        return {}

    def check_graph(self, edges: Sequence[tuple[int, int]], num_nodes: int) -> None:
        """Refuse a communication graph the algorithm cannot run on (a :class:`ConfigError`); default: any."""

    def graph_for(self, edges: Sequence[tuple[int, int]], num_nodes: int) -> list[tuple[int, int]]:
        """The communication graph the algorithm runs on, given the user's (``graphfl p2p`` writes this
        one into the network file); default: the given edges. FedADMM-Local-ES: every pair.
        """
        return [(int(i), int(j)) for i, j in edges]

    def needs_every_neighbour_at_start(self) -> bool:
        """Whether a peer must reach every neighbour before its first round, even under
        ``on-missing = "skip"`` (FedADMM-Local-ES: its selection phase needs every pair).
        """
        return False


def same_specs(like: Array) -> TensorSpec:
    """``(dtype, shape)`` of ``like`` (channels whose tensors have the shape of θ)."""
    a = np.asarray(like)
    return (a.dtype.name, tuple(int(d) for d in a.shape))
