"""The federated round loop, shared by the Flower ServerApp and the in-process driver.

Only the *exchange* differs between engines: a :class:`ClientExchange` sends one payload to each
selected client and returns their replies (or errors). Everything else — the join round,
sampling, validation of replies (shapes, NaN/Inf), piggy-backed evaluation, recording of
per-round metrics and writing result files — happens here once.

Round protocol
--------------
* round 0 (*join*): every client evaluates the common initial model and reports its
  partition id and number of training samples; the core is built from that.
* round r = 1..R: ``core.configure_train`` per selected client → clients train → replies
  are validated → ``core.aggregate_train``. When the core allows it (and every client
  takes part), a client evaluates its round-r payload *before* training, which measures the
  model of round r-1, so no separate evaluation exchange is needed; a final evaluation
  exchange after round R completes the curve.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from graphfl.common import wire
from graphfl.common.arrays import validate_update
from graphfl.common.config import RunConfig
from graphfl.common.core import ServerContext, ServerCore
from graphfl.common.registry import AlgorithmSpec
from graphfl.common.types import Arrays, ClientUpdate, Payload

logger = logging.getLogger(__name__)



@dataclass
class Reply:
    """One client's answer to one message, as the loop sees it."""

    partition_id: int
    arrays: Arrays | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def num_examples(self) -> int:
        return int(self.metrics.get(wire.NUM_EXAMPLES, 0))

    def eval_metrics(self) -> dict[str, float]:
        return {k[len(wire.EVAL_PREFIX):]: v for k, v in self.metrics.items() if k.startswith(wire.EVAL_PREFIX)}


class ClientExchange(Protocol):
    """Engine-specific transport of one round's messages."""

    def join(self, initial: Payload, num_clients: int) -> dict[int, Reply]:
        """Send the initial model to every client for evaluation; return replies by pid."""

    def send(
        self, kind: str, server_round: int, payloads: Mapping[int, Payload], eval_first: bool
    ) -> dict[int, Reply]:
        """Send ``payloads`` (``kind`` is ``"train"`` or ``"evaluate"``); return one reply per pid
        (a reply with ``error`` set for a client that failed or did not answer in time).
        """


class RunError(RuntimeError):
    """A run cannot continue (e.g. no client joined); the message says why."""


def sample_clients(pids: list[int], fraction: float, rng: random.Random) -> list[int]:
    """``max(1, round(fraction·n))`` clients without replacement, sorted."""
    if fraction >= 1.0:
        return sorted(pids)
    k = max(1, int(round(fraction * len(pids))))
    return sorted(rng.sample(sorted(pids), k))


def _mean(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(vals)) if vals else None


class RunRecorder:
    """Collects per-round metrics and writes ``run.json``/``.md``/``.png`` (after every round)."""

    def __init__(
        self, cfg: RunConfig, method: str, out_dir: Path | None, name: str = "run",
        env: Mapping[str, Any] | None = None, progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.method = method
        self.out_dir = out_dir
        self.name = name
        self.env = dict(env or {})
        self.progress = progress
        self.rounds: dict[int, dict[str, Any]] = {}
        self.extra: dict[str, Any] = {}
        self.status = "running"

    def _row(self, r: int) -> dict[str, Any]:
        return self.rounds.setdefault(r, {"round": r})

    def record_eval(self, r: int, per_client: Mapping[int, Mapping[str, float]]) -> None:
        row = self._row(r)
        if not per_client:
            return
        for key in ("test_loss", "test_acc"):
            values = {pid: m[key] for pid, m in per_client.items() if key in m}
            if values:
                row[key] = _mean(list(values.values()))
                row[f"{key}_per_client"] = {str(p): values[p] for p in sorted(values)}
        row["clients_evaluated"] = len(per_client)

    def record_train(
        self, r: int, *, seconds: float, bytes_up: int, bytes_down: int, replies: Mapping[int, Reply],
        rejected: Mapping[int, str], server_metrics: Mapping[str, Any],
    ) -> None:
        row = self._row(r)
        ok = [rep for pid, rep in replies.items() if rep.error is None and pid not in rejected]
        row["train_loss"] = _mean([rep.metrics.get("train_loss") for rep in ok])
        row["seconds"] = seconds
        row["bytes_up"] = bytes_up
        row["bytes_down"] = bytes_down
        row["clients_ok"] = len(ok)
        for key, name in ((wire.CLIENT_SECONDS, "client_seconds"), (wire.CLIENT_BOOT_SECONDS, "client_boot_seconds")):
            value = _mean([rep.metrics.get(key) for rep in ok])
            if value is not None:
                row[name] = value
        failed = {str(p): rep.error for p, rep in replies.items() if rep.error is not None}
        failed.update({str(p): why for p, why in rejected.items()})
        if failed:
            row["failed"] = failed
        if server_metrics:
            row["server"] = dict(server_metrics)

    def document(self) -> dict[str, Any]:
        from graphfl.common.config import config_hash

        curve = [self.rounds[r] for r in sorted(self.rounds)]
        evaluated = [row for row in curve if row.get("test_loss") is not None]
        final = {"test_loss": None, "test_acc": None}
        if evaluated:
            final = {"test_loss": evaluated[-1].get("test_loss"), "test_acc": evaluated[-1].get("test_acc")}
        timed = [row["seconds"] for row in curve if row.get("seconds") is not None]
        final["seconds_per_round"] = float(np.median(timed)) if timed else None
        final["rounds_completed"] = max((row["round"] for row in curve if "seconds" in row), default=0)
        return {
            "name": self.name,
            "status": self.status,
            "config": self.cfg.to_json(),
            "config_hash": config_hash(self.cfg),
            "methods": {self.method: {"final": final, "curve": curve}},
            "env": self.env,
            **self.extra,
        }

    def flush(self, plot: bool = False) -> None:
        if self.out_dir is None:
            return
        from graphfl.common.results import write_results

        write_results(self.out_dir, self.document(), plot=plot)

    def emit(self, event: dict[str, Any]) -> None:
        if self.progress is not None:
            try:
                self.progress(event)
            except Exception:  # progress display must never break a run
                logger.debug("progress callback failed", exc_info=True)


@dataclass(frozen=True)
class ServerInputs:
    """What the server knows before the join round: the initial model and the task's structure.

    Built once per run by :func:`graphfl.server.inprocess.server_inputs` (every engine).
    """

    initial_arrays: Arrays
    param_keys: tuple[str, ...]
    client_graph: np.ndarray | None = None
    graph_source: str = ""
    cluster_labels: np.ndarray | None = None


def build_server_context(cfg: RunConfig, inputs: ServerInputs, num_examples: Mapping[int, int]) -> ServerContext[Any]:
    """The :class:`ServerContext` a core is built from, once the clients have joined."""
    return ServerContext(
        config=cfg, params=cfg.params, num_clients=cfg.nodes, initial_arrays=inputs.initial_arrays,
        param_keys=inputs.param_keys, num_examples=dict(num_examples), client_graph=inputs.client_graph,
        cluster_labels=inputs.cluster_labels, seed=cfg.seed, graph_source=inputs.graph_source,
    )


def run_federated(
    cfg: RunConfig,
    spec: AlgorithmSpec[Any],
    exchange: ClientExchange,
    inputs: ServerInputs,
    recorder: RunRecorder,
) -> ServerCore[Any]:
    """Run ``cfg.rounds`` rounds of ``spec`` over ``exchange``; return the final core.

    Results are flushed to ``recorder.out_dir`` after every round, and with a plot at the
    end; on failure the status ``failed`` and the reason are written before re-raising.
    """
    try:
        core = _run(cfg, spec, exchange, inputs, recorder)
    except BaseException as exc:
        recorder.status = "failed"
        recorder.extra["error"] = f"{type(exc).__name__}: {exc}"
        recorder.flush(plot=True)
        raise
    recorder.status = "completed"
    recorder.flush(plot=True)
    return core


def _run(
    cfg: RunConfig, spec: AlgorithmSpec[Any], exchange: ClientExchange, inputs: ServerInputs, recorder: RunRecorder,
) -> ServerCore[Any]:
    n = cfg.nodes
    initial = inputs.initial_arrays
    t0 = time.perf_counter()
    joined = exchange.join(Payload(initial), n)
    ok = {pid: rep for pid, rep in joined.items() if rep.error is None}
    if not ok:
        raise RunError(f"no client answered the join round ({len(joined)} tried)")
    missing = sorted(set(range(n)) - set(ok))
    if missing:
        logger.warning("clients %s did not join; continuing with %d of %d", missing, len(ok), n)
    recorder.record_eval(0, {pid: rep.eval_metrics() for pid, rep in ok.items()})
    row0 = recorder.rounds[0]
    row0["seconds"] = time.perf_counter() - t0
    row0["bytes_down"] = Payload(initial).nbytes * len(joined)
    row0["bytes_up"] = 0
    recorder.flush()
    recorder.emit(_event("round", 0, cfg.rounds, row0, row0, 0))

    num_examples = {pid: rep.num_examples for pid, rep in ok.items()}
    ctx = build_server_context(cfg, inputs, num_examples)
    core = spec.server_core(ctx)
    rng = random.Random(cfg.seed)
    active = sorted(ok)
    piggyback = core.piggyback_eval and cfg.fraction_train >= 1.0

    for r in range(1, cfg.rounds + 1):
        t_round = time.perf_counter()
        selected = sample_clients(active, cfg.fraction_train, rng)
        payloads = {pid: p for pid in selected if (p := core.configure_train(r, pid)) is not None}
        replies = exchange.send(wire.TRAIN, r, payloads, eval_first=piggyback and r > 1)
        updates: dict[int, ClientUpdate] = {}
        rejected: dict[int, str] = {}
        for pid, rep in sorted(replies.items()):
            if rep.error is not None:
                logger.warning("round %d: client %d failed: %s", r, pid, rep.error)
                continue
            why = validate_update(rep.arrays, core.update_template(pid))
            if why is not None:
                logger.warning("round %d: update of client %d rejected: %s", r, pid, why)
                rejected[pid] = why
                continue
            updates[pid] = ClientUpdate(pid, rep.arrays, rep.num_examples,
                                        {k: v for k, v in rep.metrics.items() if not k.startswith(wire.EVAL_PREFIX)})
        server_metrics = core.aggregate_train(r, updates)
        if piggyback and r > 1:
            recorder.record_eval(r - 1, {pid: rep.eval_metrics() for pid, rep in replies.items()
                                         if rep.error is None and rep.eval_metrics()})
        bytes_down = sum(p.nbytes for p in payloads.values())
        bytes_up = sum(sum(a.nbytes for a in rep.arrays.values()) for rep in replies.values()
                       if rep.arrays is not None)
        if not piggyback:
            eval_replies = exchange.send(wire.EVALUATE, r, {pid: core.evaluation_payload(pid) for pid in active},
                                         eval_first=False)
            recorder.record_eval(r, {pid: rep.eval_metrics() for pid, rep in eval_replies.items()
                                     if rep.error is None})
        recorder.record_train(r, seconds=time.perf_counter() - t_round, bytes_up=bytes_up,
                              bytes_down=bytes_down, replies=replies, rejected=rejected,
                              server_metrics=server_metrics)
        recorder.flush()
        eval_round = r - 1 if piggyback else r
        recorder.emit(_event("round", r, cfg.rounds, recorder.rounds[r], recorder.rounds[eval_round], eval_round))

    if piggyback:
        t_eval = time.perf_counter()
        final = exchange.send(wire.EVALUATE, cfg.rounds + 1, {pid: core.evaluation_payload(pid) for pid in active},
                              eval_first=False)
        recorder.record_eval(cfg.rounds, {pid: rep.eval_metrics() for pid, rep in final.items()
                                          if rep.error is None})
        recorder.rounds[cfg.rounds]["eval_seconds"] = time.perf_counter() - t_eval
    final = recorder.rounds[cfg.rounds]
    recorder.emit(_event("done", cfg.rounds, cfg.rounds, final, final, cfg.rounds))
    return core


def _event(kind: str, r: int, rounds: int, train_row: Mapping[str, Any], eval_row: Mapping[str, Any],
           eval_round: int) -> dict[str, Any]:
    """A progress event: round ``r``'s training numbers and the newest evaluation, which with
    piggy-backed evaluation is that of the model after round ``eval_round = r - 1``.
    """
    return {"event": kind, "round": r, "rounds": rounds,
            "train_loss": train_row.get("train_loss"), "seconds": train_row.get("seconds"),
            "eval_round": eval_round, "test_loss": eval_row.get("test_loss"), "test_acc": eval_row.get("test_acc")}
