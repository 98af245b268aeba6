"""The Flower ``ClientApp``: one request in, one reply out, for every graphfl algorithm.

In deployment every message starts a fresh ``flwr-clientapp`` process, so module-level
imports stay light (torch and the task are imported inside the handlers). The client's
partition comes from ``context.node_config`` (``partition-id``, ``num-partitions``,
optional ``device``); its persistent state lives in ``context.state`` (kept by the SuperNode
across rounds).
"""

from __future__ import annotations

import logging
import os
import time
from typing import cast

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from graphfl.common import wire

logger = logging.getLogger(__name__)

app = ClientApp()


def process_age() -> float:
    """Seconds since this process started (Linux /proc; 0.0 elsewhere)."""
    try:
        start_ticks = float(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def boot_seconds() -> float:
    """Seconds from the ClientApp's start to its handler: the age of this per-message process, or,
    in a warm worker (which sets ``GRAPHFL_TASK_START``, the wall-clock time it claimed the task),
    the time since the claim.
    """
    started = os.environ.get("GRAPHFL_TASK_START")
    if started:
        try:
            return max(0.0, time.time() - float(started))
        except ValueError:
            pass
    return process_age()


def _serve(msg: Message, context: Context, default_kind: str) -> Message:
    boot = boot_seconds()  # ClientApp start -> handler: Python, flwr, message fetch
    import torch

    from graphfl.client.handler import build_runtime, handle
    from graphfl.common.config import parse_run_config
    from graphfl.common.records import arrays_to_record, record_to_arrays
    from graphfl.common.types import Payload

    torch.set_num_threads(int(os.environ.get("GRAPHFL_TORCH_THREADS", "1")))
    cfg = parse_run_config(dict(context.run_config))
    node = context.node_config
    if wire.NODE_PARTITION_ID not in node or wire.NODE_NUM_PARTITIONS not in node:
        raise ValueError(f"this SuperNode has no '{wire.NODE_PARTITION_ID}'/'{wire.NODE_NUM_PARTITIONS}' "
                         "in its --node-config")
    device = str(node[wire.NODE_DEVICE]) if wire.NODE_DEVICE in node else None
    runtime = build_runtime(cfg, int(node[wire.NODE_PARTITION_ID]), int(node[wire.NODE_NUM_PARTITIONS]), device)

    config = msg.content.config_records.get(wire.CONFIG)
    kind = str(config.get(wire.KIND, default_kind)) if config else default_kind
    server_round = int(cast(float, config.get(wire.ROUND, 0))) if config else 0
    eval_first = bool(config.get(wire.EVAL_FIRST, False)) if config else False
    payload_config = cast(dict[str, bool | int | float | str],
                          {k: v for k, v in (config or {}).items() if not k.startswith(wire.CONTROL_PREFIX)})
    arrays_rec = msg.content.array_records.get(wire.ARRAYS)
    payload = Payload(record_to_arrays(arrays_rec) if arrays_rec is not None else {}, payload_config)

    state_rec = context.state.array_records.get(wire.STATE)
    state = record_to_arrays(state_rec) if state_rec is not None else {}
    arrays, metrics = handle(runtime, kind, server_round, payload, state, eval_first)
    context.state[wire.STATE] = arrays_to_record(state)

    if cfg.engine != "simulation":  # Ray actors are long-lived: their age says nothing
        metrics[wire.CLIENT_BOOT_SECONDS] = boot
    record: dict[str, int | float | list[int] | list[float]] = dict(metrics)
    content = RecordDict({wire.METRICS: MetricRecord(record)})
    if arrays is not None:
        content[wire.ARRAYS] = arrays_to_record(arrays)
    return Message(content, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """A train (or join) message: fit and reply with the update."""
    return _serve(msg, context, wire.TRAIN)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """An evaluate message: reply with the test metrics of the payload."""
    return _serve(msg, context, wire.EVALUATE)
