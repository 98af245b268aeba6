"""In-process driver: the same cores, trainers and round loop, no Flower, no sockets.

Used by benchmarks (fast) and tests. For the same config it produces the same results as
``graphfl run`` on Flower's engines (tests/test_e2e_flower.py checks this).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from graphfl.client.handler import ClientRuntime, build_runtime, handle
from graphfl.client.noisy_channel import CHANNEL_REF, transmit_upload
from graphfl.client.state_store import CLIENT_STATE_DIR, state_for_request, store_for
from graphfl.common import wire
from graphfl.common.config import RunConfig
from graphfl.common.core import EVALUATE_PHASE, ServerCore
from graphfl.common.types import ClientState, Payload
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
    """

    def __init__(self, cfg: RunConfig, fail: Mapping[FailKey, str] | None = None,
                 state_dir: str | Path | None = None) -> None:
        self.cfg = cfg
        self.runtimes: dict[int, ClientRuntime] = {}
        self.states: dict[int, ClientState] = {}
        self.fail: dict[FailKey, str] = dict(fail or {})
        self.state_dir = str(state_dir) if state_dir else None
        self._live: set[int] = set()   # clients whose state this run produced (else it may be loaded)

    def runtime(self, pid: int) -> ClientRuntime:
        """The client's runtime, built on first use (its data stays loaded)."""
        if pid not in self.runtimes:
            self.runtimes[pid] = build_runtime(self.cfg, pid, self.cfg.nodes)
            self.states[pid] = {}
        return self.runtimes[pid]

    def _call(self, request: Request, pid: int, payload: Payload) -> Reply:
        r = request.server_round
        mode = self.fail.get((r, pid, request.phase), self.fail.get((r, pid)))
        if mode == "error":
            return Reply(pid, error="injected failure")
        try:
            runtime = self.runtime(pid)
            store = store_for(self.state_dir, self.cfg.run_key, pid)
            state, restored = state_for_request(store, request.kind, r, self.states[pid], pid in self._live)
            self.states[pid] = state
            arrays, metrics = handle(runtime, request.kind, r, payload, state, request.eval_first, request.phase)
            if restored is not None:
                metrics[wire.STATE_RESTORED] = float(restored)
            if request.kind != wire.JOIN:
                self._live.add(pid)
                if store is not None:
                    store.save(r, state)
        except OSError as exc:  # its state could not be saved (a full disk): the reason, not a traceback
            logger.error("client %d failed in round %d (phase %s): %s", pid, r, request.phase, exc)
            return Reply(pid, error=f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a failing client is a failed reply, as in deployment
            logger.exception("client %d failed in round %d (phase %s)", pid, r, request.phase)
            return Reply(pid, error=f"{type(exc).__name__}: {exc}")
        mask = None
        channel = self.cfg.channel
        if arrays and channel.active:  # the same function the ClientApp's channel mod applies
            ref = payload.config.get(CHANNEL_REF)
            arrays, mask = transmit_upload(arrays, channel.noise, channel.missing, self.cfg.seed, pid, r,
                                           request.phase, None if ref is None else float(ref))
        if mode == "nan" and arrays:
            key = next(iter(arrays))
            arrays = dict(arrays)
            arrays[key] = arrays[key] * float("nan")
        return Reply(pid, arrays, metrics, mask=mask)

    def join(self, initial: Payload, num_clients: int) -> dict[int, Reply]:
        """Every client evaluates the initial model and reports its partition and size."""
        request = Request(wire.JOIN, 0, EVALUATE_PHASE)
        return {pid: self._call(request, pid, initial) for pid in range(num_clients)}

    def send(self, request: Request, payloads: Mapping[int, Payload]) -> dict[int, Reply]:
        """Serve ``payloads`` one client after the other (partition-id order)."""
        return {pid: self._call(request, pid, p) for pid, p in payloads.items()}


def server_inputs(cfg: RunConfig) -> ServerInputs:
    """Initial arrays, parameter keys, the resolved client graph and cluster labels of ``cfg``'s task."""
    from graphfl.client.training import get_arrays, param_keys
    from graphfl.common.graph import resolve_client_graph
    from graphfl.tasks import registry as tasks
    from graphfl.tasks.base import DataError

    task = tasks.create(cfg.task, data=cfg.data, data_dir=cfg.data_dir, seed=cfg.seed)
    model = task.build_model()
    graph, source = resolve_client_graph(cfg.nodes, task.client_graph(cfg.nodes), cfg.graph_file, cfg.task)
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
    inputs = server_inputs(cfg)
    state_dir = Path(out_dir) / CLIENT_STATE_DIR if out_dir else None
    exchange = InProcessExchange(cfg, fail, state_dir=state_dir)
    try:  # the device the clients really train on (``auto`` depends on the model's size)
        device: str | None = str(exchange.runtime(0).ctx.device)
    except Exception:  # noqa: BLE001 - a broken client 0 fails inside the run, with its own report
        device = None
    recorder = RunRecorder(cfg, cfg.strategy, Path(out_dir) if out_dir else None, name=name,
                           env={**env_info(device), "engine": "inprocess"}, progress=progress)
    core = run_federated(cfg, spec, exchange, inputs, recorder)
    return recorder.document(), core
