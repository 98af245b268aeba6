"""One gossip exchange over a :class:`Transport`, with the failure policy.

On a communication step a node sends its channels to every neighbour, waits (bounded) for the
same round's channels from them, and mixes ``Σ_{j∈N̄_i} W_ij x_j``.

Failure policy (``docs/p2p.md`` "Failure policy"):

* ``on_missing="skip"`` (default): a neighbour whose messages are not complete by the round
  deadline, or that is unreachable, is left out of this round and the weights are re-weighted
  with :func:`graphfl.p2p.mixing.reweight` (``"self"``: the missing weight goes to ``W_ii``).
  Each skip is logged and recorded in the round's metrics. A neighbour that becomes reachable
  again is mixed again from the first round its messages arrive in time.
* ``on_missing="fail"``: wait up to the round deadline for every neighbour, then raise
  :class:`RoundFailed` naming the missing neighbours.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from graphfl.common.config import ConfigError
from graphfl.p2p.mixing import mix, reweight
from graphfl.p2p.transport import Transport

logger = logging.getLogger(__name__)


class RoundFailed(RuntimeError):
    """A round could not complete under ``on_missing="fail"``; the message names the neighbours."""


@dataclass(frozen=True)
class FailurePolicy:
    """How a round treats neighbours that are late or gone."""

    on_missing: str = "skip"
    reweight: str = "self"
    round_timeout: float = 30.0
    send_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.on_missing not in ("skip", "fail"):
            raise ConfigError(f"on-missing must be 'skip' or 'fail', got {self.on_missing!r}")
        if self.reweight not in ("self", "proportional"):
            raise ConfigError(f"reweight must be 'self' or 'proportional', got {self.reweight!r}")
        if not (self.round_timeout > 0 and self.send_timeout > 0):
            raise ConfigError("round-timeout and send-timeout must be > 0 (no unbounded waits)")


@dataclass
class ExchangeInfo:
    """What happened in one exchange."""

    seconds: float = 0.0
    present: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    unreachable: list[int] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)
    wire_sent: int = 0
    payload_sent: int = 0
    weights: dict[int, float] = field(default_factory=dict)
    local_disagreement: float = float("nan")


class NeighbourExchange:
    """Gossip of one node: ``exchange(t, outgoing) -> (mixed, info)``."""

    def __init__(self, transport: Transport, row: Mapping[int, float], policy: FailurePolicy) -> None:
        self.transport = transport
        self.own = transport.peer_id
        self.row = dict(row)
        self.neighbours = sorted(j for j in self.row if j != self.own)
        self.policy = policy

    def exchange(
        self, t: int, outgoing: Mapping[str, Mapping[str, np.ndarray]], scalars: Mapping[str, float] | None = None
    ) -> tuple[dict[str, dict[str, np.ndarray]], ExchangeInfo]:
        start = time.monotonic()
        info = ExchangeInfo()
        channels = list(outgoing)
        results = self.transport.send_many(self.neighbours, t, outgoing, scalars, timeout=self.policy.send_timeout)
        for r in results:
            info.wire_sent += r.wire_bytes
            info.payload_sent += r.payload_bytes
            if not r.ok:
                if r.unreachable:
                    if r.to not in info.unreachable:
                        info.unreachable.append(r.to)
                else:
                    info.refused[r.to] = r.reason
                    logger.error("peer %d: round %d: peer %d refused our message: %s", self.own, t, r.to, r.reason)
        if self.policy.on_missing == "skip":
            wait_for = [j for j in self.neighbours if j not in info.unreachable]
        else:
            wait_for = list(self.neighbours)
        spent = time.monotonic() - start
        got = self.transport.receive(t, channels, wait_for, max(0.0, self.policy.round_timeout - spent))
        late = [j for j in self.neighbours if j not in got and j not in wait_for]
        if late:  # unreachable now, but their message may already be here
            got.update(self.transport.receive(t, channels, late, 0.0))
        info.present = sorted(got)
        info.missing = [j for j in self.neighbours if j not in got]
        if info.missing:
            if self.policy.on_missing == "fail":
                raise RoundFailed(
                    f"peer {self.own}: round {t}: no complete message from neighbour(s) {info.missing} "
                    f"within {self.policy.round_timeout:g} s (unreachable: {info.unreachable}); "
                    f"on-missing = 'fail'"
                )
            logger.warning(
                "peer %d: round %d: skipping neighbour(s) %s (unreachable: %s); re-weighting (%s)",
                self.own, t, info.missing, info.unreachable, self.policy.reweight,
            )
        weights = reweight(self.row, self.own, set(got), self.policy.reweight)
        info.weights = weights
        mixed: dict[str, dict[str, np.ndarray]] = {}
        for ch in channels:
            mixed[ch] = {}
            for name, own_arr in outgoing[ch].items():
                arrays = {self.own: own_arr}
                arrays.update({j: got[j][ch].arrays[name] for j in got})
                mixed[ch][name] = mix(weights, arrays)
        if "params" in outgoing and got:
            own_theta = np.asarray(next(iter(outgoing["params"].values())), np.float64)
            diffs = [
                float(np.sum((own_theta - np.asarray(next(iter(got[j]["params"].arrays.values())), np.float64)) ** 2))
                for j in got
            ]
            info.local_disagreement = float(np.mean(diffs))
        self.transport.advance(t + 1)
        info.seconds = time.monotonic() - start
        return mixed, info
