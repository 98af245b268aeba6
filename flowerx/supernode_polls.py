"""Fast path ``supernode-fast-polls``: the SuperNode main loop's hard-coded sleeps made short.

In ``flwr.supernode.start_client_internal`` (FLOWER_NOTES.md §4a) the SuperNode sleeps 3 s after
every empty pull from the SuperLink, 0.5 s per wait for the ClientApp's reply, and retries a
message object not yet at the SuperLink after 1 s (doubling to 10 s). :func:`install_fast_polls`
replaces them: the 3 s sleep becomes a back-off (``idle_min`` growing by ``growth`` per empty pull
up to ``idle_max``, back to ``idle_min`` after every message), the 0.5 s waits become ``reply`` s,
and the object retries start at 10 ms (doubling, at most 0.25 s). A callback sees every message the
SuperNode stores (graphfl's warm executor is woken by it).

Only the ``time`` name inside that module and its ``_pull_and_store_message`` and ``pull_objects``
are replaced (wrapped, never edited). On: when :func:`check` finds the sleeps being replaced.
Off: Flower's own sleeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from graphfl.flowerx.checks import first_reason, lacks_source
from graphfl.flowerx.policy import FastPath, decide

FAST_PATH = FastPath("supernode-fast-polls", "short SuperNode polls",
                     "the SuperNode keeps Flower's 3 s idle and 0.5 s reply sleeps")

IDLE_SLEEP = 3      # start_client_internal: time.sleep(3) after an empty pull
REPLY_SLEEP = 0.5   # _push_messages: time.sleep(0.5) while waiting for the ClientApp's reply


@dataclass(frozen=True)
class PollPolicy:
    """The SuperNode's waits in fast mode (seconds)."""

    idle_min: float = 0.02
    idle_max: float = 0.25
    growth: float = 1.5
    reply: float = 0.005
    object_backoff: tuple[float, float] = (0.01, 0.25)
    """(initial, cap) retry delay for message objects not yet at the SuperLink (Flower: 1 s, 10 s)."""


class SuperNodeClock:
    """Stands in for the ``time`` module inside ``flwr.supernode.start_client_internal``.

    Every attribute is the real ``time``'s, except ``sleep``: Flower's idle sleep (3 s) becomes
    the current back-off, its reply wait (0.5 s) becomes ``policy.reply``; other durations pass.
    """

    def __init__(self, policy: PollPolicy, real_sleep: Callable[[float], None] = time.sleep) -> None:
        self.policy = policy
        self.idle = policy.idle_min
        self._sleep = real_sleep

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        if seconds == IDLE_SLEEP:
            seconds, self.idle = self.idle, min(self.idle * self.policy.growth, self.policy.idle_max)
        elif seconds == REPLY_SLEEP:
            seconds = self.policy.reply
        self._sleep(seconds)

    def activity(self) -> None:
        """A message arrived: poll fast again."""
        self.idle = self.policy.idle_min


def check() -> str | None:
    """Why the fast polls do not fit this Flower's SuperNode loop, or ``None``."""
    from flwr.supernode import start_client_internal as sci

    return first_reason(
        lacks_source(sci.start_client_internal, "SuperNode main loop", ("run_id = _pull_and_store_message(",
                                                                          "time.sleep(3)")),
        lacks_source(sci._push_messages, "SuperNode reply wait", ("time.sleep(0.5)",)),
        lacks_source(sci._pull_and_store_message, "SuperNode message pull", ("pull_objects(",)),
    )


def install_fast_polls(policy: PollPolicy, on_message: Callable[[], None] | None = None,
                       check_flower: bool = True) -> SuperNodeClock | None:
    """Replace the SuperNode main loop's sleeps (see the module docstring); returns the clock, or
    ``None`` when the fast path is off here (Flower's sleeps stay).

    ``check_flower=False`` skips the policy (only tests that stub the wrapped functions use it).
    """
    if check_flower and not decide(FAST_PATH, check):
        return None
    from flwr.supernode import start_client_internal as sci

    clock = SuperNodeClock(policy)
    original = sci._pull_and_store_message

    def pull_and_store_message(*args: Any, **kwargs: Any) -> int | None:
        run_id = original(*args, **kwargs)
        if run_id is not None:
            clock.activity()
            if on_message is not None:
                on_message()
        return run_id

    original_pull_objects = sci.pull_objects

    def pull_objects(*args: Any, **kwargs: Any) -> dict[str, bytes]:
        kwargs.setdefault("initial_backoff", policy.object_backoff[0])
        kwargs.setdefault("backoff_cap", policy.object_backoff[1])
        return original_pull_objects(*args, **kwargs)

    sci.time = clock  # type: ignore[assignment]
    sci._pull_and_store_message = pull_and_store_message
    sci.pull_objects = pull_objects
    return clock
