"""A run owns a fresh output folder and its files say how it ended (issue: results never lie)."""

from __future__ import annotations

import json
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
