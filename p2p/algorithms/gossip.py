"""Plain gossip averaging (no gradients; consensus and throughput tests).

Update (ALGORITHMS §1.2, the mixing step of §2.4 alone)::

    θ_i^{t+1} = Σ_{j∈N̄_i} W_ij θ_j^t    if t mod tau == 0,   θ_i^{t+1} = θ_i^t  otherwise

Messages: ``θ_i`` on ``params``. Converges to the network average of ``θ^0`` on a connected
graph with doubly stochastic ``W``.
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
    LocalProblem,
    NodeContext,
    NodeState,
    Outgoing,
    P2PAlgorithm,
    Phase,
    same_specs,
)
from graphfl.p2p.algorithms.registry import P2PAlgorithmSpec, register


@dataclass(frozen=True)
class GossipParams:
    """Hyperparameters of gossip: ``tau``, the averaging period (one round = ``tau`` iterations)."""

    tau: int = field(default=1, metadata={"min": 1})

    def __post_init__(self) -> None:
        if self.tau < 1:
            raise ConfigError(f"tau must be >= 1, got {self.tau}")


class Gossip(P2PAlgorithm[GossipParams, LocalProblem]):
    """Gossip averaging (module docstring); state ``θ_i`` only, works on any local problem."""

    name = "gossip"
    phases = (Phase("gossip", (PARAMS,)),)
    stackable = True  # init / outgoing / step are elementwise: the vectorised engine runs them on all nodes

    @property
    def period(self) -> int:
        return self.params.tau

    def channels(self, state: NodeState, ctx: NodeContext) -> ChannelSpecs:
        return {PARAMS: {THETA: same_specs(state.theta)}}

    def init(self, oracle: LocalProblem, ctx: NodeContext) -> NodeState:
        return NodeState(t=0, theta=np.array(oracle.initial_theta(), copy=True))

    def outgoing(self, state: NodeState, phase: Phase, combined: Channels, ctx: NodeContext) -> Outgoing:
        return Outgoing.to_all({PARAMS: {THETA: state.theta}})

    def step(self, state: NodeState, combined: Channels | None, oracle: LocalProblem, ctx: NodeContext) -> NodeState:
        theta = combined[PARAMS][THETA] if combined is not None else state.theta   # Σ_j W_ij θ_j  or  θ_i
        return replace(state, t=state.t + 1, theta=theta, loss=float("nan"))


SPEC = register(P2PAlgorithmSpec(Gossip.name, GossipParams, Gossip,
                                 summary="plain gossip averaging, no gradients (throughput and consensus tests)",
                                 example={"problem": "vector"}))
