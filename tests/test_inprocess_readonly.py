"""The in-process exchanges hand the receiving side read-only views, as a deployment does.

In a deployment the ServerApp reads every client reply, and the ClientApp its payload, as
read-only views into the received blob (tests/test_records_views.py). The in-process engines
(per-client and batched) must behave the same, so that a strategy or a trainer that writes into
what it received fails in every test, not only once deployed, and never corrupts the other
side's arrays in-process.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from graphfl.client.trainers import SGDTrainer
from graphfl.common import registry, wire
from graphfl.common.arrays import read_only_views
from graphfl.common.config import RunConfig, parse_run_config
from graphfl.common.core import FIT_PHASE
from graphfl.common.types import Arrays, ClientState, ClientUpdate, Payload
from graphfl.server.batched import BatchedExchange
from graphfl.server.exchange import Request
from graphfl.server.inprocess import InProcessExchange, server_inputs
from graphfl.server.recorder import RunRecorder
from graphfl.server.rounds import run_federated
from graphfl.strategies.fedavg import FedAvgCore

ENGINES = ["inprocess", "batched"]


def _cfg(engine: str, strategy: str = "fedavg", **extra: Any) -> RunConfig:
    return parse_run_config({"strategy": strategy, "task": "synthetic-multicenter", "nodes": 3, "rounds": 1,
                             "train.local-steps": 2, "engine": engine, **extra})


def _exchange(cfg: RunConfig) -> InProcessExchange:
    return BatchedExchange(cfg) if cfg.engine == "batched" else InProcessExchange(cfg)


def _train(exchange: InProcessExchange, payload: Payload) -> dict[int, Any]:
    request = Request(wire.TRAIN, 1, FIT_PHASE)
    return exchange.send(request, {pid: payload for pid in range(exchange.cfg.nodes)})


def test_read_only_views_share_the_data_and_leave_the_owner_writable() -> None:
    own = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "s": np.float32(2.0)}
    views = read_only_views(own)
    assert views is not own and list(views) == list(own)
    assert np.shares_memory(views["w"], own["w"]) and not views["w"].flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        views["w"][0, 0] = 1.0
    own["w"][0, 0] = 7.0   # the owner keeps writing its own array, and the view sees it
    assert own["w"].flags.writeable and views["w"][0, 0] == 7.0
    assert float(views["s"]) == 2.0 and not views["s"].flags.writeable
    memo: dict[int, np.ndarray] = {}
    once, twice = read_only_views(own, memo), read_only_views(dict(own), memo)
    assert once["w"] is twice["w"]   # one view per array: a broadcast stays one object per key


@pytest.mark.parametrize("engine", ENGINES)
def test_received_uploads_are_read_only_and_the_owners_arrays_stay_writable(engine: str) -> None:
    cfg = _cfg(engine)
    exchange = _exchange(cfg)
    own = {k: np.array(v, copy=True) for k, v in server_inputs(cfg).initial_arrays.items()}
    before = {k: v.copy() for k, v in own.items()}
    with warnings.catch_warnings():  # a received view is never handed to torch as if it were writable
        warnings.filterwarnings("error", message="The given NumPy array is not writable")
        replies = _train(exchange, Payload(own))
    assert all(r.error is None and r.arrays for r in replies.values()), replies
    for reply in replies.values():
        assert reply.arrays is not None
        for key, arr in reply.arrays.items():
            assert not arr.flags.writeable, key
            with pytest.raises(ValueError, match="read-only"):
                arr[...] = 0
    for key, arr in own.items():   # the server's model: untouched, still its own to update
        assert arr.flags.writeable
        np.testing.assert_array_equal(arr, before[key])
        arr += 1.0
    if engine == "batched":
        assert isinstance(exchange, BatchedExchange) and exchange.batched_clients == cfg.nodes


class _WritesIntoPayload(SGDTrainer[Any]):
    """A trainer that (wrongly) scales the received model in place before training on it."""

    def start_arrays(self, payload: Payload, state: ClientState) -> Arrays:
        for arr in payload.arrays.values():
            arr *= 1.0
        return payload.arrays


@pytest.mark.parametrize("engine", ENGINES)
def test_a_client_that_writes_into_its_payload_fails_and_the_server_model_is_untouched(engine: str) -> None:
    cfg = _cfg(engine)
    exchange = _exchange(cfg)
    for pid in range(cfg.nodes):
        runtime = exchange.runtime(pid)
        runtime.trainer = _WritesIntoPayload(runtime.ctx)
    own = {k: np.array(v, copy=True) for k, v in server_inputs(cfg).initial_arrays.items()}
    replies = _train(exchange, Payload(own))
    for pid, reply in replies.items():
        assert reply.error is not None and "read-only" in reply.error, (pid, reply.error)
    assert all(arr.flags.writeable for arr in own.values())


@pytest.mark.parametrize("engine", ENGINES)
def test_a_client_that_keeps_its_upload_in_its_state_keeps_it_writable(engine: str) -> None:
    """Local training stores the trained model in the client state and uploads the same arrays:
    the server gets views, the client's state stays its own to write.
    """
    cfg = _cfg(engine, strategy="local")
    exchange = _exchange(cfg)
    replies = _train(exchange, Payload(server_inputs(cfg).initial_arrays))
    assert all(r.error is None and r.arrays for r in replies.values()), replies
    for pid in range(cfg.nodes):
        state = exchange.states[pid]
        assert state
        for key, arr in state.items():
            assert arr.flags.writeable, (pid, key)


class _WritesIntoUploads(FedAvgCore[Any]):
    """A FedAvg core that (wrongly) clips each upload in place before averaging."""

    def aggregate_train(self, server_round: int, updates: Mapping[int, ClientUpdate]) -> dict[str, Any]:
        for update in updates.values():
            for arr in update.arrays.values():
                np.clip(arr, -1e6, 1e6, out=arr)
        return super().aggregate_train(server_round, updates)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_core_that_writes_into_an_upload_raises_in_process(engine: str) -> None:
    cfg = _cfg(engine)
    spec = dataclasses.replace(registry.get("fedavg"), server_core=_WritesIntoUploads)
    recorder = RunRecorder(cfg, cfg.strategy, None, env={})
    with pytest.raises(ValueError, match="read-only"):
        run_federated(cfg, spec, _exchange(cfg), server_inputs(cfg), recorder)


@pytest.mark.parametrize("engine", ENGINES)
def test_fedavg_updates_its_own_model_after_a_round(engine: str) -> None:
    cfg = _cfg(engine, rounds=2)
    recorder = RunRecorder(cfg, cfg.strategy, None, env={})
    core = run_federated(cfg, registry.get("fedavg"), _exchange(cfg), server_inputs(cfg), recorder)
    assert recorder.document()["status"] == "completed"
    model = core.final_arrays()
    assert model is not None
    for arr in model.values():   # the core's own arrays: writable (never flipped by the exchange)
        assert arr.flags.writeable
