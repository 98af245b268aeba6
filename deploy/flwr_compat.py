"""The Flower internals graphfl's warm ClientApp executor and fast SuperNode wrap, checked at start-up.

graphfl runs ClientApps in warm workers (:mod:`graphfl.deploy.warm`) and removes the
SuperNode's hard-coded poll sleeps (:mod:`graphfl.deploy.supernode`). Both go through Flower
code that is not a public API: the SuperNode's Runtime API client and the ``flwr-clientapp``
task protocol (``flwr.supernode.runtime.run_clientapp``), and the SuperNode's main loop
(``flwr.supernode.start_client_internal``). They were written against one Flower release,
:data:`PINNED_FLWR` (also pinned in ``pyproject.toml``). :func:`check_flower` refuses any
other release, and checks that the wrapped functions still contain what the wrappers rely
on, with an error that says how to fall back (``--clientapp-mode cold`` runs stock Flower
processes only).
"""

from __future__ import annotations

import inspect
from importlib import metadata

PINNED_FLWR = "1.41.0"
"""The Flower release whose internals the warm executor and the fast SuperNode wrap."""

FALLBACK = "use --clientapp-mode cold (stock flower-supernode / flwr-clientapp processes) or install flwr==" + PINNED_FLWR

SUPERLINK_FALLBACK = ("use `graphfl superlink --middleware stock` (Flower's SuperLink unchanged) or install flwr=="
                      + PINNED_FLWR)


class FlowerInternalsError(RuntimeError):
    """The installed Flower is not the one whose internals graphfl wraps."""


def installed_flwr() -> str:
    """Version of the installed ``flwr`` distribution (``"none"`` when it is missing)."""
    try:
        return metadata.version("flwr")
    except metadata.PackageNotFoundError:
        return "none"


def check_version(found: str | None = None, wrapper: str = "warm ClientApp executor and fast SuperNode",
                  fallback: str = FALLBACK) -> None:
    """Raise :class:`FlowerInternalsError` unless the installed Flower is :data:`PINNED_FLWR`."""
    found = installed_flwr() if found is None else found
    if found != PINNED_FLWR:
        raise FlowerInternalsError(
            f"graphfl's {wrapper} wrap internals of flwr=={PINNED_FLWR}, "
            f"but flwr {found} is installed; {fallback}"
        )


def _require(obj: object, what: str, needles: tuple[str, ...], fallback: str = FALLBACK) -> None:
    try:
        source = inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError) as exc:
        raise FlowerInternalsError(f"cannot read the source of Flower's {what} ({exc}); {fallback}") from None
    missing = [n for n in needles if n not in source]
    if missing:
        raise FlowerInternalsError(
            f"Flower's {what} no longer contains {missing}: graphfl's wrapper does not fit this Flower; {fallback}"
        )


def check_executor_internals() -> None:
    """Version check plus the ClientApp task protocol the warm worker reuses (import errors become clear)."""
    check_version()
    try:
        from flwr.supernode.runtime import run_clientapp as rc
    except ImportError as exc:
        raise FlowerInternalsError(f"cannot import Flower's ClientApp runtime ({exc}); {FALLBACK}") from None
    for name in ("pull_task_input", "push_message", "push_task_output", "install_from_fab",
                 "get_load_client_app_fn", "get_project_dir", "RuntimeHttpClient",
                 "pull_and_inflate_object_from_tree", "make_pull_object_fn_protobuf",
                 "make_confirm_message_received_fn_protobuf", "TaskIdentity"):
        if not hasattr(rc, name):
            raise FlowerInternalsError(f"flwr.supernode.runtime.run_clientapp has no {name!r}; {FALLBACK}")
    try:
        from flwr.supercore.constant import TASK_TOKEN_HEADER  # noqa: F401
        from flwr.supercore.interceptors.http.utils import add_headers  # noqa: F401
    except ImportError as exc:
        raise FlowerInternalsError(f"cannot import Flower's Runtime API token header ({exc}); {FALLBACK}") from None
    _require(rc.pull_task_input, "ClientApp task input pull",
             ("PullTaskInput(PullTaskInputRequest())", "PullMessages(", "pull_and_inflate_object_from_tree(",
              'message.metadata.__dict__["_message_id"] = object_tree.object_id'))
    _require(rc.run_clientapp, "flwr-clientapp task protocol",
             ("pull_task_input(client)", "install_from_fab(", "load_client_app_fn(",
              "push_message(client, reply_message, context)", "push_task_output("))


def check_supernode_internals() -> None:
    """Version check plus the SuperNode main loop's sleeps that :mod:`graphfl.deploy.supernode` replaces."""
    check_version()
    try:
        from flwr.supernode import start_client_internal as sci
        from flwr.supernode.cli import flower_supernode  # noqa: F401
    except ImportError as exc:
        raise FlowerInternalsError(f"cannot import Flower's SuperNode ({exc}); {FALLBACK}") from None
    _require(sci.start_client_internal, "SuperNode main loop",
             ("run_id = _pull_and_store_message(", "time.sleep(3)"))
    _require(sci._push_messages, "SuperNode reply wait", ("time.sleep(0.5)",))
    _require(sci._pull_and_store_message, "SuperNode message pull", ("pull_objects(",))


def check_superlink_internals() -> None:
    """Version check plus the path tests that make :mod:`graphfl.deploy.superlink`'s path gates exact.

    Every gated middleware must still call straight through outside its prefix: the Control
    ones test ``_is_control_path`` (``/v1/control/``) or Control-only route keys, the Fleet
    ones ``/v1/fleet/``, and the Runtime tracing acts only on replies of Runtime routes.
    """
    fb = SUPERLINK_FALLBACK
    check_version(wrapper="path-gated SuperLink middleware", fallback=fb)
    try:
        import flwr.superlink.main as superlink_main
        from flwr.supercore.protobuf import translation
        from flwr.supercore.routers.runtime import tracing
        from flwr.superlink.routers.control import middlewares as control
        from flwr.superlink.routers.fleet import middlewares as fleet
        from flwr.superlink.routers.fleet import node_auth
    except ImportError as exc:
        raise FlowerInternalsError(f"cannot import Flower's SuperLink middleware ({exc}); {fb}") from None
    if not hasattr(superlink_main, "_get_middleware"):
        raise FlowerInternalsError(f"flwr.superlink.main has no '_get_middleware'; {fb}")
    _require(superlink_main.create_app, "SuperLink app factory", ("middleware=_get_middleware()",), fb)
    _require(control._is_control_path, "Control path test", ('path.startswith("/v1/control/")',), fb)
    off_routes = sorted(p for _, p in control.CONTROL_SENSITIVE_ROUTE_KEYS if not p.startswith("/v1/control/"))
    if off_routes:
        raise FlowerInternalsError(f"Flower's sensitive Control routes include non-Control paths {off_routes}; {fb}")
    _require(control.ControlSensitiveResponseMiddleware.dispatch, "Control sensitive-response middleware",
             ("if _is_control_sensitive_route(request):",), fb)
    _require(control._is_control_sensitive_route, "Control sensitive-route test",
             ("in CONTROL_SENSITIVE_ROUTE_KEYS",), fb)
    for cls, needle in ((control.ControlAuthenticationMiddleware, "if not _is_control_path(request.url.path)"),
                        (control.ControlLicenseMiddleware, "not _is_control_path(request.url.path)"),
                        (control.ControlEventLogMiddleware, "if not _is_control_path(request.url.path)"),
                        (node_auth.NodeAuthMiddleware, 'if request.url.path.startswith("/v1/fleet/")'),
                        (fleet.FleetEventLogMiddleware, 'if not request.url.path.startswith("/v1/fleet/")')):
        _require(cls.dispatch, cls.__name__, (needle,), fb)
    _require(tracing.RuntimeTracingMiddleware.dispatch, "RuntimeTracingMiddleware",
             ("isinstance(result, AcquireTaskResponse)", "isinstance(result, PullTaskInputResponse)",
              "return response"), fb)
    traced = sorted(p for (_, p), kind in translation.PROTOBUF_REQUEST_TYPES.items()
                    if kind.__name__ in ("AcquireTaskRequest", "PullTaskInputRequest"))
    if not traced or any(not p.startswith("/v1/runtime/") for p in traced):
        raise FlowerInternalsError(f"Flower's AcquireTask / PullTaskInput routes are {traced}, not Runtime paths; {fb}")
