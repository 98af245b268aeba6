"""One thread that enforces the deadlines of a peer's inbound streams.

Every inbound ``Push`` stream has a deadline (``stream_timeout``): an idle or trickling sender
must not hold a receive thread for ever. A ``threading.Timer`` per stream did that with one new
OS thread per message (two per neighbour and round; a sampled 100k-parameter ring spent 5.5 % of
its receive threads' time starting them). :class:`Watchdog` keeps the deadlines in a heap served
by one daemon thread, started on first use.

Invariant: a callback runs at most once and never before its deadline; once :meth:`Watchdog.unwatch`
has returned it does not start (one already started at its deadline may still be running: for a
stream that is ``context.cancel()`` on an RPC that just ended, which gRPC ignores). Callbacks run
on the watchdog thread, outside its lock.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Watchdog:
    """Deadlines served by one thread: ``token = watch(seconds, callback)``, then ``unwatch(token)``."""

    def __init__(self, name: str = "p2p-watchdog") -> None:
        self.name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, Callable[[], object]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, seconds: float, callback: Callable[[], object]) -> int:
        """Run ``callback`` in ``seconds`` unless :meth:`unwatch` is called first; returns the token."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            token = next(self._ids)
            self._live[token] = callback
            heapq.heappush(self._heap, (time.monotonic() + seconds, token))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()
            return token

    def unwatch(self, token: int) -> None:
        """Forget ``token``: its callback will not start (one already started is not waited for)."""
        with self._cond:
            self._live.pop(token, None)

    def pending(self) -> int:
        """Callbacks still to run (watched and not unwatched)."""
        with self._cond:
            return len(self._live)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread (bounded wait); pending callbacks are dropped."""
        with self._cond:
            self._closed = True
            self._live.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                due: Callable[[], object] | None = None
                while due is None:
                    if self._closed:
                        return
                    while self._heap and self._heap[0][1] not in self._live:
                        heapq.heappop(self._heap)  # unwatched: drop
                    if not self._heap:
                        self._cond.wait()
                        continue
                    deadline, token = self._heap[0]
                    left = deadline - time.monotonic()
                    if left > 0:
                        self._cond.wait(left)
                        continue
                    heapq.heappop(self._heap)
                    due = self._live.pop(token)
            try:
                due()
            except Exception:  # a failing callback must not stop the other deadlines
                logger.exception("%s: a deadline callback failed", self.name)
