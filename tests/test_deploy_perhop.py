"""``graphfl bench deploy-perhop``: the per-hop split of a Flower round, on traces and on a real deployment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graphfl.bench.deploy_perhop import HOPS, hop_split, load_trace


def _procs() -> dict[int, dict[str, object]]:
    return {1: {"role": "serverapp"}, 2: {"role": "superlink"}, 3: {"role": "supernode"}, 4: {"role": "supernode"},
            5: {"role": "worker"}, 6: {"role": "worker"}}


def _c(pid: int, name: str, t0: float, t1: float) -> dict[str, object]:
    return {"kind": "rpc_c", "pid": pid, "name": name, "t0": t0, "t1": t1, "excl": t1 - t0}


def test_hops_are_the_last_message_at_each_stage_and_sum_to_the_window() -> None:
    ev = [_c(1, "/flwr.proto.ServerAppIo/PushObject", 0.1, 1.0),
          _c(3, "/flwr.proto.Fleet/PullObject", 1.2, 1.5), _c(4, "/flwr.proto.Fleet/PullObject", 1.3, 2.0),
          _c(5, "/flwr.proto.ClientAppIo/PullObject", 2.1, 2.5), _c(6, "/flwr.proto.ClientAppIo/PullMessage", 2.2, 2.3),
          _c(5, "/flwr.proto.ClientAppIo/PushObject", 4.0, 4.5), _c(6, "/flwr.proto.ClientAppIo/PushObject", 3.0, 3.2),
          _c(6, "/flwr.proto.ClientAppIo/PullObject", 3.3, 3.4),  # after worker 6 replied: not its input
          _c(3, "/flwr.proto.Fleet/PushObject", 4.6, 5.0), _c(4, "/flwr.proto.Fleet/PushMessages", 3.5, 3.6),
          _c(1, "/flwr.proto.ServerAppIo/PullMessages", 5.1, 5.2), _c(1, "/flwr.proto.ServerAppIo/PullObject", 5.2, 5.8),
          _c(1, "/flwr.proto.ServerAppIo/PullObject", 9.0, 9.5)]  # outside the window: another round
    out = hop_split(_procs(), ev, 0.0, 6.0)
    want = [1.0, 1.0, 0.5, 1.5, 0.5, 0.5, 0.8, 0.2]
    assert out["missing"] == []
    assert [out["hops"][h] for h in HOPS] == pytest.approx(want)
    assert sum(out["hops"].values()) == pytest.approx(6.0)


def test_a_hop_the_trace_did_not_see_is_named_and_counts_zero() -> None:
    ev = [_c(1, "/flwr.proto.ServerAppIo/PushObject", 0.0, 1.0), _c(1, "/flwr.proto.ServerAppIo/PullObject", 2.0, 3.0)]
    out = hop_split(_procs(), ev, 0.0, 4.0)
    assert out["missing"] == ["superlink_to_supernode", "supernode_to_worker", "worker_compute",
                              "worker_to_supernode", "supernode_to_superlink"]
    assert out["hops"]["superlink_to_serverapp"] == pytest.approx(2.0)
    assert sum(out["hops"].values()) == pytest.approx(4.0)


def test_load_trace_skips_a_cut_last_line(tmp_path: Path) -> None:
    (tmp_path / "trace-7.jsonl").write_text(
        json.dumps({"kind": "proc", "pid": 7, "role": "superlink"}) + "\n"
        + json.dumps({"kind": "act", "pid": 7, "name": "hash_sha256", "t0": 0, "t1": 1, "excl": 1}) + "\n"
        + '{"kind": "act", "pid": 7, "na')
    procs, events = load_trace(tmp_path)
    assert procs[7]["role"] == "superlink" and len(events) == 1


@pytest.mark.e2e
def test_quick_profile_of_a_real_deployment_sums_to_the_round(tmp_path: Path) -> None:
    """10k parameters x 2 nodes, TLS, warm workers: every hop is seen, the hops sum to the recorder's round."""
    from graphfl.bench.deploy_perhop import run

    doc = run(True, 0, tmp_path)
    assert (tmp_path / "deploy_perhop.json").is_file()
    md = (tmp_path / "deploy_perhop.md").read_text()
    assert "| serverapp_push |" in md and "Flower / p2p" in md
    (case,) = doc["cases"]
    (rep,) = case["repeats"]
    fl = rep["flower"]
    assert fl["ok"], fl.get("error")
    assert rep["ring"]["ok"] and rep["ring"]["median_round_s"] > 0
    assert fl["hook_errors"] == []
    assert {"serverapp", "superlink", "supernode", "worker"} <= set(fl["roles"])
    assert [r["round"] for r in fl["rounds"]] == [1, 2, 3]
    for r in fl["rounds"]:
        assert r["missing"] == [], r
        assert all(v >= 0 for v in r["hops"].values())
        total = sum(r["hops"].values())
        # the recorder's round also holds client sampling and the round's bookkeeping around run_phase
        assert total == pytest.approx(r["recorder_round_s"], rel=0.15, abs=0.05), r
        assert r["activities"]["superlink"]["object_store_put"] > 0
        assert r["activities"]["serverapp"]["hash_sha256"] > 0
        assert r["rpc"]["supernode"]["call PullObject"]["count"] >= 1
    mem = fl["memory"]
    assert mem["superlink"]["peak_mb"] > 20 and mem["worker"]["peak_mb"] > mem["supernode"]["peak_mb"] * 0.5
    (s,) = doc["summary"]
    assert s["flower_over_p2p"]["median"] > 0


@pytest.mark.e2e
def test_an_exported_chunk_size_reaches_the_workers_and_the_run_is_the_in_process_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/deployment.md "Chunk size": FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE exported before a deployment.

    1.2M parameters (4.8 MB packed, above graphfl's 4 MiB inline limit, so the payload travels as a
    Flower Array) at 256 KiB chunks: every reply is pushed as at least 19 chunk objects (Flower's
    5 MiB default would make one), and the trained model is the in-process run's.
    """
    from math import ceil

    from graphfl.bench.deploy_perhop import profile_flower
    from graphfl.common.config import parse_run_config
    from graphfl.common.records import INLINE_MAX_BYTES
    from graphfl.server.inprocess import run_federated_inprocess

    d, n, chunk = 1_200_000, 2, 256 * 1024
    assert 4 * d > INLINE_MAX_BYTES
    monkeypatch.setenv("FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE", str(chunk))
    fl = profile_flower(tmp_path, d, n, rounds=1, timeout=300)
    assert fl["ok"], fl.get("error")
    (r,) = fl["rounds"]
    assert r["rpc"]["worker"]["call PushObject"]["count"] >= n * ceil(4 * d / chunk)
    got = json.loads((tmp_path / "run" / "run.json").read_text())["methods"]["fedavg"]["curve"]
    ref, _ = run_federated_inprocess(parse_run_config({
        "strategy": "fedavg", "task": "synthetic-vector", "data": {"dim": d}, "nodes": n, "rounds": 1, "seed": 0,
        "engine": "inprocess", "train": {"local-steps": 1, "batch-size": 2}}))
    want = ref["methods"]["fedavg"]["curve"]
    assert [c["round"] for c in got] == [c["round"] for c in want]
    for g, w in zip(got, want):
        assert g["test_loss"] == pytest.approx(w["test_loss"], rel=1e-5)
