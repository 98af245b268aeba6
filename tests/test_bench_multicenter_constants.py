"""B2 reports constant predictors beside the methods and flags a method at their level."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from graphfl.bench import multicenter as b2
from graphfl.common.config import DataConfig
from graphfl.tasks import registry


def test_constant_predictors_use_the_methods_metric_on_the_task_split() -> None:
    task, nodes = "synthetic-multicenter-smooth", 50
    c = b2.constant_predictors(task, nodes, [0, 1])
    assert set(c) == {"own-mean", "pooled-mean", "zero"}
    assert all(len(v["per_seed"]) == 2 for v in c.values())
    t = registry.create(task, data=DataConfig(), data_dir="", seed=0)
    loss = t.loss_fn()
    per_client = []
    for i in range(nodes):
        d = t.client_data(i, nodes)
        y = torch.from_numpy(np.asarray(d.y_test, np.float32))
        per_client.append(float(loss(torch.zeros_like(y), y)))
    assert c["zero"]["per_seed"][0] == pytest.approx(float(np.mean(per_client)), rel=1e-5)
    # a client's own training mean is no worse than predicting 0 by much, and seeds differ
    assert c["own-mean"]["per_seed"][0] != c["own-mean"]["per_seed"][1]


def test_a_method_at_the_constant_level_is_flagged_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    constants = {"own-mean": {"test_loss": 0.32}, "zero": {"test_loss": 0.33}}
    methods = {"fedavg": {"final": {"test_loss": 0.30}}, "bigfl": {"final": {"test_loss": 0.3227}},
               "local": {"final": {"test_loss": 0.15}}, "broken": {"final": {"test_loss": None}}}
    with caplog.at_level(logging.WARNING, logger="graphfl.bench.multicenter"):
        flagged = b2.at_constant_level(methods, constants, "smooth, train graph")
    assert flagged == ["bigfl"]
    assert "bigfl" in caplog.text and "constant-predictor level" in caplog.text
