"""graphfl's path-gated SuperLink (flowerx/superlink_gates.py, run by deploy/superlink.py): the gate
itself, the checks of Flower's internals, the version policy, and Flower's real SuperLink app
answering the same with and without the gates.

The real deployments of the other e2e tests (test_e2e_flower, test_warm_workers, ...) run this
SuperLink as a process; here the app runs in-process through Starlette's test client.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from graphfl.deploy.federation import superlink_argv
from graphfl.deploy.superlink import parse_args
from graphfl.flowerx import policy
from graphfl.flowerx import superlink_gates as gates
from graphfl.flowerx.superlink_gates import MiddlewareMismatch


@pytest.fixture(autouse=True)
def fresh_decisions(monkeypatch):
    """Each test decides the fast paths anew, on the real installed Flower unless it says otherwise."""
    monkeypatch.delenv(policy.VERSION_ENV, raising=False)
    monkeypatch.delenv(policy.OFF_ENV, raising=False)
    policy.forget()
    yield
    policy.forget()


class Marking(BaseHTTPMiddleware):
    """Counts the requests it sees and marks their responses."""

    seen: list[str] = []

    def __init__(self, app: Any, label: str = "x") -> None:
        super().__init__(app)
        self.label = label

    async def dispatch(self, request: Request, call_next: Any) -> Response:
        Marking.seen.append(request.url.path)
        response = await call_next(request)
        response.headers["x-marked"] = self.label
        return response


def _toy_app(stack: list[Middleware]) -> Starlette:
    async def ok(request: Request) -> Response:
        return PlainTextResponse(request.url.path)

    return Starlette(routes=[Route("/v1/control/a", ok), Route("/v1/fleet/b", ok), Route("/other", ok)],
                     middleware=stack)


def test_a_gated_middleware_sees_only_the_requests_under_its_prefix() -> None:
    Marking.seen = []
    app = _toy_app([Middleware(gates.PathGate, middleware=Marking, prefix="/v1/control/", kwargs={"label": "c"})])
    with TestClient(app) as client:  # the lifespan scope goes through the gate as well
        control = client.get("/v1/control/a")
        fleet = client.get("/v1/fleet/b")
        other = client.get("/other")
    assert Marking.seen == ["/v1/control/a"]
    assert control.headers["x-marked"] == "c" and control.text == "/v1/control/a"
    assert "x-marked" not in fleet.headers and fleet.text == "/v1/fleet/b"
    assert "x-marked" not in other.headers and other.status_code == 200


def test_the_gate_tests_the_path_starlette_gives_the_middleware() -> None:
    scope = {"type": "http", "path": "/v1/fleet/pull-messages", "root_path": "", "query_string": b"",
             "headers": [], "scheme": "http", "server": ("127.0.0.1", 80)}
    assert gates.request_path(scope) == Request(scope).url.path == "/v1/fleet/pull-messages"


def test_flowers_middleware_is_gated_in_order_with_its_arguments() -> None:
    import flwr.superlink.main as superlink_main

    stock = superlink_main._get_middleware()
    gated = gates.gate_middleware(stock)
    assert len(gated) == len(stock) == len(gates.expected_order())
    for before, after in zip(stock, gated):
        name = before.cls.__name__
        if name in gates.GATES:
            assert after.cls is gates.PathGate
            assert after.kwargs["middleware"] is before.cls and after.kwargs["prefix"] == gates.GATES[name]
            assert after.kwargs["args"] == before.args and after.kwargs["kwargs"] == before.kwargs
        else:  # the error translator and the protobuf translation act on every path: untouched
            assert after is before
    assert sum(m.cls is gates.PathGate for m in gated) == sum(n in gates.GATES for n in gates.expected_order())
    assert sum(m.cls is gates.PathGate for m in gated) == (7 if policy.installed_flower() == "1.41.0" else 6)


def test_a_middleware_list_the_gates_were_not_checked_for_is_refused() -> None:
    import flwr.superlink.main as superlink_main

    stock = superlink_main._get_middleware()
    extra = [Middleware(Marking), *stock]  # e.g. a SuperLink extension's middleware
    with pytest.raises(MiddlewareMismatch, match=r"Marking"):
        gates.gate_middleware(extra)
    with pytest.raises(MiddlewareMismatch, match="not the"):
        gates.gate_middleware(stock[:-1])
    with pytest.raises(MiddlewareMismatch):   # the 1.41 list on 1.42 and the other way round
        gates.gate_middleware(stock, version="1.42.0" if policy.installed_flower() == "1.41.0" else "1.41.0")


def test_the_internals_check_passes_on_this_flower_and_names_a_changed_path_test(monkeypatch, caplog) -> None:
    assert gates.check() is None
    from flwr.superlink.routers.fleet import node_auth

    class Changed(BaseHTTPMiddleware):
        async def dispatch(self, request: Request, call_next: Any) -> Response:
            return await call_next(request)  # authenticates every path: a gate would change it

    monkeypatch.setattr(node_auth, "NodeAuthMiddleware", Changed)
    reason = gates.check()
    assert reason is not None and "Changed" in reason and "/v1/fleet/" in reason
    # the policy then keeps Flower's SuperLink unchanged, with one line saying why
    import flwr.superlink.main as superlink_main

    monkeypatch.setattr(superlink_main, "_get_middleware", superlink_main._get_middleware)
    before = superlink_main._get_middleware
    with caplog.at_level("WARNING", logger="graphfl.flowerx"):
        assert gates.install_gated_middleware() is False
        assert gates.install_gated_middleware() is False
    assert superlink_main._get_middleware is before
    lines = [r.getMessage() for r in caplog.records if r.name == "graphfl.flowerx"]
    assert len(lines) == 1 and "superlink-gates" in lines[0] and "Changed" in lines[0], lines


def test_an_unverified_flower_runs_the_stock_superlink_with_one_log_line(monkeypatch, caplog) -> None:
    import flwr.superlink.main as superlink_main

    monkeypatch.setattr(superlink_main, "_get_middleware", superlink_main._get_middleware)
    before = superlink_main._get_middleware
    monkeypatch.setenv(policy.VERSION_ENV, "1.40.0")
    with caplog.at_level("WARNING", logger="graphfl.flowerx"):
        assert gates.install_gated_middleware() is False
    assert superlink_main._get_middleware is before
    assert not any(m.cls is gates.PathGate for m in superlink_main.create_app().user_middleware)
    lines = [r.getMessage() for r in caplog.records if r.name == "graphfl.flowerx"]
    assert len(lines) == 1, lines
    assert "superlink-gates" in lines[0] and "flwr 1.40.0" in lines[0] and "stock middleware" in lines[0]


REQUESTS = [
    ("POST", "/v1/control/get-login-details", b"", "application/protobuf"),  # sensitive: no-store headers
    ("POST", "/v1/control/list-runs", b"", "application/protobuf"),
    ("POST", "/v1/control/list-runs", b"{}", "application/json"),
    ("POST", "/v1/fleet/pull-messages", b"", "application/protobuf"),  # node auth refuses it
    ("POST", "/v1/fleet/pull-messages", b"\x01\x02", "application/json"),
    ("POST", "/v1/fleet/no-such-route", b"", "application/protobuf"),
    ("POST", "/v1/runtime/get-nodes", b"", "application/protobuf"),  # task-token auth refuses it
    ("POST", "/v1/runtime/acquire-task", b"", "application/protobuf"),
    ("GET", "/health", b"", ""),
    ("GET", "/elsewhere", b"", ""),
]


def _answers(app: Any) -> list[tuple[Any, ...]]:
    out = []
    with TestClient(app, raise_server_exceptions=False) as client:
        for method, path, body, kind in REQUESTS:
            r = client.request(method, path, content=body, headers={"content-type": kind} if kind else {})
            text = re.sub(rb"\d{4}-\d\d-\d\dT[\d:.+]+", b"<time>", r.content)  # list-runs stamps "now"
            out.append((path, r.status_code, r.headers.get("content-type"), r.headers.get("cache-control"),
                        r.headers.get("pragma"), text))
    return out


def test_flowers_superlink_app_answers_the_same_with_and_without_the_gates(monkeypatch) -> None:
    import flwr.superlink.main as superlink_main

    stock_answers = _answers(superlink_main.create_app())
    monkeypatch.setattr(superlink_main, "_get_middleware", superlink_main._get_middleware)  # put back after
    assert gates.install_gated_middleware()  # replaces the module attribute
    gated_app = superlink_main.create_app()
    assert any(m.cls is gates.PathGate for m in gated_app.user_middleware)
    gated_answers = _answers(gated_app)
    assert gated_answers == stock_answers
    # the requests did reach the gated layers: the sensitive-response headers and node auth's refusal
    assert gated_answers[0][3] == "no-store" and gated_answers[0][1] == 200
    assert gated_answers[3][1] == 401 and b"SuperNode authentication" in gated_answers[3][5]
    assert gated_answers[6][1] == 401


def test_the_superlink_command_line_picks_the_wrapper_or_the_stock_command() -> None:
    gated = superlink_argv("127.0.0.1", 9999, None)
    assert gated[:4] == [sys.executable, "-m", "graphfl.deploy.superlink", "--"]
    assert gated[4:6] == ["--host", "127.0.0.1"] and "--insecure" in gated
    stock = superlink_argv("127.0.0.1", 9999, None, middleware="stock")
    assert stock[0] == "flower-superlink" and stock[1:] == gated[4:]
    with pytest.raises(ValueError, match="gated"):
        superlink_argv("127.0.0.1", 9999, None, middleware="fast")
    ours, flower = parse_args(["--middleware", "stock", "--", "--port", "1"])
    assert ours.middleware == "stock" and flower == ["--port", "1"]
