"""B1 (``graphfl bench dfl``) follows ALGORITHMS.md §0.1 C1: shared input transform, one step rule, global model first."""

from __future__ import annotations

import numpy as np
import pytest

from graphfl.bench import dfl as b1
from graphfl.bench.harness import Bench, Cell, run_bench
from graphfl.p2p.oracles import ProblemSpec, make_oracle


def test_pooled_standardisation_is_one_transform_shared_by_all_nodes() -> None:
    n = 5
    oracles = b1.make_oracles(n, seed=0)
    xs = [o.x.numpy().astype(np.float64) for o in oracles]
    pooled = np.concatenate(xs)
    np.testing.assert_allclose(pooled.mean(0), 0.0, atol=1e-4)
    np.testing.assert_allclose(pooled.std(0), 1.0, atol=1e-3)
    # the nodes keep their different input ranges (per-node standardisation would give each sd 1)
    sds = sorted(float(x.std()) for x in xs)
    assert sds[0] < 0.1 < 0.3 < sds[-1]
    # the same affine map on every node: raw = mu + sd * standardised, with one (mu, sd)
    raw = [make_oracle(i, ProblemSpec("synthetic-dfl", num_nodes=n, seed=0)).x.numpy() for i in range(n)]
    mu, sd = raw[0].mean(0) - xs[0].mean(0) * raw[0].std(0) / xs[0].std(0), raw[0].std(0) / xs[0].std(0)
    for r, x in zip(raw, xs):
        np.testing.assert_allclose(r, mu + sd * x, rtol=1e-3, atol=1e-2)


def test_per_node_and_pooled_standardisation_exclude_each_other() -> None:
    from graphfl.common.config import ConfigError

    with pytest.raises(ConfigError, match="exclude each other"):
        make_oracle(0, ProblemSpec("synthetic-dfl", num_nodes=5, standardize=True, pooled_standardize=True))


def test_exchanged_models_of_fedavg_are_the_server_model() -> None:
    oracles = b1.make_oracles(5, seed=1)
    rng = np.random.default_rng(0)
    thetas = [o.initial_theta() + 0.05 * rng.standard_normal(o.dim).astype(np.float32) for o in oracles]
    w = b1.mixing("fedavg", 5)
    theta_bar = np.mean(np.stack(thetas).astype(np.float64), axis=0).astype(np.float32)
    assert b1.exchanged_models_loss(oracles, w, thetas) == pytest.approx(b1.global_loss(oracles, theta_bar), rel=1e-5)
    # on a ring the exchanged models differ from the average: their mean loss is not the average's
    ring = b1.mixing("dfl-sgd", 5)
    assert b1.exchanged_models_loss(oracles, ring, thetas) != pytest.approx(b1.global_loss(oracles, theta_bar),
                                                                            rel=1e-6)


def _one_point(form: b1.Form, seed: int, methods: tuple[str, ...] = b1.METHODS) -> Bench:
    bench = b1.declare(form, seed)
    bench.points = [{"topology": "ring5", "tau": 5}]
    bench.methods = methods
    return bench


def test_one_alpha0_is_tuned_for_all_methods_on_the_global_model(tmp_path) -> None:
    form = b1.Form(iterations=20, seeds=1, grid=(0.05, 0.1), eval_points=2)
    out = run_bench(_one_point(form, 0), tmp_path)
    (tuned,) = out.tuning
    assert tuned["methods"] == list(b1.METHODS) and set(tuned["per_method"]) == set(b1.METHODS)
    chosen = f"{tuned['chosen']:g}"
    per = [tuned["per_method"][m][chosen] for m in b1.METHODS]
    assert tuned["scores"][chosen] == pytest.approx(float(np.mean(per)))
    # the criterion is the global model's validation loss of each method's run (split val, first seed)
    run = b1.run_method("dfl-gt", 5, tuned["chosen"], 20, 0, 5, split="val", eval_points=2, with_stationarity=False)
    assert tuned["per_method"]["dfl-gt"][chosen] == pytest.approx(run["final"]["avg_model_test_loss"], rel=1e-6)
    assert all(r["params"] == {"alpha0": tuned["chosen"]} for r in out.results)


def test_cell_key_keeps_the_format_of_cached_runs() -> None:
    """A B1 run cache written before the harness resumes under it: the key of a cell is unchanged."""
    form = b1.Form(iterations=300, seeds=3, grid=(0.1,), eval_points=15)
    cell = Cell((("topology", "ring20"), ("tau", 5)), "dfl-gt", 2, (("alpha0", 0.2),), "val")
    assert b1.cell_key(cell, form) == {
        "bench": "dfl", "method": "dfl-gt", "tau": 5, "alpha0": 0.2, "iterations": 300, "seed": 2, "n": 20,
        "split": "val", "eval_points": 15, "stationarity": False, "inputs": "pooled-standardised", "metrics": 2}
    test = Cell(cell.point, "fedavg", 0, (("alpha0", 15.0),))
    assert b1.cell_key(test, form)["stationarity"] is True and b1.cell_key(test, form)["split"] == "test"


def test_run_records_the_global_model_and_the_exchanged_models() -> None:
    r = b1.run_method("dfl-sgd", 5, 0.1, 20, 0, 5, eval_points=2)
    last = r["curve"][-1]
    for key in ("avg_model_test_loss", "exchanged_models_test_loss", "test_loss", "stationarity"):
        assert last[key] is not None and np.isfinite(last[key])
    assert r["final"]["exchanged_models_test_loss"] is not None


def test_a_diverging_test_run_backs_off_below_the_grid(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    tried: list[float] = []

    def fake(method: str, tau: int, alpha0: float, iterations: int, seed: int, n: int, split: str = "test",
             **_: object) -> dict:
        if split == "val":  # validation prefers 0.2
            return {"final": {"avg_model_test_loss": 1 + abs(alpha0 - 0.2)}, "curve": []}
        tried.append(alpha0)
        if alpha0 > 0.03:
            raise b1.Diverged("boom")
        return {"final": {"avg_model_test_loss": 1.0}, "curve": []}

    monkeypatch.setattr(b1, "run_method", fake)
    form = b1.Form(iterations=10, seeds=1, grid=(0.1, 0.2, 15.0), eval_points=2)
    out = run_bench(_one_point(form, 2, ("dfl-sgd",)), tmp_path / "a")
    (r,) = out.results
    assert r["params"] == {"alpha0": 0.2} and r["params_per_seed"] == [{"alpha0": pytest.approx(0.025)}]
    assert tried == pytest.approx([0.2, 0.1, 0.05, 0.025]) and r["failed"] == 0 and len(r["failures"]) == 3
    tried.clear()
    monkeypatch.setattr(b1, "run_method", lambda *a, split="test", **k: fake(*a, split=split, **k) if split == "val"
                        else (_ for _ in ()).throw(b1.Diverged("always")))
    (r,) = run_bench(_one_point(form, 2, ("dfl-sgd",)), tmp_path / "b").results
    assert r["failed"] == 1 and r["params_per_seed"] == [None] and r["metrics"]["avg_model_test_loss"]["mean"] is None
