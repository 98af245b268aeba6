"""Raw data stays on its device: the ``csv`` task's client reads only its own ``device-<i>.csv``.

* each client's loader succeeds in a folder holding only its own file (the other devices' names
  present as folders, so opening one would fail), and opens no other file of the data (audited);
* the server builds the model from ``dataset.toml``'s ``features`` alone (no device file) or from
  the headers of the device files it holds (first lines only), and says what is missing otherwise;
* an in-process run with one folder per client and a schema-only server folder gives the curve of
  the run on the whole folder;
* a real deployment (e2e): 2 SuperNodes, each given its own ``data-dir`` holding only its file.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from graphfl.common import registry as algorithms
from graphfl.common.config import parse_run_config
from graphfl.tasks import registry
from graphfl.tasks.base import DataError
from graphfl.tasks.tabular import load_tabular

N = 3
_OPENED: list[str] = []
_WATCH: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _WATCH and isinstance(args[0], (str, Path)):
        path = str(args[0])
        if path.startswith(_WATCH[0]):
            _OPENED.append(path)


sys.addaudithook(_audit)


class opened_files:
    """Collect every file opened under ``root`` while the block runs (CPython audit events)."""

    def __init__(self, root: Path) -> None:
        self.root = str(root.resolve())
        self.paths: set[str] = set()

    def __enter__(self) -> opened_files:
        _OPENED.clear()
        _WATCH[:] = [self.root]
        return self

    def __exit__(self, *exc: object) -> None:
        _WATCH.clear()
        self.paths = {str(Path(p).resolve().relative_to(self.root)) for p in _OPENED}


def write_devices(root: Path, rows: int = 30) -> Path:
    """device-<i>.csv (columns in another order on device 1), edges.txt, dataset.toml."""
    root.mkdir(parents=True, exist_ok=True)
    for d in range(N):
        rng = np.random.default_rng(d)
        x = rng.normal(size=(rows, 2)) * [1.0, 3.0] + [d, -1.0]
        y = 1.5 * x[:, 0] - 0.5 * x[:, 1] + d + 0.1 * rng.normal(size=rows)
        if d == 1:
            lines = ["y,b,a"] + [f"{v!r},{b!r},{a!r}" for (a, b), v in zip(x.tolist(), y.tolist())]
        else:
            lines = ["a,b,y"] + [f"{a!r},{b!r},{v!r}" for (a, b), v in zip(x.tolist(), y.tolist())]
        (root / f"device-{d}.csv").write_text("\n".join(lines) + "\n")
    (root / "edges.txt").write_text("0 1\n1 2\n")
    (root / "dataset.toml").write_text("intercept = true\n")
    return root


def own_folders(root: Path, dest: Path) -> dict[int, Path]:
    """One folder per device: its own CSV, dataset.toml and edges.txt; every other device's file
    name exists there as a folder (reading it would fail)."""
    out = {}
    for d in range(N):
        mine = dest / f"node-{d}"
        mine.mkdir(parents=True)
        shutil.copy(root / f"device-{d}.csv", mine)
        shutil.copy(root / "dataset.toml", mine)
        shutil.copy(root / "edges.txt", mine)
        for other in range(N):
            if other != d:
                (mine / f"device-{other}.csv").mkdir()
        out[d] = mine
    return out


def test_each_client_reads_only_its_own_file(tmp_path):
    root = write_devices(tmp_path / "all")
    folders = own_folders(root, tmp_path / "nodes")
    ref = load_tabular(root, base={"split_seed": 7})
    for d, folder in folders.items():
        task = registry.create("csv", data_dir=str(folder), seed=7)
        with opened_files(folder) as seen:
            cd = task.client_data(d, N)
            graph = task.client_graph(N)
            model = task.build_model()
        assert seen.paths <= {f"device-{d}.csv", "dataset.toml", "edges.txt"}, seen.paths
        assert f"device-{d}.csv" in seen.paths
        want = ref.devices[d]
        np.testing.assert_allclose(cd.x_train, want.x_train, rtol=1e-6)
        np.testing.assert_allclose(cd.y_test[:, 0], want.y_test, rtol=1e-6)
        assert graph is not None and graph[0, 1] == graph[1, 2] == 1.0
        assert model.in_features == 3                  # a, b, (intercept)
    assert ref.features == ("a", "b", "(intercept)")   # sorted names: devices agree whatever the file order


def test_a_folder_with_only_another_devices_file_names_the_missing_one(tmp_path):
    root = write_devices(tmp_path / "all")
    mine = tmp_path / "node-1"
    mine.mkdir()
    shutil.copy(root / "device-1.csv", mine)
    with pytest.raises(DataError, match=r"node-1/device-2\.csv not found: device 2 needs its own CSV"):
        registry.create("csv", data_dir=str(mine)).client_data(2, N)
    assert registry.create("csv", data_dir=str(mine)).client_data(1, N).num_train > 0


def test_the_server_needs_no_device_rows(tmp_path):
    root = write_devices(tmp_path / "all")
    schema = tmp_path / "server"
    schema.mkdir()
    (schema / "dataset.toml").write_text('intercept = true\nfeatures = ["a", "b"]\n')
    task = registry.create("csv", data_dir=str(schema), seed=7)
    assert task.feature_names() == ("a", "b", "(intercept)") and task.build_model().in_features == 3
    assert task.client_graph(N) is None
    # device files but no schema: their headers (first lines) give the columns, no row is read
    with opened_files(root) as seen:
        names = registry.create("csv", data_dir=str(root)).feature_names()
    assert names == ("a", "b", "(intercept)")
    assert seen.paths == {"dataset.toml", *(f"device-{d}.csv" for d in range(N))}
    empty = tmp_path / "nothing"
    empty.mkdir()
    with pytest.raises(DataError, match=r"holds neither dataset\.toml with 'features' nor a device file"):
        registry.create("csv", data_dir=str(empty)).build_model()
    # headers that disagree are named
    (root / "device-2.csv").write_text("a,c,y\n1,2,3\n")
    with pytest.raises(DataError, match=r"device-2\.csv: columns differ from device-0\.csv"):
        registry.create("csv", data_dir=str(root)).feature_names()
    # a schema a device does not match is named on that device
    bad = tmp_path / "node-0"
    bad.mkdir()
    shutil.copy(root / "device-0.csv", bad)
    (bad / "dataset.toml").write_text('features = ["a", "z"]\n')
    with pytest.raises(DataError, match=r"device-0\.csv: columns differ from the feature list \['a', 'z'\]"):
        registry.create("csv", data_dir=str(bad)).client_data(0, N)


def test_a_clients_memory_holds_its_own_file_only(tmp_path):
    """Peak of the loader's allocations (tracemalloc) with a large other device beside it."""
    import tracemalloc

    root = write_devices(tmp_path / "all", rows=50)
    big = np.random.default_rng(0).normal(size=(60_000, 3))
    (root / "device-2.csv").write_text("a,b,y\n" + "\n".join(f"{a!r},{b!r},{c!r}" for a, b, c in big.tolist()))
    task = registry.create("csv", data_dir=str(root))
    tracemalloc.start()
    try:
        task.client_data(0, N)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000, peak          # device 2 alone as float64 is 1.4 MB; parsed as before, far more


def test_inprocess_run_with_one_folder_per_client(tmp_path):
    from graphfl.client.handler import build_runtime
    from graphfl.server.inprocess import InProcessExchange, run_federated_inprocess, server_inputs
    from graphfl.server.rounds import RunRecorder, run_federated

    root = write_devices(tmp_path / "all")
    folders = own_folders(root, tmp_path / "nodes")
    schema = tmp_path / "server"
    schema.mkdir()
    (schema / "dataset.toml").write_text('intercept = true\nfeatures = ["a", "b"]\n')
    shutil.copy(root / "edges.txt", schema)
    values = {"strategy": "fedavg", "task": "csv", "nodes": N, "rounds": 3, "train.local-steps": 5,
              "train.lr": 0.05, "engine": "inprocess", "seed": 3}
    whole, _ = run_federated_inprocess(parse_run_config({**values, "data-dir": str(root)}))

    class OwnFolders(InProcessExchange):
        def runtime(self, pid):
            if pid not in self.runtimes:
                self.runtimes[pid] = build_runtime(self.cfg, pid, self.cfg.nodes, data_dir=str(folders[pid]))
                self.states[pid] = {}
            return self.runtimes[pid]

    cfg = parse_run_config({**values, "data-dir": str(schema)})
    recorder = RunRecorder(cfg, "fedavg", None)
    run_federated(cfg, algorithms.get("fedavg"), OwnFolders(cfg), server_inputs(cfg), recorder)
    got = recorder.document()["methods"]["fedavg"]["curve"]
    want = whole["methods"]["fedavg"]["curve"]
    assert recorder.status == "completed"
    assert [r["round"] for r in got] == [0, 1, 2, 3]
    for g, w in zip(got, want):
        assert g["test_loss"] == pytest.approx(w["test_loss"], rel=1e-6)
        assert g["clients_evaluated"] == N


@pytest.mark.e2e
def test_deployment_with_each_supernode_holding_only_its_own_file(tmp_path):
    """2 SuperNodes, each with ``data-dir`` = a folder holding only its device file; the ServerApp's
    folder holds only ``dataset.toml`` (the schema) and ``edges.txt``."""
    from graphfl.deploy.federation import LocalFederation
    from graphfl.deploy.run import prepare, write_overrides
    from graphfl.server.flower_app import write_app_dir
    from graphfl.server.inprocess import run_federated_inprocess

    root = tmp_path / "all"
    root.mkdir()
    for d in range(2):
        rng = np.random.default_rng(d)
        x = rng.normal(size=(20, 2))
        y = x[:, 0] - x[:, 1] + d
        (root / f"device-{d}.csv").write_text("a,b,y\n" + "".join(f"{a!r},{b!r},{v!r}\n" for (a, b), v in
                                                                  zip(x.tolist(), y.tolist())))
    nodes = {}
    for d in range(2):
        nodes[d] = tmp_path / f"node-{d}"
        nodes[d].mkdir()
        shutil.copy(root / f"device-{d}.csv", nodes[d])
    schema = tmp_path / "server"
    schema.mkdir()
    (schema / "dataset.toml").write_text('features = ["a", "b"]\n')
    values = {"strategy": "fedavg", "task": "csv", "nodes": 2, "rounds": 2, "train.local-steps": 5,
              "train.lr": 0.05, "connect-timeout": 90, "round-timeout": 120, "engine": "local-deployment",
              "data-dir": str(schema), "out-dir": str(tmp_path / "run")}
    cfg, out = prepare(parse_run_config(values))
    with LocalFederation(tmp_path / "fed", 2, tls=True, clientapp_mode="cold", data_dirs=nodes) as fed:
        sub = fed.submitter()
        handle = sub.submit(write_app_dir(out / "app"), write_overrides(out / "rc.toml", cfg), out)
        sub.wait(handle, timeout=400, health=fed.health, status_every=30.0)
    doc = json.loads((out / "run.json").read_text())
    assert doc["status"] == "completed", doc.get("error")
    got = doc["methods"]["fedavg"]["curve"]
    ref, _ = run_federated_inprocess(parse_run_config({**values, "engine": "inprocess", "data-dir": str(root),
                                                       "out-dir": None}))
    want = ref["methods"]["fedavg"]["curve"]
    assert [r["round"] for r in got] == [0, 1, 2] and got[2]["clients_ok"] == 2
    for g, w in zip(got, want):
        assert g["test_loss"] == pytest.approx(w["test_loss"], rel=1e-5)


def test_a_supernodes_data_dir_goes_into_its_node_config(tmp_path):
    from graphfl.deploy.federation import supernode_argv

    argv = supernode_argv("127.0.0.1:9091", 9094, 1, 3, None, data_dir=tmp_path)
    node_config = argv[argv.index("--node-config") + 1]
    assert node_config == f"partition-id=1 num-partitions=3 data-dir='{tmp_path.resolve()}'"
    with pytest.raises(ValueError, match="a node-config path cannot hold quotes or spaces"):
        supernode_argv("127.0.0.1:9091", 9094, 1, 3, None, data_dir=tmp_path / "my data")
