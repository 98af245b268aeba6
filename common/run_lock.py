"""Exclusive ownership of an output folder through an OS lock (``fcntl.flock``).

Rule
----
A process owns a folder while it holds an exclusive ``flock`` on a lock file in that folder
(:data:`LOCK_NAME` unless the caller names another, e.g. one per p2p peer). The claim is a single
non-blocking ``flock`` on an open file, not a look at the folder followed by a write: of any
number of processes claiming at once exactly one gets the lock, and every other one gets
:class:`FolderBusy`, whose message names the folder and the owner (pid, host, role, command,
since) that the owner wrote into the lock file right after taking it. The operating system drops
the lock when the owning process ends in any way (normal exit, exception, SIGKILL), so a lock
file left behind never blocks a later run. The file itself is never removed: removing it would
let one process lock the old file and another a new file of the same name.

Within one process, claims of the same lock file nest: a second :func:`acquire` returns the lock
already held (its count raised) and the file is unlocked when the last holder releases it. The
lock's file descriptor is not inherited by child processes (``O_CLOEXEC``).

``flock`` is advisory (it binds graphfl processes, not other programs) and, on network file
systems, only as strong as the file system's support for it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from graphfl.common.config import ConfigError

logger = logging.getLogger(__name__)

LOCK_NAME = ".graphfl.lock"
"""The lock file of a run folder: its owner (the launcher; the ServerApp when no launcher owns it)."""

WRITER_LOCK_NAME = ".graphfl-writer.lock"
"""The lock file held by the one process that writes a run's results (the ServerApp or the in-process loop)."""

LOCK_FILES = (LOCK_NAME, WRITER_LOCK_NAME)
"""Lock files a run folder may hold (never counted as its content, never removed)."""

OWNER_WAIT_S = 1.0
"""How long a refused claim waits for the owner to write its name into a lock file it just took."""

_HELD: dict[str, FolderLock] = {}
_GUARD = threading.Lock()


class FolderBusy(ConfigError):
    """Another process holds the folder's lock; ``owner`` is what it wrote into the lock file."""

    def __init__(self, folder: Path, lock_file: Path, owner: dict[str, Any]) -> None:
        self.folder = folder
        self.lock_file = lock_file
        self.owner = owner
        super().__init__(f"{folder} is in use by another graphfl process ({describe_owner(owner)}); "
                         f"wait for it to end or stop it, or choose another folder (lock file {lock_file})")


def describe_owner(owner: dict[str, Any]) -> str:
    """One line naming a lock's owner: ``pid 123 on host (role), since 10:02:03, command: graphfl run ...``."""
    if not owner.get("pid"):
        return "owner unknown: it has not written its name into the lock file"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(owner.get("since", 0) or 0)))
    role = f" ({owner['role']})" if owner.get("role") else ""
    command = f", command: {owner['command']}" if owner.get("command") else ""
    return f"pid {owner['pid']} on {owner.get('host', '?')}{role}, since {since}{command}"


def read_owner(lock_file: Path, wait: float = 0.0) -> dict[str, Any]:
    """The owner written into ``lock_file`` (``{}`` when none is readable within ``wait`` seconds)."""
    end = time.monotonic() + wait
    while True:
        try:
            doc = json.loads(lock_file.read_text() or "null")
            if isinstance(doc, dict) and doc.get("pid"):
                return doc
        except (OSError, ValueError):
            pass
        if time.monotonic() >= end:
            return {}
        time.sleep(0.02)


class FolderLock:
    """A held lock on ``folder / name`` (see the module docstring); release it or use ``with``."""

    def __init__(self, folder: Path, lock_file: Path, fd: int, owner: dict[str, Any]) -> None:
        self.folder = folder
        self.lock_file = lock_file
        self.owner = owner
        self._fd: int | None = fd
        self._count = 1

    @property
    def held(self) -> bool:
        """Whether this process still holds the lock."""
        return self._fd is not None

    def update(self, **info: Any) -> None:
        """Add ``info`` to the owner written in the lock file (e.g. the run key, once known)."""
        self.owner.update(info)
        self._write_owner()

    def _write_owner(self) -> None:
        if self._fd is None:
            return
        data = (json.dumps(self.owner, default=str) + "\n").encode()
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)
        except OSError as exc:  # a full disk must not stop the owner; a refused claim then says "unknown"
            logger.warning("could not write the owner into %s: %s", self.lock_file, exc.strerror or exc)

    def release(self) -> None:
        """Drop one hold; the last one unlocks (the file stays, see the module docstring)."""
        with _GUARD:
            if self._fd is None:
                return
            self._count -= 1
            if self._count > 0:
                return
            _HELD.pop(str(self.lock_file), None)
            fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(folder: str | Path, *, name: str = LOCK_NAME, role: str = "", **info: Any) -> FolderLock:
    """Take the exclusive lock ``folder / name`` (the folder must exist) or fail at once.

    ``role`` and ``info`` go into the lock file with the pid, host, command and time, for the
    message another claimant gets. A lock this process already holds is returned again (nested;
    ``role`` and ``info`` are added to its owner).

    Raises
    ------
    FolderBusy
        Another process holds the lock; the message names the folder and the owner.
    ConfigError
        The lock file cannot be created or locked (the folder is missing, read-only, or its file
        system has no locks); the message names the file and the reason.
    """
    folder = Path(folder)
    lock_file = folder / name
    key = os.path.realpath(lock_file)
    with _GUARD:
        mine = _HELD.get(key)
        if mine is not None:
            mine._count += 1
    if mine is not None:
        if role or info:
            mine.update(**({"role": role} if role else {}), **info)
        return mine
    for _ in range(20):
        try:
            fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ConfigError(f"cannot create the lock file {lock_file} ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise FolderBusy(folder, lock_file, read_owner(lock_file, OWNER_WAIT_S)) from None
            raise ConfigError(f"cannot lock {lock_file} ({exc.strerror or exc})") from None
        try:  # the name may have been given to another file between open and flock: lock that one
            same = os.path.samestat(os.fstat(fd), os.stat(lock_file))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    else:
        raise ConfigError(f"cannot lock {lock_file}: the file keeps being replaced")
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "role": role, "since": time.time(),
             "command": " ".join(sys.argv)[:300], **info}
    lock = FolderLock(folder, lock_file, fd, owner)
    lock._write_owner()
    with _GUARD:
        _HELD[key] = lock
    return lock


def claim_output_folder(out: Path, *, overwrite: bool, kind: str, own_file: Callable[[str], bool],
                        ignore: Callable[[str], bool] = lambda name: name in LOCK_FILES,
                        role: str = "", **info: Any) -> FolderLock:
    """Create ``out``, take its lock, and check what it holds: the claim of a run's output folder.

    The lock is taken first (one system call: of two runs claiming one folder at once exactly one
    gets it), then the content is checked under it. A folder holding names other than the
    ``ignore`` d ones (lock files) is refused unless ``overwrite``; with ``overwrite`` the names
    for which ``own_file`` is true (what a ``kind`` writes) are removed, and a folder holding
    anything else is refused. The caller holds the returned lock and releases it.

    Raises
    ------
    FolderBusy
        Another process owns the folder.
    ConfigError
        ``out`` is a file, cannot be created or locked, or holds files (see above).
    """
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot create the folder ({exc.strerror or exc})") from None
    try:
        lock = acquire(out, role=role, **info)
    except FolderBusy:
        raise
    except ConfigError as exc:
        raise ConfigError(f"--out {out}: {exc}") from None
    try:
        present = sorted(p.name for p in out.iterdir() if not ignore(p.name))
        if present and not overwrite:
            raise ConfigError(f"--out {out} already holds {', '.join(present[:6])}{' ...' if len(present) > 6 else ''}"
                              f"; choose a new folder, or pass --overwrite to replace a previous {kind}'s files")
        foreign = [name for name in present if not own_file(name)]
        if foreign:
            raise ConfigError(f"--out {out} holds files that are not a graphfl {kind}'s ({', '.join(foreign[:6])}); "
                              f"--overwrite only replaces {kind} files: choose another folder")
        for name in present:
            path = out / name
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        if present:
            logger.warning("--overwrite: removed the previous %s's files from %s", kind, out)
    except BaseException:
        lock.release()
        raise
    return lock
