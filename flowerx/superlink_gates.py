"""Fast path ``superlink-gates``: Flower's SuperLink with its API-specific middleware gated by path.

Flower's SuperLink is one FastAPI app for the Fleet, Control and Runtime APIs, and every request
passes through every middleware of ``flwr.superlink.main._get_middleware()``, each a Starlette
``BaseHTTPMiddleware`` (a task, a memory stream and a response wrapper per layer). All but two of
them act on one API only and call straight through for every other path:

==================================  =================  ===========================================
middleware                          acts on            otherwise
==================================  =================  ===========================================
ControlSensitiveResponseMiddleware  ``/v1/control/``   headers only on Control auth/OAuth routes
ControlAuthenticationMiddleware     ``/v1/control/``   ``if not _is_control_path(...)``: call next
ControlLicenseMiddleware            ``/v1/control/``   ``... or not _is_control_path(...)``: next
ControlEventLogMiddleware           ``/v1/control/``   ``if not _is_control_path(...)``: call next
RuntimeTracingMiddleware (1.41)     ``/v1/runtime/``   acts on AcquireTask / PullTaskInput replies
NodeAuthMiddleware                  ``/v1/fleet/``     ``if path.startswith("/v1/fleet/")``: auth
FleetEventLogMiddleware             ``/v1/fleet/``     ``if not path.startswith("/v1/fleet/")``: next
==================================  =================  ===========================================

:func:`install_gated_middleware` wraps each of them in :class:`PathGate`, a pure ASGI layer that
hands a request to the middleware only when its path starts with the middleware's prefix and
straight to the next layer otherwise. Order and arguments are kept, the two middlewares that act
on every path (the HTTP error translator and the protobuf translation) are untouched, so a request
reaches exactly the middleware code that acts on it in stock Flower, through fewer layers.

On: when :func:`check` finds the middleware list of :data:`STOCK_ORDERS` for the Flower version
and each gated middleware's path test in its source. Off: Flower's SuperLink runs unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from graphfl.flowerx.checks import first_reason, lacks_source
from graphfl.flowerx.policy import FastPath, decide, flower_version

logger = logging.getLogger("graphfl.flowerx")

FAST_PATH = FastPath("superlink-gates", "path-gated SuperLink middleware",
                     "Flower's SuperLink runs with its stock middleware")

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

_ORDER_1_41 = (
    "ControlSensitiveResponseMiddleware", "BaseHTTPMiddleware", "ControlAuthenticationMiddleware",
    "ControlLicenseMiddleware", "ProtobufTranslationMiddleware", "RuntimeTracingMiddleware",
    "ControlEventLogMiddleware", "NodeAuthMiddleware", "FleetEventLogMiddleware",
)
STOCK_ORDERS: dict[str, tuple[str, ...]] = {
    "1.41.0": _ORDER_1_41,
    "1.42.0": tuple(n for n in _ORDER_1_41 if n != "RuntimeTracingMiddleware"),
}
"""Per verified Flower release, its SuperLink middleware classes, outermost first
(``BaseHTTPMiddleware`` is the HTTP error translator); :func:`gate_middleware` gates no other list."""

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class MiddlewareMismatch(RuntimeError):
    """The SuperLink's middleware list is not the one the gates were checked for."""


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
    :func:`check` checks for Flower's.
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


def expected_order(version: str | None = None) -> tuple[str, ...] | None:
    """The middleware list the gates were checked for on ``version`` (default: the policy's version)."""
    return STOCK_ORDERS.get(flower_version() if version is None else version)


def gate_middleware(stack: Sequence[Any], version: str | None = None) -> list[Any]:
    """Flower's SuperLink middleware list with each of :data:`GATES` wrapped in a :class:`PathGate`.

    Raises
    ------
    MiddlewareMismatch
        When ``stack`` is not the :data:`STOCK_ORDERS` list of ``version`` (another Flower, or a
        SuperLink extension's middleware): the gates were checked for that list only.
    """
    from starlette.middleware import Middleware

    names = middleware_names(stack)
    expected = expected_order(version)
    if expected is None or tuple(names) != expected:
        raise MiddlewareMismatch(f"the SuperLink's middleware is {names}, not the "
                                 f"{list(expected or ())} the path gates were checked against")
    out = []
    for m, name in zip(stack, names):
        if name in GATES:
            out.append(Middleware(PathGate, middleware=m.cls, prefix=GATES[name], args=m.args, kwargs=m.kwargs))
        else:
            out.append(m)
    return out


def check() -> str | None:
    """Why the gates do not fit this Flower's SuperLink, or ``None`` when each gated middleware still
    calls straight through outside its prefix and the list is the expected one.

    The Control middlewares test ``_is_control_path`` (``/v1/control/``) or Control-only route keys,
    the Fleet ones ``/v1/fleet/``, and the Runtime tracing (1.41) acts only on replies of Runtime routes.
    """
    import flwr.superlink.main as superlink_main
    from flwr.supercore.protobuf import translation
    from flwr.superlink.routers.control import middlewares as control
    from flwr.superlink.routers.fleet import middlewares as fleet
    from flwr.superlink.routers.fleet import node_auth

    if not callable(getattr(superlink_main, "_get_middleware", None)):
        return "flwr.superlink.main has no _get_middleware"
    reason = first_reason(
        lacks_source(superlink_main.create_app, "SuperLink app factory", ("middleware=_get_middleware()",)),
        lacks_source(control._is_control_path, "Control path test", ('path.startswith("/v1/control/")',)),
        lacks_source(control.ControlSensitiveResponseMiddleware.dispatch, "Control sensitive-response middleware",
                     ("if _is_control_sensitive_route(request):",)),
        lacks_source(control._is_control_sensitive_route, "Control sensitive-route test",
                     ("in CONTROL_SENSITIVE_ROUTE_KEYS",)),
        *(lacks_source(cls.dispatch, cls.__name__, (needle,)) for cls, needle in (
            (control.ControlAuthenticationMiddleware, "if not _is_control_path(request.url.path)"),
            (control.ControlLicenseMiddleware, "not _is_control_path(request.url.path)"),
            (control.ControlEventLogMiddleware, "if not _is_control_path(request.url.path)"),
            (node_auth.NodeAuthMiddleware, 'if request.url.path.startswith("/v1/fleet/")'),
            (fleet.FleetEventLogMiddleware, 'if not request.url.path.startswith("/v1/fleet/")'))),
    )
    if reason:
        return reason
    off_routes = sorted(p for _, p in control.CONTROL_SENSITIVE_ROUTE_KEYS if not p.startswith(CONTROL))
    if off_routes:
        return f"Flower's sensitive Control routes include non-Control paths {off_routes}"
    names = middleware_names(superlink_main._get_middleware())
    expected = expected_order()
    if expected is None or tuple(names) != expected:
        return f"the SuperLink's middleware is {names}, not {list(expected or ())}"
    if "RuntimeTracingMiddleware" in names:
        from flwr.supercore.routers.runtime import tracing

        # getattr: the class exists only in the Flower versions whose list names it (1.41), and
        # mypy runs against whichever Flower is installed
        middleware = getattr(tracing, "RuntimeTracingMiddleware")  # noqa: B009
        reason = lacks_source(middleware.dispatch, "RuntimeTracingMiddleware",
                              ("isinstance(result, AcquireTaskResponse)", "isinstance(result, PullTaskInputResponse)",
                               "return response"))
        if reason:
            return reason
        traced = sorted(p for (_, p), kind in translation.PROTOBUF_REQUEST_TYPES.items()
                        if kind.__name__ in ("AcquireTaskRequest", "PullTaskInputRequest"))
        if not traced or any(not p.startswith(RUNTIME) for p in traced):
            return f"Flower's AcquireTask / PullTaskInput routes are {traced}, not Runtime paths"
    return None


def stock_middleware() -> list[Any]:
    """Flower's own SuperLink middleware list (whatever ``create_app`` would use now)."""
    import flwr.superlink.main as superlink_main

    return list(superlink_main._get_middleware())


def install_gated_middleware() -> bool:
    """Make ``flwr.superlink.main.create_app`` build its app with :func:`gate_middleware`, when the
    fast path is on here (:func:`graphfl.flowerx.policy.decide`); returns whether it is.

    Replaces the module attribute ``_get_middleware`` that ``create_app`` calls by a wrapper around
    Flower's own function (site-packages is never edited). Should the list change between the check
    and the app's creation, the stock list is used, with a warning.
    """
    if not decide(FAST_PATH, check):
        return False
    import flwr.superlink.main as superlink_main

    stock = superlink_main._get_middleware
    if getattr(stock, "graphfl_gated", False):
        return True

    def gated() -> list[Any]:
        middleware = stock()
        try:
            return gate_middleware(middleware)
        except MiddlewareMismatch as exc:
            logger.warning("SuperLink middleware not gated: %s; Flower's stock middleware runs", exc)
            return list(middleware)

    gated.graphfl_gated = True  # type: ignore[attr-defined]
    superlink_main._get_middleware = gated
    return True
