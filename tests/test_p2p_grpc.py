"""Real gRPC peers on 127.0.0.1 inside the test process (no mocks): handshakes, TLS, big and bad messages."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from graphfl.common.certs import PeerTlsFiles, generate_network_certs, make_peer_cert, write_ca
from graphfl.common.ports import free_ports
from graphfl.p2p import codec
from graphfl.p2p.grpc_transport import GrpcTransport, Identity
from graphfl.p2p.proto import graphfl_p2p_pb2 as pb
from graphfl.p2p.proto import graphfl_p2p_pb2_grpc as pb_grpc
from graphfl.p2p.topology import make_topology
from graphfl.p2p.transport import HandshakeRefused

DIM = 8


@pytest.fixture()
def topo():
    return make_topology("ring", 3, ports=free_ports(3))


def peer(topo, i, tls=None, config_hash="abc", algorithm="dfl-gt", version=None, dim=DIM, chunk_bytes=1 << 20):
    t = GrpcTransport(Identity(i, algorithm, config_hash, version or topo.fingerprint), topo, tls,
                      chunk_bytes=chunk_bytes)
    t.mailbox.expect("params", {"theta": ("float32", (dim,))})
    t.serve()
    return t


@pytest.fixture()
def certs(tmp_path):
    return generate_network_certs(tmp_path / "certs", 3)


def files(d, i):
    return PeerTlsFiles(d / "ca.crt", d / f"peer-{i}.crt", d / f"peer-{i}.key")


def test_plaintext_exchange_and_early_message_buffering(topo):
    a, b = peer(topo, 0), peer(topo, 1)
    try:
        assert a.start(1.0) == {1}  # peer 2 is not running: bounded wait, then without it
        x = np.arange(DIM, dtype=np.float32)
        assert a.send(1, 3, "params", {"theta": x}).ok  # b is still in round 0: buffered
        got = b.receive(3, ["params"], [0], timeout=2.0)
        np.testing.assert_array_equal(got[0]["params"].arrays["theta"], x)
        r = a.send(2, 0, "params", {"theta": x}, timeout=2.0)
        assert not r.ok and r.unreachable
    finally:
        a.close()
        b.close()


def test_message_larger_than_4mb_over_grpc(topo):
    n = 3_000_000  # 12 MB of float32
    a, b = peer(topo, 0, dim=n), peer(topo, 1, dim=n)
    try:
        a.handshake(1, 5.0)
        x = np.random.default_rng(0).normal(size=n).astype(np.float32)
        r = a.send(1, 0, "params", {"theta": x})
        assert r.ok and r.wire_bytes > x.nbytes
        got = b.receive(0, ["params"], [0], timeout=10.0)
        np.testing.assert_array_equal(got[0]["params"].arrays["theta"], x)
        assert b.stats()["bytes_received"] == r.wire_bytes
    finally:
        a.close()
        b.close()


def test_frames_above_grpc_default_limit_when_chunk_bytes_asks(topo):
    """A 12 MB tensor in one 16 MiB frame: the receiver raises gRPC's 4 MB message limit to
    chunk-bytes + headroom; a peer with the default chunk size refuses such a frame."""
    n = 3_000_000
    a, b = peer(topo, 0, dim=n, chunk_bytes=16 << 20), peer(topo, 1, dim=n, chunk_bytes=16 << 20)
    try:
        a.handshake(1, 5.0)
        x = np.random.default_rng(1).normal(size=n).astype(np.float32)
        r = a.send(1, 0, "params", {"theta": x})
        assert r.ok, r.reason
        assert r.wire_bytes - x.nbytes < 200  # one header frame and one data frame
        got = b.receive(0, ["params"], [0], timeout=10.0)
        np.testing.assert_array_equal(got[0]["params"].arrays["theta"], x)
    finally:
        a.close()
        b.close()
    c, d = peer(topo, 0, dim=n, chunk_bytes=16 << 20), peer(topo, 2, dim=n)  # d: the default 4 MB limit
    try:
        c.handshake(2, 5.0)
        r = c.send(2, 0, "params", {"theta": np.zeros(n, np.float32)}, timeout=5.0)
        assert not r.ok and "RESOURCE_EXHAUSTED" in r.reason
    finally:
        c.close()
        d.close()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"config_hash": "other"}, "config hash differs"),
        ({"algorithm": "dfl-sgd"}, "algorithm differs"),
        ({"version": "2:deadbeef"}, "topology version differs"),
    ],
)
def test_mismatched_handshake_is_refused(topo, kwargs, match):
    a, b = peer(topo, 0), peer(topo, 1, **kwargs)
    try:
        with pytest.raises(HandshakeRefused, match=match):
            b.handshake(0, timeout=5.0)
        with pytest.raises(HandshakeRefused, match=match):  # and the caller checks the reply too
            a.handshake(1, timeout=5.0)
        assert 1 not in a.verified and 0 not in b.verified
    finally:
        a.close()
        b.close()


def test_not_a_neighbour_is_refused():
    topo = make_topology("ring", 4, ports=free_ports(4))  # 0 and 2 are not neighbours
    a = peer(topo, 0)
    c = GrpcTransport(Identity(2, "dfl-gt", "abc", topo.fingerprint), topo, None)
    try:
        with pytest.raises(HandshakeRefused, match="not a neighbour"):
            c.handshake(0, 5.0)
    finally:
        a.close()
        c.close()


def test_mutual_tls_accepts_network_certs(topo, certs):
    a, b = peer(topo, 0, files(certs, 0)), peer(topo, 1, files(certs, 1))
    try:
        a.handshake(1, 5.0)
        assert a.send(1, 0, "params", {"theta": np.ones(DIM, np.float32)}).ok
    finally:
        a.close()
        b.close()


def test_certificate_from_another_ca_is_refused(topo, certs, tmp_path):
    rogue = tmp_path / "rogue"
    ca_key, ca_cert = write_ca(rogue, name="rogue-ca")
    make_peer_cert(rogue, 1, ca_key, ca_cert)
    # the intruder trusts the network CA but presents a certificate signed by its own CA
    bad = PeerTlsFiles(certs / "ca.crt", rogue / "peer-1.crt", rogue / "peer-1.key")
    a, b = peer(topo, 0, files(certs, 0)), peer(topo, 1, bad)
    try:
        assert b.start(1.5) == set()
        assert 1 not in a.verified
        assert a.start(1.0) == set()  # and peer 0 does not accept the intruder's server certificate
        assert "SSL" in a.last_errors[1] or "handshake" in a.last_errors[1].lower()
    finally:
        a.close()
        b.close()


def test_valid_certificate_claiming_another_id_is_refused(topo, certs):
    # peer 2's genuine certificate, used by a process that claims to be peer 1
    a = peer(topo, 0, files(certs, 0))
    imp = GrpcTransport(Identity(1, "dfl-gt", "abc", topo.fingerprint), topo, files(certs, 2))
    try:
        with pytest.raises(HandshakeRefused, match="common name"):
            imp.handshake(0, 5.0)
    finally:
        a.close()
        imp.close()


def test_plaintext_client_cannot_reach_tls_peer(topo, certs):
    a = peer(topo, 0, files(certs, 0))
    c = GrpcTransport(Identity(1, "dfl-gt", "abc", topo.fingerprint), topo, None)
    try:
        with pytest.raises(grpc.RpcError):
            c.handshake(0, 2.0)
    finally:
        a.close()
        c.close()


def raw_push(topo, target, frames):
    with grpc.insecure_channel(topo.peer(target).address) as ch:
        return pb_grpc.PeerStub(ch).Push(iter(frames), timeout=5.0)


def test_malformed_messages_are_rejected_and_the_peer_keeps_serving(topo):
    a, b = peer(topo, 0), peer(topo, 1)
    try:
        a.handshake(1, 5.0)
        good = np.ones(DIM, np.float32)
        cases = {
            "NaN": list(codec.encode(0, 0, "params", {"theta": np.full(DIM, np.nan, np.float32)})),
            "shape": list(codec.encode(0, 0, "params", {"theta": np.ones(DIM + 1, np.float32)})),
            "dtype": list(codec.encode(0, 0, "params", {"theta": np.ones(DIM, np.float64)})),
            "channel": list(codec.encode(0, 0, "bogus", {"theta": good})),
            "truncated": list(codec.encode(0, 0, "params", {"theta": good}))[:1],
            "sizes": [pb.Frame(sender=0, round=0, channel="params",
                               header=pb.Header(tensors=[pb.TensorSpec(name="theta", dtype="float32", shape=[DIM], nbytes=3)]))],
            "no header": [pb.Frame(sender=0, round=0, channel="params", data=b"1234")],
            "empty": [],
            "stranger": list(codec.encode(2, 0, "params", {"theta": good})),
        }
        reasons = {}
        for name, frames in cases.items():
            ack = raw_push(topo, 1, frames)
            assert not ack.accepted, name
            reasons[name] = ack.reason
        assert "NaN" in reasons["NaN"] and "differ from the expected" in reasons["shape"] and "float64" in reasons["dtype"]
        assert "unknown channel" in reasons["channel"] and "ended early" in reasons["truncated"]
        assert "needs 32" in reasons["sizes"] and "unknown-peer" in reasons["stranger"]
        assert b.stats()["messages_rejected"] >= 8
        # still alive and accepting good messages
        assert a.send(1, 0, "params", {"theta": good}).ok
        assert 0 in b.receive(0, ["params"], [0], timeout=2.0)
    finally:
        a.close()
        b.close()


def test_local_errors_raise_and_only_network_errors_are_unreachable(topo, monkeypatch):
    a, b = peer(topo, 0), peer(topo, 1)
    try:
        a.handshake(1, 5.0)
        # an unencodable tensor is our bug: it raises, it is not "peer 1 unreachable"
        with pytest.raises(codec.WireError, match="complex128"):
            a.send(1, 0, "params", {"theta": np.ones(DIM, np.complex128)})
        # a bug in the encoder is raised here too, not reported as "peer 1 unreachable"
        def broken_encode(*args, **kwargs):
            raise RuntimeError("encoder bug")

        monkeypatch.setattr(codec, "encode_serialized", broken_encode)
        with pytest.raises(RuntimeError, match="encoder bug"):
            a.send(1, 0, "params", {"theta": np.ones(DIM, np.float32)})
        monkeypatch.undo()
        # a failing handler on the other side (gRPC status UNKNOWN) is a refusal, not an unreachable peer
        monkeypatch.setattr(b.mailbox, "put", lambda msg: 1 / 0)
        r = a.send(1, 0, "params", {"theta": np.ones(DIM, np.float32)})
        assert not r.ok and not r.unreachable and "UNKNOWN" in r.reason
        # a dead peer is unreachable
        b.close()
        r = a.send(1, 1, "params", {"theta": np.ones(DIM, np.float32)}, timeout=2.0)
        assert not r.ok and r.unreachable and "UNAVAILABLE" in r.reason
    finally:
        a.close()
        b.close()
