"""The batched engine (``engine = batched``) gives the per-client in-process engine's numbers.

Each case runs the same config on both engines in this process and compares every number of
every curve row (losses, accuracies, per-client values, bytes, server metrics) to ``RTOL``:
batched matrix products sum in another order than one client's, so the runs are close, not
bit-identical. Times (keys with ``seconds``) are left out.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from graphfl.common.config import parse_run_config
from graphfl.server.inprocess import run_federated_inprocess

RTOL = 1e-5
ATOL = 1e-7


def _run(engine: str, **settings: Any) -> tuple[dict[str, Any], Any]:
    flat = {"rounds": 3, "nodes": 6, "train.local-steps": 4, "engine": engine, **settings}
    cfg = parse_run_config(flat)
    doc, core = run_federated_inprocess(cfg)
    return doc, core


def _compare(a: Any, b: Any, where: str) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            if "seconds" not in k:   # times differ between any two runs
                _compare(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            _compare(x, y, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        if a is None or b is None:
            assert a is b, f"{where}: {a} != {b}"
        elif math.isnan(a):
            assert math.isnan(b), f"{where}: nan != {b}"
        else:
            assert math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _same_curves(strategy: str, batched_fully: bool = True, **settings: Any) -> dict[str, Any]:
    """Run both engines; with ``batched_fully`` also check that no request fell back to the
    per-client path (else equal curves would prove nothing).
    """
    log = logging.getLogger("graphfl.server.batched")
    lines, level = _Lines(), log.level
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    try:
        batched, _ = _run("batched", strategy=strategy, **settings)
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
    inproc, _ = _run("inprocess", strategy=strategy, **settings)
    assert batched["status"] == inproc["status"] == "completed"
    _compare(batched["methods"][strategy]["curve"], inproc["methods"][strategy]["curve"], strategy)
    assert batched["env"]["engine"] == "batched"
    fallbacks = [line for line in lines.lines if "client by client" in line]
    if batched_fully:
        assert not fallbacks, fallbacks
        assert any("per chunk" in line for line in lines.lines), lines.lines
    return batched


PLAIN = ["fedavg", "fedprox", "local", "fesem", "cfl", "jgesr", "fedamp", "pfedgraph"]


@pytest.mark.parametrize("strategy", PLAIN)
def test_plain_sgd_strategies_equal_the_per_client_engine_on_synthetic_multicenter(strategy):
    settings: dict[str, Any] = {"task": "synthetic-multicenter", "train.momentum": 0.5, "train.weight-decay": 0.01}
    if strategy == "fedprox":
        settings["fedprox.mu"] = 0.1
    if strategy == "pfedgraph":
        settings["pfedgraph.lam"] = 0.1
    doc = _same_curves(strategy, **settings)
    assert doc["env"]["batch_chunk"] >= 6   # every client in one chunk


@pytest.mark.parametrize("strategy", ["fedavg", "fedprox", "fesem", "fedamp"])
def test_strategies_equal_the_per_client_engine_on_digits(strategy):
    _same_curves(strategy, task="digits", **({"fedprox.mu": 0.1} if strategy == "fedprox" else {}))


def test_partial_participation_and_separate_evaluation_are_equal():
    _same_curves("fedavg", task="digits", fraction_train=0.5, nodes=8)


def test_failed_and_nan_clients_are_masked_out_as_in_the_per_client_engine():
    cfg = parse_run_config({"strategy": "fedavg", "task": "synthetic-multicenter", "nodes": 6, "rounds": 2,
                            "train.local-steps": 3, "engine": "batched"})
    fail = {(1, 2): "error", (2, 4): "nan"}
    batched, _ = run_federated_inprocess(cfg, fail=fail)
    inproc, _ = run_federated_inprocess(parse_run_config({**cfg.to_flat(), "engine": "inprocess"}), fail=fail)
    a, b = batched["methods"]["fedavg"]["curve"], inproc["methods"]["fedavg"]["curve"]
    assert a[1]["clients_ok"] == 5 and a[2]["clients_ok"] == 5
    _compare(a, b, "fedavg-failures")


def test_compression_and_noisy_channel_are_equal():
    _same_curves("fedavg", task="synthetic-multicenter", **{"compress.kind": "quant", "compress.bits": 4,
                                                             "channel.noise": 0.1, "channel.missing": 0.1})


def test_fedgate_equals_the_per_client_engine():
    _same_curves("fedgate", task="synthetic-multicenter")


def test_chunks_of_the_client_axis_give_the_same_numbers():
    from graphfl.common import registry
    from graphfl.server.batched import BatchedExchange
    from graphfl.server.inprocess import server_inputs
    from graphfl.server.recorder import RunRecorder
    from graphfl.server.rounds import run_federated

    cfg = parse_run_config({"strategy": "fedprox", "task": "synthetic-multicenter", "nodes": 7, "rounds": 2,
                            "train.local-steps": 3, "engine": "batched", "fedprox.mu": 0.1})
    docs = []
    for chunk in (None, 3):
        exchange = BatchedExchange(cfg, chunk=chunk)
        recorder = RunRecorder(cfg, cfg.strategy, None, env={})
        run_federated(cfg, registry.get(cfg.strategy), exchange, server_inputs(cfg), recorder)
        docs.append(recorder.document())
        assert exchange.chunk == (chunk or exchange.chunk) and exchange.batched_clients > 0
    _compare(docs[0]["methods"]["fedprox"]["curve"], docs[1]["methods"]["fedprox"]["curve"], "chunked")


def test_a_trainer_that_does_not_batch_runs_client_by_client_with_one_log_line(caplog):
    import graphfl.tests.probe_strategy  # noqa: F401  registers "probe" (a trainer with its own fit)

    with caplog.at_level(logging.INFO, logger="graphfl.server.batched"):
        _same_curves("probe", batched_fully=False, task="synthetic-multicenter")
    lines = [r.getMessage() for r in caplog.records if "client by client" in r.getMessage()]
    assert lines and all("ProbeTrainer" in line for line in lines)
    assert len(lines) == len(set(lines))


def test_unbatchable_models_and_inputs_are_named():
    from graphfl.client.batched import unbatchable_reason
    from graphfl.common.types import ClientData

    x = np.zeros((4, 3), np.float32)
    plain = ClientData(x, np.zeros(4, np.int64), x, np.zeros(4, np.int64))
    graphs = ClientData(x, np.zeros(4, np.int64), x, np.zeros(4, np.int64), collate=torch.as_tensor)
    assert unbatchable_reason(nn.Linear(3, 2), plain) is None
    assert "collate" in str(unbatchable_reason(nn.Linear(3, 2), graphs))
    assert "buffers" in str(unbatchable_reason(nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)), plain))
    assert "Dropout" in str(unbatchable_reason(nn.Sequential(nn.Linear(3, 2), nn.Dropout(0.1)), plain))


def test_the_client_graph_is_built_once_for_all_clients(monkeypatch):
    from graphfl.server.inprocess import InProcessExchange
    from graphfl.tasks.synthetic import SyntheticMulticenter

    calls = []
    original = SyntheticMulticenter.client_graph

    def counting(self, n):
        calls.append(n)
        return original(self, n)

    monkeypatch.setattr(SyntheticMulticenter, "client_graph", counting)
    cfg = parse_run_config({"strategy": "fedavg", "task": "synthetic-multicenter", "nodes": 12, "rounds": 1,
                            "engine": "inprocess"})
    exchange = InProcessExchange(cfg)
    for pid in range(12):
        exchange.runtime(pid)
    assert len(calls) == 1
    assert exchange.runtime(5).ctx.neighbourhood.ids   # the shared graph still gives each client its neighbours


def test_minibatch_indices_are_the_per_client_draws_and_leave_the_generator_where_sgd_steps_does():
    from graphfl.client.batched import draw_indices
    from graphfl.client.objective import LocalObjective
    from graphfl.client.training import _batches

    for n in (1, 7, 31, 32, 33, 64, 100, 333):
        for steps in (1, 3, 10, 25):
            r1, r2 = np.random.default_rng([n, steps]), np.random.default_rng([n, steps])
            drawn = draw_indices(LocalObjective({}, steps, r1), n, 32)
            assert np.array_equal(drawn, np.stack(list(_batches(n, 32, steps, r2)))), (n, steps)
            assert r1.random() == r2.random()   # a later draw (BiG-FL's Hessian sample) sees the same state


def test_a_payload_that_does_not_fit_the_model_fails_that_client_only_with_the_same_reason():
    from graphfl.common import wire
    from graphfl.common.core import FIT_PHASE
    from graphfl.common.types import Payload
    from graphfl.server.batched import BatchedExchange
    from graphfl.server.exchange import Request
    from graphfl.server.inprocess import InProcessExchange, server_inputs

    cfg = parse_run_config({"strategy": "fedavg", "task": "synthetic-multicenter", "nodes": 4, "rounds": 1,
                            "train.local-steps": 2, "engine": "batched"})
    initial = server_inputs(cfg).initial_arrays
    broken = {k: v for k, v in list(initial.items())[1:]}
    payloads = {0: Payload(initial), 1: Payload(broken), 2: Payload(initial), 3: Payload(initial)}
    request = Request(wire.TRAIN, 1, FIT_PHASE, True)
    batched = BatchedExchange(cfg).send(request, payloads)
    inproc = InProcessExchange(cfg).send(request, payloads)
    assert batched[1].error is not None and batched[1].error == inproc[1].error
    assert "missing" in batched[1].error
    for pid in (0, 2, 3):
        assert batched[pid].error is None
        for key, value in inproc[pid].arrays.items():
            np.testing.assert_allclose(batched[pid].arrays[key], value, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", ["first_order", "implicit"])
def test_bigfl_equals_the_per_client_engine(mode):
    _same_curves("bigfl", task="synthetic-multicenter", **{"bigfl.hypergrad-mode": mode})


@pytest.mark.parametrize("strategy", ["local", "fesem", "fedgate", "bigfl", "apflgate"])
def test_a_resumed_batched_run_equals_the_uninterrupted_one(tmp_path, strategy):
    """Client state (personal models, δ, the last upload) is mirrored and restored by the batched
    engine as by the per-client one: round 1 + resume to round 3 gives the uninterrupted run's numbers.
    """
    values = {"task": "synthetic-multicenter", "nodes": 4, "train.local-steps": 2, "engine": "batched",
              "run-key": "unit", "strategy": strategy, "rounds": 3}
    ref, _ = run_federated_inprocess(parse_run_config(values), tmp_path / "ref")
    run_federated_inprocess(parse_run_config({**values, "rounds": 1}), tmp_path / "res")
    doc, _ = run_federated_inprocess(parse_run_config({**values, "resume": True}), tmp_path / "res")
    assert doc["status"] == "completed" and doc["resumed_from_round"] == 1
    keys = ("test_loss", "train_loss", "test_loss_per_client", "bytes_up")   # the resumed row also says state_restored
    got = [{k: row.get(k) for k in keys} for row in doc["methods"][strategy]["curve"][2:]]
    want = [{k: row.get(k) for k in keys} for row in ref["methods"][strategy]["curve"][2:]]
    assert len(got) == 2
    _compare(got, want, f"{strategy}-resumed")


def test_bigfl_phi_per_client_counts_against_the_memory_budget(monkeypatch):
    """φ is d×d per client (1 MB at d = 512): with a 3 MB budget the model alone would allow
    every client in one chunk, φ only two; the numbers stay those of the unchunked run.
    """
    from graphfl.client import batched
    from graphfl.common import registry
    from graphfl.server.batched import BatchedExchange
    from graphfl.server.inprocess import server_inputs
    from graphfl.server.recorder import RunRecorder
    from graphfl.server.rounds import run_federated

    cfg = parse_run_config({"strategy": "bigfl", "task": "synthetic-multicenter", "nodes": 6, "rounds": 2,
                            "train.local-steps": 3, "engine": "batched"})
    curves = []
    for budget in (batched.CPU_BUDGET_BYTES, 3 << 20):
        monkeypatch.setattr(batched, "CPU_BUDGET_BYTES", budget)
        exchange = BatchedExchange(cfg)
        recorder = RunRecorder(cfg, cfg.strategy, None, env={})
        run_federated(cfg, registry.get(cfg.strategy), exchange, server_inputs(cfg), recorder)
        curves.append(recorder.document()["methods"]["bigfl"]["curve"])
        if budget == 3 << 20:
            assert exchange.chunk is not None and exchange.chunk >= 6
            assert exchange.train_chunks == {2}
        else:
            assert min(exchange.train_chunks) >= 6   # every client in one chunk
    _compare(curves[0], curves[1], "bigfl-chunked")
