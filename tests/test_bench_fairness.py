"""The pieces that make B1 (bench dfl) and B2 (bench multicenter) fair; fast."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from graphfl.bench import dfl as b1
from graphfl.bench import multicenter as b2
from graphfl.bench.harness import run_bench
from graphfl.common.graph import gcn_propagation, knn_graph
from graphfl.p2p.oracles import ProblemSpec, make_oracle
from graphfl.tasks import registry
from graphfl.tasks.holdout import VALIDATION_SUFFIX, split_validation, validation_task


def _rows(a: np.ndarray) -> set[bytes]:
    return {np.ascontiguousarray(r).tobytes() for r in np.asarray(a).reshape(len(a), -1)}


@pytest.mark.parametrize("task", ["synthetic-multicenter", "synthetic-multicenter-smooth", "synthetic-dfl"])
def test_validation_split_comes_from_train_and_is_disjoint_from_test(task: str) -> None:
    name = validation_task(task)
    assert name == task + VALIDATION_SUFFIX
    assert validation_task(task) == name  # idempotent
    n = registry.get(task).spec.default_nodes
    full = registry.create(task, seed=3).client_data(1, n)
    val = registry.create(name, seed=3).client_data(1, n)
    train, held, test = _rows(val.x_train), _rows(val.x_test), _rows(full.x_test)
    assert train.isdisjoint(held)
    assert held.isdisjoint(test) and train.isdisjoint(test)
    assert train | held == _rows(full.x_train)
    assert len(held) == round(0.2 * len(full.x_train))
    # the targets travel with their inputs
    idx = {np.ascontiguousarray(r).tobytes(): k for k, r in enumerate(full.x_train)}
    for x, y in zip(val.x_test, val.y_test):
        np.testing.assert_array_equal(full.y_train[idx[np.ascontiguousarray(x).tobytes()]], y)


def test_split_validation_is_deterministic_and_keeps_both_sides() -> None:
    from graphfl.common.types import ClientData

    x = np.arange(10, dtype=np.float32)[:, None]
    d = ClientData(x, x, x[:2] + 100, x[:2])
    a, b = split_validation(d, 0, 4), split_validation(d, 0, 4)
    np.testing.assert_array_equal(a.x_test, b.x_test)
    assert len(a.x_test) == 2 and len(a.x_train) == 8
    tiny = split_validation(ClientData(x[:2], x[:2], x[:1], x[:1]), 0, 0)
    assert len(tiny.x_train) == 1 and len(tiny.x_test) == 1


class _Quadratic:
    """f_i(θ) = ½ (θ − c_i)ᵀ H_i (θ − c_i): ∇f_i(θ) = H_i (θ − c_i)."""

    def __init__(self, h: np.ndarray, c: np.ndarray) -> None:
        self.h, self.c = h, c

    def full_grad(self, theta: np.ndarray) -> np.ndarray:
        out: np.ndarray = self.h @ (theta - self.c)
        return out


def test_stationarity_on_quadratics_by_hand() -> None:
    # 1-D: f_1 = ½(θ − 1)², f_2 = ½(θ + 3)²; at θ̄ = 0 the gradients are −1 and 3: mean 1, squared 1
    o = [_Quadratic(np.eye(1), np.array([1.0])), _Quadratic(np.eye(1), np.array([-3.0]))]
    assert b1.stationarity(o, np.zeros(1)) == pytest.approx(1.0)
    assert b1.stationarity(o, np.array([-1.0])) == pytest.approx(0.0)  # the minimiser of f_1 + f_2
    # 2-D with different curvatures: H_1 = diag(1, 2), c_1 = (1, 0); H_2 = diag(3, 1), c_2 = (0, 2)
    # at θ = (1, 1): ∇f_1 = (0, 2), ∇f_2 = (3, −1) → mean (1.5, 0.5) → 2.25 + 0.25 = 2.5
    o2 = [_Quadratic(np.diag([1.0, 2.0]), np.array([1.0, 0.0])), _Quadratic(np.diag([3.0, 1.0]), np.array([0.0, 2.0]))]
    assert b1.stationarity(o2, np.array([1.0, 1.0])) == pytest.approx(2.5)


def test_linreg_oracle_stationarity_matches_normal_equations() -> None:
    spec = ProblemSpec("linreg", num_nodes=3, seed=1, dim=4, samples=40)
    oracles = [make_oracle(i, spec) for i in range(3)]
    theta = np.random.default_rng(0).normal(size=4)
    g = np.mean([o.a.T @ (o.a @ theta - o.b) / len(o.b) for o in oracles], axis=0)
    assert b1.stationarity(oracles, theta) == pytest.approx(float(g @ g))
    # zero at the pooled least-squares solution (equal sample counts)
    a = np.vstack([o.a for o in oracles])
    b = np.concatenate([o.b for o in oracles])
    star = np.linalg.lstsq(a, b, rcond=None)[0]
    assert b1.stationarity(oracles, star) < 1e-16


def test_torch_oracle_full_grad_is_the_full_batch_gradient() -> None:
    o = make_oracle(2, ProblemSpec("synthetic-dfl", num_nodes=5, seed=0, standardize=True))
    theta = o.initial_theta()
    m = len(o.x)
    g_full = o.full_grad(theta)
    g1, _ = o.grad(theta, np.arange(m // 2))
    g2, _ = o.grad(theta, np.arange(m // 2, m))
    np.testing.assert_allclose(g_full, (g1 + g2) / 2, rtol=1e-4, atol=1e-6)
    # standardised inputs: the node's own training mean 0 and sd 1
    x = o.x.numpy()
    np.testing.assert_allclose(x.mean(0), 0.0, atol=1e-4)
    np.testing.assert_allclose(x.std(0), 1.0, atol=1e-3)


def test_smooth_generator_ground_truth_is_a_hat_v() -> None:
    n = 50
    t = registry.create("synthetic-multicenter-smooth", seed=2)
    v = t.mixture_vectors(n)
    a_hat = gcn_propagation(knn_graph(v, 4))
    u = t.ground_truth(n).reshape(n, -1)
    np.testing.assert_allclose(u, a_hat @ v, atol=1e-12)
    np.testing.assert_array_equal(t.client_graph(n), knn_graph(v, 4))
    d = t.client_data(7, n)
    np.testing.assert_allclose(d.y_train, d.x_train.astype(np.float64) @ u[7].reshape(8, 8), atol=1e-5)
    # today's generator is unchanged: W_i = v_i
    plain = registry.create("synthetic-multicenter", seed=2)
    np.testing.assert_array_equal(plain.ground_truth(n).reshape(n, -1), v)


def test_test_graph_is_homologous_but_new() -> None:
    n = 50
    train = registry.create("synthetic-multicenter-smooth", seed=0)
    test = registry.create("synthetic-multicenter-smooth-testgraph", seed=0)
    v, w = train.mixture_vectors(n), test.mixture_vectors(n)
    assert not np.allclose(v, w)
    assert not np.array_equal(train.client_graph(n), test.client_graph(n))
    lv, lw = train.cluster_labels(n), test.cluster_labels(n)
    mv = np.stack([v[lv == k].mean(0) for k in range(3)])
    mw = np.stack([w[lw == k].mean(0) for k in range(3)])
    dist = ((mv[:, None, :] - mw[None, :, :]) ** 2).sum(-1)
    assert (np.argmin(dist, axis=1) == np.arange(3)).all()  # same mixture components
    np.testing.assert_allclose(test.ground_truth(n).reshape(n, -1), gcn_propagation(test.client_graph(n)) @ w)
    assert not np.allclose(train.client_data(0, n).x_train, test.client_data(0, n).x_train)


def test_b1_tuning_picks_one_alpha0_by_validation_never_test(monkeypatch: pytest.MonkeyPatch) -> None:
    # one alpha0 for all methods (ALGORITHMS §0.1 C1): the mean of the methods' global-model validation losses;
    # a value at which any method diverges is not eligible
    val = {0.1: 0.5, 0.3: 0.2, 0.6: 0.25, 1.0: 0.01}
    diverges = {("dfl-sgd", 1.0)}
    test = {0.1: 0.1, 0.3: 0.9, 0.6: 0.0, 1.0: 0.0}  # would pick 0.6, 1.0 or 0.1
    splits: list[str] = []

    def fake(method: str, tau: int, alpha0: float, iterations: int, seed: int, n: int, split: str = "test",
             **_: Any) -> dict[str, Any]:
        splits.append(split)
        if (method, alpha0) in diverges:
            raise b1.Diverged("boom")
        loss = val[alpha0] if split == "val" else test[alpha0]
        loss += {"fedavg": 0.0, "dfl-sgd": 0.1, "dfl-gt": 0.2}[method]
        return {"final": {"avg_model_test_loss": loss, "test_loss": 0.0}}

    monkeypatch.setattr(b1, "run_method", fake)
    form = b1.Form(iterations=10, seeds=1, grid=(0.1, 0.3, 1.0), eval_points=2)
    bench = b1.declare(form, seed=0)
    bench.points = [{"topology": "ring5", "tau": 1}]
    out = run_bench(bench, None)
    (t,) = out.tuning
    assert t["chosen"] == 0.3
    assert t["scores"] == pytest.approx({"0.1": 0.6, "0.3": 0.3, "0.6": 0.35, "1": None})
    assert t["per_method"]["dfl-gt"]["0.3"] == pytest.approx(0.4)
    assert t["extended"] == [0.6] and not t["at_edge"]
    # every validation run comes before the first test run, and the test runs use the chosen value only
    first_test = splits.index("test")
    assert set(splits[:first_test]) == {"val"} and set(splits[first_test:]) == {"test"}
    assert all(r["params"] == {"alpha0": 0.3} for r in out.results)


def test_b2_tuning_picks_by_validation_never_test(monkeypatch: pytest.MonkeyPatch) -> None:
    tasks: list[str] = []
    val = {0.3: 0.4, 1.0: 0.1, 3.0: float("nan")}

    def fake(method: str, task: str, nodes: int, rounds: int, seed: int, settings: dict[str, Any], *a: Any,
             **k: Any) -> dict[str, Any]:
        tasks.append(task)
        return {"curve": [{"round": rounds, "test_loss": val[settings["lr"]] if task.endswith("+val") else 0.0}]}

    monkeypatch.setattr(b2, "run_any", fake)
    name = validation_task("synthetic-multicenter")
    t = b2.tune_lr("fedavg", name, 50, 3, 0, (0.3, 1.0, 3.0), b2.TRAIN, {})
    assert t["lr"] == 1.0 and t["grid"]["3"] is None
    assert tasks and all(x.endswith("+val") for x in tasks)
    # classification: maximise validation accuracy
    # a winning upper edge (0.3) is extended: 0.9 is tried and wins, 2.7 brackets it
    acc = {0.1: 0.7, 0.3: 0.9, 0.9: 0.95, 2.7: 0.5}
    monkeypatch.setattr(b2, "run_any", lambda m, task, n, r, s, st, *a, **k: {
        "curve": [{"round": r, "test_acc": acc[st["lr"]]}]})
    t = b2.tune_lr("local", name, 12, 2, 0, (0.1, 0.3), b2.TRAIN, {}, classification=True)
    assert t["lr"] == 0.9 and t["extended"] == [0.9, 2.7] and not t["at_grid_edge"]
    assert t["grid"] == {"0.1": 0.7, "0.3": 0.9, "0.9": 0.95, "2.7": 0.5}
