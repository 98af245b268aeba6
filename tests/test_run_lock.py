"""One owner per output folder (common/run_lock.py): an OS lock held for the run's life.

Real processes throughout: claims raced by forked processes behind a barrier, owners killed with
SIGKILL, ``graphfl run --resume`` tried against a live run, and the ServerApp's rule for sharing
the folder with its own launcher checked against a lock held by another process.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from graphfl.common import run_lock
from graphfl.common.config import ConfigError
from graphfl.common.run_lock import FolderBusy
from graphfl.tests.cli_runner import graphfl_cli

HOLDER = """
import sys, time
from graphfl.common import run_lock
lock = run_lock.acquire(sys.argv[1], name=sys.argv[2], role=sys.argv[3], run_key=sys.argv[4])
print("held", flush=True)
time.sleep(600)
"""


def _holder(folder: Path, name: str = run_lock.LOCK_NAME, role: str = "launcher",
            run_key: str = "k1") -> subprocess.Popen[str]:
    """A process holding ``folder / name`` (until killed); returns once it holds it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), name, role, run_key],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


# -- the claim ----------------------------------------------------------------------------------


def _claimant(out: str, start: multiprocessing.synchronize.Barrier, done: multiprocessing.synchronize.Barrier,
              results: multiprocessing.Queue) -> None:  # pragma: no cover - runs in a forked child
    from graphfl.deploy.run import claim_out_dir

    start.wait(timeout=30)
    try:
        claim_out_dir(Path(out))
        (Path(out) / "config.json").write_text(json.dumps({"pid": os.getpid()}))  # what prepare() writes next
        results.put(("won", os.getpid(), ""))
    except ConfigError as exc:
        results.put(("refused", os.getpid(), str(exc)))
    done.wait(timeout=30)  # the winner keeps its claim until both have tried


def test_two_processes_racing_for_one_out_exactly_one_wins_every_time(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    for trial in range(20):
        out = tmp_path / f"race-{trial}"
        start, done, results = ctx.Barrier(2), ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_claimant, args=(str(out), start, done, results)) for _ in range(2)]
        for p in procs:
            p.start()
        got = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        winners = [g for g in got if g[0] == "won"]
        assert len(winners) == 1, (trial, got)
        loser = next(g for g in got if g[0] == "refused")
        assert str(out) in loser[2], loser
        # the loser either hit the lock (the message names the owner) or came after the winner wrote
        assert f"pid {winners[0][1]}" in loser[2] or "already holds" in loser[2], loser


def test_the_os_releases_the_lock_of_a_killed_owner(tmp_path: Path) -> None:
    proc = _holder(tmp_path)
    with pytest.raises(FolderBusy) as busy:
        run_lock.acquire(tmp_path)
    assert f"pid {proc.pid}" in str(busy.value) and str(tmp_path) in str(busy.value) and "launcher" in str(busy.value)
    _kill(proc)
    with run_lock.acquire(tmp_path, role="test") as lock:
        assert lock.held and json.loads(lock.lock_file.read_text())["pid"] == os.getpid()
    assert not lock.held


def test_claims_nest_within_one_process(tmp_path: Path) -> None:
    outer = run_lock.acquire(tmp_path, role="launcher")
    inner = run_lock.acquire(tmp_path, run_key="abc")
    assert inner is outer and json.loads(outer.lock_file.read_text())["run_key"] == "abc"
    inner.release()
    assert outer.held  # still held by the outer claim
    proc = subprocess.run([sys.executable, "-c", "import sys; from graphfl.common import run_lock; "
                           "run_lock.acquire(sys.argv[1])", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "in use by another graphfl process" in proc.stderr
    outer.release()
    assert not outer.held


# -- graphfl run --resume against a live run ------------------------------------------------------


def _wait(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _checkpoint_round(out: Path) -> int:
    try:
        return int(json.loads((out / "checkpoint" / "checkpoint.json").read_text())["round"])
    except (OSError, ValueError, KeyError):
        return -1


def test_resume_while_the_run_is_alive_is_refused_and_leaves_its_files_alone(tmp_path: Path) -> None:
    out = tmp_path / "run"
    exe = Path(sys.executable).with_name("graphfl")
    argv = [str(exe), "run", "--engine", "inprocess", "--nodes", "2", "--rounds", "40", "--out", str(out),
            "--set", "train.local-steps=2"]
    with (tmp_path / "first.log").open("w") as log:
        first = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            _wait(lambda: _checkpoint_round(out) >= 2 or first.poll() is not None, 180, "round 2's checkpoint")
            first.send_signal(signal.SIGSTOP)  # alive, holding the folder, writing nothing while we look
            before = {name: (out / name).read_bytes() for name in ("config.json", "run.json")}
            second = graphfl_cli("run", "--resume", str(out), "--rounds", "50", timeout=180)
            after = {name: (out / name).read_bytes() for name in ("config.json", "run.json")}
            first.send_signal(signal.SIGCONT)
            code = first.wait(timeout=300)
        finally:
            first.send_signal(signal.SIGCONT)
            if first.poll() is None:
                first.kill()
    text = second.stdout + second.stderr
    assert second.returncode != 0, text
    assert "in use by another graphfl process" in text and f"pid {first.pid}" in text, text
    assert str(out) in text.replace("\n", "") and "Traceback" not in text, text
    assert after == before
    assert code == 0, (tmp_path / "first.log").read_text()
    doc = json.loads((out / "run.json").read_text())
    assert doc["status"] == "completed" and "resumes" not in doc and "resumed_from_round" not in doc
    assert [r["round"] for r in doc["methods"]["fedavg"]["curve"]] == list(range(41))
    assert json.loads((out / "config.json").read_text())["resume"] is False


def test_a_run_killed_with_sigkill_leaves_no_owner_behind(tmp_path: Path) -> None:
    out = tmp_path / "run"
    exe = Path(sys.executable).with_name("graphfl")
    argv = [str(exe), "run", "--engine", "inprocess", "--nodes", "2", "--rounds", "40", "--out", str(out),
            "--set", "train.local-steps=2"]
    first = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        _wait(lambda: _checkpoint_round(out) >= 2 or first.poll() is not None, 180, "round 2's checkpoint")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    at = _checkpoint_round(out)
    resumed = graphfl_cli("run", "--resume", str(out), timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    doc = json.loads((out / "run.json").read_text())
    assert doc["status"] == "completed" and doc["resumed_from_round"] == at


# -- the ServerApp and its launcher ----------------------------------------------------------------


def test_the_serverapp_shares_the_folder_with_its_own_launcher_only(tmp_path: Path) -> None:
    from graphfl.server.app import own_out_dir

    launcher = _holder(tmp_path, role="launcher", run_key="k1")
    try:
        locks = own_out_dir(tmp_path, "k1")  # its own launcher owns the folder: the ServerApp writes there
        assert [lock.lock_file.name for lock in locks] == [run_lock.WRITER_LOCK_NAME]
        for lock in locks:
            lock.release()
        with pytest.raises(FolderBusy, match=f"pid {launcher.pid}"):
            own_out_dir(tmp_path, "another-run")  # another run's launcher owns it
    finally:
        _kill(launcher)
    locks = own_out_dir(tmp_path, "k1")  # no launcher (a SuperLink on another host): the ServerApp owns it
    assert sorted(lock.lock_file.name for lock in locks) == sorted([run_lock.LOCK_NAME, run_lock.WRITER_LOCK_NAME])
    for lock in locks:
        lock.release()


def test_a_second_serverapp_writing_the_same_folder_is_refused(tmp_path: Path) -> None:
    from graphfl.server.app import own_out_dir

    launcher = _holder(tmp_path, role="launcher", run_key="k1")
    writer = _holder(tmp_path, name=run_lock.WRITER_LOCK_NAME, role="serverapp", run_key="k1")
    try:
        with pytest.raises(FolderBusy, match=f"pid {writer.pid}"):
            own_out_dir(tmp_path, "k1")  # same run key, but another ServerApp already writes there
    finally:
        _kill(writer)
        _kill(launcher)
