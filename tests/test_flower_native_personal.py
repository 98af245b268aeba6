"""graphfl.flower's BiGFL, APFL and APFLGate: the hooks driven like Flower's loop, clients in-process.

The clients are the example's ClientApp with graphfl's client parts
(examples/flower_app/graphfl_example/client_app_terms.py), called through Flower's own
``ClientApp`` with its mods (``graphfl_mod``), one ``Context`` per client kept across rounds (its
``context.state`` holds APFL's ``v_i``, ``α_i``, the local copy and FedGATE's ``δ_i``). The
reference is graphfl's own round loop (``run_federated``) with graphfl's own client halves
(``BiGFLTrainer``, ``GateTrainer``: full-batch steps, as the example trains) on the same data.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, Metadata, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

import graphfl.flower as gf
from graphfl.common import registry, wire
from graphfl.common.config import ConfigError, RunConfig, TrainConfig
from graphfl.common.core import EVALUATE_PHASE
from graphfl.common.types import Payload
from graphfl.flower import keys
from graphfl.flower.adapter import ClientReply, numpy_to_record
from graphfl.flower.client import graphfl_mod, regulariser
from graphfl.server.exchange import Reply, Request
from graphfl.server.recorder import RunRecorder
from graphfl.server.rounds import ServerInputs, run_federated
from graphfl.tests import test_flower_native as fn
from graphfl.tests.test_flower_native_e2e import TrainerExchange

task = fn.task
client_app_terms = importlib.import_module("graphfl_example.client_app_terms")   # fn put the example on sys.path

N, ROUNDS = 6, 3


def message(content: RecordDict, nid: int, kind: str, server_round: int) -> Message:
    """A message as the SuperLink delivers it to node ``nid``."""
    meta = Metadata(run_id=1, message_id=f"m-{nid}-{server_round}-{kind}", src_node_id=1, dst_node_id=nid,
                    reply_to_message_id="", group_id=str(server_round), created_at=time.time(), ttl=3600.0,
                    message_type=kind)
    return Message(content, metadata=meta)


class App:
    """Flower's ClientApp ``app`` serving the nodes ``fn.node(pid)``, each with its own Context."""

    def __init__(self, app: ClientApp, n: int) -> None:
        self.app = app
        self.contexts = {fn.node(p): Context(run_id=1, node_id=fn.node(p), node_config={"partition-id": p},
                                             state=RecordDict(), run_config={"local-steps": fn.STEPS, "lr": fn.LR})
                         for p in range(n)}

    def __call__(self, nid: int, content: RecordDict, kind: str, server_round: int) -> ClientReply:
        reply = self.app(message(content, nid, kind, server_round), self.contexts[nid])
        return ClientReply(nid, reply.content)

    def state(self, pid: int) -> RecordDict:
        return self.contexts[fn.node(pid)].state


def run_app(strategy: gf.GraphflStrategy, clients: App, n: int, rounds: int) -> None:
    """Flower's start() loop on the Flower-free halves of the hooks."""
    arrays = fn.initial_arrays()
    nodes = [fn.node(p) for p in range(n)]
    for r in range(1, rounds + 1):
        replies = [clients(nid, c, MessageType.TRAIN, r)
                   for nid, c in strategy.train_contents(r, nodes, arrays, ConfigRecord({"lr": fn.LR}))]
        strategy.fold_train(r, replies)
        evals = [clients(nid, c, MessageType.EVALUATE, r)
                 for nid, c in strategy.evaluate_contents(r, nodes, ConfigRecord(), arrays)]
        strategy.fold_evaluate(r, evals)


class EvalTrainerExchange(TrainerExchange):
    """graphfl's own client halves for training and for evaluation."""

    def send(self, request: Request, payloads: Mapping[int, Payload]) -> dict[int, Reply]:
        if request.kind == wire.TRAIN:
            return super().send(request, payloads)
        return {pid: Reply(pid, None, {wire.NUM_EXAMPLES: task.TEST, **{
            wire.EVAL_PREFIX + k: v for k, v in self.evaluate(pid, payload).items()}})
            for pid, payload in payloads.items()}

    def evaluate(self, pid: int, payload: Payload) -> dict[str, float]:
        return self.trainers[pid].evaluate_phase(EVALUATE_PHASE, payload, self.states[pid])


def reference(strategy: gf.GraphflStrategy, n: int, rounds: int,
              graph: np.ndarray | None = None) -> tuple[Any, EvalTrainerExchange]:
    """graphfl's runner with graphfl's own client halves of ``strategy.algorithm``."""
    exchange = EvalTrainerExchange(strategy.algorithm, strategy.params, n, {p: p for p in range(n)})
    cfg = RunConfig(strategy=strategy.algorithm, nodes=n, rounds=rounds, seed=strategy.seed, params=strategy.params,
                    train=TrainConfig(local_steps=fn.STEPS, batch_size=task.TRAIN, lr=fn.LR))
    init = fn.initial_arrays()
    inputs = ServerInputs(initial_arrays=init, param_keys=tuple(init), client_graph=graph,
                          graph_source="" if graph is None else "test")
    core = run_federated(cfg, registry.get(strategy.algorithm), exchange, inputs,
                         RunRecorder(cfg, strategy.algorithm, None))
    return core, exchange


def close(got: Any, want: Any, what: str) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64),
                               rtol=1e-5, atol=1e-6, err_msg=what)


PERSONAL = {
    "apfl": lambda: gf.APFL(client_lr=fn.LR, adaptive_alpha=True, alpha_lr=0.05),
    "apflgate": lambda: gf.APFLGate(alpha=0.25, client_lr=fn.LR, local_steps=fn.STEPS),
    "apflgate-aggregated": lambda: gf.APFLGate(tau=8, client_lr=fn.LR, local_steps=fn.STEPS,
                                               personal_output="aggregated"),
}


@pytest.mark.parametrize("name", sorted(PERSONAL))
def test_apfl_and_apflgate_with_the_client_helpers_equal_graphfls_runner(name):
    strategy = PERSONAL[name]()
    clients = App(client_app_terms.app, N)
    run_app(strategy, clients, N, ROUNDS)
    core, exchange = reference(strategy, N, ROUNDS)
    fn.assert_same_client_models(strategy, core, N)                     # the server's w (and ū)
    for pid in range(N):
        state, ref = clients.state(pid), exchange.states[pid]
        v = state[f"{keys.APFL_STATE}.v"]
        for k in ("weight", "bias"):
            close(v[k].numpy(), ref["model." + k], f"{name} client {pid} v_i {k}")
            close(state[f"{keys.APFL_STATE}.w-local"][k].numpy(), ref["apfl.w-local/" + k], f"{name} {pid} w_i {k}")
            if strategy.algorithm == "apflgate":
                close(state[f"{keys.GATE_STATE}.delta"][k].numpy(), ref["gate.delta/" + k], f"{name} {pid} δ_i {k}")
        close(state[f"{keys.APFL_STATE}.meta"]["alpha"], ref["apfl.alpha"], f"{name} {pid} α_i")
        want = exchange.evaluate(pid, core.evaluation_payload(pid))          # the personal output (C6)
        close(strategy.client_evaluations[ROUNDS][pid]["test_loss"], want["test_loss"], f"{name} {pid} test loss")
    if name == "apfl":      # the adaptive α moved
        assert {round(float(clients.state(p)[f"{keys.APFL_STATE}.meta"]["alpha"]), 6) for p in range(N)} != {0.5}


@pytest.mark.parametrize("mode", ["implicit", "reg_only"])
def test_bigfl_with_the_client_term_equals_graphfls_runner_and_learns_phi(mode):
    graph = task.client_graph(N)
    strategy = gf.BiGFL(client_graph=graph, alpha=0.05, hypergrad_mode=mode)
    run_app(strategy, App(client_app_terms.app, N), N, ROUNDS)
    core, _ = reference(strategy, N, ROUNDS, graph=graph)
    fn.assert_same_client_models(strategy, core, N)
    close(strategy.phi(), core.phi.numpy(), "phi")
    assert min(strategy.server_metrics[r]["hypergrad_norm"] for r in range(1, ROUNDS + 1)) > 1e-6   # a real signal
    # implicit: the clients' Hessians reached the core (φ equal to the reference's needs them; the LL
    # curvature check runs on them only)
    assert ("ll_min_curvature" in strategy.server_metrics[1]) == (mode == "implicit")
    assert strategy.server_metrics[ROUNDS]["phi_minus_identity"] > 0.01       # the upper level moved φ
    contents = strategy.train_contents(ROUNDS + 1, [fn.node(p) for p in range(N)], fn.initial_arrays(), ConfigRecord())
    cfg = contents[0][1][keys.CONFIG]
    assert cfg[keys.REGULARISER] == keys.BIGFL and list(cfg[keys.THETA_KEYS]) == ["weight", "bias"]
    assert cfg[keys.RIDGE] == "proximal" and cfg["bigfl.a-ii"] == pytest.approx(1 / 3)   # ring: Â_ii = 1/3
    assert sorted(contents[0][1][keys.ANCHOR].keys()) == ["bigfl/m", "bigfl/phi"]
    assert list(contents[0][1][keys.ARRAYS].keys()) == ["weight", "bias"]


def stock_reply(pid: int, metrics: dict[str, Any]) -> ClientReply:
    trained, n_ex = fn.client_train(pid, fn.initial_arrays())
    return ClientReply(fn.node(pid), RecordDict({keys.ARRAYS: numpy_to_record(trained),
                                                 keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: n_ex, **metrics})}))


def test_bigfl_without_the_client_term_or_the_hessian_stops_naming_what_to_add():
    strategy = gf.BiGFL(client_graph=task.client_graph(2))
    strategy.train_contents(1, [fn.node(0), fn.node(1)], fn.initial_arrays(), ConfigRecord())
    with pytest.raises(gf.CooperationError, match=r"'bigfl-ll'.*graphfl_mod.*regulariser\(msg\)\(model\)"):
        strategy.fold_train(1, [stock_reply(0, {})])
    with pytest.raises(gf.CooperationError, match=r"implicit.*node 10000 has no ArrayRecord 'graphfl.hessian'.*bigfl_hessian"):
        strategy.fold_train(1, [stock_reply(0, {keys.APPLIED: 1})])
    with pytest.raises(ValueError, match=r"client graph is \(3, 3\).*n = 2"):
        gf.BiGFL(client_graph=task.client_graph(3)).train_contents(1, [fn.node(0), fn.node(1)], fn.initial_arrays(),
                                                                   ConfigRecord())


def test_apfl_without_the_personal_model_stops_naming_personal_in_train_and_personal_model_in_evaluate():
    strategy = gf.APFL()
    nodes = [fn.node(0), fn.node(1)]
    strategy.train_contents(1, nodes, fn.initial_arrays(), ConfigRecord())
    with pytest.raises(gf.CooperationError, match=r"'apfl-personal'.*Personal\(msg, context, model\).*pers\.step"):
        strategy.fold_train(1, [stock_reply(0, {})])
    strategy.fold_train(1, [stock_reply(0, {keys.APPLIED: 1}), stock_reply(1, {keys.APPLIED: 1})])
    evals = strategy.evaluate_contents(1, nodes, ConfigRecord())
    assert all(c[keys.CONFIG][keys.REGULARISER] == keys.PERSONAL for _, c in evals)
    stock_eval = ClientReply(fn.node(0), RecordDict({keys.METRICS: MetricRecord({"test_loss": 1.0,
                                                                                 keys.NUM_EXAMPLES: task.TEST})}))
    with pytest.raises(gf.CooperationError, match=r"personal_model\(msg, context, model\)"):
        strategy.fold_evaluate(1, [stock_eval])


def test_apflgate_needs_both_parts_and_refuses_an_unstable_tau():
    half = ClientApp(mods=[graphfl_mod])      # the δ term but no personal model

    @half.train()
    def train_fn(msg: Message, context: Context) -> Message:
        model = task.make_model()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        x, y, _, _ = task.load_data(int(context.node_config["partition-id"]))
        task.train(model, x, y, fn.STEPS, fn.LR, extra=regulariser(msg))
        return Message(RecordDict({"arrays": numpy_to_record({k: v.detach().numpy() for k, v in
                                                              model.state_dict().items()}),
                                   "metrics": MetricRecord({"num-examples": len(x)})}), reply_to=msg)

    strategy = gf.APFLGate(client_lr=fn.LR, local_steps=fn.STEPS)
    clients = App(half, 2)
    contents = strategy.train_contents(1, [fn.node(0), fn.node(1)], fn.initial_arrays(), ConfigRecord())
    assert contents[0][1][keys.CONFIG][keys.REGULARISER] == "gate-delta+apfl-personal"
    reply = clients(contents[0][0], contents[0][1], MessageType.TRAIN, 1)
    assert reply.content is not None and reply.content[keys.METRICS][keys.APPLIED] == 0
    with pytest.raises(gf.CooperationError, match=r"APFLGate.*Personal\(msg, context, model\).*regulariser"):
        strategy.fold_train(1, [reply])
    with pytest.raises(ConfigError, match=r"apflgate.tau = 4 .*must exceed R/2 = 5"):
        gf.APFLGate(tau=4, local_steps=10).train_contents(1, [fn.node(0)], fn.initial_arrays(), ConfigRecord())
