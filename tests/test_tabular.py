"""Users' own tabular data (tasks/tabular.py): format, split, standardisation, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from graphfl.common.config import DataConfig
from graphfl.common.graph import GraphError
from graphfl.tasks import registry
from graphfl.tasks.base import DataError
from graphfl.tasks.tabular import device_arrays, load_tabular, split_rows


def write_csv(path: Path, header: list[str], rows: list[list[object]]) -> Path:
    path.write_text("\n".join([",".join(header)] + [",".join(str(v) for v in r) for r in rows]) + "\n")
    return path


def make_folder(root: Path, n_devices: int = 3, n_rows: int = 10, seed: int = 0) -> dict[int, np.ndarray]:
    """device-<i>.csv with columns a, b, y (y = a - 2b + i); returns the raw values per device."""
    rng = np.random.default_rng(seed)
    raw = {}
    for i in range(n_devices):
        x = rng.normal(size=(n_rows, 2)) * [1.0, 3.0] + [5.0, -1.0]
        y = x[:, 0] - 2 * x[:, 1] + i
        vals = np.column_stack([x, y])
        raw[i] = vals
        write_csv(root / f"device-{i}.csv", ["a", "b", "y"], [[repr(float(v)) for v in r] for r in vals])
    return raw


def test_round_trip_split_and_standardisation(tmp_path):
    raw = make_folder(tmp_path, n_devices=3, n_rows=10)
    ds = load_tabular(tmp_path, split_seed=5)
    assert ds.num_devices == 3 and ds.features == ("a", "b") and ds.adjacency is None and ds.shared_raw is None
    for i, d in enumerate(ds.devices):
        tr, te = split_rows(10, 0.2, 5, i)
        assert len(te) == 2 and len(tr) == 8 and not set(tr) & set(te)
        x, y = raw[i][:, :2], raw[i][:, 2]
        mu, sd = x[tr].mean(0), x[tr].std(0)
        np.testing.assert_allclose(d.x_train, (x[tr] - mu) / sd)
        np.testing.assert_allclose(d.x_test, (x[te] - mu) / sd)          # test rows use the training mean/sd
        np.testing.assert_allclose(d.y_train, y[tr])                       # response untouched
        np.testing.assert_allclose(d.y_test, y[te])
        np.testing.assert_allclose(d.x_train.mean(0), 0.0, atol=1e-12)
        np.testing.assert_allclose(d.transform(x[te]), d.x_test)
    # same seed -> same split; other seed -> other split
    again = device_arrays(tmp_path, split_seed=5)
    assert np.array_equal(again[1][3], ds.devices[1].y_test)
    other = load_tabular(tmp_path, split_seed=6)
    assert not np.array_equal(other.devices[1].y_test, ds.devices[1].y_test)
    raw_ds = load_tabular(tmp_path, standardize="none", intercept=True, test_fraction=0.0)
    assert raw_ds.features == ("a", "b", "(intercept)")
    np.testing.assert_allclose(raw_ds.devices[0].x_train, np.column_stack([raw[0][:, :2], np.ones(10)]))
    assert raw_ds.devices[0].x_test.shape == (0, 3)


def test_settings_file_graph_shared_set_and_column_order(tmp_path):
    write_csv(tmp_path / "device-0.csv", ["price", "x1", "x2"], [[1, 2, 3], [4, 5, 6], [7, 8, 10]])
    write_csv(tmp_path / "device-1.csv", ["x2", "price", "x1"], [[3, 1, 2], [6, 4, 5]])   # other order is fine
    (tmp_path / "dataset.toml").write_text('response = "price"\ntest-fraction = 0.0\nstandardize = "none"\n')
    (tmp_path / "edges.txt").write_text("# the graph\n0 1 2.5\n")
    write_csv(tmp_path / "shared.csv", ["x2", "x1"], [[1, 0], [2, 1]])
    ds = load_tabular(tmp_path)
    assert ds.settings.response == "price" and ds.features == ("x1", "x2")
    np.testing.assert_allclose(ds.devices[1].x_train, [[2, 3], [5, 6]])
    np.testing.assert_allclose(ds.devices[1].y_train, [1, 4])
    assert ds.edges() == [(0, 1)] and ds.adjacency[0, 1] == 2.5
    np.testing.assert_allclose(ds.shared_raw, [[0, 1], [1, 2]])               # reordered to the feature order
    np.testing.assert_allclose(ds.shared_for(0), [[0, 1], [1, 2]])
    # an explicit argument beats the file
    assert load_tabular(tmp_path, test_fraction=0.5).devices[0].x_test.shape == (2, 2)   # floor(1.5 + 0.5)


@pytest.mark.parametrize("case, match", [
    ("missing-response", r"device-1\.csv: no response column 'y'"),
    ("non-numeric", r"device-1\.csv:3: column 'b' has 'abc', which is not a number"),
    ("empty-cell", r"device-1\.csv:2: column 'a' is empty"),
    ("nan-cell", r"device-0\.csv:3: column 'y' has 'NaN'"),
    ("no-rows", r"device-2\.csv: no data rows"),
    ("empty-file", r"device-2\.csv: the file is empty"),
    ("mismatched-columns", r"device-1\.csv: columns differ from device-0\.csv: missing \['b'\], extra \['c'\]"),
    ("ragged-row", r"device-0\.csv:4: expected 3 cells"),
    ("duplicate-column", r"device-0\.csv:1: column 'a' appears twice"),
    ("gap-in-ids", r"device-1\.csv not found: device ids must be contiguous"),
    ("leading-zero", r"device-01\.csv: device files are named"),
    ("no-devices", r"device-0\.csv not found"),
    ("shared-has-response", r"shared\.csv: has the response column 'y'"),
    ("shared-columns", r"shared\.csv: columns differ"),
    ("bad-settings-key", r"dataset\.toml: unknown key 'respons'"),
    ("bad-settings-value", r"dataset\.toml: test-fraction must be"),
])
def test_bad_files_name_file_and_line(tmp_path, case, match):
    ok = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    for i in range(3):
        write_csv(tmp_path / f"device-{i}.csv", ["a", "b", "y"], ok)
    d0, d1, d2 = (tmp_path / f"device-{i}.csv" for i in range(3))
    if case == "missing-response":
        write_csv(d1, ["a", "b", "z"], ok)
    elif case == "non-numeric":
        write_csv(d1, ["a", "b", "y"], [[1, 2, 3], [4, "abc", 6]])
    elif case == "empty-cell":
        write_csv(d1, ["a", "b", "y"], [["", 2, 3]])
    elif case == "nan-cell":
        write_csv(d0, ["a", "b", "y"], [[1, 2, 3], [4, 5, "NaN"]])
    elif case == "no-rows":
        write_csv(d2, ["a", "b", "y"], [])
    elif case == "empty-file":
        d2.write_text("")
    elif case == "mismatched-columns":
        write_csv(d1, ["a", "c", "y"], ok)
    elif case == "ragged-row":
        write_csv(d0, ["a", "b", "y"], [[1, 2, 3], [4, 5, 6], [7, 8]])
    elif case == "duplicate-column":
        write_csv(d0, ["a", "a", "y"], ok)
    elif case == "gap-in-ids":
        d1.unlink()
    elif case == "leading-zero":
        write_csv(tmp_path / "device-01.csv", ["a", "b", "y"], ok)
    elif case == "no-devices":
        for f in (d0, d1, d2):
            f.unlink()
    elif case == "shared-has-response":
        write_csv(tmp_path / "shared.csv", ["a", "b", "y"], ok)
    elif case == "shared-columns":
        write_csv(tmp_path / "shared.csv", ["a"], [[1]])
    elif case == "bad-settings-key":
        (tmp_path / "dataset.toml").write_text('respons = "y"\n')
    elif case == "bad-settings-value":
        (tmp_path / "dataset.toml").write_text("test-fraction = 2\n")
    with pytest.raises(DataError, match=match):
        load_tabular(tmp_path)


def test_edge_to_unknown_device_names_file_and_line(tmp_path):
    make_folder(tmp_path, n_devices=3)
    (tmp_path / "edges.txt").write_text("0 1\n1 3\n")
    with pytest.raises(GraphError, match=r"edges\.txt:2: node id 3 is outside 0\.\.2"):
        load_tabular(tmp_path)


def test_constant_feature_is_centred_only(tmp_path, caplog):
    write_csv(tmp_path / "device-0.csv", ["a", "k", "y"], [[1, 7, 0], [2, 7, 1], [3, 7, 2], [4, 7, 3]])
    ds = load_tabular(tmp_path, test_fraction=0.0)
    np.testing.assert_allclose(ds.devices[0].x_train[:, 1], 0.0)
    assert "constant" in caplog.text and "'k'" in caplog.text


def test_csv_task_for_flower(tmp_path):
    make_folder(tmp_path, n_devices=3, n_rows=10)
    (tmp_path / "edges.txt").write_text("0 1\n1 2\n")
    task = registry.create("csv", data=DataConfig(test_fraction=0.3), data_dir=str(tmp_path), seed=4)
    cd = task.client_data(2, 3)
    assert cd.x_train.dtype == np.float32 and cd.x_train.shape == (7, 2) and cd.y_train.shape == (7, 1)
    ref = load_tabular(tmp_path, split_seed=4, test_fraction=0.3).devices[2]
    np.testing.assert_allclose(cd.y_test[:, 0], ref.y_test, rtol=1e-6)
    assert task.client_graph(3)[1, 2] == 1.0
    assert task.build_model()(torch.as_tensor(cd.x_train)).shape == (7, 1)
    with pytest.raises(DataError, match=r"device-3\.csv not found: device 3 needs its own CSV"):
        task.client_data(3, 4)
    with pytest.raises(DataError, match=r"holds device-2\.csv but the run has 2 clients .*use --nodes 3"):
        task.client_data(0, 2)
    with pytest.raises(DataError, match="not found"):
        registry.create("csv", data_dir=str(tmp_path / "nowhere")).client_data(0, 3)
