r"""How long the ServerApp waits between two pulls of a round's replies from the SuperLink.

Flower's deployment has no push from the SuperLink to the ServerApp: the ServerApp asks for the
replies it is waiting for (``Grid.pull_messages``) until all have come. Every ask is a request the
SuperLink serves while it is also moving the round's model bytes. A fixed short wait (Flower's
``send_and_receive`` sleeps 3 s; a short constant wait makes hundreds of requests in a round of a
large model) trades latency for requests in one fixed ratio. :class:`ReplyPolls` makes the wait a
fraction of the time already spent waiting:

.. math::

    w = \min\bigl(w_{\max},\; \max(w_{\min},\; f \cdot (t - t_{\text{last}}))\bigr)

where :math:`t_{\text{last}}` is the start of the exchange or the last pull that brought a reply.
A reply that arrives during a wait is therefore seen at most :math:`\max(w_{\min}, f\,\Delta)`
(capped at :math:`w_{\max}`) plus the duration of one pull late, :math:`\Delta` being how long
the ServerApp had already waited for it: rounds shorter than :math:`w_{\min}/f` poll exactly as with a constant :math:`w_{\min}`,
and a long round makes :math:`O(\log(\Delta f / w_{\min})/f + \Delta / w_{\max})` requests
instead of :math:`\Delta / w_{\min}`. Replies of one round tend to arrive together, so the
wait drops back to :math:`w_{\min}` after every pull that brought one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplyPolls:
    r"""The waits between reply pulls (seconds): ``w = min(longest, max(shortest, fraction × waited))``.

    Parameters
    ----------
    shortest:
        :math:`w_{\min}`, the wait while little time has passed since the exchange started or a
        reply came.
    fraction:
        :math:`f`, the wait as a fraction of the time waited since then (the extra latency a reply
        can see, relative to how long it took).
    longest:
        :math:`w_{\max}`, the longest wait.
    """

    shortest: float = 0.05
    fraction: float = 0.1
    longest: float = 0.5

    def __post_init__(self) -> None:
        for name in ("shortest", "fraction", "longest"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"ReplyPolls.{name} must be a positive finite number of seconds, got {value!r}")
        if self.longest < self.shortest:
            raise ValueError(f"ReplyPolls.longest ({self.longest}) must be >= ReplyPolls.shortest ({self.shortest})")

    def wait(self, waited: float) -> float:
        """The wait before the next pull, ``waited`` s after the exchange started or a reply came."""
        return min(self.longest, max(self.shortest, self.fraction * max(0.0, waited)))


class ReplyPollClock:
    """One exchange's reply polls under ``polls``: call :meth:`pulled` after every pull, then
    sleep :meth:`next_wait`.
    """

    def __init__(self, polls: ReplyPolls, start: float) -> None:
        self.polls = polls
        self.since = start

    def pulled(self, now: float, got_reply: bool) -> None:
        """Record a pull at ``now`` (monotonic seconds); one that brought a reply restarts the wait."""
        if got_reply:
            self.since = now

    def next_wait(self, now: float) -> float:
        """Seconds to sleep before the next pull."""
        return self.polls.wait(now - self.since)


def poll_replies(pull: Callable[[float], int], outstanding: Callable[[], bool], polls: ReplyPolls, timeout: float,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> int:
    """Pull until nothing is ``outstanding()`` or ``timeout`` s have passed, waiting as ``polls`` says.

    ``pull(budget)`` makes one pull with ``budget`` s left before the deadline and returns how many
    replies it brought (a pull that brought one restarts the wait). No wait runs past the deadline.
    Returns the number of pulls made.
    """
    state = ReplyPollClock(polls, clock())
    deadline = state.since + timeout
    made = 0
    while outstanding() and clock() < deadline:
        got = pull(deadline - clock())
        made += 1
        now = clock()
        state.pulled(now, got_reply=got > 0)
        if outstanding():
            sleep(min(state.next_wait(now), max(0.0, deadline - now)))
    return made
