"""A run owns a fresh output folder and its files say how it ended (issue: results never lie)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from graphfl.common.config import ConfigError, parse_run_config
from graphfl.deploy.federation import events_of_run
from graphfl.deploy.run import claim_out_dir, finalize_status, run_experiment


def _cfg(out: Path, **extra: object):
    return parse_run_config({"engine": "inprocess", "rounds": 1, "nodes": 2, "train.local-steps": 2,
                             "out-dir": str(out), **extra}, ignore_other_strategies=False)


def test_rerun_into_a_finished_run_is_refused_and_overwrite_really_trains(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_experiment(_cfg(out))
    first = json.loads((out / "run.json").read_text())
    assert first["status"] == "completed"
    with pytest.raises(ConfigError, match="already holds"):
        run_experiment(_cfg(out))
    (out / "run.json").write_text(json.dumps({**first, "status": "stale-marker"}))
    run_experiment(_cfg(out, seed=1), overwrite=True)
    second = json.loads((out / "run.json").read_text())
    assert second["status"] == "completed" and second["config"]["seed"] == 1


def test_overwrite_never_deletes_foreign_files(tmp_path: Path) -> None:
    (tmp_path / "thesis.tex").write_text("precious")
    with pytest.raises(ConfigError, match="not a graphfl run"):
        claim_out_dir(tmp_path, overwrite=True)
    assert (tmp_path / "thesis.tex").read_text() == "precious"


@pytest.mark.parametrize("make", ["file", "under-file", "proc"])
def test_unusable_out_is_one_clear_error(tmp_path: Path, make: str) -> None:
    target = {"file": tmp_path / "f", "under-file": tmp_path / "f" / "sub", "proc": Path("/proc/graphfl-run")}[make]
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=str(target)):
        claim_out_dir(target)


def test_status_of_an_interrupted_or_crashed_run(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"name": "run", "status": "running", "methods": {}}))
    finalize_status(tmp_path, "interrupted", "Ctrl-C", cfg)
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["status"] == "interrupted" and doc["error"] == "Ctrl-C"
    finalize_status(tmp_path, "failed", "later crash", cfg)  # an ended run keeps its status
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "interrupted"
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    finalize_status(fresh, "failed", "SuperLink died", cfg)
    doc = json.loads((fresh / "run.json").read_text())
    assert doc["status"] == "failed" and doc["config"]["rounds"] == 1


def test_launcher_follows_only_its_own_runs_progress() -> None:
    events = [{"run_id": 7, "event": "done"}, {"event": "done"}, {"run_id": 9, "event": "round", "round": 1}]
    assert events_of_run(events, 9) == [{"run_id": 9, "event": "round", "round": 1}]


def test_a_strategy_below_its_minimum_clients_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from graphfl.common import registry
    from graphfl.deploy.run import preflight

    spec = registry.get("fedavg")
    monkeypatch.setitem(registry._SERVER, "fedavg", dataclasses.replace(spec, min_clients=3))
    with pytest.raises(ConfigError, match="at least 3 clients"):
        preflight(_cfg(tmp_path))


def test_a_round_without_a_valid_reply_fails_the_run(tmp_path: Path) -> None:
    """train.lr = 1e30 makes every update NaN: that run failed, it did not complete."""
    from graphfl.server.rounds import RunError

    out = tmp_path / "diverged"
    with pytest.raises(RunError, match="min-replies = 1"):
        run_experiment(_cfg(out, **{"train.lr": 1e30}))
    doc = json.loads((out / "run.json").read_text())
    assert doc["status"] == "failed" and "NaN" in doc["error"]
    ok = tmp_path / "tolerated"
    run_experiment(_cfg(ok, **{"train.lr": 1e30, "min-replies": 0}))  # explicitly allowed: runs to the end
    assert json.loads((ok / "run.json").read_text())["status"] == "completed"


def test_bigfl_on_a_cnn_is_refused_in_one_line_naming_the_setting(tmp_path: Path) -> None:
    """phi over all of mnist's CNN would be 22 TB: refused before anything starts, not a MemoryError."""
    from graphfl.common.registry import get
    from graphfl.tasks import registry as tasks

    cfg = parse_run_config({"strategy": "bigfl", "task": "mnist", "nodes": 4}, ignore_other_strategies=False)
    model = tasks.create("mnist", seed=0).build_model()
    arrays = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    keys = tuple(k for k, _ in model.named_parameters())
    check = get("bigfl").preflight
    assert check is not None
    with pytest.raises(ConfigError, match=r"set bigfl.layers to a few layers, e.g. bigfl.layers = '[\w.]+'"):
        check(cfg, arrays, keys)
    last = keys[-1].rsplit(".", 1)[0]
    ok = parse_run_config({"strategy": "bigfl", "task": "mnist", "nodes": 4, "bigfl.layers": last},
                          ignore_other_strategies=False)
    check(ok, arrays, keys)  # the suggested setting fits


def test_bigfl_needs_two_clients(tmp_path: Path) -> None:
    from graphfl.deploy.run import preflight

    with pytest.raises(ConfigError, match="bigfl needs at least 2 clients"):
        preflight(_cfg(tmp_path, strategy="bigfl", nodes=1))


# -- p2p: a finished run's folder is not silently replaced -------------------------------------------

P2P_SMALL = ("--peers", "2", "--rounds", "2", "--problem", "linreg", "--quiet")


def _snapshot(folder: Path, names: tuple[str, ...]) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in names}


@pytest.mark.e2e
def test_p2p_and_peer_refuse_a_finished_runs_folder_unless_overwrite(tmp_path: Path) -> None:
    from graphfl.tests.cli_runner import graphfl_cli

    out = tmp_path / "net"
    first = graphfl_cli("p2p", *P2P_SMALL, "--out", str(out), timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    kept = ("p2p.json", "certs/ca.crt", "network.toml", "peer-0.json", "peer-0.npz", "peer-0.rounds.jsonl",
            "peer-0.ckpt.json")
    before = _snapshot(out, kept)

    again = graphfl_cli("p2p", *P2P_SMALL, "--seed", "1", "--out", str(out), timeout=300)
    text = again.stdout + again.stderr
    assert again.returncode == 2 and "already holds" in text and "--overwrite" in text and "Traceback" not in text, text

    peer = graphfl_cli("peer", "--topology", str(out / "network.toml"), "--id", "0", "--out", str(out),
                       "--set", "connect-timeout=1", timeout=300)
    text = peer.stdout + peer.stderr
    assert peer.returncode == 2 and "peer-0.json" in text and "finished" in text and "--overwrite" in text, text
    resumed = graphfl_cli("peer", "--topology", str(out / "network.toml"), "--id", "0", "--out", str(out),
                          "--resume", "--set", "connect-timeout=1", timeout=300)
    text = resumed.stdout + resumed.stderr
    assert resumed.returncode == 2 and "rounds" in text and "finished" in text, text
    assert _snapshot(out, kept) == before  # nothing of the finished run was touched

    (out / "notes.txt").write_text("mine")
    foreign = graphfl_cli("p2p", *P2P_SMALL, "--out", str(out), "--overwrite", "--engine", "inprocess", timeout=300)
    assert foreign.returncode == 2 and "notes.txt" in foreign.stdout + foreign.stderr
    assert _snapshot(out, kept) == before
    (out / "notes.txt").unlink()

    others = _snapshot(out, ("p2p.json", "peer-1.json", "peer-1.npz", "peer-1.rounds.jsonl"))
    peer = graphfl_cli("peer", "--topology", str(out / "network.toml"), "--id", "0", "--out", str(out),
                       "--overwrite", "--set", "connect-timeout=1", timeout=300)
    assert peer.returncode in (0, 5), peer.stdout + peer.stderr  # 5: it ran alone, its neighbour is gone
    doc = json.loads((out / "peer-0.json").read_text())
    assert doc["unreached_at_start"] and len(doc["records"]) == 2  # a new run, alone, replaced peer 0's files
    assert _snapshot(out, tuple(others)) == others  # the network's and peer 1's files are not touched

    over = graphfl_cli("p2p", *P2P_SMALL, "--seed", "1", "--out", str(out), "--overwrite", "--engine", "inprocess",
                       timeout=300)
    assert over.returncode == 0, over.stdout + over.stderr
    assert json.loads((out / "p2p.json").read_text())["config"]["run"]["seed"] == 1
    assert not (out / "certs").exists()  # the old network's CA went with the run it belonged to


# -- a full disk or a file-size limit while writing results -----------------------------------------


def _tmp_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if ".tmp" in p.name)


def _limit_file_size(limit: int):
    import resource

    def apply() -> None:  # pragma: no cover - runs in the child before exec
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def _run_argv(out: Path, rounds: int) -> list[str]:
    import sys

    exe = Path(sys.executable).with_name("graphfl")
    return [str(exe), "run", "--engine", "inprocess", "--nodes", "2", "--rounds", str(rounds), "--out", str(out),
            "--set", "train.local-steps=2"]


def _rounds(doc: dict) -> list[int]:
    return [r["round"] for r in doc["methods"]["fedavg"]["curve"]]


@pytest.mark.e2e
def test_a_result_file_over_the_size_limit_is_a_clear_error_and_resume_continues(tmp_path: Path) -> None:
    """RLIMIT_FSIZE (EFBIG, portable, no privileges): the checkpoint outgrows the limit mid-run; run.json
    (smaller) still takes the failed status and the reason; no temporary file is left; --resume finishes."""
    import subprocess

    from graphfl.deploy.run import preflight
    from graphfl.tests.cli_runner import graphfl_cli

    out = tmp_path / "run"
    rounds = 30
    preflight(_cfg(out, nodes=2, rounds=rounds))  # the task's data cache is written here, not under the limit
    proc = subprocess.run(_run_argv(out, rounds), preexec_fn=_limit_file_size(50_000), capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "200"})
    text = (proc.stdout + proc.stderr).replace("\n", "")
    assert proc.returncode == 1, text
    assert "File too large" in text and "server-r" in text and "--resume" in text and "Traceback" not in text, text
    doc = json.loads((out / "run.json").read_text())
    assert doc["status"] == "failed" and "File too large" in doc["error"] and "server-r" in doc["error"]
    assert _tmp_files(out) == []
    at = json.loads((out / "checkpoint" / "checkpoint.json").read_text())["round"]
    assert 1 <= at < rounds and _rounds(doc) == list(range(at + 2))  # the failed round's rows are kept too
    resumed = graphfl_cli("run", "--resume", str(out), timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    doc = json.loads((out / "run.json").read_text())
    assert doc["status"] == "completed" and _rounds(doc) == list(range(rounds + 1)) and doc["resumed_from_round"] == at


@pytest.mark.e2e
def test_a_full_disk_is_a_clear_error_and_resume_continues_after_space_is_freed(tmp_path: Path) -> None:
    """A real full file system: a 4 MB tmpfs (needs the right to mount; skipped, saying so, without it)
    is filled while the run goes; run.json cannot be written at all, and the error says so."""
    import errno
    import subprocess

    from graphfl.tests.cli_runner import graphfl_cli

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({mounted.stderr.strip() or mounted.returncode}); "
                    "the RLIMIT_FSIZE test covers the same code without privileges")
    try:
        out = disk / "run"
        rounds = 150
        with (tmp_path / "run.log").open("w") as log:
            proc = subprocess.Popen(_run_argv(out, rounds), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "200"})
            try:
                end = time.monotonic() + 180
                while time.monotonic() < end and proc.poll() is None:
                    ck = out / "checkpoint" / "checkpoint.json"
                    if ck.is_file() and json.loads(ck.read_text() or "{}").get("round", 0) >= 2:
                        break
                    time.sleep(0.02)
                # fill every free byte; unbuffered, so closing the file has nothing left to flush (a buffered
                # file can raise ENOSPC again from close(), outside this try)
                with (disk / "filler").open("wb", buffering=0) as fh:
                    try:
                        while True:
                            fh.write(b"\0" * 65536)
                    except OSError as exc:
                        assert exc.errno == errno.ENOSPC
                code = proc.wait(timeout=180)
            finally:
                if proc.poll() is None:
                    proc.kill()
        text = (tmp_path / "run.log").read_text().replace("\n", "")
        assert code == 1, text
        assert "No space left on device" in text and str(out) in text and "--resume" in text, text
        assert "Traceback" not in text and "run.json" in text, text
        assert _tmp_files(out) == []
        doc = json.loads((out / "run.json").read_text())  # the last complete version, never half a file
        assert doc["status"] in ("running", "failed")
        if doc["status"] == "running":
            assert "could not be updated" in text, text
        at = json.loads((out / "checkpoint" / "checkpoint.json").read_text())["round"]
        (disk / "filler").unlink()
        resumed = graphfl_cli("run", "--resume", str(out), timeout=300)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        doc = json.loads((out / "run.json").read_text())
        assert doc["status"] == "completed" and _rounds(doc) == list(range(rounds + 1))
        assert doc["resumed_from_round"] == at
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_the_launcher_says_when_it_cannot_write_run_json(tmp_path: Path) -> None:
    """finalize_status under a file-size limit: no exception, the reason returned, run.json and the folder intact."""
    import subprocess
    import sys

    (tmp_path / "run.json").write_text(json.dumps({"name": "run", "status": "running", "methods": {}}))
    before = (tmp_path / "run.json").read_bytes()
    code = ("import sys; from pathlib import Path; from graphfl.deploy.run import finalize_status; "
            "print(finalize_status(Path(sys.argv[1]), 'failed', 'x' * 200))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], preexec_fn=_limit_file_size(64),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "run.json" in proc.stdout and "File too large" in proc.stdout and "still says 'running'" in proc.stdout
    assert (tmp_path / "run.json").read_bytes() == before and _tmp_files(tmp_path) == []
