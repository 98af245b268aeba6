"""One process of the parallel floor of ``graphfl bench p2p-throughput`` (a small module: a spawned
floor process imports only this, numpy and :mod:`graphfl.p2p.mixing`, so its start-up and memory are
a floor too).

With a certificate folder (``ca.crt``, ``server.pem``, ``server.key`` as :func:`graphfl.common.certs.generate_tls`
writes them) every ring connection is TLS (Python's ``ssl``, the server certificate checked against
the CA): the floor of the TLS cases, which pays the same encryption per byte as TLS peers.
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
import sys
import threading
import time
from typing import Any

import numpy as np

from graphfl.common.envinfo import peak_rss_mb
from graphfl.common.malloc import keep_freed_memory
from graphfl.p2p.mixing import mix


def ring_weights(i: int, n: int) -> dict[int, float]:
    """Metropolis weights of a ring (what ``graphfl p2p`` uses): ``1/3`` on each edge and the diagonal."""
    nbrs = sorted({(i - 1) % n, (i + 1) % n} - {i})
    if not nbrs:
        return {i: 1.0}
    w = 1.0 / (1.0 + max(len(nbrs), 2 if n > 2 else 1))
    row = {j: w for j in nbrs}
    row[i] = 1.0 - w * len(nbrs)
    return row


def recv_into(conn: socket.socket, buf: bytearray) -> None:
    """Fill ``buf`` from ``conn`` (raises if the peer closes early)."""
    view = memoryview(buf)
    got = 0
    while got < len(buf):
        k = conn.recv_into(view[got:], len(buf) - got)
        if k == 0:
            raise ConnectionError("floor socket closed early")
        got += k


def _expect(conn: socket.socket, what: bytes) -> None:
    got = bytearray(len(what))
    recv_into(conn, got)
    if bytes(got) != what:
        raise ConnectionError(f"floor control: expected {what!r}, got {bytes(got)!r}")


def initial_theta(i: int, d: int) -> np.ndarray:
    """Process ``i``'s starting vector (seeded by ``i``; tests recompute the ring from it)."""
    return np.random.default_rng([0, i]).standard_normal(d, dtype=np.float32)


def tls_contexts(cert_dir: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts from ``cert_dir``: the server presents ``server.pem``; the client
    checks it against ``ca.crt`` (host name 127.0.0.1, a SAN of graphfl's certificates).
    """
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(f"{cert_dir}/server.pem", f"{cert_dir}/server.key")
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=f"{cert_dir}/ca.crt")
    return server, client


def floor_peer(i: int, n: int, d: int, rounds: int, ports: list[int], ctrl_port: int, spawned: float,
               cert_dir: str | None = None) -> dict[str, Any]:
    """Process ``i`` of the ring: listen, connect to both neighbours, then ``rounds`` exchanges, each
    started by the parent's ``G`` and reported with ``D`` on the control socket (the parent starts a
    round when every process has finished the previous one, and sends ``E`` after the last). Round ``k``:
    ``θ_i ← Σ_j W_ij θ_j`` over ``i`` and its two ring neighbours (:func:`ring_weights`).
    ``cert_dir``: TLS on every ring connection (the control socket stays plain).
    """
    ctrl = socket.create_connection(("127.0.0.1", ctrl_port))
    nbrs = sorted({(i - 1) % n, (i + 1) % n} - {i})
    srv = socket.create_server(("127.0.0.1", ports[i]), backlog=max(2, len(nbrs)))
    server_tls, client_tls = tls_contexts(cert_dir) if cert_dir else (None, None)
    ready = time.time()
    ctrl.sendall(b"R")
    _expect(ctrl, b"S")  # every process listens
    incoming: dict[int, socket.socket] = {}
    accept_errors: list[BaseException] = []

    def accept_all() -> None:  # concurrently with our own connects: a TLS handshake needs both ends
        try:
            for _ in nbrs:
                conn, _ = srv.accept()
                if server_tls is not None:
                    conn = server_tls.wrap_socket(conn, server_side=True)
                hdr = bytearray(4)
                recv_into(conn, hdr)
                incoming[struct.unpack("!I", hdr)[0]] = conn
        except Exception as exc:  # noqa: BLE001 - re-raised in the main thread below
            accept_errors.append(exc)

    srv.settimeout(120)
    acceptor = threading.Thread(target=accept_all, daemon=True)
    acceptor.start()
    outgoing: dict[int, socket.socket] = {}
    for j in nbrs:
        sock = socket.create_connection(("127.0.0.1", ports[j]), timeout=120)
        outgoing[j] = client_tls.wrap_socket(sock, server_hostname="127.0.0.1") if client_tls else sock
        outgoing[j].sendall(struct.pack("!I", i))
    acceptor.join(150)
    if accept_errors:
        raise accept_errors[0]
    if len(incoming) != len(nbrs):
        raise ConnectionError(f"floor process {i}: {len(incoming)} of {len(nbrs)} neighbours connected")
    for sock in (*outgoing.values(), *incoming.values()):
        sock.settimeout(None)
    theta = initial_theta(i, d)
    row = ring_weights(i, n)
    cipher = next((s.cipher() for s in outgoing.values() if isinstance(s, ssl.SSLSocket)), None)
    bufs = {j: bytearray(4 * d) for j in nbrs}
    times = []
    for _ in range(rounds):
        _expect(ctrl, b"G")
        t0 = time.perf_counter()
        payload = theta.tobytes()
        senders = [threading.Thread(target=outgoing[j].sendall, args=(payload,)) for j in nbrs]
        for th in senders:
            th.start()
        arrays = {i: theta}
        for j in nbrs:
            recv_into(incoming[j], bufs[j])
            arrays[j] = np.frombuffer(bufs[j], dtype=np.float32)
        for th in senders:
            th.join()
        theta = mix(row, arrays)
        times.append(time.perf_counter() - t0)
        ctrl.sendall(b"D")
    # Close only when every process has its last round's bytes: a socket closed with unread bytes
    # (a TLS client never reads the server's session tickets) sends a reset, and a neighbour still
    # reading its last round would lose them.
    _expect(ctrl, b"E")
    for sock in (*outgoing.values(), *incoming.values(), srv):
        sock.close()
    return {"peer": i, "round_s": times, "startup_s": ready - spawned, "rss_mb": peak_rss_mb(),
            "tls_cipher": cipher[0] if cipher else None, "theta_head": theta[:4].tolist(),
            "theta_sum": float(theta.astype(np.float64).sum()), "ctrl": ctrl}


def main(argv: list[str]) -> int:
    """``python -m graphfl.bench.ring_floor I N D ROUNDS PORTS CTRL_PORT SPAWNED [CERT_DIR]``: one floor process."""
    malloc = keep_freed_memory()  # as a peer process does: the floor must not pay page faults the peers do not
    i, n, d, rounds = (int(x) for x in argv[:4])
    ports = [int(p) for p in argv[4].split(",")]
    res = floor_peer(i, n, d, rounds, ports, int(argv[5]), float(argv[6]), argv[7] if len(argv) > 7 else None)
    ctrl = res.pop("ctrl")
    res["malloc"] = malloc
    ctrl.sendall(json.dumps(res).encode() + b"\n")
    ctrl.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
