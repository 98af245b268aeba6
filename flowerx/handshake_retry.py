"""Fast paths ``grid-handshake-retry`` and ``fleet-handshake-retry``: a connection to the SuperLink
whose TLS handshake was cut short is retried, a bounded number of times.

Flower's HTTP clients (the ServerApp's ``HttpGrid``, the SuperNode's Fleet connection) send every
request through a ``RetryInvoker`` (``flwr.supercore.retry.http_retry``) that retries a failed
connection for ever, except when the error's text names SSL or TLS: then it gives up at once ("SSL/TLS
handshake error detected"), because a wrong certificate never heals. But a handshake the server
cut short is transient: ``httpx.ConnectError: [SSL: UNEXPECTED_EOF_WHILE_READING] EOF occurred in
violation of protocol`` (a busy server closing a connection it has not served yet), and giving up
on it ends a run whose processes are all healthy.

:func:`tolerate_cut_handshakes` makes an invoker retry such an error, with Flower's own back-off
(exponential from 1 s, jittered), at most :data:`CUT_HANDSHAKE_RETRIES` times in a row; any request
that succeeds resets the count, and past the bound Flower decides as before (it gives up on an SSL
error; it keeps retrying a plain "connection reset", e.g. while a SuperLink restarts).
Retrying is safe for every request: an ``httpx.ConnectError`` is raised while the connection is being
made, before a byte of the request is sent, and the invoker retries one HTTP request (not a whole
``push_messages``). A certificate failure (``CERTIFICATE_VERIFY_FAILED``, a wrong host name, plain
HTTP on the other end) is not a cut handshake and is still given up at once.

Installed on the ServerApp's grid (:func:`install_on_grid`, by :mod:`graphfl.server.app`) and on the
Fleet connection of graphfl's SuperNode (:func:`install_on_fleet_connections`, by
:mod:`graphfl.deploy.supernode`); the stock ``flower-supernode`` is unchanged. Off (where the seam was
not verified on the installed Flower, :mod:`graphfl.flowerx.policy`): Flower gives up on a cut
handshake as it does by itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import httpx  # Flower's HTTP client (a dependency of flwr)

from graphfl.flowerx.policy import FastPath, decide

logger = logging.getLogger(__name__)

GRID_PATH = FastPath("grid-handshake-retry", "retry of a cut TLS handshake on the ServerApp's grid",
                     "a TLS handshake the SuperLink cuts short fails the run, as in stock Flower")
FLEET_PATH = FastPath("fleet-handshake-retry", "retry of a cut TLS handshake on the SuperNode's Fleet connection",
                      "a TLS handshake the SuperLink cuts short stops the SuperNode, as in stock Flower")

CUT_HANDSHAKE_RETRIES = 5
"""Cut handshakes retried in a row (with Flower's back-off: about 1 + 2 + 4 + 8 + 16 s at most)."""

TRANSIENT_MARKERS = ("unexpected_eof", "eof occurred", "connection reset", "connection aborted")
"""Lower-case fragments of a connection error that a later try can heal: the server closed or reset
the connection during the handshake."""


def is_cut_handshake(exc: BaseException) -> bool:
    """True for an ``httpx.ConnectError`` whose text says the handshake was cut short (no request sent)."""
    if not isinstance(exc, httpx.ConnectError):
        return False
    text = str(exc).lower()
    return any(marker in text for marker in TRANSIENT_MARKERS)


def tolerate_cut_handshakes(invoker: Any, retries: int = CUT_HANDSHAKE_RETRIES, what: str = "SuperLink") -> Any:
    """Make a Flower ``RetryInvoker`` retry up to ``retries`` cut handshakes in a row; returns it.

    Wraps the invoker's ``should_giveup`` (a cut handshake within the bound is not given up; past
    the bound, and for any other error, the original decides: Flower gives up on an error that
    names SSL, and keeps retrying a plain reset) and ``on_success`` (which resets the count).
    Idempotent.
    """
    if getattr(invoker, "graphfl_tolerates_cut_handshakes", False):
        return invoker
    lock = threading.Lock()
    in_a_row = [0]
    original_giveup: Callable[[Exception], bool] | None = invoker.should_giveup
    original_success: Callable[[Any], None] | None = invoker.on_success

    def should_giveup(exc: Exception) -> bool:
        if is_cut_handshake(exc):
            with lock:
                in_a_row[0] += 1
                count = in_a_row[0]
            if count <= retries:
                logger.warning("connection to the %s cut during the TLS handshake (%s); retry %d of %d",
                               what, exc, count, retries)
                return False
            logger.error("connection to the %s cut during the TLS handshake %d times in a row", what, count)
        return bool(original_giveup(exc)) if original_giveup is not None else False

    def on_success(state: Any) -> None:
        with lock:
            in_a_row[0] = 0
        if original_success is not None:
            original_success(state)

    invoker.should_giveup = should_giveup
    invoker.on_success = on_success
    invoker.graphfl_tolerates_cut_handshakes = True
    return invoker


def _grid_invoker(grid: Any) -> Any:
    invoker = getattr(grid, "_retry_invoker", None)
    if invoker is None or not hasattr(invoker, "should_giveup") or not hasattr(invoker, "on_success"):
        return None
    return invoker


def install_on_grid(grid: Any) -> bool:
    """Make the ServerApp's ``HttpGrid`` tolerate cut handshakes; ``False`` for a grid without an
    HTTP retry invoker (the simulation engine's in-memory grid) or when the fast path is off.
    """
    if type(grid).__name__ != "HttpGrid" and _grid_invoker(grid) is None:
        return False   # nothing to wrap: not a deployment grid

    def check() -> str | None:
        return None if _grid_invoker(grid) is not None else "this Flower's HttpGrid has no retry invoker to wrap"

    invoker = _grid_invoker(grid)
    if not decide(GRID_PATH, check) or invoker is None:
        return False
    tolerate_cut_handshakes(invoker, what="SuperLink (Runtime API)")
    return True


def install_on_fleet_connections() -> bool:
    """Fleet connections made from now on in this process (a SuperNode's) tolerate cut handshakes.

    Wraps ``flwr.supernode.fleet_http_connection.make_simple_http_retry_invoker``; ``False`` when the
    fast path is off (e.g. this Flower has no such function there).
    """

    def check() -> str | None:
        from flwr.supernode import fleet_http_connection

        if not callable(getattr(fleet_http_connection, "make_simple_http_retry_invoker", None)):
            return "flwr.supernode.fleet_http_connection has no make_simple_http_retry_invoker"
        return None

    if not decide(FLEET_PATH, check):
        return False
    from flwr.supernode import fleet_http_connection as fleet

    make = fleet.make_simple_http_retry_invoker
    if getattr(make, "graphfl_tolerates_cut_handshakes", False):
        return True

    def make_tolerant() -> Any:
        return tolerate_cut_handshakes(make(), what="SuperLink (Fleet API)")

    make_tolerant.graphfl_tolerates_cut_handshakes = True  # type: ignore[attr-defined]
    fleet.make_simple_http_retry_invoker = make_tolerant
    return True
