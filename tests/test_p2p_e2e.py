"""End-to-end: real peer processes on 127.0.0.1 (gRPC, TLS), no mocks."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from graphfl.deploy.p2p_launch import PeerProcesses, launch, prepare_network
from graphfl.p2p.config import load_network_file
from graphfl.p2p.driver import run_network_inprocess
from graphfl.p2p.oracles import make_oracle
from graphfl.p2p.peer import EXIT_REFUSED, problem_spec
from graphfl.tests.cli_runner import default_sigint

pytestmark = pytest.mark.e2e


def wait_for(cond, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_launch_torch_task_matches_inprocess_driver(tmp_path):
    """`graphfl p2p`'s launch(): DFL-GT on the synthetic-dfl task (torch MLP, float32), mutual TLS, vs one process.

    (Every registered algorithm is checked on small numpy problems by tests/test_p2p_contract.py;
    this one adds a torch model and the launcher's report.)
    """
    out = tmp_path / "run"
    rounds = 3
    result = launch("ring", 2, {"algorithm": "dfl-gt", "rounds": rounds, "problem": "synthetic-dfl", "alpha0": 0.3,
                                "standardize": True, "connect-timeout": 60},
                    out=out, progress=False, timeout=150, device="cpu")
    assert result["ok"], result["peers"]
    assert result["config"]["tls"] is True
    # --device reaches every peer, and each peer records the device it really used
    peer_docs = [json.loads((out / f"peer-{i}.json").read_text()) for i in range(2)]
    assert all(doc["device"] == "cpu" for doc in peer_docs)
    # each peer process keeps freed model-sized buffers (glibc; common/malloc.py) and says so
    want = "retain" if platform.libc_ver()[0] == "glibc" else "unsupported"
    assert [doc["malloc"] for doc in peer_docs] == [want, want]
    for name in ("p2p.json", "p2p.md", "p2p.png"):
        assert (out / name).is_file()
    curve = result["methods"]["dfl-gt"]["curve"]
    assert [c["round"] for c in curve] == list(range(1, rounds + 1)) and all(c["missing"] == [] for c in curve)
    assert curve[-1]["bytes"] > 0

    net = load_network_file(out / "network.toml")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        oracles = [make_oracle(i, problem_spec(net, i), partition=i) for i in range(2)]
        ref = run_network_inprocess(net.run.make_algorithm(), oracles, net.topology.mixing_matrix(), net.run.iterations)
    finally:
        torch.set_num_threads(threads)
    for i in range(2):
        with np.load(out / f"peer-{i}.npz") as z:
            np.testing.assert_allclose(z["theta"], ref.states[i].theta, rtol=0, atol=1e-6)
            np.testing.assert_allclose(z["tracker"], ref.states[i].tracker, rtol=0, atol=1e-6)


def test_socket_data_path_over_tls_matches_inprocess_driver(tmp_path):
    """`data-path = "socket"` with mutual TLS: the same iterates as one process, bytes counted as over gRPC."""
    out = tmp_path / "run"
    result = launch("ring", 3, {"algorithm": "dfl-gt", "rounds": 4, "problem": "linreg", "alpha0": 0.05,
                                "data-path": "socket", "connect-timeout": 60},
                    out=out, progress=False, timeout=120)
    assert result["ok"], result["peers"]
    assert result["config"]["tls"] is True
    docs = [json.loads((out / f"peer-{i}.json").read_text()) for i in range(3)]
    assert all(d["config"]["run"]["data_path"] == "socket" and d["stats"]["bytes_received"] > 0 for d in docs)
    assert "socket data path listening" in (out / "logs" / "peer-0.log").read_text()
    net = load_network_file(out / "network.toml")
    oracles = [make_oracle(i, problem_spec(net, i), partition=i) for i in range(3)]
    ref = run_network_inprocess(net.run.make_algorithm(), oracles, net.topology.mixing_matrix(), net.run.iterations)
    for i in range(3):
        with np.load(out / f"peer-{i}.npz") as z:
            np.testing.assert_allclose(z["theta"], ref.states[i].theta, rtol=0, atol=1e-12)


@pytest.mark.parametrize("data_path", ["grpc", "socket"])
def test_killed_peer_is_skipped_within_the_deadline_and_rejoins(tmp_path, data_path):
    """Peer 2 is killed, its neighbours skip it within the deadline, the same command restarts it and it rejoins."""
    deadline = 2.0
    net_file = prepare_network(tmp_path, "ring", 4, {
        "algorithm": "dfl-sgd", "problem": "linreg", "alpha0": 0.02, "rounds": 100_000, "min-round-seconds": 0.05,
        "round-timeout": deadline, "send-timeout": deadline, "connect-timeout": 30, "checkpoint-every": 0,
        "data-path": data_path}, insecure=True)
    with PeerProcesses(net_file, tmp_path, range(4)) as procs:
        wait_for(lambda: procs.status(2).get("round", 0) >= 5, 60, "peer 2 to reach round 5")
        procs.kill(2)
        killed_at = procs.status(2).get("round", 0)
        wait_for(lambda: 2 in (procs.status(1).get("missing") or []), 30, "peer 1 to skip peer 2")
        # count from the round at which peer 1 first skipped peer 2: the status file peer 2 left may lag its real round
        first_skip = procs.status(1).get("round", 0)
        # peer 2 stays down past the horizon (max-ahead = 4 rounds): its neighbours' messages are refused
        # at first, yet count (clamped) as evidence for skipping ahead, so it catches up all the same
        wait_for(lambda: procs.status(1).get("round", 0) >= first_skip + 6, 40, "peer 1 to go on without peer 2")
        procs.start(2)  # the same command again: it rejoins at the network's round
        wait_for(lambda: procs.status(2).get("state") == "running", 60, "peer 2 to run again")
        back = procs.status(1).get("round", 0)
        wait_for(lambda: procs.status(1).get("round", 0) >= back + 3 and procs.status(1).get("missing") == []
                 and procs.status(3).get("missing") == [], 60, "peers 1 and 3 to hear peer 2 again")
        procs.stop_all()  # SIGTERM: every peer stops after its current step and writes its results
    peers = {i: json.loads((tmp_path / f"peer-{i}.json").read_text()) for i in range(4)}
    assert all(p["outcome"] == "stopped" for p in peers.values()), {i: p["outcome"] for i, p in peers.items()}
    for i in (1, 3):  # the neighbours of peer 2 skipped it, each round within the deadline, then heard it again
        recs = peers[i]["records"]
        skipped = [r for r in recs if 2 in r["missing"]]
        assert len(skipped) >= 3
        assert max(r["comm_s"] for r in skipped) < deadline + 1.0
        first = next(k for k, r in enumerate(recs) if 2 in r["missing"])
        assert any(r["missing"] == [] for r in recs[first:])  # heard again (before SIGTERM stopped everyone)
    assert peers[2]["start_t"] > killed_at  # the restarted peer joined at the network's round
    log = (tmp_path / "logs" / "peer-1.log").read_text()
    assert "skipping neighbour(s) [2]" in log and "re-weighting (self)" in log


def test_mismatched_config_between_processes_is_refused(tmp_path):
    a = prepare_network(tmp_path / "a", "ring", 2, {"problem": "linreg", "rounds": 3, "connect-timeout": 5},
                        insecure=True)
    b_dir = tmp_path / "b"
    b_dir.mkdir()
    b = b_dir / "network.toml"
    text = a.read_text()
    assert "alpha0 = 0.1" in text
    b.write_text(text.replace("alpha0 = 0.1", "alpha0 = 0.7"))
    with PeerProcesses(a, tmp_path / "a", [0]) as pa, PeerProcesses(b, b_dir, [1]) as pb:
        assert pa.wait_all(time.monotonic() + 40) and pb.wait_all(time.monotonic() + 40)
        codes = {**pa.exit_codes(), **pb.exit_codes()}
    assert EXIT_REFUSED in codes.values()
    errors = [json.loads(f.read_text()).get("error") or "" for f in [tmp_path / "a" / "peer-0.json", b_dir / "peer-1.json"]]
    assert any("config hash differs" in e for e in errors), errors


def test_launcher_ctrl_c_tears_everything_down(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "graphfl.p2p", "p2p", "--algorithm", "dfl-sgd", "--topology", "ring", "--peers", "3",
           "--rounds", "1000", "--problem", "linreg", "--insecure", "--quiet", "--out", str(out),
           "--set", "min-round-seconds=0.1", "--set", "alpha0=0.01"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=default_sigint)
    try:
        wait_for(lambda: all((out / f"peer-{i}.status.json").is_file() and
                             json.loads((out / f"peer-{i}.status.json").read_text()).get("round", 0) >= 2
                             for i in range(3)), 60, "peers running")
        launcher.send_signal(signal.SIGINT)
        rc = launcher.wait(20)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert rc == 130, launcher.stdout.read().decode()
    time.sleep(0.5)
    left = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if str(out) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    left.append(pid)
            except OSError:
                pass
    assert left == [], f"orphan peer processes: {left}"


def _pids_with(text: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd + " ":
                out.append(int(pid))
    return out


def test_launcher_stops_everything_when_a_peer_crashes_under_fail_policy(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "graphfl.p2p", "p2p", "--algorithm", "dfl-sgd", "--topology", "ring", "--peers", "3",
           "--rounds", "100000", "--problem", "linreg", "--insecure", "--quiet", "--out", str(out),
           "--set", "min-round-seconds=0.05", "--set", "on-missing=fail", "--set", "round-timeout=2",
           "--set", "send-timeout=2"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: all((out / f"peer-{i}.status.json").is_file() and
                             json.loads((out / f"peer-{i}.status.json").read_text()).get("round", 0) >= 3
                             for i in range(3)), 60, "peers running")
        victim = _pids_with(f"--id 1 --out {out}")  # the peer process this test's launcher started
        assert len(victim) == 1
        t_kill = time.monotonic()
        os.kill(victim[0], signal.SIGKILL)
        rc = launcher.wait(90)  # round deadline + teardown + report (matplotlib) on a busy 2-core machine
        elapsed = time.monotonic() - t_kill
    finally:
        if launcher.poll() is None:
            launcher.kill()
    output = launcher.stdout.read().decode()
    assert rc == 1, output
    assert elapsed < 90  # round deadline 2 s + teardown + report, not the 100000-round bound (>= 5000 s)
    result = json.loads((out / "p2p.json").read_text())
    assert result["ok"] is False
    outcomes = {i: p["outcome"] for i, p in result["peers"].items()}
    assert outcomes["1"] != "done" and all(o != "done" for o in outcomes.values()), outcomes
    assert _pids_with(str(out)) == []
