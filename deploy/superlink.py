"""graphfl's SuperLink entry point: Flower's own SuperLink, with its path-specific middleware gated by path.

``python -m graphfl.deploy.superlink [--middleware gated|stock] -- <flower-superlink arguments>``

Flower 1.41's SuperLink is one FastAPI app for the Fleet, Control and Runtime APIs, and every
request passes through all nine of its middlewares, each a Starlette ``BaseHTTPMiddleware``
(a task, a memory stream and a response wrapper per layer). Seven of them act on one API only
and call straight through for every other path:

==================================  =================  ===========================================
middleware                          acts on            otherwise
==================================  =================  ===========================================
ControlSensitiveResponseMiddleware  ``/v1/control/``   headers only on Control auth/OAuth routes
ControlAuthenticationMiddleware     ``/v1/control/``   ``if not _is_control_path(...)``: call next
ControlLicenseMiddleware            ``/v1/control/``   ``... or not _is_control_path(...)``: next
ControlEventLogMiddleware           ``/v1/control/``   ``if not _is_control_path(...)``: call next
RuntimeTracingMiddleware            ``/v1/runtime/``   acts on AcquireTask / PullTaskInput replies
NodeAuthMiddleware                  ``/v1/fleet/``     ``if path.startswith("/v1/fleet/")``: auth
FleetEventLogMiddleware             ``/v1/fleet/``     ``if not path.startswith("/v1/fleet/")``: next
==================================  =================  ===========================================

``--middleware gated`` (the default) wraps each of the seven in :class:`PathGate`, a pure ASGI
layer that hands a request to the middleware only when its path starts with the middleware's
prefix and straight to the next layer otherwise. Order and arguments are kept, the two
middlewares that act on every path (the HTTP error translator and the protobuf translation) are
untouched, and a request reaches exactly the middleware code that acts on it in stock Flower. A
SuperNode's poll then crosses 4 layers instead of 9, a ServerApp's 3. Measured on the default
job (4 SuperNodes, TLS, 2 cores, interleaved): 0.67-0.68 s per warm round with the stock stack,
0.51 s gated (docs/deployment.md).

:func:`graphfl.deploy.flwr_compat.check_superlink_internals` checks at start-up that Flower is
the pinned release, that the middleware list is the one above in Flower's order, and that each
gated middleware still contains the path test it is gated by; a mismatch is a clear error.
``--middleware stock`` runs Flower's SuperLink unchanged (``graphfl superlink --middleware stock``
execs ``flower-superlink`` itself).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

logger = logging.getLogger("graphfl.deploy.superlink")

CONTROL = "/v1/control/"
FLEET = "/v1/fleet/"
RUNTIME = "/v1/runtime/"

GATES: dict[str, str] = {
    "ControlSensitiveResponseMiddleware": CONTROL,
    "ControlAuthenticationMiddleware": CONTROL,
    "ControlLicenseMiddleware": CONTROL,
    "ControlEventLogMiddleware": CONTROL,
    "RuntimeTracingMiddleware": RUNTIME,
    "NodeAuthMiddleware": FLEET,
    "FleetEventLogMiddleware": FLEET,
}
"""Middleware class name -> the path prefix outside of which it only calls the next layer."""

STOCK_ORDER: tuple[str, ...] = (
    "ControlSensitiveResponseMiddleware", "BaseHTTPMiddleware", "ControlAuthenticationMiddleware",
    "ControlLicenseMiddleware", "ProtobufTranslationMiddleware", "RuntimeTracingMiddleware",
    "ControlEventLogMiddleware", "NodeAuthMiddleware", "FleetEventLogMiddleware",
)
"""Flower 1.41.0's SuperLink middleware classes, outermost first (``BaseHTTPMiddleware`` is the
HTTP error translator); :func:`gate_middleware` refuses any other list."""

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def request_path(scope: Scope) -> str:
    """The path Starlette's ``request.url.path`` gives for ``scope`` (what the gated middlewares test)."""
    from starlette.datastructures import URL

    return URL(scope=scope).path


class PathGate:
    """Pure ASGI layer: run ``middleware`` only for HTTP requests whose path starts with ``prefix``.

    ``PathGate(app, middleware=M, prefix=p)`` behaves as ``M(app)`` for a request under ``p``
    (and for non-HTTP scopes such as the lifespan, which ``M`` passes through anyway), and as
    ``app`` itself for every other request, without ``M``'s per-request task and streams.
    Exact only for a middleware that calls straight through outside ``p``; that is what
    :func:`graphfl.deploy.flwr_compat.check_superlink_internals` checks for Flower's.
    """

    def __init__(self, app: ASGIApp, middleware: Callable[..., ASGIApp], prefix: str,
                 args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> None:
        self.app = app
        self.prefix = prefix
        self.gated = middleware(app, *args, **(kwargs or {}))
        self.name = getattr(middleware, "__name__", repr(middleware))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not request_path(scope).startswith(self.prefix):
            await self.app(scope, receive, send)
        else:
            await self.gated(scope, receive, send)


def middleware_names(stack: Sequence[Any]) -> list[str]:
    """Class names of a Starlette ``Middleware`` list, outermost first."""
    return [getattr(m.cls, "__name__", repr(m.cls)) for m in stack]


def gate_middleware(stack: Sequence[Any]) -> list[Any]:
    """Flower's SuperLink middleware list with each of :data:`GATES` wrapped in a :class:`PathGate`.

    Raises
    ------
    graphfl.deploy.flwr_compat.FlowerInternalsError
        When ``stack`` is not :data:`STOCK_ORDER` (another Flower, or a SuperLink extension's
        middleware): the gates were checked for that list only.
    """
    from starlette.middleware import Middleware

    from graphfl.deploy.flwr_compat import SUPERLINK_FALLBACK, FlowerInternalsError

    names = middleware_names(stack)
    if tuple(names) != STOCK_ORDER:
        raise FlowerInternalsError(
            f"the SuperLink's middleware is {names}, not the {list(STOCK_ORDER)} graphfl's path gates were "
            f"checked against; {SUPERLINK_FALLBACK}"
        )
    out = []
    for m, name in zip(stack, names):
        if name in GATES:
            out.append(Middleware(PathGate, middleware=m.cls, prefix=GATES[name], args=m.args, kwargs=m.kwargs))
        else:
            out.append(m)
    return out


def install_gated_middleware() -> None:
    """Make ``flwr.superlink.main.create_app`` build its app with :func:`gate_middleware` (checked first).

    Replaces the module attribute ``_get_middleware`` that ``create_app`` calls (a wrapper around
    Flower's own function; site-packages is never edited).
    """
    from graphfl.deploy.flwr_compat import check_superlink_internals

    check_superlink_internals()
    import flwr.superlink.main as superlink_main

    stock = superlink_main._get_middleware
    gate_middleware(stock())  # refuse a list that does not fit before the SuperLink starts

    def gated() -> list[Any]:
        return gate_middleware(stock())

    superlink_main._get_middleware = gated


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split ``[ours] -- [flower-superlink's]``."""
    from graphfl.deploy.supernode import split_at_dashes

    ours, flower = split_at_dashes(argv)
    p = argparse.ArgumentParser(prog="python -m graphfl.deploy.superlink",
                                description="Flower's SuperLink with its API-specific middleware gated by path.")
    p.add_argument("--middleware", choices=("gated", "stock"), default="gated")
    return p.parse_args(ours), flower


def main(argv: Sequence[str] | None = None) -> int:
    """Install the path gates (unless ``--middleware stock``), then run Flower's ``flower_superlink()``."""
    args, flower_args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.middleware == "gated":
        install_gated_middleware()
    from flwr.superlink.cli.flower_superlink import flower_superlink

    sys.argv = ["flower-superlink", *flower_args]
    flower_superlink()
    return 0


if __name__ == "__main__":
    from graphfl.deploy.flwr_compat import FlowerInternalsError

    try:
        sys.exit(main())
    except FlowerInternalsError as exc:
        print(f"graphfl superlink: {exc}", file=sys.stderr)
        sys.exit(2)
