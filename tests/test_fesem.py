"""FeSEM: hand-computed E/M steps, core protocol, robustness (ALGORITHMS.md §4)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from graphfl.common.arrays import select_keys
from graphfl.common.config import ConfigError, RunConfig
from graphfl.common.core import ServerContext
from graphfl.common.types import ClientUpdate
from graphfl.strategies import fesem as fs

PTS = np.array([[0.0, 0.0], [1.0, 0.0], [10.0, 0.0], [11.0, 0.0]])


def test_distances_and_e_step_by_hand():
    centers = np.array([[0.5, 0.0], [10.0, 0.0]])
    dist = fs.squared_distances(PTS, centers)
    np.testing.assert_allclose(dist, [[0.25, 100.0], [0.25, 81.0], [90.25, 0.0], [110.25, 1.0]])
    np.testing.assert_array_equal(fs.e_step(dist), [0, 0, 1, 1])
    # exact tie (4.75² to both centers) goes to the smallest k
    tie = fs.squared_distances(np.array([[5.25, 0.0]]), centers)
    assert tie[0, 0] == tie[0, 1]
    assert fs.e_step(tie)[0] == 0
    assert fs.e_step(np.array([[3.0, 1.0, 1.0]]))[0] == 1


def test_m_step_by_hand_plain_weighted_and_empty():
    prev = np.array([[0.5, 0.0], [10.0, 0.0], [100.0, 100.0]])
    assign = np.array([0, 0, 1, 1])
    centers, sizes = fs.m_step(PTS, assign, prev)
    np.testing.assert_allclose(centers, [[0.5, 0.0], [10.5, 0.0], [100.0, 100.0]])
    np.testing.assert_array_equal(sizes, [2, 2, 0])  # empty cluster keeps its old center
    centers_w, _ = fs.m_step(PTS, assign, prev, weights=np.array([1.0, 3.0, 1.0, 1.0]))
    np.testing.assert_allclose(centers_w[0], [0.75, 0.0])
    # unassigned rows (-1) are ignored
    centers_u, sizes_u = fs.m_step(PTS, np.array([0, -1, 1, 1]), prev)
    np.testing.assert_allclose(centers_u[0], [0.0, 0.0])
    assert sizes_u.tolist() == [1, 2, 0]


def test_reseed_empty_moves_farthest_member():
    centers = np.array([[0.0, 0.0], [10.0, 0.0], [50.0, 50.0]])
    pts = np.array([[0.0, 0.0], [1.0, 0.0], [4.0, 0.0], [10.0, 0.0]])
    assign = np.array([0, 0, 0, 1])
    dist = fs.squared_distances(pts, centers)
    new_assign, new_centers, moved = fs.reseed_empty(pts, assign, dist, centers)
    assert moved == [2]
    assert new_assign.tolist() == [0, 0, 2, 1]
    np.testing.assert_allclose(new_centers[2], [4.0, 0.0])


def test_kmeanspp_picks_distinct_groups():
    rng = np.random.default_rng(0)
    groups = np.concatenate([rng.normal(m, 0.01, size=(5, 3)) for m in (0.0, 5.0, -5.0)])
    seeds = fs.kmeanspp_seeds(groups, 3, np.random.default_rng(1))
    assert sorted(s // 5 for s in seeds) == [0, 1, 2]
    # fewer distinct points than K: still returns K indices
    assert len(fs.kmeanspp_seeds(np.zeros((2, 3)), 3, np.random.default_rng(0))) == 3


def test_select_keys():
    keys = ("net.0.weight", "net.2.weight", "net.4.weight")
    assert select_keys(keys, "") == keys
    assert select_keys(keys, "net.4") == ("net.4.weight",)
    assert select_keys(keys, "net.4.weight, net.0") == ("net.0.weight", "net.4.weight")
    with pytest.raises(ConfigError, match="net.0.weight"):
        select_keys(keys, "fc9")


# ---------------------------------------------------------------------------------------
# core
# ---------------------------------------------------------------------------------------


def _ctx(n=4, labels=None, template=None, **params):
    template = template or {"a.weight": np.zeros(2, dtype=np.float32)}
    return ServerContext(
        config=RunConfig(), params=fs.FeSEMParams(**params), num_clients=n,
        initial_arrays=template, param_keys=tuple(template), num_examples={i: 10 for i in range(n)},
        cluster_labels=labels, seed=0,
    )


def _ups(points, key="a.weight"):
    return {i: ClientUpdate(i, {key: np.asarray(p, dtype=np.float32)}, 10) for i, p in enumerate(points)}


def test_core_warmup_then_centers_and_ari():
    core = fs.FeSEMCore(_ctx(labels=np.array([1, 1, 0, 0]), k=2, init_iters=1))
    first = core.configure_train(1, 0)
    assert first.config[fs.WARMUP_KEY] is True
    assert first.config[fs.STEPS_KEY] == RunConfig().train.local_steps
    m = core.aggregate_train(1, _ups(PTS))
    assert sorted(m["cluster_sizes"]) == [2, 2]
    assert m["ari"] == pytest.approx(1.0)
    a = m["assignment"]
    assert a[0] == a[1] and a[2] == a[3] and a[0] != a[2]
    p0, p1, p2 = (core.configure_train(2, i) for i in range(3))
    assert fs.WARMUP_KEY not in p0.config
    assert p0 is p1 and p0 is not p2  # one payload object per center
    np.testing.assert_allclose(p0.arrays["a.weight"], [0.5, 0.0])
    np.testing.assert_allclose(p2.arrays["a.weight"], [10.5, 0.0])
    assert core.evaluation_payload(3) is p2
    # client 1 moves next to the other group: the E-step follows it
    moved = PTS.copy()
    moved[1] = [10.2, 0.0]
    m2 = core.aggregate_train(2, _ups(moved))
    assert m2["assignment"][1] == m2["assignment"][2]
    assert m2["num_changed"] == 1 and m2["reclustered"] == 1
    # planted {0,1},{2,3} vs found {0},{1,2,3}: 1 agreeing pair, expected 2·3/6 = 1, max 2.5 -> ARI 0
    assert m2["ari"] == pytest.approx(0.0, abs=1e-12)
    assert ari_by_pairs([1, 1, 0, 0], m2["assignment"]) == pytest.approx(0.0, abs=1e-12)


def ari_by_pairs(truth, found) -> float:
    """Adjusted Rand index from its pair-counting definition (independent of sklearn):
    ``(I − E[I]) / (max − E[I])`` with ``I`` = pairs together in both, ``E[I] = a·b / C(n,2)``,
    ``max = (a + b) / 2``, ``a``/``b`` = pairs together in ``truth``/``found``."""
    from itertools import combinations

    pairs = list(combinations(range(len(truth)), 2))
    same_t = [truth[i] == truth[j] for i, j in pairs]
    same_f = [found[i] == found[j] for i, j in pairs]
    index = sum(t and f for t, f in zip(same_t, same_f))
    expected = sum(same_t) * sum(same_f) / len(pairs)
    top = (sum(same_t) + sum(same_f)) / 2
    return 1.0 if top == expected else (index - expected) / (top - expected)


def test_ari_by_pairs_agrees_with_hand_values():
    assert ari_by_pairs([0, 0, 1, 1], [5, 5, 7, 7]) == 1.0                    # same partition, other names
    # truth {0,1,2},{3,4,5} vs found {0,1},{2,3},{4,5}: I = 2, a = 6, b = 3, C(6,2) = 15
    # E = 18/15 = 1.2, max = 4.5 -> (2 - 1.2) / (4.5 - 1.2) = 0.8 / 3.3
    assert ari_by_pairs([0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 2, 2]) == pytest.approx(0.8 / 3.3, abs=1e-12)
    assert fs.adjusted_rand(np.array([0, 0, 0, 1, 1, 1]), np.array([0, 0, 1, 1, 2, 2])) == pytest.approx(0.8 / 3.3)


def test_core_nan_upload_excluded_with_warning(caplog):
    core = fs.FeSEMCore(_ctx(k=2, init_iters=1))
    core.aggregate_train(1, _ups(PTS))
    before = core.centers.copy()
    bad = _ups(PTS)
    bad[0] = ClientUpdate(0, {"a.weight": np.array([np.nan, 0.0], dtype=np.float32)}, 10)
    bad[1] = ClientUpdate(1, {"a.weight": np.zeros(3, dtype=np.float32)}, 10)  # wrong shape
    with caplog.at_level(logging.WARNING, logger="graphfl.strategies.fesem"):
        m = core.aggregate_train(2, bad)
    assert m["clients_excluded"] == 2 and m["clients_aggregated"] == 2
    assert "client 0" in caplog.text and "NaN" in caplog.text
    assert np.all(np.isfinite(core.centers))
    np.testing.assert_allclose(core.centers, before)  # stale models of 0, 1 reused


def test_core_empty_round_and_late_client():
    core = fs.FeSEMCore(_ctx(k=2, init_iters=1))
    m = core.aggregate_train(1, {})
    assert m["clients_aggregated"] == 0 and core.centers is None
    ups = _ups(PTS)
    del ups[3]  # client 3 misses the warm-up
    core.aggregate_train(2, ups)
    assert core.assign[3] == -1
    assert core.configure_train(3, 3).config.get(fs.WARMUP_KEY) is True
    assert core.configure_train(3, 0).config.get(fs.WARMUP_KEY) is None
    m = core.aggregate_train(3, {3: _ups(PTS)[3]})
    assert m["assignment"][3] == m["assignment"][2]
    assert core.aggregate_train(4, {})["cluster_sizes"] == m["cluster_sizes"]


def test_recluster_every_freezes_assignment_between_e_steps():
    core = fs.FeSEMCore(_ctx(k=2, init_iters=1, recluster_every=2))
    core.aggregate_train(1, _ups(PTS))
    moved = PTS.copy()
    moved[1] = [10.2, 0.0]
    m2 = core.aggregate_train(2, _ups(moved))  # M-step only
    assert m2["reclustered"] == 0 and m2["assignment"][1] == m2["assignment"][0]
    m3 = core.aggregate_train(3, _ups(moved))  # E-step again
    assert m3["reclustered"] == 1 and m3["assignment"][1] == m3["assignment"][2]


def test_dist_layers_subset_decides_clusters():
    tmpl = {"l1.weight": np.zeros(1, dtype=np.float32), "l2.weight": np.zeros(1, dtype=np.float32)}
    # l1 separates {0,1} vs {2,3}; l2 (large) separates {0,2} vs {1,3}
    l1 = [0.0, 0.1, 1.0, 1.1]
    l2 = [0.0, 100.0, 0.5, 100.5]

    def ups():
        return {i: ClientUpdate(i, {"l1.weight": np.float32([l1[i]]), "l2.weight": np.float32([l2[i]])}, 10)
                for i in range(4)}

    for spec, same in (("l1", (0, 1)), ("", (0, 2))):
        core = fs.FeSEMCore(_ctx(template=tmpl, k=2, dist_layers=spec))
        a = core.aggregate_train(1, ups())["assignment"]
        assert a[same[0]] == a[same[1]], spec
        assert len(set(a)) == 2
    with pytest.raises(ConfigError, match="l1.weight"):
        fs.FeSEMCore(_ctx(template=tmpl, dist_layers="conv"))


def test_k_larger_than_n_and_reseed_policy(caplog):
    with caplog.at_level(logging.WARNING, logger="graphfl.strategies.fesem"):
        core = fs.FeSEMCore(_ctx(n=2, k=3))
    assert "K=3" in caplog.text
    m = core.aggregate_train(1, _ups(PTS[:2]))
    assert sum(m["cluster_sizes"]) == 2 and 0 in m["cluster_sizes"]
    # identical models: every tie goes to cluster 0; "keep" leaves cluster 1 empty,
    # "reseed" moves one client into it
    core = fs.FeSEMCore(_ctx(k=2, empty_cluster="keep", init_iters=1))
    assert core.aggregate_train(1, _ups(np.zeros((4, 2))))["cluster_sizes"] == [4, 0]
    core = fs.FeSEMCore(_ctx(k=2, empty_cluster="reseed", init_iters=1))
    assert sorted(core.aggregate_train(1, _ups(np.zeros((4, 2))))["cluster_sizes"]) == [1, 3]


def test_weighted_mstep_uses_num_examples():
    core = fs.FeSEMCore(_ctx(k=1, weighted_mstep=True))
    ups = _ups(PTS)
    ups[0] = ClientUpdate(0, ups[0].arrays, 70)
    core.aggregate_train(1, ups)
    expected = (70 * PTS[0] + 10 * PTS[1] + 10 * PTS[2] + 10 * PTS[3]) / 100
    np.testing.assert_allclose(core.centers[0], expected, atol=1e-6)


# ---------------------------------------------------------------------------------------
# in-process runs (real trainers, real round loop)
# ---------------------------------------------------------------------------------------


def _run(strategy: str, task: str, rounds: int, nodes: int, seed: int = 0, fail=None, **extra):
    import graphfl.strategies.fesem  # noqa: F401  (registers "fesem")
    from graphfl.common.config import parse_run_config
    from graphfl.server.inprocess import run_federated_inprocess

    cfg = parse_run_config({"strategy": strategy, "task": task, "nodes": nodes, "rounds": rounds,
                            "engine": "inprocess", "seed": seed, **extra})
    doc, core = run_federated_inprocess(cfg, fail=fail)
    return doc["methods"][strategy]["curve"], core


def test_inprocess_recovers_planted_clusters_with_linear_clients(monkeypatch):
    """Multicenter data, linear client models: parameters ≈ ground-truth W_i, so FeSEM's
    parameter-space clustering can recover the 3 planted clusters (ARI ≥ 0.9). Seed 0: k-means
    on the true W_i gives ARI 1.0 there (seeds 1, 2: 0.88), so the threshold is attainable."""
    from torch import nn

    from graphfl.tasks import registry as task_registry
    from graphfl.tasks.base import TaskSpec
    from graphfl.tasks.models import seeded
    from graphfl.tasks.synthetic import SyntheticMulticenter

    class LinearMulticenter(SyntheticMulticenter):
        spec = TaskSpec("test-linear-multicenter", "regression", default_nodes=50)

        def build_model(self):
            return seeded(self.seed, nn.Linear, 8, 8, bias=False)

    monkeypatch.setitem(task_registry._TASKS, LinearMulticenter.spec.name, LinearMulticenter)
    curve, core = _run("fesem", "test-linear-multicenter", 3, 50, **{
        "train.lr": 0.5, "train.local-steps": 20, "fesem.warmup-steps": 100})
    aris = [row["server"]["ari"] for row in curve if "server" in row]
    assert len(aris) == 3
    print("ARI per round", aris)
    assert aris[-1] >= 0.9, aris
    assert sorted(curve[-1]["server"]["cluster_sizes"]) == sorted(np.bincount(core.labels).tolist())
    assert curve[-1]["test_loss"] < curve[0]["test_loss"]


def test_inprocess_seed_mlp_task_reports_assignments_and_survives_nan():
    curve, core = _run("fesem", "synthetic-multicenter", 3, 12, fail={(2, 4): "nan", (3, 5): "error"},
                       **{"train.local-steps": 5})
    assert "4" in curve[2]["failed"] and "5" in curve[3]["failed"]
    srv = curve[3]["server"]
    assert srv["clients_aggregated"] == 11
    assert np.all(np.isfinite(core.centers))
    assert len(srv["assignment"]) == 12 and sum(srv["cluster_sizes"]) == 12
    planted = core.labels.tolist()
    assert planted == [int(v) for v in task_labels("synthetic-multicenter", 12)]
    for row in curve[1:]:  # the logged ARI is that of the logged assignment vs the planted clusters
        assert row["server"]["ari"] == pytest.approx(ari_by_pairs(planted, row["server"]["assignment"]), abs=1e-12)
    assert all(np.isfinite(row["test_loss"]) for row in curve)


def task_labels(name: str, n: int) -> np.ndarray:
    from graphfl.tasks import registry as task_registry

    return task_registry.create(name, seed=0).cluster_labels(n)


def test_client_step_with_prox_lambda_is_sgd_on_f_plus_lambda_times_squared_distance():
    """Eq. 10.10: local loss F(θ) + λ‖θ − θ̄‖², gradient ∇F + 2λ(θ − θ̄) (so μ = 2λ for the
    proximal helper's μ/2‖θ − θ̄‖²). Hand-computed on a 2-input linear model, full batch."""
    import torch
    from torch import nn

    from graphfl.client.fesem_trainer import FeSEMTrainer
    from graphfl.common.config import TrainConfig
    from graphfl.common.core import ClientContext
    from graphfl.common.types import ClientData, Payload

    x = np.array([[1.0, 2.0], [0.5, -1.0], [-1.5, 0.0], [2.0, 1.0]], np.float32)
    y = np.array([[1.0], [0.0], [-2.0], [3.0]], np.float32)

    class TinyTask:
        name, kind = "tiny", "regression"

        def build_model(self):
            torch.manual_seed(0)
            return nn.Linear(2, 1, bias=False)

        def loss_fn(self):
            return nn.MSELoss()

    lam, lr, steps = 0.7, 0.1, 4
    cfg = RunConfig(train=TrainConfig(local_steps=steps, batch_size=4, lr=lr))
    ctx = ClientContext(config=cfg, params=fs.FeSEMParams(prox_lambda=lam), partition_id=0, num_partitions=1,
                        task=TinyTask(), data=ClientData(x, y, x, y))
    center = np.array([[0.3, -0.4]], np.float32)
    result = FeSEMTrainer(ctx).fit(2, Payload({"weight": center}), {})

    def by_hand(coef: float) -> np.ndarray:
        xd, yd, bar = x.astype(np.float64), y[:, 0].astype(np.float64), center[0].astype(np.float64)
        theta = bar.copy()                                    # the client starts from its center
        for _ in range(steps):
            grad_f = 2.0 / len(xd) * xd.T @ (xd @ theta - yd)  # ∇ mean((Xθ − y)²)
            theta = theta - lr * (grad_f + coef * (theta - bar))
        return theta

    np.testing.assert_allclose(result.arrays["weight"][0], by_hand(2 * lam), rtol=0, atol=1e-6)
    assert np.abs(by_hand(2 * lam) - by_hand(lam)).max() > 1e-3  # the factor 2 is visible at this size
    warm = FeSEMTrainer(ctx).fit(1, Payload({"weight": center}, {fs.WARMUP_KEY: True, fs.STEPS_KEY: steps}), {})
    np.testing.assert_allclose(warm.arrays["weight"][0], by_hand(0.0), rtol=0, atol=1e-6)  # warm-up: no term


def test_bench_permuted_digits_task_and_seed_aggregation():
    from graphfl.bench import multicenter as mc
    from graphfl.tasks.labeled import Digits, PermutedDigits

    task = PermutedDigits(seed=0)
    base = Digits(seed=0)
    for pid in (0, 1, 2):
        ours, plain = task.client_data(pid, 6), base.client_data(pid, 6)
        np.testing.assert_array_equal(ours.y_train, task.permutation(pid % 3)[plain.y_train])
    assert not np.array_equal(task.permutation(1), np.arange(10))
    adj = task.client_graph(6)
    assert np.array_equal(adj, adj.T) and adj[0, 3] == 1 and adj[0, 1] == 0
    assert task.cluster_labels(6).tolist() == [0, 1, 2, 0, 1, 2]
    runs = [{"curve": [{"round": 0, "test_loss": v}, {"round": 1, "test_loss": v / 2}],
             "aggregate_seconds": [0.1], "wall_seconds": 1.0} for v in (1.0, 3.0)]
    res = mc._combine(runs, "test_loss")
    assert res["final"]["test_loss"] == pytest.approx(1.0)
    assert res["final"]["test_loss_sd"] == pytest.approx(np.std([0.5, 1.5], ddof=1))


def test_both_fesem_losses_are_recorded_per_round():
    """§4.5 asks for the center's loss and the last local model's: both land in run.json's curve."""
    from graphfl.common.config import parse_run_config
    from graphfl.server.inprocess import run_federated_inprocess

    cfg = parse_run_config({"strategy": "fesem", "task": "digits-permuted", "nodes": 6, "rounds": 2,
                            "engine": "inprocess", "train.local-steps": 3, "fesem.k": 3})
    doc, _ = run_federated_inprocess(cfg)
    last = doc["methods"]["fesem"]["curve"][-1]
    assert last["test_loss"] is not None and last["local_test_loss"] is not None
    assert last["local_test_loss"] != last["test_loss"]  # the local model is not the center
    assert set(last["local_test_loss_per_client"]) == {str(i) for i in range(6)}
