"""In-process driver: the same cores, trainers and round loop, no Flower, no sockets.

Used by benchmarks (fast) and tests. For the same config it produces the same results as
``graphfl run`` on Flower's engines (tests/test_e2e_flower.py checks this).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.client.handler import ClientRuntime, SharedInputs, build_runtime, check_client_options, handle, shared_inputs
from graphfl.client.noisy_channel import CHANNEL_REF, transmit_upload
from graphfl.client.state_store import CLIENT_STATE_DIR, StateStore, state_for_request, store_for
from graphfl.common import wire
from graphfl.common.arrays import read_only_views
from graphfl.common.config import RunConfig
from graphfl.common.core import EVALUATE_PHASE, ServerCore
from graphfl.common.types import Arrays, ClientState, Payload
from graphfl.server.exchange import Reply, Request
from graphfl.server.recorder import RunRecorder
from graphfl.server.rounds import ServerInputs, run_federated

logger = logging.getLogger(__name__)

FailKey = tuple[int, int] | tuple[int, int, str]
"""``(round, partition id)`` or ``(round, partition id, phase)``."""


class InProcessExchange:
    """Runs each client's handler directly; client state lives in a dict per client (mirrored
    under ``state_dir`` like a SuperNode's ``state-dir``, :mod:`graphfl.client.state_store`).

    ``fail`` maps ``(round, partition id)`` -- or ``(round, partition id, phase)`` for one
    phase only -- to a behaviour (``"error"`` or ``"nan"``), to inject failures in tests of
    the loop's error handling.

    The receiving side gets read-only views, as in a deployment (where the ClientApp and the
    ServerApp read views into the received message): a client handler gets its payload's arrays
    as views (:meth:`received`), the round loop and the server core get every reply's arrays and
    mask as views (:meth:`transmit`), both by :func:`~graphfl.common.arrays.read_only_views`. No
    data is copied and the sender's own arrays stay writable; writing into a received array
    raises ``ValueError`` (a client's then becomes its failed reply).
    """

    def __init__(self, cfg: RunConfig, fail: Mapping[FailKey, str] | None = None,
                 state_dir: str | Path | None = None, shared: SharedInputs | None = None) -> None:
        self.cfg = cfg
        self.runtimes: dict[int, ClientRuntime] = {}
        self.states: dict[int, ClientState] = {}
        self.fail: dict[FailKey, str] = dict(fail or {})
        self.state_dir = str(state_dir) if state_dir else None
        self._live: set[int] = set()   # clients whose state this run produced (else it may be loaded)
        self._shared = shared

    def runtime(self, pid: int) -> ClientRuntime:
        """The client's runtime, built on first use (its data stays loaded; the task and the
        client graph are built once for all clients).
        """
        if pid not in self.runtimes:
            if self._shared is None:
                self._shared = shared_inputs(self.cfg)
            self.runtimes[pid] = build_runtime(self.cfg, pid, self.cfg.nodes, shared=self._shared)
            self.states[pid] = {}
        return self.runtimes[pid]

    def fail_mode(self, request: Request, pid: int) -> str | None:
        """The injected behaviour for this request and client (``"error"``, ``"nan"`` or ``None``)."""
        r = request.server_round
        return self.fail.get((r, pid, request.phase), self.fail.get((r, pid)))

    def open_client(self, request: Request, pid: int) -> tuple[ClientRuntime, StateStore | None, ClientState,
                                                                 int | None]:
        """The client's runtime, state store, the state to serve ``request`` with and the round
        it was restored from (:func:`~graphfl.client.state_store.state_for_request`).
        """
        runtime = self.runtime(pid)
        store = store_for(self.state_dir, self.cfg.run_key, pid)
        state, restored = state_for_request(store, request.kind, request.server_round, self.states[pid],
                                            pid in self._live)
        self.states[pid] = state
        return runtime, store, state, restored

    def close_client(self, request: Request, pid: int, store: StateStore | None, state: ClientState,
                     restored: int | None, metrics: dict[str, float]) -> None:
        """After a served request: report a restored state, mark the client live, save its state."""
        if restored is not None:
            metrics[wire.STATE_RESTORED] = float(restored)
        if request.kind != wire.JOIN:
            self._live.add(pid)
            if store is not None:
                store.save(request.server_round, state)

    @staticmethod
    def error_reply(request: Request, pid: int, exc: Exception) -> Reply:
        """A failed client's reply (logged; an ``OSError``, a full disk say, without a traceback)."""
        r = request.server_round
        if isinstance(exc, OSError):
            logger.error("client %d failed in round %d (phase %s): %s", pid, r, request.phase, exc)
        else:
            logger.error("client %d failed in round %d (phase %s)", pid, r, request.phase, exc_info=exc)
        return Reply(pid, error=f"{type(exc).__name__}: {exc}")

    @staticmethod
    def received(payloads: Mapping[int, Payload]) -> dict[int, Payload]:
        """``payloads`` as the clients receive them: the same config, the arrays as read-only
        views (:func:`~graphfl.common.arrays.read_only_views`). A payload, an arrays dict or an
        array that several clients share stays one object, so a broadcast is still one model.
        """
        memo: dict[int, np.ndarray] = {}
        by_arrays: dict[int, Arrays] = {}
        by_payload: dict[int, Payload] = {}
        out: dict[int, Payload] = {}
        for pid, payload in payloads.items():
            got = by_payload.get(id(payload))
            if got is None:
                views = by_arrays.get(id(payload.arrays))
                if views is None:
                    views = by_arrays[id(payload.arrays)] = read_only_views(payload.arrays, memo)
                got = by_payload[id(payload)] = Payload(views, payload.config)
            out[pid] = got
        return out

    def transmit(self, request: Request, pid: int, payload: Payload, arrays: Arrays | None,
                 metrics: dict[str, float], mode: str | None) -> Reply:
        """The reply as the server receives it: through the noisy uplink when ``[channel]`` is on
        (the function the ClientApp's channel mod applies), NaN-poisoned when injected, its
        arrays and mask read-only views (the client keeps its own arrays writable).
        """
        mask = None
        channel = self.cfg.channel
        if arrays and channel.active:
            ref = payload.config.get(CHANNEL_REF)
            arrays, mask = transmit_upload(arrays, channel.noise, channel.missing, self.cfg.seed, pid,
                                           request.server_round, request.phase, None if ref is None else float(ref))
        if mode == "nan" and arrays:
            key = next(iter(arrays))
            arrays = dict(arrays)
            arrays[key] = arrays[key] * float("nan")
        return Reply(pid, None if arrays is None else read_only_views(arrays), metrics,
                     mask=None if mask is None else read_only_views(mask))

    def _call(self, request: Request, pid: int, payload: Payload) -> Reply:
        """Serve one client; ``payload`` as the client receives it (:meth:`received`)."""
        r = request.server_round
        mode = self.fail_mode(request, pid)
        if mode == "error":
            return Reply(pid, error="injected failure")
        try:
            runtime, store, state, restored = self.open_client(request, pid)
            arrays, metrics = handle(runtime, request.kind, r, payload, state, request.eval_first, request.phase)
            self.close_client(request, pid, store, state, restored, metrics)
        except Exception as exc:  # noqa: BLE001 - a failing client is a failed reply (logged), as in deployment
            return self.error_reply(request, pid, exc)
        return self.transmit(request, pid, payload, arrays, metrics, mode)

    def join(self, initial: Payload, num_clients: int) -> dict[int, Reply]:
        """Every client evaluates the initial model and reports its partition and size."""
        request = Request(wire.JOIN, 0, EVALUATE_PHASE)
        received = self.received({pid: initial for pid in range(num_clients)})
        return {pid: self._call(request, pid, p) for pid, p in received.items()}

    def send(self, request: Request, payloads: Mapping[int, Payload]) -> dict[int, Reply]:
        """Serve ``payloads`` one client after the other (partition-id order)."""
        return {pid: self._call(request, pid, p) for pid, p in self.received(payloads).items()}


def server_inputs(cfg: RunConfig, shared: SharedInputs | None = None) -> ServerInputs:
    """Initial arrays, parameter keys, the resolved client graph and cluster labels of ``cfg``'s task.

    ``shared``: the task and client graph the in-process clients use (built once for both).
    """
    from graphfl.client.training import get_arrays, param_keys
    from graphfl.common.graph import resolve_client_graph
    from graphfl.tasks import registry as tasks
    from graphfl.tasks.base import DataError

    if shared is not None:
        task, graph, source = shared.task, shared.graph, shared.graph_source
    else:
        task = tasks.create(cfg.task, data=cfg.data, data_dir=cfg.data_dir, seed=cfg.seed)
        graph, source = resolve_client_graph(cfg.nodes, task.client_graph(cfg.nodes), cfg.graph_file, cfg.task)
    model = task.build_model()
    try:
        info = task.describe()
    except DataError as exc:  # a server without the data files still runs; the clients load them
        logger.warning("task %s: no data description on the server (%s)", cfg.task, exc)
        info = {}
    return ServerInputs(get_arrays(model), param_keys(model), graph, source, task.cluster_labels(cfg.nodes), info)


def run_federated_inprocess(
    cfg: RunConfig, out_dir: str | Path | None = None, name: str = "run",
    progress: Callable[[dict[str, Any]], None] | None = None,
    fail: Mapping[FailKey, str] | None = None,
) -> tuple[dict[str, Any], ServerCore[Any]]:
    """Run ``cfg`` in this process; return (result document, final server core).

    With ``out_dir`` the run checkpoints there and its clients mirror their state to
    ``<out_dir>/client-state`` (when ``cfg.run_key`` is set), so ``cfg.resume`` can continue it.
    """
    import torch

    from graphfl.common import registry
    from graphfl.common.envinfo import env_info

    torch.set_num_threads(1)
    spec = registry.get(cfg.strategy)
    check_client_options(cfg)   # a client-side option the trainer cannot serve: refused before any client trains
    try:  # the task and the client graph, once for the server and every client
        shared: SharedInputs | None = shared_inputs(cfg)
    except Exception:  # noqa: BLE001 - e.g. a device that is absent: each client reports it in the run
        shared = None
    inputs = server_inputs(cfg, shared)
    state_dir = Path(out_dir) / CLIENT_STATE_DIR if out_dir else None
    exchange: InProcessExchange
    if cfg.engine == "batched":
        from graphfl.server.batched import BatchedExchange

        exchange = BatchedExchange(cfg, fail, state_dir=state_dir, shared=shared)
    else:
        exchange = InProcessExchange(cfg, fail, state_dir=state_dir, shared=shared)
    try:  # the device the clients really train on (``auto`` depends on the model's size)
        device: str | None = str(exchange.runtime(0).ctx.device)
    except Exception:  # noqa: BLE001 - a broken client 0 fails inside the run, with its own report
        device = None
    env: dict[str, Any] = {**env_info(device), "engine": "inprocess"}
    if cfg.engine == "batched":
        env.update(exchange.describe())   # type: ignore[attr-defined]
    recorder = RunRecorder(cfg, cfg.strategy, Path(out_dir) if out_dir else None, name=name, env=env,
                           progress=progress)
    core = run_federated(cfg, spec, exchange, inputs, recorder)
    return recorder.document(), core
