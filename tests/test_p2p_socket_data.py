"""The socket data path (``[run] data-path = "socket"``): real peers on 127.0.0.1, real TCP / TLS
connections, hostile raw clients (no mocks)."""

from __future__ import annotations

import dataclasses
import socket
import ssl
import struct
import time

import numpy as np
import pytest

from graphfl.common.certs import PeerTlsFiles, generate_network_certs
from graphfl.common.ports import free_ports
from graphfl.p2p import codec
from graphfl.p2p.grpc_transport import GrpcTransport, Identity
from graphfl.p2p.proto import graphfl_p2p_pb2 as pb
from graphfl.p2p.socket_data import MAGIC, PREAMBLE, client_context, read_ack, split_host_port, write_record
from graphfl.p2p.topology import make_topology
from graphfl.p2p.transport import HandshakeRefused, TransportError

DIM = 8


def peer(topo, i, tls=None, dim=DIM, chunk_bytes=1 << 20, data_path="socket", **kw):
    t = GrpcTransport(Identity(i, "dfl-gt", "abc", topo.fingerprint), topo, tls, chunk_bytes=chunk_bytes,
                      data_path=data_path, **kw)
    t.mailbox.expect("params", {"theta": ("float32", (dim,))})
    t.serve()
    return t


def files(d, i):
    return PeerTlsFiles(d / "ca.crt", d / f"peer-{i}.crt", d / f"peer-{i}.key")


@pytest.fixture()
def topo():
    return make_topology("ring", 4, ports=free_ports(4))


def raw_connect(target: GrpcTransport, claimed: int, token: bytes, ctx: ssl.SSLContext | None = None,
                server_name: str = "", magic: bytes = MAGIC) -> tuple[socket.socket, pb.Ack]:
    """A hand-made data connection to ``target``: the preamble, then the callee's Ack."""
    s = socket.create_connection(("127.0.0.1", target.data_server.port), timeout=5.0)
    if ctx is not None:
        s = ctx.wrap_socket(s, server_hostname=server_name)
    s.sendall(PREAMBLE.pack(magic, claimed, token))
    return s, read_ack(s)


def send_message(s: socket.socket, frames) -> pb.Ack:
    for f in frames:
        write_record(s, f if isinstance(f, bytes) else f.SerializeToString())
    return read_ack(s)


def closed_within(s: socket.socket, seconds: float) -> float:
    """Seconds until the callee closes ``s`` (AssertionError past ``seconds``)."""
    t0 = time.monotonic()
    s.settimeout(seconds)
    try:
        while s.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"connection still open after {seconds} s") from None
    return time.monotonic() - t0


def test_split_host_port():
    assert split_host_port("127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert split_host_port("[::1]:7") == ("::1", 7)
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_host_port("localhost")


def test_exchange_big_messages_zero_copy_and_one_reused_connection(topo):
    n = 3_000_000  # 12 MB: 12 data frames of 1 MiB
    a, b = peer(topo, 0, dim=n), peer(topo, 1, dim=n)
    try:
        assert a.start(1.0) == {1}  # peer 3 is not running: bounded wait, then without it
        rng = np.random.default_rng(0)
        xs = [rng.normal(size=n).astype(np.float32) for _ in range(3)]
        r = a.send(1, 2, "params", {"theta": xs[2]})  # b is in round 0: buffered until asked
        assert r.ok, r.reason
        sent = [a.send(1, k, "params", {"theta": xs[k]}) for k in (0, 1)]
        assert all(x.ok for x in sent)
        wire = r.wire_bytes + sum(x.wire_bytes for x in sent)
        for k in range(3):
            got = b.receive(k, ["params"], [0], timeout=10.0)[0]["params"].arrays["theta"]
            np.testing.assert_array_equal(got, xs[k])
        assert b.stats()["bytes_received"] == wire == a.stats()["bytes_sent"]
        assert r.wire_bytes - xs[0].nbytes < 400  # the same protobuf frames as gRPC's Push: header + 12 data frames
        assert len(b.data_server._live) == 1  # one connection, reused for the three messages
    finally:
        a.close()
        b.close()
    # a tensor that fits one frame is the received buffer itself: aligned, read-only
    a, b = peer(topo, 0, dim=1000), peer(topo, 1, dim=1000)
    try:
        y = np.arange(1000, dtype=np.float32)
        assert a.send(1, 0, "params", {"theta": y}).ok
        got = b.receive(0, ["params"], [0], timeout=5.0)[0]["params"].arrays["theta"]
        np.testing.assert_array_equal(got, y)
        assert got.flags.aligned and not got.flags.writeable
    finally:
        a.close()
        b.close()


def test_dead_neighbour_is_unreachable_and_a_restarted_one_is_reached_again(topo):
    a, b = peer(topo, 0), peer(topo, 1)
    x = np.ones(DIM, np.float32)
    try:
        assert a.send(1, 0, "params", {"theta": x}).ok
        old_port = a.data_contacts[1][0]
        b.close()
        t0 = time.monotonic()
        r = a.send(1, 1, "params", {"theta": x}, timeout=3.0)
        assert not r.ok and r.unreachable and time.monotonic() - t0 < 5.0
        b = peer(topo, 1)  # the same peer restarted: a new data port and token
        end = time.monotonic() + 10.0
        while True:  # gRPC's channel may still be in its reconnect back-off (capped at 2 s): a later round's send
            r = a.send(1, 1, "params", {"theta": x}, timeout=5.0)
            if r.ok or time.monotonic() > end:
                break
            time.sleep(0.2)
        assert r.ok, r.reason
        assert a.data_contacts[1][0] == b.data_server.port != old_port
        assert 0 in b.receive(1, ["params"], [0], timeout=2.0)
    finally:
        a.close()
        b.close()


def test_mutual_tls_and_a_certificate_that_is_not_the_claimed_peer(topo, tmp_path):
    certs = generate_network_certs(tmp_path / "certs", 4)
    n = 300_000  # 5 frames of 256 KiB over TLS, received in place
    a, b = (peer(topo, i, files(certs, i), dim=n, chunk_bytes=256 << 10) for i in (0, 1))
    try:
        x = np.random.default_rng(3).normal(size=n).astype(np.float32)
        assert a.send(1, 0, "params", {"theta": x}).ok
        np.testing.assert_array_equal(b.receive(0, ["params"], [0], timeout=5.0)[0]["params"].arrays["theta"], x)
        # peer 2's genuine certificate with peer 0's token (as if stolen): refused on the common name
        ctx = client_context(files(certs, 2))
        s, ack = raw_connect(b, 0, b.data_tokens[0], ctx, server_name="peer-1")
        s.close()
        assert not ack.accepted and "common name" in ack.reason
        # no client certificate at all: the TLS handshake fails
        bare = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            s, ack = raw_connect(b, 0, b.data_tokens[0], bare, server_name="peer-1")
            s.close()
            assert not ack.accepted
    finally:
        a.close()
        b.close()


def test_preamble_refusals(topo):
    a, b = peer(topo, 0), peer(topo, 1)
    try:
        a.handshake(1, 5.0)
        token = b.data_tokens[0]
        cases = {
            "magic": dict(claimed=0, token=token, magic=b"HTTP"),
            "stranger": dict(claimed=3, token=token),  # ring of 4: peer 3 is not peer 1's neighbour
            "token": dict(claimed=0, token=bytes(16)),
            "no handshake": dict(claimed=2, token=token),  # a neighbour that never handshook
        }
        reasons = {}
        for name, kw in cases.items():
            s, ack = raw_connect(b, **kw)
            assert not ack.accepted, name
            reasons[name] = ack.reason
            closed_within(s, 2.0)
            s.close()
        assert "bad preamble" in reasons["magic"] and "not a neighbour" in reasons["stranger"]
        assert reasons["token"].startswith("unknown-peer") and reasons["no handshake"].startswith("unknown-peer")
        # at most streams_per_sender (2) connections per identity: a third, authenticated one replaces the
        # least recently used idle one (tests/test_reliability_followups.py: busy ones are never replaced)
        held = [raw_connect(b, 0, token)[0] for _ in range(2)]
        s, ack = raw_connect(b, 0, token)
        assert ack.accepted, ack.reason
        closed_within(held[0], 2.0)
        assert len(b.data_server._live) == 2
        for c in [*held, s]:
            c.close()
        assert b.stats()["messages_rejected"] >= 4
    finally:
        a.close()
        b.close()


def test_bad_messages_are_refused_and_the_connection_survives_a_refused_header(topo):
    a, b = peer(topo, 0), peer(topo, 1)
    try:
        a.handshake(1, 5.0)
        s, ack = raw_connect(b, 0, b.data_tokens[0])
        assert ack.accepted
        good = np.ones(DIM, np.float32)
        # refused after decoding (NaN), and refused on its header (shape): the connection stays usable
        ack = send_message(s, codec.encode(0, 0, "params", {"theta": np.full(DIM, np.nan, np.float32)}))
        assert not ack.accepted and "NaN" in ack.reason
        big = np.ones(50_000, np.float32)  # several frames the callee must read and drop
        ack = send_message(s, codec.encode_serialized(0, 0, "params", {"theta": big}, chunk_bytes=64 << 10))
        assert not ack.accepted and "differ from the expected" in ack.reason
        ack = send_message(s, codec.encode(0, 0, "params", {"theta": good}))
        assert ack.accepted, ack.reason
        assert 0 in b.receive(0, ["params"], [0], timeout=2.0)
        # malformed: answered, then the connection is closed
        bad = {
            "no header": [pb.Frame(sender=0, round=1, channel="params", data=b"1234")],
            "claims another peer": list(codec.encode(2, 1, "params", {"theta": good})),
            "frame too large": [struct.pack("<I", b.max_frame_bytes + 1)],
        }
        reasons = {}
        for name, frames in bad.items():
            s.close()
            s, ack = raw_connect(b, 0, b.data_tokens[0])
            assert ack.accepted
            if isinstance(frames[0], bytes):
                s.sendall(frames[0])
                ack = read_ack(s)
            else:
                ack = send_message(s, frames)
            assert not ack.accepted, name
            reasons[name] = ack.reason
            closed_within(s, 2.0)
        s.close()
        assert "must be a header" in reasons["no header"] and "claiming peer 2" in reasons["claims another peer"]
        assert "exceeds the limit" in reasons["frame too large"]
        # the peer still serves: a normal send goes through
        assert a.send(1, 1, "params", {"theta": good}).ok
    finally:
        a.close()
        b.close()


def test_trickling_sender_is_cut_at_the_stream_timeout_and_floods_are_bounded(topo):
    n = 100_000
    a, b = peer(topo, 0, dim=n), peer(topo, 1, dim=n, stream_timeout=1.0)
    try:
        a.handshake(1, 5.0)
        s, ack = raw_connect(b, 0, b.data_tokens[0])
        assert ack.accepted
        frames = codec.encode_serialized(0, 0, "params", {"theta": np.ones(n, np.float32)})
        write_record(s, frames[0])  # the header, then nothing
        assert 0.5 < closed_within(s, 5.0) < 4.0
        s.close()
        # a preamble sent a byte at a time is cut at the pre-auth deadline
        b.data_server.preauth_timeout = 1.0
        slow = socket.create_connection(("127.0.0.1", b.data_server.port), timeout=5.0)
        t0 = time.monotonic()
        with pytest.raises(OSError):
            for byte in PREAMBLE.pack(MAGIC, 0, b.data_tokens[0]):
                slow.sendall(bytes([byte]))
                time.sleep(0.3)
            read_ack(slow)  # (the preamble cannot complete: 24 bytes take 7 s)
        assert time.monotonic() - t0 < 4.0
        slow.close()
        # connections that never send a preamble hold at most preauth_max slots: a newer one makes room by
        # closing the oldest of those that sent least, at once; the neighbour still gets in
        b.data_server.preauth_timeout = 10.0
        b.data_server.preauth_max = 3
        idle = [socket.create_connection(("127.0.0.1", b.data_server.port), timeout=5.0) for _ in range(3)]
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", b.data_server.port), timeout=5.0)
        assert closed_within(idle[0], 2.0) < 0.5  # at once, not at a deadline
        assert b.data_server.preauth_open() == 3
        assert a.send(1, 0, "params", {"theta": np.ones(n, np.float32)}, timeout=5.0).ok
        for c in [*idle, extra]:
            c.close()
    finally:
        a.close()
        b.close()


def test_receiver_failure_is_a_refusal_not_an_unreachable_peer(topo, monkeypatch):
    a, b = peer(topo, 0), peer(topo, 1)
    try:
        monkeypatch.setattr(b.mailbox, "put", lambda msg: 1 / 0)
        r = a.send(1, 0, "params", {"theta": np.ones(DIM, np.float32)})
        assert not r.ok and not r.unreachable and "UNKNOWN" in r.reason and "ZeroDivisionError" in r.reason
    finally:
        a.close()
        b.close()


def test_a_fixed_data_port_is_bound_and_announced():
    ports = free_ports(6)
    topo = make_topology("ring", 4, ports=ports[:4])
    topo = dataclasses.replace(topo, peers=tuple(dataclasses.replace(p, data_port=ports[4]) if p.id == 1 else p
                                                  for p in topo.peers))
    a, b = peer(topo, 0), peer(topo, 1)
    try:
        assert b.data_server.port == ports[4]
        assert a.send(1, 0, "params", {"theta": np.ones(DIM, np.float32)}).ok
        assert a.data_contacts[1][0] == ports[4]
        # a second peer 1 on the same machine cannot take the port: a clear error naming it
        with pytest.raises(TransportError, match=f"data listener cannot bind 127.0.0.1:{ports[4]}"):
            dup = GrpcTransport(Identity(1, "dfl-gt", "abc", topo.fingerprint), topo, None, data_path="socket")
            try:
                dup.serve(f"127.0.0.1:{ports[5]}")
            finally:
                dup.close()
    finally:
        a.close()
        b.close()


def test_data_paths_must_match(topo):
    a, b = peer(topo, 0), peer(topo, 1, data_path="grpc")
    try:
        with pytest.raises(HandshakeRefused, match="no socket data port"):
            a.handshake(1, 5.0)
        with pytest.raises(ValueError, match="data_path must be one of"):
            GrpcTransport(Identity(2, "dfl-gt", "abc", topo.fingerprint), topo, None, data_path="udp")
    finally:
        a.close()
        b.close()
