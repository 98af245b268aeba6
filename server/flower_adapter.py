"""One Flower ``Strategy`` for every graphfl algorithm: it translates messages to arrays.

:class:`CoreStrategy` wraps any registered :class:`~graphfl.common.core.ServerCore`.
It addresses clients by *partition id* (learned in a join round; node ids change when a
SuperNode restarts, partition ids do not), gives each client its own ``ArrayRecord``
(identical payloads share one record, so Flower uploads them once), validates replies
(failed, NaN/Inf or wrongly shaped replies are left out with a warning) and keeps the
core's per-client state across rounds.

``start()`` runs the graphfl round loop (:func:`graphfl.server.rounds.run_federated`)
with its own push/pull polling (:class:`~graphfl.server.reply_polls.ReplyPolls`: 50 ms, growing
with the time already waited for a reply up to 0.5 s) instead of ``Grid.send_and_receive``'s 3 s
sleeps (FLOWER_NOTES.md §4a).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from graphfl.common import wire
from graphfl.common.config import RunConfig
from graphfl.common.core import EVALUATE_PHASE, ServerCore
from graphfl.common.records import arrays_record, arrays_to_record, get_arrays, record_to_arrays
from graphfl.common.registry import AlgorithmSpec
from graphfl.common.types import Arrays, Payload
from graphfl.flowerx import array_copies, bounded_pull, object_io
from graphfl.server.exchange import Reply, Request
from graphfl.server.recorder import RunRecorder
from graphfl.server.reply_polls import ReplyPolls, poll_replies
from graphfl.server.rounds import RunError, ServerInputs, run_federated

logger = logging.getLogger(__name__)

MetricRecordValue = int | float | list[int] | list[float]

FINAL_PULL_S = 1.0
"""After a round's deadline, one more pull collects replies that arrived while the pull of a
straggler's half-pushed reply used up the deadline."""
EXCHANGE_TRACE = "exchange.jsonl"
"""Per-exchange timing trace under ``<out>/logs`` (read by ``graphfl bench deploy``)."""
REJOIN_ATTEMPTS = 2
"""Failed re-join requests after which a node id is retired (never asked again); a restarted SuperNode
comes back under a new node id, so a retired id is one the SuperLink still lists after it died."""


def reply_from_message(msg: Message, partition_id: int | None = None) -> Reply:
    """Parse a ClientApp reply (or a Flower error message) into a :class:`Reply`.

    The reply's arrays and mask are read-only views into the message's packed blob
    (:func:`~graphfl.common.records.get_arrays` with ``copy=False``): the server only reads an
    upload, and writing to one raises ``ValueError``.
    """
    if msg.has_error():
        return Reply(partition_id if partition_id is not None else -1,
                     error=f"client error {msg.error.code}: {msg.error.reason}")
    content = msg.content
    metrics: dict[str, float] = {}
    for rec in content.metric_records.values():
        metrics.update({k: float(v) for k, v in rec.items() if isinstance(v, (int, float))})
    fallback = -1 if partition_id is None else partition_id
    for key in (wire.PARTITION_ID, wire.NUM_PARTITIONS, wire.NUM_EXAMPLES):
        value = metrics.get(key)
        if value is not None and not (math.isfinite(value) and value >= 0 and float(value).is_integer()):
            return Reply(fallback, error=f"reply metric {key!r} = {value!r} is not a non-negative integer")
    pid = int(metrics.get(wire.PARTITION_ID, fallback))
    # Views, not copies: validation, decoding and aggregation only read an upload, and a strategy
    # that keeps one copies it into its own table (ModelTable.flatten, weighted_average).
    try:
        arrays = get_arrays(content, wire.ARRAYS, copy=False)
    except (ValueError, TypeError) as exc:  # undecodable arrays: treat as a failed reply
        return Reply(pid, error=f"undecodable arrays: {exc}")
    mask = None
    if wire.MASK_PREFIX + wire.ARRAYS in content:
        try:
            mask = get_arrays(content, wire.MASK_PREFIX + wire.ARRAYS, copy=False)
        except (ValueError, TypeError) as exc:
            return Reply(pid, error=f"undecodable channel mask: {exc}")
    return Reply(pid, arrays, metrics, mask=mask)


class GridExchange:
    """Moves one round's payloads over a Flower ``Grid`` (deployment or simulation)."""

    def __init__(self, grid: Grid, cfg: RunConfig, polls: ReplyPolls | None = None) -> None:
        self.grid = grid
        self.cfg = cfg
        self.polls = polls or ReplyPolls()
        self.node_of: dict[int, int] = {}   # partition id -> node id
        self.retired: set[int] = set()
        self.rejoin_failures: dict[int, int] = {}
        """Node ids never asked again: replaced by a newer node for their partition, or failed a rejoin
        (a killed SuperNode stays listed by the SuperLink until its heartbeat expires)."""
        self._records: dict[int, ArrayRecord | ConfigRecord] = {}
        self.trace_path = Path(cfg.out_dir) / "logs" / EXCHANGE_TRACE if cfg.out_dir else None
        """One JSON line per exchange with wall-clock instants (see :meth:`_trace`)."""
        bounded_pull.install()
        object_io.widen_object_transfers()
        array_copies.install()

    # -- messages -----------------------------------------------------------------------
    def _record(self, arrays: Arrays) -> ArrayRecord | ConfigRecord:
        """The wire record of ``arrays`` (:func:`~graphfl.common.records.arrays_record`), built once
        per exchange for arrays sent to several nodes (one object for the SuperLink to store).
        """
        key = id(arrays)
        if key not in self._records:
            self._records[key] = arrays_record(arrays)
        return self._records[key]

    def message(self, node_id: int, request: Request, payload: Payload) -> Message:
        """The Flower message carrying ``request`` with ``payload`` to ``node_id``.

        The request's kind, round, phase and eval-first flag travel as control keys
        (``wire.CONTROL_PREFIX``) in the payload's config record.
        """
        config = ConfigRecord(dict(payload.config))
        config[wire.ROUND] = int(request.server_round)
        config[wire.KIND] = request.kind
        config[wire.PHASE] = request.phase
        config[wire.EVAL_FIRST] = bool(request.eval_first)
        mtype = MessageType.TRAIN if request.kind == wire.TRAIN else MessageType.EVALUATE
        content = RecordDict({wire.ARRAYS: self._record(payload.arrays), wire.CONFIG: config})
        return Message(content, dst_node_id=int(node_id), message_type=mtype, group_id=str(request.server_round))

    def _exchange(self, messages: dict[int, Message], timeout: float) -> dict[int, Message]:
        """Push ``{key: message}``, pull until all replied or ``timeout``; returns replies by key."""
        self._records.clear()
        if not messages:
            return {}
        keys = list(messages)
        t_start = time.time()
        ids = list(self.grid.push_messages([messages[k] for k in keys]))
        t_pushed = time.time()
        pending = {mid: k for mid, k in zip(ids, keys) if mid}
        for k, mid in zip(keys, ids):
            if not mid:
                logger.warning("message to %s could not be pushed to the SuperLink", k)
        out: dict[int, Message] = {}
        pulled_at: dict[int, float] = {}

        def pull(budget: float) -> int:
            before = len(pending)
            self._pull(pending, out, pulled_at, budget)
            return before - len(pending)

        polls = poll_replies(pull, lambda: bool(pending), self.polls, timeout)
        if pending:  # replies that arrived while a half-pushed one used up the deadline: one last, short pull
            self._pull(pending, out, pulled_at, FINAL_PULL_S)
        self._trace(messages, t_start, t_pushed, pulled_at, polls)
        return out

    def _trace(self, messages: Mapping[int, Message], t_start: float, t_pushed: float,
               pulled_at: Mapping[int, float], polls: int) -> None:
        """Append one line to ``<out>/logs/exchange.jsonl``: the exchange's kind and round, and the
        wall-clock instants (``time.time()``, comparable with the warm workers' traces) of its start,
        the end of the push to the SuperLink, each reply's pull (by key: partition or node id), the
        end; ``polls`` = pulls made. Never fails the run: an unwritable trace is logged once.
        """
        if self.trace_path is None:
            return
        first = next(iter(messages.values()))
        config = first.content.config_records.get(wire.CONFIG) or ConfigRecord()
        line = {"kind": config.get(wire.KIND), "round": config.get(wire.ROUND), "start": t_start,
                "pushed": t_pushed, "pulled": {str(k): v for k, v in pulled_at.items()}, "end": time.time(),
                "polls": polls, "messages": len(messages)}
        try:
            self.trace_path.parent.mkdir(parents=True, exist_ok=True)
            with self.trace_path.open("a") as fh:
                fh.write(json.dumps(line) + "\n")
        except OSError as exc:
            logger.warning("exchange trace %s not written (%s); tracing stops", self.trace_path, exc)
            self.trace_path = None

    def _pull(self, pending: dict[str, int], out: dict[int, Message], pulled_at: dict[int, float],
              budget: float) -> None:
        """One pull of the ``pending`` replies (message id -> key) into ``out``, each stamped in
        ``pulled_at`` (wall clock); a reply whose objects do not arrive within ``budget`` s comes back
        as Flower's error reply (:mod:`graphfl.flowerx.bounded_pull`).
        """
        with bounded_pull.pull_budget(budget):
            pulled = list(self.grid.pull_messages(list(pending)))
        now = time.time()
        for msg in pulled:
            reply_to = msg.metadata.reply_to_message_id
            if reply_to in pending:
                key = pending.pop(reply_to)
                out[key], pulled_at[key] = msg, now

    # -- Exchange protocol -------------------------------------------------------------
    def _wait_for_nodes(self, n: int) -> list[int]:
        deadline = time.monotonic() + self.cfg.connect_timeout
        while True:
            ids = [int(i) for i in self.grid.get_node_ids()]
            if len(ids) >= n:
                return ids
            if time.monotonic() >= deadline:
                raise RunError(
                    f"only {len(ids)} of {n} SuperNodes connected within "
                    f"{self.cfg.connect_timeout:.0f} s (connect-timeout); check that the "
                    f"SuperNodes point at this SuperLink and use the same TLS settings"
                )
            time.sleep(0.2)

    def _join_nodes(self, node_ids: list[int], initial: Payload, rejoin: bool = False) -> dict[int, Reply]:
        """Ask ``node_ids`` for their partition ids. Two nodes claiming one partition is a
        configuration error at the start; later (``rejoin``) the newer node replaces the old
        one, which the SuperLink may still list after a crash, and a node whose reply is an
        error (e.g. Flower's "Node Unavailable") is skipped and asked again next round instead
        of failing the run; after :data:`REJOIN_ATTEMPTS` such errors it is retired.
        """
        request = Request(wire.JOIN, 0, EVALUATE_PHASE)
        msgs = {nid: self.message(nid, request, initial) for nid in node_ids}
        replies = self._exchange(msgs, self.cfg.round_timeout)
        out: dict[int, Reply] = {}
        for nid in node_ids:
            if nid not in replies:
                logger.warning("node %d did not answer the join request", nid)
                continue
            rep = reply_from_message(replies[nid])
            if rep.error is not None:
                if not rejoin:
                    raise RunError(f"node {nid} failed to join: {rep.error}")
                # e.g. a node the SuperLink still lists after it died ("Node Unavailable"), or a
                # restarted one not ready yet: asked again next round, retired after REJOIN_ATTEMPTS
                self.rejoin_failures[nid] = self.rejoin_failures.get(nid, 0) + 1
                if self.rejoin_failures[nid] >= REJOIN_ATTEMPTS:
                    logger.warning("node %d did not rejoin (%s); it is not asked again", nid, rep.error)
                    self.retired.add(nid)
                else:
                    logger.warning("node %d failed to re-join (asked again next round): %s", nid, rep.error)
                continue
            nparts = int(rep.metrics.get(wire.NUM_PARTITIONS, -1))
            if nparts != self.cfg.nodes:
                raise RunError(f"node {nid} has num-partitions={nparts} but the run has nodes={self.cfg.nodes}")
            previous = self.node_of.get(rep.partition_id)
            if rep.partition_id in out or (previous is not None and previous != nid and not rejoin):
                raise RunError(f"two SuperNodes claim partition-id {rep.partition_id}")
            if previous is not None and previous != nid:
                logger.warning("partition %d moved from node %d to node %d", rep.partition_id, previous, nid)
                self.retired.add(previous)
            self.node_of[rep.partition_id] = nid
            out[rep.partition_id] = rep
        return out

    def join(self, initial: Payload, num_clients: int) -> dict[int, Reply]:
        self._initial = initial
        node_ids = self._wait_for_nodes(num_clients)
        return self._join_nodes(node_ids, initial)

    def _refresh_nodes(self) -> None:
        """Learn the partition id of nodes that (re)connected since the last round."""
        current = {int(i) for i in self.grid.get_node_ids()}
        known = set(self.node_of.values())
        new = sorted(current - known - self.retired)
        gone = known - current
        if gone:
            for pid in [p for p, n in self.node_of.items() if n in gone]:
                logger.warning("client %d (node %d) left the federation", pid, self.node_of[pid])
                del self.node_of[pid]
        if new:
            logger.info("nodes %s (re)connected; asking for their partition ids", new)
            self._join_nodes(new, self._initial, rejoin=True)

    def send(self, request: Request, payloads: Mapping[int, Payload]) -> dict[int, Reply]:
        self._refresh_nodes()
        msgs: dict[int, Message] = {}
        out: dict[int, Reply] = {}
        for pid, payload in payloads.items():
            nid = self.node_of.get(pid)
            if nid is None:
                out[pid] = Reply(pid, error="no SuperNode serves this partition")
                continue
            msgs[pid] = self.message(nid, request, payload)
        replies = self._exchange(msgs, self.cfg.round_timeout)
        for pid in msgs:
            if pid not in replies:
                out[pid] = Reply(pid, error=f"no reply within round-timeout={self.cfg.round_timeout:.0f} s")
            else:
                rep = reply_from_message(replies[pid], pid)
                if rep.error is None and rep.partition_id != pid:
                    rep = Reply(pid, error=f"reply claims partition {rep.partition_id}")
                out[pid] = rep
        return out


class CoreStrategy(Strategy):
    """Flower strategy running a graphfl algorithm (any name in the registry).

    Use :meth:`start` (as with any Flower strategy); it returns Flower's ``Result``. The
    per-round hooks of Flower's stock loop raise ``NotImplementedError`` with that advice.
    """

    def __init__(self, cfg: RunConfig, spec: AlgorithmSpec[Any], recorder: RunRecorder, inputs: ServerInputs,
                 polls: ReplyPolls | None = None) -> None:
        self.cfg = cfg
        self.spec = spec
        self.recorder = recorder
        self.inputs = inputs
        self.polls = polls
        self.core: ServerCore[Any] | None = None
        self.exchange: GridExchange | None = None

    def summary(self) -> None:
        logger.info("graphfl strategy %s (%s) on task %s, %d nodes, %d rounds",
                    self.spec.name, self.spec.summary, self.cfg.task, self.cfg.nodes, self.cfg.rounds)

    def start(
        self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
        train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run the graphfl round loop on ``grid``; Flower's ``Strategy.start`` signature.

        The run config decides rounds, timeouts and evaluation: a ``num_rounds`` other than
        the config's ``rounds`` is overridden (with a warning); ``timeout``, ``train_config``,
        ``evaluate_config`` and ``evaluate_fn`` are not used (graphfl's per-message bounds are
        ``round-timeout`` and ``connect-timeout``; payload configs come from the core; clients
        evaluate).
        """
        if num_rounds != self.cfg.rounds:
            logger.warning("CoreStrategy.start: num_rounds=%d ignored; the run config has rounds=%d",
                           num_rounds, self.cfg.rounds)
        if train_config or evaluate_config or evaluate_fn is not None:
            logger.warning("CoreStrategy.start ignores train_config, evaluate_config and evaluate_fn")
        self.summary()
        inputs = dataclasses.replace(self.inputs, initial_arrays=record_to_arrays(initial_arrays))
        self.exchange = GridExchange(grid, self.cfg, self.polls)
        self.core = run_federated(self.cfg, self.spec, self.exchange, inputs, self.recorder)
        result = Result()
        final = self.core.final_arrays()
        if final is not None:
            result.arrays = arrays_to_record(final, pack=False)  # a user reads it by tensor name
        for row in self.recorder.rounds.values():
            scalars: dict[str, MetricRecordValue] = {
                k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and k != "round"}
            if scalars:
                result.evaluate_metrics_clientapp[int(row["round"])] = MetricRecord(scalars)
        return result

    # -- Flower's per-round hooks --------------------------------------------------------
    # graphfl's protocol (join round, partition ids, piggy-backed evaluation, validation) is
    # driven by start(); Flower's stock loop would skip all of it. The hooks therefore refuse
    # clearly instead of half-working.
    def _unsupported(self, hook: str) -> NoReturn:
        raise NotImplementedError(
            f"CoreStrategy.{hook}: graphfl strategies run their own round loop; call "
            "CoreStrategy.start(grid, initial_arrays) (Flower's Strategy.start contract is kept)"
        )

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        self._unsupported("configure_train")

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        self._unsupported("aggregate_train")

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        self._unsupported("configure_evaluate")

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        self._unsupported("aggregate_evaluate")
