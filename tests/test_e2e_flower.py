"""End-to-end runs on real Flower processes (SuperLink, SuperNodes, Ray simulation).

Time goes into starting processes (a SuperLink, SuperNodes, one ``flwr-clientapp`` process per
message, ``flwr`` CLI calls), not into training. So tests that only need *a* running deployment
share one per kind: a 3-SuperNode TLS federation (:class:`TestOneTlsFederation`: the probe,
FeSEM and BiG-FL runs) and a 2-SuperNode TLS federation with SuperNode authentication
(:class:`TestAuthenticatedFederation`: the refused key and the remote user's run). Models and
rounds are tiny, and tests that own their processes (``graphfl run``'s own federation, a
restarted SuperNode, Ctrl-C, Ray) use 2 SuperNodes where 3 add nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from graphfl.common.config import parse_run_config
from graphfl.common.ports import free_port
from graphfl.deploy.federation import LocalFederation
from graphfl.deploy.processes import pids_with_env
from graphfl.deploy.run import run_experiment
from graphfl.server.inprocess import run_federated_inprocess
from graphfl.tests.cli_runner import default_sigint, graphfl_cli

TINY = {"task": "digits", "nodes": 2, "rounds": 2, "train.local-steps": 5, "train.lr": 0.1,
        "connect-timeout": 90, "round-timeout": 120}
PROBE = "graphfl.tests.probe_strategy"
SHARED_NODES = 3
STATUS_EVERY = 30.0   # `flwr list` costs a CLI process; fed.health() already notices a dead SuperLink


def curve(out: Path, method: str) -> list[dict]:
    doc = json.loads((out / "run.json").read_text())
    assert doc["status"] == "completed", doc.get("error")
    return doc["methods"][method]["curve"]


def assert_no_processes_left(out: Path) -> None:
    home = str((out / ".flwr").resolve())
    deadline = time.monotonic() + 5
    while pids_with_env("FLWR_HOME", home) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pids_with_env("FLWR_HOME", home) == []


def assert_matches_inprocess(out: Path, cfg_values: dict, method: str = "fedavg") -> None:
    ref, _ = run_federated_inprocess(parse_run_config({**cfg_values, "engine": "inprocess"}))
    got = curve(out, method)
    want = ref["methods"][method]["curve"]
    assert [r["round"] for r in got] == [r["round"] for r in want]
    for g, w in zip(got, want):
        assert g["test_loss"] == pytest.approx(w["test_loss"], rel=1e-5, abs=1e-6)
        if w.get("test_acc") is None:
            assert g.get("test_acc") is None
        else:
            assert g["test_acc"] == pytest.approx(w["test_acc"], rel=1e-5, abs=1e-6)


@pytest.mark.e2e
def test_local_deployment_with_tls_matches_inprocess(tmp_path):
    values = {**TINY, "strategy": "fedavg", "engine": "local-deployment", "out-dir": str(tmp_path)}
    out = run_experiment(parse_run_config(values))
    rows = curve(out, "fedavg")
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all(r["test_loss"] is not None for r in rows)
    assert rows[1]["bytes_down"] > 0 and rows[1]["bytes_up"] > 0 and rows[1]["seconds"] > 0
    assert (out / "run.md").is_file() and (out / "run.png").is_file()
    assert (out / "certs" / "ca.crt").is_file()                    # TLS was on
    log = (out / "logs" / "superlink.log").read_text()
    assert "https://" in log.lower() or "ssl" in log.lower()
    assert_no_processes_left(out)
    assert_matches_inprocess(out, values)


@pytest.mark.e2e
def test_simulation_engine_matches_inprocess(tmp_path):
    values = {**TINY, "strategy": "fedavg", "engine": "simulation", "out-dir": str(tmp_path)}
    out = run_experiment(parse_run_config(values))
    assert [r["round"] for r in curve(out, "fedavg")] == [0, 1, 2]
    assert_no_processes_left(out)
    assert_matches_inprocess(out, values)


@pytest.mark.e2e
def test_supernode_restart_is_mapped_back_to_its_partition(tmp_path, monkeypatch):
    """A restarted SuperNode gets a new node id; the server finds its partition again."""
    monkeypatch.setenv("GRAPHFL_PLUGINS", "graphfl.tests.probe_strategy")
    # stock (cold) SuperNodes on both sides: their rounds take seconds, so the restarted node
    # registers and is joined while the run goes on (warm rounds would end the run first)
    rounds = 4
    values = {**TINY, "strategy": "probe", "nodes": 2, "rounds": rounds, "round-timeout": 90,
              "engine": "local-deployment", "out-dir": str(tmp_path)}
    from graphfl.deploy.federation import supernode_argv
    from graphfl.deploy.run import prepare, write_overrides
    from graphfl.server.flower_app import write_app_dir

    cfg, out = prepare(parse_run_config(values))
    with LocalFederation(out, 2, tls=True, clientapp_mode="cold") as fed:
        sub = fed.submitter()
        handle = sub.submit(write_app_dir(out / "app"), write_overrides(out / "rc.toml", cfg), out)
        restarted = False

        def on_event(ev):
            nonlocal restarted
            if ev.get("event") == "round" and ev.get("round") == 1 and not restarted:
                restarted = True
                node = next(p for p in fed.group.procs if p.name == "supernode-1")
                node.popen.send_signal(signal.SIGTERM)
                node.popen.wait(timeout=10)
                fed.group.start("supernode-1b", supernode_argv(fed.address, free_port(), 1, 2,
                                                               fed.tls_files.ca_cert))

        sub.wait(handle, on_event, timeout=300, health=fed.health, status_every=STATUS_EVERY)
    rows = curve(out, "probe")
    assert restarted
    last = rows[rounds]["server"]
    assert last["tags_ok"] and last["sums_ok"]
    assert "1" in last["counts"] and last["counts"]["0"] == rounds
    assert last["counts"]["1"] < rounds           # fresh SuperNode: its client state started anew
    assert_no_processes_left(out)




def test_bad_config_fails_fast_with_valid_choices(tmp_path):
    t0 = time.monotonic()
    res = graphfl_cli("run", "--strategy", "fedmagic", "--out", str(tmp_path))
    assert res.returncode == 2
    assert "valid strategies" in res.stderr and "fedavg" in res.stderr
    res = graphfl_cli("run", "--set", "train.lr=-1", "--out", str(tmp_path))
    assert res.returncode == 2 and "train.lr" in res.stderr
    cfg = tmp_path / "x.toml"
    cfg.write_text("roundz = 3\n")
    res = graphfl_cli("run", "--config", str(cfg), "--out", str(tmp_path))
    assert res.returncode == 2 and "roundz" in res.stderr
    assert time.monotonic() - t0 < 60


def test_missing_data_file_fails_before_starting_processes(tmp_path):
    out = tmp_path / "out"
    res = graphfl_cli("run", "--task", "mnist", "--data-dir", str(tmp_path / "nodata"), "--out", str(out))
    assert res.returncode == 1
    assert "train-images-idx3-ubyte.gz" in res.stderr.replace("\n", "")
    assert not (out / "logs").exists()           # nothing was started


@pytest.mark.e2e
def test_unreachable_superlink_is_a_clear_bounded_error(tmp_path):
    port = free_port()
    t0 = time.monotonic()
    res = graphfl_cli("run", "--superlink", f"127.0.0.1:{port}", "--insecure", "--out", str(tmp_path))
    assert res.returncode == 1 and f"127.0.0.1:{port}" in res.stderr and "cannot reach" in res.stderr
    node = graphfl_cli("supernode", "--superlink", f"127.0.0.1:{port}", "--insecure", "--partition-id", "0",
                       "--num-partitions", "1", "--port", str(free_port()), "--max-wait-time", "3", timeout=60)
    assert node.returncode != 0
    assert time.monotonic() - t0 < 60


def kill_leftovers(proc: subprocess.Popen | None, out: Path) -> None:
    """After a failed run: kill the CLI and every process of its deployment (marked by its FLWR_HOME)."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in pids_with_env("FLWR_HOME", str((out / ".flwr").resolve())):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.e2e
def test_ctrl_c_stops_every_process(tmp_path):
    """SIGINT during a deployment run: exit code 130, no SuperLink/SuperNode/ClientApp left."""
    out = tmp_path / "run"
    exe = Path(sys.executable).with_name("graphfl")
    proc = None
    try:
        with (tmp_path / "stdout").open("w") as fh:
            proc = subprocess.Popen([str(exe), "run", "--nodes", "2", "--rounds", "20", "--out", str(out)],
                                    stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=default_sigint)
            deadline = time.monotonic() + 120
            progress = out / "progress.jsonl"
            while time.monotonic() < deadline and not (progress.is_file() and progress.read_text().strip()):
                assert proc.poll() is None, (tmp_path / "stdout").read_text()
                time.sleep(0.2)
            assert progress.is_file(), "the run never reported progress"
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=60)
        assert code == 130, (tmp_path / "stdout").read_text()
        assert_no_processes_left(out)
    finally:
        kill_leftovers(proc, out)                    # a failed test leaves no 20-round run behind
    doc = json.loads((out / "run.json").read_text())   # what was measured before Ctrl-C is kept
    assert doc["methods"]["fedavg"]["curve"][0]["round"] == 0


@pytest.fixture(scope="class")
def tls_federation(tmp_path_factory):
    """One TLS SuperLink + 3 SuperNodes for every run of :class:`TestOneTlsFederation`.

    The probe plug-in is in the processes' environment (the ServerApp and every ClientApp
    inherit it); it only adds the test algorithm ``probe`` to the registry.
    """
    root = tmp_path_factory.mktemp("tls-federation")
    with LocalFederation(root / "fed", SHARED_NODES, tls=True, env={"GRAPHFL_PLUGINS": PROBE}) as fed:
        yield fed
        fed.health()                                 # the SuperLink survived every run
    assert_no_processes_left(root / "fed")


def submit(fed: LocalFederation, values: dict, timeout: float = 400) -> Path:
    """Submit one graphfl run to ``fed`` with ``flwr run`` and wait until it is done."""
    from graphfl.deploy.run import prepare, write_overrides
    from graphfl.server.flower_app import write_app_dir

    cfg, out = prepare(parse_run_config(values))
    sub = fed.submitter()
    handle = sub.submit(write_app_dir(out / "app"), write_overrides(out / "rc.toml", cfg), out)
    sub.wait(handle, timeout=timeout, health=fed.health, status_every=STATUS_EVERY)
    return out


@pytest.mark.e2e
class TestOneTlsFederation:
    """Several runs, one after another, on one running TLS deployment (as a lab's server would)."""

    def test_per_node_payloads_and_client_state_in_deployment(self, tls_federation, tmp_path, monkeypatch):
        monkeypatch.setenv("GRAPHFL_PLUGINS", PROBE)
        values = {**TINY, "strategy": "probe", "nodes": SHARED_NODES, "rounds": 3,
                  "engine": "local-deployment", "out-dir": str(tmp_path)}
        out = submit(tls_federation, values)
        rows = curve(out, "probe")
        for r in (1, 2, 3):
            server = rows[r]["server"]
            assert server["tags_ok"] is True and server["sums_ok"] is True
            assert server["counts"] == {"0": r, "1": r, "2": r}           # context.state persisted

    @pytest.mark.parametrize("strategy", ["fesem", "bigfl", "apflgate", "jgesr", "pfedgraph"])
    def test_graph_aware_strategy_in_a_real_deployment_matches_inprocess(self, tls_federation, tmp_path, strategy):
        """Issues 3, 11 and 12: graph-aware strategies run on real SuperNodes (one federation, one run each).

        apflgate keeps v_i, α_i, δ_i in context.state across the 2 rounds, with 4-bit quantised uploads
        (seeded codec, decoded by the server, Q(Δ_i) kept by the client). JGESR runs behind the noisy
        channel (the ClientApp's mod): the masks reach the server (its logged missing fraction) and
        the noisy run still equals the in-process one.
        """
        channel = {"channel.noise": 0.1, "channel.missing": 0.2} if strategy == "jgesr" else {}
        values = {"task": "synthetic-multicenter", "nodes": SHARED_NODES, "rounds": 2, "train.local-steps": 5,
                  "train.lr": 0.1, "connect-timeout": 90, "round-timeout": 120, "engine": "local-deployment",
                  "strategy": strategy, "out-dir": str(tmp_path / strategy), **channel}
        if strategy == "apflgate":
            values.update({"compress.kind": "quant", "compress.bits": 4})
        out = submit(tls_federation, values)
        rows = curve(out, strategy)
        assert [r["round"] for r in rows] == [0, 1, 2]
        assert rows[2]["clients_ok"] == SHARED_NODES and "failed" not in rows[2]
        if strategy == "apflgate":
            assert rows[2]["bytes_up"] < 0.2 * rows[2]["bytes_up_decoded"]
        if channel:
            assert 0.05 < rows[1]["server"]["missing_fraction"] < 0.5   # the masks reached the server
            graph = np.asarray(rows[2]["server"]["graph"])
            assert graph.shape == (SHARED_NODES, SHARED_NODES) and np.allclose(graph, graph.T)
        assert_matches_inprocess(out, values, strategy)

    def test_gnn_task_state_dict_and_graph_batches_in_a_real_deployment(self, tls_federation, tmp_path, real_data):
        """Issue 12: APFLGate on BBBP — a PyG model's state dict crosses the Flower wire, ClientApp
        processes batch molecule graphs (personal and global model, client state kept), and ROC-AUC
        reaches the server; the run equals the in-process driver's."""
        root = real_data("bbbp/BBBP.csv")
        values = {"task": "bbbp", "nodes": SHARED_NODES, "rounds": 2, "train.local-steps": 5, "train.lr": 0.1,
                  "data.max-samples": 300, "data-dir": str(root), "connect-timeout": 90, "round-timeout": 180,
                  "engine": "local-deployment", "strategy": "apflgate", "out-dir": str(tmp_path / "bbbp")}
        out = submit(tls_federation, values)
        rows = curve(out, "apflgate")
        assert rows[2]["clients_ok"] == SHARED_NODES and "failed" not in rows[2]
        assert rows[2].get("test_auc") is not None
        assert_matches_inprocess(out, values, "apflgate")
        ref, _ = run_federated_inprocess(parse_run_config({**values, "engine": "inprocess"}))
        want = ref["methods"]["apflgate"]["curve"]
        for g, w in zip(rows, want):
            assert (g.get("test_auc") is None) == (w.get("test_auc") is None)
            if w.get("test_auc") is not None:
                assert g["test_auc"] == pytest.approx(w["test_auc"], rel=1e-5)


@pytest.fixture(scope="class")
def auth_federation(tmp_path_factory):
    """A TLS SuperLink with SuperNode authentication and 2 registered SuperNodes, for
    :class:`TestAuthenticatedFederation` (the multi-host recipe with ``--node-auth``).
    """
    root = tmp_path_factory.mktemp("auth-federation")
    with LocalFederation(root / "fed", 2, tls=True, node_auth=True) as fed:
        yield fed
        fed.health()
    assert_no_processes_left(root / "fed")


@pytest.mark.e2e
class TestAuthenticatedFederation:
    """A deployment as the README's multi-host recipe builds it, with ``--node-auth``."""

    def test_supernode_authentication_admits_only_registered_keys(self, auth_federation, tmp_path):
        """`graphfl certs --node-keys` material + `flwr supernode register`: registered SuperNodes
        join (start() waits for their ids); an unregistered key is refused."""
        from graphfl.common.certs import generate_node_keys
        from graphfl.deploy.federation import supernode_argv

        fed = auth_federation
        rogue_key, _ = generate_node_keys(tmp_path / "rogue", 1)[0]
        rogue = fed.group.start("rogue", supernode_argv(fed.address, free_port(), 0, 2, fed.tls_files.ca_cert,
                                                       auth_key=rogue_key, max_wait_time=20))
        try:
            code = rogue.popen.wait(timeout=60)
        finally:
            fed.group.procs.remove(rogue)
            if rogue.popen.poll() is None:
                rogue.popen.kill()
                rogue.popen.wait()
        assert code != 0
        assert "2004" in rogue.log_path.read_text() or "Failed to activate" in rogue.log_path.read_text()
        for proc in fed.group.procs:
            assert proc.popen.poll() is None        # the registered SuperNodes are still running

    def test_submit_to_a_running_superlink_like_a_remote_user(self, auth_federation, tmp_path):
        """Multi-host recipe, step 5: `graphfl run --superlink HOST:PORT --root-certificates CA`
        against SuperLink/SuperNodes started separately (here on 127.0.0.1; the SuperNodes
        authenticate with registered keys, so this also runs a round on them)."""
        fed = auth_federation
        out = tmp_path / "results"
        res = graphfl_cli("run", "--superlink", fed.address, "--root-certificates", str(fed.tls_files.ca_cert),
                          "--nodes", "2", "--rounds", "1", "--set", "train.local-steps=5", "--out", str(out),
                          timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        rows = curve(out, "fedavg")                  # the ServerApp wrote them (same machine here)
        assert [r["round"] for r in rows] == [0, 1]
        wrong = graphfl_cli("run", "--superlink", fed.address, "--nodes", "2", "--out", str(tmp_path / "x"))
        assert wrong.returncode == 1 and "root-certificates" in wrong.stderr
