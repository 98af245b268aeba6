"""p2p/watchdog.py: one thread keeps every inbound stream's deadline."""

from __future__ import annotations

import threading
import time

import pytest

from graphfl.p2p.watchdog import Watchdog


def test_callbacks_run_after_their_deadline_in_deadline_order_and_unwatched_ones_never():
    dog = Watchdog("test-watchdog")
    fired: list[tuple[str, float]] = []
    done = threading.Event()
    t0 = time.monotonic()
    try:
        dog.watch(0.30, lambda: (fired.append(("late", time.monotonic() - t0)), done.set()))
        dog.watch(0.10, lambda: fired.append(("early", time.monotonic() - t0)))
        gone = dog.watch(0.05, lambda: fired.append(("unwatched", time.monotonic() - t0)))
        dog.unwatch(gone)
        assert done.wait(5.0)
        assert [name for name, _ in fired] == ["early", "late"]
        assert fired[0][1] >= 0.10 and fired[1][1] >= 0.30
        assert dog.pending() == 0
        assert sum(th.name == "test-watchdog" for th in threading.enumerate()) == 1  # one thread, not one per deadline
    finally:
        dog.close()


def test_a_failing_callback_does_not_stop_the_others_and_close_drops_pending():
    dog = Watchdog("test-watchdog-2")
    ran = threading.Event()
    try:
        dog.watch(0.01, lambda: 1 / 0)
        dog.watch(0.05, ran.set)
        assert ran.wait(5.0)
        dog.watch(60.0, ran.clear)
        assert dog.pending() == 1
    finally:
        dog.close()
    assert dog.pending() == 0 and ran.is_set()
    assert not any(th.name == "test-watchdog-2" for th in threading.enumerate())
    with pytest.raises(RuntimeError, match="closed"):
        dog.watch(1.0, ran.clear)
