"""``train.eval-local``: the plain SGD trainer also evaluates its locally trained model (``local_test_*``)."""

from __future__ import annotations

import numpy as np
import pytest

from graphfl.client.fesem_trainer import FeSEMTrainer
from graphfl.client.gate_trainer import APFLTrainer
from graphfl.client.trainers import LocalTrainer, SGDTrainer, eval_local_problem
from graphfl.common.config import ConfigError, config_hash, parse_run_config
from graphfl.server.inprocess import run_federated_inprocess

BASE = {"strategy": "fedavg", "task": "digits", "nodes": 3, "rounds": 2, "train.local-steps": 3,
        "train.batch-size": 8, "train.lr": 0.3, "seed": 0, "data.dirichlet-alpha": 0.1}


def _curve(engine: str, **extra: object) -> list[dict]:
    doc, _ = run_federated_inprocess(parse_run_config({**BASE, "engine": engine, **extra}))
    return doc["methods"]["fedavg"]["curve"]


def test_eval_local_reports_the_trained_model_equal_on_both_engines_and_changes_nothing_else():
    on = {e: _curve(e, **{"train.eval-local": True}) for e in ("inprocess", "batched")}
    off = _curve("batched")
    # round 0 has no trained model yet; every later round reports one
    assert all(r.get("local_test_acc") is None for r in (on["inprocess"][0], on["batched"][0]))
    for e in on:
        local = [r["local_test_acc"] for r in on[e][1:]]
        assert len(local) == BASE["rounds"] and all(0.0 <= a <= 1.0 for a in local)
    # the trained w_i is not the global model: at this strong skew it fits the client's classes better
    assert on["batched"][-1]["local_test_acc"] > on["batched"][-1]["test_acc"]
    for key in ("local_test_acc", "local_test_loss", "test_acc"):
        np.testing.assert_allclose([r[key] for r in on["inprocess"][1:]], [r[key] for r in on["batched"][1:]],
                                   rtol=1e-6)
    # the option only adds an evaluation: training and the global model's metrics are unchanged
    np.testing.assert_allclose([r["test_acc"] for r in off], [r["test_acc"] for r in on["batched"]], rtol=1e-6)
    assert all("local_test_acc" not in r or r["local_test_acc"] is None for r in off)


def test_eval_local_is_off_by_default_keeps_old_hashes_and_refuses_bad_values_and_other_trainers():
    cfg = parse_run_config(BASE)
    assert cfg.train.eval_local is False
    assert "train.eval-local" in cfg.to_flat()
    # default off: the hash is that of the config without the key (every earlier result keeps its hash)
    assert config_hash(cfg) == config_hash(parse_run_config({**BASE, "train.eval-local": False}))
    assert config_hash(cfg) != config_hash(parse_run_config({**BASE, "train.eval-local": True}))
    with pytest.raises(ConfigError, match="train.eval-local"):
        parse_run_config({**BASE, "train.eval-local": "maybe"})

    # trainers that evaluate (FeSEM) or train (APFL: not an SGDTrainer) their own way are refused by name
    assert eval_local_problem("fedavg", SGDTrainer.__new__(SGDTrainer)) is None
    assert eval_local_problem("local", LocalTrainer.__new__(LocalTrainer)) is None
    for name, cls in (("fesem", FeSEMTrainer), ("apfl", APFLTrainer)):
        problem = eval_local_problem(name, cls.__new__(cls))
        assert problem is not None and "train.eval-local" in problem and f"'{name}'" in problem


def test_a_strategy_that_cannot_serve_eval_local_is_refused_before_any_client_trains(tmp_path):
    """The in-process round loop and `graphfl run`'s preflight both stop with the option's name,
    not with "no client answered the join round" after every client failed.
    """
    from graphfl.deploy.run import preflight

    cfg = parse_run_config({**BASE, "strategy": "fesem", "train.eval-local": True, "out-dir": str(tmp_path / "r")})
    with pytest.raises(ConfigError, match="train.eval-local"):
        run_federated_inprocess(cfg)
    with pytest.raises(ConfigError, match="train.eval-local"):
        preflight(cfg)
    preflight(parse_run_config({**BASE, "train.eval-local": True}))   # fedavg serves it
