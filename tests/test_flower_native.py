"""graphfl.flower: Flower-native strategy classes, their hooks on the Flower-free path.

The clients here are the example app's own functions (examples/flower_app), called in-process;
the reference is graphfl's own round loop (``run_federated``) over the same functions. The same
app on real Flower processes is in tests/test_flower_native_e2e.py.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

import graphfl.flower as gf
from graphfl.common import registry, wire
from graphfl.common.config import ConfigError, RunConfig
from graphfl.common.types import Payload
from graphfl.flower import keys
from graphfl.flower.adapter import ClientReply, numpy_to_record, record_to_numpy
from graphfl.server.exchange import Reply, Request
from graphfl.server.recorder import RunRecorder
from graphfl.server.rounds import ServerInputs, run_federated

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flower_app"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

from graphfl_example import task  # noqa: E402

STEPS, LR = 10, 0.05


def initial_arrays() -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in task.make_model().state_dict().items()}


def client_train(pid: int, arrays: Mapping[str, np.ndarray], extra: Any = None) -> tuple[dict[str, np.ndarray], int]:
    """What the example's ClientApp does with a train message (same functions)."""
    import torch

    model = task.make_model()
    model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in arrays.items()})
    x, y, _, _ = task.load_data(pid)
    task.train(model, x, y, STEPS, LR, extra)
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}, len(x)


def client_eval(pid: int, arrays: Mapping[str, np.ndarray]) -> float:
    import torch

    model = task.make_model()
    model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in arrays.items()})
    _, _, x, y = task.load_data(pid)
    return task.test(model, x, y)


class TaskExchange:
    """graphfl's ClientExchange over the example's client functions (the reference engine)."""

    def __init__(self, n: int, data_of: Mapping[int, int] | None = None) -> None:
        self.n = n
        self.model_keys = tuple(initial_arrays())
        self.data_of = dict(data_of or {p: p for p in range(n)})
        """Client (partition id of the core) -> the example's data partition it trains on."""

    def join(self, initial: Payload, num_clients: int) -> dict[int, Reply]:
        return {pid: Reply(pid, None, {wire.PARTITION_ID: pid, wire.NUM_PARTITIONS: self.n,
                                       wire.NUM_EXAMPLES: task.TRAIN,
                                       wire.EVAL_PREFIX + "test_loss": client_eval(self.data_of[pid], initial.arrays)})
                for pid in range(num_clients)}

    def send(self, request: Request, payloads: Mapping[int, Payload]) -> dict[int, Reply]:
        out = {}
        for pid, payload in payloads.items():
            model = {k: v for k, v in payload.arrays.items() if k in self.model_keys}   # pFedGraph's c_i aside
            if request.kind == wire.TRAIN:
                arrays, n_ex = client_train(self.data_of[pid], model)
                out[pid] = Reply(pid, arrays, {wire.NUM_EXAMPLES: n_ex})
            else:
                out[pid] = Reply(pid, None, {wire.NUM_EXAMPLES: task.TEST,
                                             wire.EVAL_PREFIX + "test_loss": client_eval(self.data_of[pid], model)})
        return out


def reference(strategy: gf.GraphflStrategy, n: int, rounds: int, data_of: Mapping[int, int] | None = None,
              fraction: float = 1.0, exchange: TaskExchange | None = None) -> Any:
    """graphfl's own round loop (``run_federated``) with the same core and client functions; returns its core."""
    cfg = RunConfig(strategy=strategy.algorithm, nodes=n, rounds=rounds, seed=strategy.seed, params=strategy.params,
                    fraction_train=fraction)
    init = initial_arrays()
    inputs = ServerInputs(initial_arrays=init, param_keys=tuple(init))
    return run_federated(cfg, registry.get(strategy.algorithm), exchange or TaskExchange(n, data_of), inputs,
                         RunRecorder(cfg, strategy.algorithm, None))


def node(pid: int) -> int:
    return 10_000 + 7 * pid   # node ids are arbitrary uint64s; their order gives the partition ids


def run_pure(strategy: gf.GraphflStrategy, n: int, rounds: int, terms: bool = False) -> None:
    """Flower's start() loop on the Flower-free halves of the hooks, clients in-process."""
    arrays = initial_arrays()
    nodes = [node(p) for p in range(n)]
    for r in range(1, rounds + 1):
        contents = strategy.train_contents(r, nodes, arrays, ConfigRecord({"lr": LR}))
        replies = []
        for nid, content in contents:
            pid = (nid - 10_000) // 7
            sent = record_to_numpy(content[keys.ARRAYS])
            trained, n_ex = client_train(pid, sent)
            metrics = MetricRecord({"train_loss": 1.0, keys.NUM_EXAMPLES: n_ex})
            replies.append(ClientReply(nid, RecordDict({keys.ARRAYS: numpy_to_record(trained), keys.METRICS: metrics})))
        agg, _ = strategy.fold_train(r, replies)
        if agg is not None:
            arrays = record_to_numpy(agg)
        evals = []
        for nid, content in strategy.evaluate_contents(r, nodes, ConfigRecord(), arrays):
            pid = (nid - 10_000) // 7
            loss = client_eval(pid, record_to_numpy(content[keys.ARRAYS]))
            evals.append(ClientReply(nid, RecordDict({keys.METRICS: MetricRecord(
                {"test_loss": loss, keys.NUM_EXAMPLES: task.TEST})})))
        strategy.fold_evaluate(r, evals)


def assert_same_client_models(strategy: gf.GraphflStrategy, core: Any, n: int) -> None:
    for pid in range(n):
        got = strategy.client_arrays(pid)
        want = core.evaluation_payload(pid).arrays
        assert list(got) == list(initial_arrays())
        for k in got:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=f"client {pid} {k}")


STOCK = {
    "fesem": lambda: gf.FeSEM(k=3),
    "jgesr": lambda: gf.JGESR(),
    "cfl": lambda: gf.CFL(warmup_rounds=1, min_cluster_size=2, eps1=10.0, eps2=0.0),
    "fedamp": lambda: gf.FedAMP(prox_mu=0.0),
    "pfedgraph": lambda: gf.PFedGraph(lam=0.0),
    "fedavg": lambda: gf.FedAvg(),
}


@pytest.mark.parametrize("name", sorted(STOCK))
def test_stock_client_results_equal_graphfls_runner(name):
    n, rounds = 6, 3
    strategy = STOCK[name]()
    run_pure(strategy, n, rounds)
    core = reference(strategy, n, rounds)
    assert_same_client_models(strategy, core, n)
    assert set(strategy.client_evaluations[rounds]) == set(range(n))


def test_fesem_finds_the_planted_groups_and_reports_them():
    strategy = gf.FeSEM(k=3)
    run_pure(strategy, 6, 3)
    assign = strategy.assignment()
    groups = [pid % 3 for pid in range(6)]
    # same partition of the clients (labels may be permuted)
    assert len({(a, g) for a, g in zip(assign, groups)}) == 3 and len(set(assign)) == 3
    assert strategy.server_metrics[3]["assignment"] == assign


def test_each_client_gets_its_own_arrays_and_identical_payloads_share_one_record():
    strategy = gf.FeSEM(k=3)
    run_pure(strategy, 6, 2)
    contents = strategy.train_contents(3, [node(p) for p in range(6)], initial_arrays(), ConfigRecord({"lr": LR}))
    records = {nid: c[keys.ARRAYS] for nid, c in contents}
    assert len(records) == 6
    assert len({id(r) for r in records.values()}) == 3          # one record per center
    for _, c in contents:
        assert list(c[keys.ARRAYS].keys()) == ["weight", "bias"]  # only the model: a stock client loads it
        assert c[keys.CONFIG][keys.SERVER_ROUND] == 3 and c[keys.CONFIG]["lr"] == LR
        assert keys.REGULARISER not in c[keys.CONFIG]


def test_a_client_term_the_app_lacks_stops_the_run_naming_what_to_add():
    strategy = gf.FedProx(mu=0.1)
    contents = strategy.train_contents(1, [node(0), node(1)], initial_arrays(), ConfigRecord())
    assert contents[0][1][keys.CONFIG][keys.REGULARISER] == keys.PROXIMAL
    assert contents[0][1][keys.CONFIG][keys.MU] == pytest.approx(0.1)
    trained, n_ex = client_train(0, initial_arrays())
    reply = ClientReply(node(0), RecordDict({keys.ARRAYS: numpy_to_record(trained),
                                             keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: n_ex})}))
    with pytest.raises(gf.CooperationError, match=r"graphfl_mod.*regulariser\(msg\)\(model\).*mu=0"):
        strategy.fold_train(1, [reply])
    applied_zero = ClientReply(node(0), RecordDict({keys.ARRAYS: numpy_to_record(trained),
                                                    keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: n_ex,
                                                                                keys.APPLIED: 0})}))
    with pytest.raises(gf.CooperationError, match="did not add the term"):
        strategy.fold_train(1, [applied_zero])


def test_fesem_prox_lambda_asks_for_the_proximal_term_with_mu_2_lambda():
    strategy = gf.FeSEM(prox_lambda=0.05)
    contents = strategy.train_contents(1, [node(0), node(1)], initial_arrays(), ConfigRecord())
    assert contents[0][1][keys.CONFIG][keys.MU] == pytest.approx(0.1)


def test_pfedgraph_sends_its_cluster_model_beside_the_model_only_with_lam():
    for lam, expect_anchor in ((0.01, True), (0.0, False)):
        strategy = gf.PFedGraph(lam=lam)
        nodes = [node(p) for p in range(4)]
        strategy.train_contents(1, nodes, initial_arrays(), ConfigRecord())
        replies = []
        for p in range(4):
            trained, n_ex = client_train(p, initial_arrays())
            metrics = {keys.NUM_EXAMPLES: n_ex, keys.APPLIED: 1}
            replies.append(ClientReply(node(p), RecordDict({keys.ARRAYS: numpy_to_record(trained),
                                                            keys.METRICS: MetricRecord(metrics)})))
        strategy.fold_train(1, replies)
        contents = strategy.train_contents(2, nodes, initial_arrays(), ConfigRecord())
        for _, c in contents:
            assert list(c[keys.ARRAYS].keys()) == ["weight", "bias"]
            assert (keys.ANCHOR in c.array_records) == expect_anchor
            if expect_anchor:
                assert list(c[keys.ANCHOR].keys()) == ["weight", "bias"]
                assert c[keys.CONFIG][keys.REGULARISER] == keys.COSINE


def test_bad_replies_are_left_out_and_the_client_keeps_its_model(caplog):
    strategy = gf.JGESR()
    nodes = [node(p) for p in range(3)]
    strategy.train_contents(1, nodes, initial_arrays(), ConfigRecord())
    good, n_ex = client_train(0, initial_arrays())
    nan = {k: np.full_like(v, np.nan) for k, v in good.items()}
    replies = [
        ClientReply(node(0), RecordDict({keys.ARRAYS: numpy_to_record(good),
                                         keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: n_ex})})),
        ClientReply(node(1), RecordDict({keys.ARRAYS: numpy_to_record(nan),
                                         keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: n_ex})})),
        ClientReply(node(2), RecordDict({keys.ARRAYS: numpy_to_record(good), keys.METRICS: MetricRecord({})})),
    ]
    _, metrics = strategy.fold_train(1, replies)
    assert metrics["clients_aggregated"] == 1
    text = caplog.text
    assert f"node {node(1)} (client 1) left out: array 'weight' contains NaN" in text
    assert f"node {node(2)} (client 2) left out: no non-negative metric 'num-examples'" in text


def test_a_reported_partition_id_readdresses_the_node():
    strategy = gf.FeSEM(k=2)
    nodes = [node(0), node(1)]
    strategy.train_contents(1, nodes, initial_arrays(), ConfigRecord())
    assert strategy.pid_of_node == {node(0): 0, node(1): 1}
    replies = []
    for nid, pid in ((node(0), 1), (node(1), 0)):          # the nodes serve the other partitions
        trained, n_ex = client_train(pid, initial_arrays())
        replies.append(ClientReply(nid, RecordDict({keys.ARRAYS: numpy_to_record(trained), keys.METRICS: MetricRecord(
            {keys.NUM_EXAMPLES: n_ex, keys.PARTITION_ID: pid})})))
    strategy.fold_train(1, replies)
    assert strategy.pid_of_node == {node(0): 1, node(1): 0}


def test_partition_of_mapping_is_used_and_checked():
    strategy = gf.FeSEM(k=2, partition_of={node(0): 1, node(1): 0})
    contents = strategy.train_contents(1, [node(0), node(1)], initial_arrays(), ConfigRecord())
    assert {nid for nid, _ in contents} == {node(0), node(1)} and strategy.pid_of_node[node(0)] == 1
    with pytest.raises(ValueError, match="outside 0..1"):
        gf.FeSEM(partition_of={node(0): 5}, num_clients=2).train_contents(1, [node(0)], initial_arrays(),
                                                                          ConfigRecord())


def test_fraction_train_samples_like_graphfls_runner():
    n, rounds = 6, 3
    strategy = gf.FedAMP(prox_mu=0.0, fraction_train=0.5)
    run_pure(strategy, n, rounds)
    cfg_core = reference(strategy, n, rounds, fraction=0.5)
    assert_same_client_models(strategy, cfg_core, n)


def test_hyperparameters_are_checked_like_a_run_config():
    with pytest.raises(ConfigError, match="fesem.k = 0 must be >= 1"):
        gf.FeSEM(k=0)
    with pytest.raises(ConfigError, match="jgesr.solver = 'newton' is not valid"):
        gf.JGESR(solver="newton")
    with pytest.raises(ValueError, match="fraction_train"):
        gf.CFL(fraction_train=1.5)


def test_flowers_dp_wrapper_is_refused_by_name_around_a_per_client_strategy():
    inner = gf.FeSEM(k=2)
    dp = DifferentialPrivacyServerSideFixedClipping(inner, noise_multiplier=1.0, clipping_norm=1.0,
                                                    num_sampled_clients=2)
    with pytest.raises(gf.WrapperRefused, match="DifferentialPrivacyServerSideFixedClipping cannot wrap FeSEM"):
        dp.configure_train(1, ArrayRecord(), ConfigRecord(), None)  # type: ignore[arg-type]


def test_global_model_strategies_send_what_flower_passes_and_return_the_aggregate():
    strategy = gf.FedAvg()
    nodes = [node(p) for p in range(2)]
    passed = {k: v + 1.0 for k, v in initial_arrays().items()}      # e.g. a DP wrapper's noised model
    contents = strategy.train_contents(1, nodes, passed, ConfigRecord())
    for _, c in contents:
        np.testing.assert_allclose(c[keys.ARRAYS]["weight"].numpy(), passed["weight"])
    replies = []
    ups = []
    for p in range(2):
        trained, n_ex = client_train(p, passed)
        ups.append(trained)
        replies.append(ClientReply(node(p), RecordDict({keys.ARRAYS: numpy_to_record(trained),
                                                        keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: n_ex})})))
    agg, _ = strategy.fold_train(1, replies)
    assert agg is not None
    np.testing.assert_allclose(agg["weight"].numpy(), (ups[0]["weight"] + ups[1]["weight"]) / 2, rtol=1e-6)


def test_local_sends_the_initial_model_once_then_asks_the_mod_for_the_clients_own_model():
    strategy = gf.Local()
    nodes = [node(p) for p in range(2)]
    first = strategy.train_contents(1, nodes, initial_arrays(), ConfigRecord())
    assert all(list(c[keys.ARRAYS].keys()) == ["weight", "bias"] for _, c in first)
    assert all(c[keys.CONFIG][keys.REGULARISER] == keys.OWN_MODEL for _, c in first)
    trained, n_ex = client_train(0, initial_arrays())
    stock = ClientReply(node(0), RecordDict({keys.ARRAYS: numpy_to_record(trained),
                                             keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: n_ex})}))
    with pytest.raises(gf.CooperationError, match=r"keep its own model.*graphfl_mod"):
        strategy.fold_train(1, [stock])
    replies = []
    for p in range(2):
        trained, n_ex = client_train(p, initial_arrays())
        replies.append(ClientReply(node(p), RecordDict({keys.ARRAYS: numpy_to_record(trained), keys.METRICS:
                                                        MetricRecord({keys.NUM_EXAMPLES: n_ex, keys.APPLIED: 1})})))
    strategy.fold_train(1, replies)
    second = strategy.train_contents(2, nodes, initial_arrays(), ConfigRecord())
    assert all(len(c[keys.ARRAYS].keys()) == 0 for _, c in second)          # nothing leaves the server
    evals = strategy.evaluate_contents(2, nodes, ConfigRecord(), initial_arrays())
    assert all(len(c[keys.ARRAYS].keys()) == 0 and c[keys.CONFIG][keys.REGULARISER] == keys.OWN_MODEL
               for _, c in evals)


def test_fedgate_sends_the_mean_update_and_its_delta_settings_and_refuses_an_unstable_tau():
    strategy = gf.FedGATE(client_lr=LR, local_steps=STEPS)
    nodes = [node(p) for p in range(2)]
    first = strategy.train_contents(1, nodes, initial_arrays(), ConfigRecord())
    assert all(keys.ANCHOR not in c.array_records for _, c in first)          # no ū before round 1's uploads
    replies, ups = [], []
    for p in range(2):
        trained, n_ex = client_train(p, initial_arrays())
        ups.append(trained)
        replies.append(ClientReply(node(p), RecordDict({keys.ARRAYS: numpy_to_record(trained), keys.METRICS:
                                                        MetricRecord({keys.NUM_EXAMPLES: n_ex, keys.APPLIED: 1})})))
    agg, _ = strategy.fold_train(1, replies)
    mean = (ups[0]["weight"] + ups[1]["weight"]) / 2
    assert agg is not None
    np.testing.assert_allclose(agg["weight"].numpy(), mean, rtol=1e-6)            # γ = 1: the plain average
    for _, c in strategy.train_contents(2, nodes, initial_arrays(), ConfigRecord()):
        cfg = c[keys.CONFIG]
        assert cfg[keys.REGULARISER] == keys.GATE and cfg[keys.ETA] == pytest.approx(LR)
        assert cfg[keys.TAU] == pytest.approx(STEPS) and cfg["gate.round"] == 1 and cfg["gate.accepted"] is True
        u_bar = initial_arrays()["weight"] - mean                                   # ū = w − mean_i w_i
        np.testing.assert_allclose(c[keys.ANCHOR]["weight"].numpy(), u_bar, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(c[keys.ARRAYS]["weight"].numpy(), mean, rtol=1e-6)
    with pytest.raises(ConfigError, match=r"fedgate.tau = 4 .*must exceed R/2 = 5"):
        gf.FedGATE(tau=4, local_steps=10).train_contents(1, nodes, initial_arrays(), ConfigRecord())


def test_a_node_beyond_num_clients_is_not_used_and_reported_once(caplog):
    strategy = gf.FeSEM(k=2, num_clients=2)
    nodes = [node(p) for p in range(3)]
    for r in (1, 2):
        contents = strategy.train_contents(r, nodes, initial_arrays(), ConfigRecord())
        assert {nid for nid, _ in contents} == {node(0), node(1)}
        strategy.fold_train(r, [])
    assert caplog.text.count(f"node {node(2)} has no free partition id") == 1
