"""p2p-throughput's ring measure on both data paths: real peer processes on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

from graphfl.bench.p2p_throughput import measure_ring

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("data_path", ["grpc", "socket"])
def test_measure_ring_runs_the_asked_data_path(tmp_path, data_path):
    rounds = 8
    res = measure_ring(tmp_path, 20_000, 3, rounds, insecure=True, timeout=120, data_path=data_path)
    assert res["ok"], res
    assert res["data_path"] == data_path
    assert len(res["round_s"]) == rounds and res["median_round_s"] > 0
    assert 1.0 < res["wire_over_payload"] < 1.01  # the same protobuf frames either way: bytes counted alike
    peer = json.loads((tmp_path / "peer-0.json").read_text())
    assert peer["config"]["run"]["data_path"] == data_path
    log = (tmp_path / "logs" / "peer-0.log").read_text()
    assert ("socket data path listening" in log) == (data_path == "socket")
