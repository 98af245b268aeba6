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
from graphfl.common import wire
from graphfl.common.config import RunConfig
from graphfl.common.core import ServerCore
from graphfl.common.types import ClientState, Payload
from graphfl.server.rounds import Reply, RunRecorder, ServerInputs, run_federated

logger = logging.getLogger(__name__)


class InProcessExchange:
    """Runs each client's handler directly; client state lives in a dict per client.

    ``fail`` maps (round, partition id) -> behaviour (``"error"`` or ``"nan"``) to inject
    failures in tests of the loop's error handling.
    """

    def __init__(self, cfg: RunConfig, fail: Mapping[tuple[int, int], str] | None = None) -> None:
        self.cfg = cfg
        self.runtimes: dict[int, ClientRuntime] = {}
        self.states: dict[int, ClientState] = {}
        self.fail = dict(fail or {})

    def runtime(self, pid: int) -> ClientRuntime:
        """The client's runtime, built on first use (its data stays loaded)."""
        if pid not in self.runtimes:
            self.runtimes[pid] = build_runtime(self.cfg, pid, self.cfg.nodes)
            self.states[pid] = {}
        return self.runtimes[pid]

    def _call(self, kind: str, r: int, pid: int, payload: Payload, eval_first: bool) -> Reply:
        mode = self.fail.get((r, pid))
        if mode == "error":
            return Reply(pid, error="injected failure")
        try:
            arrays, metrics = handle(self.runtime(pid), kind, r, payload, self.states[pid], eval_first)
        except Exception as exc:
            logger.exception("client %d failed in round %d", pid, r)
            return Reply(pid, error=f"{type(exc).__name__}: {exc}")
        if mode == "nan" and arrays:
            key = next(iter(arrays))
            arrays = dict(arrays)
            arrays[key] = arrays[key] * float("nan")
        return Reply(pid, arrays, metrics)

    def join(self, initial: Payload, num_clients: int) -> dict[int, Reply]:
        """Every client evaluates the initial model and reports its partition and size."""
        return {pid: self._call(wire.JOIN, 0, pid, initial, False) for pid in range(num_clients)}

    def send(self, kind: str, server_round: int, payloads: Mapping[int, Payload], eval_first: bool) -> dict[int, Reply]:
        """Serve ``payloads`` one client after the other (partition-id order)."""
        return {pid: self._call(kind, server_round, pid, p, eval_first) for pid, p in payloads.items()}


def server_inputs(cfg: RunConfig) -> ServerInputs:
    """Initial arrays, parameter keys, the resolved client graph and cluster labels of ``cfg``'s task."""
    from graphfl.client.training import get_arrays, param_keys
    from graphfl.common.graph import resolve_client_graph
    from graphfl.tasks import registry as tasks

    task = tasks.create(cfg.task, data=cfg.data, data_dir=cfg.data_dir, seed=cfg.seed)
    model = task.build_model()
    graph, source = resolve_client_graph(cfg.nodes, task.client_graph(cfg.nodes), cfg.graph_file, cfg.task)
    return ServerInputs(get_arrays(model), param_keys(model), graph, source, task.cluster_labels(cfg.nodes))


def run_federated_inprocess(
    cfg: RunConfig, out_dir: str | Path | None = None, name: str = "run",
    progress: Callable[[dict[str, Any]], None] | None = None,
    fail: Mapping[tuple[int, int], str] | None = None,
) -> tuple[dict[str, Any], ServerCore[Any]]:
    """Run ``cfg`` in this process; return (result document, final server core)."""
    import torch

    from graphfl.common import registry
    from graphfl.common.envinfo import env_info

    torch.set_num_threads(1)
    spec = registry.get(cfg.strategy)
    inputs = server_inputs(cfg)
    recorder = RunRecorder(cfg, cfg.strategy, Path(out_dir) if out_dir else None, name=name,
                           env={**env_info(), "engine": "inprocess"}, progress=progress)
    core = run_federated(cfg, spec, InProcessExchange(cfg, fail), inputs, recorder)
    return recorder.document(), core
