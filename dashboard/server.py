"""The dashboard's HTTP server: the standard library's threading server, read-only, bounded.

Routes (``GET`` only; anything else is ``405``):

* ``/`` -- the page (``static/index.html``); ``/static/<name>`` -- its script and style sheet,
  from a fixed list shipped in the package (no path from the request reaches the file system);
* ``/api/state`` -- ``{"folders": [snapshot, ...], "now": t}``, one
  :func:`~graphfl.dashboard.readers.snapshot` per watched folder; the page polls it.

Rules: the server listens on 127.0.0.1 by default; any other host needs a token (generated per
start, printed with the address) that every request must carry (``?token=`` or the
``X-Graphfl-Token`` header), compared in constant time. At most :data:`MAX_CONCURRENT` requests are
served at once (more are answered ``503`` at once), each connection's reads time out after
:data:`REQUEST_TIMEOUT_S`, and an error while answering one request is logged and answered
``500`` -- the server keeps serving.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from graphfl.dashboard.readers import SnapshotCache, snapshot

logger = logging.getLogger(__name__)

MAX_CONCURRENT = 16
"""Requests answered at the same time; further ones get ``503`` without waiting."""
REQUEST_TIMEOUT_S = 10.0
"""Bound on each blocking read of a connection (a client that sends nothing is dropped)."""
STATIC_FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
                "style.css": "text/css; charset=utf-8"}
"""The only files the server sends, all from the package's ``static/`` folder."""
TOKEN_HEADER = "X-Graphfl-Token"


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _static(name: str) -> bytes:
    return resources.files("graphfl.dashboard").joinpath("static", name).read_bytes()


@dataclass
class Dashboard:
    """What the server shows: the watched folders, the optional token, the snapshot cache."""

    folders: Sequence[Path]
    token: str | None = None
    cache: SnapshotCache = field(default_factory=SnapshotCache)

    def state(self) -> dict[str, Any]:
        """The ``/api/state`` document."""
        import time

        return {"folders": [snapshot(f, self.cache) for f in self.folders], "now": time.time()}


class _Handler(BaseHTTPRequestHandler):
    server: DashboardServer
    timeout = REQUEST_TIMEOUT_S
    protocol_version = "HTTP/1.1"
    server_version = "graphfl-dashboard"

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    def _send(self, code: int, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy",
                         "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, code: int, message: str) -> None:
        self._send(code, json.dumps({"error": message}).encode(), "application/json")

    def _authorised(self, query: dict[str, list[str]]) -> bool:
        token = self.server.dashboard.token
        if token is None:
            return True
        given = self.headers.get(TOKEN_HEADER) or (query.get("token") or [""])[0]
        return hmac.compare_digest(given.encode(), token.encode())

    def do_GET(self) -> None:
        try:
            url = urlsplit(self.path)
            query = parse_qs(url.query)
            if not self._authorised(query):
                self._error(403, "missing or wrong token: open the address the dashboard printed")
                return
            if url.path in ("/", "/index.html"):
                self._send(200, _static("index.html"), STATIC_FILES["index.html"])
            elif url.path.startswith("/static/") and url.path[len("/static/"):] in STATIC_FILES:
                name = url.path[len("/static/"):]
                self._send(200, _static(name), STATIC_FILES[name])
            elif url.path == "/api/state":
                body = json.dumps(self.server.dashboard.state(), allow_nan=False, default=str).encode()
                self._send(200, body, "application/json")
            elif url.path == "/favicon.ico":
                self._send(204, b"", "image/x-icon")
            else:
                self._error(404, f"no such page: {url.path}")
        except (BrokenPipeError, ConnectionResetError):
            logger.debug("client went away")
        except Exception as exc:
            logger.exception("dashboard request %s failed", self.path)
            try:
                self._error(500, f"{type(exc).__name__}: {exc}")
            except OSError:
                pass

    do_HEAD = do_GET

    def _refuse(self) -> None:
        self._error(405, "the dashboard is read-only: GET only")

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse


class DashboardServer(ThreadingHTTPServer):
    """A :class:`~http.server.ThreadingHTTPServer` with at most :data:`MAX_CONCURRENT` requests
    in flight (the next is answered ``503`` on the accepting thread, without reading it).
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], dashboard: Dashboard, max_concurrent: int = MAX_CONCURRENT) -> None:
        super().__init__(address, _Handler)
        self.dashboard = dashboard
        self._slots = threading.BoundedSemaphore(max_concurrent)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\n"
                                b"Connection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def url(self) -> str:
        """The address to open (with the token when there is one)."""
        raw, port = self.server_address[0], self.server_address[1]
        host = raw.decode() if isinstance(raw, bytes) else str(raw)
        shown = f"[{host}]" if ":" in host else host
        suffix = f"/?token={self.dashboard.token}" if self.dashboard.token else "/"
        return f"http://{shown}:{port}{suffix}"


def make_server(folders: Sequence[Path], host: str = "127.0.0.1", port: int = 0,
                token: str | None = None) -> DashboardServer:
    """A bound (not yet serving) dashboard on ``host:port`` (``0``: a free port).

    A host that is not loopback gets a token (``token``, else a fresh random one); loopback needs
    none unless ``token`` is given.
    """
    if not folders:
        raise ValueError("the dashboard needs at least one folder to show")
    if token is None and not is_loopback(host):
        token = secrets.token_urlsafe(18)
    return DashboardServer((host, port), Dashboard([Path(f) for f in folders], token=token))


def serve_in_thread(server: DashboardServer) -> threading.Thread:
    """Serve ``server`` on a daemon thread (stop it with ``server.shutdown()``)."""
    thread = threading.Thread(target=server.serve_forever, name="graphfl-dashboard", daemon=True)
    thread.start()
    return thread
