"""``graphfl bench network``: the netem probe, the summary figures, and a small real run through the proxies.

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
    assert method["method"] == "user-space"
    if not probe["root"]:
        # no rights for namespaces here: the probe says so, and the benchmark still runs (user-space emulator)
        assert "not root" in probe["detail"]
        assert "not available" in method["why"]
        return
    if probe["netns"]:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
        assert f"graphfl-netem-probe-{os.getpid()}" not in listed  # the throwaway namespace is gone
    assert ("netem is available" in method["why"]) == probe["netem"]


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


@pytest.mark.e2e
def test_small_network_bench_runs_through_the_proxies(tmp_path: Path) -> None:
    profile = LinkProfile("ci-wan", delay_ms=10.0, jitter_ms=2.0, rate_mbit=50.0)
    network.PROFILES["ci-wan"] = profile
    try:
        plan = network.Plan(profiles=("ci-wan",), flower_rounds=1, p2p_rounds=3, seeds=(0,), strategies=("fedavg",),
                            nodes=3)
        doc = network.run(out=tmp_path, plan=plan)
    finally:
        del network.PROFILES["ci-wan"]
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
    from graphfl.p2p.launcher import prepare_network
    from graphfl.p2p.peer import EXIT_CONFIG, run_peer

    net = prepare_network(tmp_path, "ring", 3, {"problem": "linreg", "rounds": 1}, insecure=True)
    assert run_peer(net, 0, tmp_path, listen="no-port") == EXIT_CONFIG
    assert "--listen must be HOST:PORT" in json.loads((tmp_path / "peer-0.json").read_text())["error"]
