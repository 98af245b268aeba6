"""Socket data path: a peer's frames over plain TCP (or TLS) connections beside its gRPC service.

With ``[run] data-path = "socket"`` the gRPC ``Handshake`` stays as it is (identity, config
hash, topology, TLS names) and its reply also announces the callee's **data port** and a random
**token** for this caller. Messages then travel over a TCP connection to that port instead of
gRPC's ``Push`` stream. The frames are the same bytes (:func:`graphfl.p2p.codec.encode_serialized`:
a protobuf ``Frame`` header, then chunked data frames); only gRPC's HTTP/2 envelope is replaced
by a 4-byte length. Why (docs/p2p.md, "Socket data path"): on a 2-core machine a ring of peers
is CPU-bound, and gRPC's Python binding spends about twice a raw socket's CPU per byte (it
copies every received message slice by slice into a ``bytearray`` and then a ``bytes``, copies
every sent message into a core slice, and hands each message between two threads). Here a data
frame's payload is read by ``recv_into`` straight into the buffer that becomes the tensor.

Protocol (``record(x)`` = uint32 little-endian length of ``x``, then ``x``)::

    caller -> callee   b"GFL1" | int32 LE caller id | 16-byte token          (once per connection)
    callee -> caller   record(Ack)        accepted; or refused with the reason, then closed
    caller -> callee   record(frame) ...  one message: header frame, then its data frames
    callee -> caller   record(Ack)        as Push's reply (accepted, reason, bytes received)
    ... further messages, one at a time per connection

The callee knows where a message ends from its header (the declared tensors' bytes).

What a receiver checks, and when (the same checks as the gRPC ``Push``, see
:mod:`graphfl.p2p.grpc_transport`):

* before authentication (one thread, non-blocking, :class:`DataServer`): at most
  ``preauth_max`` (:data:`PREAUTH_MAX`) connections are in their TLS handshake / preamble at
  once, apart from the authenticated ones, and each must complete both within
  ``preauth_timeout`` (:data:`PREAUTH_TIMEOUT`) of its accept. A new connection always gets in:
  when the budget is full, the pending connection that has sent the fewest bytes (the oldest
  among those) is closed to make room, so idle and trickling connections cannot keep a caller
  that speaks (a TLS ClientHello, a preamble) from authenticating. With TLS the client
  certificate must name a neighbour (``peer-<j>``) before the preamble is read. Connections
  dropped in this phase are counted by cause and logged rate-limited (:class:`PreauthLog`);
* the preamble: the token is the one this peer gave the claimed id in an accepted handshake
  (compared in constant time); with TLS, the client certificate is ``peer-<claimed id>``; the
  claimed id may have at most ``streams_per_sender`` connections open (slots per identity,
  taken only after these checks, so strangers never hold one). When all of them are taken, the
  new, authenticated connection replaces the identity's least recently used idle one (waiting
  between messages), which is closed: a peer that restarted while its old connections stayed
  half-open (a partition: no FIN or RST reached this peer) gets its slots back at once instead of
  after :data:`IDLE_TIMEOUT`. Only a connection that passed every check above can replace one,
  and only one of its own identity; a connection in the middle of a message is never replaced,
  so with every slot busy the new one is refused;
* every frame: its length is at most ``max_frame_bytes`` before anything is allocated;
* every message: the header's sender is the connection's, and its declared tensors and round
  pass :meth:`~graphfl.p2p.transport.Mailbox.check_header` before the receive buffers are made;
  the whole message must arrive within ``stream_timeout`` (one
  :class:`~graphfl.p2p.watchdog.Watchdog` deadline per message cuts a trickling sender);
* a connection idle for ``IDLE_TIMEOUT`` between messages is closed (the sender reconnects).

A refused header is answered at once and the message's declared bytes are read and dropped,
so the connection stays usable; a malformed frame closes the connection.
"""

from __future__ import annotations

import fcntl
import hmac
import logging
import os
import secrets
import selectors
import socket
import ssl
import struct
import termios
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from graphfl.common.certs import PeerTlsFiles, peer_name
from graphfl.p2p import codec
from graphfl.p2p.codec import WireError
from graphfl.p2p.proto import graphfl_p2p_pb2 as pb
from graphfl.p2p.transport import UNKNOWN_PEER

if TYPE_CHECKING:  # the transport owns the server and client below
    from graphfl.p2p.grpc_transport import GrpcTransport

logger = logging.getLogger(__name__)

MAGIC = b"GFL1"
TOKEN_BYTES = 16
PREAMBLE = struct.Struct("<4si16s")
"""Magic, caller id, token: what a caller sends first on a data connection."""
_LEN = struct.Struct("<I")
PREAUTH_TIMEOUT = 3.0
"""Seconds an inbound connection has, from its accept, for its TLS handshake and preamble."""
PREAUTH_MAX = 32
"""Connections at most before authentication at once (the pre-auth budget, apart from the
per-identity slots of authenticated connections)."""
PREAUTH_LOG_EVERY = 5.0
"""Seconds between two log lines about connections dropped before authentication."""
IDLE_TIMEOUT = 600.0
"""Seconds an inbound connection may wait for its next message before the callee closes it."""
ACK_LIMIT = 1 << 16
"""Largest Ack record a caller reads (an Ack is a flag, a reason and a count)."""
_HEAD = 128
"""Bytes of a frame read first: enough for a data frame's fields before its payload."""
_SMALL = 1 << 16
"""Records up to this size are written with their length in one system call."""


class DataRefused(ConnectionError):
    """The callee refused a data connection (the reason is its Ack's)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def split_host_port(address: str) -> tuple[str, int]:
    """``("host", port)`` of ``HOST:PORT`` or ``[IPv6]:PORT``."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock`` (``ConnectionError`` if it closes first)."""
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (``ConnectionError`` if it closes first)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k


def _fill(sock: socket.socket, dest: memoryview, head: bytes, start: int) -> None:
    """Fill ``dest`` with ``head[start:]`` (bytes already read), then from ``sock``."""
    have = len(head) - start
    if have:
        dest[:have] = head[start:]
    recv_into_exact(sock, dest[have:])


def write_record(sock: socket.socket, data: bytes) -> None:
    """``record(data)``: its uint32 length, then the bytes (one write when small, two when large:
    copying a data frame to prepend 4 bytes would cost more than the second system call).
    """
    if len(data) <= _SMALL:
        sock.sendall(_LEN.pack(len(data)) + data)
    else:
        sock.sendall(_LEN.pack(len(data)))
        sock.sendall(data)


def read_length(sock: socket.socket) -> int:
    """The uint32 length that starts a record."""
    return int(_LEN.unpack(recv_exact(sock, _LEN.size))[0])


def read_ack(sock: socket.socket) -> pb.Ack:
    """One ``record(Ack)`` (``ConnectionError`` if it is longer than :data:`ACK_LIMIT` or not an Ack)."""
    n = read_length(sock)
    if n > ACK_LIMIT:
        raise ConnectionError(f"reply of {n} bytes is not an Ack")
    try:
        return pb.Ack.FromString(recv_exact(sock, n))
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError: the callee speaks something else
        raise ConnectionError(f"reply is not an Ack: {exc}") from None


def server_context(tls: PeerTlsFiles) -> ssl.SSLContext:
    """Mutual TLS, callee side: present our certificate, require one signed by the network CA."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(tls.ca))
    ctx.load_cert_chain(str(tls.cert), str(tls.key))
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(tls: PeerTlsFiles) -> ssl.SSLContext:
    """Mutual TLS, caller side: the callee must present ``peer-<id>`` signed by the network CA."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(tls.ca))
    ctx.load_cert_chain(str(tls.cert), str(tls.key))
    return ctx


def certificate_names(sock: socket.socket) -> list[str]:
    """Common names of the peer certificate of a TLS socket (empty without TLS)."""
    if not isinstance(sock, ssl.SSLSocket):
        return []
    cert = sock.getpeercert() or {}
    subject: Sequence[Sequence[tuple[str, str]]] = cert.get("subject", ())  # type: ignore[assignment]
    return [value for rdn in subject for key, value in rdn if key == "commonName"]


class _Inbound:
    """One authenticated connection: its socket and a duplicate of it that can shut it down from
    another thread (a deadline) without racing the reader for the socket object.

    ``who`` is the sender's identity, ``last_used`` when its last message ended (or when it was
    admitted), ``busy`` whether a message is being read or answered, ``replaced`` whether a newer
    connection of ``who`` took its slot (:meth:`DataServer._claim_slot`). The three flags change
    under the server's lock.
    """

    def __init__(self, sock: socket.socket, who: int) -> None:
        self.sock = sock
        self.control = socket.socket(fileno=os.dup(sock.fileno()))
        self.who = who
        self.last_used = time.monotonic()
        self.busy = False
        self.replaced = False

    def abort(self) -> None:
        try:
            self.control.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        for s in (self.sock, self.control):
            try:
                s.close()
            except OSError:
                pass


def _unread(sock: socket.socket) -> int:
    """Bytes the kernel holds for ``sock`` that nobody has read yet (``FIONREAD``; 0 on error)."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0])
    except (OSError, ValueError):
        return 0


class _Pending:
    """A connection before authentication: its non-blocking socket, when it was accepted, how many
    bytes it has sent so far (its progress) and the part of its preamble read.
    """

    __slots__ = ("buf", "bytes_in", "since", "sock", "tls_done")

    def __init__(self, sock: socket.socket, since: float) -> None:
        self.sock = sock
        self.since = since
        self.bytes_in = 0
        self.buf = bytearray()
        self.tls_done = False


class PreauthLog:
    """Connections dropped before authentication, counted by cause and logged without flooding.

    The first drop after a quiet interval is logged at once with its reason (so a real refusal is
    visible); the ones that follow within ``every`` seconds are only counted and reported as one
    summary line per interval (:meth:`flush`). Causes: ``tls`` (the TLS handshake failed, e.g.
    no client certificate), ``deadline`` (no handshake and preamble within the pre-auth deadline),
    ``evicted`` (dropped for a newer connection while the pre-auth budget was full), ``closed``
    (the caller closed before its preamble).
    """

    CAUSES = ("tls", "deadline", "evicted", "closed")

    def __init__(self, peer_id: int, every: float) -> None:
        self.peer_id = peer_id
        self.every = every
        self.totals = dict.fromkeys(self.CAUSES, 0)
        self._window = dict.fromkeys(self.CAUSES, 0)
        self._last = -1e18
        self._lock = threading.Lock()

    def note(self, cause: str, reason: str, now: float) -> None:
        """Count one drop; log it when the last line is older than ``every`` seconds."""
        with self._lock:
            self.totals[cause] += 1
            if now - self._last < self.every or any(self._window.values()):
                self._window[cause] += 1
                return
            self._last = now
        logger.warning("peer %d: data connection dropped before authentication (%s): %s (further drops are "
                       "summarised every %g s)", self.peer_id, cause, reason, self.every)

    def flush(self, now: float) -> None:
        """Log the drops counted since the last line, at most once per ``every`` seconds."""
        with self._lock:
            if not any(self._window.values()) or now - self._last < self.every:
                return
            window, self._window, self._last = self._window, dict.fromkeys(self.CAUSES, 0), now
        logger.warning("peer %d: %d data connection(s) dropped before authentication in the last %g s (%s)",
                       self.peer_id, sum(window.values()), self.every,
                       ", ".join(f"{k}: {v}" for k, v in window.items() if v))


_LISTENER, _WAKE = object(), object()
"""Selector keys of the listening socket and of the close wake-up."""


class DataServer:
    """The callee side: one thread accepts connections and takes each through its TLS handshake
    and preamble (non-blocking, within the pre-auth budget and deadline); an authenticated
    connection gets its own reader thread (see the module docstring).

    Parameters
    ----------
    transport
        The owning transport: its identity, neighbours, mailbox, limits, watchdog and tokens.
    """

    def __init__(self, transport: GrpcTransport) -> None:
        self.t = transport
        self._ctx = server_context(transport.tls) if transport.tls is not None else None
        self.preauth_max = PREAUTH_MAX
        self.preauth_timeout = PREAUTH_TIMEOUT
        self._log = PreauthLog(transport.peer_id, PREAUTH_LOG_EVERY)
        self._listener: socket.socket | None = None
        self._accepter: threading.Thread | None = None
        self._sel: selectors.BaseSelector | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._pending: dict[_Pending, None] = {}
        """Connections before authentication, oldest first (touched by the accept thread only)."""
        self._live: set[_Inbound] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.port = 0

    def start(self, host: str, port: int = 0) -> int:
        """Listen on ``host:port`` (0 = any free port); returns the bound port.

        The listener sets ``SO_REUSEADDR`` (never ``SO_REUSEPORT``): a peer restarted at once on a
        fixed ``data-port`` binds although its previous connections linger in ``FIN-WAIT`` /
        ``TIME-WAIT``; a port another process listens on is still an error.

        Raises
        ------
        OSError
            The port cannot be bound; the message names ``host:port`` and says "bind".
        """
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(1024)
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            raise OSError(exc.errno, f"data listener cannot bind {host}:{port}: {exc.strerror or exc}") from None
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._wake = socket.socketpair()
        self._wake[0].setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, _LISTENER)
        self._sel.register(self._wake[0], selectors.EVENT_READ, _WAKE)
        self._accepter = threading.Thread(target=self._accept_loop, name=f"p2p-data-accept-{self.t.peer_id}",
                                          daemon=True)
        self._accepter.start()
        logger.info("peer %d: socket data path listening on %s:%d", self.t.peer_id, host, self.port)
        return self.port

    def close(self, timeout: float = 2.0) -> None:
        """Stop accepting, cut every connection, wait (bounded) for the threads."""
        with self._lock:
            self._closed = True
            live, threads = list(self._live), list(self._threads)
        end = time.monotonic() + timeout
        if self._accepter is not None and self._wake is not None:
            try:
                self._wake[1].send(b"x")
            except OSError:
                pass
            self._accepter.join(timeout)  # it closes the listener and the pending connections
        elif self._listener is not None:
            self._listener.close()
        for conn in live:
            conn.abort()
        for th in threads:
            th.join(max(0.0, end - time.monotonic()))

    def preauth_open(self) -> int:
        """Connections now before authentication (at most :attr:`preauth_max`)."""
        return len(self._pending)

    def preauth_counts(self) -> dict[str, int]:
        """Connections dropped before authentication so far, by cause (see :class:`PreauthLog`)."""
        with self._log._lock:
            return dict(self._log.totals)

    # -- before authentication: one thread, non-blocking ----------------------------------
    def _accept_loop(self) -> None:
        assert self._sel is not None and self._listener is not None and self._wake is not None
        sel = self._sel
        try:
            while not self._closed:
                events = sel.select(self._next_timeout(time.monotonic()))
                if self._closed:
                    return
                for key, mask in events:
                    if key.data is _LISTENER:
                        self._accept_ready()
                    elif key.data is _WAKE:
                        try:
                            self._wake[0].recv(64)
                        except OSError:
                            pass
                    elif key.data in self._pending:
                        self._advance(key.data, mask)
                now = time.monotonic()
                self._expire(now)
                self._log.flush(now)
        except Exception:  # a bug here must not pass silently; the peer's data path stops accepting
            logger.exception("peer %d: the data listener failed", self.t.peer_id)
        finally:
            for p in list(self._pending):
                p.sock.close()
            self._pending.clear()
            sel.close()
            self._listener.close()
            for s in self._wake:
                s.close()

    def _next_timeout(self, now: float) -> float:
        """Seconds until the oldest pending connection's deadline (or the next log interval)."""
        oldest = next(iter(self._pending), None)
        if oldest is None:
            return PREAUTH_LOG_EVERY
        return min(PREAUTH_LOG_EVERY, max(0.0, oldest.since + self.preauth_timeout - now))

    def _accept_ready(self) -> None:
        assert self._listener is not None and self._sel is not None
        for _ in range(8):  # then deadlines and the pending connections get their turn
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of file descriptors: make room by the rule below, try later
                victim = self._victim()
                if victim is not None:
                    self._drop(victim, "evicted", f"to free a file descriptor ({exc})")
                else:  # nothing to drop: wait a little rather than spin on a listener that stays readable
                    self._log.note("closed", f"accept failed: {exc}", time.monotonic())
                    time.sleep(0.05)
                return
            now = time.monotonic()
            victim = self._victim() if len(self._pending) >= self.preauth_max else None
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._ctx is not None:
                    sock = self._ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            except OSError as exc:
                sock.close()
                self._log.note("closed", f"{type(exc).__name__}: {exc}", now)
                continue
            p = _Pending(sock, now)
            self._pending[p] = None
            self._sel.register(sock, selectors.EVENT_READ, p)
            if victim is not None:  # the budget is full: the new connection takes the place of the victim
                self._drop(victim, "evicted", f"pre-auth budget of {self.preauth_max} connections full; the "
                                              f"one with the least progress ({victim.bytes_in} bytes in "
                                              f"{now - victim.since:.2f} s) made room for a new one")

    def _victim(self) -> _Pending | None:
        """The pending connection that makes room: the one that has sent the fewest bytes (read,
        or waiting in the kernel's buffer), the oldest among those. A caller that speaks (a TLS
        ClientHello, a preamble) outranks idle and trickling connections as soon as its first
        bytes arrive, before this thread has read them, so a flood of those cannot push it out.
        """
        return min(self._pending, key=lambda p: (p.bytes_in + _unread(p.sock), p.since), default=None)

    def _drop(self, p: _Pending, cause: str, reason: str) -> None:
        assert self._sel is not None
        self._forget(p)
        p.sock.close()
        self._log.note(cause, reason, time.monotonic())

    def _forget(self, p: _Pending) -> None:
        assert self._sel is not None
        self._pending.pop(p, None)
        try:
            self._sel.unregister(p.sock)
        except (KeyError, ValueError, OSError):
            pass

    def _expire(self, now: float) -> None:
        for p in list(self._pending):  # oldest first: stop at the first one still in time
            if now - p.since < self.preauth_timeout:
                return
            self._drop(p, "deadline", f"no TLS handshake and preamble within {self.preauth_timeout:g} s "
                                      f"({p.bytes_in} bytes received)")

    def _advance(self, p: _Pending, mask: int) -> None:
        """Take ``p`` as far through its TLS handshake and preamble as the bytes received allow."""
        assert self._sel is not None
        try:
            if self._ctx is not None and not p.tls_done:
                before = _unread(p.sock)
                if mask & selectors.EVENT_READ and before == 0:
                    self._drop(p, "closed", "closed before its TLS handshake")
                    return
                try:
                    p.sock.do_handshake()  # type: ignore[attr-defined]
                except ssl.SSLWantReadError:
                    self._sel.modify(p.sock, selectors.EVENT_READ, p)
                    return
                except ssl.SSLWantWriteError:
                    self._sel.modify(p.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, p)
                    return
                finally:
                    p.bytes_in += max(0, before - _unread(p.sock))
                p.tls_done = True
                self._sel.modify(p.sock, selectors.EVENT_READ, p)
                names = certificate_names(p.sock)
                if not any(peer_name(j) in names for j in self.t.neighbours):
                    self._refuse(p, f"certificate common name {names} is not a neighbour's of peer {self.t.peer_id}")
                    return
            while len(p.buf) < PREAMBLE.size:
                try:
                    data = p.sock.recv(PREAMBLE.size - len(p.buf))
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                    return
                if not data:
                    self._drop(p, "closed", f"closed after {len(p.buf)} bytes of its preamble")
                    return
                p.buf += data
                if self._ctx is None:
                    p.bytes_in += len(data)
        except OSError as exc:  # ssl.SSLError included: no client certificate, not TLS, a reset
            tls = self._ctx is not None and not p.tls_done
            self._drop(p, "tls" if tls else "closed",
                       f"{'TLS handshake failed' if tls else 'connection failed'}: {type(exc).__name__}: {exc}")
            return
        self._authenticate(p)

    def _authenticate(self, p: _Pending) -> None:
        """The preamble is complete: admit the claimed identity into one of its slots and give the
        connection a reader thread, or answer the refusal and close.
        """
        self._forget(p)
        magic, who, token = PREAMBLE.unpack(bytes(p.buf))
        reason = self._admit(p.sock, magic, who, token)
        if not reason and not self._claim_slot(who):
            reason = (f"peer {who} already has {self.t.streams_per_sender} open data connections, each in the "
                      "middle of a message; refused")
        if reason:
            self._refuse(p, reason)
            return
        try:
            p.sock.settimeout(self.preauth_timeout)
            conn = _Inbound(p.sock, who)
        except OSError as exc:  # out of file descriptors: this connection only
            self.t.release_stream_slot(who)
            p.sock.close()
            self.t.mailbox.note_rejection(f"data connection of peer {who} refused: {exc}")
            return
        with self._lock:
            if self._closed:
                self.t.release_stream_slot(who)
                conn.close()
                return
            self._live.add(conn)
            th = threading.Thread(target=self._serve, args=(conn, who), daemon=True,
                                  name=f"p2p-data-rx-{self.t.peer_id}")
            self._threads.add(th)
        th.start()

    def _claim_slot(self, who: int) -> bool:
        """A slot of ``who`` for a connection that passed authentication: a free one, or the slot of
        ``who``'s least recently used idle connection, which is closed (its reader thread ends
        without freeing the slot: it is this connection's now). False when every connection of
        ``who`` is in the middle of a message.
        """
        with self._lock:
            if self.t.take_stream_slot(who):
                return True
            idle = [c for c in self._live if c.who == who and not c.busy and not c.replaced]
            victim = min(idle, key=lambda c: c.last_used, default=None)
            if victim is None:
                return False
            victim.replaced = True
            # no longer live from this moment: the peer may see its close before its reader thread ends
            self._live.discard(victim)
            idle_s = time.monotonic() - victim.last_used
        victim.abort()
        logger.info("peer %d: a new data connection of peer %d replaced its least recently used idle one (idle "
                    "%.1f s; all %d slots were taken: a restarted peer's old connections, or ones it closed)",
                    self.t.peer_id, who, idle_s, self.t.streams_per_sender)
        return True

    def _refuse(self, p: _Pending, reason: str) -> None:
        """Count the refusal (rate-limited log), answer it with its reason when the socket takes
        the few bytes at once, and close.
        """
        self._forget(p)
        self.t.mailbox.note_rejection(reason)
        try:
            p.sock.settimeout(0.2)
            write_record(p.sock, pb.Ack(accepted=False, reason=reason).SerializeToString())
        except OSError:
            pass
        p.sock.close()

    # -- one authenticated connection ----------------------------------------------------
    def _serve(self, conn: _Inbound, who: int) -> None:
        t = self.t
        try:
            write_record(conn.sock, pb.Ack(accepted=True).SerializeToString())
            while True:
                conn.sock.settimeout(IDLE_TIMEOUT)
                first = read_length(conn.sock)
                with self._lock:
                    if conn.replaced:  # a newer connection of the same peer took the slot meanwhile
                        return
                    conn.busy = True
                try:
                    if not self._message(conn, who, first):
                        return
                finally:
                    with self._lock:
                        conn.busy = False
                        conn.last_used = time.monotonic()
        except (OSError, ValueError, struct.error) as exc:  # closed, cut by a deadline, idle
            logger.debug("peer %d: data connection ended: %s", t.peer_id, exc)
        except Exception:  # a bug here must not pass silently; the connection closes, the peer serves on
            logger.exception("peer %d: data connection failed", t.peer_id)
        finally:
            with self._lock:
                self._live.discard(conn)
                self._threads.discard(threading.current_thread())
                if not conn.replaced:  # a replaced connection's slot belongs to the one that replaced it
                    t.release_stream_slot(who)
            conn.close()

    def _admit(self, sock: socket.socket, magic: bytes, who: int, token: bytes) -> str:
        """Why the preamble is refused ("" = admitted)."""
        t = self.t
        if magic != MAGIC:
            return "not a graphfl data connection (bad preamble)"
        if who not in t.neighbours:
            return f"peer {who} is not a neighbour of peer {t.peer_id}"
        if t.tls is not None and peer_name(who) not in certificate_names(sock):
            return f"certificate common name {certificate_names(sock)} does not match the claimed peer id {who}"
        issued = t.data_tokens.get(who)
        if issued is None or not hmac.compare_digest(issued, token):
            return f"{UNKNOWN_PEER}: peer {who} has no accepted handshake with peer {t.peer_id} for this token"
        return ""

    def _message(self, conn: _Inbound, sender: int, first: int) -> bool:
        """Read one message whose first frame is ``first`` bytes; answer it. False = close."""
        t = self.t
        deadline = t.watchdog.watch(t.stream_timeout, conn.abort)
        sock = conn.sock
        try:
            sock.settimeout(t.stream_timeout)
            asm = codec.Assembler(t.max_message_bytes)
            try:
                head = self._read_frame(sock, first)
                if head is None:  # (only data frames are received in place, and only with an Assembler)
                    raise WireError("the first frame of a message must be a header")
                asm.header(head)
                if asm.sender != sender:
                    raise WireError(f"connection of peer {sender} sent a message claiming peer {asm.sender}")
                refusal = t.mailbox.check_header(sender, int(asm.round or 0), str(asm.channel), asm.declared)
                if refusal is None:
                    asm.allocate()
                    while not asm.complete:
                        frame = self._read_frame(sock, read_length(sock), asm)
                        if frame is not None:  # not already received in place
                            asm.data(frame)
                    msg = asm.finish()
            except WireError as exc:
                reason = f"malformed message: {exc}"
                t.mailbox.note_rejection(reason)
                write_record(sock, pb.Ack(accepted=False, reason=reason).SerializeToString())
                return False
            if refusal is not None:  # answered at once; the declared bytes are read and dropped
                t.mailbox.note_rejection(refusal)
                write_record(sock, pb.Ack(accepted=False, reason=refusal).SerializeToString())
                try:
                    self._skip(sock, asm.payload_bytes)
                except WireError as exc:  # its Ack is sent: close without a second one
                    logger.debug("peer %d: closing a data connection: %s", t.peer_id, exc)
                    return False
                return True
        finally:
            t.watchdog.unwatch(deadline)
        try:
            ok, reason = t.mailbox.put(msg)
        except Exception as exc:  # as gRPC answers a failing handler (status UNKNOWN): refused, not unreachable
            logger.exception("peer %d: storing a message from peer %d failed", t.peer_id, sender)
            ok, reason = False, f"UNKNOWN: the receiver failed to store the message: {type(exc).__name__}: {exc}"
        write_record(sock, pb.Ack(accepted=ok, reason=reason, bytes_received=msg.wire_bytes).SerializeToString())
        return True

    def _frame_head(self, sock: socket.socket, n: int) -> tuple[bytes, tuple[int, int, str, int] | None]:
        """The first bytes of a frame of ``n`` bytes (its length checked before anything is read)
        and, for a data frame, its :func:`~graphfl.p2p.codec.data_prefix`.
        """
        if n > self.t.max_frame_bytes:
            raise WireError(f"frame of {n} bytes exceeds the limit of {self.t.max_frame_bytes} bytes")
        head = recv_exact(sock, min(n, _HEAD))
        return head, codec.data_prefix(head, n)

    def _read_frame(self, sock: socket.socket, n: int,
                    asm: codec.Assembler | None = None) -> pb.Frame | codec.DataFrame | None:
        """One frame of ``n`` bytes. A data frame's payload is received straight into the tensor
        buffer of ``asm`` (:meth:`~graphfl.p2p.codec.Assembler.target`; returns ``None``, the
        frame is already counted) or, when it straddles tensors, into a new aligned buffer that
        the Assembler keeps as the tensor when the frame holds all of it. Any other frame goes
        through protobuf.
        """
        head, prefix = self._frame_head(sock, n)
        if prefix is None:
            raw = head + recv_exact(sock, n - len(head)) if n > len(head) else head
            try:
                return codec.parse_frame(raw)
            except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError
                raise WireError(f"undecodable frame: {exc}") from None
        frame_sender, round_, channel, start = prefix
        size = n - start
        dest = asm.target(frame_sender, round_, channel, size) if asm is not None else None
        if dest is not None:  # in place: no copy from frame to tensor
            assert asm is not None
            _fill(sock, dest, head, start)
            asm.commit(size, n)
            return None
        payload = np.empty(size, dtype=np.uint8)
        _fill(sock, payload.data, head, start)
        return codec.DataFrame(frame_sender, round_, channel, payload.data.toreadonly(), n)

    def _skip(self, sock: socket.socket, payload: int) -> None:
        """Read and drop the data frames of a refused message (``payload`` declared bytes)."""
        view = np.empty(min(self.t.max_frame_bytes, 1 << 20), dtype=np.uint8).data
        while payload > 0:
            n = read_length(sock)
            head, prefix = self._frame_head(sock, n)
            if prefix is None:
                raise WireError("a refused message continued with something other than data frames")
            payload -= n - prefix[3]
            left = n - len(head)
            while left > 0:
                k = min(left, len(view))
                recv_into_exact(sock, view[:k])
                left -= k
        if payload < 0:
            raise WireError("a refused message carried more bytes than its header declared")


class DataClient:
    """The caller side: up to ``streams_per_sender`` connections per neighbour, reused across messages."""

    def __init__(self, transport: GrpcTransport) -> None:
        self.t = transport
        self._ctx = client_context(transport.tls) if transport.tls is not None else None
        self._idle: dict[int, list[socket.socket]] = {}
        self._slots: dict[int, threading.BoundedSemaphore] = {
            j: threading.BoundedSemaphore(transport.streams_per_sender) for j in transport.neighbours}
        self._lock = threading.Lock()
        self._closed = False

    def push(self, to: int, frames: Sequence[bytes], deadline: float) -> pb.Ack:
        """Send one message's frames to ``to`` and return its Ack, all before ``deadline`` (monotonic).

        Raises
        ------
        DataRefused
            The callee refused the connection (the reason is its own).
        OSError
            Unreachable, cut, TLS failure or past the deadline (``TimeoutError``).
        """
        slots = self._slots.get(to)
        if slots is None:
            raise DataRefused(f"peer {to} is not a neighbour of peer {self.t.peer_id}")
        if not slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"no free data connection to peer {to} before the send deadline")
        try:
            with self._lock:
                idle = self._idle.setdefault(to, [])
                sock = idle.pop() if idle else None
            if sock is None:
                sock = self._connect(to, deadline)
            try:
                for frame in frames:
                    sock.settimeout(_left(deadline))
                    write_record(sock, frame)
                sock.settimeout(_left(deadline))
                ack = read_ack(sock)
            except BaseException:
                sock.close()
                raise
            with self._lock:
                if self._closed:
                    sock.close()
                else:
                    self._idle.setdefault(to, []).append(sock)
            return ack
        finally:
            slots.release()

    def forget(self, to: int) -> None:
        """Close the idle connections to ``to`` (after a new handshake: a restarted callee)."""
        with self._lock:
            socks = self._idle.pop(to, [])
        for s in socks:
            s.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = [s for lst in self._idle.values() for s in lst]
            self._idle.clear()
        for s in socks:
            s.close()

    def _connect(self, to: int, deadline: float) -> socket.socket:
        t = self.t
        contact = t.data_contacts.get(to)
        if contact is None:
            raise ConnectionError(f"peer {to} announced no data port in its handshake")
        port, token = contact
        host, _ = split_host_port(t.topology.peer(to).address)
        sock = socket.create_connection((host, port), timeout=_left(deadline))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ctx is not None:
                sock = self._ctx.wrap_socket(sock, server_hostname=peer_name(to))
            sock.settimeout(_left(deadline))
            sock.sendall(PREAMBLE.pack(MAGIC, t.peer_id, token))
            ack = read_ack(sock)
        except BaseException:
            sock.close()
            raise
        if not ack.accepted:
            sock.close()
            raise DataRefused(ack.reason)
        return sock


def _left(deadline: float) -> float:
    """Seconds to ``deadline`` for a socket timeout (``TimeoutError`` once it has passed)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("send deadline passed")
    return left


def new_token() -> bytes:
    """A random data-connection token (:data:`TOKEN_BYTES` bytes)."""
    return secrets.token_bytes(TOKEN_BYTES)
