"""Engine-independent client logic: one request in, one reply out.

Both the Flower ClientApp and the in-process driver call :func:`handle`, so a client
behaves identically whatever carries its messages. Requests are *join* (report partition
id and sample count, evaluate the initial model), *train* (optionally evaluate the payload
first, then serve the named phase: :meth:`~graphfl.common.core.ClientTrainer.fit_phase`,
``fit`` by default) and *evaluate* (:meth:`~graphfl.common.core.ClientTrainer.evaluate_phase`,
``evaluate`` by default).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from graphfl.common import wire
from graphfl.common.compress import Encoded, encode
from graphfl.common.config import RunConfig
from graphfl.common.core import EVALUATE_PHASE, FIT_PHASE, ClientContext, ClientTrainer
from graphfl.common.types import Arrays, ClientState, FitResult, Payload

logger = logging.getLogger(__name__)


@dataclass
class ClientRuntime:
    """A client's long-lived pieces: context (task, data, neighbourhood) and trainer."""

    ctx: ClientContext[Any]
    trainer: ClientTrainer[Any]


@dataclass(frozen=True)
class SharedInputs:
    """What every client of one process builds alike: the task, the run's client graph and the
    training device (an engine that hosts many clients builds them once, :func:`shared_inputs`).
    """

    task: Any
    graph: Any
    device: str
    graph_source: str = ""
    """Where the graph came from (:func:`~graphfl.common.graph.resolve_client_graph`'s second value)."""


def shared_inputs(cfg: RunConfig, device: str | None = None, data_dir: str | None = None,
                  task: Any = None) -> SharedInputs:
    """The task (``data_dir``: see :func:`build_runtime`; or ``task``, already built), the client
    graph (``graph-file`` if set, which must then exist on this client's machine too, else the
    task's graph) and the device.
    """
    from graphfl.client.training import pick_device
    from graphfl.common.graph import resolve_client_graph
    from graphfl.tasks import registry as tasks

    if task is None:
        task = tasks.create(cfg.task, data=cfg.data, data_dir=data_dir or cfg.data_dir, seed=cfg.seed)
    graph, source = resolve_client_graph(cfg.nodes, task.client_graph(cfg.nodes), cfg.graph_file, cfg.task)
    requested = device or cfg.device
    size = sum(p.numel() for p in task.build_model().parameters()) if requested == "auto" else None
    return SharedInputs(task, graph, pick_device(requested, size), source)


def build_runtime(cfg: RunConfig, partition_id: int, num_partitions: int, device: str | None = None,
                  data_dir: str | None = None, shared: SharedInputs | None = None) -> ClientRuntime:
    """Load the task's data for ``partition_id`` and build the algorithm's trainer.

    The client's neighbourhood comes from the run's client graph (:func:`shared_inputs`; pass
    ``shared`` to reuse one already built for this run). ``data_dir`` (the SuperNode's
    ``data-dir``) replaces the run's ``data-dir`` for this client: its own data folder.
    """
    from graphfl.common import registry
    from graphfl.common.graph import neighbourhood

    if num_partitions != cfg.nodes:
        raise ValueError(
            f"this SuperNode has num-partitions={num_partitions} but the run has nodes={cfg.nodes}"
        )
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is outside 0..{num_partitions - 1}")
    if shared is None:
        # the client's own data first: a task that reads its inputs' shape from the data (csv
        # without 'features') then sizes the model from this client's file, not its neighbours'
        from graphfl.tasks import registry as tasks

        task = tasks.create(cfg.task, data=cfg.data, data_dir=data_dir or cfg.data_dir, seed=cfg.seed)
        data = task.client_data(partition_id, num_partitions)
        shared = shared_inputs(cfg, device, data_dir, task=task)
    else:
        data = shared.task.client_data(partition_id, num_partitions)
    ctx: ClientContext[Any] = ClientContext(
        config=cfg, params=cfg.params, partition_id=partition_id, num_partitions=num_partitions,
        task=shared.task, data=data, device=shared.device,
        neighbourhood=neighbourhood(shared.graph, partition_id),
    )
    spec = registry.get_client(cfg.strategy)
    trainer = spec.client_trainer(ctx)
    if cfg.train.eval_local:
        from graphfl.client.trainers import eval_local_problem
        from graphfl.common.errors import ConfigError

        problem = eval_local_problem(cfg.strategy, trainer)
        if problem:
            raise ConfigError(problem)
    return ClientRuntime(ctx, trainer)


def check_client_options(cfg: RunConfig) -> None:
    """Refuse, before any client starts, a client-side option the strategy's trainer cannot serve.

    ``train.eval-local`` is served by the plain SGD trainer only (:func:`~graphfl.client.trainers.eval_local_problem`);
    the check builds one trainer (partition 0) only when the option is on. Raises
    :class:`~graphfl.common.errors.ConfigError` naming the option and the strategy.
    """
    if not cfg.train.eval_local:
        return
    build_runtime(cfg, 0, cfg.nodes)

REQUEST_KINDS = (wire.JOIN, wire.TRAIN, wire.EVALUATE)


def handle(
    runtime: ClientRuntime, kind: str, server_round: int, payload: Payload, state: ClientState,
    eval_first: bool = False, phase: str | None = None,
) -> tuple[Arrays | None, dict[str, float]]:
    """Serve one request; returns (arrays to upload or None, metrics). ``state`` is updated in place.

    ``phase`` names what the trainer does (``None``: ``fit`` for train, ``evaluate`` for
    evaluate requests). Evaluation metrics are returned under ``wire.EVAL_PREFIX``.
    """
    if kind not in REQUEST_KINDS:
        raise ValueError(f"unknown request kind {kind!r}; expected one of {list(REQUEST_KINDS)}")
    metrics = reply_metrics(runtime)
    t0 = time.perf_counter()
    if kind == wire.TRAIN:
        if eval_first:
            metrics.update(prefixed(runtime.trainer.evaluate(payload, state)))
        result = runtime.trainer.fit_phase(phase or FIT_PHASE, server_round, payload, state)
        return train_reply(runtime, server_round, payload, result, state, metrics, phase, t0)
    evaluation = (runtime.trainer.evaluate(payload, state) if kind == wire.JOIN
                  else runtime.trainer.evaluate_phase(phase or EVALUATE_PHASE, payload, state))
    metrics.update(prefixed(evaluation))
    metrics[wire.CLIENT_SECONDS] = time.perf_counter() - t0
    return None, metrics


def reply_metrics(runtime: ClientRuntime) -> dict[str, float]:
    """The metrics every reply starts with: partition id and count, sample count, GPU flag."""
    ctx = runtime.ctx
    return {
        wire.PARTITION_ID: float(ctx.partition_id),
        wire.NUM_PARTITIONS: float(ctx.num_partitions),
        wire.NUM_EXAMPLES: float(ctx.data.num_train),
        wire.CLIENT_ON_GPU: float(str(ctx.device).startswith("cuda")),
    }


def train_reply(runtime: ClientRuntime, server_round: int, payload: Payload, result: FitResult, state: ClientState,
                metrics: dict[str, float], phase: str | None, t0: float) -> tuple[Arrays, dict[str, float]]:
    """A train request's reply from the trainer's ``result``: the upload encoded
    (:func:`compress_upload`), the trainer's :meth:`~graphfl.common.core.ClientTrainer.after_upload`,
    ``result``'s metrics and sample count added to ``metrics``, the seconds since ``t0``.
    """
    upload = compress_upload(runtime, server_round, payload, result.arrays, state)
    runtime.trainer.after_upload(phase or FIT_PHASE, server_round, payload, upload.decoded, state)
    metrics.update({k: float(v) for k, v in result.metrics.items()})
    metrics[wire.NUM_EXAMPLES] = float(result.num_examples)
    metrics[wire.CLIENT_SECONDS] = time.perf_counter() - t0
    return upload.wire_arrays, metrics


def compress_upload(runtime: ClientRuntime, server_round: int, payload: Payload, arrays: Arrays,
                    state: ClientState) -> Encoded:
    """Encode a training upload with the run's ``[compress]`` settings (against the payload).

    ``compress.kind = none`` returns ``arrays`` untouched. The quantiser's randomness is drawn
    from (seed, partition id, round), so every engine sends the same bits.
    """
    from graphfl.tasks.partition import client_rng

    cfg = runtime.ctx.config.compress
    if cfg.kind == "none":
        return Encoded(arrays, arrays)
    rng = client_rng(runtime.ctx.config.seed, 7, runtime.ctx.partition_id, server_round)
    return encode(arrays, payload.arrays, cfg, rng, state)


def prefixed(evaluation: dict[str, float]) -> dict[str, float]:
    """Evaluation metrics under :data:`graphfl.common.wire.EVAL_PREFIX`, as a reply carries them."""
    return {wire.EVAL_PREFIX + k: float(v) for k, v in evaluation.items()}
