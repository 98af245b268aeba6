"""FedADMM: fused-lasso M-estimation by decentralized stochastic ADMM, one node (ALGORITHMS §6).

The mathematics is :mod:`graphfl.p2p.algorithms.admm_math` (node step eq. 14, edge step eqs. 15–16 in
closed form, edge selection §6.9, IPW §6.10); this module only places it on the p2p contract.

State of node ``i`` (ALGORITHMS §6.4)
-------------------------------------
* ``theta`` — ``θ_i(t)`` (float64, ``p``); ``aux["theta_sum"]`` — ``Σ_{s<t} θ_i(s)`` (the output
  ``θ̄_i = theta_sum / t``, §6.5); ``aux["step"]`` — ``(c, t0)`` of the step schedule;
  ``aux["avail"]`` — ``(online iterations, observed iterations)`` for the estimated ``p̂_i``;
  ``aux["selection"]`` — one row ``(j, kept, W², df, p-value)`` per tested edge ``{i, j}`` (edge
  selection only).
* ``edges[j]`` for every kept neighbour ``j``: ``beta`` = ``β_ij``, ``alpha`` = ``α_ij``; on an
  edge the node owns (``i = max(i, j)``, :func:`~graphfl.p2p.algorithms.admm_math.owner_of`) also the mirror
  of the other half ``beta_ji``, ``alpha_ji`` and ``theta_j`` (the last ``θ_j`` heard).
* ``rng`` — the minibatch RNG, ``SeedSequence(seed).spawn(n + 1)[i]`` exactly as
  :func:`~graphfl.p2p.algorithms.admm_math.run_admm_reference` draws them.

One iteration ``t`` of node ``i``
--------------------------------
With edge selection, iteration ``t = 0`` starts with two one-off phases:

``stats``: every node sends ``(θ̂_i, Ω̂_i/n_i, n_i)`` (:func:`~graphfl.p2p.algorithms.admm_math.local_statistics`,
  computed in ``init`` with the ``es-covariance`` estimator) to its neighbours; the owner of
  each edge computes ``W²`` and keeps the edge iff ``W² ≤ χ²_df.isf(α/|E|)`` (Bonferroni over
  the ``|E|`` tested edges: the given graph's, or all ``n(n−1)/2`` pairs for Local-ES), exactly as
  :func:`~graphfl.p2p.algorithms.admm_math.select_edges`.
``select``: the owner sends its decision ``(kept, W², df, p-value)`` to the other endpoint. A
  dropped edge leaves both nodes' state (and every later exchange) for the rest of the run.

Every iteration then has two phases and a local step:

``theta``: ``θ_i(t)`` to every kept neighbour (channel ``params``, §6.6); the owner of each kept
  edge runs the edge step (:func:`~graphfl.p2p.algorithms.admm_math.edge_step`, eqs. 15–16) on ``θ_i(t)``,
  ``θ_j(t)`` and the halves of ``t − 1``. (At ``t = 0`` all nodes hold ``θ(0) = 0`` and the
  initial halves ``β = θ(0)``, ``α = 0``, for which the edge step returns the halves unchanged,
  bit for bit: round 0 only synchronises the nodes.)
``edge``: the owner sends the other half ``(β_ji(t), α_ji(t))`` (channel ``edge``) to ``j``,
  which replaces its own half with it. So in every round a node waits for each kept neighbour
  (the lower ids' ``θ``, the higher ids' halves) and no node runs ahead of its neighbours.
``step``: the node step (eq. 14, eq. 19 with IPW) on the halves at ``t``::

      θ_i(t+1) = θ_i(t) − η_i(t) [ g̃_i + Σ_{j kept, ascending} (ρ(θ_i(t) − β_ij(t)) − α_ij(t)) ]

  and ``θ_i(t)`` is added to the output sum.

After ``T`` iterations a node holds exactly what ``T`` iterations of
:func:`~graphfl.p2p.algorithms.admm_math.run_admm_reference` produce — ``θ_i(T)``,
``θ̄_i = (1/T) Σ_{t<T} θ_i(t)``, the same minibatch and availability draws — with its edge halves
one edge step behind (the reference's after ``T − 1`` iterations; the next round does that edge
step first). Every edge step touches only its own edge, so the order of edges does not matter;
the in-process run equals the reference (tested to 1e-8; in practice bit for bit).

Randomly inaccessible devices (§6.10, simulated)
------------------------------------------------
``availability`` gives ``p_i`` (one number for all nodes, or one per node). ``R_i(t)`` is entry
``i`` of ``rng_R.random(n)`` at iteration ``t``, where ``rng_R`` is the generator of
``SeedSequence(seed).spawn(n + 1)[n]`` advanced by ``t·n`` draws — the availability stream of
the reference, computed by every node without communication and without state (so restarts and
skips keep it). An offline node computes no gradient (``g̃_i = 0``; its minibatch RNG is not
advanced); its node step still applies the ρ-term — in the simulation the node itself takes it
(numerically what the neighbour holding copies of its edge state would compute) and the edge
steps run as usual. ``ipw``: ``known`` divides an online gradient by ``p_i``, ``estimated`` by
``p̂_i(t)`` (:class:`~graphfl.p2p.algorithms.admm_math.AvailabilityTracker`), ``none`` does not (biased).

Real dead or late peers (the failure policy ``on-missing = "skip"``)
--------------------------------------------------------------------
* The **owner** of ``{i, j}`` that does not hear ``θ_j`` in a round carries the edge on: it runs
  the edge step with the last ``θ_j`` it heard (its mirror ``β_ji, α_ji`` is the edge's state),
  i.e. the silent neighbour counts as a fixed model under the fusion penalty.
* A **non-owner** that does not hear the owner's half keeps its own half unchanged (it cannot
  take the owner's place: it lacks ``β_ij``); when the owner is heard again, its half replaces
  the stale one (the owner's mirror is the edge's state of record).
* Edge selection: an edge whose owner misses the other endpoint's statistics, or whose
  non-owner misses the owner's decision, is dropped (conservative, §6.11). Local-ES refuses to
  start unless every peer reaches every other (exit 5, naming the pairs).
* A peer restarted after ``t = 0`` without ``--resume`` cannot redo the selection its neighbours
  finished: it stops with a configuration error (exit 2) asking for ``--resume``.

The mixing weights ``W`` are not used (ADMM couples nodes through the edge variables), and the
graph's edge weights are ignored (unweighted fusion penalty, §6.1).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from graphfl.common.config import ConfigError
from graphfl.p2p.algorithms.base import (
    PARAMS,
    THETA,
    Array,
    Channels,
    ChannelSpecs,
    Inbox,
    NodeContext,
    NodeState,
    Outgoing,
    P2PAlgorithm,
    Phase,
)
from graphfl.p2p.algorithms.registry import P2PAlgorithmSpec, PrepareContext, register
from graphfl.p2p.oracles import DATA_PROBLEMS, is_data_problem

if TYPE_CHECKING:  # the cores import scipy / scikit-learn: loaded when first used, not by every peer
    from graphfl.p2p.algorithms import admm_math as am

logger = logging.getLogger(__name__)

LOSSES = ("least-squares", "logistic")
PENALTIES = ("l1", "l2")
STEPS = ("auto", "decay", "constant")
IPW_MODES = ("known", "estimated", "none")
SELECTIONS = ("none", "given", "complete")
COVARIANCES = ("hessian", "sandwich-hc3", "sandwich")  # = admm_math.COVARIANCES (not imported: scipy)

STATS, SELECT, EDGE = "stats", "select", "edge"
STATS_PHASE = Phase("stats", (STATS,))
SELECT_PHASE = Phase("select", (SELECT,))
THETA_PHASE = Phase("theta", (PARAMS,))
EDGE_PHASE = Phase("edge", (EDGE,))
KEPT = "kept"
"""``own``-only channel of the theta phase (never sent): the neighbours whose edges the node keeps."""


def _number_list(text: str, key: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(v) for v in str(text).replace(" ", "").split(",") if v)
    except ValueError:
        raise ConfigError(f"{key} = {text!r}: expected a number or comma-separated numbers") from None
    if not vals or not all(math.isfinite(v) for v in vals):
        raise ConfigError(f"{key} = {text!r}: expected finite numbers")
    return vals


@dataclass(frozen=True)
class ADMMParams:
    """Hyperparameters of FedADMM (ALGORITHMS §6.3, §6.9, §6.10); each field is a ``[run]`` key.

    Attributes
    ----------
    loss
        ``least-squares`` (``½(y − xᵀθ)²``) | ``logistic`` (0/1 response).
    penalty
        The fusion norm ``φ``: ``l1`` (default, the paper's simulations) | ``l2``.
    lam
        ``λ``: a number ``>= 0``, or ``"cv"`` — chosen by K-fold cross-validation over
        ``cv-grid`` *before* training, in the launcher's process (``graphfl p2p``; it needs every
        device's data), on the selected graph, with :func:`~graphfl.p2p.algorithms.admm_math.admm_cv_lambda`
        (the reference loop, same settings; ``step = "auto"`` uses the reference's global default
        schedule there). The chosen number is written into the network file.
    rho
        ``ρ > 0`` (default 1).
    step, step_c, step_t0
        ``η̃(t) = c/(t + t0)`` (``decay``) or ``c`` (``constant``), ``η_i(t) = η̃/(1 + ρ deg_i η̃)``.
        ``auto`` (default): each node takes ``c = κ̂_i``, ``t0 = ⌈κ̂_i λ̂_max,i⌉`` from its own
        Hessian at ``θ(0)`` (:func:`~graphfl.p2p.algorithms.admm_math.default_step_schedule` of its own
        Hessian — decentralized: no node knows the others').
    full_batch
        Use the full local gradient instead of minibatches of ``[run] batch-size`` rows (drawn
        without replacement, :func:`~graphfl.p2p.algorithms.admm_math.minibatch_gradient`).
    radius
        Project ``θ_i`` onto the ball ``‖θ‖ ≤ radius`` after each node step (0 = no projection).
    availability
        ``p_i``: one number in ``(0, 1]`` for every node, or ``n`` comma-separated numbers.
        ``1`` = always available (no draws).
    ipw
        ``known`` (divide by ``p_i``) | ``estimated`` (by the empirical ``p̂_i(t)``) | ``none``.
    edge_selection
        ``none`` | ``given`` (FedADMM-ES: test the network's edges) | ``complete``
        (FedADMM-Local-ES: the network must be the complete graph; every pair is tested).
    es_alpha
        Family-wise level ``α`` of the Bonferroni test (default 0.05).
    es_covariance
        The covariance ``Ω̂_i/n_i`` of the local estimator in the edge test
        (:func:`~graphfl.p2p.algorithms.admm_math.local_statistics`, ALGORITHMS §0.1 C3): ``hessian``
        (default; seed 001 eq. 2's ``{n_i Ĥ_i}⁻¹``, times ``σ̂²_i = RSS_i/(n_i − p)`` for least
        squares) | ``sandwich-hc3`` (``Ĥ⁻¹Σ̃Ĥ⁻¹`` with HC3's ``ψ_k/(1 − h_k)``: robust to unequal
        noise, conservative) | ``sandwich`` (the plug-in ``Ĥ⁻¹Σ̂Ĥ⁻¹``; anti-conservative unless
        ``p/n_i`` is small: it drops true edges).
    cv_folds, cv_grid
        ``lam = "cv"``: folds (default 5) and the comma-separated λ grid.
    """

    loss: str = field(default="least-squares", metadata={"choices": LOSSES})
    penalty: str = field(default="l1", metadata={"choices": PENALTIES})
    lam: str = "0.1"
    rho: float = field(default=1.0, metadata={"min": 0.0})
    step: str = field(default="auto", metadata={"choices": STEPS})
    step_c: float = field(default=1.0, metadata={"min": 0.0})
    step_t0: float = field(default=1.0, metadata={"min": 0.0})
    full_batch: bool = False
    radius: float = field(default=0.0, metadata={"min": 0.0})
    availability: str = "1"
    ipw: str = field(default="known", metadata={"choices": IPW_MODES})
    edge_selection: str = field(default="none", metadata={"choices": SELECTIONS})
    es_alpha: float = field(default=0.05, metadata={"min": 0.0, "max": 1.0})
    es_covariance: str = field(default="hessian", metadata={"choices": COVARIANCES})
    cv_folds: int = field(default=5, metadata={"min": 2})
    cv_grid: str = "0.0001,0.001,0.01,0.1,1"

    def __post_init__(self) -> None:
        for name, choices in (("loss", LOSSES), ("penalty", PENALTIES), ("step", STEPS), ("ipw", IPW_MODES),
                              ("edge_selection", SELECTIONS), ("es_covariance", COVARIANCES)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name.replace('_', '-')} = {getattr(self, name)!r} is not valid; "
                                  f"choose one of {list(choices)}")
        if str(self.lam).strip().lower() != "cv":
            (lam,) = _number_list(self.lam, "lam")[:1]
            if lam < 0:
                raise ConfigError(f"lam = {self.lam!r} must be >= 0 (or \"cv\")")
        if not self.rho > 0:
            raise ConfigError(f"rho = {self.rho!r} must be > 0")
        if self.step != "auto" and not (self.step_c > 0 and (self.step == "constant" or self.step_t0 > 0)):
            raise ConfigError(f"step-c (and step-t0 for step = 'decay') must be > 0, got {self.step_c}, {self.step_t0}")
        avail = _number_list(self.availability, "availability")
        if any(not (0 < p <= 1) for p in avail):
            raise ConfigError(f"availability = {self.availability!r}: every p_i must lie in (0, 1]")
        if not 0 < self.es_alpha < 1:
            raise ConfigError(f"es-alpha = {self.es_alpha!r} must lie in (0, 1)")
        grid = _number_list(self.cv_grid, "cv-grid")
        if any(v < 0 for v in grid):
            raise ConfigError(f"cv-grid = {self.cv_grid!r}: lambdas must be >= 0")

    @property
    def lam_value(self) -> float | None:
        """``λ`` as a number, or ``None`` for ``"cv"``."""
        return None if str(self.lam).strip().lower() == "cv" else _number_list(self.lam, "lam")[0]

    def availability_for(self, n: int) -> np.ndarray | None:
        """``p`` of the ``n`` nodes, or ``None`` when every node is always available."""
        vals = _number_list(self.availability, "availability")
        if len(vals) == 1:
            vals = vals * n
        if len(vals) != n:
            raise ConfigError(f"availability = {self.availability!r} gives {len(vals)} values for {n} nodes; "
                              f"give one number or one per node")
        p = np.asarray(vals, dtype=np.float64)
        return None if np.all(p == 1.0) else p

    def loss_fn(self) -> am.MLoss:
        from graphfl.p2p.algorithms import admm_math as am  # scipy: loaded on first use
        return am.LogisticLoss() if self.loss == "logistic" else am.LeastSquaresLoss()

    @property
    def covariance(self) -> am.Covariance:
        """``es-covariance`` as :func:`~graphfl.p2p.algorithms.admm_math.local_statistics` names it."""
        if self.es_covariance == "sandwich":
            return "sandwich"
        return "sandwich-hc3" if self.es_covariance == "sandwich-hc3" else "hessian"

    @property
    def phi(self) -> am.Phi:
        return "l2" if self.penalty == "l2" else "l1"

    def schedule(self) -> am.StepSchedule | None:
        """The explicit step schedule (``None`` for ``auto``)."""
        from graphfl.p2p.algorithms import admm_math as am  # scipy: loaded on first use
        if self.step == "auto":
            return None
        return am.StepSchedule(c=self.step_c, t0=self.step_t0, rule="constant" if self.step == "constant" else "decay")


def _check_problem(problem: Any, node: int) -> None:
    if not is_data_problem(problem):
        raise ConfigError(f"node {node}: admm needs tabular data (problem one of {list(DATA_PROBLEMS)}), "
                          f"got {type(problem).__name__}")


def _online(t: int, node: int, p: np.ndarray | None, seed: int) -> bool:
    """``R_i(t)``: entry ``node`` of the reference's availability draw at iteration ``t`` (module docstring)."""
    from graphfl.p2p.algorithms import admm_math as am  # scipy: loaded on first use
    if p is None:
        return True
    n = p.shape[0]
    bits = np.random.PCG64(np.random.SeedSequence(seed).spawn(n + 1)[n])  # default_rng's bit generator
    bits.advance(t * n)
    return bool(am.sample_availability(p, np.random.Generator(bits))[node])


def _stats_of(msg: dict[str, Array]) -> am.LocalStatistics:
    from graphfl.p2p.algorithms import admm_math as am  # scipy: loaded on first use
    return am.LocalStatistics(theta=np.asarray(msg["theta_hat"]), cov=np.asarray(msg["cov"]),
                              n=int(msg["n"][0]), ridge=0.0)


def test_edge(own: am.LocalStatistics, other: am.LocalStatistics, level: float) -> tuple[bool, float, int, float]:
    """One edge of :func:`~graphfl.p2p.algorithms.admm_math.select_edges` at per-test level ``α/|E|``:
    ``(kept, W², df, p-value)``.
    """
    from scipy import stats as sstats  # scipy: loaded on first use

    from graphfl.p2p.algorithms import admm_math as am  # scipy: loaded on first use
    w2, df = am.wald_statistic(own, other)
    if df == 0:
        return w2 == 0.0, w2, 0, 1.0 if w2 == 0.0 else 0.0
    return w2 <= float(sstats.chi2.isf(level, df)), w2, df, float(sstats.chi2.sf(w2, df))


class ADMM(P2PAlgorithm[ADMMParams, Any]):
    """FedADMM on one node (module docstring)."""

    name = "admm"
    phases = (STATS_PHASE, SELECT_PHASE, THETA_PHASE, EDGE_PHASE)

    def __init__(self, params: ADMMParams) -> None:
        super().__init__(params)
        self.loss = params.loss_fn()

    # -- schedule ------------------------------------------------------------------------------
    def active_phases(self, state: NodeState) -> tuple[Phase, ...]:
        if state.t == 0 and self.params.edge_selection != "none":
            return self.phases
        return (THETA_PHASE, EDGE_PHASE)

    @staticmethod
    def _kept(state: NodeState, combined: Channels) -> tuple[int, ...]:
        """The neighbours whose edges the node keeps: this round's selection decisions, else its edges."""
        decisions = {int(k.split("/")[1]): v["decision"] for k, v in combined.items() if k.startswith("es/")}
        if decisions:
            return tuple(sorted(j for j, d in decisions.items() if d[0] == 1.0))
        return tuple(sorted(state.edges))

    def expected_senders(self, phase: Phase, state: NodeState, combined: Channels, ctx: NodeContext) -> tuple[int, ...]:
        i = ctx.node
        if phase.name == STATS_PHASE.name:      # owners need the other endpoint's statistics
            return tuple(j for j in ctx.neighbours if j < i)
        if phase.name == SELECT_PHASE.name:     # the owners' decisions
            return tuple(j for j in ctx.neighbours if j > i)
        kept = self._kept(state, combined)
        if phase.name == THETA_PHASE.name:      # θ_j of the kept edges this node owns
            return tuple(j for j in kept if j < i)
        return tuple(j for j in kept if j > i)  # edge: the halves from the owners

    # -- the node ------------------------------------------------------------------------------
    def channels(self, state: NodeState, ctx: NodeContext) -> ChannelSpecs:
        p = int(state.theta.shape[0])
        vec = ("float64", (p,))
        return {
            STATS: {"theta_hat": vec, "cov": ("float64", (p, p)), "n": ("float64", (1,))},
            SELECT: {"decision": ("float64", (4,))},
            PARAMS: {THETA: vec},
            EDGE: {"beta": vec, "alpha": vec},
        }

    def check_graph(self, edges: Sequence[tuple[int, int]], num_nodes: int) -> None:
        if self.params.edge_selection != "complete":
            return
        have = {(min(i, j), max(i, j)) for i, j in edges}
        missing = [(i, j) for i in range(num_nodes) for j in range(i + 1, num_nodes) if (i, j) not in have]
        if missing:
            raise ConfigError(f"edge-selection = 'complete' (FedADMM-Local-ES) tests every pair of peers, so the network "
                              f"must be the complete graph; missing pairs: {missing[:20]}"
                              f"{' ...' if len(missing) > 20 else ''} (graphfl p2p writes it for you)")

    def graph_for(self, edges: Sequence[tuple[int, int]], num_nodes: int) -> list[tuple[int, int]]:
        if self.params.edge_selection == "complete":
            return [(i, j) for i in range(num_nodes) for j in range(i + 1, num_nodes)]
        return super().graph_for(edges, num_nodes)

    def needs_every_neighbour_at_start(self) -> bool:
        return self.params.edge_selection == "complete"

    def init(self, oracle: Any, ctx: NodeContext) -> NodeState:
        from graphfl.p2p.algorithms import admm_math as am  # scipy: loaded on first use
        _check_problem(oracle, ctx.node)
        if self.params.lam_value is None:
            raise ConfigError("lam = 'cv' must be resolved before the run: graphfl p2p does it (in-process "
                              "cross-validation); elsewhere call graphfl.p2p.algorithms.admm.choose_lambda or set lam")
        self.params.availability_for(ctx.num_nodes)  # the length must match n
        x, y = np.asarray(oracle.x_train, np.float64), np.asarray(oracle.y_train, np.float64)
        p = int(x.shape[1])
        theta0 = np.zeros(p)
        sched = self.params.schedule()
        if sched is None:
            sched = am.default_step_schedule([self.loss.hessian(theta0, x, y)])
        rng = np.random.default_rng(np.random.SeedSequence(int(oracle.seed)).spawn(ctx.num_nodes + 1)[ctx.node])
        edges: dict[int, dict[str, Array]] = {}
        for j in ctx.neighbours:
            e = {"beta": theta0.copy(), "alpha": np.zeros(p)}  # β_ij(0) = θ_i(0), α_ij(0) = 0
            if j < ctx.node:  # owned: the mirror of j's half and the last θ_j
                e.update({"beta_ji": theta0.copy(), "alpha_ji": np.zeros(p), "theta_j": theta0.copy()})
            edges[j] = e
        aux = {"theta_sum": np.zeros(p), "step": np.array([sched.c, sched.t0]),
               "avail": np.zeros(2, dtype=np.int64)}
        if self.params.edge_selection != "none":  # the local estimator and its covariance (§6.9), sent at t = 0
            st = am.local_statistics(self.loss, x, y, covariance=self.params.covariance)
            aux.update({"es_theta": st.theta, "es_cov": st.cov, "es_n": np.array([float(st.n)])})
        return NodeState(t=0, theta=theta0, aux=aux, edges=edges, rng=rng, loss=float(self.loss.value(theta0, x, y)))

    def outgoing(self, state: NodeState, phase: Phase, combined: Channels, ctx: NodeContext) -> Outgoing:
        if phase.name == STATS_PHASE.name:
            a = state.aux
            return Outgoing.to_all({STATS: {"theta_hat": a["es_theta"], "cov": a["es_cov"], "n": a["es_n"]}})
        if phase.name == SELECT_PHASE.name:
            return Outgoing.per_neighbour({j: {SELECT: {"decision": combined[f"es/{j}"]["decision"]}}
                                           for j in ctx.neighbours if j < ctx.node and f"es/{j}" in combined})
        if phase.name == THETA_PHASE.name:
            if self.params.edge_selection != "none" and state.t > 0 and "selection" not in state.aux:
                raise ConfigError(f"peer {ctx.node}: edge selection ran at iteration 0 and this peer has no record of "
                                  f"it (restarted without --resume?); restart it with --resume")
            kept = self._kept(state, combined)
            msg: Channels = {PARAMS: {THETA: state.theta}}
            own: Channels = {**msg, KEPT: {"ids": np.asarray(kept, dtype=np.int64)}}  # own: not sent
            return Outgoing.per_neighbour({j: msg for j in kept}, own=own)
        return Outgoing.per_neighbour({int(k.split("/")[1]): {EDGE: {"beta": v["beta_ji"], "alpha": v["alpha_ji"]}}
                                       for k, v in combined.items() if k.startswith("mirror/")})

    def combine(self, state: NodeState, inbox: Inbox, ctx: NodeContext) -> Channels:
        from graphfl.p2p.algorithms import admm_math as am  # scipy: loaded on first use
        i = ctx.node
        big = float(np.finfo(np.float64).max)
        if inbox.phase == STATS_PHASE.name:  # the owner tests each edge it owns
            own = am.LocalStatistics(theta=state.aux["es_theta"], cov=state.aux["es_cov"],
                                     n=int(state.aux["es_n"][0]), ridge=0.0)
            level = self.params.es_alpha / max(ctx.num_edges, 1)
            out: Channels = {}
            for j in ctx.neighbours:
                if j >= i:
                    continue
                if j in inbox.messages:
                    kept, w2, df, pv = test_edge(own, _stats_of(inbox.messages[j][STATS]), level)
                    decision = [1.0 if kept else 0.0, min(w2, big), float(df), pv]
                else:  # not heard: dropped (conservative, §6.11)
                    decision = [0.0, big, -1.0, 0.0]
                out[f"es/{j}"] = {"decision": np.asarray(decision, dtype=np.float64)}
            return out
        if inbox.phase == SELECT_PHASE.name:
            out = {f"es/{j}": {"decision": np.asarray(msg[SELECT]["decision"], np.float64)}
                   for j, msg in inbox.messages.items()}
            for j in inbox.missing:
                out[f"es/{j}"] = {"decision": np.asarray([0.0, big, -1.0, 0.0])}
            return out
        if inbox.phase == THETA_PHASE.name:  # the owner's edge step (eqs. 15–16) on every kept edge it owns
            lam = self.params.lam_value
            assert lam is not None and inbox.own is not None
            out = {}
            for j in (int(k) for k in inbox.own[KEPT]["ids"]):
                if j >= i:
                    continue
                e = state.edges[j]
                theta_j = inbox.messages[j][PARAMS][THETA] if j in inbox.messages else e["theta_j"]
                h_ij, h_ji = am.edge_step(state.theta, theta_j, am.EdgeState(e["beta"], e["alpha"]),
                                          am.EdgeState(e["beta_ji"], e["alpha_ji"]), lam=lam, rho=self.params.rho,
                                          phi=self.params.phi)
                out[f"mirror/{j}"] = {"beta": h_ij.beta, "alpha": h_ij.alpha, "beta_ji": h_ji.beta,
                                      "alpha_ji": h_ji.alpha, "theta_j": np.array(theta_j, np.float64)}
            return out
        return {f"half/{j}": {"beta": np.array(msg[EDGE]["beta"], np.float64),
                              "alpha": np.array(msg[EDGE]["alpha"], np.float64)}
                for j, msg in inbox.messages.items()}

    def step(self, state: NodeState, combined: Channels | None, oracle: Any, ctx: NodeContext) -> NodeState:
        """Store this round's edge results, then the node step of iteration ``t`` (eq. 14 / 19)."""
        from graphfl.p2p.algorithms import admm_math as am  # scipy: loaded on first use
        i, t = ctx.node, state.t
        combined = combined or {}
        aux = dict(state.aux)
        kept = self._kept(state, combined)
        if self.params.edge_selection != "none" and t == 0:  # record this round's selection
            decisions = {int(k.split("/")[1]): v["decision"] for k, v in combined.items() if k.startswith("es/")}
            aux["selection"] = np.asarray([[j, *decisions[j]] for j in sorted(decisions)], np.float64).reshape(-1, 5)
            logger.info("node %d: edge selection keeps neighbours %s, drops %s", i, list(kept),
                        sorted(set(ctx.neighbours) - set(kept)))
        edges: dict[int, dict[str, Array]] = {}
        for j in kept:  # owned: the new halves (mirror); else the owner's half; not heard: unchanged
            got = combined.get(f"mirror/{j}" if j < i else f"half/{j}")
            edges[j] = dict(got) if got is not None else state.edges[j]
        # the node step of iteration t on the halves at t
        p_avail = self.params.availability_for(ctx.num_nodes)
        x, y = oracle.x_train, oracle.y_train
        online = _online(t, i, p_avail, int(oracle.seed))
        if online:
            batch = None if self.params.full_batch else int(oracle.batch_size)
            g = am.minibatch_gradient(self.loss, state.theta, x, y, batch_size=batch, rng=state.rng)
        else:  # offline: no gradient, the minibatch RNG is not advanced
            g = np.zeros_like(state.theta)
        if p_avail is not None:
            counts = state.aux["avail"]
            if self.params.ipw == "known":
                g = am.ipw_gradient(g, online, float(p_avail[i]))
            elif self.params.ipw == "estimated":
                g = am.ipw_gradient(g, online, am.estimate_availability(int(counts[0]), int(counts[1])))
            aux["avail"] = counts + np.array([int(online), 1], dtype=np.int64)
        c, t0 = (float(v) for v in state.aux["step"])
        sched = am.StepSchedule(c=c, t0=t0, rule="constant" if self.params.step == "constant" else "decay")
        eta = sched.eta(t, len(edges), self.params.rho)
        halves = [am.EdgeState(edges[j]["beta"], edges[j]["alpha"]) for j in sorted(edges)]
        theta = am.node_step(state.theta, g, halves, rho=self.params.rho, eta=eta)
        theta = am.project_ball(theta, self.params.radius or None)
        aux["theta_sum"] = state.aux["theta_sum"] + state.theta
        loss = float(self.loss.value(theta, x, y))
        return replace(state, t=t + 1, theta=theta, aux=aux, edges=edges, loss=loss)

    # -- results -------------------------------------------------------------------------------
    @staticmethod
    def estimate(state: NodeState) -> Array:
        """``θ̄_i = (1/t) Σ_{s<t} θ_i(s)`` (§6.5); ``θ_i(0)`` before the first iteration."""
        if state.t == 0:
            return np.asarray(state.theta, np.float64)
        out: Array = state.aux["theta_sum"] / state.t
        return out

    def evaluate(self, state: NodeState, oracle: Any) -> float:
        """The loss of ``θ̄_i`` on the node's test rows (NaN without test rows)."""
        if len(oracle.y_test) == 0:
            return float("nan")
        return float(self.loss.value(self.estimate(state), oracle.x_test, oracle.y_test))

    def metrics(self, theta: Array, oracle: Any) -> dict[str, float | None]:
        """Training and test error of ``θ``: MSE for least squares, accuracy and log-loss for logistic."""
        out: dict[str, float | None] = {}
        for split, x, y in (("train", oracle.x_train, oracle.y_train), ("test", oracle.x_test, oracle.y_test)):
            if self.params.loss == "logistic":
                z = np.asarray(x, np.float64) @ theta if len(y) else np.zeros(0)
                out[f"{split}_acc"] = float(np.mean((z > 0).astype(np.float64) == y)) if len(y) else None
                out[f"{split}_logloss"] = float(self.loss.value(theta, x, y)) if len(y) else None
            else:
                out[f"{split}_mse"] = float(np.mean((y - np.asarray(x, np.float64) @ theta) ** 2)) if len(y) else None
        return out

    def output(self, state: NodeState, oracle: Any) -> dict[str, Array]:
        return {THETA: state.theta, "estimate": self.estimate(state)}

    def report(self, state: NodeState, oracle: Any, ctx: NodeContext) -> dict[str, Any]:
        est = self.estimate(state)
        return {
            "estimate": est.tolist() if est.size <= 10_000 else None,
            "features": list(getattr(oracle, "features", ())) or None,
            "metrics": self.metrics(est, oracle),
            "lam": self.params.lam_value,
            "step": [float(v) for v in state.aux["step"]],
            "neighbours": list(ctx.neighbours),
            "kept_neighbours": sorted(int(j) for j in state.edges),
            "selection": selection_records(state, ctx.node) if "selection" in state.aux else None,
        }


def selection_records(state: NodeState, node: int) -> list[dict[str, Any]]:
    """The node's tested edges as JSON records (``edge``, ``kept``, ``w2``, ``df``, ``pvalue``, ``decided_by``)."""
    from graphfl.p2p.algorithms import admm_math as am  # scipy: loaded on first use
    out = []
    big = float(np.finfo(np.float64).max)
    for j, kept, w2, df, pv in np.asarray(state.aux.get("selection", np.zeros((0, 5)))).reshape(-1, 5):
        jj = int(j)
        out.append({"edge": [min(node, jj), max(node, jj)], "kept": bool(kept == 1.0),
                    "w2": None if w2 >= big else float(w2), "df": int(df) if df >= 0 else None,
                    "pvalue": float(pv), "tested": bool(df >= 0), "decided_by": am.owner_of(node, jj)})
    return out


# ---------------------------------------------------------------------------------------------
# λ by cross-validation, before the run (the launcher's prepare hook)
# ---------------------------------------------------------------------------------------------


def selected_edges(params: ADMMParams, problems: Sequence[Any],
                   edges: Sequence[tuple[int, int]]) -> tuple[list[tuple[int, int]], am.EdgeSelection | None]:
    """The edges ADMM runs on: all of ``edges`` without selection; else
    :func:`~graphfl.p2p.algorithms.admm_math.select_edges` on the nodes' local statistics (the same result
    as the protocol phase).
    """
    from graphfl.p2p.algorithms import admm_math as am  # scipy: loaded on first use
    if params.edge_selection == "none":
        return [(min(i, j), max(i, j)) for i, j in edges], None
    loss = params.loss_fn()
    st = [am.local_statistics(loss, o.x_train, o.y_train, covariance=params.covariance) for o in problems]
    n = len(problems)
    tested = am.complete_graph_edges(n) if params.edge_selection == "complete" else list(edges)
    sel = am.select_edges(st, tested, alpha=params.es_alpha)
    return sorted((j, i) for i, j in sel.kept), sel


def choose_lambda(params: ADMMParams, problems: Sequence[Any], edges: Sequence[tuple[int, int]], rounds: int) -> am.CVResult:
    """``λ`` by :func:`~graphfl.p2p.algorithms.admm_math.admm_cv_lambda` on the selected graph (ALGORITHMS §6.3)."""
    from graphfl.p2p.algorithms import admm_math as am  # scipy: loaded on first use
    kept, _ = selected_edges(params, problems, edges)
    seed = int(problems[0].seed)
    p_avail = params.availability_for(len(problems))
    batch = None if params.full_batch else int(problems[0].batch_size)
    return am.admm_cv_lambda(params.loss_fn(), [(o.x_train, o.y_train) for o in problems], kept,
                             _number_list(params.cv_grid, "cv-grid"), n_folds=params.cv_folds, seed=seed,
                             rho=params.rho, phi=params.phi, n_iter=rounds, step=params.schedule(), batch_size=batch,
                             availability=p_avail, ipw=params.ipw, radius=params.radius or None)


def prepare(params: ADMMParams, ctx: PrepareContext) -> tuple[dict[str, Any], dict[str, Any]]:
    """The launcher's hook: resolve ``lam = "cv"`` (in-process, before the peers start)."""
    if params.lam_value is not None:
        return {}, {}
    cv = choose_lambda(params, ctx.problems(), ctx.edges, ctx.rounds)
    logger.info("admm: lambda %g chosen by %d-fold cross-validation over %s", cv.best_lambda, params.cv_folds,
                cv.lambdas.tolist())
    report = {"lambda_cv": {"chosen": cv.best_lambda, "lambdas": cv.lambdas.tolist(), "mean_loss": cv.mean_loss.tolist(),
                            "se_loss": cv.se_loss.tolist(), "folds": params.cv_folds}}
    return {"lam": repr(cv.best_lambda)}, report


SPEC = register(P2PAlgorithmSpec(
    ADMM.name, ADMMParams, ADMM,
    summary="FedADMM: fused-lasso M-estimation by decentralized stochastic ADMM, edge selection, IPW (ALGORITHMS §6)",
    example={"problem": "linreg", "lam": "0.05", "step": "constant", "step-c": 0.05},
    prepare=prepare,
    problems=DATA_PROBLEMS,
))

__all__ = ["ADMM", "ADMMParams", "SPEC", "choose_lambda", "prepare", "selected_edges", "selection_records", "test_edge"]
