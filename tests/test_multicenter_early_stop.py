"""B2's BiG-FL tuning runs stop at the first round whose lower level is not strongly convex.

Such a run is excluded from the choice whatever follows (``bigfl_inadmissible``), so its later
rounds only cost time. The round loop's early-stop rule ends it there; admissible tuning runs and
every evaluation cell run all their rounds, with the results (and run-cache keys) they had before.
Real runs on 6 clients for a few rounds.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from graphfl.bench import multicenter as mc
from graphfl.bench.runcache import RunCache
from graphfl.tasks.holdout import validation_task

TASK = "synthetic-multicenter-smooth"
NODES = 6
ROUNDS = 3
# at lr 3 and kappa 0.1 the lower level is not strongly convex from round 1 on; at lr 0.1, kappa 1 it stays so
BAD = {"lr": 3.0, "bigfl.lam": 0.1, "bigfl.alpha": 0.02, "bigfl.kappa": 0.1}
GOOD = {"lr": 0.1, "bigfl.lam": 0.1, "bigfl.alpha": 0.02, "bigfl.kappa": 1.0}


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunCache:
    c = RunCache(tmp_path / "cache")
    monkeypatch.setattr(mc, "_cache", c)
    monkeypatch.setattr(mc, "_CACHE_ONLY", False)
    return c


def _excluded_round(run: dict) -> int:
    why = mc.bigfl_inadmissible(run)
    assert why is not None
    m = re.fullmatch(r"excluded: LL not strongly convex at round (\d+) \(min curvature \S+\)", why)
    assert m, why
    return int(m.group(1))


def test_a_tuning_run_stops_at_the_round_it_becomes_inadmissible(cache: RunCache) -> None:
    val = validation_task(TASK)
    run = mc.run_any("bigfl", val, NODES, ROUNDS, 0, BAD, mc.TRAIN)
    r = _excluded_round(run)
    assert r < ROUNDS
    assert run["stopped_early"] == {"round": r, "after_round": r, "rounds": ROUNDS,
                                    "reason": mc.bigfl_inadmissible(run)}
    assert [row["round"] for row in run["curve"]] == list(range(r + 1))
    assert np.isfinite(run["curve"][-1]["test_loss"]), "the stopped run's last round is evaluated"
    # the stored record (same key as before the rule) reads back as excluded at that round
    key = mc._cell_key("bigfl", val, NODES, ROUNDS, 0, BAD, mc.TRAIN)
    stored = cache.get(key)
    assert stored is not None and stored["stopped_early"]["round"] == r
    assert mc.bigfl_inadmissible(stored) == mc.bigfl_inadmissible(run)
    assert not cache.work_dir(key).exists()


def test_an_admissible_tuning_run_runs_every_round_with_the_same_result(cache: RunCache) -> None:
    val = validation_task(TASK)
    run = mc.run_any("bigfl", val, NODES, ROUNDS, 0, GOOD, mc.TRAIN)
    key = mc._cell_key("bigfl", val, NODES, ROUNDS, 0, GOOD, mc.TRAIN)
    plain = mc.run_method("bigfl", val, NODES, ROUNDS, 0, key["overrides"])  # no stop rule, no checkpoints
    assert mc.bigfl_inadmissible(run) is None and "stopped_early" not in run
    assert cache.has(key)
    assert set(run) == set(plain) | {"resumed"}  # no new key in an unstopped record
    assert [row["round"] for row in run["curve"]] == list(range(ROUNDS + 1))
    for k in ("test_loss", "train_loss"):
        np.testing.assert_allclose([row.get(k, np.nan) for row in run["curve"]],
                                   [row.get(k, np.nan) for row in plain["curve"]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(run["phi"]), np.asarray(plain["phi"]), rtol=1e-6, atol=1e-12)


def test_an_evaluation_cell_never_stops_early(cache: RunCache) -> None:
    for task in (TASK, TASK + mc.TESTGRAPH_SUFFIX):
        assert mc.tuning_stop_rule("bigfl", task) is None
    for m in ("fedavg", "fesem", "local"):
        assert mc.tuning_stop_rule(m, validation_task(TASK)) is None
    run = mc.run_any("bigfl", TASK, NODES, 2, 0, BAD, mc.TRAIN)
    assert _excluded_round(run) < 2, "the setting loses strong convexity on the train graph too"
    assert "stopped_early" not in run
    assert [row["round"] for row in run["curve"]] == [0, 1, 2]


class _Killed(BaseException):
    """Stands for the process being killed after a round's checkpoint."""


def test_a_resumed_tuning_run_still_stops(cache: RunCache) -> None:
    """A cell whose checkpoint (from a run without the rule) is past its inadmissible round stops on resume."""
    val = validation_task(TASK)
    key = mc._cell_key("bigfl", val, NODES, ROUNDS, 0, BAD, mc.TRAIN)
    work = cache.work_dir(key)

    def killed_after_round_2(row: dict) -> None:
        if row["round"] == 2:
            raise _Killed

    with pytest.raises(_Killed):
        mc.run_method("bigfl", val, NODES, ROUNDS, 0, key["overrides"], work_dir=work,
                      stop_when=killed_after_round_2)
    assert json.loads((work / f"{mc.NAME}-bigfl.json").read_text())["status"] == "failed"
    run = mc.run_any("bigfl", val, NODES, ROUNDS, 0, BAD, mc.TRAIN)
    r = _excluded_round(run)
    assert run["resumed"] is True and r < 2
    assert run["stopped_early"]["round"] == r and run["stopped_early"]["after_round"] == 2
    assert [row["round"] for row in run["curve"]] == [0, 1, 2]
    assert np.isfinite(run["curve"][-1]["test_loss"])
    assert not work.exists()


def test_both_record_lengths_read_as_excluded_at_the_same_round() -> None:
    """A record from before the rule (every round) and an early-stopped one give the same reason."""
    def row(r: int, curv: float) -> dict:
        return {"round": r, "test_loss": 0.3, "server": {"ll_min_curvature": curv, "phi_minus_identity": 0.1}}

    full = {"curve": [{"round": 0, "test_loss": 0.4}] + [row(r, 0.2 if r < 46 else -0.00497) for r in range(1, 201)]}
    stopped = {"curve": full["curve"][:47], "stopped_early": {"round": 46, "after_round": 46, "rounds": 200,
                                                              "reason": "excluded: ..."}}
    why = "excluded: LL not strongly convex at round 46 (min curvature -0.00497)"
    assert mc.bigfl_inadmissible(full) == mc.bigfl_inadmissible(stopped) == why
    assert mc._bigfl_round_inadmissible(full["curve"][46]) == why
    assert mc._bigfl_round_inadmissible(full["curve"][45]) is None
    assert mc._bigfl_round_inadmissible({"round": 3, "server": {"ll_strongly_convex": 0}}) is not None


def _fedavg_run_stopping_at(tmp_path: Path, rounds: int, stop_at: int) -> dict:
    """run.json of an in-process FedAvg run whose stop rule gives a reason at round ``stop_at``."""
    from graphfl.common import registry
    from graphfl.common.envinfo import env_info
    from graphfl.server.inprocess import InProcessExchange, server_inputs
    from graphfl.server.rounds import RunRecorder, run_federated

    cfg = mc.cell_config("fedavg", TASK, NODES, rounds, 0, {**mc.TRAIN, "train.lr": 0.3, "engine": "inprocess"})
    recorder = RunRecorder(cfg, "fedavg", tmp_path, name="run", env=env_info())
    run_federated(cfg, registry.get("fedavg"), InProcessExchange(cfg), server_inputs(cfg), recorder,
                  stop_when=lambda row: "enough" if row["round"] == stop_at else None)
    return json.loads((tmp_path / "run.json").read_text())


def test_the_round_loop_records_a_stopped_run_as_stopped(tmp_path: Path) -> None:
    """The engine's general hook: a rule's reason ends the run after that round; run.json says so."""
    from graphfl.server.rounds import STOPPED

    doc = _fedavg_run_stopping_at(tmp_path, rounds=5, stop_at=2)
    assert doc["status"] == STOPPED
    assert doc["stopped_early"] == {"round": 2, "after_round": 2, "rounds": 5, "reason": "enough"}
    curve = doc["methods"]["fedavg"]["curve"]
    assert [row["round"] for row in curve] == [0, 1, 2] and curve[-1]["test_loss"] is not None


def test_a_rule_that_fires_at_the_last_round_leaves_the_run_completed(tmp_path: Path) -> None:
    """A run that reached its last round is completed, not stopped, whatever the rule says of it."""
    doc = _fedavg_run_stopping_at(tmp_path, rounds=3, stop_at=3)
    assert doc["status"] == "completed" and "stopped_early" not in doc
