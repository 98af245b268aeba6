"""APFL and APFLGate in the batched engine give the per-client in-process engine's numbers.

The personal model ``v_i``, its mixing weight ``α_i`` (fixed and adaptive), FedGATE's ``δ_i``
(APFLGate) and both personal outputs (the locally trained copy, the aggregated model) train and
evaluate stacked on the client axis; every curve number (personal, mixture, global metrics,
``alpha``, ``personal_loss``) must equal the per-client engine's to ``RTOL``, and no request may
fall back to client-by-client training (``_same_curves`` checks the log).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from graphfl.tests.test_batched import RTOL, _same_curves

CASES = [
    ("apfl", "synthetic-multicenter", {}),
    ("apfl", "synthetic-multicenter", {"apfl.adaptive-alpha": True, "apfl.alpha-lr": 0.05,
                                       "train.momentum": 0.5, "train.weight-decay": 0.01}),
    ("apfl", "digits", {"apfl.adaptive-alpha": True, "apfl.personal-output": "aggregated"}),
    ("apflgate", "synthetic-multicenter", {"apflgate.adaptive-alpha": True}),
    ("apflgate", "digits", {"train.momentum": 0.5}),
]


@pytest.mark.parametrize(("strategy", "task", "settings"), CASES,
                         ids=[f"{s}-{t}-{i}" for i, (s, t, _) in enumerate(CASES)])
def test_personal_strategies_equal_the_per_client_engine(strategy: str, task: str, settings: dict[str, Any]):
    doc = _same_curves(strategy, task=task, **settings)
    curve = doc["methods"][strategy]["curve"]
    last = curve[-1]
    assert "mix_local_test_loss" in last and "global_test_loss" in last   # the personal metrics are there


@pytest.mark.parametrize("strategy", ["apfl", "apflgate"])
def test_every_reply_metric_and_array_equals_the_per_client_engine(strategy: str):
    """The curve does not record ``alpha`` or ``personal_loss``: compare the replies themselves,
    two rounds (the second evaluates the mixtures with the kept ``v_i``, ``α_i`` and local copy).
    """
    from graphfl.common import wire
    from graphfl.common.config import parse_run_config
    from graphfl.common.core import FIT_PHASE
    from graphfl.common.types import Payload
    from graphfl.server.batched import BatchedExchange
    from graphfl.server.exchange import Request
    from graphfl.server.inprocess import InProcessExchange, server_inputs

    cfg = parse_run_config({"strategy": strategy, "task": "synthetic-multicenter", "nodes": 4, "rounds": 2,
                            "train.local-steps": 3, "engine": "batched", f"{strategy}.adaptive-alpha": True,
                            f"{strategy}.alpha-lr": 0.5, "train.momentum": 0.3})
    initial = server_inputs(cfg).initial_arrays
    engines = {"batched": BatchedExchange(cfg), "inprocess": InProcessExchange(cfg)}
    payload = Payload(initial)
    for server_round in (1, 2):
        request = Request(wire.TRAIN, server_round, FIT_PHASE, True)
        replies = {name: ex.send(request, {pid: payload for pid in range(4)}) for name, ex in engines.items()}
        for pid in range(4):
            got, want = replies["batched"][pid], replies["inprocess"][pid]
            assert got.error is None and want.error is None, (got.error, want.error)
            keys = {k for k in want.metrics if "seconds" not in k}
            assert keys == {k for k in got.metrics if "seconds" not in k}
            assert any(k.endswith("alpha") for k in keys) and any(k.endswith("personal_loss") for k in keys)
            for k in keys:
                np.testing.assert_allclose(got.metrics[k], want.metrics[k], rtol=RTOL, atol=1e-7, err_msg=k)
            for k, v in want.arrays.items():
                np.testing.assert_allclose(got.arrays[k], v, rtol=RTOL, atol=1e-7, err_msg=k)
        alphas = [replies["batched"][pid].fit_metrics().get("alpha") for pid in range(4)]
        assert all(a is not None and a != 0.5 for a in alphas), alphas   # adaptive α moved
        payload = Payload(replies["inprocess"][0].arrays)
    assert engines["batched"].batched_clients == 8   # no client fell back


def test_adaptive_alpha_moves_and_stays_in_the_unit_interval():
    """α is clipped to [0, 1] per client (the first and last start on the bounds) and moves."""
    from torch import nn

    from graphfl.client.batched import StackedData, batched_sgd, draw_indices
    from graphfl.client.objective import LocalObjective, PersonalModel
    from graphfl.common.types import ClientData

    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    start = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    datas = {p: ClientData(rng.normal(size=(10, 3)).astype(np.float32), rng.integers(0, 2, 10),
                           rng.normal(size=(4, 3)).astype(np.float32), rng.integers(0, 2, 4)) for p in range(3)}
    stacked = StackedData.build(datas, "cpu")
    objs = [LocalObjective(start, 5, np.random.default_rng(p), personal=PersonalModel(start, a, True, 5.0))
            for p, a in enumerate((0.0, 0.5, 1.0))]
    idx = [draw_indices(o, 10, 4) for o in objs]
    _, losses, personal = batched_sgd(model, nn.CrossEntropyLoss(), stacked, [0, 1, 2], objs, idx, 0.1)
    alphas = [p.alpha for p in personal if p is not None]
    assert len(alphas) == 3 and all(0.0 <= a <= 1.0 for a in alphas)
    assert alphas[1] != 0.5
    assert np.all(np.isfinite(losses)) and np.all(np.isfinite([p.loss for p in personal if p is not None]))


def test_a_client_whose_kept_personal_model_has_a_wrong_shape_fails_alone():
    """``v_i`` comes from the client's own state, not from the broadcast: one client's corrupt
    ``v_i`` fails that client's reply (naming the array and both shapes) and the other clients of
    the request still train batched.
    """
    from graphfl.client.trainers import STATE_MODEL_PREFIX
    from graphfl.common import wire
    from graphfl.common.config import parse_run_config
    from graphfl.common.core import FIT_PHASE
    from graphfl.common.types import Payload
    from graphfl.server.batched import BatchedExchange
    from graphfl.server.exchange import Request
    from graphfl.server.inprocess import server_inputs

    cfg = parse_run_config({"strategy": "apfl", "task": "synthetic-multicenter", "nodes": 4, "rounds": 2,
                            "train.local-steps": 2, "engine": "batched"})
    initial = server_inputs(cfg).initial_arrays
    ex = BatchedExchange(cfg)
    payload = Payload(initial)
    first = ex.send(Request(wire.TRAIN, 1, FIT_PHASE, True), {pid: payload for pid in range(4)})
    assert all(first[pid].error is None for pid in range(4))
    ex.runtime(2)
    state = ex.states[2]
    key = next(k for k in state if k.startswith(STATE_MODEL_PREFIX))
    state[key] = np.zeros(np.asarray(state[key]).size + 1)
    before = ex.batched_clients
    second = ex.send(Request(wire.TRAIN, 2, FIT_PHASE, True), {pid: payload for pid in range(4)})
    assert second[2].error is not None and key[len(STATE_MODEL_PREFIX):] in second[2].error, second[2].error
    assert "shape" in second[2].error
    assert all(second[pid].error is None for pid in (0, 1, 3))
    assert ex.batched_clients - before == 3
