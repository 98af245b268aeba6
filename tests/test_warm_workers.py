"""Warm ClientApp workers (deploy/warm.py, deploy/supernode.py, flowerx/clientapp_runtime.py,
flowerx/supernode_polls.py): the Flower internals they wrap,
identical results to stock Flower, crash handling, and teardown (after a run, after Ctrl-C).

Also a test-only plug-in algorithm ("warmcrash", loaded in the ServerApp and the workers through
``GRAPHFL_PLUGINS=graphfl.tests.test_warm_workers``) whose ClientApp kills its own process once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from graphfl.common.registry import AlgorithmSpec, ClientSpec, register, register_client
from graphfl.tests.cli_runner import default_sigint
from graphfl.tests.probe_strategy import ProbeCore, ProbeParams, ProbeTrainer

CRASH_MARKER_ENV = "GRAPHFL_TEST_CRASH_MARKER"


class CrashOnceTrainer(ProbeTrainer):
    """Probe client whose process dies (``os._exit``) the first time partition 0 trains round 1."""

    def fit(self, server_round, payload, state):
        marker = os.environ.get(CRASH_MARKER_ENV)
        if marker and self.ctx.partition_id == 0 and server_round == 1 and not Path(marker).exists():
            Path(marker).write_text(str(os.getpid()))
            os._exit(3)
        return super().fit(server_round, payload, state)


try:  # imported by pytest and, as a plug-in, by the ServerApp and workers: register once per process
    register(AlgorithmSpec("warmcrash", ProbeParams, ProbeCore, "test: its ClientApp process dies once"))
    register_client(ClientSpec("warmcrash", CrashOnceTrainer))
except ValueError:
    pass


# ---------------------------------------------------------------------------------------------
# unit: the wrapped Flower internals
# ---------------------------------------------------------------------------------------------
def test_flower_is_a_verified_version_and_pyproject_allows_exactly_those():
    from graphfl.flowerx.policy import VERIFIED_FLOWER, installed_flower

    assert installed_flower() in VERIFIED_FLOWER
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert '"flwr>=1.41,<1.43"' in pyproject and VERIFIED_FLOWER == ("1.41.0", "1.42.0")


def test_wrapped_flower_internals_are_the_expected_ones():
    from graphfl.flowerx import clientapp_runtime, supernode_polls

    assert clientapp_runtime.check() is None
    assert supernode_polls.check() is None


def test_supernode_clock_replaces_only_flowers_sleeps():
    from graphfl.flowerx.supernode_polls import PollPolicy, SuperNodeClock

    slept: list[float] = []
    clock = SuperNodeClock(PollPolicy(idle_min=0.02, idle_max=0.1, growth=2.0, reply=0.005), slept.append)
    for _ in range(5):
        clock.sleep(3)          # Flower's idle sleep: back-off from idle_min up to idle_max
    clock.sleep(0.5)            # Flower's reply wait
    clock.sleep(1.25)           # anything else passes unchanged
    clock.activity()
    clock.sleep(3)
    assert slept == [0.02, 0.04, 0.08, 0.1, 0.1, 0.005, 1.25, 0.02]
    assert abs(clock.time() - time.time()) < 1.0 and clock.monotonic() > 0   # the rest is the real time module


def test_fast_polls_wrap_the_supernode_loop_and_notify(monkeypatch):
    from flwr.supernode import start_client_internal as sci

    from graphfl.flowerx.supernode_polls import PollPolicy, SuperNodeClock, install_fast_polls

    calls: list[tuple] = []
    monkeypatch.setattr(sci, "_pull_and_store_message", lambda *a, **k: calls.append(("pull", k)) or k.get("rid"))
    monkeypatch.setattr(sci, "pull_objects", lambda ids, pull_object_fn, **k: calls.append(("objects", k)) or {})
    monkeypatch.setattr(sci, "time", sci.time)
    notified: list[int] = []
    clock = install_fast_polls(PollPolicy(idle_min=0.01, object_backoff=(0.02, 0.3)), lambda: notified.append(1),
                               check_flower=False)
    assert sci.time is clock and isinstance(clock, SuperNodeClock)
    clock.idle = 0.2
    assert sci._pull_and_store_message(rid=None) is None and notified == [] and clock.idle == 0.2
    assert sci._pull_and_store_message(rid=7) == 7 and notified == [1] and clock.idle == 0.01
    sci.pull_objects(["a"], pull_object_fn=lambda i: b"")
    assert calls[-1] == ("objects", {"initial_backoff": 0.02, "backoff_cap": 0.3})


def test_supernode_command_lines():
    from graphfl.deploy.federation import supernode_argv
    from graphfl.deploy.supernode import parse_args

    cold = supernode_argv("127.0.0.1:9091", 9100, 1, 4, None)
    assert cold[0] == "flower-supernode" and "--isolation" not in cold          # stock Flower, untouched
    warm = supernode_argv("127.0.0.1:9091", 9100, 1, 4, Path("ca.crt"), device="cuda", clientapp_mode="warm")
    assert warm[:3] == [sys.executable, "-m", "graphfl.deploy.supernode"]
    ours, flower = parse_args(warm[3:])
    assert (ours.clientapp_mode, ours.polls, ours.device) == ("warm", "fast", "cuda")
    assert flower[:2] == ["--superlink", "127.0.0.1:9091"] and "device='cuda'" in " ".join(flower)
    cold_fast = supernode_argv("127.0.0.1:9091", 9100, 1, 4, None, clientapp_mode="cold", polls="fast")
    assert parse_args(cold_fast[3:])[0].polls == "fast"
    with pytest.raises(ValueError):
        supernode_argv("127.0.0.1:9091", 9100, 1, 4, None, clientapp_mode="lukewarm")


def test_control_channel_round_trip_and_end_of_file():
    from graphfl.deploy.warm import Channel

    a_r, b_w = os.pipe()
    b_r, a_w = os.pipe()
    a, b = Channel(a_r, a_w), Channel(b_r, b_w)
    big = {"op": "task", "token": "x" * 200_000}            # more than a pipe buffer: read in pieces
    sender = threading.Thread(target=lambda: (a.send(big), a.send({"op": "exit"})))
    sender.start()
    assert b.recv(timeout=10) == big and b.recv(timeout=10) == {"op": "exit"}
    sender.join(timeout=10)
    assert a.recv(timeout=0.05) is None
    b.close()
    with pytest.raises(EOFError):
        a.recv(timeout=5)
    a.close()


def test_teardown_kills_children_that_cleared_the_marker(tmp_path):
    """A child started with an empty environment (no GRAPHFL_LAUNCH_ID) that ignores SIGTERM is
    still found (by PID, as a descendant) and killed, and nothing else is."""
    from graphfl.deploy.processes import MARKER, ProcessGroup, marked_pids, process_table

    child_code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    parent_code = (f"import subprocess, sys, time; p = subprocess.Popen([{sys.executable!r}, '-c', {child_code!r}], env={{}}); "
                   "print(p.pid, flush=True); time.sleep(120)")
    group = ProcessGroup(tmp_path / "logs")
    proc = group.start("parent", [sys.executable, "-c", parent_code])
    deadline = time.monotonic() + 30
    while not proc.log_path.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(proc.log_path.read_text().split()[0])
    time.sleep(0.3)
    assert MARKER.encode() not in Path(f"/proc/{child}/environ").read_bytes()
    assert child not in marked_pids(group.launch_id)
    killed = group.stop(grace=2.0)
    assert child in killed
    time.sleep(0.2)
    state = process_table().get(child)
    assert state is None or state[2] == "Z"


def test_processes_find_flowers_commands_without_an_activated_environment(tmp_path, monkeypatch):
    """`.venv/bin/graphfl run` without `activate`: Flower's SuperLink starts `flower-superexec` by
    name, so every process graphfl starts has the interpreter's bin folder on PATH."""
    import shutil

    from graphfl.deploy.processes import ProcessGroup, with_interpreter_bin

    here = str(Path(sys.executable).parent)
    if not (Path(here) / "flower-superexec").exists():
        pytest.skip(f"flower-superexec is not installed next to {sys.executable}")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # what a shell without `activate` has
    assert shutil.which("flower-superexec") is None or not shutil.which("flower-superexec").startswith(here)
    proc = ProcessGroup(tmp_path / "logs").start("probe", ["/bin/sh", "-c", "command -v flower-superexec"])
    assert proc.popen.wait(30) == 0
    assert proc.log_path.read_text().strip() == str(Path(here) / "flower-superexec")
    # the order of PATH is kept otherwise, and the folder is never listed twice
    assert with_interpreter_bin(f"/a{os.pathsep}{here}{os.pathsep}/b").split(os.pathsep).count(here) == 1


# ---------------------------------------------------------------------------------------------
# end to end: real SuperLink / SuperNodes / executors / workers
# ---------------------------------------------------------------------------------------------
SMALL = {"task": "digits", "nodes": 2, "rounds": 2, "train.local-steps": 5, "train.lr": 0.1,
         "connect-timeout": 120, "round-timeout": 120}


def _curve(out: Path, method: str) -> list[dict]:
    doc = json.loads((out / "run.json").read_text())
    assert doc["status"] == "completed", doc.get("error")
    return doc["methods"][method]["curve"]


def _traces(out: Path, i: int) -> list[dict]:
    path = out / "logs" / f"warm-{i}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _flower_pids(out: Path) -> list[int]:
    from graphfl.deploy.processes import pids_with_env

    return pids_with_env("FLWR_HOME", str((out / ".flwr").resolve()))


def _assert_nothing_left(out: Path, also: dict[int, int] | None = None) -> None:
    from graphfl.deploy.processes import process_table

    deadline = time.monotonic() + 10
    while _flower_pids(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _flower_pids(out) == []
    table = process_table()
    alive = [pid for pid, start in (also or {}).items() if pid in table and table[pid][1] == start and table[pid][2] != "Z"]
    assert alive == []


@pytest.mark.e2e
def test_warm_and_cold_give_identical_curves(tmp_path):
    """Same config, both ClientApp modes: identical run.json curves; warm ran every message of a
    node in one worker process (torch imported once), and nothing is left after either run."""
    from graphfl.common.config import parse_run_config
    from graphfl.deploy.run import run_experiment

    curves = {}
    for mode in ("warm", "cold"):
        out = run_experiment(parse_run_config({**SMALL, "strategy": "fedavg", "engine": "local-deployment",
                                               "out-dir": str(tmp_path / mode)}), clientapp_mode=mode)
        curves[mode] = _curve(out, "fedavg")
        _assert_nothing_left(out)
        env = json.loads((out / "run.json").read_text())["env"]   # on a verified Flower every fast path ran
        assert env["flower_fast_paths"] == {"grid-handshake-retry": True, "bounded-pull": True,
                                            "object-io-threads": True, "array-fewer-copies": True}
    warm, cold = curves["warm"], curves["cold"]
    assert [r["round"] for r in warm] == [r["round"] for r in cold] == [0, 1, 2]
    for w, c in zip(warm, cold):
        for key in ("test_loss", "test_acc", "train_loss"):
            if c.get(key) is None:
                assert w.get(key) is None
            else:
                assert w[key] == pytest.approx(c[key], abs=1e-6, rel=0)
    assert warm[1]["client_boot_seconds"] >= 0 and cold[1]["client_boot_seconds"] > 0
    out = tmp_path / "warm"
    for i in range(SMALL["nodes"]):
        tasks = _traces(out, i)
        assert len(tasks) == SMALL["rounds"] + 2                       # join, rounds, final evaluation
        assert all(t["status"] == "completed" for t in tasks)
        assert len({t["worker_pid"] for t in tasks}) == 1               # one warm worker served them all
    assert not (tmp_path / "cold" / "logs" / "warm-0.jsonl").exists()
    # the server's exchange trace: join, each round, final evaluation; each reply pulled after the
    # push and after the worker that served it pushed its reply (one wall clock on one machine)
    exchanges = [json.loads(line) for line in (out / "logs" / "exchange.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["round"]) for e in exchanges] == [("join", 0), ("train", 1), ("train", 2), ("evaluate", 3)]
    for r, e in enumerate(exchanges):
        assert e["start"] <= e["pushed"] <= min(e["pulled"].values()) <= max(e["pulled"].values()) <= e["end"]
        assert len(e["pulled"]) == e["messages"] == SMALL["nodes"] and e["polls"] >= 1
        if e["kind"] != "join":   # join replies are keyed by node id, the rest by partition id
            for i in range(SMALL["nodes"]):
                assert _traces(out, i)[r]["times"]["reply"] <= e["pulled"][str(i)]


@pytest.mark.e2e
def test_worker_crash_is_reported_at_once_and_the_worker_restarts(tmp_path, monkeypatch):
    """The ClientApp of partition 0 kills its process in round 1: the server gets an error reply
    within seconds (not after round-timeout), a new worker serves round 2, the run completes."""
    from graphfl.common.config import parse_run_config
    from graphfl.deploy.run import run_experiment

    marker = tmp_path / "crashed"
    monkeypatch.setenv("GRAPHFL_PLUGINS", "graphfl.tests.test_warm_workers")
    monkeypatch.setenv(CRASH_MARKER_ENV, str(marker))
    values = {**SMALL, "strategy": "warmcrash", "rounds": 2, "round-timeout": 200, "engine": "local-deployment",
              "out-dir": str(tmp_path / "run")}
    out = run_experiment(parse_run_config(values), clientapp_mode="warm")
    rows = _curve(out, "warmcrash")
    assert marker.is_file()
    assert "0" in rows[1]["failed"] and "died" in rows[1]["failed"]["0"]
    assert rows[1]["seconds"] < 100                                     # not the 200 s round-timeout
    assert rows[2]["clients_ok"] == SMALL["nodes"] and "failed" not in rows[2]
    assert rows[2]["server"]["counts"]["0"] == 1                        # the crashed round left no state
    tasks = _traces(out, 0)
    assert [t["status"] for t in tasks].count("crashed") == 1
    assert len({t["worker_pid"] for t in tasks if "worker_pid" in t}) == 2
    _assert_nothing_left(out)


@pytest.mark.e2e
def test_ctrl_c_in_warm_mode_leaves_no_process(tmp_path):
    """SIGINT to `graphfl run` (warm) mid-run: exit 130, and every SuperNode, executor and warm
    worker seen during the run (recorded by PID and start time) is gone."""
    from graphfl.deploy.processes import process_table

    out = tmp_path / "run"
    exe = Path(sys.executable).with_name("graphfl")
    with (tmp_path / "stdout").open("w") as fh:
        proc = subprocess.Popen([str(exe), "run", "--nodes", "2", "--clientapp-mode", "warm", "--rounds", "30",
                                 "--set", "train.local-steps=5", "--out", str(out)],
                                stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=default_sigint)
        deadline = time.monotonic() + 240
        progress = out / "progress.jsonl"
        while time.monotonic() < deadline and not (progress.is_file() and progress.read_text().strip()):
            assert proc.poll() is None, (tmp_path / "stdout").read_text()
            time.sleep(0.2)
        assert progress.is_file(), "the run never reported progress"
        table = process_table()
        seen = {pid: table[pid][1] for pid in _flower_pids(out) if pid in table}
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    for pid in seen]
        assert sum("graphfl.deploy.warm worker" in c for c in commands) == 2, commands
        assert sum("graphfl.deploy.warm executor" in c for c in commands) == 2, commands
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
    assert code == 130, (tmp_path / "stdout").read_text()
    _assert_nothing_left(out, seen)


def _supernode_main_with(monkeypatch, flower_supernode, flower_args):
    """Run the SuperNode wrapper's main (fast polls, cold) with Flower's entry point replaced."""
    import flwr.supernode.cli as flower_cli
    from flwr.supercore.object_store.object_store_factory import ObjectStoreFactory
    from flwr.supernode import start_client_internal as sci

    from graphfl.deploy import supernode as wrapper

    for name in ("_pull_and_store_message", "pull_objects", "time"):   # install_fast_polls wraps these
        monkeypatch.setattr(sci, name, getattr(sci, name))
    monkeypatch.setattr(ObjectStoreFactory, "store", ObjectStoreFactory.store)   # restored after the test
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(flower_cli, "flower_supernode", flower_supernode)
    return wrapper.main(["--clientapp-mode", "cold", "--polls", "fast", "--", *flower_args])


def test_a_supernode_whose_main_loop_returns_exits_with_a_failure(monkeypatch):
    """Flower logs a failed SuperNode main loop and returns normally (exit code 0): the wrapper
    must report it as a failure, or systemd's Restart=on-failure never restarts the node."""
    ran: list[list[str]] = []
    code = _supernode_main_with(monkeypatch, lambda: ran.append(list(sys.argv)),
                                ["--insecure", "--superlink", "127.0.0.1:9"])
    assert ran and ran[0][0] == "flower-supernode" and "--superlink" in ran[0]
    assert code == 1


def test_a_stopped_supernode_keeps_flowers_exit_code(monkeypatch):
    from graphfl.deploy import supernode as wrapper

    def stopped() -> None:   # a stop signal: Flower's flwr_exit raises SystemExit(0)
        raise SystemExit(0)

    with pytest.raises(SystemExit) as exc:
        _supernode_main_with(monkeypatch, stopped, ["--insecure"])
    assert wrapper._exit_code(exc.value) == 0
    assert wrapper._exit_code(SystemExit(None)) == 0 and wrapper._exit_code(SystemExit("boom")) == 1
