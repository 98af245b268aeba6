"""Free TCP ports and reachability checks on this host (both runtimes use them)."""

from __future__ import annotations

import random
import socket
import threading
from collections import deque

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LISTEN_PORTS = (20000, 32768)
"""Where listening ports are picked: below Linux's default ephemeral range (32768-60999), which the
kernel hands to *outgoing* connections. A port taken from the ephemeral range (``bind(:0)``) can
be grabbed by some process's outgoing connection between the pick and the server's bind: a
16-SuperNode federation lost a SuperNode that way ("Runtime HTTP API failed to start")."""


RECENT_MEMORY = 512
"""How many of the ports this process handed out last are not handed out again: a federation asks
for its ports one at a time and binds them seconds later, so a fresh pick must not repeat one
that is not bound yet (16 random picks in 12768 ports repeat one with ~1 % chance)."""

_recent: deque[int] = deque(maxlen=RECENT_MEMORY)
_recent_lock = threading.Lock()


def _ephemeral_range() -> tuple[int, int] | None:
    try:
        with open(EPHEMERAL_RANGE_FILE) as fh:
            lo, hi = (int(x) for x in fh.read().split())
    except (OSError, ValueError):
        return None
    return lo, hi


def _can_bind(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free a moment ago.

    Picked at random in :data:`LISTEN_PORTS`, outside the kernel's ephemeral range, and checked
    by binding, so no outgoing connection can take one before its server binds it; another
    listener can still (rarely) win the race. Falls back to ``bind(:0)`` where that range is not
    below the ephemeral one or has no free port left.
    """
    lo, hi = LISTEN_PORTS
    eph = _ephemeral_range()
    picked: list[int] = []
    if eph is not None and hi <= eph[0]:
        rng = random.SystemRandom()
        for _ in range(50 * n):
            if len(picked) == n:
                return _remember(picked)
            port = rng.randrange(lo, hi)
            with _recent_lock:
                recent = port in _recent
            if port not in picked and not recent and _can_bind(host, port):
                picked.append(port)
    socks = []
    try:
        for _ in range(n - len(picked)):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
        return _remember(picked + [int(s.getsockname()[1]) for s in socks])
    finally:
        for s in socks:
            s.close()


def _remember(picked: list[int]) -> list[int]:
    with _recent_lock:
        _recent.extend(picked)
    return picked


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    return free_ports(1, host)[0]


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether a TCP connection to ``host:port`` succeeds within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
