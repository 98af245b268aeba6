"""graphfl's SuperNode entry point: Flower's own SuperNode, with warm ClientApps and short polls.

``python -m graphfl.deploy.supernode [graphfl options] -- <flower-supernode arguments>``

* ``--clientapp-mode cold --polls stock`` execs the stock ``flower-supernode`` unchanged: every
  message starts a ``flwr-clientapp`` process (Flower's default, the fallback).
* ``--clientapp-mode warm`` (default) runs the SuperNode with ``--isolation process`` and starts
  graphfl's warm executor (:mod:`graphfl.deploy.warm`) as its child: ClientApps run in a
  long-lived worker that already holds torch, the data and (on a GPU) its CUDA context.
* ``--polls fast`` (default) replaces the SuperNode main loop's hard-coded sleeps by short
  back-offs (:mod:`graphfl.flowerx.supernode_polls`). Each message the SuperNode stores also
  wakes the warm executor through a pipe, so it claims the task at once instead of polling.

The SuperNode itself is Flower's ``flower_supernode()`` running in this process with the
arguments given after ``--``. Every Flower internal it touches goes through the Flower seam
(:mod:`graphfl.flowerx`): each fast path (``warm-clientapp``, ``supernode-fast-polls``,
``object-io-threads``, ``object-hash-once``, ``fleet-handshake-retry``) is on where the seam was verified on the
installed Flower, and otherwise off with one log line, the SuperNode then behaving as stock
Flower's (warm mode off: no executor, ClientApps as ``flwr-clientapp`` processes, and
:data:`WARM_OFF_LINE` logged). When Flower's SuperNode entry point itself cannot be imported,
this process execs the stock ``flower-supernode`` command with the same arguments.

Exit: when Flower's SuperNode stops (a signal, or its main loop failing), this process exits
within :data:`EXIT_GRACE` s even if a thread of Flower's is still running (its Runtime HTTP API
thread outlives a failed main loop and would keep the interpreter waiting forever at shutdown),
so a launcher or systemd sees the exit and can restart it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from graphfl.deploy.flower_malloc import keep_to_this_process
from graphfl.flowerx import clientapp_runtime, entrypoints
from graphfl.flowerx.handshake_retry import install_on_fleet_connections
from graphfl.flowerx.object_io import widen_object_transfers
from graphfl.flowerx.supernode_polls import PollPolicy, install_fast_polls

logger = logging.getLogger("graphfl.deploy.supernode")

WARM_OFF_LINE = "graphfl warm workers off"
"""Logged instead of the executor's ready line when the ``warm-clientapp`` fast path is off here
(launchers waiting for a warm SuperNode accept either)."""


def _flower_options(flower_args: Sequence[str]) -> argparse.Namespace:
    """The few ``flower-supernode`` options the executor needs to know (Runtime API address, TLS)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--isolation", default="subprocess")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9094)
    p.add_argument("--ssl-certfile", default=None)
    p.add_argument("--ssl-ca-certfile", default=None)
    ns, _ = p.parse_known_args(list(flower_args))
    return ns


def runtime_api_address(host: str, port: int) -> str:
    """Where a local executor reaches the SuperNode's Runtime API (a wildcard bind -> loopback)."""
    if host in ("0.0.0.0", "", "::", "[::]"):
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class ExecutorChild:
    """The warm executor started as a child of this SuperNode process."""

    def __init__(self, argv_builder: Callable[[int | None], list[str]], notify: bool) -> None:
        self.notify_r: int | None = None
        self.notify_w: int | None = None
        if notify:
            self.notify_r, self.notify_w = os.pipe()
            os.set_blocking(self.notify_w, False)
        argv = argv_builder(self.notify_r)
        self.popen = subprocess.Popen(argv, pass_fds=(self.notify_r,) if self.notify_r is not None else (),
                                      stdin=subprocess.DEVNULL)
        if self.notify_r is not None:
            os.close(self.notify_r)

    def notify(self) -> None:
        if self.notify_w is None:
            return
        try:
            os.write(self.notify_w, b"\x01")
        except BlockingIOError:
            pass  # the executor has unread notifications already
        except OSError:
            self.notify_w = None  # the executor is gone

    def stop(self, grace: float = 3.0) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)
        if self.notify_w is not None:
            with contextlib.suppress(OSError):
                os.close(self.notify_w)
            self.notify_w = None


def split_at_dashes(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``[ours] -- [flower's]`` -> ``(ours, flower's)``; without ``--`` everything is Flower's."""
    argv = list(argv)
    if "--" not in argv:
        return [], argv
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def without_isolation(flower_args: Sequence[str]) -> list[str]:
    """``flower_args`` less any ``--isolation X`` / ``--isolation=X`` (Flower's default: subprocess)."""
    out: list[str] = []
    skip = False
    for a in flower_args:
        if skip:
            skip = False
        elif a == "--isolation":
            skip = True
        elif not a.startswith("--isolation="):
            out.append(a)
    return out


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Graphfl's options before ``--``; Flower's ``flower-supernode`` arguments after it."""
    ours, flower = split_at_dashes(argv)
    p = argparse.ArgumentParser(prog="python -m graphfl.deploy.supernode",
                                description="Flower SuperNode with graphfl's warm ClientApp executor and short polls.")
    p.add_argument("--clientapp-mode", choices=("warm", "cold"), default="warm")
    p.add_argument("--polls", choices=("fast", "stock"), default="fast")
    p.add_argument("--device", default=None, help="warm: create the worker's CUDA context at start-up")
    p.add_argument("--executor-poll", type=float, default=0.1, help="warm + stock polls: AcquireTask interval")
    p.add_argument("--trace", default=None, help="warm: JSON lines of per-task timings")
    p.add_argument("--idle-min", type=float, default=PollPolicy.idle_min)
    p.add_argument("--idle-max", type=float, default=PollPolicy.idle_max)
    p.add_argument("--reply-poll", type=float, default=PollPolicy.reply)
    return p.parse_args(ours), flower


def main(argv: Sequence[str] | None = None) -> int:
    """Run one SuperNode (see the module docstring)."""
    from graphfl.deploy.warm import own_log_handler

    own = keep_to_this_process(os.environ)   # allocator settings for this process, not its ClientApps'
    own_log_handler(logger)
    args, flower = parse_args(sys.argv[1:] if argv is None else argv)
    entry = None if args.clientapp_mode == "cold" and args.polls == "stock" else entrypoints.supernode_entry()
    if own:
        logger.info("allocator: %s %s", ", ".join(f"{n}={v}" for n, v in own.items()),
                    "for this process only" if entry is not None else
                    "not applied: this process runs the stock flower-supernode, whose children would inherit it")
    if entry is None:
        entrypoints.exec_stock("flower-supernode", flower)
    assert entry is not None
    opts = _flower_options(flower)
    child: ExecutorChild | None = None
    if args.clientapp_mode == "warm" and not clientapp_runtime.available():
        logger.info("%s: ClientApps run as stock flwr-clientapp processes", WARM_OFF_LINE)
        flower = without_isolation(flower)   # no executor would serve --isolation process
    elif args.clientapp_mode == "warm":
        if opts.isolation != "process":
            if any(a == "--isolation" or a.startswith("--isolation=") for a in flower):
                logger.error("--clientapp-mode warm runs the SuperNode with --isolation process, not %s", opts.isolation)
                return 2
            flower = [*flower, "--isolation", "process"]
        from graphfl.deploy.warm import executor_argv

        address = runtime_api_address(opts.host, opts.port)
        tls = opts.ssl_certfile is not None

        def build(notify_fd: int | None) -> list[str]:
            return executor_argv(address, insecure=not tls, root_certificates=opts.ssl_ca_certfile,
                                 parent_pid=os.getpid(), notify_fd=notify_fd, device=args.device,
                                 poll=args.executor_poll, trace=Path(args.trace) if args.trace else None)

        child = ExecutorChild(build, notify=args.polls == "fast")
    try:
        if args.polls == "fast":
            install_fast_polls(PollPolicy(args.idle_min, args.idle_max, PollPolicy.growth, args.reply_poll),
                               on_message=child.notify if child is not None else None)
        widen_object_transfers()
        install_on_fleet_connections()   # a TLS handshake the SuperLink cuts short is retried, not fatal
        if child is not None:
            entrypoints.add_exit_handler(child.stop)
        entrypoints.run_entry(entry, "flower-supernode", flower)
        # A stopped SuperNode leaves through sys.exit (a signal: flwr_exit); returning means its
        # main loop failed (Flower logged why and returns 0): exit non-zero so a supervisor
        # (systemd Restart=on-failure, a launcher) sees a failure and restarts it.
        logger.error("Flower's SuperNode main loop ended without a stop signal (see the error above); exit code 1")
        return 1
    finally:
        if child is not None:
            child.stop()


EXIT_GRACE = 10.0
"""Seconds this process may take to shut down after its SuperNode stopped, before it exits hard."""


def exit_within(code: int, grace: float = EXIT_GRACE) -> None:
    """``sys.exit(code)``, but the process is gone ``grace`` s later at the latest.

    Python's shutdown waits for every non-daemon thread; Flower's SuperNode leaves its Runtime
    HTTP API thread (uvicorn) running when its main loop fails, so a plain exit would hang there.
    A daemon timer ends the process with ``os._exit(code)`` after ``grace`` s (logs flushed first).
    """
    import threading

    def hard_exit() -> None:
        logger.error("still shutting down after %.0f s (a thread did not stop); exiting with code %d", grace, code)
        logging.shutdown()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(grace, hard_exit)
    timer.daemon = True
    timer.start()
    sys.exit(code)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


if __name__ == "__main__":
    try:
        status = main()
    except SystemExit as stop:   # Flower ends its SuperNode with sys.exit (flwr_exit)
        status = _exit_code(stop)
    except Exception:   # logged with its traceback; the exit below stays bounded
        logger.exception("the SuperNode failed")
        status = 1
    exit_within(status)
