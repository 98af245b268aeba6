"""Bench ``multicenter-regime``: the task knobs it sweeps, the verdict rule, a tiny sweep that resumes."""

from __future__ import annotations

import numpy as np
import pytest

from graphfl.bench import multicenter_regime as mr
from graphfl.common.config import ConfigError, parse_run_config
from graphfl.tasks import registry


def _task(seed: int = 0, **data: object):
    cfg = parse_run_config({"strategy": "fedavg", "task": "synthetic-multicenter", "nodes": 12, "seed": seed,
                            **{f"data.{k}": v for k, v in data.items()}})
    return registry.create(cfg.task, data=cfg.data, seed=seed)


def test_defaults_are_the_paper_setting() -> None:
    plain, named = _task(), _task(**{"client-samples": 100, "cluster-std": 0.5})
    # the generator as the paper's setting writes it (seed 000 Table 10.1): 3 centers U[-0.5, 0.5]^64, std 0.5
    rng = np.random.default_rng([0, 10])
    centers = rng.uniform(-0.5, 0.5, size=(3, 64))
    labels = rng.integers(0, 3, size=12)
    expected = centers[labels] + 0.5 * rng.standard_normal((12, 64))
    np.testing.assert_allclose(plain.mixture_vectors(12), expected, rtol=1e-6)
    for p in (0, 7):
        a, b = plain.client_data(p, 12), named.client_data(p, 12)
        for f in ("x_train", "y_train", "x_test", "y_test"):
            np.testing.assert_allclose(getattr(a, f), getattr(b, f), rtol=1e-6)
        r = np.random.default_rng([0, 11, p])
        x_tr = r.uniform(-60, 60, size=(100, 8)) / 60.0
        x_te = r.uniform(-60, 60, size=(100, 8)) / 60.0
        np.testing.assert_allclose(a.x_train, x_tr, rtol=1e-6)
        np.testing.assert_allclose(a.x_test, x_te, rtol=1e-6)


def test_client_samples_sets_the_training_rows_only() -> None:
    base, few = _task(), _task(**{"client-samples": 5})
    a, b = base.client_data(3, 12), few.client_data(3, 12)
    assert b.x_train.shape == (5, 8) and b.y_train.shape == (5, 8)
    assert b.x_test.shape == (100, 8)
    np.testing.assert_allclose(b.x_train, a.x_train[:5], rtol=1e-6)  # same stream: a prefix
    np.testing.assert_allclose(few.ground_truth(12), base.ground_truth(12), rtol=1e-6)


def test_cluster_std_scales_the_spread_around_fixed_centers() -> None:
    tight, wide = _task(**{"cluster-std": 0.05}), _task(**{"cluster-std": 2.0})
    labels = tight.cluster_labels(12)
    np.testing.assert_array_equal(labels, wide.cluster_labels(12))
    vt, vw = tight.mixture_vectors(12), wide.mixture_vectors(12)
    # v = c_label + std * z with the same c and z: the offsets scale by 2.0 / 0.05 = 40 and the centers cancel
    centre_t = vt - 0.05 * (vw - vt) / (2.0 - 0.05)
    centre_w = vw - 2.0 * (vw - vt) / (2.0 - 0.05)
    np.testing.assert_allclose(centre_t, centre_w, rtol=1e-6, atol=1e-9)
    for k in np.unique(labels):
        same = centre_t[labels == k]
        np.testing.assert_allclose(same, np.broadcast_to(same[0], same.shape), rtol=1e-6, atol=1e-9)
    # the data follow the weights: y = x W_i
    d = wide.client_data(0, 12)
    np.testing.assert_allclose(d.y_train, d.x_train @ wide.ground_truth(12)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("key", "value"), [("data.client-samples", -1), ("data.cluster-std", -0.1)])
def test_bad_knob_values_name_the_key(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_run_config({"strategy": "fedavg", "task": "synthetic-multicenter", key: value})


def test_verdict_is_computed_from_the_paired_seeds() -> None:
    assert mr.verdict([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], 3)["verdict"] == "FeSEM wins"
    assert mr.verdict([2.0, 2.0, 2.0], [1.0, 1.0, 1.0], 3)["verdict"] == "FeSEM loses"
    assert mr.verdict([1.0, 3.0, 1.0], [2.0, 2.0, 2.0], 3)["verdict"] == "tie"
    assert mr.verdict([1.0, 1.0, 1.0], [1.001, 1.001, 1.001], 3)["verdict"] == "tie"  # inside the band
    assert mr.verdict([1.0, 1.0], [2.0, 2.0], 3)["verdict"] == "not testable"  # a seed missing
    assert mr.verdict([1.0, None, 1.0], [2.0, 2.0, 2.0], 3)["verdict"] == "FeSEM loses"


TINY = mr.Form(rounds=2, seeds=2, samples=(5,), stds=(0.1,), nodes=(6,), lr_grid=(1.0,), fesem_warmups=(10,))


def test_tiny_sweep_runs_reports_and_resumes(tmp_path, monkeypatch) -> None:
    doc = mr.run(seed=0, out=tmp_path, spec=TINY)
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"{mr.NAME}.{ext}").is_file()
    point = {"nodes": 6, "samples": 5, "std": 0.1}
    for m in mr.METHODS:
        stat = mr.result(doc, m, **point)["metrics"]["mse"]
        assert stat["mean"] is not None and np.isfinite(stat["mean"]), m
    (v,) = doc["verdicts"]
    assert v["FeSEM vs FedAvg"]["verdict"] in {"FeSEM wins", "FeSEM loses", "tie"}
    assert v["FeSEM vs FedAvg"]["expected"] == 2
    (diag,) = doc["diagnostics"]
    assert all(d is not None and d["ari"] is not None for d in diag["per_seed"])
    assert "Verdicts" in (tmp_path / f"{mr.NAME}.md").read_text()

    def must_not_run(*args: object, **kwargs: object) -> dict:
        raise AssertionError("a cached cell was computed again")

    monkeypatch.setattr(mr, "run_one", must_not_run)
    again = mr.run(seed=0, out=tmp_path, spec=TINY)
    assert again["verdicts"] == doc["verdicts"]
