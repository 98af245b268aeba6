"""Bound Flower's reply pulls by the round deadline (found by ``graphfl bench faults``).

A reply message reaches the SuperLink in two steps: the SuperNode pushes the message, then its
objects (the ArrayRecord). A SuperNode that stops between the two (SIGSTOP, killed, cut off)
leaves a reply whose objects never come. Flower's deployment grid
(``flwr.superlink.grid.http_grid.HttpGrid.pull_messages``) then retries pulling them with
``pull_objects``' defaults: up to 500 tries or 7200 s, backing off to 10 s per try. graphfl's
``round-timeout`` is checked only between pulls, so the round waited for the straggler: measured
17.5 s for a round with ``round-timeout = 8`` and a SuperNode stopped for 13 s, and up to two
hours in the worst case.

:func:`pull_budget` sets, for the pulls made inside it, ``max_time`` = the time left in the
round, a first retry after 10 ms and a backoff cap of 1 s. When it runs out, Flower itself turns the reply into an error
reply (``MESSAGE_UNAVAILABLE``, "Reply message objects are unavailable ..."), which the round
records as that client's failure. The wrapper is installed once, in the ServerApp process; if
the installed Flower no longer calls ``pull_objects`` from ``http_grid`` it is not installed and
a warning says the round deadline is then not enforced inside a pull.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

BACKOFF_CAP_S = 1.0
"""Longest wait between two tries of a missing object inside a bounded pull."""

INITIAL_BACKOFF_S = 0.01
"""First wait before a reply's object is asked again (Flower: 1 s). The ServerApp often sees a reply
message while its SuperNode is still pushing the objects; they are there within milliseconds."""

_budget: contextvars.ContextVar[float | None] = contextvars.ContextVar("graphfl_pull_budget", default=None)
_installed: list[bool] = []


def _bounded(pull_objects: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(pull_objects)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        budget = _budget.get()
        if budget is not None:
            kwargs["max_time"] = min(float(kwargs.get("max_time") or budget), budget)
            kwargs["backoff_cap"] = min(float(kwargs.get("backoff_cap") or BACKOFF_CAP_S), BACKOFF_CAP_S)
            kwargs["initial_backoff"] = min(float(kwargs.get("initial_backoff") or INITIAL_BACKOFF_S), INITIAL_BACKOFF_S)
        return pull_objects(*args, **kwargs)

    wrapper.graphfl_bounded = True  # type: ignore[attr-defined]
    return wrapper


def install() -> bool:
    """Wrap ``http_grid``'s ``pull_objects`` (idempotent); ``False`` when this Flower has no such call."""
    if _installed:
        return _installed[0]
    try:
        from flwr.superlink.grid import http_grid
    except ImportError as exc:
        logger.warning("cannot bound Flower's reply pulls (%s): round-timeout is not enforced inside a pull", exc)
        _installed.append(False)
        return False
    current = getattr(http_grid, "pull_objects", None)
    if current is None or not callable(current):
        logger.warning("flwr.superlink.grid.http_grid has no pull_objects: round-timeout is not enforced inside a "
                       "pull of a straggler's reply")
        _installed.append(False)
        return False
    if not getattr(current, "graphfl_bounded", False):
        http_grid.pull_objects = _bounded(current)
    _installed.append(True)
    return True


@contextlib.contextmanager
def pull_budget(seconds: float) -> Iterator[None]:
    """Pulls inside this block give up on a reply's missing objects after ``seconds`` (at least 0.5)."""
    token = _budget.set(max(0.5, float(seconds)))
    try:
        yield
    finally:
        _budget.reset(token)
