"""Checkpoint and resume (issue 8, Flower side) and persistent client state (issue 12).

Unit tests: the server checkpoint's atomic write, refusals (other config, missing checkpoint,
completed run), the client state files' round selection, and every registered strategy resumed
in-process giving exactly the uninterrupted run. End-to-end (real processes on 127.0.0.1): a
SuperLink killed mid-run and ``graphfl run --resume`` finishing it with the uninterrupted
run's numbers and model; a SuperNode killed and restarted mid-run restoring its client state
from disk.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from graphfl.client.state_store import KEEP, StateStore, state_for_request, store_for
from graphfl.common import registry, wire
from graphfl.common.config import ConfigError, parse_run_config
from graphfl.deploy.run import prepare, prepare_resume
from graphfl.server import checkpoint
from graphfl.server.inprocess import run_federated_inprocess
from graphfl.tests.cli_runner import graphfl_cli

SMALL = {"task": "synthetic-multicenter", "nodes": 4, "train.local-steps": 2, "engine": "inprocess",
         "run-key": "unit"}


def builtin_strategies() -> list[str]:
    return [n for n in registry.names() if not registry.get(n).server_core.__module__.startswith("graphfl.tests")]


def losses(doc: dict, method: str) -> list[float | None]:
    return [row.get("test_loss") for row in doc["methods"][method]["curve"]]


# -- server checkpoint files ------------------------------------------------------------------

def _saved_core(tmp_path: Path):
    cfg = parse_run_config({**SMALL, "strategy": "fedavg", "rounds": 1})
    _, core = run_federated_inprocess(cfg)
    return cfg, core


def test_checkpoint_write_is_atomic_and_a_failed_write_keeps_the_previous_one(tmp_path, monkeypatch):
    cfg, core = _saved_core(tmp_path)
    d = tmp_path / "checkpoint"
    rows = {0: {"round": 0}, 1: {"round": 1, "seconds": 0.1}}
    checkpoint.save(d, server_round=1, cfg=cfg, core=core, rng=random.Random(3), active=[0, 1, 2, 3],
                    rows=rows, extra={})

    def crash(path: Path, text: str) -> None:
        raise OSError("disk full (injected)")

    monkeypatch.setattr(checkpoint, "atomic_write_text", crash)     # dies before the commit point
    with pytest.raises(OSError):
        checkpoint.save(d, server_round=2, cfg=cfg, core=core, rng=random.Random(4), active=[0, 1],
                        rows={**rows, 2: {"round": 2}}, extra={})
    monkeypatch.undo()
    ck = checkpoint.load(d, cfg)
    assert ck.round == 1 and ck.active == [0, 1, 2, 3] and sorted(ck.rows) == [0, 1]
    assert ck.rng.random() == random.Random(3).random()
    assert not list(d.glob(".*.tmp"))                                # no temporary file left behind
    # a partial (truncated) state file is detected, not unpickled
    pkl = d / ck.meta["pickle"]
    pkl.write_bytes(pkl.read_bytes()[:100])
    with pytest.raises(checkpoint.CheckpointError, match="checksum"):
        checkpoint.load(d, cfg)


def test_resume_with_another_config_is_refused_naming_the_keys(tmp_path):
    cfg, core = _saved_core(tmp_path)
    checkpoint.save(tmp_path, server_round=2, cfg=cfg, core=core, rng=random.Random(0), active=[0],
                    rows={}, extra={})
    meta = checkpoint.read_meta(tmp_path)
    other = parse_run_config({**SMALL, "strategy": "fedavg", "rounds": 1, "train.lr": 0.5, "seed": 7})
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.check_config(meta, other)
    msg = str(err.value)
    assert "train.lr" in msg and "seed" in msg and "\n" not in msg
    assert "local-steps" not in msg                                   # only the differing keys
    with pytest.raises(checkpoint.CheckpointError, match="below the checkpoint's round 2"):
        checkpoint.check_config(meta, parse_run_config({**SMALL, "strategy": "fedavg", "rounds": 1}))
    # what may change: more rounds, timeouts, folders, device
    checkpoint.check_config(meta, parse_run_config({**SMALL, "strategy": "fedavg", "rounds": 9, "round-timeout": 5,
                                                    "device": "cpu", "out-dir": "/elsewhere"}))


def test_resume_of_a_folder_without_checkpoint_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        prepare_resume(tmp_path)
    cfg, out = prepare(parse_run_config({**SMALL, "strategy": "fedavg", "rounds": 2, "out-dir": str(tmp_path / "r")}))
    assert cfg.run_key                                               # every graphfl run gets a run key
    with pytest.raises(ConfigError, match="no checkpoint"):
        prepare_resume(out)


# -- client state files ------------------------------------------------------------------------

def test_client_state_keeps_two_rounds_and_serves_round_t_from_a_round_before_t(tmp_path):
    store = StateStore(tmp_path, "key1", 3)
    for r in (1, 2, 3):
        store.save(r, {"v": np.full(2, float(r))})
    assert store.rounds() == [2, 3] and KEEP == 2
    assert StateStore(tmp_path, "key1", 4).rounds() == []            # keyed by partition id
    assert StateStore(tmp_path, "key2", 3).rounds() == []            # and by run key
    got = store.load_before(4)
    assert got is not None and got[0] == 3 and float(got[1]["v"][0]) == 3.0
    got = store.load_before(3)                                        # a client that crashed after it
    assert got is not None and got[0] == 2                            # served round 3: round 2's state
    assert store.load_before(2) is None                               # round 1 was dropped
    # who loads: only a client without a state of this run, never for a join
    mine = {"v": np.zeros(2)}
    assert state_for_request(store, wire.TRAIN, 4, mine, live=True) == (mine, None)
    assert state_for_request(store, wire.JOIN, 0, mine, live=False) == (mine, None)
    state, restored = state_for_request(store, wire.TRAIN, 4, {}, live=False)
    assert restored == 3 and float(state["v"][0]) == 3.0
    assert state_for_request(None, wire.TRAIN, 4, mine, live=False) == (mine, None)
    assert store_for(None, "key1", 3) is None and store_for(str(tmp_path), "", 3) is None
    (store.path(3)).write_bytes(b"not an npz")
    with pytest.raises(ValueError, match="cannot be read"):
        store.load_before(4)


# -- resume = uninterrupted, in-process, every strategy --------------------------------------

@pytest.mark.parametrize("strategy", builtin_strategies())
def test_every_strategy_resumed_in_process_equals_the_uninterrupted_run(tmp_path, strategy):
    """Every core pickles, and round 1 + resume to round 2 gives the uninterrupted run's numbers and model."""
    values = {**SMALL, "strategy": strategy, "rounds": 2}
    ref, ref_core = run_federated_inprocess(parse_run_config(values), tmp_path / "ref")
    run_federated_inprocess(parse_run_config({**values, "rounds": 1}), tmp_path / "res")
    doc, core = run_federated_inprocess(parse_run_config({**values, "resume": True}), tmp_path / "res")
    assert doc["status"] == "completed" and doc["resumed_from_round"] == 1
    assert losses(doc, strategy) == losses(ref, strategy)
    want, got = ref_core.final_arrays(), core.final_arrays()
    assert (want is None) == (got is None)
    if want is not None and got is not None:
        assert all(np.array_equal(want[k], got[k]) for k in want)


def test_resume_without_the_client_state_would_differ(tmp_path):
    """Control for the test above: apflgate's clients need their state (v_i, α_i, δ_i) back."""
    values = {**SMALL, "strategy": "apflgate", "rounds": 3}
    ref, _ = run_federated_inprocess(parse_run_config(values))
    run_federated_inprocess(parse_run_config({**values, "rounds": 1}), tmp_path)
    shutil.rmtree(tmp_path / "client-state")
    doc, _ = run_federated_inprocess(parse_run_config({**values, "resume": True}), tmp_path)
    assert losses(doc, "apflgate")[0] == losses(ref, "apflgate")[0]
    # row 1 onwards: measured (piggy-backed) by clients that lost their personal models
    assert all(a != b for a, b in zip(losses(doc, "apflgate")[1:], losses(ref, "apflgate")[1:]))


# -- the CLI -------------------------------------------------------------------------------------



def test_cli_resume_continues_a_completed_inprocess_run_and_refuses_changes(tmp_path):
    from graphfl.deploy.run import run_experiment

    values = {"strategy": "apflgate", "nodes": 3, "train.local-steps": 2, "engine": "inprocess"}
    out = run_experiment(parse_run_config({**values, "rounds": 1, "out-dir": str(tmp_path / "run")}))
    with pytest.raises(ConfigError, match="already completed its 1 rounds"):
        prepare_resume(out)
    changed = graphfl_cli("run", "--resume", str(out), "--rounds", "3", "--set", "train.lr=0.5", timeout=300)
    text = changed.stdout + changed.stderr
    assert changed.returncode == 2 and "train.lr" in text and "Traceback" not in text
    more = graphfl_cli("run", "--resume", str(out), "--rounds", "3", timeout=300)
    assert more.returncode == 0, more.stdout + more.stderr
    doc = json.loads((out / "run.json").read_text())
    assert doc["status"] == "completed" and doc["resumed_from_round"] == 1
    assert doc["resumes"][0]["previous_status"] == "completed"
    assert [r["round"] for r in doc["methods"]["apflgate"]["curve"]] == [0, 1, 2, 3]
    ref, _ = run_federated_inprocess(parse_run_config({**values, "rounds": 3, "run-key": "x"}))
    assert losses(doc, "apflgate") == losses(ref, "apflgate")


# -- end to end: real SuperLink / SuperNodes ---------------------------------------------------

E2E = {"task": "digits", "nodes": 2, "train.local-steps": 5, "train.lr": 0.1, "connect-timeout": 90}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _kill_tree_of(out: Path) -> None:
    from graphfl.deploy.processes import pids_with_env

    for pid in pids_with_env("FLWR_HOME", str((out / ".flwr").resolve())):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _events(out: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


@pytest.mark.e2e
def test_superlink_killed_mid_run_then_resume_gives_the_uninterrupted_result(tmp_path):
    """apflgate (stateful clients) on warm SuperNodes: SuperLink SIGKILLed after round 2 of 5; ``graphfl run
    --resume`` on a fresh deployment finishes it with every round's numbers and the final model of the
    uninterrupted run (the in-process driver, which equals a deployment run: test_e2e_flower.py)."""
    from graphfl.deploy.processes import pids_with_env

    rounds = 5
    out = tmp_path / "run"
    exe = Path(sys.executable).with_name("graphfl")
    argv = [str(exe), "run", "--strategy", "apflgate", "--rounds", str(rounds), "--out", str(out),
            "--clientapp-mode", "warm", *[a for k, v in E2E.items() for a in ("--set", f"{k}={v}")]]
    proc = None
    try:
        with (tmp_path / "first.log").open("w") as fh:
            proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            deadline = time.monotonic() + 150
            while time.monotonic() < deadline and not any(e.get("event") == "round" and e.get("round") == 2
                                                          for e in _events(out)):
                assert proc.poll() is None, (tmp_path / "first.log").read_text()
                time.sleep(0.05)
            links = [p for p in pids_with_env("FLWR_HOME", str((out / ".flwr").resolve()))
                     if "graphfl.deploy.superlink" in _cmdline(p)]
            assert len(links) == 1, "the SuperLink process was not found"
            os.kill(links[0], signal.SIGKILL)
            code = proc.wait(timeout=120)
        assert code == 1, (tmp_path / "first.log").read_text()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        _kill_tree_of(out)
    stopped = json.loads((out / "run.json").read_text())
    assert stopped["status"] == "failed" and "SuperLink" in stopped["error"]
    at = checkpoint.read_meta(out / "checkpoint")["round"]
    assert 2 <= at < rounds
    resumed = graphfl_cli("run", "--resume", str(out), "--clientapp-mode", "warm", timeout=240)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    doc = json.loads((out / "run.json").read_text())
    assert doc["status"] == "completed" and doc["resumed_from_round"] == at
    entry = doc["resumes"][0]
    assert entry["previous_status"] == "failed" and "SuperLink" in entry["previous_error"]
    curve = doc["methods"]["apflgate"]["curve"]
    assert [r["round"] for r in curve] == list(range(rounds + 1))       # no round lost, none repeated
    assert all(set(r.get("state_restored", {}).values()) <= {at} for r in curve)
    assert curve[at + 1]["state_restored"] == {"0": at, "1": at}        # both clients got their state back
    ref_values = {**E2E, "strategy": "apflgate", "rounds": rounds, "engine": "inprocess", "run-key": "ref"}
    ref, ref_core = run_federated_inprocess(parse_run_config(ref_values))
    want = ref["methods"]["apflgate"]["curve"]
    for got_row, want_row in zip(curve, want):
        assert got_row["test_loss"] == pytest.approx(want_row["test_loss"], rel=1e-5, abs=1e-6)
        assert got_row["test_acc"] == pytest.approx(want_row["test_acc"], rel=1e-5, abs=1e-6)
    final = checkpoint.load(out / "checkpoint", parse_run_config({**ref_values, "run-key": doc["config"]["run_key"],
                                                                  "engine": "local-deployment"}))
    assert final.round == rounds
    got_model, want_model = final.core.final_arrays(), ref_core.final_arrays()
    assert got_model is not None and want_model is not None
    for k in want_model:
        np.testing.assert_allclose(got_model[k], want_model[k], rtol=1e-5, atol=1e-6)


@pytest.mark.e2e
def test_restarted_supernode_restores_its_client_state_from_disk(tmp_path):
    """Warm SuperNodes with a state dir: SuperNode 1 is SIGKILLed after round 1 and started again; its
    new ClientApps find no ``context.state`` and load their saved state (the run records the round).
    (The ClientApp code is the same in cold mode, where this test also passes; warm keeps it short.)"""
    from graphfl.deploy.federation import LocalFederation
    from graphfl.deploy.run import write_overrides
    from graphfl.server.flower_app import write_app_dir

    rounds = 4
    values = {**E2E, "strategy": "apflgate", "rounds": rounds, "round-timeout": 40, "min-replies": 1,
              "apflgate.adaptive-alpha": True, "engine": "local-deployment", "out-dir": str(tmp_path / "run")}
    cfg, out = prepare(parse_run_config(values))
    state_dir = out / "client-state"
    with LocalFederation(out, 2, tls=True, clientapp_mode="warm", state_dir=state_dir) as fed:
        sub = fed.submitter()
        handle = sub.submit(write_app_dir(out / "app"), write_overrides(out / "rc.toml", cfg), out)
        restarted = False

        def on_event(ev):
            nonlocal restarted
            if ev.get("event") == "round" and ev.get("round") == 1 and not restarted:
                restarted = True
                node = next(p for p in fed.group.procs if p.name == "supernode-1")
                node.popen.send_signal(signal.SIGKILL)
                node.popen.wait(timeout=10)
                fed.start_supernode(1, name="supernode-1b")              # same state dir, a new node id

        sub.wait(handle, on_event, timeout=400, health=fed.health, status_every=30.0)
    assert restarted
    doc = json.loads((out / "run.json").read_text())
    assert doc["status"] == "completed", doc.get("error")
    curve = doc["methods"]["apflgate"]["curve"]
    restored = [(r["round"], r["state_restored"]) for r in curve if r.get("state_restored")]
    assert len(restored) == 1, restored                                  # once, by the new SuperNode only
    back_in, which = restored[0]
    assert list(which) == ["1"] and 1 <= which["1"] < back_in            # a state of a round before the one served
    saved = StateStore(state_dir, cfg.run_key, 1)
    assert saved.rounds()[-1] == rounds + 1                              # it kept saving after the restart
    alpha = saved.load_before(rounds + 2)
    assert alpha is not None and "apfl.alpha" in alpha[1]
