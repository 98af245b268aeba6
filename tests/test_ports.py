"""Listening ports are picked outside the kernel's ephemeral range and checked by binding."""

from __future__ import annotations

import socket

import pytest

from graphfl.common import ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    got = ports.free_ports(20)
    assert len(set(got)) == 20
    eph = ports._ephemeral_range()
    if eph is not None and ports.LISTEN_PORTS[1] <= eph[0]:
        assert all(ports.LISTEN_PORTS[0] <= p < ports.LISTEN_PORTS[1] for p in got)
    for p in got:
        assert ports._can_bind("127.0.0.1", p)


def test_a_port_with_a_listener_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "_ephemeral_range", lambda: (taken + 2, 65000))
        monkeypatch.setattr(ports, "LISTEN_PORTS", (taken, taken + 2))  # two candidates, one taken
        if not ports._can_bind("127.0.0.1", taken + 1):
            pytest.skip(f"port {taken + 1} happens to be in use too")  # nothing to choose from
        monkeypatch.setattr(ports, "_recent", ports.deque(maxlen=ports.RECENT_MEMORY))
        assert ports.free_ports(1) == [taken + 1]
        monkeypatch.setattr(ports, "_recent", ports.deque(maxlen=ports.RECENT_MEMORY))
        # no candidate left in the range: falls back to the kernel's choice, still not the held port
        assert ports.free_ports(2)[0] == taken + 1 and taken not in ports.free_ports(2)


def test_without_the_range_file_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", "/nonexistent/ip_local_port_range")
    got = ports.free_ports(3)
    assert len(set(got)) == 3 and all(ports._can_bind("127.0.0.1", p) for p in got)


def test_a_port_handed_out_is_not_handed_out_again_before_it_is_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A federation asks for its ports one at a time and binds them later: no repeats meanwhile."""
    lo = 20000
    monkeypatch.setattr(ports, "_recent", ports.deque(maxlen=ports.RECENT_MEMORY))
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (lo + 40, 65000))
    monkeypatch.setattr(ports, "LISTEN_PORTS", (lo, lo + 40))
    bindable = [p for p in range(lo, lo + 40) if ports._can_bind("127.0.0.1", p)]
    if len(bindable) < 20:
        pytest.skip(f"only {len(bindable)} of ports {lo}..{lo + 39} are free on this host")
    got = [ports.free_port() for _ in range(20)]     # none bound: each pick must still be new
    assert len(set(got)) == 20 and set(got) <= set(bindable)
