"""A hostile or broken neighbour, for tests and ``graphfl bench faults``: crafted frames over real mutual TLS.

:class:`TargetPeer` serves one peer's real receive stack (:class:`~graphfl.p2p.grpc_transport.GrpcTransport`,
its :class:`~graphfl.p2p.transport.Mailbox` and codec) on 127.0.0.1 in a ring of ``n`` peers with a
fresh CA. Other peers' certificates let a caller speak as any of them: a neighbour (peer 1 or
``n - 1``) or a stranger with a valid certificate (peer 2 on a ring of 4). :func:`push` sends
crafted frames as one of them; :func:`huge_header`, :func:`frames` and :func:`idle_frames` build
the usual attacks (a declared 2 GB tensor, well-formed messages for any round and value, a stream
that sends nothing). :class:`ConnectionFlood` holds idle and trickling connections open before
authentication (a stranger without a certificate). Nothing here is used by a running peer.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from graphfl.common.certs import PeerTlsFiles, generate_network_certs
from graphfl.common.ports import free_ports
from graphfl.p2p import codec
from graphfl.p2p.codec import TensorSpecs
from graphfl.p2p.grpc_transport import GrpcTransport, Identity
from graphfl.p2p.proto import graphfl_p2p_pb2 as pb
from graphfl.p2p.proto import graphfl_p2p_pb2_grpc as pb_grpc
from graphfl.p2p.topology import Topology, make_topology

DIM = 8
SPECS: TensorSpecs = {"theta": ("float32", (DIM,))}
"""What the target expects on channel ``params``: one float32 vector of :data:`DIM`."""


class TargetPeer:
    """Peer 0 of a ring of ``n`` (mutual TLS, 127.0.0.1) serving its real receive stack.

    Use as a context manager; ``max_round`` bounds the run (messages for later rounds are
    refused), ``horizon`` is how many rounds ahead a message may be, ``stream_timeout`` the
    per-stream deadline.
    """

    def __init__(self, folder: Path, n: int = 4, *, horizon: int = 4, max_round: int | None = None,
                 stream_timeout: float = 1.5) -> None:
        self.topology: Topology = make_topology("ring", n, ports=free_ports(n))
        certs = generate_network_certs(Path(folder) / "certs", n)
        self.files = {i: PeerTlsFiles(certs / "ca.crt", certs / f"peer-{i}.crt", certs / f"peer-{i}.key")
                      for i in range(n)}
        self.transport = GrpcTransport(Identity(0, "dfl-gt", "h", self.topology.fingerprint), self.topology,
                                       self.files[0], horizon=horizon, stream_timeout=stream_timeout)
        self.transport.mailbox.expect("params", SPECS)
        self.transport.mailbox.max_round = max_round

    def __enter__(self) -> TargetPeer:
        self.transport.serve()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.transport.close()

    def verify(self, *peers: int) -> None:
        """Mark ``peers`` as having completed a handshake (as a running peer's neighbours have)."""
        self.transport.verified.update(peers)

    def channel(self, who: int) -> grpc.Channel:
        """A channel to the target with peer ``who``'s certificate."""
        ca, cert, key = self.files[who].read()
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        return grpc.secure_channel(self.topology.peer(0).address, creds,
                                   options=[("grpc.ssl_target_name_override", "peer-0")])

    def push(self, who: int, frames: Iterator[pb.Frame] | list[pb.Frame], timeout: float = 5.0) -> pb.Ack:
        """Push one stream of ``frames`` as peer ``who``; the target's Ack (bounded by ``timeout``)."""
        with self.channel(who) as ch:
            ack: pb.Ack = pb_grpc.PeerStub(ch).Push(iter(frames), timeout=timeout)
        return ack


def frames(sender: int, round_: int, value: float = 1.0, dim: int = DIM) -> list[pb.Frame]:
    """The frames of a well-formed ``params`` message: ``theta`` = ``value`` everywhere."""
    return list(codec.encode(sender, round_, "params", {"theta": np.full(dim, value, np.float32)}))


def huge_header(sender: int, round_: int = 0) -> pb.Frame:
    """A header declaring one 2 GB float32 tensor (no data follows)."""
    return pb.Frame(sender=sender, round=round_, channel="params",
                    header=pb.Header(tensors=[pb.TensorSpec(name="theta", dtype="float32",
                                                            shape=[500_000_000], nbytes=2_000_000_000)]))


def idle_frames(stop: threading.Event, limit: float = 30.0) -> Iterator[pb.Frame]:
    """A stream that sends nothing until ``stop`` is set (or ``limit`` s pass)."""
    stop.wait(limit)
    return
    yield  # pragma: no cover


class ConnectionFlood:
    """A stranger (no certificate, no token) holding connections open before authentication.

    For each port of ``ports`` (``(host, port)``): ``idle`` connections that send nothing and
    ``slow`` ones that send a TLS record header announcing 512 bytes, then one byte every
    ``trickle`` seconds. Each is reopened ``pause`` seconds after the callee closes it, so the
    flood is sustained. ``opened`` counts the connections made. A context manager; :meth:`close`
    stops it (bounded). ``opened_by_port`` counts them per port.
    """

    def __init__(self, ports: list[tuple[str, int]], idle: int, slow: int, pause: float = 0.2,
                 trickle: float = 0.3) -> None:
        self.pause, self.trickle = pause, trickle
        self.stop = threading.Event()
        self.opened = 0
        self.opened_by_port = {port: 0 for _, port in ports}
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._hold, args=(addr, k < slow), daemon=True,
                                         name=f"flood-{addr[1]}-{k}")
                        for addr in ports for k in range(idle + slow)]
        for th in self.threads:
            th.start()

    def __enter__(self) -> ConnectionFlood:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _hold(self, addr: tuple[str, int], slow: bool) -> None:
        while not self.stop.is_set():
            try:
                s = socket.create_connection(addr, timeout=1.0)
            except OSError:
                self.stop.wait(self.pause)
                continue
            with self._lock:
                self.opened += 1
                self.opened_by_port[addr[1]] += 1
            try:
                s.settimeout(self.trickle)
                if slow:
                    s.sendall(b"\x16\x03\x01\x02\x00")
                while not self.stop.is_set():
                    try:
                        if s.recv(1 << 12) == b"":
                            break  # closed by the callee: open another
                    except TimeoutError:
                        if slow:
                            s.sendall(b"\x01")
            except OSError:
                pass
            finally:
                s.close()
            self.stop.wait(self.pause)

    def close(self) -> None:
        self.stop.set()
        for th in self.threads:
            th.join(5.0)
