"""Claim files: several processes sharing one run cache never compute the same cell twice.

A process about to compute a cell creates ``<cache>/<key hash>.running`` in one step (a hard link
of a file it wrote: one creator wins, and the file is never seen empty), holding its identity
``"<host> <pid> <start time>"`` (the start time is field 22 of ``/proc/<pid>/stat``, so a reused
pid is not mistaken for the holder). Another process that needs the cell waits while the holder
is alive and the result is not cached, at most a given number of seconds in all (then
:class:`TimeoutError` naming the cell, the holder and the file); a claim whose holder has ended
is taken over. The holder removes its file when the cell ends, also when it is interrupted. A
holder on another host cannot be checked and counts as alive; processes that share a cache
folder must see one another's pids (not containers with separate pid namespaces and one host
name).

:func:`compute_claimed` is the whole protocol around one cell; the harness's cell runner uses it
for a :class:`~graphfl.bench.harness.Bench` that declares ``claim_wait``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .runcache import RunCache

logger = logging.getLogger(__name__)

__all__ = ["POLL_SECONDS", "UNWRITTEN_GRACE_SECONDS", "claim", "claim_file", "claimed", "compute_claimed", "holder",
           "holder_alive", "identity", "wait_for_claim"]

POLL_SECONDS = 10.0
"""How often a process waiting for another process's cell looks again."""


def claim_file(cache: RunCache, key: dict[str, Any]) -> Path | None:
    """``<cache>/<key hash>.running`` (``None`` for a cache without a folder)."""
    if cache.folder is None:
        return None
    return cache.path(key).with_suffix(".running")


def _proc_start(pid: int) -> str | None:
    """The start time of process ``pid`` (field 22 of ``/proc/<pid>/stat``, clock ticks since boot); None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # field 3 onwards (the name, field 2, may hold spaces)
    return fields[19] if len(fields) > 19 else None


def identity(pid: int | None = None) -> str:
    """``"<hostname> <pid> <start time>"`` of ``pid`` (this process by default): what a claim file holds."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()} {pid} {_proc_start(pid) or '-'}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder_alive(who: str) -> bool:
    """Whether the process a claim file names still runs: same host, pid alive and the same start time
    (a reused pid has another); a holder on another host cannot be checked and counts as alive; a
    bare pid is checked for existence only.
    """
    parts = who.split()
    try:
        if len(parts) == 1:
            return _alive(int(parts[0]))
        host, pid, start = parts[0], int(parts[1]), (parts[2] if len(parts) > 2 else "-")
    except (IndexError, ValueError):
        return False
    if host != socket.gethostname():
        return True
    if pid <= 0 or not _alive(pid):
        return False
    now = _proc_start(pid)
    return start == "-" or now is None or now == start


def holder(cache: RunCache, key: dict[str, Any]) -> str | None:
    """The live process (its identity) other than this one that has claimed ``key``'s cell, or None
    (an empty, recent claim file, whose creator has not written it yet, is ``"(being written)"``).
    """
    path = claim_file(cache, key)
    if path is None:
        return None
    try:
        who = path.read_text().strip()
    except OSError:
        return None
    if not who:
        return "(being written)" if _unwritten_and_recent(path) else None
    return who if who != identity() and holder_alive(who) else None


def claimed(cache: RunCache, key: dict[str, Any]) -> bool:
    """Whether a live process other than this one has claimed ``key``'s cell."""
    return holder(cache, key) is not None


UNWRITTEN_GRACE_SECONDS = 30.0
"""An empty claim file younger than this counts as held: its creator may not have written its
identity yet (a claim made by :func:`_try_claim` is never empty; one made by a process that creates
the file and then writes it can be, for a moment)."""


def _create_with(path: Path, content: str) -> bool:
    """Create ``path`` holding ``content`` in one step: written to a private file, then hard-linked
    to ``path`` (``link`` fails when ``path`` exists, so one creator wins and nobody ever reads a
    claim without its identity; on a file system without hard links, created with ``O_EXCL`` and
    then written). False when ``path`` exists.
    """
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(content)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: create, then write (an empty file counts as held)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(content)
    finally:
        tmp.unlink(missing_ok=True)
    return True


def _unwritten_and_recent(path: Path) -> bool:
    try:
        return time.time() - path.stat().st_mtime < UNWRITTEN_GRACE_SECONDS
    except OSError:
        return False


def _try_claim(path: Path) -> bool:
    """Create ``path`` with this process's identity (:func:`_create_with`: one creator wins).

    An existing file whose holder has ended (or is this process) is taken over; False when a live
    holder has it, or when the file is empty and recent (:data:`UNWRITTEN_GRACE_SECONDS`). Two
    processes taking over the same dead claim at once can at worst both compute the cell (the cache
    write is atomic).
    """
    me = identity()
    for _ in range(3):
        if _create_with(path, me + "\n"):
            return True
        try:
            who = path.read_text().strip()
        except OSError:
            continue  # removed meanwhile
        if not who and _unwritten_and_recent(path):
            return False
        if who and who != me and holder_alive(who):
            return False
        logger.warning("taking over the claim %s of the ended process %r", path, who)
        try:
            if path.read_text().strip() == who:
                path.unlink()
        except OSError:
            pass
    return False


@contextlib.contextmanager
def claim(cache: RunCache, key: dict[str, Any]) -> Iterator[bool]:
    """Mark ``key``'s cell as being computed by this process (another process sharing the cache waits).

    Yields whether this process holds the claim (False: a live process claimed it first; wait for
    it with :func:`wait_for_claim`). The claim file is removed on exit if it is ours.
    """
    path = claim_file(cache, key)
    held = True if path is None else _try_claim(path)
    try:
        yield held
    finally:
        if path is not None and held:
            try:
                if path.read_text().strip() == identity():
                    path.unlink()
            except OSError:
                pass


def wait_for_claim(cache: RunCache, key: dict[str, Any], limit: float, what: str,
                   poll: float = POLL_SECONDS) -> None:
    """Wait while another live process has claimed ``key``'s cell (``what``) and its result is not cached.

    Raises :class:`TimeoutError` (naming the cell, the holder and the claim file) after ``limit`` seconds.
    """
    who = holder(cache, key)
    if cache.has(key) or who is None:
        return
    logger.info("waiting (at most %.0f s) for process %s computing %s", limit, who, what)
    t0 = time.monotonic()
    while not cache.has(key) and (who := holder(cache, key)) is not None:
        if time.monotonic() - t0 > limit:
            raise TimeoutError(f"{what} is still claimed by process {who!r} after {limit:.0f} s "
                               f"(claim file {claim_file(cache, key)}); stop that process or remove the file if "
                               "it is stale, then run again")
        time.sleep(poll)
    if not cache.has(key):
        logger.warning("the process computing %s ended without a result; computing it here", what)


def compute_claimed(cache: RunCache, key: dict[str, Any], compute: Callable[[], dict[str, Any]], limit: float,
                    what: str, poll: float = POLL_SECONDS) -> dict[str, Any]:
    """``key``'s cached result, or ``compute()``'s stored under a claim (the module docstring's protocol).

    A process that loses the race for the claim waits for the winner (:func:`wait_for_claim`, looking
    every ``poll`` seconds, at most a tenth of ``limit``) and reads its result; :class:`TimeoutError`
    after ``limit`` seconds without the claim.
    """
    poll = min(poll, max(limit / 10, 0.01))
    t0 = time.monotonic()
    while True:
        wait_for_claim(cache, key, max(limit - (time.monotonic() - t0), 0.0), what, poll)
        if cache.has(key):
            return cache.get(key) or {}
        with claim(cache, key) as held:
            if held:
                return cache(key, compute)
            if time.monotonic() - t0 > limit:
                raise TimeoutError(f"could not claim {what} (claim file {claim_file(cache, key)})")
        time.sleep(1.0)
