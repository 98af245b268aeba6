"""Fast path ``warm-clientapp``: Flower's ClientApp task protocol served from a long-lived process.

Flower's ``flwr-clientapp`` serves one task per process: pull the task input and the message from
the SuperNode's Runtime API, install the FAB, load the ClientApp, run it, push the reply, push the
task output (``flwr.supernode.runtime.run_clientapp``). :class:`TaskRunner` does the same with
Flower's own functions, task after task in one process, installing each FAB and loading each
ClientApp once per FAB hash. :func:`claim_task` is the executor's half (``AcquireTask``, the call
``flower-superexec`` makes) and :func:`push_crash_reply` answers a task whose worker died.

The Runtime API clients here (:class:`RuntimeTarget`) retry within a bound and never signal their
own process (Flower's per-message process retries for ever and sends itself SIGINT on HTTP 401,
right for a process that lives one task, not for a worker that outlives it).

On: when :func:`check` finds the task protocol these functions reuse. Off: the SuperNode runs its
ClientApps as stock ``flwr-clientapp`` processes (``--isolation subprocess``).
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphfl.flowerx import hash_once
from graphfl.flowerx.checks import first_reason, lacks_attributes, lacks_source
from graphfl.flowerx.policy import FastPath, decide

logger = logging.getLogger("graphfl.flowerx")

FAST_PATH = FastPath("warm-clientapp", "warm ClientApp workers",
                     "ClientApps run as stock flwr-clientapp processes, one per message")

PULL_BACKOFF = (0.01, 0.1)
"""(initial, cap) seconds between retries of an object that is not yet in the SuperNode's store.
Flower's defaults (1 s, 10 s) suit a ClientApp that starts seconds after its task; a warm worker
claims the task while the SuperNode may still be pulling the message's objects from the SuperLink."""

HEARTBEAT_SECONDS = 20.0
"""Task heartbeat period (Flower's ClientApp sends one about every 20 s, HEARTBEAT_DEFAULT_INTERVAL 30)."""


def check() -> str | None:
    """Why the warm runtime does not fit this Flower's ClientApp task protocol, or ``None``."""
    from flwr.supercore.constant import TASK_TOKEN_HEADER  # noqa: F401
    from flwr.supercore.interceptors.http.utils import add_headers  # noqa: F401
    from flwr.supernode.runtime import run_clientapp as rc

    return first_reason(
        lacks_attributes(rc, ("pull_task_input", "push_message", "push_task_output", "install_from_fab",
                              "get_load_client_app_fn", "get_project_dir", "RuntimeHttpClient",
                              "pull_and_inflate_object_from_tree", "make_pull_object_fn_protobuf",
                              "make_confirm_message_received_fn_protobuf", "TaskIdentity")),
        lacks_source(rc.pull_task_input, "ClientApp task input pull",
                     ("PullTaskInput(PullTaskInputRequest())", "PullMessages(", "pull_and_inflate_object_from_tree(",
                      'message.metadata.__dict__["_message_id"] = object_tree.object_id')),
        lacks_source(rc.run_clientapp, "flwr-clientapp task protocol",
                     ("pull_task_input(client)", "install_from_fab(", "load_client_app_fn(",
                      "push_message(client, reply_message, context)", "push_task_output(")),
    )


def available() -> bool:
    """Whether the warm ClientApp runtime is on in this process (:func:`graphfl.flowerx.policy.decide`)."""
    return decide(FAST_PATH, check)


class TaskToken:
    """Adds the current task's token to every Runtime API request (the worker's one client
    serves task after task; Flower's ``RuntimeTokenHttpInterceptor`` holds a fixed token).
    """

    def __init__(self) -> None:
        self.token: str | None = None

    def intercept(self, context: Any, call_next: Any) -> Any:
        from flwr.supercore.constant import TASK_TOKEN_HEADER
        from flwr.supercore.interceptors.http.utils import add_headers

        if not self.token:
            raise RuntimeError("no task token set")
        add_headers(context.request, {TASK_TOKEN_HEADER: self.token})
        return call_next(context)


@dataclass(frozen=True)
class RuntimeTarget:
    """Where the SuperNode's Runtime API is and how to reach it."""

    address: str
    insecure: bool = True
    root_certificates: str | None = None

    def client(self, component: str, token: str | TaskToken | None = None, max_time: float = 30.0) -> Any:
        """A ``RuntimeHttpClient`` whose retries stop after ``max_time`` s and never signal this process.

        ``token``: a fixed task token, or a :class:`TaskToken` set per task.
        """
        import httpx
        from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
        from flwr.supercore.retry import RetryInvoker, exponential
        from flwr.supercore.runtime import RuntimeHttpClient

        def giveup(exc: Exception) -> bool:
            if isinstance(exc, httpx.HTTPStatusError):
                return exc.response.status_code not in (502, 503, 504)
            return False

        retry = RetryInvoker(
            lambda: exponential(base_delay=0.05, multiplier=2, max_delay=2),
            (httpx.TransportError, httpx.HTTPStatusError), max_tries=None, max_time=max_time,
            should_giveup=giveup,
        )
        interceptors: list[Any] = [RuntimeVersionHttpInterceptor(component_name=component)]
        if isinstance(token, TaskToken):
            interceptors.append(token)
        elif token is not None:
            interceptors.append(RuntimeTokenHttpInterceptor(token))
        certs = None
        if not self.insecure and self.root_certificates:
            certs = Path(self.root_certificates).expanduser().read_bytes()
        return RuntimeHttpClient.from_server_address(self.address, insecure=self.insecure, root_certificates=certs,
                                                     interceptors=interceptors, retry_invoker=retry)


def claim_task(client: Any) -> tuple[int, str] | None:
    """One ``AcquireTask`` for a ClientApp task: ``(task_id, token)``, or ``None`` when none waits."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType

    res = client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
    if not (res.HasField("task") and res.token):
        return None
    return int(res.task.task_id), str(res.token)


class TaskHeartbeat:
    """Sends ``SendTaskHeartbeat`` for one task every ``period`` s from a thread.

    Unlike Flower's sender it never signals the process when the SuperNode no longer knows the
    task; it only records it (``lost``), since the worker outlives the task.
    """

    def __init__(self, client: Any, period: float = HEARTBEAT_SECONDS) -> None:
        self.client = client
        self.period = period
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="task-heartbeat", daemon=True)

    def __enter__(self) -> TaskHeartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest

        while not self._stop.wait(self.period):
            try:
                res = self.client.SendTaskHeartbeat(SendTaskHeartbeatRequest())
            except Exception as exc:  # noqa: BLE001 - a heartbeat must never take the worker down
                logger.warning("task heartbeat failed: %s", exc)
                continue
            if not res.success:
                self.lost = True
                logger.warning("the SuperNode no longer knows this task (claim expired)")
                return


@dataclass
class TaskRunner:
    """Runs ClientApp tasks given their tokens; caches FAB installs and loaded ClientApps, and
    keeps one Runtime API client (connection) whose token changes per task.
    """

    target: RuntimeTarget
    report: Callable[[dict[str, Any]], None] = lambda doc: None
    installed: set[str] = field(default_factory=set)
    apps: dict[str, Any] = field(default_factory=dict)
    token: TaskToken = field(default_factory=TaskToken)
    _client: Any = None

    def client(self) -> Any:
        if self._client is None:
            self._client = self.target.client("flwr-clientapp", token=self.token)
        return self._client

    def client_app(self, run: Any, fab: Any) -> Any:
        """The run's ClientApp: FAB installed and app loaded once per FAB hash."""
        from flwr.supernode.runtime import run_clientapp as rc

        key = fab.hash_str
        if key not in self.installed:
            rc.install_from_fab(fab.content, skip_prompt=True)
            self.installed.add(key)
        if key not in self.apps:
            load = rc.get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
            self.apps[key] = load(run.fab_id, run.fab_version, key)
        return self.apps[key]

    def run(self, task_id: int, token: str) -> dict[str, Any]:
        """Serve one task end to end, as ``flwr-clientapp`` does; returns timings and the outcome.

        Reports ``{"op": "started", "task_id", "run_id", "message"}`` once the message is pulled
        (``message``: its metadata, for :func:`push_crash_reply`). An exception in the ClientApp
        becomes an error reply, as in ``flwr-clientapp``.
        """
        from flwr.app import Message
        from flwr.app.error import Error
        from flwr.app.message import remove_content_from_message
        from flwr.clientapp.client_app import LoadClientAppError
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.common.serde import message_to_proto
        from flwr.supernode.runtime import run_clientapp as rc

        t: dict[str, float] = {"received": time.time()}
        self.token.token = token
        client = self.client()
        message = reply = context = None
        sub_status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        outcome: dict[str, Any] = {"task_id": task_id}
        try:
            with TaskHeartbeat(client):
                try:
                    message, context, run, fab = pull_task_input(client, t)
                    t["input"] = time.time()
                    meta = message_to_proto(remove_content_from_message(message)).SerializeToString()
                    self.report({"op": "started", "task_id": task_id, "run_id": int(run.run_id),
                                 "message": base64.b64encode(meta).decode()})
                    outcome.update(run_id=int(run.run_id), created_at=float(message.metadata.created_at),
                                   message_type=str(message.metadata.message_type))
                    app = self.client_app(run, fab)
                    t["app"] = time.time()
                    reply = app(message=message, context=context)
                    t["handler"] = time.time()
                    sub_status, details = SubStatus.COMPLETED, ""
                except Exception as ex:
                    code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
                    reason = str(type(ex)) + ":<'" + str(ex) + "'>"
                    if isinstance(ex, LoadClientAppError):
                        code = ErrorCode.LOAD_CLIENT_APP_EXCEPTION
                        reason = "An exception was raised when attempting to load `ClientApp`"
                    logger.error("ClientApp raised an exception (task %d)", task_id, exc_info=ex)
                    sub_status, details = SubStatus.FAILED, reason
                    outcome["error"] = reason
                    if message is not None:
                        reply = Message(Error(code=code, reason=reason), reply_to=message)
                finally:
                    if reply is not None and context is not None:
                        try:
                            hash_once.push_message(client, reply, context)
                            t["reply"] = time.time()
                        except Exception as ex:
                            logger.error("failed to push the reply of task %d", task_id, exc_info=ex)
                            outcome["error"] = f"reply not pushed: {ex}"
                    rc.push_task_output(client, context, sub_status, details)
                    t["output"] = time.time()
        finally:
            self.token.token = None
        outcome["status"] = sub_status
        outcome["times"] = t
        return outcome


def pull_task_input(client: Any, times: dict[str, float] | None = None) -> tuple[Any, Any, Any, Any]:
    """``flwr.supernode.runtime.run_clientapp.pull_task_input`` with :data:`PULL_BACKOFF` instead
    of Flower's 1 s initial retry delay (same requests, same order, same result).
    """
    from flwr.app import Message
    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.task_identity import TaskIdentity

    times = {} if times is None else times
    res = client.PullTaskInput(PullTaskInputRequest())
    times["task_input"] = time.time()
    TaskIdentity.task_id = res.task_id
    TaskIdentity.run_id = res.run.run_id
    TaskIdentity.node_id = res.context.node_id
    context = context_from_proto(res.context)
    run = run_from_proto(res.run)
    fab = fab_from_proto(res.fab)
    pulled = client.PullMessages(PullAppMessagesRequest())
    times["message_tree"] = time.time()
    if not pulled.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree,
        make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message, initial_backoff=PULL_BACKOFF[0], backoff_cap=PULL_BACKOFF[1],
    )
    message.metadata.__dict__["_message_id"] = tree.object_id
    return message, context, run, fab


def push_crash_reply(client: Any, started: dict[str, Any], reason: str) -> None:
    """After the worker died in a task: push an error reply to the message it had pulled (``started``
    as reported by :meth:`TaskRunner.run`) and a failed task status, so the SuperNode (which waits
    for a reply) and the server move on at once.
    """
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.common.serde import message_from_proto
    from flwr.proto.message_pb2 import Message as ProtoMessage
    from flwr.supernode.runtime import run_clientapp as rc

    proto = ProtoMessage()
    proto.ParseFromString(base64.b64decode(started["message"]))
    original = message_from_proto(proto)
    reply = Message(Error(code=ErrorCode.CLIENT_APP_CRASHED, reason=reason), reply_to=original)

    @dataclass
    class _Where:  # what push_message reads from a Context
        node_id: int
        run_id: int

    rc.push_message(client, reply, _Where(original.metadata.dst_node_id, original.metadata.run_id))  # type: ignore[arg-type]
    rc.push_task_output(client, None, SubStatus.FAILED, reason)
