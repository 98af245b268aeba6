"""One phase of a round over a :class:`Transport`: send, gather per-neighbour messages, failure policy.

:meth:`NeighbourExchange.exchange` sends a node's outgoing messages (the same to every neighbour
or one per neighbour), waits (bounded) for the phase's channels from the neighbours expected to
send, and returns an :class:`~graphfl.p2p.algorithms.base.Inbox`:
``{neighbour: {channel: tensors}}`` plus the weights row ``W_i·`` re-weighted over the neighbours
heard. It does not mix: combining is the algorithm's (``combine``, default
:func:`graphfl.p2p.algorithms.base.mix_inbox`).

Failure policy (``docs/p2p.md`` "Failure policy"):

* ``on_missing="skip"`` (default): a neighbour whose messages are not complete by the round
  deadline, or that is unreachable, is left out of this phase and the weights are re-weighted
  with :func:`graphfl.p2p.mixing.reweight` (``"self"``: the missing weight goes to ``W_ii``).
  Each skip is logged and recorded. A neighbour that becomes reachable again is heard again from
  the first round its messages arrive in time.
* ``on_missing="fail"``: wait up to the round deadline for every expected neighbour, then raise
  :class:`RoundFailed` naming the missing neighbours.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from graphfl.common.config import ConfigError
from graphfl.p2p.algorithms.base import Channels, Inbox, Outgoing
from graphfl.p2p.mixing import reweight
from graphfl.p2p.transport import Transport

logger = logging.getLogger(__name__)

ON_MISSING = ("skip", "fail")
REWEIGHT = ("self", "proportional")


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
        if self.on_missing not in ON_MISSING:
            raise ConfigError(f"on-missing = {self.on_missing!r} is not valid; choose one of {list(ON_MISSING)}")
        if self.reweight not in REWEIGHT:
            raise ConfigError(f"reweight = {self.reweight!r} is not valid; choose one of {list(REWEIGHT)}")
        if not (self.round_timeout > 0 and self.send_timeout > 0):
            raise ConfigError("round-timeout and send-timeout must be > 0 (no unbounded waits)")


@dataclass
class ExchangeInfo:
    """What happened in one phase's exchange (for records and logs)."""

    seconds: float = 0.0
    present: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    unreachable: list[int] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)
    wire_sent: int = 0
    payload_sent: int = 0


class NeighbourExchange:
    """One node's exchanges: ``exchange(t, phase, channels, outgoing, senders) -> (inbox, info)``.

    Parameters
    ----------
    transport
        Sends and buffers messages (gRPC or in-process).
    row
        ``{j: W_ij}`` of this node, itself included (the weights handed to ``combine``).
    policy
        The failure policy.
    """

    def __init__(self, transport: Transport, row: Mapping[int, float], policy: FailurePolicy) -> None:
        self.transport = transport
        self.own = transport.peer_id
        self.row = dict(row)
        self.neighbours = tuple(sorted(transport.neighbours))
        self.policy = policy
        self._unreachable: tuple[int, set[int]] = (-1, set())  # (round, neighbours found unreachable in it)
        self._passed: tuple[int, frozenset[int]] = (-1, frozenset())

    def mark_passed(self, t: int, neighbours: Iterable[int]) -> None:
        """Neighbours known to have finished round ``t`` long ago: under ``on_missing = "skip"`` the
        exchanges of round ``t`` take their message if it is already here and do not wait for it.

        The driver marks a neighbour whose messages show it two communication rounds past ``t``
        (:func:`graphfl.p2p.driver.passed_neighbours`): it sent its round-``t`` message at least one
        round deadline before its later ones, so a message not here by now was lost (sent while a
        link was down, or refused as beyond this node's horizon) and will never come.
        """
        self._passed = (t, frozenset(neighbours))

    def exchange(
        self,
        t: int,
        phase: str,
        channels: Sequence[str],
        outgoing: Outgoing,
        senders: Sequence[int] | None = None,
        scalars: Mapping[str, float] | None = None,
    ) -> tuple[Inbox, ExchangeInfo]:
        """Send ``outgoing`` for round ``t``, gather ``channels`` from ``senders`` (default: all neighbours).

        Raises
        ------
        RoundFailed
            Under ``on_missing="fail"`` when an expected neighbour is not heard by the deadline.
        """
        start = time.monotonic()
        info = ExchangeInfo()
        jobs: dict[int, Channels] = {}
        for j in outgoing.targets(self.neighbours):
            msg = outgoing.to(j)
            if msg is not None:
                jobs[j] = msg
        for r in self.transport.send_many(jobs, t, scalars, timeout=self.policy.send_timeout):
            info.wire_sent += r.wire_bytes
            info.payload_sent += r.payload_bytes
            if r.ok:
                continue
            if r.unreachable:
                if r.to not in info.unreachable:
                    info.unreachable.append(r.to)
            else:
                info.refused[r.to] = r.reason
                logger.error("peer %d: round %d: peer %d refused our message: %s", self.own, t, r.to, r.reason)
        if self._unreachable[0] != t:
            self._unreachable = (t, set())
        self._unreachable[1].update(info.unreachable)  # also for later phases of this round, which may not send to them
        expected = sorted(self.neighbours if senders is None else senders)
        if self.policy.on_missing == "skip":
            passed = self._passed[1] if self._passed[0] == t else frozenset()
            wait_for = [j for j in expected if j not in self._unreachable[1] and j not in passed]
        else:
            wait_for = list(expected)
        spent = time.monotonic() - start
        got = self.transport.receive(t, channels, wait_for, max(0.0, self.policy.round_timeout - spent))
        late = [j for j in expected if j not in got and j not in wait_for]
        if late:  # unreachable now or passed, but their message may already be here
            got.update(self.transport.receive(t, channels, late, 0.0))
        info.present = sorted(got)
        info.missing = [j for j in expected if j not in got]
        if info.missing:
            if self.policy.on_missing == "fail":
                raise RoundFailed(
                    f"peer {self.own}: round {t}: no complete message from neighbour(s) {info.missing} "
                    f"within {self.policy.round_timeout:g} s (unreachable: {info.unreachable}); "
                    f"on-missing = 'fail'"
                )
            logger.warning(
                "peer %d: round %d: skipping neighbour(s) %s (unreachable: %s); re-weighting (%s)",
                self.own, t, info.missing, sorted(self._unreachable[1]), self.policy.reweight,
            )
        messages = {j: {ch: dict(got[j][ch].arrays) for ch in channels} for j in info.present}
        weights = reweight(self.row, self.own, set(got), self.policy.reweight)
        info.seconds = time.monotonic() - start
        inbox = Inbox(round=t, phase=phase, own=outgoing.own, messages=messages, weights=weights,
                      missing=tuple(info.missing))
        return inbox, info

    def finish_round(self, t: int) -> None:
        """Round ``t`` is over: its (and older) buffered messages are dropped."""
        self.transport.advance(t + 1)
