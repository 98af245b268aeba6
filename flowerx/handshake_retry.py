"""Retry a connection to the SuperLink whose TLS handshake was cut short, a bounded number of times.

Flower 1.41's HTTP clients (the ServerApp's ``HttpGrid``, the SuperNode's Fleet connection) send
every request through a ``RetryInvoker`` (``flwr.supercore.retry.http_retry``) that retries a failed
connection for ever, except when the error's text names SSL or TLS: then it gives up at once ("SSL/TLS
handshake error detected"), because a wrong certificate never heals. But a handshake the server
cut short is transient: ``httpx.ConnectError: [SSL: UNEXPECTED_EOF_WHILE_READING] EOF occurred in
violation of protocol``. One CI run of a TLS federation on a busy 2-core machine failed that way in
its first round, with every process healthy; the ServerApp gave up and the run with it.

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
:mod:`graphfl.deploy.supernode`); the stock ``flower-supernode`` is unchanged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import httpx  # Flower's HTTP client (a dependency of flwr)

logger = logging.getLogger(__name__)

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


def install_on_grid(grid: Any) -> bool:
    """Make the ServerApp's ``HttpGrid`` tolerate cut handshakes; ``False`` for a grid without an
    HTTP retry invoker (the simulation engine's in-memory grid, or a Flower that moved it).
    """
    invoker = getattr(grid, "_retry_invoker", None)
    if invoker is None or not hasattr(invoker, "should_giveup") or not hasattr(invoker, "on_success"):
        if type(grid).__name__ == "HttpGrid":
            logger.warning("this Flower's HttpGrid has no retry invoker to wrap: a TLS handshake the SuperLink "
                           "cuts short fails the run")
        return False
    tolerate_cut_handshakes(invoker, what="SuperLink (Runtime API)")
    return True


def install_on_fleet_connections() -> bool:
    """Fleet connections made from now on in this process (a SuperNode's) tolerate cut handshakes.

    Wraps ``flwr.supernode.fleet_http_connection.make_simple_http_retry_invoker``; ``False`` (and a
    warning) when this Flower has no such function there.
    """
    try:
        from flwr.supernode import fleet_http_connection as fleet
    except ImportError as exc:
        logger.warning("cannot wrap Flower's Fleet connection (%s): a cut TLS handshake stops the SuperNode", exc)
        return False
    make = getattr(fleet, "make_simple_http_retry_invoker", None)
    if make is None or not callable(make):
        logger.warning("flwr.supernode.fleet_http_connection has no make_simple_http_retry_invoker: a cut TLS "
                       "handshake stops the SuperNode")
        return False
    if getattr(make, "graphfl_tolerates_cut_handshakes", False):
        return True

    def make_tolerant() -> Any:
        return tolerate_cut_handshakes(make(), what="SuperLink (Fleet API)")

    make_tolerant.graphfl_tolerates_cut_handshakes = True  # type: ignore[attr-defined]
    fleet.make_simple_http_retry_invoker = make_tolerant
    return True
