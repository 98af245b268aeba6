"""Per-node checkpoints: exact round trip of everything in a NodeState and the RNGs, atomic, verified."""

from __future__ import annotations

import json

import numpy as np
import pytest

from graphfl.p2p import checkpoint
from graphfl.p2p.algorithms import NodeState
from graphfl.p2p.algorithms.dfl_gt import DFLGTParams
from graphfl.p2p.algorithms.dfl_sgd import DFLSGDParams
from graphfl.p2p.checkpoint import CheckpointError
from graphfl.p2p.oracles import ProblemSpec, make_oracle


def full_state(rng_seed=5):
    r = np.random.default_rng(0)
    return NodeState(
        t=12, theta=r.normal(size=4).astype(np.float32), tracker=r.normal(size=4).astype(np.float32),
        aux={"g_prev": r.normal(size=4), "count": np.arange(3, dtype=np.int64)},
        edges={3: {"beta": r.normal(size=4), "alpha": r.normal(size=4)}, 1: {"beta": r.normal(size=4)}},
        loss=0.25, rng=np.random.default_rng(rng_seed),
    )


def test_round_trip_is_exact_including_rngs(tmp_path):
    st = full_state()
    st.rng.normal(size=7)  # advance it: the saved state is not the seed's
    oracle = make_oracle(2, ProblemSpec("linreg", num_nodes=4, dim=4))
    oracle.sample()
    checkpoint.save(tmp_path, 2, st, algorithm="dfl-gt", params=DFLGTParams(tau=2), round_=6, oracle=oracle,
                    extra={"config_hash": "abc"})
    expected_batch, expected_draw = oracle.sample(), st.rng.normal(size=3)  # what comes next
    ck = checkpoint.load(tmp_path, 2)
    assert (ck.node, ck.round, ck.algorithm, ck.extra) == (2, 6, "dfl-gt", {"config_hash": "abc"})
    got = ck.state
    assert got.t == 12 and got.loss == 0.25
    np.testing.assert_array_equal(got.theta, st.theta)
    assert got.theta.dtype == np.float32 and got.aux["count"].dtype == np.int64
    np.testing.assert_array_equal(got.tracker, st.tracker)
    assert sorted(got.aux) == ["count", "g_prev"] and sorted(got.edges) == [1, 3]
    np.testing.assert_array_equal(got.edges[3]["alpha"], st.edges[3]["alpha"])
    np.testing.assert_array_equal(got.rng.normal(size=3), expected_draw)
    fresh = make_oracle(2, ProblemSpec("linreg", num_nodes=4, dim=4))
    ck.restore_oracle_rng(fresh)
    np.testing.assert_array_equal(fresh.sample(), expected_batch)
    ck.check("dfl-gt", DFLGTParams(tau=2))
    with pytest.raises(CheckpointError, match="algorithm 'dfl-gt', this run is 'dfl-sgd'"):
        ck.check("dfl-sgd", DFLSGDParams())
    with pytest.raises(CheckpointError, match="tau: 2 != 3"):
        ck.check("dfl-gt", DFLGTParams(tau=3))


def test_nan_loss_no_tracker_no_rng(tmp_path):
    st = NodeState(t=0, theta=np.zeros(2))
    checkpoint.save(tmp_path, 0, st, algorithm="gossip", params={"tau": 1}, round_=0)
    got = checkpoint.load(tmp_path, 0).state
    assert np.isnan(got.loss) and got.tracker is None and got.rng is None and got.edges == {} and got.aux == {}


def test_only_the_latest_npz_is_kept_and_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    st = full_state()
    for r in (1, 2):
        checkpoint.save(tmp_path, 4, NodeState(t=r, theta=st.theta), algorithm="gossip", params={}, round_=r)
    assert sorted(p.name for p in tmp_path.glob("peer-4.ckpt-r*.npz")) == ["peer-4.ckpt-r0000002.npz"]

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "savez", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path, 4, NodeState(t=3, theta=st.theta), algorithm="gossip", params={}, round_=3)
    assert checkpoint.load(tmp_path, 4).state.t == 2  # the previous one, intact
    assert not list(tmp_path.glob(".peer-4*"))  # no temporary files left


def test_missing_corrupt_or_foreign_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint for peer 0"):
        checkpoint.load(tmp_path, 0)
    path = checkpoint.save(tmp_path, 0, full_state(), algorithm="dfl-gt", params=DFLGTParams(), round_=1)
    npz = next(tmp_path.glob("peer-0.ckpt-r*.npz"))
    data = bytearray(npz.read_bytes())
    data[-10] ^= 0xFF
    npz.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match the checksum"):
        checkpoint.load(tmp_path, 0)
    meta = json.loads(path.read_text())
    (tmp_path / "peer-1.ckpt.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="of peer 0, not of peer 1"):
        checkpoint.load(tmp_path, 1)
    with pytest.raises(CheckpointError, match="dtype object"):
        checkpoint.save(tmp_path, 5, NodeState(t=0, theta=np.array([object()])), algorithm="x", params={}, round_=0)
