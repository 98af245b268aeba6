"""Retrying a TLS handshake the SuperLink cut short (flowerx/handshake_retry.py).

A real TLS server on 127.0.0.1 closes chosen connections before the handshake and answers HTTP on
the others; requests go through Flower's own HTTP retry invoker and httpx, unmocked. Only the
invoker's wait is recorded instead of slept.
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading
from collections.abc import Callable

import httpx
import pytest
from flwr.supercore.retry import make_simple_http_retry_invoker

from graphfl.common.certs import generate_tls
from graphfl.flowerx.handshake_retry import (
    CUT_HANDSHAKE_RETRIES,
    install_on_fleet_connections,
    install_on_grid,
    is_cut_handshake,
    tolerate_cut_handshakes,
)


def read_request(sock: socket.socket) -> bytes:
    """One HTTP/1.1 request: the head, then ``content-length`` bytes of body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


class CuttingTlsServer:
    """Accepts on 127.0.0.1; cuts the handshake of the connections ``cut(n)`` picks (n = 1, 2, ...;
    ``"reset"``: resets them instead), and speaks TLS + HTTP/1.1 ("ok") on the others."""

    def __init__(self, tls_dir, cut: Callable[[int], bool | str]) -> None:
        files = generate_tls(tls_dir, hosts=["127.0.0.1"])
        self.ca = str(files.ca_cert)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(files.server_cert, files.server_key)
        self.cut = cut
        self.accepted = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"https://127.0.0.1:{self.sock.getsockname()[1]}/"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            conn.settimeout(5)
            how = self.cut(self.accepted)
            if how == "reset":   # an RST instead of a handshake (SO_LINGER 0): "connection reset by peer"
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()
                continue
            if how:
                # read the ClientHello, then close: a FIN mid-handshake (the client sees an EOF); closing
                # with the hello unread would send a reset instead, which Flower already retries
                try:
                    conn.recv(65536)
                    conn.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                finally:
                    conn.close()
                continue
            try:
                with self.context.wrap_socket(conn, server_side=True) as tls:
                    read_request(tls)   # all of it: closing with a body unread would reset the connection
                    tls.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
            except (OSError, ssl.SSLError):
                conn.close()

    def get(self, trust_test_ca: bool = True) -> str:
        """GET the page with a fresh client (one connection per request)."""
        context = ssl.create_default_context(cafile=self.ca) if trust_test_ca else ssl.create_default_context()
        with httpx.Client(verify=context, timeout=5) as client:
            return client.get(self.url).text

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


@pytest.fixture
def serve(tmp_path):
    servers: list[CuttingTlsServer] = []

    def make(cut: Callable[[int], bool | str]) -> CuttingTlsServer:
        servers.append(CuttingTlsServer(tmp_path / f"tls{len(servers)}", cut))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def flower_invoker(waits: list[float]):
    """Flower's own HTTP retry invoker, its waits recorded instead of slept."""
    invoker = make_simple_http_retry_invoker()
    invoker.wait_function = waits.append
    return invoker


def test_a_cut_handshake_is_recognised_and_a_bad_certificate_is_not(serve):
    cutting = serve(lambda n: n == 1)
    with pytest.raises(httpx.ConnectError) as cut:
        cutting.get()
    assert "UNEXPECTED_EOF_WHILE_READING" in str(cut.value)      # the error CI saw
    assert is_cut_handshake(cut.value)

    honest = serve(lambda n: False)
    with pytest.raises(httpx.ConnectError) as untrusted:
        honest.get(trust_test_ca=False)                            # the system's CAs do not know this CA
    assert "certificate" in str(untrusted.value).lower()
    assert not is_cut_handshake(untrusted.value)
    assert not is_cut_handshake(ValueError("unexpected_eof"))     # only a ConnectError counts


def test_flower_alone_gives_up_on_the_first_cut_handshake(serve):
    """Why the wrapper exists: the stock invoker treats the cut as an SSL error and raises at once."""
    server = serve(lambda n: n == 1)
    waits: list[float] = []
    with pytest.raises(httpx.ConnectError):
        flower_invoker(waits).invoke(server.get)
    assert server.accepted == 1 and waits == []


def test_cut_handshakes_are_retried_with_flowers_backoff(serve):
    server = serve(lambda n: n <= 2)
    waits: list[float] = []
    invoker = tolerate_cut_handshakes(flower_invoker(waits))
    assert invoker.invoke(server.get) == "ok"
    assert server.accepted == 3
    assert len(waits) == 2 and 0 <= waits[0] <= 1 and 0 <= waits[1] <= 2   # exponential from 1 s, jittered


def test_retries_are_bounded_and_a_success_resets_the_count(serve):
    cuts_before_success = CUT_HANDSHAKE_RETRIES
    server = serve(lambda n: n % (cuts_before_success + 1) != 0)   # 5 cuts, 1 answer, 5 cuts, 1 answer, ...
    waits: list[float] = []
    invoker = tolerate_cut_handshakes(flower_invoker(waits))
    assert invoker.invoke(server.get) == "ok"
    assert invoker.invoke(server.get) == "ok"                      # the count started again after the success
    assert server.accepted == 2 * (cuts_before_success + 1)

    always = serve(lambda n: True)
    waits.clear()
    fresh = tolerate_cut_handshakes(flower_invoker(waits))
    with pytest.raises(httpx.ConnectError):
        fresh.invoke(always.get)
    assert always.accepted == CUT_HANDSHAKE_RETRIES + 1 and len(waits) == CUT_HANDSHAKE_RETRIES


def test_past_the_bound_flower_decides_and_keeps_retrying_a_plain_reset(serve):
    """Resets (e.g. a SuperLink restarting) are retried for ever by Flower; the wrapper leaves that be."""
    resets = CUT_HANDSHAKE_RETRIES + 2
    server = serve(lambda n: "reset" if n <= resets else False)
    waits: list[float] = []
    invoker = tolerate_cut_handshakes(flower_invoker(waits))
    assert invoker.invoke(server.get) == "ok"
    assert server.accepted == resets + 1 and len(waits) == resets


def test_a_certificate_failure_is_still_given_up_at_once(serve):
    server = serve(lambda n: False)
    waits: list[float] = []
    invoker = tolerate_cut_handshakes(flower_invoker(waits))
    with pytest.raises(httpx.ConnectError, match="(?i)certificate"):
        invoker.invoke(lambda: server.get(trust_test_ca=False))
    assert server.accepted == 1 and waits == []


def test_installed_on_flowers_grid_and_fleet_connection(monkeypatch):
    from flwr.superlink.grid.http_grid import HttpGrid
    from flwr.supernode import fleet_http_connection

    grid = HttpGrid("127.0.0.1:9", token="t")
    assert install_on_grid(grid) is True
    assert grid._retry_invoker.graphfl_tolerates_cut_handshakes is True
    assert install_on_grid(grid) is True                           # idempotent
    assert install_on_grid(object()) is False                      # e.g. the simulation's in-memory grid

    monkeypatch.setattr(fleet_http_connection, "make_simple_http_retry_invoker",
                        fleet_http_connection.make_simple_http_retry_invoker)   # restored after the test
    assert install_on_fleet_connections() is True
    assert install_on_fleet_connections() is True                  # not wrapped twice
    made = fleet_http_connection.make_simple_http_retry_invoker()
    assert made.graphfl_tolerates_cut_handshakes is True


def test_a_status_query_is_asked_again_when_the_superlink_was_unavailable(serve, tmp_path, caplog):
    """``Submitter.status`` runs the real ``flwr list``; the CLI hides the cause ("unavailable")."""
    import logging
    import os

    from graphfl.deploy.federation import UNAVAILABLE, FederationError, Submitter, write_connection

    def submitter(server: CuttingTlsServer, name: str) -> Submitter:
        home = tmp_path / name
        write_connection(home, server.url.split("//")[1].rstrip("/"), server.ca)
        return Submitter(home, {**os.environ, "FLWR_HOME": str(home)})

    def asked_again() -> int:
        return sum("asking again" in r.getMessage() for r in caplog.records)

    caplog.set_level(logging.WARNING, logger="graphfl.deploy.federation")
    always = serve(lambda n: True)
    with pytest.raises(FederationError, match=UNAVAILABLE):
        submitter(always, "always").status(1, retry_waits=(0.01, 0.01))
    assert always.accepted == 3 and asked_again() == 2             # asked three times, then raised

    caplog.clear()
    once = serve(lambda n: n == 1)
    with pytest.raises(FederationError, match="Invalid protobuf") as other:
        submitter(once, "once").status(1, retry_waits=(0.01, 0.01))
    assert UNAVAILABLE not in str(other.value)                     # the 2nd try reached the server,
    assert asked_again() == 1 and once.accepted == 2               # and its (non-Flower) answer was raised
