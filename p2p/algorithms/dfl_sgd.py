"""DFL-SGD: decentralized FL with local SGD and periodic gossip (ALGORITHMS §2; seed 000 §10.2).

Update (ALGORITHMS §2.4, seed 000 eqs. 10.2–10.4), gradient at the node's own, un-mixed
iterate::

    g_i       = ∇̂f_i(θ_i^t)                                   (minibatch, eq. 10.2)
    θ_i^{t+1} = Σ_{j∈N̄_i} W_ij θ_j^t − α_t g_i    if t mod tau == 0   (eq. 10.4)
    θ_i^{t+1} = θ_i^t − α_t g_i                    otherwise           (eq. 10.3)

Messages (§2.5): ``θ_i`` on channel ``params`` to every neighbour on communication steps.
With ``W = (1/n) 1 1ᵀ`` this is FedAvg with averaging every ``tau`` steps (Fig. 10.1's baseline).
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

GOSSIP_PHASE = Phase("gossip", (PARAMS,))


@dataclass(frozen=True)
class DFLSGDParams:
    """Hyperparameters of DFL-SGD (ALGORITHMS §2.2); keys of the ``[run]`` table.

    Attributes
    ----------
    tau
        Gossip period: communicate when ``t mod tau == 0``; one round = ``tau`` iterations.
    alpha0
        Step size scale: ``α_t = alpha0/√(t+1)`` (``inv-sqrt``) or ``alpha0`` (``constant``).
    step_rule
        ``inv-sqrt`` | ``constant``.
    """

    tau: int = field(default=1, metadata={"min": 1})
    alpha0: float = field(default=0.1, metadata={"min": 0.0})
    step_rule: str = field(default="inv-sqrt", metadata={"choices": STEP_RULES})

    def __post_init__(self) -> None:
        if self.tau < 1:
            raise ConfigError(f"tau must be >= 1, got {self.tau}")

    @property
    def step(self) -> StepSize:
        return StepSize(self.alpha0, self.step_rule)


class DFLSGD(P2PAlgorithm[DFLSGDParams, GradientOracle]):
    """DFL-SGD (module docstring); state ``θ_i`` only."""

    name = "dfl-sgd"
    phases = (GOSSIP_PHASE,)
    stackable = True  # init / outgoing / step are elementwise: the vectorised engine runs them on all nodes

    def __init__(self, params: DFLSGDParams) -> None:
        super().__init__(params)
        self.step_size = params.step

    @property
    def period(self) -> int:
        return self.params.tau

    def channels(self, state: NodeState, ctx: NodeContext) -> ChannelSpecs:
        return {PARAMS: {THETA: same_specs(state.theta)}}

    def init(self, oracle: GradientOracle, ctx: NodeContext) -> NodeState:
        return NodeState(t=0, theta=np.array(oracle.initial_theta(), copy=True))

    def outgoing(self, state: NodeState, phase: Phase, combined: Channels, ctx: NodeContext) -> Outgoing:
        return Outgoing.to_all({PARAMS: {THETA: state.theta}})

    def step(self, state: NodeState, combined: Channels | None, oracle: GradientOracle, ctx: NodeContext) -> NodeState:
        t = state.t
        g, loss = oracle.grad(state.theta, oracle.sample())
        base = combined[PARAMS][THETA] if combined is not None else state.theta   # Σ_j W_ij θ_j  or  θ_i
        return replace(state, t=t + 1, theta=axpy(base, self.step_size(t), g), loss=loss)   # − α_t g_i


SPEC = register(P2PAlgorithmSpec(DFLSGD.name, DFLSGDParams, DFLSGD,
                                 summary="decentralized SGD with gossip every tau steps (ALGORITHMS §2)",
                                 example={"problem": "linreg", "alpha0": 0.05}))
