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

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

logger = logging.getLogger(__name__)

app = ClientApp()

STATE_KEY = "graphfl-state"


def process_age() -> float:
    """Seconds since this process started (Linux /proc; 0.0 elsewhere)."""
    try:
        start_ticks = float(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def _serve(msg: Message, context: Context, default_kind: str) -> Message:
    boot_seconds = process_age()  # process start -> handler: Python, flwr, message fetch
    import torch

    from graphfl.client.handler import JOIN, build_runtime, handle
    from graphfl.common.config import parse_run_config
    from graphfl.strategies.base import Payload
    from graphfl.strategies.flower_adapter import (
        EVAL_FIRST_KEY, KIND_KEY, ROUND_KEY, arrays_to_record, record_to_arrays,
    )

    torch.set_num_threads(int(os.environ.get("GRAPHFL_TORCH_THREADS", "1")))
    cfg = parse_run_config(dict(context.run_config))
    node = context.node_config
    if "partition-id" not in node or "num-partitions" not in node:
        raise ValueError("this SuperNode has no 'partition-id'/'num-partitions' in its --node-config")
    device = str(node["device"]) if "device" in node else None
    runtime = build_runtime(cfg, int(node["partition-id"]), int(node["num-partitions"]), device)

    config = msg.content.config_records.get("config")
    kind = str(config.get(KIND_KEY, default_kind)) if config else default_kind
    server_round = int(config.get(ROUND_KEY, 0)) if config else 0
    eval_first = bool(config.get(EVAL_FIRST_KEY, False)) if config else False
    payload_config = {k: v for k, v in (config or {}).items() if not k.startswith("graphfl.")}
    arrays_rec = msg.content.array_records.get("arrays")
    payload = Payload(record_to_arrays(arrays_rec) if arrays_rec is not None else {}, payload_config)

    state_rec = context.state.array_records.get(STATE_KEY)
    state = record_to_arrays(state_rec) if state_rec is not None else {}
    arrays, metrics = handle(runtime, kind if kind != "join" else JOIN, server_round, payload, state, eval_first)
    context.state[STATE_KEY] = arrays_to_record(state)

    if cfg.engine != "simulation":  # Ray actors are long-lived: their age says nothing
        metrics["client-boot-seconds"] = boot_seconds
    content = RecordDict({"metrics": MetricRecord(metrics)})
    if arrays is not None:
        content["arrays"] = arrays_to_record(arrays)
    return Message(content, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _serve(msg, context, "train")


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _serve(msg, context, "evaluate")
