"""Users' own data on the p2p layer: one CSV per device (docs/data.md, docs/p2p.md "Your own data").

* a device's own file gives exactly the arrays of the folder loader (``load_tabular``), also as a
  peer's ``data`` path in the network file;
* DFL-SGD / DFL-GT (a linear model) and FedRelax (with ``shared.csv``) run on the same data;
* ``graphfl p2p --algorithm admm --data-dir DIR`` with real TLS peer processes: per-device
  estimates, selected edges and test errors in ``p2p.json`` equal the in-process run (e2e).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from graphfl.common.config import ConfigError
from graphfl.p2p.algorithms import registry
from graphfl.p2p.algorithms.admm import ADMM
from graphfl.p2p.config import load_network_file
from graphfl.p2p.driver import run_network_inprocess
from graphfl.p2p.oracles import ProblemSpec, load_device, make_oracle
from graphfl.p2p.peer import problem_spec
from graphfl.tasks.tabular import load_tabular

CLUSTER = {0: (1.0, 2.0, -1.0), 1: (1.0, 2.0, -1.0), 2: (-1.0, 0.5, 1.0), 3: (-1.0, 0.5, 1.0)}  # (b, w1, w2)


def write_devices(root: Path, rows: int = 40, shuffled_columns: bool = True) -> Path:
    """4 devices in two clusters {0, 1}, {2, 3}; device 1's columns in another order; a ring plus a chord."""
    root.mkdir(parents=True, exist_ok=True)
    for d, (b, w1, w2) in CLUSTER.items():
        rng = np.random.default_rng(d)
        x = rng.normal(size=(rows, 2)).tolist()
        y = [b + w1 * a1 + w2 * a2 + 0.3 * e for (a1, a2), e in zip(x, rng.normal(size=rows).tolist())]
        if d == 1 and shuffled_columns:
            lines = ["y,x2,x1"] + [f"{yy!r},{a2!r},{a1!r}" for (a1, a2), yy in zip(x, y)]
        else:
            lines = ["x1,x2,y"] + [f"{a1!r},{a2!r},{yy!r}" for (a1, a2), yy in zip(x, y)]
        (root / f"device-{d}.csv").write_text("\n".join(lines) + "\n")
    (root / "edges.txt").write_text("# ring + chord\n0 1\n1 2\n2 3\n3 0\n0 2\n")
    (root / "dataset.toml").write_text('intercept = true\nstandardize = "none"\ntest-fraction = 0.25\n')
    xs = np.random.default_rng(9).normal(size=(15, 2)).tolist()
    (root / "shared.csv").write_text("x2,x1\n" + "".join(f"{a2!r},{a1!r}\n" for a1, a2 in xs))
    return root


def test_a_device_file_gives_the_folder_loaders_arrays(tmp_path):
    root = write_devices(tmp_path / "data")
    (root / "dataset.toml").write_text("intercept = true\ntest-fraction = 0.25\n")  # per-device standardisation
    ds = load_tabular(root, base={"split_seed": 5})
    for d in range(4):
        dev, shared, names = load_device(root, d, features=("x1", "x2"), split_seed=5)
        want = ds.devices[d]
        for a, b in zip(dev.arrays(), want.arrays()):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(dev.transform(shared), ds.shared_for(d))
        assert names == ds.features == ("x1", "x2", "(intercept)")
    # one device alone, its file named as the peer's data (settings and shared.csv next to it)
    mine = tmp_path / "device1-only"
    mine.mkdir()
    shutil.copy(root / "device-1.csv", mine / "my-data.csv")
    shutil.copy(root / "dataset.toml", mine / "dataset.toml")
    alone, _, _ = load_device(mine / "my-data.csv", 1, features=("x1", "x2"), split_seed=5)
    for a, b in zip(alone.arrays(), ds.devices[1].arrays()):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(FileNotFoundError, match="columns differ"):
        load_device(root, 0, features=("x1", "x3"))


def test_the_network_file_names_each_peers_own_data(tmp_path):
    root = write_devices(tmp_path / "data")
    own = tmp_path / "peer2"
    own.mkdir()
    shutil.copy(root / "device-2.csv", own / "readings.csv")
    shutil.copy(root / "dataset.toml", own / "dataset.toml")
    f = tmp_path / "net.toml"
    f.write_text(f'''[network]
name = "lab"
[[peers]]
id = 0
address = "127.0.0.1:50051"
[[peers]]
id = 1
address = "127.0.0.1:50052"
data = "{root}"
[[peers]]
id = 2
address = "127.0.0.1:50053"
partition = 2
data = "peer2/readings.csv"
[[edges]]
nodes = [0, 1]
[[edges]]
nodes = [1, 2]
[run]
algorithm = "admm"
problem = "csv"
data-dir = "data"
features = "x1,x2"
[tls]
insecure = true
''')
    net = load_network_file(f)
    folder = [make_oracle(i, ProblemSpec("csv", num_nodes=4, data_dir=str(root), features="x1,x2"), partition=i)
              for i in range(3)]
    for i in range(3):
        o = make_oracle(i, problem_spec(net, i), partition=net.topology.peer(i).partition)
        np.testing.assert_array_equal(o.x_train, folder[i].x_train)
        np.testing.assert_array_equal(o.y_test, folder[i].y_test)
        assert o.features == ("x1", "x2", "(intercept)")
    assert net.topology.peer(2).data == str(tmp_path / "peer2/readings.csv")


def test_dfl_and_fedrelax_run_on_the_same_csv_data(tmp_path):
    root = write_devices(tmp_path / "data")
    spec = ProblemSpec("csv", num_nodes=4, data_dir=str(root), batch_size=8, seed=1)
    from graphfl.p2p.topology import make_topology

    topo = make_topology("ring", 4)
    w = topo.mixing_matrix()
    for name in ("dfl-sgd", "dfl-gt"):
        oracles = [make_oracle(i, spec) for i in range(4)]
        start = np.mean([o.test_loss(o.initial_theta()) for o in oracles])
        res = run_network_inprocess(registry.create(name, alpha0=0.1), oracles, w, 60)
        assert res.curve[-1]["test_loss"] < 0.7 * start  # one consensus model for two clusters
        assert res.states[0].theta.shape == (3,)  # x1, x2, (intercept)
    relax = registry.create("fedrelax", model="linear", lam=1.0)
    res = run_network_inprocess(relax, [make_oracle(i, spec) for i in range(4)], w, 5, adjacency=topo.adjacency())
    assert np.isfinite(res.curve[-1]["test_loss"]) and res.states[0].theta.shape == (15,)
    (root / "shared.csv").unlink()
    with pytest.raises(ConfigError, match="shared.csv not found"):
        run_network_inprocess(relax, [make_oracle(i, spec) for i in range(4)], w, 1)
    with pytest.raises(ConfigError, match="--data-dir"):
        make_oracle(0, ProblemSpec("csv", num_nodes=4))


@pytest.mark.e2e
def test_a_csv_data_set_round_trips_through_graphfl_p2p(tmp_path):
    """graphfl p2p --algorithm admm --data-dir DIR (edges.txt in DIR), 4 real TLS peer processes, edge
    selection on the given graph: p2p.json's estimates, kept edges and test MSE == the in-process run."""
    from typer.testing import CliRunner

    from graphfl.deploy.p2p_cli import make_app

    root = write_devices(tmp_path / "data")
    out = tmp_path / "run"
    rounds = 8
    args = ["p2p", "--algorithm", "admm", "--data-dir", str(root), "--rounds", str(rounds), "--out", str(out),
            "--quiet", "--seed", "2", "--set", "edge-selection=given", "--set", "lam=0.05", "--set", "step=constant",
            "--set", "step-c=0.3", "--set", "batch-size=10", "--set", "connect-timeout=60", "--set", "round-timeout=30"]
    result = CliRunner().invoke(make_app(), args)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((out / "logs").glob("*.log"))) if (out / "logs").is_dir() else ""
    assert result.exit_code == 0, result.output + logs
    doc = json.loads((out / "p2p.json").read_text())
    assert doc["ok"] and doc["config"]["peers"] == 4 and doc["config"]["tls"]
    assert doc["config"]["run"]["problem"] == "csv" and doc["config"]["run"]["features"] == "x1,x2"
    assert sorted(map(tuple, (e[:2] for e in doc["config"]["edges"]))) == [(0, 1), (0, 2), (0, 3), (1, 2), (2, 3)]
    # the in-process run from the same network file
    net = load_network_file(out / "network.toml")
    algo = net.run.make_algorithm()
    oracles = [make_oracle(i, problem_spec(net, i), partition=i) for i in range(4)]
    ref = run_network_inprocess(algo, oracles, net.topology.mixing_matrix(), rounds, adjacency=net.topology.adjacency())
    sel = doc["edge_selection"]
    assert sel["kept"] == [[0, 1], [2, 3]] and sel["dropped"] == [[0, 2], [0, 3], [1, 2]] and not sel["unknown"]
    for i in range(4):
        peer = doc["peers"][str(i)]
        np.testing.assert_allclose(peer["estimate"], ADMM.estimate(ref.states[i]), rtol=0, atol=1e-6)
        want = algo.report(ref.states[i], oracles[i], _ctx(net, i))
        assert peer["report"]["kept_neighbours"] == want["kept_neighbours"]
        assert peer["metrics"]["test_mse"] == pytest.approx(want["metrics"]["test_mse"], abs=1e-6)
        assert peer["report"]["features"] == ["x1", "x2", "(intercept)"]
    fin = doc["methods"]["admm"]["final"]
    assert fin["test_mse"] == pytest.approx(np.mean([doc["peers"][str(i)]["metrics"]["test_mse"] for i in range(4)]))
    assert "## Edge selection: 2 of 5 edges kept" in (out / "p2p.md").read_text()
    assert (out / "p2p.png").stat().st_size > 0 and "edges kept 2/5" in result.output


def _ctx(net, i):
    from graphfl.p2p.algorithms import NodeContext

    return NodeContext.from_matrix(net.topology.mixing_matrix(), i, net.topology.adjacency())
