"""The narrow transport interface between peers, its mailbox, and an in-process implementation.

A :class:`Transport` does two things: ``send`` one message (round, channel, named arrays) to a
neighbour, and ``receive`` a given round's channels from a set of neighbours with a timeout.
Messages that arrive early (a faster neighbour already in round ``t+1``) wait in the
:class:`Mailbox`; messages for rounds already finished are dropped. Every wait is bounded.

Two implementations: :class:`InProcessTransport` (threads in one process, used by tests) and
:class:`graphfl.p2p.grpc_transport.GrpcTransport` (one peer per process).
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import numpy as np

from graphfl.p2p import codec
from graphfl.p2p.codec import Message, TensorSpecs, WireError

logger = logging.getLogger(__name__)


UNKNOWN_PEER = "unknown-peer"
"""Prefix of a refusal that means "no accepted handshake with you": the sender handshakes again
and resends once (the receiver restarted)."""


class TransportError(RuntimeError):
    """A transport-level failure (unreachable peer, refused handshake, ...), with the peer named."""


class HandshakeRefused(TransportError):
    """A neighbour refused us (or we refused it): different algorithm, config or topology, or TLS."""


@dataclass
class SendResult:
    """Outcome of one send: accepted or not, the reason, and bytes on the wire."""

    to: int
    ok: bool
    reason: str = ""
    wire_bytes: int = 0
    payload_bytes: int = 0
    unreachable: bool = False


@dataclass
class TransportStats:
    """Counters of one transport (bytes on the wire and as raw tensors, rejected and late messages)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    payload_sent: int = 0
    payload_received: int = 0
    messages_rejected: int = 0
    messages_dropped_late: int = 0
    sent_to: dict[int, int] = field(default_factory=dict)
    """Bytes on the wire of the accepted messages sent to each neighbour."""
    received_from: dict[int, int] = field(default_factory=dict)
    """Bytes on the wire of the accepted messages received from each neighbour."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count_sent(self, to: int, wire: int, payload: int) -> None:
        """Count an accepted message to ``to`` (``wire`` bytes on the wire, ``payload`` as tensors)."""
        with self.lock:
            self.bytes_sent += wire
            self.payload_sent += payload
            self.sent_to[to] = self.sent_to.get(to, 0) + wire

    def count_received(self, sender: int, wire: int, payload: int) -> None:
        """Count an accepted message from ``sender``."""
        with self.lock:
            self.bytes_received += wire
            self.payload_received += payload
            self.received_from[sender] = self.received_from.get(sender, 0) + wire

    def links(self) -> dict[str, dict[str, int]]:
        """``{neighbour id: {"bytes_sent", "bytes_received"}}`` over each link (wire bytes of
        accepted messages), for the neighbours a message went to or came from.
        """
        with self.lock:
            ids = sorted(set(self.sent_to) | set(self.received_from))
            return {str(j): {"bytes_sent": self.sent_to.get(j, 0), "bytes_received": self.received_from.get(j, 0)}
                    for j in ids}

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {
                "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received,
                "payload_sent": self.payload_sent,
                "payload_received": self.payload_received,
                "messages_rejected": self.messages_rejected,
                "messages_dropped_late": self.messages_dropped_late,
            }


class Mailbox:
    """Thread-safe buffer of validated inbound messages keyed by (round, channel, sender).

    ``put`` never blocks (it is called from inbound RPC handlers). Messages older than the
    current round floor are dropped; messages more than ``horizon`` rounds ahead are refused
    (bounded memory); a second message for the same key is refused.
    """

    def __init__(self, own_id: int, neighbours: Iterable[int], horizon: int = 64) -> None:
        self.own_id = own_id
        self.neighbours = set(neighbours)
        self.horizon = horizon
        self.expected: dict[str, TensorSpecs | None] = {}
        self.stats = TransportStats()
        self._floor = 0
        self.log_every = 5.0
        self._last_log = -1e9
        self._suppressed = 0
        self.max_round: int | None = None
        """Rounds at or beyond this are outside the run and refused (``None``: unbounded)."""
        self.latest: dict[int, int] = {}
        """``{neighbour: highest round of an ACCEPTED message}`` (refused messages never count)."""
        self.announced: dict[int, int] = {}
        """``{neighbour: highest round it sent that was refused only for being beyond the horizon}``.

        Such a message is not buffered; the round only serves, clamped to the horizon, as a
        witness for skipping ahead (:meth:`witness_rounds`)."""
        self._box: dict[tuple[int, str, int], Message] = {}
        self._cond = threading.Condition(threading.RLock())

    def expect(self, channel: str, specs: TensorSpecs | None) -> None:
        """Declare a channel and the tensors its messages must carry (``None`` = any)."""
        with self._cond:
            self.expected[channel] = specs

    def note_rejection(self, reason: str) -> None:
        """Count a refused message and log it, at most once per ``log_every`` seconds.

        A flood of invalid messages costs a counter increment each, not a log line each; the
        next line says how many were suppressed.
        """
        with self.stats.lock:
            self.stats.messages_rejected += 1
        now = time.monotonic()
        with self._cond:
            if now - self._last_log < self.log_every:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last_log = self._suppressed, 0, now
        extra = f" ({suppressed} more refused since the last report)" if suppressed else ""
        logger.warning("peer %d refused a message: %s%s", self.own_id, reason, extra)

    def check_header(self, sender: int, round_: int, channel: str,
                     declared: Mapping[str, tuple[str, tuple[int, ...]]]) -> str | None:
        """Why a message announced by its header must be refused before any buffer is allocated.

        Checks the sender (a neighbour), the channel (declared by the algorithm), the declared
        tensors against the channel's expected names, dtypes and shapes (so the payload can be
        no larger than the model's), and the round (not beyond the horizon or the run).
        Returns ``None`` when the message may be received.
        """
        if sender not in self.neighbours:
            return f"peer {sender} is not a neighbour of peer {self.own_id}"
        with self._cond:
            if channel not in self.expected:
                return f"unknown channel {channel!r}; expected one of {sorted(self.expected)}"
            specs = self.expected[channel]
            floor = self._floor
        if specs is not None:
            want = {name: (np.dtype(dt).name, tuple(shape)) for name, (dt, shape) in specs.items()}
            if dict(declared) != want:
                return f"channel {channel!r}: declared tensors {dict(declared)} differ from the expected {want}"
        return self._round_refusal(round_, floor, sender)

    def _round_refusal(self, round_: int, floor: int, sender: int) -> str | None:
        if self.max_round is not None and round_ >= self.max_round:
            return f"round {round_} is beyond the run (last round {self.max_round - 1})"
        if round_ > floor + self.horizon:
            with self._cond:
                self.announced[sender] = max(round_, self.announced.get(sender, -1))
            return f"round {round_} is more than {self.horizon} rounds ahead of {floor}"
        return None

    def put(self, msg: Message) -> tuple[bool, str]:
        """Validate and store a message. Returns ``(accepted, reason)``; never raises, never blocks."""
        try:
            if msg.sender not in self.neighbours:
                raise WireError(f"peer {msg.sender} is not a neighbour of peer {self.own_id}")
            if msg.channel not in self.expected:
                raise WireError(f"unknown channel {msg.channel!r}; expected one of {sorted(self.expected)}")
            codec.validate(msg, self.expected[msg.channel])
        except WireError as exc:
            self.note_rejection(str(exc))
            return False, str(exc)
        key = (msg.round, msg.channel, msg.sender)
        with self._cond:
            if msg.round < self._floor:
                with self.stats.lock:
                    self.stats.messages_dropped_late += 1
                logger.info(
                    "peer %d dropped a late message from peer %d (round %d < current %d)",
                    self.own_id, msg.sender, msg.round, self._floor,
                )
                return True, "late (round already finished); dropped"
            refusal = self._round_refusal(msg.round, self._floor, msg.sender)
            if refusal is None and key in self._box:
                refusal = f"duplicate message for round {msg.round}, channel {msg.channel!r}"
            if refusal is not None:
                self.note_rejection(f"from peer {msg.sender}: {refusal}")  # _cond is reentrant
                return False, refusal
            self._box[key] = msg
            self.latest[msg.sender] = max(msg.round, self.latest.get(msg.sender, -1))
            self.stats.count_received(msg.sender, msg.wire_bytes, msg.payload_bytes)
            self._cond.notify_all()
        return True, ""

    def wait(
        self, round_: int, channels: Sequence[str], senders: Iterable[int], timeout: float
    ) -> dict[int, dict[str, Message]]:
        """Messages of ``round_`` on all ``channels`` from ``senders``, waiting at most ``timeout`` s.

        Returns the senders that delivered *every* channel (a partial sender counts as missing).
        """
        want = set(senders)
        deadline = time.monotonic() + max(0.0, timeout)

        def complete() -> set[int]:
            return {s for s in want if all((round_, c, s) in self._box for c in channels)}

        with self._cond:
            while True:
                done = complete()
                left = deadline - time.monotonic()
                if done == want or left <= 0:
                    break
                self._cond.wait(min(left, 1.0))
            return {s: {c: self._box[(round_, c, s)] for c in channels} for s in done}

    def available(self, round_: int, channels: Sequence[str], senders: Iterable[int]) -> set[int]:
        with self._cond:
            return {s for s in senders if all((round_, c, s) in self._box for c in channels)}

    def advance(self, round_: int) -> None:
        """Rounds below ``round_`` are finished: drop their buffered messages."""
        with self._cond:
            self._floor = max(self._floor, round_)
            for key in [k for k in self._box if k[0] < self._floor]:
                del self._box[key]

    def latest_round(self) -> int:
        """The highest round any neighbour has sent us a valid message for (-1 if none)."""
        with self._cond:
            return max(self.latest.values(), default=-1)

    def witness_rounds(self, t: int) -> dict[int, int]:
        """Per neighbour, the round its messages show it at, as evidence for skipping ahead from ``t``.

        The highest accepted round, or a round refused for being beyond the horizon clamped to
        ``t + horizon``: a node far behind (restarted while the others went on) still sees that
        its neighbours are ahead, but one skip moves it at most ``horizon`` rounds; from there
        their messages are accepted and the next skip rests on accepted messages.
        """
        with self._cond:
            rounds = dict(self.latest)
            for j, r in self.announced.items():
                rounds[j] = max(rounds.get(j, -1), min(r, t + self.horizon))
            return rounds

    def latest_rounds(self) -> dict[int, int]:
        """``{neighbour: highest round it has sent us a valid message for}`` (neighbours heard so far)."""
        with self._cond:
            return dict(self.latest)

    def pending(self) -> int:
        with self._cond:
            return len(self._box)


class Transport(ABC):
    """Send to a neighbour; receive a round's channels from neighbours with a timeout."""

    peer_id: int
    neighbours: list[int]
    mailbox: Mailbox
    _executor: ThreadPoolExecutor | None = None

    def start(self, timeout: float) -> set[int]:
        """Connect (and handshake) with the neighbours within ``timeout`` s; return those reached."""
        return set(self.neighbours)

    @abstractmethod
    def send(
        self, to: int, round_: int, channel: str, arrays: Mapping[str, np.ndarray],
        scalars: Mapping[str, float] | None = None, timeout: float = 30.0,
    ) -> SendResult:
        """Deliver one message to neighbour ``to`` (bounded by ``timeout``); never raises for a dead peer."""

    def send_many(
        self, jobs: Mapping[int, Mapping[str, Mapping[str, np.ndarray]]], round_: int,
        scalars: Mapping[str, float] | None = None, timeout: float = 30.0,
    ) -> list[SendResult]:
        """Send ``jobs[j]`` (every channel of it) to each neighbour ``j``, in parallel; bounded by ``timeout``.

        A send that does not finish within ``timeout + 5`` s counts as unreachable. Any other
        exception is a local error (a bug, an unencodable tensor) and propagates with its
        traceback: it is never reported as an unreachable neighbour.
        """
        flat = [(to, ch, arrs) for to, msg in jobs.items() for ch, arrs in msg.items()]
        if not flat:
            return []
        pool = self._pool()
        futs = [pool.submit(self.send, to, round_, ch, arrs, scalars, timeout) for to, ch, arrs in flat]
        out = []
        for (to, ch, _), fut in zip(flat, futs):
            try:
                out.append(fut.result(timeout=timeout + 5.0))
            except FutureTimeout:
                fut.cancel()
                out.append(SendResult(to, False, f"send of {ch!r} did not finish within {timeout + 5.0:g} s",
                                      unreachable=True))
        return out

    def receive(
        self, round_: int, channels: Sequence[str], senders: Iterable[int], timeout: float
    ) -> dict[int, dict[str, Message]]:
        return self.mailbox.wait(round_, channels, senders, timeout)

    def advance(self, round_: int) -> None:
        self.mailbox.advance(round_)

    def stats(self) -> dict[str, int]:
        return self.mailbox.stats.snapshot()

    def link_stats(self) -> dict[str, dict[str, int]]:
        """Bytes sent to and received from each neighbour (:meth:`TransportStats.links`)."""
        return self.mailbox.stats.links()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=max(2, 2 * len(self.neighbours)), thread_name_prefix=f"p2p-send-{self.peer_id}"
            )
        return self._executor


class InProcessHub:
    """Connects :class:`InProcessTransport` s living in one process (one per node)."""

    def __init__(self) -> None:
        self.mailboxes: dict[int, Mailbox] = {}
        self.down: set[int] = set()

    def transport(self, peer_id: int, neighbours: Sequence[int], horizon: int = 64) -> InProcessTransport:
        t = InProcessTransport(self, peer_id, list(neighbours), horizon)
        self.mailboxes[peer_id] = t.mailbox
        return t


class InProcessTransport(Transport):
    """Delivers messages by encoding and decoding them through :mod:`codec` into the target mailbox."""

    def __init__(self, hub: InProcessHub, peer_id: int, neighbours: list[int], horizon: int = 64) -> None:
        self.hub = hub
        self.peer_id = peer_id
        self.neighbours = sorted(neighbours)
        self.mailbox = Mailbox(peer_id, neighbours, horizon)

    def send(
        self, to: int, round_: int, channel: str, arrays: Mapping[str, np.ndarray],
        scalars: Mapping[str, float] | None = None, timeout: float = 30.0,
    ) -> SendResult:
        """Encode, decode into the target's mailbox; a stopped target (``hub.down``) is unreachable."""
        box = self.hub.mailboxes.get(to)
        if box is None or to in self.hub.down:
            return SendResult(to, False, f"peer {to} is not running", unreachable=True)
        asm = codec.Assembler()
        for f in codec.encode(self.peer_id, round_, channel, arrays, scalars):
            asm.feed(f)
        msg = asm.finish()
        ok, reason = box.put(msg)
        if ok:
            self.mailbox.stats.count_sent(to, msg.wire_bytes, msg.payload_bytes)
        return SendResult(to, ok, reason, msg.wire_bytes, msg.payload_bytes)
