"""User-space TCP link emulator: one proxy per link, with delay, jitter, bandwidth, stalls and resets.

Used by ``graphfl bench network`` where the kernel has no ``netem``: a
:class:`LinkProxy` listens on a free ``127.0.0.1`` port and forwards every accepted connection to
a target ``host:port``. It is TCP-transparent (bytes are relayed unchanged, so TLS and gRPC run
through it with the server name the certificate expects). Each direction of each connection is a
link with the same :class:`LinkProfile`:

* **bandwidth** (``rate_mbit``): a chunk of ``b`` bytes read from the sender occupies the link for
  ``8 b / rate`` seconds after the previous chunk left it (a FIFO queue + serialisation, i.e. a
  token bucket with a burst of one chunk);
* **delay + jitter** (``delay_ms``, ``jitter_ms``): the chunk is delivered ``delay + U(-jitter,
  +jitter)`` ms (clipped at 0) after it was serialised, never before the previous chunk of the same
  direction (order-preserving within a connection, as TCP is);
* **stalls** (``stall_per_s``, ``stall_ms``): loss modelled as what it does to a TCP stream —
  outage windows of ``stall_ms`` start at exponential intervals (mean ``1 / stall_per_s`` seconds,
  wall clock); a chunk due inside a window is held until it ends (a retransmission timeout).
  A window that holds no data costs nothing; ``stalls`` counts the windows that held data;
* **resets** (``reset_per_s``): each connection is aborted (``RST`` to both ends) after an
  exponential time with mean ``1 / reset_per_s`` seconds.

:meth:`LinkProxy.cut` drops every open connection and resets new ones on accept (a partition);
:meth:`LinkProxy.heal` allows them again. Buffers are bounded (``buffer_bytes`` per direction: a
full link stops reading from its sender, which is TCP back-pressure), every wait has a timeout,
and :meth:`LinkProxy.close` stops all threads.

Counters (:meth:`LinkProxy.stats`): bytes each way, connections accepted / refused / reset,
stalls. Chunks are at most 64 KiB, so the rate is respected to within one chunk's serialisation
time.
"""

from __future__ import annotations

import collections
import logging
import random
import socket
import struct
import threading
import time
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any

logger = logging.getLogger(__name__)

CHUNK = 64 * 1024
"""Largest chunk read from a socket at once (bytes)."""
POLL_S = 0.05
"""Longest a thread waits before re-checking whether it should stop (seconds)."""
CONNECT_TIMEOUT_S = 5.0
"""How long the proxy tries to reach its target for one accepted connection (seconds)."""


@dataclass(frozen=True)
class LinkProfile:
    """One emulated link, the same in both directions.

    Attributes
    ----------
    name : str
        Label used in results (``lan``, ``wan``, ...).
    delay_ms : float
        One-way propagation delay (ms); a round trip through the proxy adds ``2 * delay_ms``.
    jitter_ms : float
        Half-width of the uniform jitter added to each chunk's delay (ms); order is preserved.
    rate_mbit : float | None
        Bandwidth per direction and connection (Mbit/s); ``None`` = unlimited.
    stall_per_s : float
        Mean number of stalls per second per direction (0 = none).
    stall_ms : float
        Length of one stall (ms).
    reset_per_s : float
        Probability per second that a connection is reset (rate of an exponential clock; 0 = never).
    buffer_bytes : int
        Bytes a direction holds before it stops reading from its sender.
    loss_pct : float
        Packet loss (%) for the kernel path (:mod:`graphfl.bench.netns`, netem). The user-space
        emulator relays a TCP stream, which has no packets to lose: it models loss by its
        effect, stalls (``stall_per_s``, ``stall_ms``), and ignores this field.
    """

    name: str
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    rate_mbit: float | None = None
    stall_per_s: float = 0.0
    stall_ms: float = 0.0
    reset_per_s: float = 0.0
    buffer_bytes: int = 4 * 1024 * 1024
    loss_pct: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.loss_pct <= 100.0:
            raise ValueError(f"LinkProfile {self.name!r}: loss_pct must be in [0, 100], got {self.loss_pct}")
        for key in ("delay_ms", "jitter_ms", "stall_per_s", "stall_ms", "reset_per_s"):
            value = getattr(self, key)
            if not value >= 0:
                raise ValueError(f"LinkProfile {self.name!r}: {key} must be >= 0, got {value}")
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ValueError(f"LinkProfile {self.name!r}: rate_mbit must be > 0 or None, got {self.rate_mbit}")
        if self.buffer_bytes < CHUNK:
            raise ValueError(f"LinkProfile {self.name!r}: buffer_bytes must be >= {CHUNK}, got {self.buffer_bytes}")

    def to_dict(self) -> dict[str, Any]:
        """The profile as a plain dict (for results files)."""
        return asdict(self)


def _abort(sock: socket.socket) -> None:
    """Close ``sock`` with an RST (``SO_LINGER`` 0), ignoring errors of an already dead socket."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class _Stats:
    """Thread-safe counters of one proxy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, float] = collections.defaultdict(float)

    def add(self, key: str, amount: float = 1.0) -> None:
        with self._lock:
            self.values[key] += amount

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.values)


class _Direction:
    """One direction of one connection: a reader thread schedules chunks, a writer thread delivers them."""

    def __init__(self, conn: _Connection, src: socket.socket, dst: socket.socket, label: str,
                 rng: random.Random) -> None:
        self.conn, self.src, self.dst, self.label, self.rng = conn, src, dst, label, rng
        self.profile = conn.proxy.profile
        self.queue: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self.queued = 0
        self.cond = threading.Condition()
        self.link_free_at = 0.0
        self.last_release = 0.0
        self.next_stall = self._next_stall(time.monotonic())
        self.stalled_window = -1.0
        self.threads = [threading.Thread(target=self._read, name=f"linkemu-{label}-r", daemon=True),
                        threading.Thread(target=self._write, name=f"linkemu-{label}-w", daemon=True)]

    def _next_stall(self, after: float) -> float:
        """Start of the next outage window after ``after`` (exponential gap; ``inf`` without stalls)."""
        rate = self.profile.stall_per_s
        return after + self.rng.expovariate(rate) if rate > 0 else float("inf")

    def _stall_until(self, now: float) -> float:
        """End of the outage window that holds ``now``, or ``now`` when the link is up."""
        length = self.profile.stall_ms / 1000.0
        while self.next_stall + length <= now:
            self.next_stall = self._next_stall(self.next_stall + length)
        return self.next_stall + length if self.next_stall <= now else now

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _schedule(self, size: int) -> float:
        """Release time of a chunk of ``size`` bytes read now (serialisation, then delay + jitter)."""
        p = self.profile
        now = time.monotonic()
        start = max(now, self.link_free_at)
        self.link_free_at = start + (8.0 * size / (p.rate_mbit * 1e6) if p.rate_mbit else 0.0)
        jitter = self.rng.uniform(-p.jitter_ms, p.jitter_ms) if p.jitter_ms else 0.0
        release = self.link_free_at + max(0.0, p.delay_ms + jitter) / 1000.0
        self.last_release = max(self.last_release, release)
        return self.last_release

    def _read(self) -> None:
        self.src.settimeout(POLL_S)
        try:
            while not self.conn.dead.is_set():
                try:
                    data = self.src.recv(CHUNK)
                except TimeoutError:
                    continue
                except OSError:
                    break
                if not data:
                    break
                with self.cond:
                    while self.queued + len(data) > self.profile.buffer_bytes and not self.conn.dead.is_set():
                        self.cond.wait(POLL_S)
                    self.queue.append((self._schedule(len(data)), data))
                    self.queued += len(data)
                    self.cond.notify_all()
        finally:
            with self.cond:
                self.queue.append((self.last_release, None))
                self.cond.notify_all()

    def _write(self) -> None:
        dead = self.conn.dead
        try:
            while not dead.is_set():
                with self.cond:
                    if not self.queue:
                        self.cond.wait(POLL_S)
                        continue
                    release, data = self.queue[0]
                now = time.monotonic()
                if release > now:
                    dead.wait(min(release - now, POLL_S))
                    continue
                up_at = self._stall_until(now)
                if up_at > now:
                    if self.stalled_window != self.next_stall:
                        self.stalled_window = self.next_stall
                        self.conn.proxy._stats.add("stalls")
                    dead.wait(min(up_at - now, POLL_S))
                    continue
                with self.cond:
                    self.queue.popleft()
                    if data is not None:
                        self.queued -= len(data)
                    self.cond.notify_all()
                if data is None:
                    try:
                        self.dst.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    break
                try:
                    self.dst.sendall(data)
                except OSError:
                    self.conn.kill(reset=False)
                    break
                self.conn.proxy._stats.add(f"bytes_{self.label}", len(data))
        finally:
            self.conn.direction_done()


class _Connection:
    """One accepted client connection and its connection to the target."""

    def __init__(self, proxy: LinkProxy, client: socket.socket, upstream: socket.socket, rng: random.Random) -> None:
        self.proxy, self.client, self.upstream = proxy, client, upstream
        self.dead = threading.Event()
        self._lock = threading.Lock()
        self._open_directions = 2
        self.client.settimeout(None)
        self.upstream.settimeout(None)
        self.directions = [_Direction(self, client, upstream, "up", random.Random(rng.random())),
                           _Direction(self, upstream, client, "down", random.Random(rng.random()))]
        rate = proxy.profile.reset_per_s
        self.reset_at = time.monotonic() + rng.expovariate(rate) if rate > 0 else float("inf")

    def start(self) -> None:
        for d in self.directions:
            d.start()
        if self.reset_at != float("inf"):
            threading.Thread(target=self._reset_clock, name="linkemu-reset", daemon=True).start()

    def _reset_clock(self) -> None:
        while not self.dead.is_set():
            left = self.reset_at - time.monotonic()
            if left <= 0:
                self.proxy._stats.add("resets")
                logger.debug("linkemu %s: resetting a connection", self.proxy.profile.name)
                self.kill(reset=True)
                return
            self.dead.wait(min(left, 1.0))

    def direction_done(self) -> None:
        with self._lock:
            self._open_directions -= 1
            last = self._open_directions == 0
        if last:
            self.kill(reset=False)

    def kill(self, reset: bool) -> None:
        """End the connection: both sockets closed (with an RST when ``reset``)."""
        with self._lock:
            if self.dead.is_set():
                return
            self.dead.set()
        for sock in (self.client, self.upstream):
            if reset:
                _abort(sock)
            else:
                try:
                    sock.close()
                except OSError:
                    pass
        self.proxy._forget(self)

    def join(self, timeout: float) -> None:
        for d in self.directions:
            for t in d.threads:
                if t.ident is not None:
                    t.join(timeout)


class LinkProxy:
    """A TCP proxy on ``127.0.0.1:<port>`` that forwards to ``target_host:target_port`` through an emulated link.

    Parameters
    ----------
    target_host, target_port : str, int
        Where accepted connections are forwarded.
    profile : LinkProfile
        The link (delay, jitter, bandwidth, stalls, resets), applied to each direction.
    seed : int
        Seed of the jitter / stall / reset random draws.
    listen_host : str
        Address to listen on (default ``127.0.0.1``); the port is picked by the kernel (:attr:`port`).

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, target_host: str, target_port: int, profile: LinkProfile, seed: int = 0,
                 listen_host: str = "127.0.0.1") -> None:
        self.target = (target_host, int(target_port))
        self.profile = profile
        self._stats = _Stats()
        self._rng = random.Random(seed)
        self._conns: set[_Connection] = set()
        self._lock = threading.Lock()
        self._cut = threading.Event()
        self._closed = threading.Event()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((listen_host, 0))
        self._listener.listen(128)
        self._listener.settimeout(POLL_S)
        self.host = listen_host
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name=f"linkemu-{profile.name}-accept", daemon=True)
        self._thread.start()
        logger.debug("linkemu %s: 127.0.0.1:%d -> %s:%d", profile.name, self.port, *self.target)

    @property
    def address(self) -> str:
        """``host:port`` clients connect to."""
        return f"{self.host}:{self.port}"

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if not self._closed.is_set():
                    logger.warning("linkemu %s: accept failed; proxy stops", self.profile.name, exc_info=True)
                break
            if self._cut.is_set():
                self._stats.add("refused")
                _abort(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT_S)
            except OSError as exc:
                logger.debug("linkemu %s: target %s:%d unreachable: %s", self.profile.name, *self.target, exc)
                self._stats.add("target_unreachable")
                _abort(client)
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(self, client, upstream, self._rng)
            with self._lock:
                self._conns.add(conn)
            self._stats.add("connections")
            conn.start()

    def _forget(self, conn: _Connection) -> None:
        with self._lock:
            self._conns.discard(conn)

    def _kill_all(self, reset: bool) -> list[_Connection]:
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.kill(reset=reset)
        return conns

    def cut(self) -> None:
        """Partition the link: open connections are reset, new ones are reset on accept, until :meth:`heal`."""
        self._cut.set()
        dropped = self._kill_all(reset=True)
        self._stats.add("cut_dropped", len(dropped))
        logger.info("linkemu %s: cut (%d connections dropped)", self.profile.name, len(dropped))

    def heal(self) -> None:
        """End a :meth:`cut`: new connections are forwarded again."""
        self._cut.clear()
        logger.info("linkemu %s: healed", self.profile.name)

    @property
    def is_cut(self) -> bool:
        return self._cut.is_set()

    def stats(self) -> dict[str, float]:
        """Counters: ``bytes_up`` (client -> target), ``bytes_down``, ``connections``, ``refused``, ``resets``, ``stalls``, ..."""
        values = {k: 0.0 for k in ("bytes_up", "bytes_down", "connections", "refused", "resets", "stalls")}
        values.update(self._stats.snapshot())
        return values

    def close(self, timeout: float = 2.0) -> None:
        """Stop accepting, drop every connection and join the threads (each join bounded by ``timeout``)."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._listener.close()
        except OSError:
            pass
        self._thread.join(timeout)
        for conn in self._kill_all(reset=False):
            conn.join(timeout)

    def __enter__(self) -> LinkProxy:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
