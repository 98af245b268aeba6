"""Fast path ``bounded-pull``: Flower's pulls of a reply's objects are bounded by the round deadline.

A reply message reaches the SuperLink in two steps: the SuperNode pushes the message, then its
objects (the ArrayRecord). A SuperNode that stops between the two (SIGSTOP, killed, cut off)
leaves a reply whose objects never come. Flower's deployment grid
(``flwr.superlink.grid.http_grid.HttpGrid.pull_messages``) then retries pulling them with
``pull_objects``' defaults: up to 500 tries or 7200 s, backing off to 10 s per try, while graphfl's
``round-timeout`` is checked only between pulls.

:func:`pull_budget` sets, for the pulls made inside it, ``max_time`` = the time left in the
round, a first retry after 10 ms and a backoff cap of 1 s. When it runs out, Flower itself turns
the reply into an error reply (``MESSAGE_UNAVAILABLE``, "Reply message objects are unavailable
..."), which the round records as that client's failure. The wrapper is installed once, in the
ServerApp process. Off (:mod:`graphfl.flowerx.policy`): :func:`pull_budget` changes nothing and a
straggler's missing objects are retried with Flower's defaults.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

from graphfl.flowerx.policy import FastPath, decide

logger = logging.getLogger(__name__)

FAST_PATH = FastPath("bounded-pull", "reply pulls bounded by the round deadline",
                     "a straggler's missing reply objects are retried with Flower's defaults (up to 7200 s)")

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


def check() -> str | None:
    """Why the bound cannot be installed on this Flower, or ``None``."""
    from flwr.superlink.grid import http_grid

    if not callable(getattr(http_grid, "pull_objects", None)):
        return "flwr.superlink.grid.http_grid has no pull_objects"
    return None


def install() -> bool:
    """Wrap ``http_grid``'s ``pull_objects`` (idempotent); ``False`` when the fast path is off here."""
    if _installed:
        return _installed[0]
    if not decide(FAST_PATH, check):
        _installed.append(False)
        return False
    from flwr.superlink.grid import http_grid

    current = http_grid.pull_objects
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
