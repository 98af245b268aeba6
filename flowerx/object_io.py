"""More concurrent object transfers in a Flower process (ServerApp, SuperNode, warm ClientApp worker).

Installed by graphfl's ServerApp (:mod:`graphfl.server.flower_adapter`), its fast SuperNode
(:mod:`graphfl.deploy.supernode`) and its warm ClientApp worker (:mod:`graphfl.deploy.warm`);
stock ``flwr-clientapp`` processes (``--clientapp-mode cold``) keep Flower's setting.
"""

from __future__ import annotations

import inspect
import logging

logger = logging.getLogger(__name__)

OBJECT_IO_THREADS = 8
"""Threads a process uses to push or pull one message's objects (see :func:`widen_object_transfers`)."""


def _source(obj: object) -> str:
    try:
        return inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""


def widen_object_transfers(threads: int = OBJECT_IO_THREADS) -> bool:
    """Let Flower move a message's objects over at least ``threads`` concurrent calls in this process.

    A Flower message travels as a tree of objects (the message, its record dict, each record,
    each array and its chunks: 12 for the ``digits`` MLP), each pulled or pushed by its own request
    to the SuperLink or the SuperNode. ``flwr.supercore.inflatable.inflatable_utils.get_num_workers`` caps the calls in flight
    at ``min(FLWR_PRIVATE_MAX_CONCURRENT_OBJ_*, os.cpu_count())`` = 2 on a 2-core machine, so the
    SuperNode fetched a message in six waves of two round trips: 0.37–0.58 s of a 2.1 s warm round
    (measured). The calls wait on the network, not on a core, so the cap by core count is replaced
    here by ``max(Flower's cap, threads)``; the wrapped function is the module attribute that
    ``push_objects`` (through ``push_object_contents_from_iterable``) and
    ``pull_objects`` look up at each call (never an edit of Flower's files). Measured on 2 cores:
    join 1.1–1.4 s instead of 1.5–2.7 s; rounds unchanged (there the cores are the limit, see
    docs/deployment.md); on links with latency a message's objects take ~2 round trips, not 6.

    Returns ``False`` (and changes nothing) when this Flower has no such function.
    """
    try:
        from flwr.supercore.inflatable import inflatable_utils as iu
    except ImportError:
        return False
    current = getattr(iu, "get_num_workers", None)
    if current is None or getattr(current, "graphfl_widened", False):
        return current is not None
    users = [getattr(iu, name, None) for name in ("push_object_contents_from_iterable", "pull_objects")]
    if not all(f is not None and "get_num_workers(" in _source(f) for f in users):
        logger.warning("this Flower's object transfers do not go through get_num_workers: their threads are not widened")
        return False

    def get_num_workers(max_concurrent: int) -> int:
        return max(int(current(max_concurrent)), int(threads))

    get_num_workers.graphfl_widened = True  # type: ignore[attr-defined]
    iu.get_num_workers = get_num_workers
    return True
