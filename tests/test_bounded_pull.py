"""A straggler's half-pushed reply cannot hold a round past its deadline (found by ``graphfl bench faults``).

Flower's deployment grid pulls a reply's objects with ``pull_objects``, retrying a missing
object for up to 7200 s. :mod:`graphfl.server.bounded_pull` bounds those retries by the time
left in the round. Flower's real ``pull_objects`` runs here; only the object source is ours
(an object that never arrives, as from a SuperNode stopped between pushing a message and its
objects).
"""

from __future__ import annotations

import time

import pytest
from flwr.supercore.inflatable.inflatable_utils import ObjectPullError, ObjectUnavailableError
from flwr.superlink.grid import http_grid

from graphfl.server import bounded_pull


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
