"""Before authentication: strangers' connections, fixed ports across restarts, and the log.

Real peers on 127.0.0.1 (in this process, or ``python -m graphfl.p2p peer`` processes), real TCP
and mutual TLS connections from hostile raw clients; no mocks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from graphfl.common.certs import PeerTlsFiles, generate_network_certs
from graphfl.common.ports import free_ports
from graphfl.p2p.grpc_transport import GrpcTransport, Identity
from graphfl.p2p.hostile import ConnectionFlood
from graphfl.p2p.socket_data import MAGIC, PREAMBLE
from graphfl.p2p.topology import make_topology
from graphfl.p2p.transport import HandshakeRefused

DIM = 8
X = np.ones(DIM, np.float32)


def files(d: Path, i: int) -> PeerTlsFiles:
    return PeerTlsFiles(d / "ca.crt", d / f"peer-{i}.crt", d / f"peer-{i}.key")


def peer(topo, i, tls=None, **kw) -> GrpcTransport:
    t = GrpcTransport(Identity(i, "dfl-gt", "abc", topo.fingerprint), topo, tls, data_path="socket", **kw)
    t.mailbox.expect("params", {"theta": ("float32", (DIM,))})
    t.serve()
    return t


def test_strangers_flooding_idle_and_slow_connections_do_not_lock_neighbours_out(tmp_path):
    certs = generate_network_certs(tmp_path / "certs", 3)
    topo = make_topology("ring", 3, ports=free_ports(3))
    a, b, c = (peer(topo, i, files(certs, i)) for i in range(3))
    # well over the pre-auth budget, sustained: each connection reopened 50 ms after the callee closes it
    flood = ConnectionFlood([("127.0.0.1", b.data_server.port)], idle=40, slow=20, pause=0.05)
    try:
        time.sleep(1.0)  # the flood holds its connections before the neighbours connect
        assert flood.opened >= 40
        sent = []
        for r in range(4):
            t0 = time.monotonic()
            results = [a.send(1, r, "params", {"theta": X * r}, timeout=2.0),
                       c.send(1, r, "params", {"theta": X * r}, timeout=2.0)]
            sent.append((time.monotonic() - t0, [(x.ok, x.reason) for x in results]))
            got = b.receive(r, ["params"], [0, 2], timeout=2.0)
            assert sorted(got) == [0, 2], (r, sent)
            for j in (0, 2):
                np.testing.assert_array_equal(got[j]["params"].arrays["theta"], X * r)
            a._data_client.forget(1)  # reconnect next round (as after a restart or the idle close)
            c._data_client.forget(1)
            b.advance(r + 1)
        pending = b.data_server.preauth_open()
        assert pending <= b.data_server.preauth_max, pending
        drops = b.data_server.preauth_counts()
        assert drops["evicted"] + drops["deadline"] > 0, drops  # the flood was really dropped, not ignored
    finally:
        flood.close()
        for t in (a, b, c):
            t.close()


def test_a_stranger_idle_before_authentication_is_cut_at_the_short_preauth_deadline():
    topo = make_topology("ring", 3, ports=free_ports(3))
    b = peer(topo, 1)
    try:
        b.data_server.preauth_timeout = 0.5
        s = socket.create_connection(("127.0.0.1", b.data_server.port), timeout=5.0)
        t0 = time.monotonic()
        s.settimeout(5.0)
        try:
            assert s.recv(16) == b""
        except ConnectionResetError:
            pass
        assert time.monotonic() - t0 < 2.0
        s.close()
        # a preamble trickled a byte at a time is cut at the same deadline
        slow = socket.create_connection(("127.0.0.1", b.data_server.port), timeout=5.0)
        t0 = time.monotonic()
        with pytest.raises(OSError):
            for byte in PREAMBLE.pack(MAGIC, 0, bytes(16)):
                slow.sendall(bytes([byte]))
                time.sleep(0.2)
        assert time.monotonic() - t0 < 2.5
        slow.close()
    finally:
        b.close()


def _with_data_port(topo, i: int, port: int):
    return dataclasses.replace(topo, peers=tuple(dataclasses.replace(p, data_port=port) if p.id == i else p
                                                  for p in topo.peers))


def test_a_peer_with_fixed_ports_restarts_at_once_despite_time_wait():
    ports = free_ports(4)
    topo = _with_data_port(make_topology("ring", 3, ports=ports[:3]), 1, ports[3])
    a, b = peer(topo, 0), peer(topo, 1)
    try:
        for r in range(2):
            assert a.send(1, r, "params", {"theta": X}).ok
        assert 0 in b.receive(0, ["params"], [0], timeout=2.0)
        b.close()  # the callee closes first: its end of the data connection lingers (FIN-WAIT, then TIME-WAIT)
        out = subprocess.run(["ss", "-tan"], capture_output=True, text=True, check=False).stdout
        lingering = [ln for ln in out.splitlines() if f"127.0.0.1:{ports[3]} " in ln and "WAIT" in ln.split()[0]]
        assert lingering, out  # the condition this test is about: the old connection still holds the fixed port
        b = peer(topo, 1)  # the same peer, restarted at once: same gRPC port, same data port
        assert b.data_server.port == ports[3]
        end = time.monotonic() + 10.0
        while True:  # gRPC's channel may still be in its reconnect back-off (capped at 2 s)
            r = a.send(1, 0, "params", {"theta": X}, timeout=3.0)
            if r.ok or time.monotonic() > end:
                break
            time.sleep(0.2)
        assert r.ok, r.reason
        assert 0 in b.receive(0, ["params"], [0], timeout=2.0)
    finally:
        a.close()
        b.close()


def test_a_grpc_only_peer_restarts_at_once_on_its_fixed_port():
    topo = make_topology("ring", 3, ports=free_ports(3))
    a = peer(topo, 0)
    b = GrpcTransport(Identity(1, "dfl-gt", "abc", topo.fingerprint), topo, None)
    b.mailbox.expect("params", {"theta": ("float32", (DIM,))})
    b.serve()
    a2 = GrpcTransport(Identity(0, "dfl-gt", "abc", topo.fingerprint), topo, None)
    try:
        assert a2.send(1, 0, "params", {"theta": X}).ok
        b.close()
        b = GrpcTransport(Identity(1, "dfl-gt", "abc", topo.fingerprint), topo, None)
        b.mailbox.expect("params", {"theta": ("float32", (DIM,))})
        b.serve()  # gRPC sets SO_REUSEADDR on its listeners: no TIME_WAIT wait
        end = time.monotonic() + 10.0
        while not (r := a2.send(1, 0, "params", {"theta": X}, timeout=3.0)).ok and time.monotonic() < end:
            time.sleep(0.2)
        assert r.ok, r.reason
    finally:
        for t in (a, a2, b):
            t.close()


def _network(tmp_path: Path, n: int, insecure: bool = True, **run) -> Path:
    from graphfl.deploy.p2p_launch import prepare_network

    return prepare_network(tmp_path, "ring", n, {"algorithm": "dfl-gt", "problem": "linreg", "data-path": "socket",
                                                  "connect-timeout": 0.5, "round-timeout": 0.3, "send-timeout": 0.3,
                                                  **run}, insecure=insecure)


def test_a_peer_that_never_heard_a_neighbour_does_not_report_done(tmp_path):
    from graphfl.p2p.peer import EXIT_UNREACHABLE, run_peer

    net = _network(tmp_path, 3, rounds=3)
    code = run_peer(net, 0, tmp_path / "out", insecure=True)  # peers 1 and 2 never start
    doc = json.loads((tmp_path / "out" / "peer-0.json").read_text())
    assert [r["missing"] for r in doc["records"]] == [[1, 2]] * 3  # it did run its rounds, alone
    assert doc["outcome"] == "isolated" and code == EXIT_UNREACHABLE, (doc["outcome"], code)
    assert "no message from any neighbour" in doc["error"] and "3 round" in doc["error"]


def test_a_data_port_taken_by_another_process_is_a_bind_error_naming_the_port(tmp_path):
    from graphfl.p2p.config import load_network_file, write_network_file
    from graphfl.p2p.peer import EXIT_BIND, run_peer

    path = _network(tmp_path, 3, rounds=1)
    net = load_network_file(path)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        path = write_network_file(path, _with_data_port(net.topology, 0, port), net.run, net.tls)
        code = run_peer(path, 0, tmp_path / "out", insecure=True)
    finally:
        busy.close()
    doc = json.loads((tmp_path / "out" / "peer-0.json").read_text())
    assert code == EXIT_BIND and doc["outcome"] == "bind-failed", (code, doc["outcome"])
    assert "bind" in doc["error"] and f"127.0.0.1:{port}" in doc["error"] and "data" in doc["error"], doc["error"]


@pytest.mark.e2e
def test_no_certificate_connections_grow_a_peer_log_by_a_bounded_amount(tmp_path):
    """A peer process's log grows by a bounded number of bytes under a flood of connections
    without a client certificate (gRPC port and data port), and the refusal is logged once.
    """
    path = _network(tmp_path, 3, insecure=False, rounds=10_000, **{"connect-timeout": 120})
    net_certs = tmp_path / "certs"
    log = tmp_path / "peer-0.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    with log.open("wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "graphfl.p2p", "peer", "--topology", str(path), "--id", "0",
                                 "--out", str(tmp_path / "out")], stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        status = tmp_path / "out" / "peer-0.status.json"
        end = time.monotonic() + 60
        while not (status.is_file() and "connecting" in status.read_text()):
            assert proc.poll() is None and time.monotonic() < end, log.read_text()
            time.sleep(0.1)
        from graphfl.p2p.config import load_network_file

        topo = load_network_file(path).topology
        grpc_port = int(topo.peer(0).address.rsplit(":", 1)[1])
        data_port = _announced_data_port(log)
        time.sleep(0.5)
        before = log.stat().st_size
        bare = ssl.create_default_context(cafile=str(net_certs / "ca.crt"))
        bare.check_hostname = False
        n = 300
        for port in (grpc_port, data_port):
            for _ in range(n):
                s = socket.create_connection(("127.0.0.1", port), timeout=5.0)
                try:
                    s = bare.wrap_socket(s, server_hostname="peer-0")
                    s.recv(16)
                except OSError:
                    pass
                finally:
                    s.close()
        time.sleep(6.0)  # one summary interval
        grown = log.stat().st_size - before
        text = log.read_text()[before:]
    finally:
        proc.kill()  # (still connecting: SIGTERM would wait out connect-timeout)
        proc.wait(30)
    assert grown < 3000, (grown, text[:2000])  # 2 x 300 refused connections: a few summary lines, not one each
    assert "before authentication" in text and "TLS" in text, text  # ... and the refusal is visible


def _announced_data_port(log: Path) -> int:
    for line in log.read_text().splitlines():
        if "socket data path listening on" in line:
            return int(line.rsplit(":", 1)[1])
    raise AssertionError(log.read_text())


def test_refused_handshakes_are_logged_rate_limited(tmp_path, caplog):
    certs = generate_network_certs(tmp_path / "certs", 4)
    topo = make_topology("ring", 4, ports=free_ports(4))
    target = peer(topo, 0, files(certs, 0))
    stranger = GrpcTransport(Identity(2, "dfl-gt", "abc", topo.fingerprint), topo, files(certs, 2))  # not 0's neighbour
    try:
        with caplog.at_level(logging.WARNING, logger="graphfl.p2p.grpc_transport"):
            for _ in range(50):
                with pytest.raises(HandshakeRefused, match="not a neighbour"):
                    stranger.handshake(0, 5.0)
        lines = [r.getMessage() for r in caplog.records if "refused a handshake" in r.getMessage()]
        assert len(lines) == 1 and "peer 2 is not a neighbour of peer 0" in lines[0], lines  # visible, once
    finally:
        stranger.close()
        target.close()
