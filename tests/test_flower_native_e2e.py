"""graphfl.flower on real Flower processes: the example app (examples/flower_app) under ``flwr run``.

One SuperLink and 3 stock SuperNodes (``flower-superlink`` / ``flower-supernode``, one
``flwr-clientapp`` process per message, TLS) on 127.0.0.1 with free ports; the app is submitted
with ``flwr run`` like a user's own. Its ServerApp writes every client's final model and
evaluation; they must equal graphfl's own round loop (``run_federated``) over the same client
functions and the same client order (node id -> partition id, read from the SuperNodes' logs).
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from graphfl.client.objective import cosine_term, proximal_term
from graphfl.common import wire
from graphfl.common.types import Payload
from graphfl.deploy.federation import FederationError, LocalFederation
from graphfl.server.exchange import Reply, Request
from graphfl.strategies.pfedgraph import CLUSTER_PREFIX
from graphfl.tests import test_flower_native as fn

pytestmark = pytest.mark.e2e

NODES, ROUNDS = 3, 2
RUN_TIMEOUT_S = 1800.0
"""Bound of one `flwr run`: every message starts a `flwr-clientapp` process, slow on a loaded machine."""
COMPONENT = 'clientapp = "graphfl_example.client_app:app"'
CFG = {"prox-mu": 0.0, "pfedgraph-lam": 0.0, "lr": fn.LR, "local-steps": fn.STEPS}
"""The example's run config as its make_strategy reads it (defaults of examples/flower_app)."""


def app_copy(dest: Path, terms: bool = False) -> Path:
    """The example app, optionally with the ClientApp that adds graphfl's client term."""
    shutil.copytree(fn.EXAMPLE, dest, ignore=shutil.ignore_patterns("__pycache__"))
    if terms:
        toml = dest / "pyproject.toml"
        text = toml.read_text()
        assert COMPONENT in text
        toml.write_text(text.replace(COMPONENT, 'clientapp = "graphfl_example.client_app_terms:app"'))
    return dest


def submit(fed: LocalFederation, work: Path, app: Path, overrides: Mapping[str, Any],
           federation_config: str | None = None) -> dict[str, Any]:
    out = work / "out"
    out.mkdir(parents=True)
    values = {**overrides, "num-server-rounds": ROUNDS, "out-dir": str(out)}
    lines = [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    (work / "overrides.toml").write_text("\n".join(lines) + "\n")
    sub = fed.submitter()
    handle = sub.submit(app, work / "overrides.toml", out, federation_config=federation_config)
    sub.wait_status(handle.run_id, RUN_TIMEOUT_S, interval=2.0)
    doc: dict[str, Any] = json.loads((out / "results.json").read_text())
    return doc


def data_partitions(fed: LocalFederation) -> dict[int, int]:
    """Node id -> the partition id in its node config (each SuperNode logs its node id)."""
    out = {}
    for i in range(NODES):
        match = re.search(r"SuperNode ID: (\d+)", (fed.run_dir / "logs" / f"supernode-{i}.log").read_text())
        assert match, f"supernode-{i}.log names no node id"
        out[int(match.group(1))] = i
    return out


class TermsExchange(fn.TaskExchange):
    """The reference clients with the client term (graphfl's own penalty functions)."""

    def __init__(self, n: int, data_of: Mapping[int, int], mu: float = 0.0, lam: float = 0.0) -> None:
        super().__init__(n, data_of)
        self.mu, self.lam = mu, lam
        self.own: dict[int, dict[str, np.ndarray]] = {}
        """Local-only training: each client's own model (what graphfl_mod keeps in context.state)."""

    def send(self, request: Request, payloads: Mapping[int, Payload]) -> dict[int, Reply]:
        payloads = {pid: p if p.arrays else Payload(self.own[pid]) for pid, p in payloads.items()}
        if request.kind != wire.TRAIN:
            return super().send(request, payloads)
        out = {}
        for pid, payload in payloads.items():
            model = {k: v for k, v in payload.arrays.items() if k in self.model_keys}
            cluster = {k[len(CLUSTER_PREFIX):]: v for k, v in payload.arrays.items() if k.startswith(CLUSTER_PREFIX)}
            keys_ = tuple(self.model_keys)
            term = None
            if self.mu > 0:
                term = proximal_term(model, self.mu, keys_)
            elif self.lam > 0 and cluster:
                term = cosine_term(cluster, self.lam, keys_)
            extra = None if term is None else (lambda m, t=term: t(dict(m.named_parameters())))
            arrays, n_ex = fn.client_train(self.data_of[pid], model, extra)
            self.own[pid] = arrays
            out[pid] = Reply(pid, arrays, {wire.NUM_EXAMPLES: n_ex})
        return out


class ExampleTask:
    """The example's model and loss as a graphfl task view (for graphfl's own client halves)."""

    name, kind = "flower-example", "regression"

    def build_model(self) -> Any:
        return fn.task.make_model()

    def loss_fn(self) -> Any:
        from torch import nn

        return nn.MSELoss()

    def metrics(self, *args: Any) -> dict[str, float]:
        return {}


class TrainerExchange(fn.TaskExchange):
    """graphfl's own client half of ``algorithm`` (its ClientTrainer, state kept per client) on the
    example's data; full-batch steps (batch size = the training set), as the example trains."""

    def __init__(self, algorithm: str, params: Any, n: int, data_of: Mapping[int, int]) -> None:
        from graphfl.common import registry
        from graphfl.common.config import RunConfig, TrainConfig
        from graphfl.common.core import ClientContext
        from graphfl.common.types import ClientData

        super().__init__(n, data_of)
        cfg = RunConfig(strategy=algorithm, nodes=n, params=params,
                        train=TrainConfig(local_steps=fn.STEPS, batch_size=fn.task.TRAIN, lr=fn.LR))
        spec = registry.get_client(algorithm)
        self.trainers = {}
        for pid in range(n):
            x, y, xt, yt = (t.numpy() for t in fn.task.load_data(self.data_of[pid]))
            ctx = ClientContext(cfg, params, pid, n, ExampleTask(), ClientData(x, y, xt, yt))
            self.trainers[pid] = spec.client_trainer(ctx)
        self.states: dict[int, dict[str, np.ndarray]] = {pid: {} for pid in range(n)}

    def send(self, request: Request, payloads: Mapping[int, Payload]) -> dict[int, Reply]:
        if request.kind != wire.TRAIN:
            return super().send(request, payloads)
        out = {}
        for pid, payload in payloads.items():
            res = self.trainers[pid].fit_phase("fit", request.server_round, payload, self.states[pid])
            self.trainers[pid].after_upload("fit", request.server_round, payload, res.arrays, self.states[pid])
            out[pid] = Reply(pid, res.arrays, {wire.NUM_EXAMPLES: res.num_examples})
        return out


def check_against_reference(work: Path, name: str, result: Mapping[str, Any], nodes: Mapping[int, int],
                            exchange: fn.TaskExchange | None = None, evaluated: bool = False) -> None:
    from graphfl_example.server_app import make_strategy

    data_of = {pid: nodes[int(nid)] for nid, pid in result["partition_of_node"].items()}
    assert sorted(data_of) == list(range(NODES)) and sorted(data_of.values()) == list(range(NODES))
    cfg = {**CFG, "prox-mu": getattr(exchange, "mu", 0.0), "pfedgraph-lam": getattr(exchange, "lam", 0.0)}
    strategy = make_strategy(name, cfg)
    core = fn.reference(strategy, NODES, ROUNDS, data_of, exchange=exchange)
    for pid in range(NODES):
        want = core.evaluation_payload(pid).arrays or getattr(exchange, "own", {}).get(pid, {})
        if name != "local":   # local-only models stay on the clients: only their evaluations come back
            got = np.load(work / "out" / f"{name}-client-{pid}.npz")
            assert sorted(got.files) == ["bias", "weight"]
            for k in got.files:
                np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=f"{name} client {pid} {k}")
        if evaluated:
            ev = result["client_evaluations"][str(ROUNDS)][str(pid)]
            model = {k: v for k, v in want.items() if k in ("weight", "bias")}
            expected = fn.client_eval(data_of[pid], model)
            if isinstance(exchange, TrainerExchange) and name in ("apfl", "apflgate"):   # the personal output
                expected = exchange.trainers[pid].evaluate_phase("evaluate", core.evaluation_payload(pid),
                                                                 exchange.states[pid])["test_loss"]
            assert ev["test_loss"] == pytest.approx(expected, rel=1e-5)
            assert ev["num-examples"] == fn.task.TEST


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    run = tmp_path_factory.mktemp("flower-native")
    with LocalFederation(run / "fed", nodes=NODES, tls=True, clientapp_mode="cold", superlink_middleware="stock",
                         start_timeout=120.0) as fed:
        yield fed


def test_stock_clientapp_runs_each_fedavg_like_strategy_and_equals_graphfls_runner(federation, tmp_path):
    names = ["fesem", "jgesr", "cfl", "fedamp", "pfedgraph"]
    app = app_copy(tmp_path / "app")
    tree = ast.parse((app / "graphfl_example" / "client_app.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not [m for m in imported if m.split(".")[0] == "graphfl"], imported      # Flower's API only
    assert "flwr.clientapp" in imported
    results = submit(federation, tmp_path, app, {"strategies": ",".join(names), "fraction-evaluate": 0.0})
    nodes = data_partitions(federation)
    assert sorted(results) == sorted(names)
    for name in names:
        check_against_reference(tmp_path, name, results[name], nodes)
    fesem = results["fesem"]["server_metrics"][str(ROUNDS)]
    assert sorted(fesem["cluster_sizes"]) == [1, 1, 1]      # 3 planted groups, one client each
    assert results["cfl"]["server_metrics"][str(ROUNDS)]["num_clusters"] >= 2


@pytest.mark.timeout(1500)   # five strategies under flwr run: near pytest's 600 s on a loaded 2-core machine
def test_cooperative_strategies_fedgate_and_local_run_with_the_mod_and_the_dp_wrapper_composes_with_fedavg(federation, tmp_path):
    from graphfl_example.server_app import make_strategy

    app = app_copy(tmp_path / "app", terms=True)
    results = submit(federation, tmp_path, app, {
        "strategies": "fedprox,pfedgraph,fedavg,local,fedgate", "prox-mu": 0.1, "pfedgraph-lam": 0.01,
        "dp-strategies": "fedavg", "dp-clip": 1000.0, "dp-noise": 0.0})
    nodes = data_partitions(federation)
    cases: tuple[tuple[str, dict[str, float]], ...] = (
        ("fedprox", {"mu": 0.1}), ("pfedgraph", {"lam": 0.01}), ("fedavg", {}), ("local", {}), ("fedgate", {}))
    for name, exchange_kw in cases:
        data_of = {pid: nodes[int(nid)] for nid, pid in results[name]["partition_of_node"].items()}
        exchange: fn.TaskExchange = TermsExchange(NODES, data_of, **exchange_kw)
        if name == "fedgate":   # graphfl's own FedGATE client half (its δ update) is the reference
            exchange = TrainerExchange("fedgate", make_strategy("fedgate", CFG).params, NODES, data_of)
        check_against_reference(tmp_path, name, results[name], nodes, exchange, evaluated=True)
        rounds = results[name]["evaluate_metrics"]
        assert sorted(rounds) == [str(r) for r in range(1, ROUNDS + 1)] and "test_loss" in rounds[str(ROUNDS)]
    assert results["fedavg"]["final_arrays"] == ["weight", "bias"]        # Result.arrays: the global model


@pytest.mark.timeout(1500)   # the run's own bound is RUN_TIMEOUT_S; pytest's 600 s is too near on a loaded machine
def test_apflgate_runs_with_the_personal_helpers_and_equals_graphfls_runner(federation, tmp_path):
    """APFLGate's client state (v_i, α_i, the local copy, δ_i) lives in the SuperNodes' contexts across
    rounds and one-process-per-message ClientApps; models and personal evaluations equal graphfl's runner."""
    from graphfl_example.server_app import make_strategy

    app = app_copy(tmp_path / "app", terms=True)
    results = submit(federation, tmp_path, app, {"strategies": "apflgate"})
    nodes = data_partitions(federation)
    data_of = {pid: nodes[int(nid)] for nid, pid in results["apflgate"]["partition_of_node"].items()}
    exchange = TrainerExchange("apflgate", make_strategy("apflgate", CFG).params, NODES, data_of)
    check_against_reference(tmp_path, "apflgate", results["apflgate"], nodes, exchange, evaluated=True)
    assert results["apflgate"]["final_arrays"] == ["weight", "bias"]       # Result.arrays: the global w


def test_a_stock_clientapp_under_a_strategy_that_needs_the_client_term_fails_the_run(federation, tmp_path):
    app = app_copy(tmp_path / "app")
    with pytest.raises(FederationError, match="ended with status 'finished:failed'"):
        submit(federation, tmp_path, app, {"strategies": "fedprox", "prox-mu": 0.1, "fraction-evaluate": 0.0})
    assert not (tmp_path / "out" / "results.json").exists()


def test_the_same_app_runs_on_flowers_simulation_engine(tmp_path):
    if sys.platform != "linux":
        pytest.skip("Ray simulation is tested on Linux only")
    app = app_copy(tmp_path / "app")
    with LocalFederation(tmp_path / "fed", nodes=NODES, simulation=True, start_timeout=120.0) as fed:
        results = submit(fed, tmp_path, app, {"strategies": "fesem", "fraction-evaluate": 1.0},
                         federation_config=f"num-supernodes={NODES} client-resources-num-cpus=1")
    assert sorted(results["fesem"]["server_metrics"][str(ROUNDS)]["cluster_sizes"]) == [1, 1, 1]
    assert set(results["fesem"]["client_evaluations"][str(ROUNDS)]) == {"0", "1", "2"}
