"""The round loop with the in-process driver: learning, aggregation, failure handling."""


import numpy as np
import pytest

from graphfl.common import registry
from graphfl.common.arrays import flatten_params, unflatten_params, weighted_average
from graphfl.common.config import parse_run_config
from graphfl.server.inprocess import run_federated_inprocess
from graphfl.server.rounds import validate_update


def small(strategy="fedavg", **kw):
    values = {"strategy": strategy, "task": "digits", "nodes": 3, "rounds": 3, "engine": "inprocess",
              "train.local-steps": 5, "train.lr": 0.1}
    values.update(kw)
    return parse_run_config(values)


def test_weighted_average_by_hand():
    a = {"w": np.array([1.0, 2.0], np.float32)}
    b = {"w": np.array([3.0, 6.0], np.float32)}
    out = weighted_average([a, b], [1, 3])
    np.testing.assert_allclose(out["w"], [2.5, 5.0])
    assert out["w"].dtype == np.float32
    with pytest.raises(ValueError, match="positive sum"):
        weighted_average([a], [0])


def test_flatten_roundtrip():
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "buf": np.ones(2), "b": np.array([7.0], np.float32)}
    theta = flatten_params(arrays, ("a", "b"))
    assert theta.tolist() == [0, 1, 2, 3, 4, 5, 7]
    back = unflatten_params(theta * 2, arrays, ("a", "b"))
    assert back["b"][0] == 14 and back["buf"] is arrays["buf"]


def test_validate_update_rejects_nan_and_shapes():
    tmpl = {"w": np.zeros((2, 2), np.float32)}
    assert validate_update({"w": np.ones((2, 2), np.float32)}, tmpl) is None
    assert "NaN" in validate_update({"w": np.full((2, 2), np.nan, np.float32)}, tmpl)
    assert "shape" in validate_update({"w": np.ones((3,), np.float32)}, tmpl)
    assert "missing" in validate_update({"v": np.ones((2, 2), np.float32)}, tmpl)
    assert "no arrays" in validate_update(None, tmpl)


def test_fedavg_learns_and_curve_is_complete(tmp_path):
    doc, core = run_federated_inprocess(small(rounds=4, device="cpu", **{"train.local-steps": 20}), out_dir=tmp_path)
    curve = doc["methods"]["fedavg"]["curve"]
    assert [row["round"] for row in curve] == [0, 1, 2, 3, 4]
    assert all(row.get("test_acc") is not None for row in curve)
    assert curve[-1]["test_acc"] > curve[0]["test_acc"] + 0.3
    model_bytes = sum(a.nbytes for a in core.global_arrays.values())
    assert curve[1]["bytes_down"] == curve[1]["bytes_up"] == 3 * model_bytes
    assert curve[1]["phases"] == [{**curve[1]["phases"][0], "phase": "fit", "kind": "train", "clients": 3,
                                   "clients_ok": 3, "bytes_down": 3 * model_bytes, "bytes_up": 3 * model_bytes}]
    assert (tmp_path / "run.json").is_file() and (tmp_path / "run.png").is_file()
    assert doc["status"] == "completed"
    # the device really used is recorded (not whether a GPU is visible), per run and per round
    assert doc["env"]["device"] == "cpu" and "gpu_visible" in doc["env"]
    assert all(row["clients_on_gpu"] == 0 for row in curve[1:])


def test_fedavg_global_model_is_the_weighted_mean_of_client_models():
    from graphfl.client.handler import build_runtime, handle
    from graphfl.common.types import Payload
    from graphfl.server.inprocess import server_inputs

    cfg = small(rounds=1)
    _, core = run_federated_inprocess(cfg)
    initial = server_inputs(cfg).initial_arrays
    ups, ns = [], []
    for pid in range(3):  # replay round 1 by hand
        arrays, metrics = handle(build_runtime(cfg, pid, 3), "train", 1, Payload(initial), {})
        ups.append(arrays)
        ns.append(metrics["num-examples"])
    expected = weighted_average(ups, ns)
    for k in expected:
        np.testing.assert_allclose(core.global_arrays[k], expected[k], rtol=1e-6, atol=1e-7)


def test_local_keeps_personal_models_in_client_state():
    doc, _ = run_federated_inprocess(small("local", rounds=3))
    curve = doc["methods"]["local"]["curve"]
    assert curve[1]["bytes_down"] > 0 and curve[2]["bytes_down"] == 0   # model only sent in round 1
    assert curve[3]["test_acc"] > curve[0]["test_acc"]


def test_same_seed_same_results_different_seed_different():
    a, _ = run_federated_inprocess(small(rounds=2))
    b, _ = run_federated_inprocess(small(rounds=2))
    c, _ = run_federated_inprocess(small(rounds=2, seed=1))
    la = [r["test_loss"] for r in a["methods"]["fedavg"]["curve"]]
    assert la == [r["test_loss"] for r in b["methods"]["fedavg"]["curve"]]
    assert la != [r["test_loss"] for r in c["methods"]["fedavg"]["curve"]]


def test_probe_gets_per_node_payloads_and_state():
    import graphfl.tests.probe_strategy  # noqa: F401  registers "probe"

    doc, _ = run_federated_inprocess(small("probe", rounds=3))
    curve = doc["methods"]["probe"]["curve"]
    for r in (1, 2, 3):
        server = curve[r]["server"]
        assert server["tags_ok"] and server["sums_ok"]
        assert server["counts"] == {"0": r, "1": r, "2": r}


def test_fraction_train_trains_a_sample_and_evaluates_everyone_separately():
    """fraction-train < 1: only the sampled clients train (no piggy-backed evaluation); after
    every round all clients evaluate the new model in a separate exchange."""
    import random

    from graphfl.server.inprocess import InProcessExchange, server_inputs
    from graphfl.server.rounds import RunRecorder, run_federated, sample_clients

    class Recording(InProcessExchange):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.log = []

        def send(self, request, payloads):
            replies = super().send(request, payloads)
            self.log.append((request, sorted(payloads), replies))
            return replies

    cfg = small(nodes=4, rounds=3, **{"fraction-train": 0.5})
    exchange = Recording(cfg)
    recorder = RunRecorder(cfg, "fedavg", None)
    core = run_federated(cfg, registry.get("fedavg"), exchange, server_inputs(cfg), recorder)
    rng = random.Random(cfg.seed)
    sampled = [sample_clients([0, 1, 2, 3], 0.5, rng) for _ in range(3)]
    assert len({tuple(s) for s in sampled}) > 1                      # the sample changes between rounds
    assert [(req.kind, req.server_round, req.phase, req.eval_first, pids) for req, pids, _ in exchange.log] == [
        x for r in (1, 2, 3) for x in (("train", r, "fit", False, sampled[r - 1]),
                                        ("evaluate", r, "evaluate", False, [0, 1, 2, 3]))]
    curve = recorder.document()["methods"]["fedavg"]["curve"]
    for r in (1, 2, 3):
        assert curve[r]["phases"][0]["clients"] == 2 and curve[r]["clients_ok"] == 2
        assert curve[r]["clients_evaluated"] == 4 and sorted(curve[r]["test_loss_per_client"]) == ["0", "1", "2", "3"]
        assert "eval_seconds" not in curve[r]
    # the last global model is the sample-weighted mean of the last round's two uploads
    _, _, replies = exchange.log[-2]
    ups = [replies[p] for p in sampled[2]]
    expect = weighted_average([u.arrays for u in ups], [u.num_examples for u in ups])
    for k in expect:
        np.testing.assert_array_equal(core.global_arrays[k], expect[k])
    # and the evaluation after round 3 measured exactly that model
    evaluated = {pid: rep.eval_metrics()["test_loss"] for pid, rep in exchange.log[-1][2].items()}
    assert curve[3]["test_loss"] == pytest.approx(np.mean(list(evaluated.values())), rel=1e-12)


@pytest.mark.parametrize("momentum, wd", [(0.0, 0.0), (0.9, 0.0), (0.5, 0.01)])
def test_sgd_update_equals_torch_sgd(momentum, wd):
    import torch

    from graphfl.client.training import sgd_update

    torch.manual_seed(0)
    a = torch.nn.Linear(4, 3)
    b = torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    opt = torch.optim.SGD(b.parameters(), lr=0.1, momentum=momentum, weight_decay=wd)
    params, bufs = list(a.parameters()), [None, None]
    for step in range(4):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        for m in (a, b):
            m.zero_grad()
            (m(x) ** 2).mean().backward()
        sgd_update(params, bufs, 0.1, momentum, wd)
        opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb)


def test_core_strategy_refuses_flowers_stock_loop_clearly():
    from graphfl.server.flower_adapter import CoreStrategy

    strategy = CoreStrategy(small(), registry.get("fedavg"), None, ())
    with pytest.raises(NotImplementedError, match="call CoreStrategy.start"):
        strategy.configure_train(1, None, None, None)
    with pytest.raises(NotImplementedError, match="own round loop"):
        strategy.aggregate_evaluate(1, [])


def test_done_is_announced_only_once_the_result_files_are_final(tmp_path):
    """A follower stops at the ``done`` event (``Submitter.wait``): run.json and the plot must
    already say ``completed`` then (CI once read a run.json still ``running`` after ``done``)."""
    import json

    seen: list[tuple[str, str, bool]] = []

    def on_event(ev):
        doc = json.loads((tmp_path / "run.json").read_text()) if (tmp_path / "run.json").is_file() else {}
        seen.append((ev["event"], doc.get("status", "absent"), (tmp_path / "run.png").is_file()))

    run_federated_inprocess(small(rounds=2), out_dir=tmp_path, progress=on_event)
    assert [kind for kind, _, _ in seen] == ["round", "round", "round", "done"]
    assert seen[-1][1:] == ("completed", True)
    assert all(status == "running" for kind, status, _ in seen if kind == "round")
