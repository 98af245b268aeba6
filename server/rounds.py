"""The federated round loop, shared by the Flower ServerApp and the in-process driver.

Only the *exchange* differs between engines: a :class:`~graphfl.server.exchange.ClientExchange`
sends one phase's payloads to the addressed clients and returns their replies (or errors).
Everything else — the join round, sampling, the phases of each round, validation of replies
(shapes, NaN/Inf), piggy-backed evaluation, recording of per-round and per-phase numbers and
writing result files — happens here once.

Round protocol
--------------
* round 0 (*join*): every client evaluates the common initial model and reports its
  partition id and number of training samples; the core is built from that.
* round r = 1..R: the clients for the round are sampled (``fraction-train``); then for each
  :class:`~graphfl.common.core.Phase` of ``core.round_plan(r)``, in order: ``phase.configure``
  per sampled client → clients serve the phase → replies are validated → ``phase.aggregate``
  folds the valid ones, before the next phase is configured. A one-phase core's plan is
  ``configure_train`` → fit → ``aggregate_train``.
* evaluation: when the core allows it (and every client takes part), a client evaluates its
  round-r payload of the first phase *before* working on it, which measures the model of
  round r-1, so no separate evaluation exchange is needed; a final evaluation exchange after
  round R completes the curve. Otherwise every active client evaluates
  ``core.evaluation_payload`` after each round.
* checkpoint: with an output folder, the core, the sampling RNG, the active clients and the rows
  so far are saved after the join round and after every round (:mod:`graphfl.server.checkpoint`).
  With ``resume = true`` the loop loads that checkpoint instead of building a core, still sends
  the join request (clients report their partition ids; nothing of it is recorded) and
  continues at the round after the checkpoint's.
* early stop: a caller may give ``run_federated`` a :data:`StopRule`, a function of one round's
  row (as recorded once its training phases have run: ``round``, ``train_loss``, ``server``
  metrics, ...; with piggy-backed evaluation the row's test metrics arrive only with the next
  round) that returns why the run should go no further, or ``None``. It is asked after every
  round before the last, once that round's rows and checkpoint are written (a run that reaches its
  last round is not stopped, whatever the rule says of it); on resume it is first asked about
  the restored rows, in order, so a resumed run stops where an uninterrupted one would have (at
  the checkpoint's round, if a restored row already gives a reason). A stopped run gets its final
  evaluation like a finished one, the status ``stopped`` and ``stopped_early`` = ``{"round": the
  round whose row gave the reason, "after_round": the last round run, "rounds": the rounds
  configured, "reason": ...}`` in ``run.json``.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.client.noisy_channel import CHANNEL_REF, reference_scale
from graphfl.common import wire
from graphfl.common.arrays import validate_update
from graphfl.common.compress import decode_received, is_encoded
from graphfl.common.config import RunConfig
from graphfl.common.core import EVALUATE_PHASE, Phase, ServerContext, ServerCore
from graphfl.common.finite import round_divergence
from graphfl.common.registry import AlgorithmSpec
from graphfl.common.results import STORAGE_ERRNOS, ResultsWriteError, full_disk
from graphfl.common.types import Arrays, ClientUpdate, Payload
from graphfl.server import checkpoint
from graphfl.server.exchange import ClientExchange, Reply, Request
from graphfl.server.recorder import PhaseOutcome, RunRecorder, write_failure

__all__ = [
    "ClientExchange", "PhaseOutcome", "Reply", "Request", "RunError", "RunRecorder", "STOPPED", "ServerInputs",
    "StopRule", "build_server_context", "run_federated", "run_phase", "sample_clients", "validate_update",
]

logger = logging.getLogger(__name__)

StopRule = Callable[[Mapping[str, Any]], str | None]
"""Why a run should stop after the round whose row it is given, or ``None`` (module doc, early stop)."""

STOPPED = "stopped"
"""The ``run.json`` status of a run a :data:`StopRule` ended before its last configured round."""


class RunError(RuntimeError):
    """A run cannot continue (e.g. no client joined); the message says why."""


def sample_clients(pids: list[int], fraction: float, rng: random.Random) -> list[int]:
    """``max(1, round(fraction·n))`` clients without replacement, sorted."""
    if fraction >= 1.0:
        return sorted(pids)
    k = max(1, int(round(fraction * len(pids))))
    return sorted(rng.sample(sorted(pids), k))


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
    task_info: dict[str, Any] = field(default_factory=dict)
    """The task's :meth:`~graphfl.tasks.base.Task.describe` (written to the result file as ``task``)."""


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
    stop_when: StopRule | None = None,
) -> ServerCore[Any]:
    """Run ``cfg.rounds`` rounds of ``spec`` over ``exchange``; return the final core.

    Results are flushed to ``recorder.out_dir`` after every round, and with a plot at the
    end; on failure the status ``failed`` and the reason are written before re-raising. A failed
    write of the run's own files (:class:`~graphfl.common.results.ResultsWriteError`, or another
    storage errno) becomes a :class:`RunError` naming the file, what to do and the checkpoint
    ``--resume`` continues from; so does a failure while the output folder's disk is full (a
    client that could not save its state, say). It also says when ``run.json`` itself could not
    be updated.
    A run whose last round has an infinite per-client loss ends with the status ``diverged`` and
    the reason (:func:`graphfl.common.finite.round_divergence`), not ``completed``.
    ``stop_when`` (a :data:`StopRule`) may end the run after an earlier round: its status is then
    :data:`STOPPED` and ``stopped_early`` says where and why (module doc, early stop); the core
    returned is the one after that round.
    """
    if inputs.task_info:
        recorder.extra["task"] = dict(inputs.task_info)
    try:
        core = _run(cfg, spec, exchange, inputs, recorder, stop_when)
    except BaseException as exc:
        disk = full_disk(recorder.out_dir) if recorder.out_dir is not None else None
        stored = isinstance(exc, ResultsWriteError) or (isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS)
        stored = stored or (disk is not None and isinstance(exc, (OSError, RunError)))
        reason = write_failure(exc, recorder.out_dir, disk) if stored else f"{type(exc).__name__}: {exc}"
        unwritten = recorder.fail(reason)
        if stored:  # a full disk, a quota, a read-only folder: one clear line, not a traceback
            raise RunError("; ".join(n for n in (reason, unwritten) if n)) from exc
        if unwritten:
            logger.error("%s", unwritten)
        raise
    stopped = recorder.extra.get("stopped_early")
    end = cfg.rounds if stopped is None else int(stopped["after_round"])
    diverged = round_divergence(recorder.rounds.get(end, {}))
    recorder.status = "diverged" if diverged is not None else "completed" if stopped is None else STOPPED
    if diverged is not None:  # the run ran to its end, but its final numbers are no result
        logger.error("the run diverged: %s", diverged)
        recorder.extra["error"] = diverged
    recorder.flush(plot=True)
    last = recorder.rounds[end]
    # Only now: a follower that stops at "done" (Submitter.wait) then finds run.json completed.
    recorder.emit(_event("done", end, cfg.rounds, last, last, end))
    return core


def run_phase(
    phase: Phase, exchange: ClientExchange, server_round: int, clients: Sequence[int], eval_first: bool = False,
    channel_ref: float | None = None,
) -> PhaseOutcome:
    """Configure, send, validate and aggregate one phase of ``server_round`` for ``clients``.

    A train-kind reply counts when it arrived and its arrays match ``phase.template`` (keys,
    shapes, dtypes, finite values); an evaluate-kind reply when it carries an evaluation.
    ``phase.aggregate`` is called with the valid replies only, also when there are none.

    ``channel_ref`` (``mean|θ⁰|``, when the run's noisy uplink is on) travels with every train
    payload as the control key :data:`~graphfl.client.noisy_channel.CHANNEL_REF`, the channel's
    noise reference. When valid train replies carry a channel mask, the phase's server metrics
    get ``channel_missing_fraction`` (entries flagged missing over the entries the masks cover,
    all valid replies together) and ``channel_arrays_lost`` (compressed arrays missing as a
    whole because their side information was lost or corrupted on the way).
    """
    t0 = time.perf_counter()
    out = PhaseOutcome(phase.name, phase.kind)
    payloads = {pid: p for pid in clients if (p := phase.configure(server_round, pid)) is not None}
    if channel_ref is not None and phase.kind == wire.TRAIN:
        payloads = {pid: Payload(p.arrays, {**p.config, CHANNEL_REF: float(channel_ref)}) for pid, p in payloads.items()}
    out.replies = exchange.send(Request(phase.kind, server_round, phase.name, eval_first), payloads)
    updates: dict[int, ClientUpdate] = {}
    arrays_lost = 0
    for pid, rep in sorted(out.replies.items()):
        if rep.error is not None:
            logger.warning("round %d, phase %s: client %d failed: %s", server_round, phase.name, pid, rep.error)
            continue
        lost: list[str] = []
        if phase.kind == wire.TRAIN and is_encoded(rep.arrays):
            out.compressed = True
            decoded, why, lost = _decoded(phase, pid, rep, payloads[pid])
            if decoded is None:
                logger.warning("round %d, phase %s: reply of client %d rejected: %s", server_round, phase.name, pid, why)
                out.rejected[pid] = why
                continue
            rep = decoded
            out.bytes_up_decoded += sum(a.nbytes for a in (rep.arrays or {}).values())
        update, why = _update(phase, pid, rep)
        if update is None:
            logger.warning("round %d, phase %s: reply of client %d rejected: %s", server_round, phase.name, pid, why)
            out.rejected[pid] = why
            continue
        if lost:
            logger.warning("round %d, phase %s: client %d: the side information of %s was lost or corrupted in "
                           "the channel; these arrays count as missing", server_round, phase.name, pid, lost)
            arrays_lost += len(lost)
        updates[pid] = update
    t_agg = time.perf_counter()
    out.server_metrics = dict(phase.aggregate(server_round, updates))
    masks = [u.mask for u in updates.values() if u.mask is not None]
    if masks:
        covered = sum(m.size for mask in masks for m in mask.values())
        flagged = sum(int(m.size - np.count_nonzero(m)) for mask in masks for m in mask.values())
        out.server_metrics["channel_missing_fraction"] = flagged / covered if covered else 0.0
        out.server_metrics["channel_arrays_lost"] = arrays_lost
    out.server_seconds = time.perf_counter() - t_agg
    out.bytes_down = sum(p.nbytes for p in payloads.values())
    out.bytes_up = sum(sum(a.nbytes for a in rep.arrays.values()) for rep in out.replies.values()
                       if rep.arrays is not None)
    out.seconds = time.perf_counter() - t0
    return out


def _decoded(phase: Phase, pid: int, rep: Reply, payload: Payload) -> tuple[Reply | None, str, list[str]]:
    """The reply with its compressed upload decoded against ``payload`` (what the client received),
    why it is undecodable, and the keys missing as a whole (side information lost in the channel).

    The channel's mask survives decoding, with the lost arrays all ``False``
    (:func:`graphfl.common.compress.decode_received`).
    """
    assert phase.template is not None and rep.arrays is not None
    try:
        received = decode_received(rep.arrays, payload.arrays, phase.template(pid), rep.mask)
    except (ValueError, TypeError) as exc:
        return None, f"undecodable compressed upload: {exc}", []
    return Reply(pid, received.arrays, rep.metrics, rep.error, mask=received.mask), "", received.lost


def _update(phase: Phase, pid: int, rep: Reply) -> tuple[ClientUpdate | None, str]:
    """The :class:`ClientUpdate` of a reply that arrived, or ``None`` and why it is unusable."""
    if phase.kind == wire.EVALUATE:
        evaluation = rep.eval_metrics()
        if not evaluation:
            return None, "reply carries no evaluation"
        return ClientUpdate(pid, {}, rep.num_examples, evaluation), ""
    assert phase.template is not None  # Phase enforces it for train phases
    template = phase.template(pid)
    why = validate_update(rep.arrays, template)
    if why is not None or rep.arrays is None:
        return None, why or "reply carries no arrays"
    if rep.mask is not None:
        why = validate_mask(rep.mask, template)
        if why is not None:
            return None, why
    return ClientUpdate(pid, rep.arrays, rep.num_examples, rep.fit_metrics(), mask=rep.mask), ""


def validate_mask(mask: Arrays, template: Arrays) -> str | None:
    """Why a reply's channel mask is unusable (unknown key, wrong shape, not bool), or ``None``."""
    for key, m in mask.items():
        if key not in template:
            return f"channel mask has key {key!r}, which the model does not have"
        if m.shape != template[key].shape or m.dtype != np.bool_:
            return (f"channel mask {key!r} has shape {m.shape} and dtype {m.dtype}, "
                    f"expected {template[key].shape} bool")
    return None


def _evaluate(core: ServerCore[Any], exchange: ClientExchange, server_round: int, clients: Sequence[int]) -> dict[int, Reply]:
    """Every client in ``clients`` evaluates ``core.evaluation_payload`` (its own test split)."""
    request = Request(wire.EVALUATE, server_round, EVALUATE_PHASE)
    return exchange.send(request, {pid: core.evaluation_payload(pid) for pid in clients})


def _evaluations(replies: Mapping[int, Reply]) -> dict[int, dict[str, float]]:
    return {pid: ev for pid, rep in replies.items() if rep.error is None and (ev := rep.eval_metrics())}


def _stop(stop_when: StopRule | None, recorder: RunRecorder, r: int, rows: Sequence[int]) -> bool:
    """Ask ``stop_when`` about the rows ``rows`` in order; on the first reason record ``stopped_early``
    (the run stops after round ``r``) and return True.
    """
    if stop_when is None:
        return False
    for k in rows:
        why = stop_when(recorder.rounds[k])
        if why is not None:
            recorder.extra["stopped_early"] = {"round": k, "after_round": r, "rounds": recorder.cfg.rounds,
                                               "reason": str(why)}
            logger.warning("stopping after round %d of %d: %s", r, recorder.cfg.rounds, why)
            return True
    return False


def _run(
    cfg: RunConfig, spec: AlgorithmSpec[Any], exchange: ClientExchange, inputs: ServerInputs, recorder: RunRecorder,
    stop_when: StopRule | None = None,
) -> ServerCore[Any]:
    n = cfg.nodes
    initial = inputs.initial_arrays
    if n < spec.min_clients:
        raise RunError(f"{spec.name} needs at least {spec.min_clients} clients, got nodes = {n}")
    if spec.preflight is not None:
        spec.preflight(cfg, initial, inputs.param_keys)
    ck_dir = checkpoint.checkpoint_dir(recorder.out_dir) if recorder.out_dir is not None else None
    resumed = None
    if cfg.resume:
        if ck_dir is None:
            raise RunError("resume = true needs the out-dir that holds the run's checkpoint (out-dir is empty)")
        resumed = checkpoint.load(ck_dir, cfg)  # before any client is contacted: a refusal costs nothing
    t0 = time.perf_counter()
    joined = exchange.join(Payload(initial), n)
    ok = {pid: rep for pid, rep in joined.items() if rep.error is None}
    if not ok:
        raise RunError(f"no client answered the join round in time ({len(joined)} replied, none usable; "
                       f"round-timeout={cfg.round_timeout:g} s)")
    missing = sorted(set(range(n)) - set(ok))
    if missing:
        logger.warning("clients %s did not join; continuing with %d of %d", missing, len(ok), n)
    if resumed is None:
        recorder.record_eval(0, {pid: rep.eval_metrics() for pid, rep in ok.items()})
        row0 = recorder.row(0)
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
        first = 1
    else:
        core, rng, active, first = resumed.core, resumed.rng, resumed.active, resumed.round + 1
        _restore_recorder(recorder, resumed, join_seconds=time.perf_counter() - t0, joined=sorted(ok))
    piggyback = core.piggyback_eval and cfg.fraction_train >= 1.0
    channel_ref = reference_scale(initial, inputs.param_keys) if cfg.channel.active else None
    if ck_dir is not None and resumed is None:
        _checkpoint(ck_dir, 0, cfg, core, rng, active, recorder)
    end = first - 1
    stopped = end < cfg.rounds and _stop(stop_when, recorder, end, sorted(k for k in recorder.rounds if 0 < k <= end))

    for r in range(first, cfg.rounds + 1):
        if stopped:
            break
        t_round = time.perf_counter()
        selected = sample_clients(active, cfg.fraction_train, rng)
        phases: list[PhaseOutcome] = []
        for phase in core.round_plan(r):
            eval_first = piggyback and r > 1 and not phases
            if eval_first and phase.kind != wire.TRAIN:
                raise RunError(f"{type(core).__name__}: piggy-backed evaluation needs a train-kind first phase, "
                               f"round {r} starts with {phase.kind} phase {phase.name!r}; set piggyback_eval = False")
            outcome = run_phase(phase, exchange, r, selected, eval_first, channel_ref)
            phases.append(outcome)
            _require_replies(cfg, r, outcome)
        if not phases:
            raise RunError(f"{type(core).__name__}.round_plan({r}) has no phase")
        if piggyback and r > 1:
            recorder.record_eval(r - 1, _evaluations(phases[0].replies))
        if not piggyback:
            recorder.record_eval(r, _evaluations(_evaluate(core, exchange, r, active)))
        recorder.record_round(r, seconds=time.perf_counter() - t_round, phases=phases)
        recorder.flush()
        if ck_dir is not None:
            _checkpoint(ck_dir, r, cfg, core, rng, active, recorder)
        eval_round = r - 1 if piggyback else r
        recorder.emit(_event("round", r, cfg.rounds, recorder.rounds[r], recorder.rounds[eval_round], eval_round))
        end = r
        stopped = r < cfg.rounds and _stop(stop_when, recorder, r, [r])

    if piggyback:
        t_eval = time.perf_counter()
        recorder.record_eval(end, _evaluations(_evaluate(core, exchange, end + 1, active)))
        recorder.rounds[end]["eval_seconds"] = time.perf_counter() - t_eval
    return core


def _checkpoint(directory: Path, r: int, cfg: RunConfig, core: ServerCore[Any], rng: random.Random,
                active: list[int], recorder: RunRecorder) -> None:
    """Write the checkpoint of the completed round ``r`` (:mod:`graphfl.server.checkpoint`)."""
    t = time.perf_counter()
    checkpoint.save(directory, server_round=r, cfg=cfg, core=core, rng=rng, active=active,
                    rows=recorder.rounds, extra=recorder.extra)
    logger.debug("round %d: checkpoint written in %.3f s", r, time.perf_counter() - t)


def _restore_recorder(recorder: RunRecorder, resumed: checkpoint.ServerCheckpoint, join_seconds: float,
                      joined: list[int]) -> None:
    """Put the rows of the rounds before the interruption back and record the resume.

    ``run.json`` then says ``resumed_from_round`` (the latest) and ``resumes``: one entry per
    resume with the round it continued after, when, how the interrupted run had ended (its
    ``run.json`` status and error), the clients that re-joined and the join's seconds.
    """
    previous = checkpoint.previous_outcome(recorder.out_dir)
    recorder.rounds = resumed.rows
    for key, value in resumed.extra.items():
        recorder.extra.setdefault(key, value)
    missing = sorted(set(resumed.active) - set(joined))
    if missing:
        logger.warning("resume: clients %s did not re-join; their requests will fail until they do", missing)
    entry = {"resumed_from_round": resumed.round, "time": time.time(), "join_seconds": join_seconds,
             "previous_status": previous.get("status"), "previous_error": previous.get("error"),
             "clients_joined": joined}
    recorder.extra["resumes"] = [*resumed.extra.get("resumes", []), entry]
    recorder.extra["resumed_from_round"] = resumed.round
    logger.info("resuming after round %d (interrupted run: %s)", resumed.round, previous.get("status", "unknown"))
    recorder.flush()
    recorder.emit({"event": "resumed", "round": resumed.round, "rounds": recorder.cfg.rounds})


def _require_replies(cfg: RunConfig, server_round: int, outcome: PhaseOutcome) -> None:
    """Fail the run when a phase got fewer valid replies than ``min-replies`` (the reasons named).

    A round in which every update was rejected (e.g. NaN after ``train.lr = 1e30``) is not a
    completed round; by default (``min-replies = 1``) it ends the run with status ``failed``.
    """
    valid = outcome.ok()
    if not outcome.replies or len(valid) >= cfg.min_replies:  # a phase may address no client at all
        return
    reasons = {pid: rep.error for pid, rep in outcome.replies.items() if rep.error is not None}
    reasons.update(outcome.rejected)
    sample = "; ".join(f"client {pid}: {why}" for pid, why in sorted(reasons.items())[:3])
    raise RunError(f"round {server_round}, phase {outcome.name!r}: {len(valid)} valid replies of "
                   f"{len(outcome.replies)}, fewer than min-replies = {cfg.min_replies} ({sample})")


def _event(kind: str, r: int, rounds: int, train_row: Mapping[str, Any], eval_row: Mapping[str, Any],
           eval_round: int) -> dict[str, Any]:
    """A progress event: round ``r``'s training numbers and the newest evaluation, which with
    piggy-backed evaluation is that of the model after round ``eval_round = r - 1``.
    """
    return {"event": kind, "round": r, "rounds": rounds,
            "train_loss": train_row.get("train_loss"), "seconds": train_row.get("seconds"),
            "eval_round": eval_round, "test_loss": eval_row.get("test_loss"), "test_acc": eval_row.get("test_acc"),
            **{k: eval_row[k] for k in ("test_auc", "test_mae") if eval_row.get(k) is not None}}
