"""A straggler's half-pushed reply cannot hold a round past its deadline (found by ``graphfl bench faults``).

Flower's deployment grid pulls a reply's objects with ``pull_objects``, retrying a missing
object for up to 7200 s. :mod:`graphfl.flowerx.bounded_pull` bounds those retries by the time
left in the round. Flower's real ``pull_objects`` runs here; only the object source is ours
(an object that never arrives, as from a SuperNode stopped between pushing a message and its
objects).
"""

from __future__ import annotations

import time

import pytest
from flwr.supercore.inflatable.inflatable_utils import ObjectPullError, ObjectUnavailableError
from flwr.superlink.grid import http_grid

from graphfl.flowerx import bounded_pull


def _never(object_id: str) -> bytes:
    raise ObjectUnavailableError(object_id)


def test_a_missing_object_is_given_up_at_the_round_deadline() -> None:
    assert bounded_pull.install() and bounded_pull.install()  # idempotent
    assert getattr(http_grid.pull_objects, "graphfl_bounded", False)
    t0 = time.monotonic()
    with bounded_pull.pull_budget(1.0), pytest.raises(ObjectPullError):
        http_grid.pull_objects(["a", "b"], _never)
    assert time.monotonic() - t0 < 3.0  # budget 1 s + at most one 1 s backoff, not 7200 s


def test_outside_a_budget_the_callers_limits_apply_unchanged() -> None:
    bounded_pull.install()
    assert bounded_pull._budget.get() is None
    t0 = time.monotonic()
    with pytest.raises(ObjectPullError):
        http_grid.pull_objects(["a"], _never, max_time=0.3, initial_backoff=0.1)
    assert time.monotonic() - t0 < 2.0
    with bounded_pull.pull_budget(0.0):
        assert bounded_pull._budget.get() == 0.5  # never below half a second
    assert bounded_pull._budget.get() is None


def test_an_object_arriving_late_is_asked_again_within_milliseconds() -> None:
    """The first retry comes after ~10 ms (Flower: 1 s): a reply seen while its SuperNode still
    pushes the objects is complete a few ms later and must not cost the round a second."""
    bounded_pull.install()
    ready_at = time.monotonic() + 0.03
    calls: list[float] = []

    def late(object_id: str) -> bytes:
        calls.append(time.monotonic())
        if time.monotonic() < ready_at:
            raise ObjectUnavailableError(object_id)
        return b"x"

    t0 = time.monotonic()
    with bounded_pull.pull_budget(5.0):
        assert http_grid.pull_objects(["a"], late) == {"a": b"x"}
    assert len(calls) >= 2
    assert time.monotonic() - t0 < 0.5   # 10, 20, 40 ms back-off (±20 %), not 1 s


def test_object_transfers_use_more_threads_than_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`graphfl.flowerx.object_io.widen_object_transfers`: Flower's own ``pull_objects`` then
    has 8 calls in flight (it capped them at the core count); installing twice does not nest."""
    import threading

    from flwr.supercore.inflatable import inflatable_utils as iu

    from graphfl.flowerx import object_io

    monkeypatch.setattr(iu, "get_num_workers", iu.get_num_workers)   # restored after the test
    stock = iu.get_num_workers(2)
    assert object_io.widen_object_transfers(8) and object_io.widen_object_transfers(8)
    assert iu.get_num_workers(2) == max(stock, 8)
    assert not getattr(iu.get_num_workers.__closure__[0].cell_contents, "graphfl_widened", False)  # no nesting

    lock, in_flight, peak = threading.Lock(), [0], [0]
    gate = threading.Barrier(8, timeout=5)

    def slow(object_id: str) -> bytes:
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        gate.wait()                      # all 8 must be in flight at once, or this times out
        with lock:
            in_flight[0] -= 1
        return object_id.encode()

    got = iu.pull_objects([f"o{i}" for i in range(8)], slow, max_concurrent_pulls=2)
    assert len(got) == 8 and peak[0] == 8
