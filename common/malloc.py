"""Keep freed model-sized buffers in the process (glibc ``mallopt``): no page faults per round.

A peer allocates a few model-sized arrays every round (the received tensors, the mixed
parameters, the encoded frames) and frees the previous round's. With glibc's defaults such a
buffer is either ``mmap``-ed (above the dynamic mmap threshold, at most 32 MiB) and unmapped on
``free``, or taken from the heap, whose top is given back to the kernel (``trim``) as soon as
more than twice the last such size is free. Either way the next round touches fresh pages:
one page fault and one zeroed page per 4 kB, a large part of a big model's round (measured in
docs/p2p.md, "Third look: CPU per round").

:func:`keep_freed_memory` sets ``M_MMAP_MAX = 0`` (every allocation from the heap, none
``mmap``-ed) and ``M_TRIM_THRESHOLD`` to 2 GiB, the largest value ``mallopt`` takes (freed
memory is reused, not trimmed). The resident set then stays at the process's peak instead of
falling back between rounds, and the peak (``max_rss_mb``) can grow a little where freed blocks
are kept rather than unmapped (docs/p2p.md). It is
called at the start of processes whose working set is a few model-sized buffers reused every round: a p2p peer
(``python -m graphfl.p2p peer``) and the parallel floor of ``graphfl bench p2p-throughput`` (the
floor gets it too, or it would pay page faults the peers do not). Not glibc (macOS, musl):
nothing is changed. ``GRAPHFL_MALLOC=default`` keeps glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
"""``mallopt`` parameter numbers (glibc ``malloc.h``)."""
TRIM_THRESHOLD = 2**31 - 1
"""Bytes of free heap top kept before glibc trims it (``mallopt`` takes an ``int``)."""
ENV = "GRAPHFL_MALLOC"


def keep_freed_memory() -> str:
    """Tell glibc to reuse freed memory instead of returning it to the kernel (module docstring).

    Returns
    -------
    str
        ``"retain"`` when both settings took effect, ``"default"`` when ``GRAPHFL_MALLOC=default``
        asked for glibc's defaults, ``"unsupported"`` off glibc or when ``mallopt`` refused.
    """
    if os.environ.get(ENV, "").strip().lower() == "default":
        return "default"
    if platform.libc_ver()[0] != "glibc":
        return "unsupported"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as exc:
        logger.debug("mallopt unavailable: %s", exc)
        return "unsupported"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1  # 1: success
    return "retain" if ok else "unsupported"
