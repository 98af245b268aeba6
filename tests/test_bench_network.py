"""``graphfl bench network``: the netem probe, the emulation choice, the summary figures, a small real
run through the proxies and, as root, one through network namespaces.

The e2e test runs one link profile with real ``flower-superlink`` / ``flower-supernode`` processes
and real gRPC peers, every SuperNode and every peer connection crossing a
:class:`~graphfl.bench.linkemu.LinkProxy`; it checks that rounds completed and that their bytes went
through the proxies. Without root (no network namespaces) the probe records why and the rest
still runs: the benchmark never needs root, only the netem probe does.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from graphfl.bench import network
from graphfl.bench.linkemu import LinkProfile


def test_netem_probe_reports_and_cleans_up() -> None:
    probe = network.detect_netem()
    assert set(probe) == {"root", "netns", "netem", "detail"}
    assert probe["detail"]
    method = network.emulation_method(probe)
    assert method["method"] == ("netns-netem" if probe["netem"] else "user-space")
    if not probe["root"]:
        # no rights for namespaces here: the probe says so, and the benchmark still runs (user-space emulator)
        assert "not root" in probe["detail"]
        assert "not available" in method["why"]
        return
    if probe["netns"]:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
        assert f"graphfl-netem-probe-{os.getpid()}" not in listed  # the throwaway namespace is gone
    assert ("netem not available" in method["why"]) == (not probe["netem"])


def test_time_to_target_and_summary() -> None:
    assert network.time_to_target([1.0, 2.0, 3.0], [3.0, 2.0, 1.0], 2.0) == 3.0
    assert network.time_to_target([1.0, 2.0], [3.0, 2.5], 2.0) is None
    assert network.time_to_target([1.0], [1.0], None) is None
    link = {"bytes_up": 1e6, "bytes_down": 1e6, "resets": 1.0, "stalls": 2.0}
    base = {"runtime": "p2p", "strategy": "dfl-gt", "seed": 0, "payload_bytes": 10**6, "failed_rounds": 0,
            "missing_replies": 0, "rounds_completed": 3, "final_acc": None, "error": None, "link": link}
    runs = [{**base, "profile": "lan", "rounds": [0.1, 0.1, 0.1], "losses": [2.0, 1.5, 1.0], "final_loss": 1.0},
            {**base, "profile": "wan", "rounds": [0.5, 0.5, 0.5], "losses": [2.0, 1.04, 1.0], "final_loss": 1.0,
             "failed_rounds": 1}]
    rows = {r["profile"]: r for r in network.summarize(runs)}
    assert rows["lan"]["time_to_target_s"] == pytest.approx(0.3)
    assert rows["wan"]["time_to_target_s"] == pytest.approx(1.0)  # 1.04 <= 1.05 x lan's final loss
    assert rows["wan"]["s_per_round"] == pytest.approx(0.5)
    assert rows["wan"]["wire_MB"] == pytest.approx(2.0)
    assert rows["wan"]["failed_rounds"] == 1 and rows["wan"]["link_stalls"] == 2


def _small_run(out: Path, profile: LinkProfile, emulation: str) -> dict:
    """The bench on one extra profile: 3 nodes, one Flower FedAvg round, 3 p2p rounds."""
    network.PROFILES[profile.name] = profile
    try:
        plan = network.Plan(profiles=(profile.name,), flower_rounds=1, p2p_rounds=3, seeds=(0,),
                            strategies=("fedavg",), nodes=3)
        return network.run(out=out, plan=plan, emulation=emulation)
    finally:
        del network.PROFILES[profile.name]


@pytest.mark.e2e
def test_small_network_bench_runs_through_the_proxies(tmp_path: Path) -> None:
    doc = _small_run(tmp_path, LinkProfile("ci-wan", delay_ms=10.0, jitter_ms=2.0, rate_mbit=50.0), "user-space")
    for suffix in ("json", "md", "png"):
        assert (tmp_path / f"network.{suffix}").is_file()
    saved = json.loads((tmp_path / "network.json").read_text())
    assert saved["emulation"]["method"] == "user-space" and saved["emulation"]["why"]
    by_runtime = {r["runtime"]: r for r in doc["runs"]}
    flower, p2p = by_runtime["flower"], by_runtime["p2p"]
    assert flower["error"] is None and flower["rounds_completed"] == 1 and flower["failed_rounds"] == 0
    assert p2p["error"] is None and p2p["rounds_completed"] == 3 and p2p["peers_done"] == 3
    for res in (flower, p2p):
        assert res["link"]["connections"] >= 1
        # the model bytes crossed the emulated links (the wire carries at least the payload)
        assert res["link"]["bytes_up"] + res["link"]["bytes_down"] >= res["payload_bytes"] > 0
    assert "ci-wan" in (tmp_path / "network.md").read_text()


def test_peer_listen_must_be_host_port(tmp_path: Path) -> None:
    from graphfl.deploy.p2p_launch import prepare_network
    from graphfl.p2p.peer import EXIT_CONFIG, run_peer

    net = prepare_network(tmp_path, "ring", 3, {"problem": "linreg", "rounds": 1}, insecure=True)
    assert run_peer(net, 0, tmp_path, listen="no-port") == EXIT_CONFIG
    assert "--listen must be HOST:PORT" in json.loads((tmp_path / "peer-0.json").read_text())["error"]


# ------------------------------------------------------------------------------------------
# the kernel path (network namespaces)
# ------------------------------------------------------------------------------------------
PROBE_NETEM = {"root": True, "netns": True, "netem": True, "detail": "netem qdisc accepted"}
PROBE_NO_NETEM = {"root": True, "netns": True, "netem": False, "detail": "`tc qdisc add ... netem` failed: x"}
PROBE_NOT_ROOT = {"root": False, "netns": False, "netem": False, "detail": "not root: ..."}


def test_emulation_choice_follows_the_kernel_and_the_request() -> None:
    from graphfl.common.config import ConfigError

    wan, lossy = network.PROFILES["wan"], network.PROFILES["edge-lossy"]
    rate_only = LinkProfile("rate", rate_mbit=10.0)
    assert network.emulation_method(PROBE_NETEM, "auto", [wan])["method"] == "netns-netem"
    assert network.emulation_method(PROBE_NO_NETEM, "auto", [wan])["method"] == "user-space"
    assert network.emulation_method(PROBE_NETEM, "user-space", [wan])["method"] == "user-space"
    assert network.emulation_method(PROBE_NO_NETEM, "netns", [rate_only])["method"] == "netns-tbf"
    # stalls and resets are the user-space emulator's notions: the kernel path lists them as not emulated
    chosen = network.emulation_method(PROBE_NETEM, "auto", [wan, lossy, network.PROFILES["wan-resets"]])
    assert chosen["not_emulated"] == {"edge-lossy": ["stall_per_s"], "wan-resets": ["reset_per_s"]}
    assert network.emulation_method(PROBE_NO_NETEM, "auto", [lossy])["not_emulated"] == {}
    with pytest.raises(ConfigError, match=r"wan.*delay_ms.*need netem"):
        network.emulation_method(PROBE_NO_NETEM, "netns", [rate_only, wan])
    with pytest.raises(ConfigError, match="namespaces cannot be made here"):
        network.emulation_method(PROBE_NOT_ROOT, "netns", [rate_only])
    with pytest.raises(ConfigError, match="auto, user-space, netns"):
        network.emulation_method(PROBE_NETEM, "kernel", [wan])


def test_qdisc_commands_for_netem_and_tbf() -> None:
    from graphfl.bench import netns

    lossy = network.PROFILES["edge-lossy"]
    assert netns.qdisc_argv("v0", lossy, netem=True) == [
        "tc", "qdisc", "replace", "dev", "v0", "root", "netem", "delay", "100ms", "30ms", "loss", "1%",
        "rate", "5mbit", "limit", str(netns.NETEM_LIMIT_PACKETS)]
    assert netns.qdisc_argv("v0", LinkProfile("d", delay_ms=2.5), netem=True)[6:10] == ["netem", "delay", "2.5ms",
                                                                                          "limit"]
    tbf = netns.qdisc_argv("v1", LinkProfile("r", rate_mbit=20.0), netem=False)
    assert tbf is not None and tbf[6:9] == ["tbf", "rate", "20mbit"]
    assert int(tbf[tbf.index("burst") + 1]) >= 64 * 1024  # above a veth GSO packet, which tbf would drop
    assert netns.qdisc_argv("v1", LinkProfile("free"), netem=False) is None
    with pytest.raises(netns.LabError, match=r"'edge-lossy'.*delay_ms.*jitter_ms.*loss_pct"):
        netns.qdisc_argv("v1", lossy, netem=False)
    with pytest.raises(ValueError, match="loss_pct"):
        LinkProfile("bad", loss_pct=101.0)


def _lab_or_skip() -> None:
    from graphfl.bench.netns import lab_available

    why = lab_available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    probe = network.detect_netem()  # root in a container may still lack the rights: try one
    if not probe["netns"]:
        pytest.skip(f"network namespaces unavailable: {probe['detail']}")


def test_a_lab_shapes_the_link_between_two_namespaces_and_removes_everything(tmp_path: Path) -> None:
    import sys
    import time

    from graphfl.bench.netns import NetnsLab

    _lab_or_skip()
    size = 2_000_000
    with NetnsLab(2, LinkProfile("rate-20", rate_mbit=20.0), netem=False) as lab:
        names = (lab.namespace(0), lab.namespace(1), lab.root_dev(0), f"{lab.tag}br")
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
        assert lab.namespace(0) in listed and lab.namespace(1) in listed
        server = subprocess.Popen(
            [*lab.prefix(1), sys.executable, "-c",
             "import socket,sys\n"
             f"s=socket.create_server(('{lab.address(1)}', 5601)); print('up', flush=True); c,_=s.accept(); n=0\n"
             "while True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\n"
             "print(n, flush=True)"],
            stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        before = lab.counters()
        t0 = time.monotonic()
        subprocess.run([*lab.prefix(0), sys.executable, "-c",
                        f"import socket; c=socket.create_connection(('{lab.address(1)}', 5601), timeout=20); "
                        f"c.sendall(bytes({size})); c.close()"], check=True, timeout=60)
        received = int(server.communicate(timeout=60)[0].strip())
        seconds = time.monotonic() - t0
        after = lab.counters()
    assert received == size
    # a token bucket never lets 2 MB through 20 Mbit/s links faster than 0.8 s (minus its 256 kB burst)
    assert seconds >= (size - 2 * 256 * 1024) * 8 / 20e6
    assert after["bytes_up"] - before["bytes_up"] >= size and after["bytes_down"] - before["bytes_down"] >= size
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert names[0] not in listed and names[1] not in listed
    assert not Path("/sys/class/net", names[2]).exists() and not Path("/sys/class/net", names[3]).exists()


@pytest.mark.e2e
def test_small_network_bench_runs_through_network_namespaces(tmp_path: Path) -> None:
    _lab_or_skip()
    doc = _small_run(tmp_path, LinkProfile("ci-rate", rate_mbit=100.0), "netns")
    assert doc["emulation"]["method"] in ("netns-tbf", "netns-netem")
    assert doc["emulation"]["method"] in (tmp_path / "network.md").read_text()
    by_runtime = {r["runtime"]: r for r in doc["runs"]}
    flower, p2p = by_runtime["flower"], by_runtime["p2p"]
    assert flower["error"] is None and flower["rounds_completed"] == 1 and flower["failed_rounds"] == 0
    assert p2p["error"] is None and p2p["rounds_completed"] == 3 and p2p["peers_done"] == 3
    for res in (flower, p2p):  # the model bytes crossed the namespaces' links
        assert res["link"]["bytes_up"] + res["link"]["bytes_down"] >= res["payload_bytes"] > 0
    network_toml = (tmp_path / "runs" / "p2p-ci-rate-s0" / "network.toml").read_text()
    assert "10." in network_toml and "127.0.0.1" not in network_toml  # the peers dialled each other's namespaces
