"""Bad input gives a clear error or an honest status, never a traceback or a false "done".

* CSV cells: plain decimal numbers only (``1_0``, which Python reads as 10, ``0x10``, ``nan``,
  ``inf``, ``1e400`` are refused naming file, line and column), in tasks/ and in p2p/;
* checkpoints (server and p2p): every field is validated; a bad ``round`` names file, key, value;
* non-finite final results (CSV values of 1e200 / 1e30): p2p peers and the in-process engine end
  ``diverged``, a Flower run ends with the status ``diverged``, never ``done`` / ``completed``;
* the network file refuses two peers on the same host:port however it is spelled.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from graphfl.common.config import ConfigError, parse_run_config
from graphfl.tasks.base import DataError
from graphfl.tasks.tabular import load_device, load_tabular, read_numeric_csv


def write_rows(path: Path, header: str, rows: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


# -- 9b: CSV numbers ---------------------------------------------------------------------------

@pytest.mark.parametrize("cell", ["1_0", "0x10", "0b1", "1e", ".", "--1", "1 0", "１", "½", "1d",
                                  "NaN", "nan", "-inf", "+Infinity", "inf", "1e400", "-1e999"])
def test_a_cell_that_is_not_a_plain_decimal_number_is_refused(tmp_path, cell):
    f = write_rows(tmp_path / "device-0.csv", "a,b,y", ["1,2,3", f'4,"{cell}",6', "7,8,9"])
    with pytest.raises(DataError) as err:
        read_numeric_csv(f)
    msg = str(err.value)
    assert f"{f}:3: column 'b' has {cell!r}" in msg, msg
    if cell.lstrip("+-").lower() in ("nan", "inf", "infinity"):
        assert "NaN and infinite values are not allowed" in msg
    with pytest.raises(DataError, match=r"device-0\.csv:3: column 'b'"):       # the p2p path: same reader
        from graphfl.p2p.oracles import load_device as p2p_load_device

        p2p_load_device(tmp_path, 0, features=("a", "b"))


def test_python_float_accepts_what_the_reader_refuses():
    assert float("1_0") == 10.0 and float(" nan ") != float(" nan ") and float("１") == 1.0   # why a grammar is needed


def test_plain_decimal_numbers_and_spaces_around_them_are_read(tmp_path):
    f = write_rows(tmp_path / "d.csv", "a,b,y", [" 1.5 ,+2,-0", ".5,5.,1E3", "\t-3e-2,007,1e200"])
    header, values = read_numeric_csv(f)
    assert header == ("a", "b", "y")
    np.testing.assert_array_equal(values, [[1.5, 2, 0], [0.5, 5, 1000], [-0.03, 7, 1e200]])


# -- 9a: checkpoints ---------------------------------------------------------------------------

SMALL = {"task": "synthetic-multicenter", "nodes": 4, "train.local-steps": 2, "engine": "inprocess",
         "run-key": "unit", "strategy": "fedavg", "rounds": 2}


@pytest.fixture(scope="module")
def server_checkpoint(tmp_path_factory):
    from graphfl.server import checkpoint
    from graphfl.server.inprocess import run_federated_inprocess

    cfg = parse_run_config({**SMALL, "rounds": 1})
    _, core = run_federated_inprocess(cfg)
    d = tmp_path_factory.mktemp("ck")
    checkpoint.save(d, server_round=1, cfg=cfg, core=core, rng=random.Random(0), active=[0, 1, 2, 3], rows={},
                    extra={})
    return d


@pytest.mark.parametrize("key, value, expected", [
    ("round", "four", "an integer >= 0"),
    ("round", -3, "an integer >= 0"),
    ("round", 1.5, "an integer >= 0"),
    ("round", True, "an integer >= 0"),
    ("rounds", 0, "an integer >= 1"),
    ("active", [0, "x"], "a list of partition ids"),
    ("active", "0,1", "a list of partition ids"),
    ("pickle", "../../elsewhere.pkl", "'server-r0000001.pkl'"),
    ("sha256", "abc", "64 hexadecimal digits"),
    ("config", [1], "a table of run-config keys"),
    ("strategy", 3, "a string"),
    ("saved_at", "yesterday", "a finite number"),
    ("round", None, "an integer >= 0"),
])
def test_a_bad_server_checkpoint_field_names_file_key_and_value(server_checkpoint, tmp_path, key, value, expected):
    import shutil

    from graphfl.server import checkpoint

    d = tmp_path / "ck"
    shutil.copytree(server_checkpoint, d)
    meta = json.loads((d / "checkpoint.json").read_text())
    meta[key] = value
    (d / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(d, parse_run_config({**SMALL}))
    msg = str(err.value)
    assert str(d / "checkpoint.json") in msg and f"key {key!r} is {value!r}" in msg and expected in msg, msg
    del meta[key]
    (d / "checkpoint.json").write_text(json.dumps(meta))
    if key == "saved_at":
        checkpoint.read_meta(d)               # optional: absent is fine
    else:
        with pytest.raises(checkpoint.CheckpointError, match=f"key {key!r} is missing"):
            checkpoint.read_meta(d)


def test_graphfl_run_resume_with_a_bad_round_is_a_one_line_error(tmp_path):
    from graphfl.deploy.run import prepare, prepare_resume
    from graphfl.server.inprocess import run_federated_inprocess

    cfg, out = prepare(parse_run_config({**SMALL, "out-dir": str(tmp_path / "run")}))
    run_federated_inprocess(cfg, out_dir=out)
    meta_path = out / "checkpoint" / "checkpoint.json"
    meta = json.loads(meta_path.read_text())
    meta["round"] = "four"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"checkpoint\.json: key 'round' is 'four'; expected an integer >= 0"):
        prepare_resume(out, {"rounds": 4})


def _p2p_checkpoint(d: Path) -> Path:
    from graphfl.p2p import checkpoint
    from graphfl.p2p.algorithms.base import NodeState

    st = NodeState(t=6, theta=np.arange(3.0), rng=np.random.default_rng(1), loss=0.5)
    return checkpoint.save(d, 2, st, algorithm="gossip", params={"a": 1}, round_=3)


@pytest.mark.parametrize("key, value, expected", [
    ("round", "four", "an integer >= 0"),
    ("round", -3, "an integer >= 0"),
    ("round", 2.5, "an integer >= 0"),
    ("t", "6", "an integer >= 0"),
    ("loss", "low", "a finite number or null"),
    ("npz", "../../etc/x.npz", "'peer-2.ckpt-r0000003.npz'"),
    ("sha256", 5, "64 hexadecimal digits"),
    ("edges", [1, -1], "a list of peer ids"),
    ("arrays", "theta", "a list of array names"),
    ("rng", {"state": None}, "a table with 'oracle' and 'state'"),
    ("params", [], "a table"),
])
def test_a_bad_p2p_checkpoint_field_names_file_key_and_value(tmp_path, key, value, expected):
    from graphfl.p2p import checkpoint

    path = _p2p_checkpoint(tmp_path)
    assert checkpoint.load(tmp_path, 2).round == 3
    meta = json.loads(path.read_text())
    meta[key] = value
    path.write_text(json.dumps(meta))
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(tmp_path, 2)
    msg = str(err.value)
    assert str(path) in msg and f"key {key!r} is {value!r}" in msg and expected in msg, msg


def test_a_p2p_checkpoint_with_a_broken_rng_state_is_a_checkpoint_error(tmp_path):
    from graphfl.p2p import checkpoint

    path = _p2p_checkpoint(tmp_path)
    meta = json.loads(path.read_text())
    meta["rng"]["state"]["state"] = "garbage"
    path.write_text(json.dumps(meta))
    with pytest.raises(checkpoint.CheckpointError, match=r"key 'rng' holds an RNG state numpy refuses"):
        checkpoint.load(tmp_path, 2)
    meta["rng"] = {"oracle": None, "state": {"bit_generator": "NoSuchGenerator"}}
    path.write_text(json.dumps(meta))
    with pytest.raises(checkpoint.CheckpointError, match="unknown bit generator"):
        checkpoint.load(tmp_path, 2)


# -- 9c: non-finite results are not "done" -----------------------------------------------------

def huge_devices(root: Path, scale_y: dict[int, float], n: int = 2, rows: int = 12, scale_x: float = 1.0) -> Path:
    for d in range(n):
        rng = np.random.default_rng(d)
        x = rng.normal(size=(rows, 2)) * scale_x
        y = rng.normal(size=rows) * scale_y.get(d, 1.0)
        write_rows(root / f"device-{d}.csv", "a,b,y", [f"{a!r},{b!r},{v!r}" for (a, b), v in zip(x.tolist(), y.tolist())])
    return root


def test_p2p_inprocess_run_on_values_of_1e200_ends_diverged(tmp_path):
    from graphfl.deploy.p2p_inprocess import launch_inprocess

    root = huge_devices(tmp_path / "data", {0: 1e200, 1: 1e200}, scale_x=1e200)
    with np.errstate(over="ignore", invalid="ignore"):
        doc = launch_inprocess(None, None, {"algorithm": "dfl-sgd", "rounds": 3}, out=tmp_path / "o", data_dir=root)
    assert not doc["ok"]
    for peer in doc["peers"].values():
        assert peer["outcome"] == "diverged" and "test loss is inf" in peer["error"]
    saved = json.loads((tmp_path / "o" / "p2p.json").read_text())
    assert saved["ok"] is False and saved["methods"]["dfl-sgd"]["final"]["peers_done"] == 0


def test_features_of_1e200_are_standardised_not_zeroed(tmp_path):
    root = huge_devices(tmp_path / "data", {}, scale_x=1e200)
    dev, _, _ = load_device(root, 0)
    ref = load_tabular(huge_devices(tmp_path / "small", {}, scale_x=1.0))   # the same rows / 1e200
    np.testing.assert_allclose(dev.x_train, ref.devices[0].x_train, rtol=1e-9)
    assert np.all(np.isfinite(dev.scale)) and dev.scale.max() > 1e199


def test_flower_run_whose_final_test_loss_is_inf_ends_diverged(tmp_path):
    from graphfl.server.inprocess import run_federated_inprocess

    root = huge_devices(tmp_path / "data", {1: 1e30})      # fits float32, its square does not
    values = {"strategy": "fedavg", "task": "csv", "nodes": 2, "rounds": 2, "engine": "inprocess",
              "data-dir": str(root), "train.local-steps": 3}
    with np.errstate(over="ignore", invalid="ignore"):
        doc, _ = run_federated_inprocess(parse_run_config(values), out_dir=tmp_path / "out")
    assert doc["status"] == "diverged"
    assert "round 2: test_loss is infinite on client(s) ['0', '1']" in doc["error"]
    saved = json.loads((tmp_path / "out" / "run.json").read_text())
    assert saved["status"] == "diverged" and saved["error"] == doc["error"]
    # a finite run of the same shape still completes
    ok = huge_devices(tmp_path / "fine", {})
    doc, _ = run_federated_inprocess(parse_run_config({**values, "data-dir": str(ok)}))
    assert doc["status"] == "completed" and "error" not in doc


def test_flower_csv_refuses_values_beyond_float32(tmp_path):
    from graphfl.tasks import registry

    root = huge_devices(tmp_path / "data", {1: 1e200})
    with pytest.raises(DataError, match=r"device-1\.csv: column 'y' has the value -?[0-9.]+e\+(199|200), beyond the range of "
                                        r"float32"):
        registry.create("csv", data_dir=str(root)).client_data(1, 2)
    assert registry.create("csv", data_dir=str(root)).client_data(0, 2).num_train > 0


@pytest.mark.e2e
def test_p2p_peer_processes_on_values_of_1e200_end_diverged(tmp_path):
    from graphfl.deploy.p2p_launch import launch

    root = huge_devices(tmp_path / "data", {0: 1e200, 1: 1e200}, scale_x=1e200)
    result = launch(None, None, {"algorithm": "dfl-sgd", "rounds": 2}, out=tmp_path / "o", data_dir=root,
                    insecure=True, progress=False)
    assert not result["ok"]
    for peer in result["peers"].values():
        assert peer["outcome"] == "diverged" and "test loss is inf" in peer["error"], peer
        assert peer["exit_code"] == 1
    assert json.loads((tmp_path / "o" / "peer-0.status.json").read_text())["state"] == "diverged"


# -- 9d: the same host:port under two spellings ------------------------------------------------

def _network(tmp_path: Path, addresses: list[str]) -> Path:
    lines = ["[network]", 'name = "t"', ""]
    for i, a in enumerate(addresses):
        lines += ["[[peers]]", f"id = {i}", f'address = "{a}"', ""]
    lines += ["[[edges]]", "nodes = [0, 1]", ""]
    f = tmp_path / "net.toml"
    f.write_text("\n".join(lines))
    return f


@pytest.mark.parametrize("a, b", [
    ("localhost:50051", "127.0.0.1:50051"),
    ("127.0.0.1:50051", "127.0.0.1:050051"),
    ("[::ffff:127.0.0.1]:7000", "127.0.0.1:7000"),
    ("[::1]:7000", "[0:0:0:0:0:0:0:1]:7000"),
    ("LOCALHOST.:7000", "localhost:7000"),
])
def test_two_peers_on_one_host_and_port_are_refused_naming_both(tmp_path, a, b):
    from graphfl.p2p.topology import load_topology

    with pytest.raises(ConfigError) as err:
        load_topology(_network(tmp_path, [a, b, "127.0.0.1:9"]))
    msg = str(err.value)
    assert f"peers 0 ({a}) and 1 ({b}) are the same host:port" in msg, msg


@pytest.mark.parametrize("a, b", [("127.0.0.1:50051", "127.0.0.2:50051"), ("localhost:50051", "localhost:50052"),
                                  ("10.0.0.1:50051", "10.0.0.2:50051")])
def test_distinct_endpoints_pass(tmp_path, a, b):
    from graphfl.p2p.topology import load_topology

    assert load_topology(_network(tmp_path, [a, b, "127.0.0.1:9"])).n == 3


def test_name_resolution_is_bounded_and_an_unresolved_name_is_compared_by_text(monkeypatch):
    import socket
    import threading
    import time

    from graphfl.p2p import addresses

    release = threading.Event()

    def hang(*args, **kwargs):
        release.wait(30)
        raise socket.gaierror("released")

    monkeypatch.setattr(addresses.socket, "getaddrinfo", hang)
    monkeypatch.setattr(addresses, "_RESOLVED", {})
    t0 = time.monotonic()
    try:
        with pytest.raises(addresses.AddressClash, match=r"peers 0 \(slow\.example:1\) and 2 \(SLOW\.example:1\)"):
            addresses.check_distinct([(0, "slow.example:1"), (1, "other.example:1"), (2, "SLOW.example:1")],
                                     budget_s=0.3)
        assert time.monotonic() - t0 < 3.0
    finally:
        release.set()
    with pytest.raises(ValueError, match=r"peer 1: address must be HOST:PORT with a port in 0\.\.65535"):
        addresses.check_distinct([(0, "a:1"), (1, "a:70000")])
