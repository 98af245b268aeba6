"""Engine-independent client logic: one request in, one reply out.

Both the Flower ClientApp and the in-process driver call :func:`handle`, so a client
behaves identically whatever carries its messages. Requests are *join* (report partition
id and sample count, evaluate the initial model), *train* (optionally evaluate the payload
first, then fit) and *evaluate*.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from graphfl.client.base import ClientContext, ClientState, ClientTrainer
from graphfl.common.config import RunConfig
from graphfl.strategies.base import EVAL_PREFIX, Arrays, Payload

logger = logging.getLogger(__name__)

JOIN, TRAIN, EVALUATE = "join", "train", "evaluate"


@dataclass
class ClientRuntime:
    """A client's long-lived pieces: context (task, data) and trainer."""

    ctx: ClientContext
    trainer: ClientTrainer


def build_runtime(cfg: RunConfig, partition_id: int, num_partitions: int, device: str | None = None) -> ClientRuntime:
    """Load the task's data for ``partition_id`` and build the algorithm's trainer."""
    from graphfl.client.training import pick_device
    from graphfl.common import registry
    from graphfl.tasks import registry as tasks

    if num_partitions != cfg.nodes:
        raise ValueError(
            f"this SuperNode has num-partitions={num_partitions} but the run has nodes={cfg.nodes}"
        )
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is outside 0..{num_partitions - 1}")
    task = tasks.create(cfg.task, data=cfg.data, data_dir=cfg.data_dir, seed=cfg.seed)
    data = task.client_data(partition_id, num_partitions)
    ctx = ClientContext(config=cfg, params=cfg.params, partition_id=partition_id,
                        num_partitions=num_partitions, task=task, data=data,
                        device=pick_device(device or cfg.device))
    spec = registry.get(cfg.strategy)
    return ClientRuntime(ctx, spec.client_trainer(ctx))


def handle(
    runtime: ClientRuntime, kind: str, server_round: int, payload: Payload, state: ClientState,
    eval_first: bool = False,
) -> tuple[Arrays | None, dict[str, float]]:
    """Serve one request; returns (arrays to upload or None, metrics). ``state`` is updated in place."""
    ctx = runtime.ctx
    metrics: dict[str, float] = {
        "partition-id": float(ctx.partition_id),
        "num-partitions": float(ctx.num_partitions),
        "num-examples": float(ctx.data.num_train),
    }
    t0 = time.perf_counter()
    if kind in (JOIN, EVALUATE) or eval_first:
        metrics.update({EVAL_PREFIX + k: float(v) for k, v in runtime.trainer.evaluate(payload, state).items()})
    if kind in (JOIN, EVALUATE):
        metrics["client-seconds"] = time.perf_counter() - t0
        return None, metrics
    if kind != TRAIN:
        raise ValueError(f"unknown request kind {kind!r}")
    result = runtime.trainer.fit(server_round, payload, state)
    metrics.update({k: float(v) for k, v in result.metrics.items()})
    metrics["num-examples"] = float(result.num_examples)
    metrics["client-seconds"] = time.perf_counter() - t0
    return result.arrays, metrics
