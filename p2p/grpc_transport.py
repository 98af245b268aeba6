"""gRPC implementation of :class:`~graphfl.p2p.transport.Transport` (one peer per process).

Each peer runs a gRPC server (service ``graphfl.p2p.Peer``) on its address and a client
channel to each neighbour.

* ``Handshake`` — the caller sends (peer id, algorithm, config hash, topology version); the
  callee refuses with a reason if any differs, or if the caller is not its neighbour, or (with
  TLS) if the caller's certificate is not ``peer-<id>``. The reply carries the callee's own
  values (the caller checks them too) and its current round (a restarted peer rejoins there).
* ``Push`` — a client stream of frames (:mod:`graphfl.p2p.codec`). The handler only decodes,
  validates and puts the message into the :class:`~graphfl.p2p.transport.Mailbox`: it never
  makes outbound calls and never waits on other peers. Before it allocates anything it checks,
  in this order: the TLS identity (a certificate that is not a neighbour's is refused before a
  single frame is read), the number of streams that identity already has open
  (``streams_per_sender``), the header's sender (a completed handshake, the same id as the
  certificate), and the declared tensors and round against what the algorithm expects
  (:meth:`~graphfl.p2p.transport.Mailbox.check_header`), so a payload can never be larger than
  the model. Every stream has a deadline (``stream_timeout``, kept by one
  :class:`~graphfl.p2p.watchdog.Watchdog` thread per peer): an idle or trickling stream is
  cancelled and its worker thread freed.

Every outbound call has a deadline; reconnect back-off is capped at 2 s so a neighbour that
comes back is reached again quickly.

A message is encoded and serialised once (:class:`_EncodeCache`) and the same frame bytes are
pushed to every neighbour (``Push`` called with a pass-through serialiser): the wire format is
unchanged, the per-neighbour encode + protobuf serialisation (three copies of the model) is gone.

``data_path="socket"`` (``[run] data-path``) sends the same frames over plain TCP / TLS
connections instead of ``Push`` (:mod:`graphfl.p2p.socket_data`): the handshake reply announces
the data port and a token for the caller. The handshake itself always uses gRPC.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass

import grpc
import numpy as np

from graphfl.common.certs import PeerTlsFiles, peer_name
from graphfl.p2p import codec
from graphfl.p2p.codec import WireError
from graphfl.p2p.proto import graphfl_p2p_pb2 as pb
from graphfl.p2p.proto import graphfl_p2p_pb2_grpc as pb_grpc
from graphfl.p2p.socket_data import DataClient, DataRefused, DataServer, new_token, split_host_port
from graphfl.p2p.topology import Topology
from graphfl.p2p.transport import UNKNOWN_PEER, HandshakeRefused, Mailbox, SendResult, Transport, TransportError
from graphfl.p2p.watchdog import Watchdog

logger = logging.getLogger(__name__)

DEFAULT_STREAM_TIMEOUT = 60.0
"""Seconds one inbound Push stream may stay open (header to last frame)."""
DEFAULT_STREAMS_PER_SENDER = 2
"""Concurrent inbound Push streams accepted from one identity (a neighbour sends one at a time
per channel; two leaves room for a retry)."""
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""The only gRPC status codes that mean "the neighbour cannot be reached" (dead process, cut link,
refused connection, TLS failure, deadline). Anything else is an error to report, not a skip."""
DATA_PATHS = ("grpc", "socket")
"""How messages travel: gRPC ``Push`` streams, or the same frames over TCP (:mod:`graphfl.p2p.socket_data`)."""
SERVICE = "graphfl.p2p.Peer"
PUSH_METHOD = f"/{SERVICE}/Push"
"""The streaming RPC of :class:`~graphfl.p2p.proto.graphfl_p2p_pb2_grpc.PeerStub` (``Push``)."""

GRPC_DEFAULT_MAX_RECEIVE = 4 << 20
"""gRPC's default limit on one received message (one frame here)."""
FRAME_HEADROOM = 1 << 20
"""Bytes a frame may carry beyond ``chunk_bytes`` (a data frame's few bytes of fields; a header
frame's tensor names and shapes)."""

_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.enable_retries", 0),
]


class _EncodedMessage:
    """One message encoded and serialised once (header + chunked data frames as protobuf bytes),
    pushed to every neighbour as it is: the wire bytes are exactly those of the frames, gRPC only
    frames them (no re-encoding, no re-serialisation, no copy per neighbour).
    """

    def __init__(self, frames: list[bytes], payload: int) -> None:
        self.frames = frames
        self.bytes = sum(len(f) for f in frames)
        self.payload = payload


class _EncodeCache:
    """The last few encoded messages, keyed by (round, channel, the arrays' identities, scalars).

    ``send_many`` pushes the same arrays to every neighbour from a thread pool; the first push
    encodes, the others reuse it. Keys hold the arrays themselves (not only ``id``), so an id is
    never reused for a different array while its entry lives.
    """

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._entries: list[tuple[tuple[object, ...], tuple[np.ndarray, ...], _EncodedMessage]] = []

    def get(self, sender: int, round_: int, channel: str, arrays: Mapping[str, np.ndarray],
            scalars: Mapping[str, float] | None, chunk_bytes: int) -> _EncodedMessage:
        held = tuple(arrays.values())
        key = (round_, channel, tuple(arrays), tuple(id(a) for a in held), tuple(sorted((scalars or {}).items())))
        with self._lock:
            for k, _, enc in self._entries:
                if k == key:
                    return enc
            frames = codec.encode_serialized(sender, round_, channel, arrays, scalars, chunk_bytes)
            enc = _EncodedMessage(frames, int(sum(np.asarray(a).nbytes for a in held)))
            # keep only this round's messages (a round's frames are what is in flight anyway)
            self._entries = [e for e in self._entries if e[0][0] == round_][-(self.size - 1):] if self.size > 1 else []
            self._entries.append((key, held, enc))
            return enc


@dataclass(frozen=True)
class Identity:
    """What two peers must agree on to talk."""

    peer_id: int
    algorithm: str
    config_hash: str
    topology_version: str
    network: str = ""


class ListenError(TransportError):
    """A port of this peer cannot be bound (the message names the address and says "bind")."""


class _Servicer(pb_grpc.PeerServicer):
    def __init__(self, transport: GrpcTransport) -> None:
        self.t = transport

    def _tls_name_ok(self, context: grpc.ServicerContext, claimed: int) -> str:
        if self.t.tls is None:
            return ""
        names = context.auth_context().get("x509_common_name", [])
        want = peer_name(claimed).encode()
        if want not in names:
            got = [n.decode(errors="replace") for n in names]
            return f"certificate common name {got} does not match the claimed peer id {claimed} ({want.decode()})"
        return ""

    def Handshake(self, request: pb.Hello, context: grpc.ServicerContext) -> pb.HelloReply:
        t = self.t
        me = t.identity
        reason = ""
        if request.peer_id not in t.neighbours:
            reason = f"peer {request.peer_id} is not a neighbour of peer {me.peer_id} in topology {me.topology_version}"
        else:
            reason = self._tls_name_ok(context, request.peer_id) or _mismatch(me, request)
        reply = pb.HelloReply(
            accepted=not reason, reason=reason, peer_id=me.peer_id, round=t.current_round,
            algorithm=me.algorithm, config_hash="" if reason else me.config_hash, topology_version=me.topology_version,
        )
        if not reason and t.data_server is not None:
            reply.data_port = t.data_server.port
            reply.data_token = t.data_token_for(request.peer_id)
        if reason:
            t.log_refused_handshake(request.peer_id, reason)
        else:
            with t._lock:
                new = request.peer_id not in t.verified
                t.verified.add(request.peer_id)
            if new:
                logger.info("peer %d: handshake from peer %d accepted", me.peer_id, request.peer_id)
        return reply

    def _tls_peer(self, context: grpc.ServicerContext) -> int | None:
        """The peer id in the caller's certificate (``peer-<id>``), or ``None`` without TLS / a name."""
        if self.t.tls is None:
            return None
        for raw in context.auth_context().get("x509_common_name", []):
            name = raw.decode(errors="replace")
            if name.startswith("peer-") and name[5:].isdigit():
                return int(name[5:])
        return -1

    def Push(self, request_iterator: Iterator[pb.Frame | codec.DataFrame], context: grpc.ServicerContext) -> pb.Ack:
        t = self.t
        cert_peer = self._tls_peer(context)
        if cert_peer is not None and cert_peer not in t.neighbours:
            return t.refuse(f"certificate of peer {cert_peer} is not a neighbour's; stream refused unread")
        slot = cert_peer
        if slot is not None and not t.take_stream_slot(slot):
            return t.refuse(f"peer {slot} already has {t.streams_per_sender} open streams; stream refused")
        deadline = t.watchdog.watch(t.stream_timeout, context.cancel)
        try:
            return self._receive(request_iterator, context, cert_peer)
        finally:
            t.watchdog.unwatch(deadline)
            if slot is not None:
                t.release_stream_slot(slot)

    def _receive(self, request_iterator: Iterator[pb.Frame | codec.DataFrame], context: grpc.ServicerContext,
                 cert_peer: int | None) -> pb.Ack:
        t = self.t
        asm = codec.Assembler(t.max_message_bytes)
        try:
            first = next(request_iterator, None)
            if first is None:
                raise WireError("empty message stream")
            asm.header(first)
            assert asm.sender is not None  # header() sets it or raises
            sender = asm.sender
            if sender not in t.verified:
                return t.refuse(f"{UNKNOWN_PEER}: peer {sender} has no accepted handshake with peer {t.peer_id}")
            if cert_peer is not None and cert_peer != sender:
                raise WireError(f"certificate of peer {cert_peer} sent a message claiming peer {sender}")
            refusal = t.mailbox.check_header(sender, int(asm.round or 0), str(asm.channel), asm.declared)
            if refusal is not None:
                return t.refuse(refusal)
            asm.allocate()
            for frame in request_iterator:
                asm.data(frame)
            msg = asm.finish()
        except WireError as exc:
            return t.refuse(f"malformed message: {exc}")
        except grpc.RpcError:  # the stream was cancelled (deadline) or broken by the caller
            return t.refuse(f"stream cancelled after {t.stream_timeout:g} s or broken by the sender")
        ok, reason = t.mailbox.put(msg)
        return pb.Ack(accepted=ok, reason=reason, bytes_received=msg.wire_bytes)


def _add_servicer(servicer: _Servicer, server: grpc.Server) -> None:
    """``pb_grpc.add_PeerServicer_to_server`` with :func:`codec.parse_frame` as Push's deserialiser
    (zero-copy data frames; same service, methods and messages).
    """
    handlers = {
        "Handshake": grpc.unary_unary_rpc_method_handler(
            servicer.Handshake, request_deserializer=pb.Hello.FromString,
            response_serializer=pb.HelloReply.SerializeToString),
        "Push": grpc.stream_unary_rpc_method_handler(
            servicer.Push, request_deserializer=codec.parse_frame, response_serializer=pb.Ack.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


def _mismatch(me: Identity, other: pb.Hello | pb.HelloReply) -> str:
    for what, mine, theirs in (
        ("algorithm", me.algorithm, other.algorithm),
        ("config hash", me.config_hash, other.config_hash),
        ("topology version", me.topology_version, other.topology_version),
    ):
        if mine != theirs:
            if what == "config hash":  # never echo our own hash: a stranger could forge a Hello with it
                return f"config hash differs: peer {other.peer_id} has {theirs!r}, peer {me.peer_id} has another"
            return f"{what} differs: peer {other.peer_id} has {theirs!r}, peer {me.peer_id} has {mine!r}"
    return ""


class GrpcTransport(Transport):
    """Transport over gRPC; see the module docstring.

    Parameters
    ----------
    identity
        This peer's id, algorithm, config hash and topology version.
    topology
        Addresses of this peer (listen) and its neighbours (dial).
    tls
        PEM files for mutual TLS, or ``None`` for plaintext (explicit).
    data_path
        ``"grpc"``: messages in ``Push`` streams; ``"socket"``: the same frames over TCP / TLS
        connections (:mod:`graphfl.p2p.socket_data`). Every peer of a network uses the same.
    """

    def __init__(
        self,
        identity: Identity,
        topology: Topology,
        tls: PeerTlsFiles | None,
        *,
        horizon: int = 64,
        chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES,
        max_message_bytes: int = codec.DEFAULT_MAX_BYTES,
        stream_timeout: float = DEFAULT_STREAM_TIMEOUT,
        streams_per_sender: int = DEFAULT_STREAMS_PER_SENDER,
        data_path: str = "grpc",
    ) -> None:
        if data_path not in DATA_PATHS:
            raise ValueError(f"data_path must be one of {list(DATA_PATHS)}, got {data_path!r}")
        self.identity = identity
        self.peer_id = identity.peer_id
        self.topology = topology
        self.neighbours = topology.neighbours(self.peer_id)
        self.tls = tls
        self.chunk_bytes = chunk_bytes
        self.max_frame_bytes = max(GRPC_DEFAULT_MAX_RECEIVE, chunk_bytes + FRAME_HEADROOM)
        self.max_message_bytes = max_message_bytes
        self.stream_timeout = float(stream_timeout)
        self.streams_per_sender = int(streams_per_sender)
        self._open_streams: dict[int, int] = {}
        self.mailbox = Mailbox(self.peer_id, self.neighbours, horizon)
        self.current_round = 0
        self.verified: set[int] = set()
        self.neighbour_rounds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._handshake_logged = -1e18
        self._handshakes_unlogged = 0
        self._server: grpc.Server | None = None
        self._channels: dict[int, grpc.Channel] = {}
        self._stubs: dict[int, pb_grpc.PeerStub] = {}
        self._raw_push: dict[int, grpc.StreamUnaryMultiCallable] = {}
        self._encoded = _EncodeCache()
        self.watchdog = Watchdog(f"p2p-watchdog-{self.peer_id}")
        self.last_errors: dict[int, str] = {}
        self.data_path = data_path
        self.data_tokens: dict[int, bytes] = {}
        """Tokens this peer gave its callers in accepted handshakes (socket data path)."""
        self.data_contacts: dict[int, tuple[int, bytes]] = {}
        """(data port, token) each neighbour announced to this peer (socket data path)."""
        self.data_server = DataServer(self) if data_path == "socket" else None
        self._data_client = DataClient(self) if data_path == "socket" else None
        self._creds = None
        if tls is not None:
            ca, cert, key = tls.read()
            self._server_creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
            self._creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    # -- server -------------------------------------------------------------------------
    def refuse(self, reason: str) -> pb.Ack:
        """Count and (rate-limited) log a refused inbound message; the Ack names the reason."""
        self.mailbox.note_rejection(reason)
        return pb.Ack(accepted=False, reason=reason)

    def log_refused_handshake(self, caller: int, reason: str) -> None:
        """Log a refused handshake at most once per ``mailbox.log_every`` seconds (the next line
        says how many were refused meanwhile): a stranger repeating handshakes costs a counter, not
        a log line each.
        """
        now = time.monotonic()
        with self._lock:
            if now - self._handshake_logged < self.mailbox.log_every:
                self._handshakes_unlogged += 1
                return
            unlogged, self._handshakes_unlogged, self._handshake_logged = self._handshakes_unlogged, 0, now
        extra = f" ({unlogged} more refused since the last report)" if unlogged else ""
        logger.warning("peer %d refused a handshake from peer %d: %s%s", self.peer_id, caller, reason, extra)

    def data_token_for(self, caller: int) -> bytes:
        """The token ``caller`` presents on its data connections (made once, kept across handshakes
        so a caller's open connections stay valid).
        """
        with self._lock:
            token = self.data_tokens.get(caller)
            if token is None:
                token = self.data_tokens[caller] = new_token()
            return token

    def take_stream_slot(self, who: int) -> bool:
        """Reserve one of ``who``'s concurrent inbound streams (False when all are in use)."""
        with self._lock:
            if self._open_streams.get(who, 0) >= self.streams_per_sender:
                return False
            self._open_streams[who] = self._open_streams.get(who, 0) + 1
            return True

    def release_stream_slot(self, who: int) -> None:
        """Free a slot taken by :meth:`take_stream_slot`."""
        with self._lock:
            self._open_streams[who] = max(0, self._open_streams.get(who, 0) - 1)

    def serve(self, listen: str | None = None) -> int:
        """Start listening on this peer's address (or on ``listen``); returns the bound port.

        ``listen`` (``HOST:PORT``) separates where the peer binds from the address its neighbours
        dial (the network file's): behind port forwarding, a NAT or a link emulator (``graphfl
        bench network``), the two differ. The network file, and so the fingerprint, is unchanged.
        """
        addr = listen or self.topology.peer(self.peer_id).address
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.streams_per_sender * len(self.neighbours) + 8,
                                       thread_name_prefix=f"p2p-rx-{self.peer_id}"),
            options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", self.max_frame_bytes)],
        )
        _add_servicer(_Servicer(self), server)
        try:
            port = server.add_secure_port(addr, self._server_creds) if self.tls else server.add_insecure_port(addr)
        except RuntimeError as exc:
            raise ListenError(f"peer {self.peer_id}: gRPC listener cannot bind {addr}: {exc}") from None
        if port == 0:
            raise ListenError(f"peer {self.peer_id}: gRPC listener cannot bind {addr} (address in use?)")
        server.start()
        self._server = server
        if self.data_server is not None:
            try:
                host = split_host_port(addr)[0]
            except ValueError as exc:
                raise TransportError(f"peer {self.peer_id}: socket data path: {exc}") from None
            try:
                self.data_server.start(host, self.topology.peer(self.peer_id).data_port)
            except OSError as exc:
                raise ListenError(f"peer {self.peer_id}: socket data path: {exc.strerror or exc}") from None
        logger.info("peer %d listening on %s (%s, data path %s)", self.peer_id, addr,
                    "mutual TLS" if self.tls else "plaintext", self.data_path)
        return int(port)

    # -- client -------------------------------------------------------------------------
    def _stub(self, j: int) -> pb_grpc.PeerStub:
        stub = self._stubs.get(j)
        if stub is None:
            addr = self.topology.peer(j).address
            if self._creds is not None:
                options = [*_CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", peer_name(j))]
                ch = grpc.secure_channel(addr, self._creds, options=options)
            else:
                ch = grpc.insecure_channel(addr, options=_CHANNEL_OPTIONS)
            self._channels[j] = ch
            stub = self._stubs[j] = pb_grpc.PeerStub(ch)
            # Push with frames serialised once (_EncodedMessage): the same RPC and the same bytes
            self._raw_push[j] = ch.stream_unary(PUSH_METHOD, request_serializer=None,
                                                response_deserializer=pb.Ack.FromString)
        return stub

    def handshake(self, j: int, timeout: float) -> pb.HelloReply:
        """One handshake with neighbour ``j`` (raises ``grpc.RpcError`` if unreachable)."""
        me = self.identity
        reply: pb.HelloReply = self._stub(j).Handshake(
            pb.Hello(peer_id=me.peer_id, algorithm=me.algorithm, config_hash=me.config_hash,
                     topology_version=me.topology_version, network=me.network),
            timeout=timeout,
        )
        if not reply.accepted:
            raise HandshakeRefused(f"peer {j} refused peer {self.peer_id}: {reply.reason}")
        reason = _mismatch(me, reply)
        if not reason and self._data_client is not None and not (reply.data_port and reply.data_token):
            reason = f"peer {j} announced no socket data port (data-path differs?)"
        if reason:
            raise HandshakeRefused(f"peer {self.peer_id} refuses peer {j}: {reason}")
        old: tuple[int, bytes] | None = None
        with self._lock:
            self.verified.add(j)
            self.neighbour_rounds[j] = int(reply.round)
            if self._data_client is not None:
                old = self.data_contacts.get(j)
                self.data_contacts[j] = (int(reply.data_port), bytes(reply.data_token))
        if self._data_client is not None and old is not None and old != self.data_contacts[j]:
            self._data_client.forget(j)  # the neighbour restarted: its old connections are dead
        return reply

    def start(self, timeout: float) -> set[int]:
        """Handshake with every neighbour, retrying until ``timeout`` s; returns those reached.

        Raises
        ------
        HandshakeRefused
            At once, if a neighbour refuses (different algorithm/config/topology, not a neighbour,
            wrong certificate name).
        """
        deadline = time.monotonic() + timeout
        pending = set(self.neighbours)
        last_error: dict[int, str] = {}
        while pending and time.monotonic() < deadline:
            for j in sorted(pending):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    self.handshake(j, timeout=min(2.0, left))
                    pending.discard(j)
                except grpc.RpcError as exc:
                    if exc.code() not in _UNREACHABLE:
                        raise TransportError(f"peer {self.peer_id}: handshake with peer {j} failed with "
                                             f"{exc.code().name}: {exc.details()}") from exc
                    last_error[j] = f"{exc.code().name}: {exc.details()}"
            if pending:
                time.sleep(0.1)
        for j in sorted(pending):
            logger.warning(
                "peer %d: no handshake with neighbour %d within %.1f s (last error: %s)",
                self.peer_id, j, timeout, last_error.get(j, "none"),
            )
        self.last_errors = last_error
        return set(self.neighbours) - pending

    def send(self, to: int, round_: int, channel: str, arrays: Mapping[str, np.ndarray],
             scalars: Mapping[str, float] | None = None, timeout: float = 30.0) -> SendResult:
        """Push one message to neighbour ``to`` (handshaking first if needed).

        Only network failures (``grpc.RpcError`` with UNAVAILABLE / DEADLINE_EXCEEDED, ``OSError``)
        give ``unreachable=True``. A local error (e.g. a tensor the wire cannot carry) raises
        here with its traceback, even when gRPC met it while streaming the frames.

        Raises
        ------
        WireError
            If ``arrays`` cannot be encoded.
        """
        codec.check_encodable(channel, arrays)
        stream = self._encoded.get(self.peer_id, round_, channel, arrays, scalars, self.chunk_bytes)
        if self._data_client is not None:
            return self._send_socket(to, stream, timeout)
        for attempt in range(2):
            try:
                if to not in self.verified:
                    self.handshake(to, timeout=min(2.0, timeout))
                self._stub(to)
                ack = self._raw_push[to](iter(stream.frames), timeout=timeout)
            except HandshakeRefused as exc:
                return SendResult(to, False, str(exc))
            except grpc.RpcError as exc:
                return self._rpc_failed(to, exc)
            except OSError as exc:
                self._unverify(to)
                return SendResult(to, False, f"peer {to}: {exc}", unreachable=True)
            if not ack.accepted and ack.reason.startswith(UNKNOWN_PEER) and attempt == 0:
                self._unverify(to)  # the neighbour restarted: handshake again, resend once
                continue
            return self._acked(to, stream, ack)
        return SendResult(to, False, "neighbour does not accept our handshake")

    def _unverify(self, to: int) -> None:
        """Forget the handshake with ``to``: the next send handshakes again."""
        with self._lock:
            self.verified.discard(to)

    def _rpc_failed(self, to: int, exc: grpc.RpcError) -> SendResult:
        """A failed gRPC call to ``to``: unreachable only for :data:`_UNREACHABLE` codes."""
        self._unverify(to)
        code = exc.code()
        return SendResult(to, False, f"peer {to}: {code.name}: {exc.details()}", unreachable=code in _UNREACHABLE)

    def _acked(self, to: int, stream: _EncodedMessage, ack: pb.Ack) -> SendResult:
        if ack.accepted:
            self.mailbox.stats.count_sent(to, stream.bytes, stream.payload)
        return SendResult(to, ack.accepted, ack.reason, stream.bytes, stream.payload)

    def _send_socket(self, to: int, stream: _EncodedMessage, timeout: float) -> SendResult:
        """:meth:`send` over the socket data path: handshake (gRPC) if needed, then the frames on
        a data connection. A failed connection is retried once after a fresh handshake (the
        neighbour may have restarted on a new data port), within the same ``timeout``. (A message's
        Ack never says ``unknown-peer`` here: the token was checked when the connection opened.)
        """
        assert self._data_client is not None
        deadline = time.monotonic() + timeout
        last = "send deadline passed"
        for attempt in range(2):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                if to not in self.verified or to not in self.data_contacts:
                    self.handshake(to, timeout=min(2.0, left))
                ack = self._data_client.push(to, stream.frames, deadline)
            except HandshakeRefused as exc:
                return SendResult(to, False, str(exc))
            except grpc.RpcError as exc:
                return self._rpc_failed(to, exc)
            except DataRefused as exc:
                if exc.reason.startswith(UNKNOWN_PEER) and attempt == 0:
                    self._unverify(to)
                    continue
                return SendResult(to, False, exc.reason)
            except OSError as exc:  # refused, reset, TLS failure, timeout: handshake again once
                self._unverify(to)
                last = f"peer {to}: data connection: {type(exc).__name__}: {exc}"
                continue
            return self._acked(to, stream, ack)
        return SendResult(to, False, last, unreachable=True)

    def stats(self) -> dict[str, int]:
        """The mailbox's counters; on the socket data path also ``preauth_dropped``: data
        connections dropped before authentication (no certificate, deadline, evicted, closed).
        """
        out = super().stats()
        if self.data_server is not None:
            out["preauth_dropped"] = sum(self.data_server.preauth_counts().values())
        return out

    def advance(self, round_: int) -> None:
        self.current_round = round_
        self.mailbox.advance(round_)

    def close(self) -> None:
        super().close()
        if self._data_client is not None:
            self._data_client.close()
        if self.data_server is not None:
            self.data_server.close()
        for ch in self._channels.values():
            ch.close()
        if self._server is not None:
            self._server.stop(grace=0.5).wait(2.0)
            self._server = None
        self.watchdog.close()
