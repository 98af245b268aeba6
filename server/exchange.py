"""What the round loop asks of an engine: carry one phase's messages, bring back the replies.

A :class:`ClientExchange` (Flower grid: :class:`graphfl.server.flower_adapter.GridExchange`;
in-process: :class:`graphfl.server.inprocess.InProcessExchange`) only moves messages. A
:class:`Request` says what every addressed client is asked to do; a :class:`Reply` is one
client's answer as the loop sees it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from graphfl.common import wire
from graphfl.common.types import Arrays, Payload


@dataclass(frozen=True)
class Request:
    """One request sent to a set of clients (each with its own payload).

    Attributes
    ----------
    kind
        ``wire.TRAIN`` (the client replies with arrays) or ``wire.EVALUATE`` (metrics only).
    server_round
        The round (0 = join).
    phase
        Phase name the client trainer dispatches on (``"fit"`` / ``"evaluate"`` for the
        default phases, :data:`graphfl.common.core.FIT_PHASE` / ``EVALUATE_PHASE``).
    eval_first
        Evaluate the payload before training on it (piggy-backed evaluation).
    """

    kind: str
    server_round: int
    phase: str
    eval_first: bool = False


@dataclass
class Reply:
    """One client's answer to one message, as the loop sees it."""

    partition_id: int
    arrays: Arrays | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    mask: Arrays | None = None
    """Received-entry masks of ``arrays`` when they passed the noisy uplink (else ``None``)."""

    @property
    def num_examples(self) -> int:
        """Training examples the client reported (0 when it did not)."""
        return int(self.metrics.get(wire.NUM_EXAMPLES, 0))

    def eval_metrics(self) -> dict[str, float]:
        """The client's evaluation (``eval.``-prefixed metrics, prefix removed)."""
        n = len(wire.EVAL_PREFIX)
        return {k[n:]: v for k, v in self.metrics.items() if k.startswith(wire.EVAL_PREFIX)}

    def fit_metrics(self) -> dict[str, float]:
        """The metrics that describe the client's work (everything but its evaluation)."""
        return {k: v for k, v in self.metrics.items() if not k.startswith(wire.EVAL_PREFIX)}


class ClientExchange(Protocol):
    """Engine-specific transport of the loop's messages."""

    def join(self, initial: Payload, num_clients: int) -> dict[int, Reply]:
        """Send the initial model to every client for evaluation; return replies by pid."""

    def send(self, request: Request, payloads: Mapping[int, Payload]) -> dict[int, Reply]:
        """Send ``request`` with ``payloads[pid]`` to each ``pid``; return one reply per pid
        (a reply with ``error`` set for a client that failed or did not answer in time).
        """
