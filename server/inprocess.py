"""In-process driver: the same cores, trainers and round loop, no Flower, no sockets.

Used by benchmarks (fast) and tests. For the same config it produces the same results as
``graphfl run`` on Flower's engines (tests/test_e2e_flower.py checks this).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from graphfl.client.base import ClientState
from graphfl.client.handler import EVALUATE, JOIN, TRAIN, ClientRuntime, build_runtime, handle
from graphfl.common.config import RunConfig
from graphfl.server.rounds import Reply, RunRecorder, run_federated
from graphfl.strategies.base import Payload, ServerCore

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
        except Exception as exc:  # a client error becomes a failed reply, as in Flower
            logger.exception("client %d failed in round %d", pid, r)
            return Reply(pid, error=f"{type(exc).__name__}: {exc}")
        if mode == "nan" and arrays:
            key = next(iter(arrays))
            arrays = dict(arrays)
            arrays[key] = arrays[key] * float("nan")
        return Reply(pid, arrays, metrics)

    def join(self, initial: Payload, num_clients: int) -> dict[int, Reply]:
        return {pid: self._call(JOIN, 0, pid, initial, False) for pid in range(num_clients)}

    def send(self, kind: str, server_round: int, payloads: Mapping[int, Payload], eval_first: bool) -> dict[int, Reply]:
        k = TRAIN if kind == "train" else EVALUATE
        return {pid: self._call(k, server_round, pid, p, eval_first) for pid, p in payloads.items()}


def server_inputs(cfg: RunConfig):
    """Initial arrays, parameter keys, client graph and cluster labels for ``cfg``'s task."""
    from graphfl.client.training import get_arrays, param_keys
    from graphfl.tasks import registry as tasks
    from graphfl.tasks.graphs import load_edge_list, validate_adjacency

    task = tasks.create(cfg.task, data=cfg.data, data_dir=cfg.data_dir, seed=cfg.seed)
    model = task.build_model()
    graph = task.client_graph(cfg.nodes)
    if cfg.graph_file:
        graph = load_edge_list(cfg.graph_file, cfg.nodes)
    if graph is not None:
        graph = validate_adjacency(graph, cfg.nodes, source=cfg.graph_file or f"{cfg.task} client graph")
    return get_arrays(model), param_keys(model), graph, task.cluster_labels(cfg.nodes)


def run_inprocess(
    cfg: RunConfig, out_dir: str | Path | None = None, name: str = "run",
    progress: Callable[[dict[str, Any]], None] | None = None,
    fail: Mapping[tuple[int, int], str] | None = None,
) -> tuple[dict[str, Any], ServerCore]:
    """Run ``cfg`` in this process; return (result document, final server core)."""
    import torch

    from graphfl.common import registry
    from graphfl.common.envinfo import env_info

    torch.set_num_threads(1)
    spec = registry.get(cfg.strategy)
    initial, keys, graph, labels = server_inputs(cfg)
    recorder = RunRecorder(cfg, cfg.strategy, Path(out_dir) if out_dir else None, name=name,
                           env={**env_info(), "engine": "inprocess"}, progress=progress)
    core = run_federated(cfg, spec, InProcessExchange(cfg, fail), initial, keys, recorder, graph, labels)
    return recorder.document(), core
