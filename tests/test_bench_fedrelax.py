"""B6 ``fedrelax`` benchmark: two-cluster data, graphs, the FDU-MTL reader and tiny end-to-end runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from graphfl.bench import fedrelax as fr
from graphfl.tasks.base import DataError

TINY = fr.Plan(seeds=(0,), lambdas=(1.0,), max_iter=3, fdu_shared=20, fdu_lambdas=(1.0,))


def test_two_clusters_data_and_graphs():
    d = fr.two_clusters(0)
    assert len(d.train) == 20 and d.train[0][0].shape == (20, 1) and list(d.clusters[:10]) == [0] * 10
    resid = d.test[15][1] - fr.truth(1, d.test[15][0][:, 0])
    assert abs(float(np.std(resid)) - fr.NOISE) < 0.06
    w = fr.weighted_knn(np.arange(12, dtype=float).reshape(6, 2))
    assert np.allclose(w, w.T) and np.all(np.diag(w) == 0) and np.all((w > 0).sum(1) >= 3) and w.max() <= 1.0


def test_read_fdu_rejects_a_malformed_line(tmp_path):
    bad = tmp_path / "x.task.train"
    bad.write_text("1\tgood\n2\tbad label\n")
    with pytest.raises(DataError, match=r"x\.task\.train:2"):
        fr.read_fdu(bad)


def test_run_without_data_skips_the_real_part_with_the_reason(tmp_path):
    doc = fr.run(quick=True, seed=0, out=tmp_path, data_dir=tmp_path / "no-data", plan=TINY)
    assert "fdu_mtl" in doc["skipped"] and "not found" in doc["skipped"]
    saved = json.loads((tmp_path / "fedrelax.json").read_text())
    assert saved["unspecified_settings"] and "two-cluster/fedrelax-prediction" in saved["methods"]
    assert all(np.isfinite(m["final"]["test_mse"]) for m in saved["methods"].values())
    assert (tmp_path / "fedrelax.png").stat().st_size > 0
    assert "skipped" in (tmp_path / "fedrelax.md").read_text()


def test_fdu_part_on_a_small_fake_folder(tmp_path):
    rng = np.random.default_rng(0)
    words = [f"w{k}" for k in range(300)]
    folder = tmp_path / "fdu_mtl"
    folder.mkdir()

    def write(path, n):
        lines = []
        for _ in range(n):
            y = int(rng.integers(2))
            toks = list(rng.choice(words, 8)) + (["good"] if y else ["bad"]) * 2
            lines.append(f"{y}\t{' '.join(toks)}")
        path.write_text("\n".join(lines) + "\n")

    for dom in (*fr.FDU_DOMAINS, fr.FDU_PUBLIC):
        write(folder / f"{dom}.task.train", fr.FDU_DEV + 30)
        write(folder / f"{dom}.task.test", 20)
    doc = fr.run(quick=True, seed=0, out=tmp_path / "out", data_dir=tmp_path, plan=TINY)
    assert doc["skipped"] is None
    fdu = {k: v["final"] for k, v in doc["methods"].items() if k.startswith("fdu_mtl-n100/")}
    assert set(fdu) == {f"fdu_mtl-n100/{m}" for m in fr.P2_METHODS}
    assert all(0.0 <= v["test_acc"] <= 1.0 for v in fdu.values())
    assert fdu["fdu_mtl-n100/pooled"]["test_acc"] > 0.8            # the planted 'good'/'bad' words are learnable
