"""DFL-SGD and DFL-GT as per-node step functions (ALGORITHMS.md §2, §3; seed 000 §10.2).

Each algorithm is written once, for one node, in three parts:

* :meth:`DFLAlgorithm.init` — the node's initial state from its gradient oracle;
* :meth:`DFLAlgorithm.outgoing` — what it sends to its neighbours on a communication step
  (``t mod tau == 0``): ``{channel: {tensor name: array}}``;
* :meth:`DFLAlgorithm.step` — one iteration given the *mixed* channels
  ``Σ_{j ∈ N̄_i} W_ij x_j`` (``None`` on local steps).

The in-process driver (:mod:`graphfl.p2p.driver`) and the gRPC peer runtime
(:mod:`graphfl.p2p.runtime`) both call these and mix with :func:`graphfl.p2p.mixing.mix`, so the
same seed and topology give the same iterates on both.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from graphfl.common.config import ConfigError

Channels = dict[str, dict[str, np.ndarray]]


class GradientOracle(Protocol):
    """What a node needs from its local problem ``f_i`` (a model + loss + local data).

    ``sample`` draws a fresh minibatch from the node's own seeded RNG; ``grad`` returns the
    stochastic gradient ``∇̂f_i(θ; batch)`` (same dtype and shape as θ) and the batch loss.
    """

    dim: int

    def initial_theta(self) -> np.ndarray: ...

    def sample(self) -> Any: ...

    def grad(self, theta: np.ndarray, batch: Any) -> tuple[np.ndarray, float]: ...

    def test_loss(self, theta: np.ndarray) -> float: ...


@dataclass(frozen=True)
class StepSize:
    """``alpha_t = alpha0 / sqrt(t + 1)`` (``rule="inv-sqrt"``, ALGORITHMS §2.2) or ``alpha0``."""

    alpha0: float = 15.0
    rule: str = "inv-sqrt"

    def __call__(self, t: int) -> float:
        if self.rule == "inv-sqrt":
            return self.alpha0 / math.sqrt(t + 1)
        if self.rule == "constant":
            return self.alpha0
        raise ConfigError(f"unknown step rule {self.rule!r}; choose 'inv-sqrt' or 'constant'")


@dataclass
class NodeState:
    """One node's state: iteration ``t``, ``θ_i``, and for DFL-GT the tracker ``ϑ_i`` and ``g_i^prev``."""

    t: int
    theta: np.ndarray
    tracker: np.ndarray | None = None
    g_prev: np.ndarray | None = None
    loss: float = float("nan")
    extra: dict[str, Any] = field(default_factory=dict)


def _axpy(base: np.ndarray, alpha: float, g: np.ndarray) -> np.ndarray:
    """``base - alpha * g`` in float64, cast back to ``base.dtype``."""
    return (np.asarray(base, np.float64) - alpha * np.asarray(g, np.float64)).astype(base.dtype, copy=False)


class DFLAlgorithm(ABC):
    """Common parts: gossip period ``tau`` and step size schedule."""

    name: str = ""
    channels: tuple[str, ...] = ("params",)

    def __init__(self, tau: int = 1, step: StepSize | None = None) -> None:
        if tau < 1:
            raise ConfigError(f"tau must be >= 1, got {tau}")
        self.tau = int(tau)
        self.step_size = step if step is not None else StepSize()

    def communicates(self, t: int) -> bool:
        """Communication step iff ``t mod tau == 0`` (seed 000, eqs. 10.3/10.4)."""
        return t % self.tau == 0

    def specs(self, dim: int, dtype: np.dtype) -> dict[str, dict[str, tuple[str, tuple[int, ...]]]]:
        """Expected tensors per channel (for validating inbound messages)."""
        names = {"params": "theta", "tracker": "tracker"}
        return {ch: {names[ch]: (np.dtype(dtype).name, (dim,))} for ch in self.channels}

    @abstractmethod
    def init(self, oracle: GradientOracle) -> NodeState: ...

    @abstractmethod
    def outgoing(self, state: NodeState) -> Channels: ...

    @abstractmethod
    def step(self, state: NodeState, oracle: GradientOracle, mixed: Channels | None) -> NodeState: ...


class DFLSGD(DFLAlgorithm):
    """DFL-SGD (ALGORITHMS §2.4; seed 000 eqs. 10.2–10.4).

    ``g_i = ∇̂f_i(θ_i^t)`` at the node's own, un-mixed iterate, then
    ``θ_i^{t+1} = Σ_{j∈N̄_i} W_ij θ_j^t − α_t g_i`` on communication steps and
    ``θ_i^{t+1} = θ_i^t − α_t g_i`` otherwise. With ``W = (1/n) 1 1ᵀ`` this is FedAvg with
    averaging every ``tau`` steps (the baseline of Fig. 10.1).
    """

    name = "dfl-sgd"
    channels = ("params",)

    def init(self, oracle: GradientOracle) -> NodeState:
        return NodeState(t=0, theta=np.array(oracle.initial_theta(), copy=True))

    def outgoing(self, state: NodeState) -> Channels:
        return {"params": {"theta": state.theta}}

    def step(self, state: NodeState, oracle: GradientOracle, mixed: Channels | None) -> NodeState:
        t = state.t
        g, loss = oracle.grad(state.theta, oracle.sample())
        base = mixed["params"]["theta"] if mixed is not None else state.theta
        return replace(state, t=t + 1, theta=_axpy(base, self.step_size(t), g), loss=loss)


class DFLGT(DFLAlgorithm):
    """DFL-GT, decentralized FL with gradient tracking (ALGORITHMS §3.4; seed 000 eqs. 10.5–10.6).

    Communication step (``t mod tau == 0``)::

        θ_i^{t+1} = Σ_j W_ij θ_j^t − α_t ϑ_i^t
        g_new     = ∇̂f_i(θ_i^{t+1}; fresh batch)
        ϑ_i^{t+1} = Σ_j W_ij ϑ_j^t + g_new − g_i^prev ;  g_i^prev = g_new

    Local step: the same without mixing. Initialisation (ALGORITHMS §3.3, correcting the
    seed): ``g_i^0 = ∇̂f_i(θ_i^0)``, ``ϑ_i^0 = g_i^0`` (GNSD); ``init_tracker="zero"`` reproduces
    the seed literally (``ϑ_i^0 = 0``). ``same_batch_difference=True`` evaluates both gradients
    of the difference on the same fresh batch (two gradients per iteration).

    Invariant (tested): with doubly stochastic ``W`` and GNSD init,
    ``(1/n) Σ_i ϑ_i^t = (1/n) Σ_i g_i^prev`` at every ``t``.
    """

    name = "dfl-gt"
    channels = ("params", "tracker")

    def __init__(
        self, tau: int = 1, step: StepSize | None = None, init_tracker: str = "gnsd",
        same_batch_difference: bool = False,
    ) -> None:
        super().__init__(tau, step)
        if init_tracker not in ("gnsd", "zero"):
            raise ConfigError(f"init_tracker must be 'gnsd' or 'zero', got {init_tracker!r}")
        self.init_tracker = init_tracker
        self.same_batch_difference = bool(same_batch_difference)

    def init(self, oracle: GradientOracle) -> NodeState:
        theta = np.array(oracle.initial_theta(), copy=True)
        g0, loss = oracle.grad(theta, oracle.sample())
        tracker = np.array(g0, copy=True) if self.init_tracker == "gnsd" else np.zeros_like(g0)
        return NodeState(t=0, theta=theta, tracker=tracker, g_prev=g0, loss=loss)

    def outgoing(self, state: NodeState) -> Channels:
        return {"params": {"theta": state.theta}, "tracker": {"tracker": state.tracker}}

    def step(self, state: NodeState, oracle: GradientOracle, mixed: Channels | None) -> NodeState:
        t = state.t
        assert state.tracker is not None and state.g_prev is not None
        if mixed is not None:
            base_theta, base_tracker = mixed["params"]["theta"], mixed["tracker"]["tracker"]
        else:
            base_theta, base_tracker = state.theta, state.tracker
        theta = _axpy(base_theta, self.step_size(t), state.tracker)
        batch = oracle.sample()
        g_new, loss = oracle.grad(theta, batch)
        g_old = oracle.grad(state.theta, batch)[0] if self.same_batch_difference else state.g_prev
        tracker = (
            np.asarray(base_tracker, np.float64) + np.asarray(g_new, np.float64) - np.asarray(g_old, np.float64)
        ).astype(state.tracker.dtype, copy=False)
        return replace(state, t=t + 1, theta=theta, tracker=tracker, g_prev=g_new, loss=loss)


class Gossip(DFLSGD):
    """Plain gossip averaging ``θ_i^{t+1} = Σ_j W_ij θ_j^t`` (no gradients; throughput benchmark).

    Same state and messages as DFL-SGD; only the step differs.
    """

    name = "gossip"

    def step(self, state: NodeState, oracle: GradientOracle, mixed: Channels | None) -> NodeState:
        theta = mixed["params"]["theta"] if mixed is not None else state.theta
        return replace(state, t=state.t + 1, theta=theta, loss=float("nan"))


ALGORITHMS = {"dfl-sgd": DFLSGD, "dfl-gt": DFLGT, "gossip": Gossip}


def make_algorithm(
    name: str, *, tau: int = 1, alpha0: float = 15.0, step_rule: str = "inv-sqrt",
    init_tracker: str = "gnsd", same_batch_difference: bool = False,
) -> DFLAlgorithm:
    """Build an algorithm by its registry name (``dfl-sgd``, ``dfl-gt``, ``gossip``)."""
    step = StepSize(alpha0, step_rule)
    step(0)  # validates the rule
    if name == "dfl-gt":
        return DFLGT(tau, step, init_tracker=init_tracker, same_batch_difference=same_batch_difference)
    if name in ALGORITHMS:
        return ALGORITHMS[name](tau, step)
    raise ConfigError(f"unknown p2p algorithm {name!r}; valid: {sorted(ALGORITHMS)}")
