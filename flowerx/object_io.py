"""Fast path ``object-io-threads``: more concurrent object transfers in a Flower process.

Installed by graphfl's ServerApp (:mod:`graphfl.server.flower_adapter`), its SuperNode
(:mod:`graphfl.deploy.supernode`) and its warm ClientApp worker (:mod:`graphfl.deploy.warm`);
stock ``flwr-clientapp`` processes (``--clientapp-mode cold``) keep Flower's setting. Off
(:mod:`graphfl.flowerx.policy`): Flower's cap by core count stays.
"""

from __future__ import annotations

import logging

from graphfl.flowerx.checks import source_of
from graphfl.flowerx.policy import FastPath, decide

logger = logging.getLogger(__name__)

FAST_PATH = FastPath("object-io-threads", "object transfers over more threads than cores",
                     "Flower caps a message's concurrent object transfers at the core count")

OBJECT_IO_THREADS = 8
"""Threads a process uses to push or pull one message's objects (see :func:`widen_object_transfers`)."""


def check() -> str | None:
    """Why the widening does not fit this Flower's object transfers, or ``None``."""
    from flwr.supercore.inflatable import inflatable_utils as iu

    if not callable(getattr(iu, "get_num_workers", None)):
        return "flwr.supercore.inflatable.inflatable_utils has no get_num_workers"
    users = [getattr(iu, name, None) for name in ("push_object_contents_from_iterable", "pull_objects")]
    if not all(f is not None and "get_num_workers(" in source_of(f) for f in users):
        return "this Flower's object transfers do not go through get_num_workers"
    return None


def widen_object_transfers(threads: int = OBJECT_IO_THREADS) -> bool:
    """Let Flower move a message's objects over at least ``threads`` concurrent calls in this process.

    A Flower message travels as a tree of objects (the message, its record dict, each record,
    each array and its chunks), each pulled or pushed by its own request to the SuperLink or the
    SuperNode. ``flwr.supercore.inflatable.inflatable_utils.get_num_workers`` caps the calls in
    flight at ``min(FLWR_PRIVATE_MAX_CONCURRENT_OBJ_*, os.cpu_count())``, so on a 2-core machine a
    message moves in waves of two round trips. The calls wait on the network, not on a core, so
    the cap by core count is replaced here by ``max(Flower's cap, threads)``; the wrapped function
    is the module attribute that ``push_objects`` (through ``push_object_contents_from_iterable``)
    and ``pull_objects`` look up at each call (never an edit of Flower's files).

    Returns ``False`` (and changes nothing) when the fast path is off here.
    """
    if not decide(FAST_PATH, check):
        return False
    from flwr.supercore.inflatable import inflatable_utils as iu

    current = iu.get_num_workers
    if getattr(current, "graphfl_widened", False):
        return True

    def get_num_workers(max_concurrent: int) -> int:
        return max(int(current(max_concurrent)), int(threads))

    get_num_workers.graphfl_widened = True  # type: ignore[attr-defined]
    iu.get_num_workers = get_num_workers
    return True
