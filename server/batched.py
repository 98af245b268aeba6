"""The ``batched`` engine: the in-process engine with a round's clients trained as one computation.

:class:`BatchedExchange` serves the same requests as
:class:`~graphfl.server.inprocess.InProcessExchange` (same round loop, server cores, client state,
failure injection, compression and noisy uplink) but, for clients whose trainer runs a round as
``objective → SGD steps → finish`` (:class:`~graphfl.client.trainers.SGDTrainer` and the trainers
built on it, the gate family FedGATE / APFL / APFLGate, BiG-FL), it

1. asks each client's trainer for its :class:`~graphfl.client.objective.LocalObjective` and draws
   its minibatch indices from its own generator;
2. trains the clients whose objectives have the same signature together
   (:func:`graphfl.client.batched.batched_sgd`), ``chunk`` clients at a time;
3. hands each client's trained arrays (and trained personal model, APFL's ``v_i`` and ``α_i``)
   back to its trainer's ``finish``, then encodes and transmits the upload exactly as the
   per-client engine does.

Evaluation (join, piggy-backed and separate) runs batched the same way for trainers that evaluate
named arrays or output mixtures (``evaluation_arrays``, plus ``evaluation_scalars`` such as
``α_i``) on tasks without extra metrics. A request, trainer or task
that cannot be batched (PyG graph tasks, models with buffers, trainers with their own loop) is
served client by client, and the reason is logged once.
The numbers equal the per-client engine up to floating-point summation order.

As in the per-client engine, the receiving side gets read-only views, as in a deployment: each
client's payload arrays reach its trainer as views
(:meth:`~graphfl.server.inprocess.InProcessExchange.received`, a broadcast model still one object
per key) and every reply's arrays reach the server as views
(:meth:`~graphfl.server.inprocess.InProcessExchange.transmit`).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.client.batched import (
    StackedData,
    batched_evaluate,
    batched_sgd,
    client_bytes,
    draw_indices,
    memory_budget,
    penalty_bytes,
    unbatchable_reason,
)
from graphfl.client.handler import ClientRuntime, SharedInputs, prefixed, reply_metrics, train_reply
from graphfl.client.objective import LocalObjective, OutputMix
from graphfl.client.training import check_arrays
from graphfl.common import wire
from graphfl.common.config import RunConfig
from graphfl.common.core import EVALUATE_PHASE, ClientTrainer
from graphfl.common.types import Arrays, ClientState, Payload
from graphfl.server.exchange import Reply, Request
from graphfl.server.inprocess import FailKey, InProcessExchange

logger = logging.getLogger(__name__)


def fits_by_objective(trainer: ClientTrainer[Any], phase: str) -> bool:
    """Whether ``trainer`` serves ``phase`` as objective → SGD steps → finish (batchable)."""
    probe = getattr(trainer, "fit_by_objective", None)
    return bool(probe(phase)) if callable(probe) else False


def evaluates_arrays(trainer: ClientTrainer[Any], phase: str) -> bool:
    """Whether ``trainer`` evaluates ``phase`` as named arrays on its test split (batchable)."""
    probe = getattr(trainer, "evaluate_by_arrays", None)
    return bool(probe(phase)) if callable(probe) else False


class _Job:
    """One client's request on its way through the batched engine."""

    def __init__(self, pid: int, payload: Payload, runtime: ClientRuntime, store: Any, state: ClientState,
                 restored: int | None, mode: str | None) -> None:
        self.pid, self.payload, self.runtime, self.store, self.state = pid, payload, runtime, store, state
        self.restored, self.mode = restored, mode
        self.metrics = reply_metrics(runtime)
        self.t0 = time.perf_counter()
        self.objective: LocalObjective | None = None
        self.indices: np.ndarray | None = None
        self.evaluation: dict[str, float] = {}
        self.scalars: dict[str, float] = {}
        self.arrays: Arrays | None = None


class BatchedExchange(InProcessExchange):
    """:class:`~graphfl.server.inprocess.InProcessExchange` that trains and evaluates the clients
    of a phase stacked on a client axis (module docstring). ``chunk``: clients per batched
    computation (default: as many as fit :func:`graphfl.client.batched.memory_budget`, each
    client's :func:`~graphfl.client.batched.client_bytes` plus its penalty tensors).
    The receiving side gets read-only views, as in a deployment: payload arrays on the clients'
    side, reply arrays on the server's (the base class's ``received`` and ``transmit``).
    """

    def __init__(self, cfg: RunConfig, fail: Mapping[FailKey, str] | None = None,
                 state_dir: str | Path | None = None, chunk: int | None = None,
                 shared: SharedInputs | None = None) -> None:
        super().__init__(cfg, fail, state_dir, shared)
        self.chunk_setting = chunk
        self.chunk: int | None = None
        self._stacked: StackedData | None = None
        self._model: Any = None
        self._loss_fn: Any = None
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._client_bytes = 1
        self._budget = 1
        self._reason: str | None = None
        self._logged: set[str] = set()
        self.train_chunks: set[int] = set()
        """The chunk sizes training ran with (penalty tensors can make them smaller than ``chunk``)."""
        self.batched_clients = 0
        """Client requests served batched so far (the rest ran client by client)."""

    # -- set-up -----------------------------------------------------------------------------

    def _note(self, why: str) -> None:
        if why not in self._logged:
            self._logged.add(why)
            logger.info("batched engine: %s; those requests run client by client", why)

    def prepare(self) -> bool:
        """Build every client's runtime and the stacked data once; whether the task batches."""
        if self._stacked is not None:
            return True
        if self._reason is not None:
            return False
        try:
            runtimes = {pid: self.runtime(pid) for pid in range(self.cfg.nodes)}
        except Exception as exc:  # noqa: BLE001 - each client then reports its own failure, per client
            self._reason = f"a client could not be set up ({type(exc).__name__}: {exc})"
            logger.warning("batched engine: %s; every client trains on its own", self._reason)
            return False
        first = runtimes[0]
        model = first.ctx.task.build_model()
        why = unbatchable_reason(model, first.ctx.data)
        if why is not None:
            self._reason = f"task {self.cfg.task} cannot be batched: {why}"
            logger.warning("batched engine: %s; every client trains on its own", self._reason)
            return False
        device = str(first.ctx.device)
        self._model = model.to(device)
        self._shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        self._loss_fn = first.ctx.task.loss_fn()
        self._stacked = StackedData.build({pid: rt.ctx.data for pid, rt in runtimes.items()}, device)
        sample = self._stacked.x_train[0, 0].to(device)
        self._client_bytes = client_bytes(self._model, sample, self.cfg.train.batch_size)
        self._budget = memory_budget(device)
        self.chunk = self.chunk_setting or max(1, self._budget // self._client_bytes)
        logger.info("batched engine: %d clients on %s, %d per chunk, stacked data %.1f MB", self.cfg.nodes,
                    device, self.chunk, self._stacked.nbytes / 1e6)
        return True

    def describe(self) -> dict[str, Any]:
        """The engine's facts for the result file: ``engine``, the chunk size that ran (clients per
        batched computation) or why the task runs client by client.
        """
        batched = self.prepare()
        out: dict[str, Any] = {"engine": "batched"}
        if batched:
            out["batch_chunk"] = self.chunk
        else:
            out["batched_fallback"] = self._reason
        return out

    def _task_metrics_plain(self) -> bool:
        from graphfl.tasks.base import Task

        task: Any = self.runtime(0).ctx.task
        return type(task).metrics is Task.metrics

    # -- serving ------------------------------------------------------------------------------

    def join(self, initial: Payload, num_clients: int) -> dict[int, Reply]:
        """Every client evaluates the initial model and reports its partition and size (batched)."""
        request = Request(wire.JOIN, 0, EVALUATE_PHASE)
        return self.send(request, {pid: initial for pid in range(num_clients)})

    def send(self, request: Request, payloads: Mapping[int, Payload]) -> dict[int, Reply]:
        """Serve ``payloads``: the batchable clients together, the others one after the other."""
        if not payloads or not self.prepare():
            return super().send(request, payloads)
        phase = request.phase
        train = request.kind == wire.TRAIN
        eval_needed = request.kind in (wire.JOIN, wire.EVALUATE) or request.eval_first
        plain_metrics = self._task_metrics_plain()
        replies: dict[int, Reply] = {}
        jobs: list[_Job] = []
        for pid, payload in self.received(payloads).items():
            trainer = self.runtime(pid).trainer
            eval_phase = EVALUATE_PHASE if request.kind != wire.EVALUATE else phase
            batch_fit = not train or fits_by_objective(trainer, phase)
            batch_eval = not eval_needed or (plain_metrics and evaluates_arrays(trainer, eval_phase))
            if not (batch_fit and batch_eval):
                self._note(f"{type(trainer).__name__} does not batch phase {phase!r}"
                           + ("" if plain_metrics else f" (task {self.cfg.task} has its own metrics)"))
                replies[pid] = self._call(request, pid, payload)
                continue
            mode = self.fail_mode(request, pid)
            if mode == "error":
                replies[pid] = Reply(pid, error="injected failure")
                continue
            try:
                runtime, store, state, restored = self.open_client(request, pid)
                jobs.append(_Job(pid, payload, runtime, store, state, restored, mode))
            except Exception as exc:  # noqa: BLE001 - a failing client is a failed reply (logged)
                replies[pid] = self.error_reply(request, pid, exc)
        if eval_needed:
            jobs = self._evaluate(request, jobs, replies)
        if train:
            jobs = self._train(request, jobs, replies)
        for job in jobs:
            try:
                if not train:
                    job.metrics[wire.CLIENT_SECONDS] = time.perf_counter() - job.t0
                self.close_client(request, job.pid, job.store, job.state, job.restored, job.metrics)
            except Exception as exc:  # noqa: BLE001 - a failing client is a failed reply (logged)
                replies[job.pid] = self.error_reply(request, job.pid, exc)
                continue
            replies[job.pid] = self.transmit(request, job.pid, job.payload, job.arrays, job.metrics, job.mode)
            self.batched_clients += 1
        return {pid: replies[pid] for pid in payloads}

    def _evaluate(self, request: Request, jobs: list[_Job], replies: dict[int, Reply]) -> list[_Job]:
        """Evaluate every job's models in one batched computation; failed clients leave ``jobs``."""
        assert self._stacked is not None
        items: list[tuple[_Job, str, Arrays | OutputMix]] = []
        kept: list[_Job] = []
        checked: set[int] = set()
        for job in jobs:
            try:
                trainer: Any = job.runtime.trainer
                named = trainer.evaluation_arrays(job.payload, job.state)
                for item in named.values():
                    for arrays in ((item.v, item.w) if isinstance(item, OutputMix) else (item,)):
                        self._check(arrays, checked)
                scalars = getattr(trainer, "evaluation_scalars", None)
                job.scalars = scalars(job.payload, job.state) if callable(scalars) else {}
            except Exception as exc:  # noqa: BLE001 - a failing client is a failed reply (logged)
                replies[job.pid] = self.error_reply(request, job.pid, exc)
                continue
            items += [(job, prefix, arrays) for prefix, arrays in named.items()]
            kept.append(job)
        try:
            results = batched_evaluate(self._model, self._loss_fn, self._classification(), self._stacked,
                                       [job.pid for job, _, _ in items], [a for _, _, a in items], chunk=self.chunk)
        except Exception as exc:  # noqa: BLE001 - the batch fails as a whole: each client's reply says why
            for job in kept:
                replies[job.pid] = self.error_reply(request, job.pid, exc)
            return []
        for (job, prefix, _), metrics in zip(items, results):
            if prefix:
                metrics = {f"{prefix}{k}": v for k, v in metrics.items() if k != "num_test"}
            job.evaluation.update(metrics)
        for job in kept:
            job.evaluation.update(job.scalars)
            job.metrics.update(prefixed(job.evaluation))
        return kept

    def _check(self, arrays: Arrays, checked: set[int]) -> None:
        """``check_arrays`` against the model, once per arrays object of a request (a broadcast
        payload is one object for every client).
        """
        if id(arrays) not in checked:
            check_arrays(self._shapes, arrays)
            checked.add(id(arrays))

    def _classification(self) -> bool:
        return str(self.runtime(0).ctx.task.kind) == "classification"

    def _train(self, request: Request, jobs: list[_Job], replies: dict[int, Reply]) -> list[_Job]:
        """Train every job's objective, grouped by signature; ``finish`` and encode each client's result."""
        assert self._stacked is not None
        tc = self.cfg.train
        groups: dict[Any, list[_Job]] = defaultdict(list)
        checked: set[int] = set()
        for job in jobs:
            trainer: Any = job.runtime.trainer
            try:
                job.objective = trainer.objective(request.server_round, job.payload, job.state)
                self._check(job.objective.start, checked)
                if job.objective.personal is not None:      # APFL's v_i comes from the client's state
                    self._check(job.objective.personal.start, checked)
                job.indices = draw_indices(job.objective, job.runtime.ctx.data.num_train, tc.batch_size)
            except Exception as exc:  # noqa: BLE001 - a failing client is a failed reply (logged)
                replies[job.pid] = self.error_reply(request, job.pid, exc)
                continue
            groups[job.objective.signature].append(job)
        done: list[_Job] = []
        for group in groups.values():
            t0 = time.perf_counter()
            chunk = self.chunk or len(group)
            if not self.chunk_setting:   # per-client penalty tensors (BiG-FL's φ) count against the budget too
                assert group[0].objective is not None
                per_client = self._client_bytes + penalty_bytes(group[0].objective)
                chunk = max(1, min(chunk, self._budget // per_client))
            self.train_chunks.add(chunk)
            try:
                arrays, losses, personal = batched_sgd(
                    self._model, self._loss_fn, self._stacked, [j.pid for j in group],
                    [j.objective for j in group], [j.indices for j in group],  # type: ignore[misc]
                    tc.lr, tc.momentum, tc.weight_decay, chunk=chunk,
                )
            except Exception as exc:  # noqa: BLE001 - the batch fails as a whole: each client's reply says why
                for job in group:
                    replies[job.pid] = self.error_reply(request, job.pid, exc)
                continue
            share = (time.perf_counter() - t0) / len(group)
            for job, trained, loss, mine in zip(group, arrays, losses, personal):
                trainer = job.runtime.trainer
                try:
                    t1 = time.perf_counter()
                    more = {} if mine is None else {"personal": mine}
                    result = trainer.finish(request.server_round, job.payload, job.state, job.objective,
                                            trained, float(loss), **more)
                    upload, metrics = train_reply(job.runtime, request.server_round, job.payload, result, job.state,
                                                  job.metrics, request.phase, t1)
                    metrics[wire.CLIENT_SECONDS] += share
                except Exception as exc:  # noqa: BLE001 - a failing client is a failed reply (logged)
                    replies[job.pid] = self.error_reply(request, job.pid, exc)
                    continue
                job.arrays, job.metrics = upload, metrics
                done.append(job)
        return done
