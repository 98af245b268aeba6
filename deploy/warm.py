"""Warm ClientApp executor: a SuperNode's ClientApps run in one long-lived worker process.

Stock Flower starts a fresh ``flwr-clientapp`` process for every message (Python start-up,
``import torch``, the FAB install and the app load each time; a new CUDA context on a GPU).
Here a SuperNode runs with ``--isolation process`` and this executor takes its tasks instead
of Flower's ``flower-superexec``:

* **executor** (``python -m graphfl.deploy.warm executor ...``, one per SuperNode): claims
  ClientApp tasks from the SuperNode's Runtime API (``AcquireTask``, the same call
  ``flower-superexec`` makes) and hands each task's token to its worker, one task at a time.
  It wakes on a byte from the SuperNode wrapper's notification pipe (``--notify-fd``, see
  :mod:`graphfl.deploy.supernode`) or else polls every ``--poll`` seconds.
* **worker** (its child, started once, restarted only if it dies): imports torch and the
  ClientApp's modules at start-up and, when ``--device`` names a GPU, creates the CUDA context
  once. For each token it does what ``flwr-clientapp`` does (pull the task input and message,
  run the ClientApp, push the reply, push the context) through the Flower seam
  (:class:`graphfl.flowerx.clientapp_runtime.TaskRunner`, Flower's own functions), installing each
  FAB and loading each ClientApp only once per FAB hash, and never exits between messages.

Design choice: a persistent worker rather than a fork-per-message zygote. A CUDA context
cannot cross ``fork`` (a child of a process that initialised CUDA cannot use it), so a zygote
would build a new context for every message on a GPU; the persistent worker also keeps the
task's data (graphfl's partition cache) and needs no fork/exit per message. What a per-message
process gave for free is kept explicitly: every task gets a fresh ``Context`` from the SuperNode
(``context.state`` round-trips through the SuperNode exactly as in cold mode), tasks run one at a
time in arrival order, and the next task is claimed only after the previous one pushed its
context. graphfl's ClientApp derives every random number from (seed, partition, round), so both
modes give the same results (tested).

Failures: an exception in the ClientApp becomes an error reply, as in ``flwr-clientapp``. If the
worker dies in a task (crash, OOM kill), the executor pushes an error reply for the message it
had pulled plus a failed task status, so the server learns at once, and starts a new worker.

Processes: the worker inherits the executor's environment (``GRAPHFL_LAUNCH_ID`` included) and
dies with it (``PR_SET_PDEATHSIG`` and end-of-file on its control pipe); the executor exits when
its SuperNode (``--parent-pid``) goes away, stopping its worker first.

Every Flower internal used here is in :mod:`graphfl.flowerx.clientapp_runtime` (fast path
``warm-clientapp``). Where that fast path is off, graphfl's SuperNode starts no executor (its
ClientApps run as stock ``flwr-clientapp`` processes); an executor or worker started by hand exits
with code 2 after the one log line saying why.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphfl.flowerx import array_copies, clientapp_runtime
from graphfl.flowerx.clientapp_runtime import RuntimeTarget, TaskRunner, claim_task, push_crash_reply
from graphfl.flowerx.object_io import widen_object_transfers

logger = logging.getLogger("graphfl.deploy.warm")

READY_LINE = "graphfl warm worker ready"
"""Logged by the executor once its worker can take tasks (launchers wait for it)."""

DEFAULT_PRELOAD = ("torch", "graphfl.client.app", "graphfl.client.handler", "graphfl.client.training",
                   "graphfl.client.trainers", "graphfl.tasks.registry", "graphfl.tasks.labeled", "sklearn.datasets")
"""Modules the worker imports before its first task (graphfl's ClientApp and what it needs)."""

TASK_START_ENV = "GRAPHFL_TASK_START"
"""Set by the worker for each task: wall-clock time at which the executor claimed it. graphfl's
ClientApp reports ``client_boot_seconds`` from it (claim -> handler) instead of its process age."""

# --------------------------------------------------------------------------------------------
# control channel: JSON lines over a pair of pipes (our own small dicts, never from the network)
# --------------------------------------------------------------------------------------------
class Channel:
    """One end of a JSON-lines link over two pipe file descriptors."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd = read_fd
        self.write_fd = write_fd
        self._buf = b""

    def send(self, doc: dict[str, Any]) -> None:
        data = (json.dumps(doc) + "\n").encode()
        while data:
            n = os.write(self.write_fd, data)
            data = data[n:]

    def recv(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next document, or None after ``timeout`` s. Raises EOFError when the other end closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.read_fd], [], [], wait)
            if not ready:
                return None
            chunk = os.read(self.read_fd, 65536)
            if not chunk:
                raise EOFError("control channel closed")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        doc: dict[str, Any] = json.loads(line)
        return doc

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def own_log_handler(log: logging.Logger) -> None:
    """Send ``log``'s INFO and above to stderr (timestamp, process id) without touching the root
    logger, so Flower's and httpx's logging keep their own settings.
    """
    if not any(getattr(h, "graphfl_own", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s"))
        handler.graphfl_own = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def die_with_parent(sig: int = signal.SIGTERM, expected_parent: int | None = None) -> None:
    """Ask Linux to send ``sig`` to this process when its parent exits (no-op elsewhere)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)  # the parent died before prctl took effect


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def worker_main(args: argparse.Namespace) -> int:
    """Entry of the worker process: preload, report ready, serve tasks until the channel closes."""
    die_with_parent(signal.SIGTERM, expected_parent=args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the executor's business
    chan = Channel(args.control_fd, args.reply_fd)
    t0 = time.monotonic()
    if not clientapp_runtime.available():
        return 2
    widen_object_transfers()
    array_copies.install()
    for name in [m for m in args.preload.split(",") if m]:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            logger.warning("warm worker: cannot preload %s: %s", name, exc)
    cuda = prewarm_device(args.device)
    runner = TaskRunner(RuntimeTarget(args.runtime_api_address, args.insecure, args.root_certificates),
                        report=chan.send)
    chan.send({"op": "ready", "pid": os.getpid(), "startup_seconds": time.monotonic() - t0, "cuda": cuda})
    while True:
        try:
            doc = chan.recv()
        except EOFError:
            return 0
        if doc is None or doc.get("op") == "exit":
            return 0
        if doc.get("op") == "task":
            result = run_task(runner, int(doc["task_id"]), str(doc["token"]), float(doc["acquired_at"]))
            chan.send({"op": "done", **result})


def run_task(runner: TaskRunner, task_id: int, token: str, acquired_at: float) -> dict[str, Any]:
    """One task on ``runner``, with :data:`TASK_START_ENV` set to ``acquired_at`` while it runs."""
    os.environ[TASK_START_ENV] = repr(acquired_at)
    try:
        return {**runner.run(task_id, token), "worker_pid": os.getpid()}
    finally:
        os.environ.pop(TASK_START_ENV, None)


def prewarm_device(device: str | None) -> bool:
    """Run one tiny forward/backward pass (torch's first op costs far more than later ones) on the
    CPU and, when ``device`` asks for a GPU (or is ``auto`` and torch sees one), on the GPU, which
    creates this worker's CUDA context now, once. Returns whether a CUDA context was created.
    """
    import torch

    def step(dev: torch.device) -> None:
        layer = torch.nn.Linear(8, 8).to(dev)
        layer(torch.zeros(2, 8, device=dev)).sum().backward()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    step(torch.device("cpu"))
    torch.set_num_threads(threads)
    if not device or device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return False
    step(torch.device("cuda" if device == "auto" else device))
    torch.cuda.synchronize()
    return True


# --------------------------------------------------------------------------------------------
# executor: claims tasks from the SuperNode and feeds them to its worker
# --------------------------------------------------------------------------------------------
class WorkerDied(RuntimeError):
    """The worker process exited (its exit code is in the message)."""


@dataclass
class WorkerHandle:
    """The executor's side of one worker process."""

    argv: list[str]
    ready_timeout: float = 300.0
    popen: subprocess.Popen[bytes] | None = None
    chan: Channel | None = None
    startup_seconds: float = 0.0

    def start(self) -> None:
        logger.info("starting the warm ClientApp worker")
        c_read, c_write = os.pipe()   # executor -> worker
        r_read, r_write = os.pipe()   # worker -> executor
        argv = [*self.argv, "--control-fd", str(c_read), "--reply-fd", str(r_write), "--parent-pid", str(os.getpid())]
        self.popen = subprocess.Popen(argv, pass_fds=(c_read, r_write), stdin=subprocess.DEVNULL)
        os.close(c_read)
        os.close(r_write)
        self.chan = Channel(r_read, c_write)
        deadline = time.monotonic() + self.ready_timeout
        while True:
            doc = self._recv(min(0.5, max(0.0, deadline - time.monotonic())))
            if doc is not None and doc.get("op") == "ready":
                self.startup_seconds = float(doc.get("startup_seconds", 0.0))
                logger.info("%s (pid %d, started in %.2f s%s)", READY_LINE, self.popen.pid, self.startup_seconds,
                            ", CUDA context created" if doc.get("cuda") else "")
                return
            if time.monotonic() > deadline:
                self.stop()
                raise WorkerDied(f"the warm worker did not get ready within {self.ready_timeout:.0f} s")

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def _recv(self, timeout: float) -> dict[str, Any] | None:
        assert self.chan is not None and self.popen is not None
        try:
            return self.chan.recv(timeout)
        except EOFError:
            code = self.popen.wait(timeout=5)
            raise WorkerDied(f"the warm worker (pid {self.popen.pid}) exited with code {code}") from None

    def run_task(self, task_id: int, token: str, acquired_at: float, keep_going: Callable[[], bool],
                 started: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Hand one task to the worker and wait for its outcome (``started`` sees the pulled message)."""
        assert self.chan is not None
        self.chan.send({"op": "task", "task_id": task_id, "token": token, "acquired_at": acquired_at})
        while True:
            doc = self._recv(0.5)
            if doc is None:
                if not keep_going():
                    raise SystemExit(0)
                continue
            if doc.get("op") == "started":
                started(doc)
            elif doc.get("op") == "done":
                return doc

    def stop(self, grace: float = 3.0) -> None:
        if self.chan is not None:
            with contextlib.suppress(OSError):
                self.chan.send({"op": "exit"})
            self.chan.close()
            self.chan = None
        if self.popen is not None and self.popen.poll() is None:
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.popen.terminate()
                try:
                    self.popen.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    self.popen.kill()
                    self.popen.wait()


@dataclass
class Executor:
    """Claims ClientApp tasks from one SuperNode and runs them on a warm worker."""

    target: RuntimeTarget
    worker_argv: list[str]
    parent_pid: int | None = None
    notify_fd: int | None = None
    poll: float = 0.1
    notify_fallback: float = 60.0
    """Seconds without a notification after which the executor asks for a task anyway: a safety net
    (the pipe keeps every byte written to it). Flower creates a task before it pulls the message's
    objects, so a claim not prompted by the pipe may find them still arriving and the worker then
    retries them; a period shorter than a round can land in that window round after round."""
    trace: Path | None = None
    _stopping: bool = False
    _credits: int = 0

    def keep_going(self) -> bool:
        return not self._stopping and (self.parent_pid is None or pid_alive(self.parent_pid))

    def wait_for_work(self) -> None:
        """Return when a task may be waiting: the SuperNode stored a message (one byte on the
        notification pipe per message, written after the message's objects are in its store),
        or ``notify_fallback`` s passed; without a pipe, after ``poll`` s.
        """
        if self.notify_fd is None:
            time.sleep(self.poll)
            return
        if self._credits > 0:
            return
        ready, _, _ = select.select([self.notify_fd], [], [], self.notify_fallback)
        if ready:
            try:
                data = os.read(self.notify_fd, 4096)
            except BlockingIOError:
                return
            if not data:   # the SuperNode closed its end: poll from now on
                self.notify_fd = None
            self._credits += len(data)

    def serve(self) -> None:
        worker = WorkerHandle(self.worker_argv)
        worker.start()
        client = self.target.client("SuperExec", max_time=10.0)
        try:
            while self.keep_going():
                self.wait_for_work()
                if not self.keep_going():
                    break
                self._credits = max(0, self._credits - 1)
                try:
                    claimed = claim_task(client)
                except Exception as exc:  # noqa: BLE001 - the SuperNode may be restarting or gone
                    if not self.keep_going():
                        break
                    logger.warning("AcquireTask failed: %s", exc)
                    time.sleep(1.0)
                    continue
                if claimed is None:
                    continue
                acquired_at = time.time()
                if not worker.alive():
                    worker.start()
                self._run_one(worker, claimed[0], claimed[1], acquired_at)
        finally:
            client.close()
            worker.stop(grace=1.0)

    def _run_one(self, worker: WorkerHandle, task_id: int, token: str, acquired_at: float) -> None:
        started: dict[str, Any] = {}
        handed = time.time()
        try:
            outcome = worker.run_task(task_id, token, acquired_at, self.keep_going, started.update)
        except WorkerDied as exc:
            reason = f"the warm ClientApp worker died during the task: {exc}"
            logger.error("%s; starting a new worker", reason)
            if started:
                client = self.target.client("flwr-clientapp", token=token, max_time=10.0)
                try:
                    push_crash_reply(client, started, reason)
                except Exception as push_exc:  # noqa: BLE001
                    logger.error("could not report the crash to the SuperNode: %s", push_exc)
                finally:
                    client.close()
            outcome = {"task_id": task_id, "status": "crashed", "error": reason, "times": {}}
            worker.stop()
            worker.start()
        outcome["times"] = {"acquired": acquired_at, "handed": handed, **outcome.get("times", {})}
        if self.trace is not None:
            with self.trace.open("a") as fh:
                fh.write(json.dumps(outcome) + "\n")


def executor_main(args: argparse.Namespace) -> int:
    """Entry of the executor process."""
    if args.parent_pid is not None and args.parent_pid == os.getppid():
        die_with_parent(signal.SIGTERM, expected_parent=args.parent_pid)
    if not clientapp_runtime.available():   # the SuperNode wrapper starts no executor then
        return 2

    def on_signal(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.notify_fd is not None:
        os.set_blocking(args.notify_fd, False)
    worker_argv = [sys.executable, "-m", "graphfl.deploy.warm", "worker",
                   "--runtime-api-address", args.runtime_api_address, "--preload", args.preload]
    worker_argv += ["--insecure"] if args.insecure else []
    worker_argv += ["--root-certificates", args.root_certificates] if args.root_certificates else []
    worker_argv += ["--device", args.device] if args.device else []
    ex = Executor(RuntimeTarget(args.runtime_api_address, args.insecure, args.root_certificates), worker_argv,
                  parent_pid=args.parent_pid, notify_fd=args.notify_fd, poll=args.poll,
                  trace=Path(args.trace) if args.trace else None)
    try:
        ex.serve()
    except WorkerDied as exc:
        logger.error("%s", exc)
        return 1
    return 0


def executor_argv(runtime_api_address: str, *, insecure: bool = True, root_certificates: str | None = None,
                  parent_pid: int | None = None, notify_fd: int | None = None, device: str | None = None,
                  poll: float | None = None, trace: Path | None = None,
                  preload: Sequence[str] = DEFAULT_PRELOAD) -> list[str]:
    """Command line of an executor for the SuperNode whose Runtime API is at ``runtime_api_address``."""
    argv = [sys.executable, "-m", "graphfl.deploy.warm", "executor", "--runtime-api-address", runtime_api_address,
            "--preload", ",".join(preload)]
    argv += ["--insecure"] if insecure else []
    argv += ["--root-certificates", root_certificates] if root_certificates else []
    argv += ["--parent-pid", str(parent_pid)] if parent_pid is not None else []
    argv += ["--notify-fd", str(notify_fd)] if notify_fd is not None else []
    argv += ["--device", device] if device else []
    argv += ["--poll", str(poll)] if poll is not None else []
    argv += ["--trace", str(trace)] if trace is not None else []
    return argv


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``executor`` or ``worker`` and their options."""
    parser = argparse.ArgumentParser(prog="python -m graphfl.deploy.warm",
                                     description="graphfl's warm ClientApp executor (one per SuperNode).")
    sub = parser.add_subparsers(dest="role", required=True)
    for role in ("executor", "worker"):
        p = sub.add_parser(role)
        p.add_argument("--runtime-api-address", required=True, help="the SuperNode's Runtime API HOST:PORT")
        p.add_argument("--insecure", action="store_true", help="plain HTTP to the Runtime API")
        p.add_argument("--root-certificates", default=None, help="CA of a TLS Runtime API")
        p.add_argument("--parent-pid", type=int, default=None, help="exit when this process exits")
        p.add_argument("--device", default=None, help="create the CUDA context at start-up (cuda, cuda:N, auto)")
        p.add_argument("--preload", default=",".join(DEFAULT_PRELOAD), help="modules the worker imports at start-up")
        if role == "executor":
            p.add_argument("--notify-fd", type=int, default=None, help="pipe the SuperNode writes to on new tasks")
            p.add_argument("--poll", type=float, default=0.1, help="AcquireTask poll interval without --notify-fd")
            p.add_argument("--trace", default=None, help="append one JSON line of timings per task to this file")
        else:
            p.add_argument("--control-fd", type=int, required=True)
            p.add_argument("--reply-fd", type=int, required=True)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m graphfl.deploy.warm executor|worker ...``."""
    own_log_handler(logger)
    args = parse_args(argv)
    if args.role == "worker":
        return worker_main(args)
    return executor_main(args)


if __name__ == "__main__":
    sys.exit(main())
