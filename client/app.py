"""The Flower ``ClientApp``: one request in, one reply out, for every graphfl algorithm.

In deployment every message starts a fresh ``flwr-clientapp`` process, so module-level
imports stay light (torch and the task are imported inside the handlers). The client's
partition comes from ``context.node_config`` (``partition-id``, ``num-partitions``,
optional ``device``, optional ``state-dir``, optional ``data-dir``: this SuperNode's own data
folder); its persistent state lives in ``context.state`` (kept by the SuperNode across rounds)
and, with a ``state-dir``, is mirrored to disk so that it survives a ``--resume`` and a SuperNode
restart (:mod:`graphfl.client.state_store`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from graphfl.client.noisy_channel import noisy_channel_mod
from graphfl.common import wire
from graphfl.common.types import ConfigValue

if TYPE_CHECKING:
    from graphfl.common.config import RunConfig

MetricRecordValue = int | float | list[int] | list[float]

logger = logging.getLogger(__name__)

app = ClientApp(mods=[noisy_channel_mod])
"""graphfl's ClientApp; training replies pass the noisy uplink of the run config's ``channel.*``
(off by default; :mod:`graphfl.client.noisy_channel`)."""


def process_age() -> float:
    """Seconds since this process started (Linux /proc; 0.0 elsewhere)."""
    try:
        start_ticks = float(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass(frozen=True)
class IncomingRequest:
    """The graphfl control keys of a message's config record, and the payload's own scalars."""

    kind: str
    server_round: int
    phase: str | None
    eval_first: bool
    payload_config: dict[str, ConfigValue]


def read_request(config: ConfigRecord | None, default_kind: str) -> IncomingRequest:
    """Split a message's config record into the request (``wire.CONTROL_PREFIX`` keys) and the
    payload's config; a missing record is a request of ``default_kind`` with no config.

    Raises
    ------
    ValueError
        When a payload config value is not a scalar (names the key).
    """
    if config is None:
        return IncomingRequest(default_kind, 0, None, False, {})
    payload_config: dict[str, ConfigValue] = {}
    for key, value in config.items():
        if key.startswith(wire.CONTROL_PREFIX):
            continue
        if not isinstance(value, (bool, int, float, str)):
            raise ValueError(f"payload config {key!r} is a {type(value).__name__}, expected a scalar")
        payload_config[key] = value
    phase = config.get(wire.PHASE)
    server_round = config.get(wire.ROUND, 0)
    if not isinstance(server_round, int):
        raise ValueError(f"control key {wire.ROUND!r} is {server_round!r}, expected an integer")
    return IncomingRequest(
        kind=str(config.get(wire.KIND, default_kind)),
        server_round=server_round,
        phase=str(phase) if phase else None,
        eval_first=bool(config.get(wire.EVAL_FIRST, False)),
        payload_config=payload_config,
    )


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


def state_dir(node_config: Mapping[str, Any], cfg: RunConfig) -> str | None:
    """Where this client mirrors its state: the node config's ``state-dir``; in a simulation (whose
    node config Flower builds, on the machine that holds the run's folder) ``<out-dir>/client-state``.
    """
    if wire.NODE_STATE_DIR in node_config:
        return str(node_config[wire.NODE_STATE_DIR])
    if cfg.engine == "simulation" and cfg.out_dir:
        from graphfl.client.state_store import CLIENT_STATE_DIR

        return os.path.join(cfg.out_dir, CLIENT_STATE_DIR)
    return None


def _serve(msg: Message, context: Context, default_kind: str) -> Message:
    boot = boot_seconds()  # ClientApp start -> handler: Python, flwr, message fetch
    import torch

    from graphfl.client.handler import build_runtime, handle
    from graphfl.client.state_store import state_for_request, store_for
    from graphfl.common.config import parse_run_config
    from graphfl.common.records import arrays_record, arrays_to_record, get_arrays, record_to_arrays
    from graphfl.common.types import Payload

    torch.set_num_threads(int(os.environ.get("GRAPHFL_TORCH_THREADS", "1")))
    cfg = parse_run_config(dict(context.run_config))
    node = context.node_config
    if wire.NODE_PARTITION_ID not in node or wire.NODE_NUM_PARTITIONS not in node:
        raise ValueError(f"this SuperNode has no '{wire.NODE_PARTITION_ID}'/'{wire.NODE_NUM_PARTITIONS}' "
                         "in its --node-config")
    device = str(node[wire.NODE_DEVICE]) if wire.NODE_DEVICE in node else None
    data_dir = str(node[wire.NODE_DATA_DIR]) if wire.NODE_DATA_DIR in node else None
    runtime = build_runtime(cfg, int(node[wire.NODE_PARTITION_ID]), int(node[wire.NODE_NUM_PARTITIONS]), device,
                            data_dir)

    request = read_request(msg.content.config_records.get(wire.CONFIG), default_kind)
    # Read-only views into the message's blob (no copy of the model): the trainers read the payload
    # (load_state_dict copies it into the model; anchors and references are read), never write it.
    payload = Payload(get_arrays(msg.content, wire.ARRAYS, copy=False) or {}, request.payload_config)

    state_rec = context.state.array_records.get(wire.STATE)
    state = record_to_arrays(state_rec) if state_rec is not None else {}
    store = store_for(state_dir(node, cfg), cfg.run_key, runtime.ctx.partition_id)
    live = wire.STATE_META in context.state.config_records
    state, restored = state_for_request(store, request.kind, request.server_round, state, live)
    arrays, metrics = handle(runtime, request.kind, request.server_round, payload, state, request.eval_first,
                             request.phase)
    if restored is not None:
        metrics[wire.STATE_RESTORED] = float(restored)
    context.state[wire.STATE] = arrays_to_record(state)
    if request.kind != wire.JOIN:
        context.state[wire.STATE_META] = ConfigRecord({"round": request.server_round})
        if store is not None:
            store.save(request.server_round, state)

    if cfg.engine != "simulation":  # Ray actors are long-lived: their age says nothing
        metrics[wire.CLIENT_BOOT_SECONDS] = boot
    content = RecordDict({wire.METRICS: MetricRecord(dict[str, MetricRecordValue](metrics))})
    if arrays is not None:
        content[wire.ARRAYS] = arrays_record(arrays)
    return Message(content, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """A train (or join) message: fit and reply with the update."""
    return _serve(msg, context, wire.TRAIN)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """An evaluate message: reply with the test metrics of the payload."""
    return _serve(msg, context, wire.EVALUATE)
