"""A hostile or broken neighbour cannot derail a peer (issue: reliability and security).

Each test reproduces a defect found by attacking real gRPC peers on 127.0.0.1:
one message fast-forwarding the network, a declared 2 GB tensor allocated before the sender
was checked, idle streams exhausting the receive pool.
"""

from __future__ import annotations

import resource
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from graphfl.p2p import codec
from graphfl.p2p.codec import Message
from graphfl.p2p.driver import skip_target
from graphfl.p2p.hostile import DIM, SPECS, TargetPeer, frames, huge_header, idle_frames
from graphfl.p2p.proto import graphfl_p2p_pb2 as pb
from graphfl.p2p.transport import Mailbox


def _msg(sender: int, round_: int, value: float = 1.0) -> Message:
    return Message(sender, round_, "params", {"theta": np.full(DIM, value, np.float32)}, {}, 64)


def test_only_accepted_messages_count_towards_skipping_ahead() -> None:
    box = Mailbox(0, [1, 2], horizon=4)
    box.expect("params", SPECS)
    box.max_round = 1000
    ok, why = box.put(_msg(1, 380))  # far beyond the horizon (the 44 -> 380 fast-forward)
    assert not ok and "ahead" in why
    ok, why = box.put(_msg(1, 5000))
    assert not ok and "beyond the run" in why
    assert box.latest_rounds() == {}
    box.advance(998)
    ok, why = box.put(_msg(1, 1000))  # inside the horizon but beyond the run: must not freeze skip-ahead
    assert not ok and "beyond the run" in why
    assert box.latest_rounds() == {}
    assert box.put(_msg(1, 999))[0]
    assert box.latest_rounds() == {1: 999}


def test_rounds_refused_beyond_the_horizon_witness_a_skip_of_at_most_the_horizon() -> None:
    """A node restarted far behind its neighbours sees them ahead, but one skip moves it <= horizon rounds."""
    box = Mailbox(0, [1, 2], horizon=4)
    box.expect("params", SPECS)
    box.max_round = 1000
    box.advance(26)
    assert not box.put(_msg(1, 31))[0] and not box.put(_msg(2, 35))[0]  # refused: more than 4 rounds ahead
    assert not box.put(_msg(2, 5000))[0]  # beyond the run: no evidence at all
    assert box.latest_rounds() == {}  # nothing was accepted or buffered
    assert box.witness_rounds(26) == {1: 30, 2: 30}  # clamped to t + horizon
    assert skip_target(box.witness_rounds(26), 26, num_neighbours=2) == 30
    box.advance(30)
    assert box.put(_msg(1, 31))[0] and box.put(_msg(2, 34))[0]  # now inside the horizon: accepted
    assert skip_target(box.witness_rounds(30), 30, num_neighbours=2) == 31


def test_skipping_ahead_needs_two_witnesses() -> None:
    assert skip_target({1: 40}, 10, num_neighbours=2) == -1  # one neighbour alone cannot move us
    assert skip_target({1: 40, 2: 30}, 10, num_neighbours=2) == 30  # slowest of those ahead
    assert skip_target({1: 40, 2: 5}, 10, num_neighbours=2) == -1  # neighbour 2 is behind: one witness
    assert skip_target({1: 12}, 10, num_neighbours=1) == 12  # a single neighbour: bounded by the horizon


def test_rejection_log_is_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    box = Mailbox(0, [1], horizon=4)
    box.expect("params", SPECS)
    with caplog.at_level("WARNING", logger="graphfl.p2p.transport"):
        for _ in range(500):
            box.put(_msg(7, 0))  # not a neighbour
    assert box.stats.snapshot()["messages_rejected"] == 500
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) <= 2


def test_header_is_parsed_without_allocating() -> None:
    frame = pb.Frame(sender=1, round=0, channel="params",
                     header=pb.Header(tensors=[pb.TensorSpec(name="theta", dtype="float32",
                                                             shape=[500_000_000], nbytes=2_000_000_000)]))
    asm = codec.Assembler(1 << 34)
    asm.header(frame)
    assert not asm.allocated and asm.declared == {"theta": ("float32", (500_000_000,))}
    box = Mailbox(0, [1], horizon=4)
    box.expect("params", SPECS)
    assert "differ from the expected" in str(box.check_header(1, 0, "params", asm.declared))


# -- real peers over mutual TLS (graphfl.p2p.hostile, shared with graphfl bench faults) ------


@pytest.fixture()
def ring4(tmp_path: Path):
    with TargetPeer(tmp_path, 4) as target:  # peer 0's neighbours: 1 and 3; peer 2 is not one
        yield target


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_declared_2gb_tensor_costs_no_memory(ring4: TargetPeer) -> None:
    before = _rss_mb()
    ack = ring4.push(2, [huge_header(2)])  # a valid certificate that is not a neighbour's
    assert not ack.accepted and "not a neighbour" in ack.reason
    ring4.verify(1)  # a neighbour with a handshake declaring a tensor bigger than the model
    ack = ring4.push(1, [huge_header(1)])
    assert not ack.accepted and "differ from the expected" in ack.reason
    assert _rss_mb() - before < 200, "a crafted header made the peer allocate its declared size"


def test_idle_streams_cannot_cut_a_peer_off_its_neighbours(ring4: TargetPeer) -> None:
    ring4.verify(1, 3)
    stop = threading.Event()
    acks: list[pb.Ack] = []
    errors: list[grpc.RpcError] = []

    def hold(who: int) -> None:
        try:
            acks.append(ring4.push(who, idle_frames(stop), timeout=30.0))
        except grpc.RpcError as exc:
            errors.append(exc)

    holders = [threading.Thread(target=hold, args=(who,)) for who in [2] * 6 + [1] * 6]
    for th in holders:
        th.start()
    time.sleep(0.5)
    # the real neighbour 3 still gets its message through while twelve streams are held open
    ack = ring4.push(3, frames(3, 0))
    assert ack.accepted, ack.reason
    t0 = time.monotonic()
    for th in holders:
        th.join(20)
    stop.set()
    refused = [a.reason for a in acks if not a.accepted]
    assert any("not a neighbour" in r for r in refused)  # peer 2's streams: refused unread
    assert any("open streams" in r for r in refused)  # peer 1 beyond its two slots
    assert time.monotonic() - t0 < 8  # idle streams were cut by the 1.5 s stream deadline, not held for 30 s
    assert 3 in ring4.transport.receive(0, ["params"], [3], timeout=1.0)


def test_a_neighbour_sending_huge_finite_values_is_refused_before_mixing() -> None:
    box = Mailbox(0, [1, 2], horizon=4)
    box.expect("params", SPECS)
    ok, why = box.put(_msg(1, 0, value=3e38))  # finite float32, but mixing it overflows
    assert not ok and "overflow" in why
    assert box.put(_msg(2, 0, value=1e6))[0]  # large but honest values still pass
    got = box.wait(0, ["params"], [1, 2], timeout=0.1)
    assert sorted(got) == [2]
