"""Network file parsing ([run], [tls]), config hashes, and the peer/p2p commands' error paths."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from graphfl.common.config import ConfigError
from graphfl.deploy.p2p_cli import register
from graphfl.p2p.algorithms.dfl_gt import DFLGTParams
from graphfl.p2p.algorithms.dfl_sgd import DFLSGDParams
from graphfl.p2p.algorithms.gossip import GossipParams
from graphfl.p2p.config import P2PConfig, TlsSection, load_network_file, parse_p2p_config, write_network_file
from graphfl.p2p.topology import make_topology


def write(tmp_path, run=None, tls=None):
    return write_network_file(tmp_path / "net.toml", make_topology("ring", 3), run or P2PConfig(),
                              tls or TlsSection(ca="c/ca.crt", cert="c/peer-{id}.crt", key="c/peer-{id}.key"))


def test_roundtrip_overrides_and_tls_paths(tmp_path):
    f = write(tmp_path, P2PConfig(algorithm="dfl-gt", params=DFLGTParams(tau=5, same_batch_difference=True)))
    assert "same-batch-difference = true" in f.read_text() and "params" not in f.read_text()
    net = load_network_file(f, {"rounds": 7, "round_timeout": 2})
    assert net.run == P2PConfig(algorithm="dfl-gt", params=DFLGTParams(tau=5, same_batch_difference=True), rounds=7,
                                round_timeout=2.0)
    assert net.run.iterations == 35
    files = net.tls_files(2)
    assert files.cert == tmp_path / "c" / "peer-2.crt" and files.ca == tmp_path / "c" / "ca.crt"
    with pytest.raises(ConfigError, match="not found"):
        files.read()


def test_hash_tracks_every_setting():
    base = P2PConfig()
    assert base.params == DFLGTParams()
    assert base.hash() == P2PConfig().hash()
    assert base.hash() != P2PConfig(params=DFLGTParams(alpha0=0.4)).hash()
    assert base.hash() != P2PConfig(params=DFLGTParams(init_tracker="zero")).hash()
    assert base.hash() != P2PConfig(round_timeout=3.0).hash()


def test_algorithm_keys_come_from_the_registry():
    cfg = parse_p2p_config({"algorithm": "dfl-sgd", "tau": 3, "alpha0": 0.2})
    assert cfg.params == DFLSGDParams(tau=3, alpha0=0.2) and cfg.iterations == 300
    assert parse_p2p_config({"rounds": 5}, base=cfg).params == cfg.params  # kept on top of a base
    assert parse_p2p_config({"algorithm": "gossip"}, base=cfg).params == GossipParams()  # dropped: other algorithm
    with pytest.raises(ConfigError, match=r"'init-tracker' is a key of \['dfl-gt'\]"):
        parse_p2p_config({"algorithm": "dfl-sgd", "init-tracker": "zero"})
    with pytest.raises(ConfigError, match="gossip's \\['tau'\\]"):
        parse_p2p_config({"algorithm": "gossip", "alpha0": 0.1})
    with pytest.raises(ConfigError, match="init-tracker"):
        parse_p2p_config({"init-tracker": "random"})
    with pytest.raises(ConfigError, match="must be DFLGTParams"):
        P2PConfig(params=GossipParams())


def test_bad_run_values_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="tau"):
        parse_p2p_config({"tau": 0})
    with pytest.raises(ConfigError, match="dfl-gt"):
        parse_p2p_config({"algorithm": "no-such-algorithm"})
    with pytest.raises(ConfigError, match="unknown key"):
        parse_p2p_config({"learning-rate": 0.1})
    with pytest.raises(ConfigError, match="chunk-bytes"):
        parse_p2p_config({"chunk-bytes": 128 << 20})  # above the 64 MiB a peer accepts per frame
    assert parse_p2p_config({"chunk-bytes": 8 << 20}).chunk_bytes == 8 << 20  # peers raise gRPC's 4 MB limit
    f = write(tmp_path)
    f.write_text(f.read_text() + "\n[extra]\nx = 1\n")
    with pytest.raises(ConfigError, match="extra"):
        load_network_file(f)


def test_data_path_and_data_port(tmp_path):
    assert P2PConfig().data_path == "grpc" and parse_p2p_config({"data-path": "socket"}).data_path == "socket"
    assert P2PConfig().hash() != P2PConfig(data_path="socket").hash()  # peers on different paths do not talk
    with pytest.raises(ConfigError, match=r"data-path.*\['grpc', 'socket'\]"):
        parse_p2p_config({"data-path": "udp"})
    f = write(tmp_path)
    before = load_network_file(f).topology
    f.write_text(f.read_text().replace('partition = 1, device = "auto" }',
                                       'partition = 1, device = "auto", data-port = 50100 }', 1))
    net = load_network_file(f)
    assert [p.data_port for p in net.topology.peers] == [0, 50100, 0]
    assert net.topology.fingerprint == before.fingerprint  # announced in the handshake, like device and data
    assert "data-port = 50100" in net.topology.to_toml()
    for bad in ("70000", "-1", '"50100"', "true"):
        f.write_text(f.read_text().replace("data-port = 50100", f"data-port = {bad}"))
        with pytest.raises(ConfigError, match="peer 1: data-port must be an integer in 0..65535"):
            load_network_file(f)
        f.write_text(f.read_text().replace(f"data-port = {bad}", "data-port = 50100"))


def test_plaintext_must_be_explicit(tmp_path):
    f = write(tmp_path, tls=TlsSection())
    with pytest.raises(ConfigError, match="insecure = true"):
        load_network_file(f).tls_files(0)
    f = write(tmp_path, tls=TlsSection(insecure=True))
    assert load_network_file(f).tls_files(0) is None


def test_commands_are_registered_and_fail_clearly(tmp_path):
    app = typer.Typer()
    register(app)
    runner = CliRunner()
    res = runner.invoke(app, ["p2p", "--help"])
    assert res.exit_code == 0 and "--algorithm" in res.output
    res = runner.invoke(app, ["peer", "--topology", str(tmp_path / "missing.toml"), "--id", "0", "--out", str(tmp_path)])
    assert res.exit_code == 2
    assert "not found" in (tmp_path / "peer-0.json").read_text()
    res = runner.invoke(app, ["p2p", "--topology", "moebius", "--peers", "3", "--out", str(tmp_path / "o"), "--quiet"])
    assert res.exit_code == 2 and "unknown topology" in res.output


def test_launcher_device_is_written_for_every_peer_and_a_bad_one_is_refused(tmp_path):
    from graphfl.deploy.p2p_launch import prepare_network
    from graphfl.p2p.config import load_network_file

    path = prepare_network(tmp_path / "a", "ring", 3, {"problem": "linreg"}, insecure=True, device="cuda:1",
                           reserve_ports=False)
    assert [p.device for p in load_network_file(path).topology.peers] == ["cuda:1"] * 3
    with pytest.raises(ConfigError, match="cuda:N"):
        prepare_network(tmp_path / "b", "ring", 3, {"problem": "linreg"}, insecure=True, device="gpu",
                        reserve_ports=False)
