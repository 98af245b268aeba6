"""DFL-GT: decentralized FL with gradient tracking (ALGORITHMS §3; seed 000 eqs. 10.5–10.6).

Update (ALGORITHMS §3.4)::

    communication step (t mod tau == 0):                  local step:
        θ_i^{t+1} = Σ_j W_ij θ_j^t − α_t ϑ_i^t               θ_i^{t+1} = θ_i^t − α_t ϑ_i^t
        g_new     = ∇̂f_i(θ_i^{t+1}; fresh batch)             g_new     = ∇̂f_i(θ_i^{t+1}; fresh batch)
        ϑ_i^{t+1} = Σ_j W_ij ϑ_j^t + g_new − g_i^prev        ϑ_i^{t+1} = ϑ_i^t + g_new − g_i^prev
        g_i^prev  = g_new

Initialisation (§3.3, correcting the seed): GNSD ``g_i^0 = ∇̂f_i(θ_i^0)``, ``ϑ_i^0 = g_i^0``;
``init_tracker = "zero"`` reproduces the seed literally (``ϑ_i^0 = 0``, which never moves from
identical starts with deterministic gradients). ``same_batch_difference`` evaluates both
gradients of the difference on the same fresh batch (two gradients per iteration).

Messages (§3.5): ``θ_i`` on ``params`` and ``ϑ_i`` on ``tracker``, one phase.
Invariant (tested): with doubly stochastic ``W`` and GNSD init,
``(1/n) Σ_i ϑ_i^t = (1/n) Σ_i g_i^prev`` at every ``t``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from graphfl.common.config import ConfigError
from graphfl.p2p.algorithms.base import (
    PARAMS,
    THETA,
    Channels,
    ChannelSpecs,
    GradientOracle,
    NodeContext,
    NodeState,
    Outgoing,
    P2PAlgorithm,
    Phase,
    same_specs,
)
from graphfl.p2p.algorithms.registry import P2PAlgorithmSpec, register
from graphfl.p2p.algorithms.steps import STEP_RULES, StepSize, axpy

TRACKER = "tracker"
"""Channel (and tensor) of the tracker ``ϑ_i``."""
G_PREV = "g_prev"
"""``NodeState.aux`` key of the last stochastic gradient ``g_i^prev``."""
INIT_TRACKERS = ("gnsd", "zero")
GOSSIP_PHASE = Phase("gossip", (PARAMS, TRACKER))


@dataclass(frozen=True)
class DFLGTParams:
    """Hyperparameters of DFL-GT (ALGORITHMS §3.1 = §2.2, plus the §3.3/§3.4 switches).

    Attributes
    ----------
    tau, alpha0, step_rule
        As for DFL-SGD (:class:`graphfl.p2p.algorithms.dfl_sgd.DFLSGDParams`).
    init_tracker
        ``gnsd`` (``ϑ_i^0 = g_i^0``, default) | ``zero`` (the seed's literal ``ϑ_i^0 = 0``).
    same_batch_difference
        Evaluate ``g_new − g_old`` on the same fresh batch (two gradients per iteration).
    """

    tau: int = field(default=1, metadata={"min": 1})
    alpha0: float = field(default=0.1, metadata={"min": 0.0})
    step_rule: str = field(default="inv-sqrt", metadata={"choices": STEP_RULES})
    init_tracker: str = field(default="gnsd", metadata={"choices": INIT_TRACKERS})
    same_batch_difference: bool = False

    def __post_init__(self) -> None:
        if self.tau < 1:
            raise ConfigError(f"tau must be >= 1, got {self.tau}")
        if self.init_tracker not in INIT_TRACKERS:
            raise ConfigError(f"init-tracker = {self.init_tracker!r} is not valid; choose one of {list(INIT_TRACKERS)}")

    @property
    def step(self) -> StepSize:
        return StepSize(self.alpha0, self.step_rule)


class DFLGT(P2PAlgorithm[DFLGTParams, GradientOracle]):
    """DFL-GT (module docstring); state ``θ_i``, ``ϑ_i`` (``tracker``) and ``g_i^prev`` (``aux``)."""

    name = "dfl-gt"
    phases = (GOSSIP_PHASE,)
    stackable = True  # init / outgoing / step are elementwise: the vectorised engine runs them on all nodes

    def __init__(self, params: DFLGTParams) -> None:
        super().__init__(params)
        self.step_size = params.step

    @property
    def period(self) -> int:
        return self.params.tau

    def channels(self, state: NodeState, ctx: NodeContext) -> ChannelSpecs:
        return {PARAMS: {THETA: same_specs(state.theta)}, TRACKER: {TRACKER: same_specs(state.theta)}}

    def init(self, oracle: GradientOracle, ctx: NodeContext) -> NodeState:
        theta = np.array(oracle.initial_theta(), copy=True)
        g0, loss = oracle.grad(theta, oracle.sample())                       # g_i^0 = ∇̂f_i(θ_i^0)
        tracker = np.array(g0, copy=True) if self.params.init_tracker == "gnsd" else np.zeros_like(g0)
        return NodeState(t=0, theta=theta, tracker=tracker, aux={G_PREV: g0}, loss=loss)

    def outgoing(self, state: NodeState, phase: Phase, combined: Channels, ctx: NodeContext) -> Outgoing:
        assert state.tracker is not None
        return Outgoing.to_all({PARAMS: {THETA: state.theta}, TRACKER: {TRACKER: state.tracker}})

    def step(self, state: NodeState, combined: Channels | None, oracle: GradientOracle, ctx: NodeContext) -> NodeState:
        t = state.t
        tracker_t = state.tracker
        if tracker_t is None:
            raise ValueError(f"node {ctx.node}: DFL-GT state has no tracker (was it initialised by DFLGT.init?)")
        g_prev = state.aux[G_PREV]
        if combined is not None:                                             # Σ_j W_ij θ_j, Σ_j W_ij ϑ_j
            base_theta, base_tracker = combined[PARAMS][THETA], combined[TRACKER][TRACKER]
        else:
            base_theta, base_tracker = state.theta, tracker_t
        theta = axpy(base_theta, self.step_size(t), tracker_t)               # θ^{t+1} = · − α_t ϑ_i^t
        batch = oracle.sample()
        g_new, loss = oracle.grad(theta, batch)                              # ∇̂f_i(θ^{t+1}; fresh batch)
        g_old = oracle.grad(state.theta, batch)[0] if self.params.same_batch_difference else g_prev
        tracker = (                                                          # ϑ^{t+1} = · + g_new − g_old
            np.asarray(base_tracker, np.float64) + np.asarray(g_new, np.float64) - np.asarray(g_old, np.float64)
        ).astype(tracker_t.dtype, copy=False)
        return replace(state, t=t + 1, theta=theta, tracker=tracker, aux={**state.aux, G_PREV: g_new}, loss=loss)


SPEC = register(P2PAlgorithmSpec(DFLGT.name, DFLGTParams, DFLGT,
                                 summary="decentralized SGD with gradient tracking, GNSD init (ALGORITHMS §3)",
                                 example={"problem": "linreg", "alpha0": 0.05}))
