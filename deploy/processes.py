"""Start, watch and reliably stop the OS processes of a local federation.

Every process graphfl starts carries ``GRAPHFL_LAUNCH_ID=<uuid>`` in its environment, and
so do all of its descendants (Flower's SuperExec and the per-message ``flwr-clientapp``
processes, graphfl's warm executors and their workers inherit it). :meth:`ProcessGroup.stop`
sends SIGTERM to the processes it started, waits (bounded), and then kills any process that
still carries the marker *or* descends (by PID, ``/proc/<pid>/stat``) from one it started, so
nothing is left behind, also after Ctrl-C or a failure, and also for a child that cleared its
environment. Descendants are identified by (pid, start time), so a recycled PID is never killed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

MARKER = "GRAPHFL_LAUNCH_ID"

QUIET_FLOWER_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1",
}


def with_interpreter_bin(path: str) -> str:
    """``path`` with the running interpreter's ``bin`` folder on it.

    Flower's processes start others by name (the SuperLink starts ``flower-superexec``, which
    starts ``flwr-serverapp``; a cold SuperNode starts ``flwr-clientapp``). Run as
    ``.venv/bin/graphfl run`` without activating the environment, those names were not on
    ``PATH`` and the SuperLink died with a ``FileNotFoundError`` traceback. In a virtual
    environment its ``bin`` goes first (its commands are the ones that match graphfl's Flower);
    for a system interpreter it is appended when missing, so the order of ``PATH`` is kept.
    """
    here = str(Path(sys.executable).parent)
    parts = [p for p in path.split(os.pathsep) if p]
    if sys.prefix != sys.base_prefix:
        return os.pathsep.join([here, *(p for p in parts if p != here)])
    return os.pathsep.join(parts if here in parts else [*parts, here])


@dataclass
class Managed:
    """A started process and the name it is logged under."""

    name: str
    popen: subprocess.Popen
    log_path: Path


@dataclass
class ProcessGroup:
    """Processes of one launch, sharing a marker and a log folder."""

    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    launch_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    procs: list[Managed] = field(default_factory=list)

    def base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(QUIET_FLOWER_ENV)
        env.update(self.env)
        env[MARKER] = self.launch_id
        env["PATH"] = with_interpreter_bin(env.get("PATH", ""))
        return env

    def start(self, name: str, argv: list[str], cwd: Path | None = None,
              extra_env: dict[str, str] | None = None) -> Managed:
        """Start ``argv`` with :meth:`base_env` (plus ``extra_env``, for this process only), logging to ``<name>.log``."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        fh = log_path.open("ab")
        logger.debug("starting %s: %s", name, " ".join(argv))
        try:
            popen = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**self.base_env(), **(extra_env or {})}, cwd=cwd,
                                     start_new_session=True)
        except FileNotFoundError:
            fh.close()
            raise RuntimeError(f"cannot start {argv[0]!r}: not found on PATH (is graphfl's environment active?)") from None
        fh.close()
        proc = Managed(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def check_alive(self) -> None:
        """Raise if a started process has exited (naming it and the end of its log)."""
        for p in self.procs:
            code = p.popen.poll()
            if code is not None:
                raise RuntimeError(f"{p.name} exited with code {code}; last log lines:\n{tail(p.log_path)}")

    def wait_for(self, what: str, ready: Callable[[], bool], timeout: float, interval: float = 0.1) -> None:
        """Poll ``ready`` until true; fail after ``timeout`` s or when a process dies."""
        deadline = time.monotonic() + timeout
        while not ready():
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready within {timeout:.0f} s")
            time.sleep(interval)

    def stop(self, grace: float = 10.0) -> list[int]:
        """SIGTERM everything, wait up to ``grace`` s, then SIGKILL what carries the marker.

        Teardown is bounded (``grace`` + a few seconds) and is not abandoned by a second Ctrl-C:
        SIGINT is deferred while it runs (in the main thread). Processes still alive afterwards
        are logged as an error with their pids. Returns the pids that had to be killed.
        """
        with deferred_sigint():
            return self._stop(grace)

    def _stop(self, grace: float) -> list[int]:
        tracked: dict[int, int] = {}   # pid -> start time (jiffies since boot)
        roots = [p.popen.pid for p in self.procs]

        def track() -> list[int]:
            """Record live descendants of the started processes; return every tracked or marked pid alive."""
            table = process_table()
            for pid in descendants(roots, table):
                tracked.setdefault(pid, table[pid][1])
            alive = [pid for pid, start in tracked.items() if pid in table and table[pid][1] == start
                     and table[pid][2] != "Z"]
            return sorted(set(alive) | set(marked_pids(self.launch_id)))

        track()
        for p in reversed(self.procs):
            if p.popen.poll() is None:
                try:
                    p.popen.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            left = track()
            if all(p.popen.poll() is not None for p in self.procs) and not left:
                return []
            time.sleep(0.1)
        killed = []
        for pid in track():
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.popen.wait(timeout=2)
            except subprocess.TimeoutExpired:
                p.popen.kill()
        if killed:
            logger.info("killed %d leftover process(es) after %.0f s: %s", len(killed), grace, killed)
        time.sleep(0.1)
        survivors = track()
        if survivors:
            logger.error("processes of this launch survived SIGKILL (pids %s); stop them by hand", survivors)
        return killed


@contextlib.contextmanager
def deferred_sigint() -> Iterator[None]:
    """Ignore Ctrl-C (with a note) while the block runs; restore the previous handler after.

    Only the main thread can set signal handlers; elsewhere the block runs unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(signum: int, frame: object) -> None:
        logger.warning("stopping the run's processes (bounded); please wait")

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def marked_pids(launch_id: str) -> list[int]:
    """Live processes (not zombies) whose environment carries ``GRAPHFL_LAUNCH_ID=launch_id``."""
    return pids_with_env(MARKER, launch_id)


def pids_with_env(name: str, value: str) -> list[int]:
    """Live processes (not zombies) whose environment has ``name=value`` (Linux /proc)."""
    needle = f"{name}={value}".encode()
    me = os.getpid()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            stat = (entry / "stat").read_text()
        except (OSError, PermissionError):
            continue
        state = stat.rsplit(")", 1)[-1].split()[0]
        if state != "Z":
            out.append(int(entry.name))
    return out


def process_table() -> dict[int, tuple[int, int, str]]:
    """``{pid: (parent pid, start time in clock ticks since boot, state)}`` of every process (Linux /proc)."""
    table: dict[int, tuple[int, int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
            table[int(entry.name)] = (int(fields[1]), int(fields[19]), fields[0])
        except (OSError, IndexError, ValueError):
            continue
    return table


def descendants(roots: list[int], table: dict[int, tuple[int, int, str]] | None = None) -> set[int]:
    """PIDs of every live descendant of ``roots`` (the roots themselves excluded)."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a log file (empty if it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
