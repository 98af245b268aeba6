"""Benchmark ``faults``: a table of faults against both runtimes on 127.0.0.1.

Every row injects one fault into real processes and reports what happened: the *outcome*, the
*time to recover* (fault -> the system works normally again, or -> the run ended with its
status written), *what was lost*, the *status the results files recorded*, and the *bound* it
was checked against. A row is green when every one of its checks held; a row whose check failed
stays red in the results, and an exception inside a row makes it red with the error (the suite
goes on). Every wait is bounded, so a hang shows up as a red row, not as a hung bench.

Flower rows (``graphfl run``'s local deployment through :func:`graphfl.deploy.run.run_experiment`:
a TLS SuperLink and warm SuperNodes, FedAvg on digits; the faults are sent to the real processes
from the progress callback):

* ``flower-dropout``: a SuperNode is SIGKILLed while a round runs; that round closes with the
  others (no reply within ``round-timeout``, recorded as the client's failure), the run completes.
* ``flower-restart``: a SuperNode is killed and a new one started for its partition; it is joined
  again (new node id mapped back to the partition) and a later round has every client.
* ``flower-straggler``: a SuperNode is SIGSTOPped for longer than ``round-timeout``; the round
  closes at the deadline, the straggler is recorded, after SIGCONT a later round has every client.
* ``flower-superlink-kill``: the SuperLink is SIGKILLed mid-run; ``run.json`` says ``failed`` with
  the reason, the launcher returns within the bound, no process is left.
* ``flower-superlink-resume``: the same kill, then ``graphfl run --resume DIR``; reported as
  ``not available`` while ``graphfl run`` has no ``--resume`` (read from ``graphfl run --help``).
* ``flower-concurrent-resume``: ``graphfl run --resume DIR`` while the run in ``DIR`` is alive;
  refused with the folder lock's error naming the owner, the run completes and its ``run.json``
  records no resume.

p2p rows, real peer processes (``graphfl peer``, DFL-GT on ``linreg``, a ring, mutual TLS):

* ``p2p-kill-resume``: a peer is SIGKILLed, its neighbours skip it within the round deadline, it
  is restarted with ``--resume`` from its checkpoint and heard again; every peer finishes.
* ``p2p-sigstop``: a peer is SIGSTOPped past the deadline, then SIGCONT; it catches up, every
  peer finishes.
* ``p2p-partition``: every link between the groups {even ids} and {odd ids} of the ring is cut for
  4 s through :mod:`graphfl.bench.linkemu` (one proxy in front of each peer, peers bound with
  ``graphfl peer --listen``), then healed; each peer trains alone meanwhile, then hears its
  neighbours again and every peer finishes.

p2p rows against one peer's real receive stack (:class:`graphfl.p2p.hostile.TargetPeer`:
gRPC server, mutual TLS, mailbox, codec — the code every peer process runs), with crafted frames
from other peers' valid certificates:

* ``p2p-messages``: duplicated, reordered, late and far-future messages;
* ``p2p-flood``: a flood of invalid messages from a stranger and a neighbour;
* ``p2p-oversized``: a header declaring a 2 GB tensor;
* ``p2p-idle-streams``: twelve idle streams held open;
* ``p2p-huge-values``: a neighbour sending values that overflow when mixed.

p2p rows on the socket data path (``data-path = "socket"``, fixed data ports, peer processes):

* ``p2p-socket-flood``: a stranger without a certificate holds idle and trickling connections on
  every peer's data port from before the peers start; one peer is restarted under the flood. No
  round lacks a neighbour because of it, and the log grows by rate-limited summaries only.
* ``p2p-fixed-port-restart``: a peer with fixed ports is SIGKILLed and started again at once
  (its old connections still hold the ports); it binds and is heard again within the bound.

In those rows *nothing lost* means the honest neighbour's message of the same round arrived,
in time and intact.

``run(quick, seed, out, rows=None)`` writes ``<out>/faults.{json,md,png}``; ``rows`` picks rows
by name (the CI test runs a subset). The full form runs more rounds and peers.

On the benchmark harness (:mod:`graphfl.bench.harness`) in its measurement mode (``cache="none"``):
methods = the rows (one fault scenario each), one point (the form), one repeat (the run's seed),
one cell per row (:func:`run_row`), metrics = time to recover, its bound and their ratio; a row's
checks are its cell's outcome: a red row is a failed cell whose reason names the checks that
failed (or the error), a row that is not available a failed cell whose reason says why (the
``rows`` and ``summary`` keep green / red / not available apart). There is nothing to pair and
nothing to average: the harness gives the suite the common layout, the estimate and the
measurement-mode statement (a row's outcome belongs to the processes of that run, nothing is
cached). What this module adds: the rows themselves, their checks, the table of outcomes and the
recover-vs-bound plot; after every row the rows measured so far are written (an interrupted suite
keeps them).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from graphfl.common.config import ConfigError, parse_run_config
from graphfl.common.envinfo import env_info
from graphfl.common.results import markdown_table, write_json
from graphfl.deploy.federation import FederationError, LocalFederation
from graphfl.deploy.p2p_launch import PeerProcesses, prepare_network
from graphfl.deploy.processes import pids_with_env
from graphfl.deploy.run import run_experiment
from graphfl.p2p import hostile
from graphfl.p2p.proto import graphfl_p2p_pb2 as pb

from .harness import Bench, Cell, Metric, run_bench
from .report import build_doc
from .report import write_report as write_bench_report

logger = logging.getLogger(__name__)

NAME = "faults"


@dataclass
class Row:
    """One fault and what happened (see the module docstring for the columns)."""

    name: str
    runtime: str
    fault: str
    outcome: str = ""
    recover_s: float | None = None
    bound_s: float | None = None
    lost: str = ""
    status: str = ""
    checks: list[dict[str, Any]] = field(default_factory=list)
    green: bool | None = None
    """``True`` every check held, ``False`` one failed (or the row raised), ``None`` not available."""
    seconds: float = 0.0
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def check(self, what: str, ok: bool, got: Any = None) -> bool:
        """Record one check (``what`` states the rule, ``got`` what was measured)."""
        self.checks.append({"check": what, "ok": bool(ok), "got": got})
        return bool(ok)

    def finish(self) -> None:
        """Green when there were checks and all held (an error makes the row red)."""
        if self.green is None and (self.checks or self.error):
            self.green = self.error is None and all(c["ok"] for c in self.checks)


@dataclass(frozen=True)
class Scale:
    """Sizes of the quick and the full form."""

    flower_nodes: int
    flower_rounds: int
    round_timeout: float
    peers: int
    p2p_rounds: int
    flood: int


QUICK = Scale(flower_nodes=2, flower_rounds=4, round_timeout=8.0, peers=4, p2p_rounds=300, flood=200)
FULL = Scale(flower_nodes=4, flower_rounds=8, round_timeout=15.0, peers=6, p2p_rounds=600, flood=2000)


def wait_for(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> float:
    """Poll ``cond`` until true; returns the monotonic time it became true. Raises ``TimeoutError``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return time.monotonic()
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


# -- Flower -------------------------------------------------------------------------------------


@dataclass
class FlowerRun:
    """One ``graphfl run`` (local deployment) with a hook per round event; what it wrote."""

    doc: dict[str, Any]
    error: str | None
    wall_s: float
    events: list[tuple[float, dict[str, Any]]]
    leftover_pids: list[int]


def flower_values(scale: Scale, out: Path, seed: int, **extra: Any) -> dict[str, Any]:
    """Run config of the Flower rows: FedAvg on digits, small, short round deadline."""
    return {"strategy": "fedavg", "task": "digits", "engine": "local-deployment", "nodes": scale.flower_nodes,
            "rounds": scale.flower_rounds, "train.local-steps": 5, "train.lr": 0.1, "seed": seed,
            "round-timeout": scale.round_timeout, "connect-timeout": 120, "out-dir": str(out), **extra}


def run_flower(values: dict[str, Any], on_round: Callable[[int, LocalFederation], None],
               run_timeout: float) -> FlowerRun:
    """``graphfl run`` with warm SuperNodes; ``on_round(r, fed)`` after each round event (main thread)."""
    fed_box: list[LocalFederation] = []
    events: list[tuple[float, dict[str, Any]]] = []

    def on_event(ev: dict[str, Any]) -> None:
        events.append((time.monotonic(), ev))
        if ev.get("event") == "round" and fed_box:
            on_round(int(ev.get("round", 0)), fed_box[0])

    out = Path(values["out-dir"])
    t0 = time.monotonic()
    error = None
    try:
        run_experiment(parse_run_config(values), on_event, run_timeout=run_timeout, clientapp_mode="warm",
                       on_federation=fed_box.append)
    except (FederationError, TimeoutError, ConfigError, RuntimeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    wall = time.monotonic() - t0
    try:
        doc = json.loads((out / "run.json").read_text())
    except (OSError, ValueError) as exc:
        doc = {"status": f"no readable run.json ({exc})", "methods": {}}
    leftover = pids_with_env("FLWR_HOME", str((out / ".flwr").resolve()))
    return FlowerRun(doc, error, wall, events, leftover)


def _curve(doc: dict[str, Any]) -> list[dict[str, Any]]:
    methods = doc.get("methods") or {}
    return list(next(iter(methods.values()))["curve"]) if methods else []


def _node(fed: LocalFederation, name: str) -> subprocess.Popen[bytes]:
    return next(p.popen for p in fed.group.procs if p.name == name)


def _signal_group(popen: subprocess.Popen[bytes], sig: int) -> None:
    """``sig`` to the process group of a started process (a SuperNode and its warm worker)."""
    try:
        os.killpg(popen.pid, sig)
    except ProcessLookupError:
        pass


def _round_times(run: FlowerRun) -> dict[int, float]:
    return {int(ev["round"]): t for t, ev in run.events if ev.get("event") == "round"}


def first_failed_round(curve: Sequence[dict[str, Any]], client: int, after: int = 0) -> int | None:
    """The first round ``> after`` whose ``failed`` names ``client``."""
    return next((int(r["round"]) for r in curve if r["round"] > after and str(client) in (r.get("failed") or {})), None)


def _round_deadlines(row: Row, curve: Sequence[dict[str, Any]], bound: float) -> None:
    """Check that no round took longer than ``bound`` (its phases' deadlines plus slack)."""
    slowest = max((float(r.get("seconds") or 0.0) for r in curve), default=0.0)
    row.check(f"no round took longer than {bound:g} s (its deadlines + slack)", slowest <= bound, round(slowest, 2))


def _flower_common(row: Row, run: FlowerRun, rounds: int, expect_completed: bool = True) -> list[dict[str, Any]]:
    curve = _curve(run.doc)
    got_rounds = [r["round"] for r in curve]
    row.status = str(run.doc.get("status"))
    if expect_completed:
        row.check("run.json status is 'completed'", run.doc.get("status") == "completed", run.doc.get("status"))
        row.check("every round 0..R is in run.json", got_rounds == list(range(rounds + 1)), got_rounds)
        missing = sorted(set(range(rounds + 1)) - set(got_rounds))
        row.lost = "nothing (every round recorded)" if not missing else f"rounds {missing} missing from run.json"
    row.check("no process of the deployment left", run.leftover_pids == [], run.leftover_pids)
    row.details.update({"wall_s": run.wall_s, "error": run.error,
                        "clients_ok": {r["round"]: r.get("clients_ok") for r in curve},
                        "failed": {r["round"]: r["failed"] for r in curve if r.get("failed")},
                        "round_seconds": {r["round"]: r.get("seconds") for r in curve}})
    return curve


DROPOUT_EXTRA_ROUNDS = 6
"""Rounds ``flower-dropout`` runs beyond the scale's, so the kill never lands after the last round began."""


def flower_dropout(out: Path, scale: Scale, seed: int) -> Row:
    """Kill SuperNode ``nodes-1`` (SIGKILL, its process group) right after round 1 ends, i.e. during round 2."""
    row = Row("flower-dropout", "flower", "client dropout mid-round: SuperNode SIGKILLed during round 2")
    victim = scale.flower_nodes - 1
    killed: dict[str, float] = {}

    def on_round(r: int, fed: LocalFederation) -> None:
        if r == 1 and not killed:
            _signal_group(_node(fed, f"supernode-{victim}"), signal.SIGKILL)
            killed["t"] = time.monotonic()

    rt = scale.round_timeout
    bound = 2 * rt + 15.0  # the round with the dead node: a train and an evaluate phase, each at most round-timeout
    # the kill follows the round-1 event, which the launcher reads from progress.jsonl while the next rounds
    # (about 0.5 s each) go on: DROPOUT_EXTRA_ROUNDS more rounds keep a round after the kill in the run
    rounds = scale.flower_rounds + DROPOUT_EXTRA_ROUNDS
    run = run_flower(flower_values(scale, out, seed, rounds=rounds), on_round,
                     run_timeout=120 + (rounds + 2) * 2 * rt)
    curve = _flower_common(row, run, rounds)
    times = _round_times(run)
    row.bound_s = bound
    hit = first_failed_round(curve, victim, after=1)
    if killed and hit is not None and hit in times:
        row.recover_s = times[hit] - killed["t"]
    row.check(f"a round after the kill records client {victim} as failed", hit is not None, hit)
    row.check(f"that round closed within {bound:g} s of the kill", row.recover_s is not None and row.recover_s <= bound,
              row.recover_s)
    _round_deadlines(row, curve, bound)
    ok_then = curve[hit].get("clients_ok") if hit is not None and hit < len(curve) else None
    row.check("that round finished with the other clients", ok_then == scale.flower_nodes - 1, ok_then)
    why = (curve[hit].get("failed") or {}).get(str(victim)) if hit is not None and hit < len(curve) else None
    row.outcome = f"round {hit} closed without client {victim} ({why}); run {run.doc.get('status')}"
    return row


def flower_restart(out: Path, scale: Scale, seed: int) -> Row:
    """Kill SuperNode 1 after round 1 and start a new (warm) one for partition 1."""
    row = Row("flower-restart", "flower", "SuperNode killed after round 1 and restarted")
    # the new SuperNode's warm worker loads torch while the run goes on: 30 s on an idle 2-core machine, 61 s
    # measured under load, and each round without the node lasts round-timeout; the run must outlast that
    rounds = scale.flower_rounds + 12
    marks: dict[str, float] = {}

    def on_round(r: int, fed: LocalFederation) -> None:
        if r == 1 and "kill" not in marks:
            node = _node(fed, "supernode-1")
            _signal_group(node, signal.SIGKILL)
            node.wait(10)
            marks["kill"] = time.monotonic()
            fed.start_supernode(1, name="supernode-1b")

    rt = scale.round_timeout
    bound = 120.0 + 2 * rt  # start-up of the new SuperNode and its warm worker (<= 120 s), registration, join, a round
    run = run_flower(flower_values(scale, out, seed, rounds=rounds), on_round,
                     run_timeout=120 + (rounds + 2) * 2 * rt)
    curve = _flower_common(row, run, rounds)
    times = _round_times(run)
    hit = first_failed_round(curve, 1, after=1) or 1
    back = [r["round"] for r in curve[hit + 1:] if r.get("clients_ok") == scale.flower_nodes and not r.get("failed")]
    row.bound_s = bound
    if back and "kill" in marks:
        row.recover_s = times.get(back[0], marks["kill"]) - marks["kill"]
    row.check("a round after the kill records client 1 as failed", first_failed_round(curve, 1, after=1) is not None,
              hit)
    row.check("a later round has every client again (the new node mapped back to partition 1)", bool(back), back)
    row.check(f"back within {bound:g} s of the kill", row.recover_s is not None and row.recover_s <= bound,
              row.recover_s)
    _round_deadlines(row, curve, 2 * rt + 15.0)
    row.outcome = (f"partition 1 failed in round {hit}, back in round {back[0]}" if back
                   else "partition 1 never came back") + f"; run {run.doc.get('status')}"
    return row


def flower_straggler(out: Path, scale: Scale, seed: int) -> Row:
    """SIGSTOP SuperNode 1 after round 1 for ``round-timeout + 5`` s, then SIGCONT."""
    row = Row("flower-straggler", "flower", "straggler: SuperNode SIGSTOPped past round-timeout, then SIGCONT")
    rt = scale.round_timeout
    stop_s = rt + 5.0
    rounds = scale.flower_rounds + 2
    marks: dict[str, float] = {}
    timers: list[threading.Timer] = []

    def on_round(r: int, fed: LocalFederation) -> None:
        if r == 1 and "stop" not in marks:
            node = _node(fed, "supernode-1")
            _signal_group(node, signal.SIGSTOP)
            marks["stop"] = time.monotonic()

            def cont() -> None:
                _signal_group(node, signal.SIGCONT)
                marks["cont"] = time.monotonic()

            timer = threading.Timer(stop_s, cont)
            timer.start()
            timers.append(timer)

    bound = 2 * rt + 15.0
    try:
        run = run_flower(flower_values(scale, out, seed, rounds=rounds), on_round,
                         run_timeout=120 + (rounds + 2) * 2 * rt)
    finally:
        for timer in timers:
            timer.cancel()
    curve = _flower_common(row, run, rounds)
    times = _round_times(run)
    row.bound_s = bound
    hit = first_failed_round(curve, 1, after=1)
    if "stop" in marks and hit is not None and hit in times:
        row.recover_s = times[hit] - marks["stop"]
    row.check("a round during the stop records client 1 as failed", hit is not None, hit)
    row.check(f"that round closed at its deadline (within {bound:g} s of SIGSTOP)",
              row.recover_s is not None and row.recover_s <= bound, row.recover_s)
    _round_deadlines(row, curve, bound)
    back = [r["round"] for r in curve[(hit or 1) + 1:] if r.get("clients_ok") == scale.flower_nodes and not r.get("failed")]
    row.check("after SIGCONT a later round has every client", bool(back), back)
    why = (curve[hit].get("failed") or {}).get("1") if hit is not None else None
    row.outcome = f"round {hit} closed without client 1 ({why}); " + \
        (f"client 1 back in round {back[0]}" if back else "client 1 never came back")
    return row


def flower_superlink_kill(out: Path, scale: Scale, seed: int) -> Row:
    """SIGKILL the SuperLink after round 1."""
    row = Row("flower-superlink-kill", "flower", "SuperLink SIGKILLed after round 1")
    marks: dict[str, float] = {}

    def on_round(r: int, fed: LocalFederation) -> None:
        if r == 1 and "kill" not in marks:
            fed.group.procs[0].popen.kill()
            marks["kill"] = time.monotonic()

    bound = 30.0
    t0 = time.monotonic()
    run = run_flower(flower_values(scale, out, seed), on_round,
                     run_timeout=120 + (scale.flower_rounds + 2) * 2 * scale.round_timeout)
    _flower_common(row, run, scale.flower_rounds, expect_completed=False)
    row.bound_s = bound
    if "kill" in marks:
        row.recover_s = t0 + run.wall_s - marks["kill"]
    row.check(f"the launcher returned within {bound:g} s of the kill", row.recover_s is not None and row.recover_s <= bound,
              row.recover_s)
    row.check("run.json says 'failed'", run.doc.get("status") == "failed", run.doc.get("status"))
    reason = str(run.doc.get("error") or "")
    row.check("run.json names the reason (the SuperLink exited)", "SuperLink" in reason, reason[:200])
    kept = [r["round"] for r in _curve(run.doc)]
    row.check("rounds finished before the kill are kept", kept[:2] == [0, 1], kept)
    row.lost = f"rounds after {max(kept, default=-1)} never ran (run failed; rounds {kept} kept in run.json)"
    row.outcome = f"run failed: {reason.splitlines()[0][:120] if reason else 'no reason recorded'}"
    return row


def run_has_resume() -> bool:
    """Whether ``graphfl run`` takes ``--resume`` (read from its ``--help``, never guessed)."""
    try:
        res = subprocess.run([sys.executable, "-m", "graphfl.cli", "run", "--help"], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("could not read graphfl run --help: %s", exc)
        return False
    return "--resume" in res.stdout


def flower_superlink_resume(out: Path, scale: Scale, seed: int) -> Row:
    """SuperLink killed after round 2, then ``graphfl run --resume DIR``: every round once, status completed."""
    row = Row("flower-superlink-resume", "flower", "SuperLink killed after round 2, run resumed with --resume")
    if not run_has_resume():
        row.outcome = "not available: graphfl run has no --resume"
        return row
    marks: dict[str, float] = {}

    def on_round(r: int, fed: LocalFederation) -> None:
        if r == 2 and "kill" not in marks:
            fed.group.procs[0].popen.kill()
            marks["kill"] = time.monotonic()

    rounds = scale.flower_rounds
    first = run_flower(flower_values(scale, out, seed), on_round, run_timeout=120 + (rounds + 2) * 20)
    row.details["first_status"] = first.doc.get("status")
    bound = 120 + (rounds + 2) * 2 * scale.round_timeout
    t0 = time.monotonic()
    try:
        res = subprocess.run([sys.executable, "-m", "graphfl.cli", "run", "--resume", str(out),
                              "--clientapp-mode", "warm"], capture_output=True, text=True, timeout=bound,
                             stdin=subprocess.DEVNULL)
        row.details["resume_rc"] = res.returncode
        row.details["resume_stderr"] = res.stderr[-2000:]
    except subprocess.TimeoutExpired:
        row.details["resume_rc"] = None
    row.recover_s = time.monotonic() - t0
    row.bound_s = bound
    try:
        doc = json.loads((out / "run.json").read_text())
    except (OSError, ValueError):
        doc = {}
    got = [r["round"] for r in _curve(doc)]
    row.status = str(doc.get("status"))
    row.check("the resumed run completed", doc.get("status") == "completed", doc.get("status"))
    row.check("every round 0..R exactly once", got == list(range(rounds + 1)), got)
    row.check(f"resume finished within {bound:g} s", row.details.get("resume_rc") is not None, row.recover_s)
    row.lost = "nothing" if got == list(range(rounds + 1)) else f"rounds recorded: {got}"
    row.outcome = f"resumed run {doc.get('status')}"
    return row


def flower_concurrent_resume(out: Path, scale: Scale, seed: int) -> Row:
    """After round 1, ``graphfl run --resume DIR`` on the live run's folder (a real CLI process)."""
    row = Row("flower-concurrent-resume", "flower", "graphfl run --resume DIR while the run in DIR is alive")
    attempt: dict[str, Any] = {}
    bound = 120.0  # a refused CLI start: interpreter, imports, the lock

    def on_round(r: int, fed: LocalFederation) -> None:
        if r != 1 or attempt:
            return
        before = (out / "config.json").read_bytes()
        t0 = time.monotonic()
        log = out.parent / "concurrent-resume.log"
        with log.open("w") as fh:  # a file, not a pipe: a wrongly accepted resume would start Flower processes
            try:
                rc: int | None = subprocess.run(
                    [sys.executable, "-m", "graphfl.cli", "run", "--resume", str(out), "--rounds",
                     str(scale.flower_rounds + 2)], stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    timeout=bound, env={**os.environ, "COLUMNS": "400", "NO_COLOR": "1"}).returncode
            except subprocess.TimeoutExpired:
                rc = None
        attempt.update(rc=rc, seconds=time.monotonic() - t0, text=" ".join(log.read_text().split()),
                       config_unchanged=(out / "config.json").read_bytes() == before)

    run = run_flower(flower_values(scale, out, seed), on_round,
                     run_timeout=120 + (scale.flower_rounds + 2) * 2 * scale.round_timeout + bound)
    _flower_common(row, run, scale.flower_rounds)
    text = str(attempt.get("text", ""))
    row.recover_s = attempt.get("seconds")
    row.bound_s = bound
    row.details["resume_rc"] = attempt.get("rc")
    row.details["resume_output"] = text[-1500:]
    row.check("a --resume was tried while the run was alive (after round 1)", bool(attempt), sorted(attempt))
    row.check(f"it was refused within {bound:g} s (exit code not 0)", attempt.get("rc") not in (0, None),
              attempt.get("rc"))
    row.check("its error is the folder lock's, naming the folder and the owner (this launcher's pid)",
              "in use by another graphfl process" in text and f"pid {os.getpid()}" in text and str(out) in text,
              text[-300:])
    row.check("config.json untouched by the refused resume", attempt.get("config_unchanged") is True,
              attempt.get("config_unchanged"))
    resumes = {k: run.doc[k] for k in ("resumes", "resumed_from_round") if k in run.doc}
    row.check("run.json records no resume", resumes == {}, resumes)
    row.outcome = (f"--resume refused (exit {attempt.get('rc')}): {text[text.find('error'):][:140]}; "
                   f"run {run.doc.get('status')}") if attempt else "no --resume was tried"
    return row


# -- p2p: peer processes ------------------------------------------------------------------------


ROUND_TIMEOUT = 2.0
MAX_AHEAD = 4


def _p2p_network(out: Path, scale: Scale, seed: int, **extra: Any) -> Path:
    return prepare_network(out, "ring", scale.peers, {
        "algorithm": "dfl-gt", "problem": "linreg", "alpha0": 0.02, "rounds": scale.p2p_rounds, "seed": seed,
        "min-round-seconds": 0.1, "round-timeout": ROUND_TIMEOUT, "send-timeout": ROUND_TIMEOUT,
        "max-ahead": MAX_AHEAD, "connect-timeout": 60, "checkpoint-every": 1, **extra}, seed=seed)


def last_round(records: Sequence[dict[str, Any]]) -> int:
    """The highest ``round`` in per-round records (0 without any)."""
    return max((int(r["round"]) for r in records), default=0)


def _peer_docs(out: Path, n: int) -> dict[int, dict[str, Any]]:
    docs = {}
    for i in range(n):
        f = out / f"peer-{i}.json"
        try:
            docs[i] = json.loads(f.read_text())
        except (OSError, ValueError):
            docs[i] = {"outcome": "no result", "records": []}
    return docs


def _rounds_file(out: Path, i: int) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in (out / f"peer-{i}.rounds.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def _p2p_finish(row: Row, procs: PeerProcesses, out: Path, n: int, rounds: int, victim: int, deadline: float) -> None:
    """Wait (bounded) for every peer; check outcomes, finite models, skip bounds; fill status and lost."""
    finished = procs.wait_all(deadline)
    row.check("every peer process exited before the bound", finished, procs.exit_codes())
    docs = _peer_docs(out, n)
    outcomes = {i: d.get("outcome") for i, d in docs.items()}
    row.status = ", ".join(f"{i}: {o}" for i, o in outcomes.items())
    row.check("every peer.json says 'done'", all(o == "done" for o in outcomes.values()), outcomes)
    finite = {}
    for i in range(n):
        try:
            with np.load(out / f"peer-{i}.npz") as z:
                finite[i] = bool(np.all(np.isfinite(z["theta"])))
        except (OSError, KeyError, ValueError):
            finite[i] = False
    row.check("every final model is finite", all(finite.values()), finite)
    last = {i: (d.get("final_t"), rounds) for i, d in docs.items()}
    row.details["final_t"] = last
    row.details["skipped_rounds"] = {i: sum(1 for r in d.get("records", []) if r.get("missing")) for i, d in docs.items()}
    if victim >= 0:
        skipped = [r for i, d in docs.items() if i != victim for r in d.get("records", [])
                   if victim in r.get("missing", [])]
        row.details["neighbour_rounds_without_victim"] = len(skipped)
    else:  # every peer was cut off: every round with a missing neighbour counts
        skipped = [r for d in docs.values() for r in d.get("records", []) if r.get("missing")]
    row.check(f"every round without a neighbour ended within the round deadline ({ROUND_TIMEOUT:g} s + 1)",
              bool(skipped) and all(r["comm_s"] < ROUND_TIMEOUT + 1.0 for r in skipped),
              {"rounds": len(skipped), "slowest comm_s": max((r["comm_s"] for r in skipped), default=None)})


def p2p_kill_resume(out: Path, scale: Scale, seed: int) -> Row:
    """SIGKILL peer 2 at round >= 10; restart it with ``--resume`` after its neighbours skipped it."""
    row = Row("p2p-kill-resume", "p2p", "peer SIGKILLed, restarted with --resume")
    n, victim = scale.peers, 2
    net = _p2p_network(out, scale, seed)
    with PeerProcesses(net, out, range(n)) as procs:
        wait_for(lambda: procs.status(victim).get("round", 0) >= 10, 90, f"peer {victim} to reach round 10")
        procs.kill(victim)
        t_kill = time.monotonic()
        before = _rounds_file(out, victim)
        wait_for(lambda: victim in (procs.status(1).get("missing") or []), 30, f"peer 1 to skip peer {victim}")
        time.sleep(2.0)  # down for a few rounds
        procs.start(victim, args=["--resume"])
        t_start = time.monotonic()
        # by design a peer far behind catches up at most max-ahead rounds per skip, each skip costing up to one
        # round deadline (its neighbours' messages for its round are gone): the bound grows with the gap
        gap = max(procs.status(j).get("round", 0) for j in range(n) if j != victim) - last_round(before)
        bound = (gap / (MAX_AHEAD + 1) + 2) * ROUND_TIMEOUT + 20.0
        t_back = wait_for(lambda: procs.status(victim).get("state") == "running"
                          and all(procs.status(j).get("missing") == [] for j in (victim - 1, victim + 1)),
                          bound, f"peer {victim}'s neighbours to hear it again")
        row.recover_s = t_back - t_start
        row.bound_s = bound
        row.details["gap_rounds_at_restart"] = gap
        _p2p_finish(row, procs, out, n, scale.p2p_rounds, victim, time.monotonic() + 30 + scale.p2p_rounds * 2.0)
    doc = _peer_docs(out, n)[victim]
    resumed = (doc.get("resumed_from") or {}).get("round")
    last_before = last_round(before)
    after = _rounds_file(out, victim)
    row.details.update({"killed_after_round": last_before, "resumed_from_round": resumed, "down_s": t_start - t_kill,
                        "records_before_kill": len(before), "records_kept": len(after)})
    row.check("restarted from its checkpoint, at or after the last round it recorded",
              resumed is not None and resumed >= last_before, {"resumed": resumed, "last recorded": last_before})
    row.check("the per-round records written before the kill are kept",
              [r["round"] for r in after[:len(before)]] == [r["round"] for r in before], len(before))
    row.check(f"heard again by its neighbours within {row.bound_s:.0f} s of the restart "
              "((gap / (max-ahead + 1) + 2) x round-timeout + 20)", row.recover_s <= (row.bound_s or 0), row.recover_s)
    lost_rounds = 0 if resumed is None else max(0, last_before - resumed)
    row.lost = (f"nothing: checkpoint of round {resumed}, last recorded round {last_before}; "
                f"{row.details['neighbour_rounds_without_victim']} neighbour rounds ran without peer {victim} (skipped, "
                "recorded)") if lost_rounds == 0 else f"{lost_rounds} round(s) of peer {victim}'s work"
    row.outcome = f"peer {victim} resumed from its checkpoint of round {resumed} and was heard again"
    return row


def p2p_sigstop(out: Path, scale: Scale, seed: int) -> Row:
    """SIGSTOP peer 2 for 3 round deadlines, then SIGCONT."""
    row = Row("p2p-sigstop", "p2p", "peer SIGSTOPped 6 s (3 round deadlines), then SIGCONT")
    n, victim = scale.peers, 2
    net = _p2p_network(out, scale, seed)
    bound = 30.0
    with PeerProcesses(net, out, range(n)) as procs:
        wait_for(lambda: procs.status(victim).get("round", 0) >= 10, 90, f"peer {victim} to reach round 10")
        pid = procs.procs[victim].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_for(lambda: victim in (procs.status(1).get("missing") or []), 30, f"peer 1 to skip peer {victim}")
            time.sleep(4.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        t_cont = time.monotonic()
        t_back = wait_for(lambda: all(procs.status(j).get("missing") == [] for j in (victim - 1, victim + 1)),
                          bound, f"peer {victim}'s neighbours to hear it again")
        row.recover_s = t_back - t_cont
        row.bound_s = bound
        _p2p_finish(row, procs, out, n, scale.p2p_rounds, victim, time.monotonic() + 30 + scale.p2p_rounds * 2.0)
    doc = _peer_docs(out, n)[victim]
    skips = [s for r in doc.get("records", []) for s in (r.get("skips") or [])]
    row.details["victim_skips"] = skips
    row.check(f"heard again within {bound:g} s of SIGCONT", row.recover_s <= bound, row.recover_s)
    row.lost = (f"nothing recorded is lost; peer {victim} skipped ahead {len(skips)} time(s) to rejoin (recorded as "
                f"skipped_from), its neighbours ran {row.details['neighbour_rounds_without_victim']} rounds without it")
    row.outcome = f"peer {victim} caught up after SIGCONT"
    return row


def p2p_partition(out: Path, scale: Scale, seed: int) -> Row:
    """Cut every link between the two groups of a bipartite ring, then heal, through a link emulator.

    Each peer binds its real port (``graphfl peer --listen``) and the network file lists, for each
    peer, a :class:`~graphfl.bench.linkemu.LinkProxy` in front of it (as ``graphfl bench network``
    does). Addresses are part of the topology's fingerprint, so there is one proxy per peer, not
    per link: a cut stops everything *into* a peer. On a ring of even length every edge joins the
    groups ``{even ids}`` and ``{odd ids}``, so cutting every proxy is exactly the partition
    between those two groups (no edge inside a group exists to keep).
    """
    import dataclasses
    import importlib.util

    row = Row("p2p-partition", "p2p", "partition between peer groups {even} and {odd} of a ring (every link "
              "crosses), healed after 4 s")
    if importlib.util.find_spec("graphfl.bench.linkemu") is None:
        row.outcome = "not available: no link emulator (graphfl.bench.linkemu) in this tree"
        return row
    from graphfl.bench.linkemu import LinkProfile, LinkProxy
    from graphfl.p2p.config import load_network_file, write_network_file

    n = scale.peers
    real = _p2p_network(out, scale, seed)
    net = load_network_file(real)
    listen = {p.id: p.address for p in net.topology.peers}
    proxies: list[LinkProxy] = []
    bound = 30.0
    try:
        for p in net.topology.peers:
            host, _, port = p.address.rpartition(":")
            proxies.append(LinkProxy(host, int(port), LinkProfile("lan"), seed=seed * 1000 + p.id))
        topo = dataclasses.replace(net.topology, peers=tuple(
            dataclasses.replace(p, address=proxies[p.id].address) for p in net.topology.peers))
        network_file = write_network_file(out / "network.toml", topo, net.run, net.tls)
        with PeerProcesses(network_file, out, ()) as procs:
            for i in range(n):
                procs.start(i, ["--listen", listen[i]])
            wait_for(lambda: all(procs.status(i).get("round", 0) >= 10 for i in range(n)), 90, "every peer at round 10")
            for proxy in proxies:
                proxy.cut()
            t_cut = time.monotonic()
            at_cut = {i: procs.status(i).get("round", 0) for i in range(n)}
            alone = wait_for(lambda: all(len(procs.status(i).get("missing") or []) == 2 for i in range(n)), bound,
                             "every peer to skip both neighbours")
            time.sleep(max(0.0, 4.0 - (time.monotonic() - t_cut)))
            during = {i: procs.status(i).get("round", 0) - at_cut[i] for i in range(n)}
            for proxy in proxies:
                proxy.heal()
            t_heal = time.monotonic()
            t_back = wait_for(lambda: all(procs.status(i).get("missing") == [] for i in range(n)), bound,
                              "every peer to hear both neighbours again")
            row.recover_s, row.bound_s = t_back - t_heal, bound
            row.details.update({"skip_after_cut_s": alone - t_cut, "rounds_during_cut": during,
                                "links": {str(i): p.stats() for i, p in enumerate(proxies)}})
            _p2p_finish(row, procs, out, n, scale.p2p_rounds, victim=-1,
                        deadline=time.monotonic() + 30 + scale.p2p_rounds * 2.0)
    finally:
        for proxy in proxies:
            proxy.close()
    row.check(f"every peer skipped its cut-off neighbours within {bound:g} s", alone - t_cut <= bound, alone - t_cut)
    row.check("each side kept training during the cut", all(v > 0 for v in during.values()), during)
    row.check(f"every link heard again within {bound:g} s of the heal", row.recover_s <= bound, row.recover_s)
    skipped = {i: d for i, d in row.details["skipped_rounds"].items()}
    row.lost = (f"nothing recorded is lost; rounds without neighbours (skipped, recorded) per peer: {skipped}")
    row.outcome = (f"cut: every peer alone after {alone - t_cut:.1f} s, kept training; healed: all links back "
                   f"after {row.recover_s:.1f} s")
    return row


# -- p2p: crafted messages against one peer's receive stack ----------------------------------


def _target(folder: Path, **kw: Any) -> hostile.TargetPeer:
    target = hostile.TargetPeer(folder, 4, **kw)  # peer 0; neighbours 1 and 3; peer 2 a stranger with a valid cert
    return target


def _delivered(row: Row, target: hostile.TargetPeer, round_: int, want: dict[int, float], bound: float) -> float:
    """Receive ``round_`` from the senders in ``want``; check each arrived with its honest value."""
    t0 = time.monotonic()
    got = target.transport.receive(round_, ["params"], list(want), timeout=bound)
    took = time.monotonic() - t0
    values = {j: float(got[j]["params"].arrays["theta"][0]) for j in got}
    row.check(f"round {round_}: the honest messages arrived intact", values == want, values)
    return took


def p2p_messages(out: Path, scale: Scale, seed: int) -> Row:
    """Duplicated, reordered, late and far-future messages from a neighbour (valid certificate)."""
    row = Row("p2p-messages", "p2p", "duplicated / reordered / late / far-future messages")
    bound = 5.0
    with _target(out, max_round=100) as target:
        target.verify(1, 3)
        target.transport.advance(5)
        acks = {
            "reordered: round 6 before 5": target.push(1, hostile.frames(1, 6, 6.0)),
            "round 5": target.push(1, hostile.frames(1, 5, 5.0)),
            "duplicate of round 5": target.push(1, hostile.frames(1, 5, 99.0)),
            "late: round 3": target.push(1, hostile.frames(1, 3, 3.0)),
            "ahead: round 50": target.push(1, hostile.frames(1, 50, 50.0)),
            "beyond the run: round 10^6": target.push(1, hostile.frames(1, 1_000_000, 1e6)),
            "neighbour 3, round 5": target.push(3, hostile.frames(3, 5, 5.0)),
        }
        got = {k: (a.accepted, a.reason) for k, a in acks.items()}
        row.details["acks"] = got
        row.check("reordered messages are both accepted", got["reordered: round 6 before 5"][0] and got["round 5"][0], got)
        row.check("a duplicate is refused", not got["duplicate of round 5"][0]
                  and "duplicate" in got["duplicate of round 5"][1], got["duplicate of round 5"])
        row.check("a late message is dropped", "late" in got["late: round 3"][1], got["late: round 3"])
        row.check("a message beyond the horizon is refused", not got["ahead: round 50"][0], got["ahead: round 50"])
        row.check("a message beyond the run is refused", not got["beyond the run: round 10^6"][0]
                  and "beyond the run" in got["beyond the run: round 10^6"][1], got["beyond the run: round 10^6"])
        latest = target.transport.mailbox.latest_rounds()
        row.check("only accepted messages count as a neighbour's round (no fast-forward)", latest.get(1) == 6, latest)
        took = _delivered(row, target, 5, {1: 5.0, 3: 5.0}, bound)
        target.transport.advance(6)
        target.push(3, hostile.frames(3, 6, 6.0))
        took += _delivered(row, target, 6, {1: 6.0, 3: 6.0}, bound)
        stats = target.transport.stats()
    row.recover_s = took
    row.bound_s = bound
    row.details["stats"] = stats
    row.status = f"{stats['messages_rejected']} refused, {stats['messages_dropped_late']} dropped late (peer stats)"
    row.lost = "nothing: the first copy of round 5 and the early round 6 were used"
    row.outcome = "duplicate/ahead/beyond refused, late dropped, reordered accepted"
    return row


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "refused" in record.getMessage():
            self.n += 1


def _invalid(kind: int, sender: int) -> list[pb.Frame]:
    """Invalid messages: wrong shape, wrong dtype, unknown channel, a header and nothing else."""
    if kind == 0:
        return hostile.frames(sender, 0, 1.0, dim=hostile.DIM + 1)
    if kind == 1:
        return [pb.Frame(sender=sender, round=0, channel="params",
                         header=pb.Header(tensors=[pb.TensorSpec(name="theta", dtype="complex64", shape=[hostile.DIM],
                                                                 nbytes=8 * hostile.DIM)]))]
    if kind == 2:
        return [pb.Frame(sender=sender, round=0, channel="nope", header=pb.Header())]
    return [pb.Frame(sender=sender, round=0, channel="params", data=b"\0" * 64)]


def p2p_flood(out: Path, scale: Scale, seed: int) -> Row:
    """``flood`` invalid messages from a stranger and from neighbour 1, 8 at a time, while neighbour 3 sends."""
    row = Row("p2p-flood", "p2p", f"flood of {scale.flood} invalid messages (stranger + neighbour)")
    bound = 10.0
    counter = _Count()
    log = logging.getLogger("graphfl.p2p.transport")
    log.addHandler(counter)
    t0 = time.monotonic()
    try:
        with _target(out, max_round=100) as target:
            target.verify(1, 3)

            def attack(k: int) -> bool:
                who = 2 if k % 2 else 1
                try:
                    return bool(target.push(who, _invalid(k % 4, who), timeout=bound).accepted)
                except grpc.RpcError:
                    return False

            with ThreadPoolExecutor(8) as pool:
                futures = [pool.submit(attack, k) for k in range(scale.flood)]
                time.sleep(0.2)  # the flood is under way
                t_send = time.monotonic()
                ack = target.push(3, hostile.frames(3, 0, 3.0), timeout=bound)
                honest_s = time.monotonic() - t_send
                accepted = sum(f.result(timeout=120) for f in futures)
            stats = target.transport.stats()
            took = _delivered(row, target, 0, {3: 3.0}, bound)
    finally:
        log.removeHandler(counter)
    row.recover_s = honest_s + took
    row.bound_s = bound
    row.check("the honest neighbour's message was accepted during the flood", ack.accepted, ack.reason)
    row.check(f"... within {bound:g} s", row.recover_s <= bound, row.recover_s)
    row.check("no invalid message was accepted", accepted == 0, accepted)
    row.check("every invalid message was counted as refused", stats["messages_rejected"] >= scale.flood,
              stats["messages_rejected"])
    row.check("refusals are logged rate-limited (<= 5 lines)", counter.n <= 5, counter.n)
    row.details.update({"stats": stats, "log_lines": counter.n, "flood_s": time.monotonic() - t0})
    row.status = f"{stats['messages_rejected']} refused (peer stats), {counter.n} log line(s)"
    row.lost = "nothing: the honest round-0 message was delivered"
    row.outcome = f"{scale.flood} invalid messages refused, honest message through in {row.recover_s:.2f} s"
    return row


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def p2p_oversized(out: Path, scale: Scale, seed: int) -> Row:
    """Headers declaring a 2 GB tensor, from a stranger and from a neighbour."""
    row = Row("p2p-oversized", "p2p", "oversized declared tensor (2 GB header, stranger and neighbour)")
    with _target(out, max_round=100) as target:
        target.verify(1, 3)
        before = _rss_mb()
        t0 = time.monotonic()
        stranger = target.push(2, [hostile.huge_header(2)])
        neighbour = target.push(1, [hostile.huge_header(1)])
        took = time.monotonic() - t0
        grew = _rss_mb() - before
        target.push(3, hostile.frames(3, 0, 3.0))
        target.push(1, hostile.frames(1, 0, 1.0))
        took += _delivered(row, target, 0, {1: 1.0, 3: 3.0}, 5.0)
        stats = target.transport.stats()
    row.recover_s, row.bound_s = took, 5.0
    row.check("the stranger's header is refused unread", not stranger.accepted and "not a neighbour" in stranger.reason,
              stranger.reason)
    row.check("the neighbour's header is refused before allocating",
              not neighbour.accepted and "differ from the expected" in neighbour.reason, neighbour.reason[:120])
    row.check("peak memory grew < 200 MB", grew < 200, round(grew, 1))
    row.check("refused and delivered within 5 s", took <= 5.0, took)
    row.status = f"{stats['messages_rejected']} refused (peer stats)"
    row.lost = "nothing: both neighbours' round-0 messages were delivered afterwards"
    row.outcome = f"both refused, peak RSS +{grew:.0f} MB"
    return row


def p2p_idle_streams(out: Path, scale: Scale, seed: int) -> Row:
    """Twelve idle Push streams (6 from a stranger, 6 from neighbour 1) while neighbour 3 sends."""
    row = Row("p2p-idle-streams", "p2p", "12 idle streams held open (stranger + neighbour)")
    stop = threading.Event()
    acks: list[pb.Ack] = []
    errors: list[str] = []
    with _target(out, max_round=100, stream_timeout=1.5) as target:
        target.verify(1, 3)

        def hold(who: int) -> None:
            try:
                acks.append(target.push(who, hostile.idle_frames(stop), timeout=30.0))
            except grpc.RpcError as exc:
                errors.append(str(exc.code()))

        holders = [threading.Thread(target=hold, args=(who,)) for who in [2] * 6 + [1] * 6]
        for th in holders:
            th.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        ack = target.push(3, hostile.frames(3, 0, 3.0))
        honest = time.monotonic() - t0
        t1 = time.monotonic()
        for th in holders:
            th.join(20)
        cut = time.monotonic() - t1
        stop.set()
        _delivered(row, target, 0, {3: 3.0}, 5.0)
    refused = [a.reason for a in acks if not a.accepted]
    row.recover_s, row.bound_s = cut + 0.5, 8.0
    row.check("the honest neighbour's message got through", ack.accepted, ack.reason)
    row.check("the stranger's streams were refused unread", any("not a neighbour" in r for r in refused), len(refused))
    row.check("the neighbour's extra streams were refused (per-sender limit)", any("open streams" in r for r in refused),
              len(refused))
    row.check("idle streams were cut by the stream deadline (1.5 s), within 8 s", cut + 0.5 <= 8.0, cut)
    row.details.update({"honest_s": honest, "refused": len(refused), "rpc_errors": errors})
    row.status = f"{len(refused)} stream(s) refused with a reason"
    row.lost = "nothing: the honest neighbour's message was delivered"
    row.outcome = f"honest message through in {honest:.2f} s; idle streams cut after {cut:.1f} s"
    return row


def p2p_huge_values(out: Path, scale: Scale, seed: int) -> Row:
    """Neighbour 1 sends 3e38 (finite float32 that overflows when mixed); neighbour 3 sends 1e6."""
    row = Row("p2p-huge-values", "p2p", "a neighbour sending huge values (3e38)")
    with _target(out, max_round=100) as target:
        target.verify(1, 3)
        t0 = time.monotonic()
        bad = target.push(1, hostile.frames(1, 0, 3e38))
        good = target.push(3, hostile.frames(3, 0, 1e6))
        got = target.transport.receive(0, ["params"], [1, 3], timeout=1.0)
        took = time.monotonic() - t0
    mixed = {j: np.asarray(m["params"].arrays["theta"], np.float32) for j, m in got.items()}
    model = np.float32(1.0) / 3 + sum((x / 3 for x in mixed.values()), np.zeros(hostile.DIM, np.float32))
    row.recover_s, row.bound_s = took, 5.0
    row.check("the huge message is refused before mixing", not bad.accepted and "overflow" in bad.reason, bad.reason)
    row.check("large but honest values pass", good.accepted and sorted(got) == [3], sorted(got))
    row.check("the mixed model stays finite", bool(np.all(np.isfinite(model))), float(np.max(np.abs(model))))
    row.status = "1 refused (overflow), reason in the peer's log and Ack"
    row.lost = "nothing: round 0 mixed with the honest neighbour (neighbour 1 skipped)"
    row.outcome = "3e38 refused, 1e6 accepted, model finite"
    return row


# -- p2p: the socket data path's listener (a stranger's flood, a restart on fixed ports) ------


def _fixed_data_ports(network_file: Path) -> dict[int, int]:
    """Give every peer of ``network_file`` a fixed ``data-port`` (free, none a gRPC port); rewrites the file."""
    import dataclasses

    from graphfl.common.ports import free_ports
    from graphfl.p2p.config import load_network_file, write_network_file

    net = load_network_file(network_file)
    grpc_ports = {int(p.address.rsplit(":", 1)[1]) for p in net.topology.peers}
    ports = [p for p in free_ports(2 * net.topology.n) if p not in grpc_ports][:net.topology.n]
    topo = dataclasses.replace(net.topology, peers=tuple(dataclasses.replace(p, data_port=ports[p.id])
                                                         for p in net.topology.peers))
    write_network_file(network_file, topo, net.run, net.tls)
    return {p.id: ports[p.id] for p in net.topology.peers}


def _lingering(port: int) -> int:
    """TCP sockets on local ``port`` in a ``*-WAIT`` state (``ss -tan``; -1 without ``ss``)."""
    import shutil

    if shutil.which("ss") is None:
        return -1
    out = subprocess.run(["ss", "-tan"], capture_output=True, text=True, check=False, timeout=10).stdout
    return sum(1 for ln in out.splitlines()[1:] if ln.split() and "WAIT" in ln.split()[0] and f":{port} " in ln)


def _restart_at_once(row: Row, procs: PeerProcesses, out: Path, n: int, victim: int, data_port: int) -> float:
    """SIGKILL ``victim`` at round >= 10 and, as soon as a neighbour has skipped it, start it again
    (``--resume``, same fixed ports: its old connections still hold them); wait until both its
    neighbours hear it again, within ``(gap / (max-ahead + 1) + 2) x round-timeout + 20`` s (as
    ``p2p-kill-resume``). Returns the wall-clock time of the kill; sets ``recover_s`` and ``bound_s``.
    """
    wait_for(lambda: procs.status(victim).get("round", 0) >= 10, 90, f"peer {victim} to reach round 10")
    procs.kill(victim)
    killed_at = time.time()
    (out / f"peer-{victim}.status.json").unlink(missing_ok=True)  # only the restarted process's progress counts
    wait_for(lambda: victim in (procs.status((victim + 1) % n).get("missing") or []), 30,
             f"peer {(victim + 1) % n} to skip peer {victim}")
    row.details["lingering_on_data_port_at_restart"] = _lingering(data_port)
    procs.start(victim, args=["--resume"])
    t_start = time.monotonic()
    # as p2p-kill-resume: a peer behind catches up at most max-ahead + 1 rounds per skip, each up to a round deadline
    gap = max(procs.status(j).get("round", 0) for j in range(n) if j != victim) - last_round(_rounds_file(out, victim))
    bound = (max(0, gap) / (MAX_AHEAD + 1) + 2) * ROUND_TIMEOUT + 20.0
    row.details["gap_rounds_at_restart"] = gap
    t_back = wait_for(lambda: procs.status(victim).get("state") == "running"
                      and all(procs.status(j % n).get("missing") == [] for j in (victim - 1, victim + 1)),
                      bound, f"peer {victim}'s neighbours to hear it again")
    row.recover_s, row.bound_s = t_back - t_start, bound
    row.details["down_s"] = time.time() - killed_at - row.recover_s
    return killed_at


_SKIP_LINE = re.compile(r"round (\d+): skipping neighbour\(s\) \[[^]]*\] \(unreachable: \[([^]]*)\]\)")


def _unreachable_in_logs(out: Path, n: int) -> dict[int, set[int]]:
    """Per peer, the neighbours its log reports unreachable in some round (``skipping ... (unreachable: [...])``)."""
    found: dict[int, set[int]] = {}
    for i in range(n):
        f = out / "logs" / f"peer-{i}.log"
        text = f.read_text(errors="replace") if f.is_file() else ""
        found[i] = {int(j) for m in _SKIP_LINE.finditer(text) for j in m.group(2).split(",") if j.strip()}
    return found


def p2p_socket_flood(out: Path, scale: Scale, seed: int) -> Row:
    """A stranger without a certificate holds idle and trickling connections on every peer's data
    port (``data-path = "socket"``, mutual TLS, fixed data ports) from the moment each listens until
    the run ends (the neighbours connect under it); one peer is killed and restarted at once, so its
    neighbours reconnect under the flood too.
    """
    idle, slow = 30, 10  # per peer: more than the pre-auth budget (socket_data.PREAUTH_MAX)
    row = Row("p2p-socket-flood", "p2p", f"a stranger holding {idle} idle + {slow} trickling connections on every "
              "peer's data port (socket path, mutual TLS) from before the neighbours connect; one peer restarted "
              "under it")
    n, victim = scale.peers, 2
    rounds = scale.p2p_rounds // 5
    net = _p2p_network(out, scale, seed, **{"data-path": "socket", "rounds": rounds})
    ports = _fixed_data_ports(net)
    t0 = time.monotonic()
    # the stranger dials every data port from before the peers start: it is in as soon as each listens
    with hostile.ConnectionFlood([("127.0.0.1", p) for p in ports.values()], idle=idle, slow=slow, pause=0.05) as flood:
        with PeerProcesses(net, out, range(n)) as procs:
            wait_for(lambda: all(procs.status(i).get("round", 0) >= 1 for i in range(n)), 90, "every peer's first round")
            at_first_round = dict(flood.opened_by_port)
            flood.pause = 0.2  # sustained from here on, without a reconnect storm
            killed_at = _restart_at_once(row, procs, out, n, victim, ports[victim])
            back_at = time.time()
            _p2p_finish(row, procs, out, n, rounds, victim, time.monotonic() + 30 + rounds * 2.0)
        opened = flood.opened
    flood_s = time.monotonic() - t0
    docs = _peer_docs(out, n)
    records = {i: d.get("records", []) for i, d in docs.items()}
    records[victim] = _rounds_file(out, victim)  # before the kill and after the restart
    before = {i: [r["round"] for r in rs if r["wall"] < killed_at and r.get("missing")] for i, rs in records.items()}
    settle = back_at + 2 * ROUND_TIMEOUT  # the restart's own wake: skips and their cascade to the next neighbours
    after = {i: [r["round"] for r in rs if r["wall"] > settle and r.get("missing")] for i, rs in records.items()}
    unreachable = {i: sorted(js - {victim}) for i, js in _unreachable_in_logs(out, n).items()}
    dropped = {i: (d.get("stats") or {}).get("preauth_dropped") for i, d in docs.items()}
    logs = {i: (out / "logs" / f"peer-{i}.log") for i in range(n)}
    log_kb = {i: round(f.stat().st_size / 1024, 1) if f.is_file() else None for i, f in logs.items()}
    lines = {i: sum("before authentication" in ln for ln in f.read_text(errors="replace").splitlines())
             if f.is_file() else None for i, f in logs.items()}
    line_bound = int(flood_s / 5.0) + 3  # one line at once, then at most one summary per 5 s interval
    row.details.update({"flood_connections_opened": opened, "flood_by_port_at_first_round": at_first_round,
                        "flood_s": flood_s, "preauth_dropped": dropped, "log_kb": log_kb, "preauth_log_lines": lines})
    row.check(f"the stranger opened more than the pre-auth budget on every data port by the end of every peer's first "
              f"round (>= {idle + slow} connections each)", all(v >= idle + slow for v in at_first_round.values()),
              at_first_round)
    row.check("every peer dropped the stranger's connections before authentication (counted)",
              all((v or 0) > 0 for v in dropped.values()), dropped)
    row.check("no round before the restart lacked a neighbour (the neighbours connected under the flood)",
              all(not v for v in before.values()), before)
    row.check("no neighbour but the restarted peer was ever unreachable (peer logs)",
              all(not v for v in unreachable.values()), unreachable)
    row.check(f"no round lacked a neighbour from {2 * ROUND_TIMEOUT:g} s after the restarted peer was heard again",
              all(not v for v in after.values()), after)
    row.check(f"the restarted peer was heard again within {row.bound_s:.0f} s (its neighbours reconnected under the "
              "flood)", (row.recover_s or 1e9) <= (row.bound_s or 0), row.recover_s)
    row.check(f"log lines about dropped pre-auth connections per peer <= {line_bound} (rate-limited)",
              all(v is not None and v <= line_bound for v in lines.values()), lines)
    row.check("every peer log < 64 KB", all(v is not None and v < 64 for v in log_kb.values()), log_kb)
    row.status = row.status + f"; pre-auth drops per peer {dropped}"
    row.lost = (f"nothing: no neighbour missing because of the flood; {row.details['neighbour_rounds_without_victim']} "
                f"neighbour rounds ran without peer {victim} while it restarted (skipped, recorded)")
    row.outcome = (f"{opened} stranger connections in {flood_s:.0f} s dropped before authentication; no round lacked "
                   f"a neighbour because of them; peer {victim} heard again {row.recover_s:.1f} s after its restart")
    return row


def p2p_fixed_port_restart(out: Path, scale: Scale, seed: int) -> Row:
    """A peer with a fixed gRPC port and a fixed data port (socket data path) is SIGKILLed and
    started again at once, while its old connections still hold the ports (``FIN-WAIT`` /
    ``TIME-WAIT``): it binds both and rejoins within the bound.
    """
    row = Row("p2p-fixed-port-restart", "p2p", "peer with fixed gRPC + data ports (socket path) SIGKILLed, "
              "restarted at once")
    n, victim = scale.peers, 2
    rounds = scale.p2p_rounds // 5
    net = _p2p_network(out, scale, seed, **{"data-path": "socket", "rounds": rounds})
    ports = _fixed_data_ports(net)
    with PeerProcesses(net, out, range(n)) as procs:
        _restart_at_once(row, procs, out, n, victim, ports[victim])
        _p2p_finish(row, procs, out, n, rounds, victim, time.monotonic() + 30 + rounds * 2.0)
    log = out / "logs" / f"peer-{victim}.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    row.check("the restarted peer bound its ports (no bind failure in its log)", "cannot bind" not in text,
              [ln for ln in text.splitlines() if "cannot bind" in ln][:2])
    row.check(f"heard again by its neighbours within {row.bound_s:.0f} s of the restart "
              "((gap / (max-ahead + 1) + 2) x round-timeout + 20)",
              (row.recover_s or 1e9) <= (row.bound_s or 0), row.recover_s)
    row.lost = (f"nothing recorded is lost; {row.details['neighbour_rounds_without_victim']} neighbour rounds ran "
                f"without peer {victim} while it restarted (skipped, recorded)")
    row.outcome = (f"peer {victim} rebound its fixed ports ({row.details['lingering_on_data_port_at_restart']} old "
                   f"connection(s) lingering on the data port) and was heard again after {row.recover_s:.1f} s")
    return row


ROWS: dict[str, Callable[[Path, Scale, int], Row]] = {
    "flower-dropout": flower_dropout,
    "flower-restart": flower_restart,
    "flower-straggler": flower_straggler,
    "flower-superlink-kill": flower_superlink_kill,
    "flower-superlink-resume": flower_superlink_resume,
    "flower-concurrent-resume": flower_concurrent_resume,
    "p2p-kill-resume": p2p_kill_resume,
    "p2p-sigstop": p2p_sigstop,
    "p2p-partition": p2p_partition,
    "p2p-messages": p2p_messages,
    "p2p-flood": p2p_flood,
    "p2p-oversized": p2p_oversized,
    "p2p-idle-streams": p2p_idle_streams,
    "p2p-huge-values": p2p_huge_values,
    "p2p-socket-flood": p2p_socket_flood,
    "p2p-fixed-port-restart": p2p_fixed_port_restart,
}
"""Every row of the suite, in the order it runs."""


def select_rows(rows: str | Iterable[str] | None) -> list[str]:
    """Row names from ``rows`` (names or a comma-separated string; ``None`` = all), checked against :data:`ROWS`."""
    if rows is None:
        return list(ROWS)
    names = [r.strip() for r in (rows.split(",") if isinstance(rows, str) else rows) if r.strip()]
    unknown = [r for r in names if r not in ROWS]
    if unknown:
        raise ConfigError(f"bench faults: unknown row(s) {unknown}; valid rows: {list(ROWS)}")
    return names


def run_row(name: str, out: Path, scale: Scale, seed: int) -> Row:
    """One row; an exception makes it red with the error instead of ending the suite."""
    t0 = time.monotonic()
    folder = out / "rows" / name
    folder.mkdir(parents=True, exist_ok=True)
    fn = ROWS[name]
    logger.info("bench faults: %s", name)
    try:
        row = fn(folder, scale, seed)
    except Exception as exc:  # a failing row is a result, reported red
        logger.exception("bench faults: row %s raised", name)
        row = Row(name, "flower" if name.startswith("flower") else "p2p", name, outcome="raised",
                  error=f"{type(exc).__name__}: {exc}")
    row.seconds = time.monotonic() - t0
    row.finish()
    logger.info("bench faults: %s -> %s (%.1f s)", name, {True: "green", False: "RED", None: "n/a"}[row.green],
                row.seconds)
    return row


def _colour(row: Row) -> str:
    return {True: "green", False: "red", None: "not available"}[row.green]


def render(doc: dict[str, Any]) -> str:
    """The suite's own Markdown: the summary line, one table of rows, then each row's checks."""
    rows = [Row(**r) for r in doc["rows"]]
    table = markdown_table(
        columns=["row", "runtime", "fault", "outcome", "recover s", "bound s", "lost", "status recorded", "result"],
        rows=[[r.name, r.runtime, r.fault, r.outcome if not r.error else f"raised: {r.error[:160]}", r.recover_s,
               r.bound_s, r.lost, r.status, _colour(r)] for r in rows])
    lines = [f"# Fault suite ({'quick' if doc['config']['quick'] else 'full'})", "",
             f"{doc['summary']['green']} green, {doc['summary']['red']} red, "
             f"{doc['summary']['not_available']} not available, of {len(rows)} rows; "
             f"{doc['summary']['seconds']:.0f} s on {os.cpu_count()} CPUs.", "", "## Rows", "", table, "",
             "## Checks", ""]
    for r in rows:
        lines.append(f"### {r.name} ({_colour(r)})")
        lines.append("")
        lines += [f"- [{'x' if c['ok'] else ' '}] {c['check']} (got: {json.dumps(c['got'], default=str)[:200]})"
                  for c in r.checks] or [f"- {r.outcome}"]
        if r.error:
            lines.append(f"- error: {r.error[:400]}")
        lines.append("")
    return "\n".join(lines)


def write_report(out: Path, doc: dict[str, Any]) -> None:
    """``faults.json``, ``faults.md`` and ``faults.png`` of the rows measured so far (while the suite runs)."""
    write_json(out / f"{NAME}.json", doc)
    (out / f"{NAME}.md").write_text(render(doc))
    plot(out / f"{NAME}.png", [Row(**r) for r in doc["rows"]])


def plot(path: Path, rows: Sequence[Row]) -> None:
    """Horizontal bars: time to recover per row (green/red, grey when not available) and its bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 0.45 * len(rows) + 1.5))
    ys = np.arange(len(rows))[::-1]
    colours = {True: "tab:green", False: "tab:red", None: "lightgray"}
    for y, r in zip(ys, rows):
        ax.barh(y, r.recover_s or 0.0, color=colours[r.green], height=0.6)
        if r.bound_s is not None:
            ax.plot([r.bound_s, r.bound_s], [y - 0.35, y + 0.35], color="black", lw=1.5)
        if r.green is None:
            ax.text(0.1, y, "not available", va="center", fontsize=7)
    ax.set_yticks(ys)
    ax.set_yticklabels([r.name for r in rows], fontsize=8)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("time to recover (s); black tick = bound")
    ax.set_title("graphfl fault suite: green held, red failed")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


METRICS = (Metric("recover_s", "recover s", fmt=".3g", paired=False),
           Metric("bound_s", "bound s", fmt=".3g", paired=False),
           Metric("recover_over_bound", "recover / bound", fmt=".2f", paired=False))


def row_failure(row: Row) -> str | None:
    """A row's outcome as the harness's cell outcome: ``None`` when green, else why (red or not available)."""
    if row.green is True:
        return None
    if row.green is None:
        return f"not available: {row.outcome}" if not row.outcome.startswith("not available") else row.outcome
    if row.error:
        return f"red: {row.error}"
    return "red: " + "; ".join(c["check"] for c in row.checks if not c["ok"])


def row_cell(out: Path, scale: Scale, done: list[Row], write: Callable[[], None], cell: Cell) -> dict[str, Any]:
    """Row ``cell.method`` now (:func:`run_row`); appends it to ``done`` and calls ``write()``."""
    row = run_row(cell.method, out, scale, cell.seed)
    done.append(row)
    write()  # an interrupted suite keeps what it measured
    ratio = row.recover_s / row.bound_s if row.recover_s is not None and row.bound_s else None
    return {"final": {"recover_s": row.recover_s, "bound_s": row.bound_s, "recover_over_bound": ratio},
            "failed": row_failure(row)}


def _summary(rows: Sequence[Row], seconds: float) -> dict[str, Any]:
    return {"green": sum(r.green is True for r in rows), "red": sum(r.green is False for r in rows),
            "not_available": sum(r.green is None for r in rows), "seconds": seconds}


def run(quick: bool, seed: int, out: Path, rows: str | Iterable[str] | None = None) -> dict[str, Any]:
    """Run the selected rows (all by default) and write ``<out>/faults.{json,md,png}``; returns the document."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = select_rows(rows)
    scale = QUICK if quick else FULL
    t0 = time.monotonic()
    done: list[Row] = []
    config = {"quick": quick, "seed": seed, "rows": names, **asdict(scale)}

    def write() -> None:
        write_report(out, {"name": NAME, "config": config, "rows": [asdict(r) for r in done],
                           "summary": _summary(done, time.monotonic() - t0), "env": env_info()})

    bench = Bench(name=NAME, title=f"Fault suite ({'quick' if quick else 'full'})", methods=names,
                  points=[{"form": "quick" if quick else "full"}], seeds=[seed], metrics=METRICS,
                  run_cell=partial(row_cell, out, scale, done, write), cache="none")
    outcome = run_bench(bench, None)
    doc = build_doc(bench, outcome, quick, config, extra={
        "rows": [asdict(r) for r in done], "summary": _summary(done, time.monotonic() - t0)})
    text = render(doc).split("\n")
    write_bench_report(out, doc, intro=text[2:3], sections=text[4:])
    plot(out / f"{NAME}.png", done)
    return doc
