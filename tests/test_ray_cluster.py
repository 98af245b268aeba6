"""``graphfl run --engine simulation --ray-address``: a simulation that joins an existing Ray cluster.

The end-to-end test starts a real two-node Ray cluster on this machine (``ray start --head`` and
``ray start --address``, one CPU each, each node with its own temp dir so no other Ray user on
the machine finds it), runs ``graphfl run`` on it and checks that Flower's ClientApp actors ran
on both nodes and that the numbers equal the in-process engine. Teardown stops only the two
process groups it started (never ``ray stop``: other runs use Ray on the same machine).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from graphfl.common.config import ConfigError, parse_run_config
from graphfl.common.ports import free_ports
from graphfl.deploy import ray_cluster
from graphfl.deploy.run import run_experiment
from graphfl.server.inprocess import run_federated_inprocess
from graphfl.tests.cli_runner import graphfl_cli

TINY = {"task": "digits", "nodes": 2, "rounds": 2, "train.local-steps": 5, "train.lr": 0.1,
        "connect-timeout": 90, "round-timeout": 120, "strategy": "fedavg"}
START_WAIT_S = 120.0
STOP_WAIT_S = 5.0


def closed_port() -> int:
    """A local TCP port nobody listens on (bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_bad_ray_addresses_are_refused_naming_the_option(tmp_path):
    out = tmp_path / "never"
    for address, says in (("not-an-address", "HOST:PORT"), ("ray://10.0.0.5:10001", "not a Ray Client URL")):
        with pytest.raises(ConfigError, match=f"--ray-address .*{says}"):
            run_experiment(parse_run_config({**TINY, "engine": "simulation", "out-dir": str(out)}), ray_address=address)
    started = time.monotonic()
    with pytest.raises(ConfigError, match="--ray-address 127.0.0.1:.*nothing answers there"):
        run_experiment(parse_run_config({**TINY, "engine": "simulation", "out-dir": str(out)}),
                       ray_address=f"127.0.0.1:{closed_port()}")
    assert time.monotonic() - started < 10
    with pytest.raises(ConfigError, match="--ray-address .*only a simulation"):
        run_experiment(parse_run_config({**TINY, "engine": "inprocess", "out-dir": str(out)}),
                       ray_address="127.0.0.1:6379")
    assert not out.exists()   # refused before anything was written


def test_the_environment_address_is_ignored_by_other_engines(monkeypatch):
    monkeypatch.setenv(ray_cluster.ENV_VAR, f"127.0.0.1:{closed_port()}")
    assert ray_cluster.resolve_address(None) == os.environ[ray_cluster.ENV_VAR]
    from graphfl.deploy.run import _ray_cluster

    assert _ray_cluster(parse_run_config({**TINY, "engine": "inprocess"}), None, None) is None
    with pytest.raises(ConfigError, match=r"\$GRAPHFL_RAY_ADDRESS .*nothing answers there"):
        _ray_cluster(parse_run_config({**TINY, "engine": "simulation"}), None, None)


def test_a_simulation_without_an_address_starts_its_own_ray():
    assert ray_cluster.superlink_env(None) == {"RAY_ADDRESS": "local"}
    cluster = ray_cluster.RayCluster("10.0.0.5:6379", 2, 8.0, 0.0, "2.55.1")
    assert ray_cluster.superlink_env(cluster) == {"RAY_ADDRESS": "10.0.0.5:6379"}


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    with log.open("wb") as fh:
        return subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)


def _wait_started(proc: subprocess.Popen[bytes], log: Path, what: str) -> None:
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "Ray runtime started" in text:
            return
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with code {proc.returncode}:\n{text[-3000:]}")
        time.sleep(0.5)
    pytest.fail(f"{what} did not start within {START_WAIT_S:.0f} s:\n{log.read_text(errors='replace')[-3000:]}")


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group this test started, SIGKILL it after :data:`STOP_WAIT_S`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                proc.poll()
                return
            proc.poll()
            time.sleep(0.3)


def _actor_logs(node_dir: Path) -> list[Path]:
    """The worker logs of this node's ``ClientAppActor`` processes (Ray's ``:actor_name:`` line)."""
    logs = node_dir / "session_latest" / "logs"
    return [p for p in sorted(logs.glob("worker-*.out"))
            if ":actor_name:ClientAppActor" in p.read_text(errors="replace")]


@pytest.mark.e2e
def test_simulation_joins_a_two_node_ray_cluster_and_matches_inprocess(tmp_path):
    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed (pip install 'graphfl[simulation]')")
    ray = str(Path(sys.executable).with_name("ray"))
    # Ray's unix sockets live under the temp dir: a short path (pytest's tmp_path can pass 107 bytes)
    root = Path(tempfile.mkdtemp(prefix="gfray-", dir="/tmp"))
    port, client_port, dash_port, agent_head, agent_worker = free_ports(5)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(_start([ray, "start", "--head", "--block", "--port", str(port), "--num-cpus", "1",
                             "--num-gpus", "0", "--temp-dir", str(root / "head"), "--include-dashboard", "false",
                             "--dashboard-port", str(dash_port), "--ray-client-server-port", str(client_port),
                             "--dashboard-agent-listen-port", str(agent_head), "--disable-usage-stats"],
                            root / "head.log"))
        # while the head starts: a listening port that is no Ray head is refused within the bound
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            other.listen()
            started = time.monotonic()
            with pytest.raises(ConfigError, match="--ray-address .*no Ray cluster answered within 5 s"):
                ray_cluster.probe(f"127.0.0.1:{other.getsockname()[1]}", timeout=5.0)
            assert time.monotonic() - started < 30
        _wait_started(procs[0], root / "head.log", "the Ray head")
        address = f"127.0.0.1:{port}"
        procs.append(_start([ray, "start", "--address", address, "--block", "--num-cpus", "1", "--num-gpus", "0",
                             "--temp-dir", str(root / "worker"), "--dashboard-agent-listen-port", str(agent_worker),
                             "--disable-usage-stats"], root / "worker.log"))
        _wait_started(procs[1], root / "worker.log", "the Ray worker node")

        out = tmp_path / "run"
        res = graphfl_cli("run", "--engine", "simulation", "--ray-address", address, "--task", "digits",
                          "--strategy", "fedavg", "--nodes", "2", "--rounds", "2", "--set", "train.local-steps=5",
                          "--set", "train.lr=0.1", "--set", "connect-timeout=90", "--set", "round-timeout=120",
                          "--out", str(out), timeout=400)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        doc = json.loads((out / "run.json").read_text())
        assert doc["status"] == "completed", doc.get("error")
        assert doc["ray_cluster"]["address"] == address
        assert (doc["ray_cluster"]["nodes"], doc["ray_cluster"]["cpus"]) == (2, 2.0)
        # one CPU per node and one per client: Flower's two actors ran one on each node of this cluster
        assert _actor_logs(root / "head") and _actor_logs(root / "worker")

        ref, _ = run_federated_inprocess(parse_run_config({**TINY, "engine": "inprocess"}))
        got, want = doc["methods"]["fedavg"]["curve"], ref["methods"]["fedavg"]["curve"]
        assert [r["round"] for r in got] == [r["round"] for r in want] == [0, 1, 2]
        for g, w in zip(got, want):
            assert g["test_loss"] == pytest.approx(w["test_loss"], rel=1e-5, abs=1e-6)
            assert g["test_acc"] == pytest.approx(w["test_acc"], rel=1e-5, abs=1e-6)
    finally:
        stoppers = [threading.Thread(target=_stop_group, args=(p,)) for p in reversed(procs)]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join(timeout=2 * STOP_WAIT_S + 5)
        shutil.rmtree(root, ignore_errors=True)
