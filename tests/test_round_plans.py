"""Rounds as plans of phases: the loop, the client dispatch, and a two-phase algorithm run
in-process and in a real two-SuperNode deployment with identical numbers.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import graphfl.tests.probe_strategy as probe  # registers probe, probe-mix, probe-mix-pb
from graphfl.client.handler import build_runtime, handle
from graphfl.common import wire
from graphfl.common.config import RunConfig, parse_run_config
from graphfl.common.core import FIT_PHASE, Phase, ServerContext, ServerCore
from graphfl.common.types import ClientUpdate, Payload
from graphfl.server.exchange import Reply, Request
from graphfl.server.inprocess import run_federated_inprocess
from graphfl.server.rounds import run_phase
from graphfl.strategies.fedavg import FedAvgCore, FedAvgParams

MIX = {"strategy": "probe-mix", "task": "digits", "nodes": 3, "rounds": 2, "engine": "inprocess"}


def _ctx(params=None) -> ServerContext:
    tmpl = {"w": np.zeros(2, np.float32)}
    return ServerContext(config=RunConfig(), params=params or FedAvgParams(), num_clients=2, initial_arrays=tmpl,
                         param_keys=("w",), num_examples={0: 1, 1: 1})


def test_default_plan_is_one_fit_phase_of_configure_and_aggregate_train():
    core = FedAvgCore(_ctx())
    (phase,) = list(core.round_plan(1))
    assert phase.name == FIT_PHASE and phase.kind == wire.TRAIN
    assert phase.configure(1, 0) is core.configure_train(1, 0)
    assert phase.template(0) is core.update_template(0)
    phase.aggregate(1, {0: ClientUpdate(0, {"w": np.array([2.0, 4.0], np.float32)}, 1)})
    np.testing.assert_array_equal(core.global_arrays["w"], [2.0, 4.0])


def test_a_core_without_train_hooks_or_plan_is_refused_by_name():
    class Half(ServerCore):
        def evaluation_payload(self, partition_id):
            return Payload({})

    with pytest.raises(TypeError, match="Half must implement configure_train and aggregate_train"):
        Half(_ctx())


def test_phase_validates_kind_and_template():
    with pytest.raises(ValueError, match="kind 'bogus'"):
        Phase("x", lambda r, p: None, lambda r, u: {}, lambda p: {}, kind="bogus")
    with pytest.raises(ValueError, match="phase 'x': a train phase needs a reply template"):
        Phase("x", lambda r, p: None, lambda r, u: {})
    Phase("x", lambda r, p: None, lambda r, u: {}, kind=wire.EVALUATE)  # evaluate phases need none


class _Echo:
    """Exchange stub: answers every client with the payload's arrays (or an evaluation)."""

    def __init__(self):
        self.requests: list[tuple[Request, list[int]]] = []

    def join(self, initial, num_clients):  # pragma: no cover - not used here
        raise AssertionError

    def send(self, request, payloads):
        self.requests.append((request, sorted(payloads)))
        if request.kind == wire.EVALUATE:
            return {pid: Reply(pid, None, {"eval.test_loss": float(pid)}) for pid in payloads}
        return {pid: Reply(pid, dict(p.arrays), {wire.NUM_EXAMPLES: 1.0}) for pid, p in payloads.items()}


def test_run_phase_configures_sends_validates_and_aggregates_in_order():
    seen: dict = {}
    arrays = {"w": np.ones(2, np.float32)}
    phase = Phase("stage", lambda r, pid: None if pid == 1 else Payload(arrays),
                  lambda r, ups: seen.update(ups) or {"n": len(ups)}, lambda pid: {"w": np.zeros(3, np.float32)})
    ex = _Echo()
    out = run_phase(phase, ex, 4, [0, 1, 2])
    assert ex.requests == [(Request(wire.TRAIN, 4, "stage", False), [0, 2])]   # client 1 sat it out
    assert set(out.rejected) == {0, 2} and "shape" in out.rejected[0]       # template says 3 entries
    assert seen == {} and out.server_metrics == {"n": 0}                      # aggregate still called
    assert out.bytes_down == 16 and out.bytes_up == 16
    ev = Phase("ask", lambda r, pid: Payload({}), lambda r, ups: {"losses": [u.metrics["test_loss"] for u in ups.values()]},
               kind=wire.EVALUATE)
    out = run_phase(ev, ex, 4, [0, 2])
    assert out.server_metrics == {"losses": [0.0, 2.0]} and ex.requests[-1][0].phase == "ask"


def test_trainer_dispatches_phases_and_names_an_unknown_one():
    cfg = parse_run_config(MIX)
    rt = build_runtime(cfg, 0, 3)
    state: dict = {}
    arrays, _ = handle(rt, wire.TRAIN, 1, Payload({"x": np.full(probe.MIX_DIM, 1, np.float32)}), state)
    assert set(arrays) == {"u"} and probe.STATE_U in state                       # default phase: fit
    m = np.arange(probe.MIX_DIM, dtype=np.float64)
    arrays, metrics = handle(rt, wire.TRAIN, 1, Payload({"m": m}, {probe.MIX_ROUND_KEY: 1}), state, phase="mix")
    np.testing.assert_array_equal(arrays["r"], m - state[probe.STATE_U].astype(np.float64))
    with pytest.raises(ValueError, match="has no train phase 'tune'"):
        handle(rt, wire.TRAIN, 1, Payload({}), state, phase="tune")
    with pytest.raises(ValueError, match="has no evaluate phase 'audit'"):
        handle(rt, wire.EVALUATE, 1, Payload({}), state, phase="audit")


def test_clientapp_reads_kind_round_phase_and_payload_config_from_the_message():
    from flwr.app import ConfigRecord

    from graphfl.client.app import read_request

    rec = ConfigRecord({wire.KIND: "train", wire.ROUND: 3, wire.PHASE: "mix", wire.EVAL_FIRST: True,
                        "probe-mix.round": 3, "fesem.warmup": False})
    req = read_request(rec, wire.EVALUATE)
    assert (req.kind, req.server_round, req.phase, req.eval_first) == ("train", 3, "mix", True)
    assert req.payload_config == {"probe-mix.round": 3, "fesem.warmup": False}   # control keys stripped
    assert read_request(None, wire.TRAIN).phase is None                         # handler's default phase
    with pytest.raises(ValueError, match="'bad' is a list"):
        read_request(ConfigRecord({"bad": [1, 2]}), wire.TRAIN)


def _expected_mix(cfg, rounds, clients):
    """Hand-computed dots of every round from the clients' own data."""
    data = {pid: build_runtime(cfg, pid, cfg.nodes).ctx.data.x_train for pid in clients}
    out = {}
    for r in range(1, rounds + 1):
        u = {pid: probe.client_vector(data[pid], pid, r) for pid in clients}
        out[r] = {str(pid): float(probe.mixture(u, pid) @ u[pid].astype(np.float64)) for pid in clients}
    return out


def test_two_phase_rounds_in_process():
    cfg = parse_run_config(MIX)
    doc, core = run_federated_inprocess(cfg)
    curve = doc["methods"]["probe-mix"]["curve"]
    want = _expected_mix(cfg, 2, [0, 1, 2])
    for r in (1, 2):
        row = curve[r]
        assert row["server"]["mix_ok"] is True and row["server"]["uploads"] == [0, 1, 2]
        assert row["server"]["dots"] == pytest.approx(want[r], rel=1e-12)
        names = [ph["phase"] for ph in row["phases"]]
        assert names == ["fit", "mix"]
        fit, mix = row["phases"]
        assert fit["bytes_down"] == fit["bytes_up"] == 3 * probe.MIX_DIM * 4       # float32 vectors
        assert mix["bytes_down"] == mix["bytes_up"] == 3 * probe.MIX_DIM * 8       # float64 vectors
        assert row["bytes_down"] == fit["bytes_down"] + mix["bytes_down"]
        assert all(ph["seconds"] >= ph["server_seconds"] >= 0 for ph in row["phases"])
        assert row["clients_ok"] == 3 and "failed" not in row
    # separate evaluation after each round measures the last mixture against the state's u
    assert curve[2]["test_loss"] == pytest.approx(
        np.mean([np.mean((core.last_mix[p] - _u(cfg, p, 2)) ** 2) for p in range(3)]), rel=1e-12)


def _u(cfg, pid, r):
    return probe.client_vector(build_runtime(cfg, pid, cfg.nodes).ctx.data.x_train, pid, r).astype(np.float64)


def test_a_client_failing_phase_one_sits_out_phase_two_and_a_phase_two_failure_is_named():
    cfg = parse_run_config({**MIX, "rounds": 2})
    doc, _ = run_federated_inprocess(cfg, fail={(1, 1): "nan", (2, 2, "mix"): "error"})
    curve = doc["methods"]["probe-mix"]["curve"]
    s1 = curve[1]["server"]
    assert s1["uploads"] == [0, 2] and s1["mixed"] == [0, 2] and s1["mix_ok"] is True
    assert curve[1]["phases"][1]["clients"] == 2                                    # 1 got no mixture
    assert "phase fit:" in curve[1]["failed"]["1"] and "NaN" in curve[1]["failed"]["1"]
    assert curve[1]["clients_ok"] == 2
    want = _expected_mix(cfg, 1, [0, 2])
    assert s1["dots"] == pytest.approx(want[1], rel=1e-12)
    assert curve[2]["failed"] == {"2": "phase mix: injected failure"}
    assert curve[2]["server"]["uploads"] == [0, 1, 2] and curve[2]["server"]["mixed"] == [0, 1]


def test_piggybacked_evaluation_with_two_phases_reports_the_previous_round():
    doc, _ = run_federated_inprocess(parse_run_config({**MIX, "strategy": "probe-mix-pb", "rounds": 3}))
    curve = doc["methods"]["probe-mix-pb"]["curve"]
    # first-phase payloads carry no mixture: the trainer evaluates them as 0; the final
    # evaluation exchange sends the last mixtures
    assert [row["test_loss"] for row in curve[:3]] == [0.0, 0.0, 0.0]
    assert curve[3]["test_loss"] > 0 and all(row["server"]["mix_ok"] for row in curve[1:])


# ---------------------------------------------------------------------------------------
# the same two-phase algorithm on real SuperLink / SuperNode processes
# ---------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_two_phase_rounds_in_a_real_deployment_match_inprocess(tmp_path, monkeypatch):
    from graphfl.deploy.run import run_experiment

    monkeypatch.setenv("GRAPHFL_PLUGINS", "graphfl.tests.probe_strategy")
    values = {**MIX, "nodes": 2, "engine": "local-deployment", "out-dir": str(tmp_path),
              "connect-timeout": 90, "round-timeout": 120}
    out = run_experiment(parse_run_config(values))
    doc = json.loads((out / "run.json").read_text())
    assert doc["status"] == "completed", doc.get("error")
    got = doc["methods"]["probe-mix"]["curve"]
    ref, _ = run_federated_inprocess(parse_run_config({**values, "engine": "inprocess", "out-dir": ""}))
    want = ref["methods"]["probe-mix"]["curve"]
    assert [r["round"] for r in got] == [r["round"] for r in want] == [0, 1, 2]
    for g, w in zip(got, want):
        assert g["test_loss"] == w["test_loss"]                                   # bit-identical
        if g["round"] == 0:
            continue
        assert g["server"] == w["server"] and g["server"]["mix_ok"] is True        # dots bit-identical
        assert g["train_loss"] == w["train_loss"] and g["bytes_up"] == w["bytes_up"]
        assert [(p["phase"], p["bytes_down"], p["bytes_up"], p["clients_ok"]) for p in g["phases"]] == \
               [(p["phase"], p["bytes_down"], p["bytes_up"], p["clients_ok"]) for p in w["phases"]]
        assert all(math.isfinite(p["seconds"]) and p["seconds"] > 0 for p in g["phases"])


# ---------------------------------------------------------------------------------------
# docs/architecture.md's worked examples are real code
# ---------------------------------------------------------------------------------------


def _doc_modules() -> dict[str, str]:
    """``{module name: source}`` of the code blocks whose first line is ``# <pkg>/<name>.py``."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    out = {}
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        first = block.splitlines()[0]
        match = re.fullmatch(r"# (strategies|client)/(\w+)\.py", first.strip())
        if match:
            out[f"graphfl.{match[1]}.{match[2]}"] = block
    return out


@pytest.fixture()
def doc_algorithms():
    """Load the examples as the modules they name; unregister and unload them afterwards."""
    import sys
    import types

    from graphfl.common import registry as reg

    modules = _doc_modules()
    try:
        for name, source in modules.items():   # server halves come first in the doc
            module = types.ModuleType(name)
            sys.modules[name] = module
            exec(compile(source, f"docs/architecture.md:{name}", "exec"), module.__dict__)
        yield modules
    finally:
        names = [n for n, spec in reg._SERVER.items() if spec.server_core.__module__ in modules]
        for name in names:
            reg._SERVER.pop(name, None)
            reg._CLIENT.pop(name, None)
        for name in modules:
            sys.modules.pop(name, None)


def test_architecture_doc_examples_run_as_written(doc_algorithms):
    assert sorted(doc_algorithms) == ["graphfl.client.fedmedian_trainer", "graphfl.client.mixtune_trainer",
                                      "graphfl.strategies.fedmedian", "graphfl.strategies.mixtune"]
    base = {"task": "digits", "nodes": 3, "rounds": 2, "engine": "inprocess", "train.local-steps": 5}
    doc, core = run_federated_inprocess(parse_run_config({**base, "strategy": "fedmedian"}))
    curve = doc["methods"]["fedmedian"]["curve"]
    assert [ph["phase"] for ph in curve[1]["phases"]] == ["fit"] and curve[2]["clients_ok"] == 3
    assert curve[2]["test_loss"] < curve[0]["test_loss"]
    cfg = parse_run_config({**base, "strategy": "mixtune", "mixtune.self-weight": 0.3})
    assert cfg.params.self_weight == 0.3
    doc, core = run_federated_inprocess(cfg)
    curve = doc["methods"]["mixtune"]["curve"]
    assert [ph["phase"] for ph in curve[1]["phases"]] == ["fit", "finetune"]
    assert curve[2]["server"] == {"clients_kept": 3} and curve[2]["clients_evaluated"] == 3
    assert curve[2]["test_loss"] < curve[0]["test_loss"]
