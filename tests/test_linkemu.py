"""The user-space link emulator (bench/linkemu.py): delay, bandwidth, stalls, resets, cut / heal, shutdown.

Real TCP sockets on 127.0.0.1 (an echo server and a sink in threads); tolerances are wide
because the machine is shared, but each assertion fails if the configured effect is absent.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Iterator

import pytest

from graphfl.bench.linkemu import LinkProfile, LinkProxy


class _Server:
    """A threaded TCP server on 127.0.0.1: ``echo`` sends back what it reads, ``sink`` counts bytes."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.received = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)
        with conn:
            while not self.stop.is_set():
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    if self.mode == "sink":
                        try:
                            conn.sendall(b"ok")
                        except OSError:
                            pass
                    return
                if self.mode == "echo":
                    conn.sendall(data)
                else:
                    self.received += len(data)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        self.thread.join(2.0)


@pytest.fixture
def echo() -> Iterator[_Server]:
    server = _Server("echo")
    yield server
    server.close()


@pytest.fixture
def sink() -> Iterator[_Server]:
    server = _Server("sink")
    yield server
    server.close()


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _ping(sock: socket.socket, payload: bytes = b"x" * 32) -> float:
    """Seconds for ``payload`` to go there and back."""
    t0 = time.perf_counter()
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        got += chunk
    assert got == payload
    return time.perf_counter() - t0


def _echo_works(port: int) -> bool:
    try:
        with _connect(port) as sock:
            sock.settimeout(2.0)
            _ping(sock)
            return True
    except OSError:
        return False


def test_delay_within_tolerance(echo: _Server) -> None:
    profile = LinkProfile("wan", delay_ms=30.0)
    with LinkProxy("127.0.0.1", echo.port, profile, seed=1) as proxy, _connect(proxy.port) as sock:
        rtts = [_ping(sock) for _ in range(8)]
    median = statistics.median(rtts)
    # a round trip crosses the link twice: 60 ms configured
    assert 0.055 <= median <= 0.110, rtts


def test_jitter_spreads_delay_and_keeps_order(echo: _Server) -> None:
    profile = LinkProfile("jittery", delay_ms=20.0, jitter_ms=15.0)
    with LinkProxy("127.0.0.1", echo.port, profile, seed=2) as proxy, _connect(proxy.port) as sock:
        rtts = [_ping(sock, f"{i:04d}".encode() * 8) for i in range(15)]  # _ping checks bytes and order
    assert min(rtts) >= 0.009  # 2 x (20 - 15) ms
    assert max(rtts) - min(rtts) >= 0.008, rtts  # spread seen; no jitter would give ~0


def test_bandwidth_roughly_respected(sink: _Server) -> None:
    size = 1_000_000
    profile = LinkProfile("slow", rate_mbit=8.0)  # 1 MB at 8 Mbit/s = 1.0 s
    with LinkProxy("127.0.0.1", sink.port, profile, seed=3) as proxy, _connect(proxy.port) as sock:
        t0 = time.perf_counter()
        sock.sendall(b"\0" * size)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(10.0)
        assert sock.recv(2) == b"ok"
        elapsed = time.perf_counter() - t0
        stats = proxy.stats()
    assert sink.received == size
    assert stats["bytes_up"] == size
    assert 0.85 <= elapsed <= 2.0, elapsed


def test_unlimited_link_is_fast(sink: _Server) -> None:
    size = 4_000_000
    with LinkProxy("127.0.0.1", sink.port, LinkProfile("lan"), seed=4) as proxy, _connect(proxy.port) as sock:
        t0 = time.perf_counter()
        sock.sendall(b"\0" * size)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(10.0)
        assert sock.recv(2) == b"ok"
        assert time.perf_counter() - t0 < 1.0


def test_cut_refuses_and_heal_allows(echo: _Server) -> None:
    with LinkProxy("127.0.0.1", echo.port, LinkProfile("lan"), seed=5) as proxy:
        assert _echo_works(proxy.port)
        held = _connect(proxy.port)
        held.settimeout(2.0)
        _ping(held)
        proxy.cut()
        assert proxy.is_cut
        with pytest.raises(OSError):  # the open connection was dropped
            _ping(held)
            _ping(held)
        held.close()
        assert not _echo_works(proxy.port)  # new connections are refused
        proxy.heal()
        assert _echo_works(proxy.port)
        stats = proxy.stats()
    assert stats["refused"] >= 1
    assert stats["cut_dropped"] >= 1


def test_resets_abort_connections(echo: _Server) -> None:
    profile = LinkProfile("flaky", reset_per_s=20.0)  # mean 50 ms to a reset
    with LinkProxy("127.0.0.1", echo.port, profile, seed=6) as proxy, _connect(proxy.port) as sock:
        sock.settimeout(2.0)
        with pytest.raises(OSError):
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                _ping(sock)
                time.sleep(0.01)
        assert proxy.stats()["resets"] >= 1


def test_stalls_pause_a_busy_link(echo: _Server) -> None:
    profile = LinkProfile("lossy", stall_per_s=5.0, stall_ms=100.0)
    with LinkProxy("127.0.0.1", echo.port, profile, seed=7) as proxy, _connect(proxy.port) as sock:
        rtts = []
        deadline = time.monotonic() + 1.5  # outage windows cover ~40 % of the time
        while time.monotonic() < deadline:
            rtts.append(_ping(sock))
            time.sleep(0.01)
        stats = proxy.stats()
    assert stats["stalls"] >= 1
    assert max(rtts) >= 0.03, max(rtts)  # at least one ping waited in an outage window
    assert statistics.median(rtts) < 0.05  # the link is up between windows


def test_close_stops_threads_and_port(echo: _Server) -> None:
    before = threading.active_count()
    proxy = LinkProxy("127.0.0.1", echo.port, LinkProfile("wan", delay_ms=5.0), seed=8)
    sock = _connect(proxy.port)
    _ping(sock)
    proxy.close()
    sock.close()
    deadline = time.monotonic() + 3.0
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=1.0).close()


def test_unreachable_target_counts_and_closes() -> None:
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    with LinkProxy("127.0.0.1", port, LinkProfile("lan"), seed=9) as proxy:
        assert not _echo_works(proxy.port)
        assert proxy.stats()["target_unreachable"] >= 1


@pytest.mark.parametrize("kwargs", [{"delay_ms": -1.0}, {"rate_mbit": 0.0}, {"stall_per_s": -0.5},
                                    {"buffer_bytes": 10}])
def test_profile_rejects_bad_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="LinkProfile 'bad'"):
        LinkProfile("bad", **kwargs)  # type: ignore[arg-type]
