"""graphfl's SuperNode entry point: Flower's own SuperNode, with warm ClientApps and short polls.

``python -m graphfl.deploy.supernode [graphfl options] -- <flower-supernode arguments>``

* ``--clientapp-mode cold --polls stock`` execs the stock ``flower-supernode`` unchanged: every
  message starts a ``flwr-clientapp`` process (Flower's default, the fallback).
* ``--clientapp-mode warm`` (default) runs the SuperNode with ``--isolation process`` and starts
  graphfl's warm executor (:mod:`graphfl.deploy.warm`) as its child: ClientApps run in a
  long-lived worker that already holds torch, the data and (on a GPU) its CUDA context.
* ``--polls fast`` (default) replaces the SuperNode main loop's hard-coded sleeps
  (FLOWER_NOTES.md §4a): the 3 s sleep after an empty pull from the SuperLink becomes a short
  back-off (``idle_min`` growing by ``growth`` per empty pull up to ``idle_max``, back to
  ``idle_min`` after every message), the 0.5 s waits for the ClientApp's reply become
  ``reply`` s, and a message object not yet at the SuperLink is retried after 10 ms (doubling,
  at most 0.25 s) instead of 1 s (doubling to 10 s). Each message the SuperNode stores also
  wakes the warm executor through a pipe, so it claims the task at once instead of polling.

The SuperNode itself is Flower's ``flower_supernode()`` running in this process with the
arguments given after ``--``; only the ``time`` name inside ``flwr.supernode.start_client_internal``
and its ``_pull_and_store_message`` and ``pull_objects`` are replaced (wrapped, never edited), after
:func:`graphfl.deploy.flwr_compat.check_supernode_internals` has checked the Flower version and
that those functions still contain the sleeps being replaced.

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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("graphfl.deploy.supernode")

IDLE_SLEEP = 3      # start_client_internal: time.sleep(3) after an empty pull
REPLY_SLEEP = 0.5   # _push_messages: time.sleep(0.5) while waiting for the ClientApp's reply


@dataclass(frozen=True)
class PollPolicy:
    """The SuperNode's waits in fast mode (seconds)."""

    idle_min: float = 0.02
    idle_max: float = 0.25
    growth: float = 1.5
    reply: float = 0.005
    object_backoff: tuple[float, float] = (0.01, 0.25)
    """(initial, cap) retry delay for message objects not yet at the SuperLink (Flower: 1 s, 10 s)."""


class SuperNodeClock:
    """Stands in for the ``time`` module inside ``flwr.supernode.start_client_internal``.

    Every attribute is the real ``time``'s, except ``sleep``: Flower's idle sleep (3 s) becomes
    the current back-off, its reply wait (0.5 s) becomes ``policy.reply``; other durations pass.
    """

    def __init__(self, policy: PollPolicy, real_sleep: Callable[[float], None] = time.sleep) -> None:
        self.policy = policy
        self.idle = policy.idle_min
        self._sleep = real_sleep

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        if seconds == IDLE_SLEEP:
            seconds, self.idle = self.idle, min(self.idle * self.policy.growth, self.policy.idle_max)
        elif seconds == REPLY_SLEEP:
            seconds = self.policy.reply
        self._sleep(seconds)

    def activity(self) -> None:
        """A message arrived: poll fast again."""
        self.idle = self.policy.idle_min


def install_fast_polls(policy: PollPolicy, on_message: Callable[[], None] | None = None,
                       check: bool = True) -> SuperNodeClock:
    """Replace the SuperNode main loop's sleeps (see the module docstring); returns the clock.

    Raises :class:`graphfl.deploy.flwr_compat.FlowerInternalsError` on another Flower (``check``
    is only turned off by tests that stub the wrapped functions).
    """
    from flwr.supernode import start_client_internal as sci

    from graphfl.deploy.flwr_compat import check_supernode_internals
    from graphfl.flowerx.object_io import widen_object_transfers

    if check:
        check_supernode_internals()
    clock = SuperNodeClock(policy)
    original = sci._pull_and_store_message

    def pull_and_store_message(*args: Any, **kwargs: Any) -> int | None:
        run_id = original(*args, **kwargs)
        if run_id is not None:
            clock.activity()
            if on_message is not None:
                on_message()
        return run_id

    original_pull_objects = sci.pull_objects

    def pull_objects(*args: Any, **kwargs: Any) -> dict[str, bytes]:
        kwargs.setdefault("initial_backoff", policy.object_backoff[0])
        kwargs.setdefault("backoff_cap", policy.object_backoff[1])
        return original_pull_objects(*args, **kwargs)

    widen_object_transfers()
    sci.time = clock  # type: ignore[assignment]
    sci._pull_and_store_message = pull_and_store_message
    sci.pull_objects = pull_objects
    return clock


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
    from graphfl.deploy.flwr_compat import FlowerInternalsError, check_version
    from graphfl.deploy.warm import own_log_handler

    own_log_handler(logger)
    args, flower = parse_args(sys.argv[1:] if argv is None else argv)
    if args.clientapp_mode == "cold" and args.polls == "stock":
        exe = Path(sys.executable).with_name("flower-supernode")
        if exe.exists():
            os.execv(str(exe), [str(exe), *flower])
        os.execvp("flower-supernode", ["flower-supernode", *flower])
    try:
        check_version()
    except FlowerInternalsError as exc:
        logger.error("%s", exc)
        return 2
    opts = _flower_options(flower)
    child: ExecutorChild | None = None
    if args.clientapp_mode == "warm":
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
        from flwr.supercore.exit import add_exit_handler
        from flwr.supernode.cli import flower_supernode

        from graphfl.flowerx.handshake_retry import install_on_fleet_connections

        install_on_fleet_connections()   # a TLS handshake the SuperLink cuts short is retried, not fatal

        if child is not None:
            add_exit_handler(child.stop)
        sys.argv = ["flower-supernode", *flower]
        flower_supernode()
    except FlowerInternalsError as exc:
        logger.error("%s", exc)
        return 2
    else:
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
