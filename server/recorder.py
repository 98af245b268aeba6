"""Per-round records of a federated run, and the result files written from them.

One row per round (``curve`` in ``run.json``). A training round's row holds the round's wall
time and bytes (sums over its phases), the clients' mean training loss, the clients that failed
and the core's server metrics; ``phases`` lists each phase's own seconds, bytes and outcome.
Evaluation (``test_loss``, ``test_acc``, per client) is recorded against the round whose
model was measured.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.common import wire
from graphfl.common.config import RunConfig
from graphfl.common.types import MetricValue
from graphfl.server.exchange import Reply

logger = logging.getLogger(__name__)


_TEST_KEYS = ("test_loss", "test_acc", "test_auc", "test_mae")
EVAL_KEYS = ("test_loss", "test_acc", "local_test_loss", "local_test_acc", "test_auc", "test_mae",
             "local_test_auc", "local_test_mae",
             *(f"{view}_{k}" for view in ("global", "mix_local", "mix_aggregated") for k in _TEST_KEYS))
"""Client evaluation metrics the curve records (mean and per client); ``test_auc`` / ``test_mae``
come from tasks that report them (:meth:`~graphfl.tasks.base.Task.metrics`), ``local_*`` from the
client's last locally trained model where it is evaluated too (``train.eval-local``). ``global_*`` and
``mix_*`` are second views that personalised algorithms report beside their main numbers (APFL's
global model alone and both forms of its output mixture, ALGORITHMS.md §0.1 C6)."""

TASK_FINAL_KEYS = ("test_auc", "test_mae")
"""Task metrics copied into the ``final`` summary when the run reports them."""


@dataclass
class PhaseOutcome:
    """What one phase of a round produced (filled in by the round loop).

    Attributes
    ----------
    name, kind
        The phase's name and request kind.
    replies
        Every addressed client's reply (failed ones with ``error`` set).
    rejected
        Replies that arrived but failed validation, with the reason.
    server_metrics
        What the phase's ``aggregate`` returned.
    seconds, server_seconds
        Wall time of the whole phase (configure, exchange, aggregate) and of ``aggregate``.
    bytes_down, bytes_up
        Payload bytes sent and reply bytes received (arrays only; compressed uploads count
        as they travel).
    compressed, bytes_up_decoded
        Whether some upload of the phase was compressed (``[compress]``), and the bytes of
        the valid compressed uploads once decoded (what they would have cost raw).
    """

    name: str
    kind: str
    replies: dict[int, Reply] = field(default_factory=dict)
    rejected: dict[int, str] = field(default_factory=dict)
    server_metrics: dict[str, MetricValue] = field(default_factory=dict)
    seconds: float = 0.0
    server_seconds: float = 0.0
    bytes_down: int = 0
    bytes_up: int = 0
    compressed: bool = False
    bytes_up_decoded: int = 0

    def ok(self) -> dict[int, Reply]:
        """Replies that arrived and passed validation."""
        return {pid: rep for pid, rep in self.replies.items() if rep.error is None and pid not in self.rejected}

    def failures(self) -> dict[int, str]:
        """Why each failed or rejected client did not count."""
        out = {pid: rep.error for pid, rep in self.replies.items() if rep.error is not None}
        out.update(self.rejected)
        return out


def mean_finite(values: Sequence[float | None]) -> float | None:
    """Mean of the finite values, or ``None`` when there are none."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(vals)) if vals else None


def final_value(row: Mapping[str, Any], key: str) -> tuple[float | None, str]:
    """The value of metric ``key`` that ``final`` reports for the evaluated ``row``, and a note
    ("" when the value is finite or missing).

    Rule: the mean over the clients' values, skipping NaN (undefined: a client without test rows,
    :mod:`graphfl.common.finite`) but not infinities: a client whose value is ``±inf`` makes the
    mean infinite (``nan`` when both signs occur), and the note names the metric, the round and
    those clients. Without per-client values, the row's own mean.
    """
    per_client = row.get(f"{key}_per_client")
    if not isinstance(per_client, Mapping):
        value = row.get(key)
        return (float(value) if isinstance(value, (int, float)) else None), ""
    vals = {str(c): float(v) for c, v in per_client.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)}
    if not vals:
        return None, ""
    bad = sorted((c for c, v in vals.items() if math.isinf(v)), key=lambda c: (len(c), c))
    value = float(np.mean(list(vals.values())))
    if not bad:
        return value, ""
    signs = sorted({"inf" if vals[c] > 0 else "-inf" for c in bad})
    return value, f"{key} is {' and '.join(signs)} in round {row.get('round')} on client(s) {', '.join(bad)}"


def _per_client_sum(phases: Sequence[PhaseOutcome], key: str) -> float | None:
    """Mean over clients of ``key`` summed over the phases each client served."""
    totals: dict[int, float] = {}
    for ph in phases:
        for pid, rep in ph.ok().items():
            if key in rep.metrics:
                totals[pid] = totals.get(pid, 0.0) + rep.metrics[key]
    return mean_finite(list(totals.values()))


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

    def row(self, r: int) -> dict[str, Any]:
        """The row of round ``r`` (created empty on first use)."""
        return self.rounds.setdefault(r, {"round": r})

    def record_eval(self, r: int, per_client: Mapping[int, Mapping[str, float]]) -> None:
        """Mean and per-client evaluation metrics (:data:`EVAL_KEYS`) of the model after round ``r``.

        ``local_test_loss`` / ``local_test_acc`` are reported by algorithms whose evaluated model
        differs from the client's last local model (FeSEM evaluates the center and reports its
        last local model beside it, ALGORITHMS.md §4.5).
        """
        row = self.row(r)
        if not per_client:
            return
        for key in EVAL_KEYS:
            values = {pid: m[key] for pid, m in per_client.items() if key in m}
            if values:
                row[key] = mean_finite(list(values.values()))
                row[f"{key}_per_client"] = {str(p): values[p] for p in sorted(values)}
        row["clients_evaluated"] = len(per_client)

    def record_round(self, r: int, *, seconds: float, phases: Sequence[PhaseOutcome]) -> None:
        """Training numbers of round ``r`` from its phases.

        Rules: ``bytes_up``/``bytes_down`` are sums over the phases; ``train_loss`` is the mean
        over the clients of the *first* phase (the round's main local work); ``client_seconds``
        and ``client_boot_seconds`` are per-client sums over phases, averaged; ``clients_ok``
        counts the clients that took part and failed no phase; ``state_restored`` maps each client
        that loaded its saved state from disk (after a restart or a resume) to that state's round;
        ``failed`` gives each failed
        client's first failure (prefixed with the phase's name when the round has several);
        ``server`` merges the phases' server metrics (a later phase wins a shared key) and
        ``phases`` keeps each phase's own numbers.
        """
        row = self.row(r)
        first = phases[0]
        row["train_loss"] = mean_finite([rep.metrics.get("train_loss") for rep in first.ok().values()])
        row["seconds"] = seconds
        row["bytes_up"] = sum(ph.bytes_up for ph in phases)
        row["bytes_down"] = sum(ph.bytes_down for ph in phases)
        if any(ph.compressed for ph in phases):
            row["bytes_up_decoded"] = sum(ph.bytes_up_decoded for ph in phases)
        failed: dict[str, str] = {}
        for ph in phases:
            for pid, why in ph.failures().items():
                failed.setdefault(str(pid), why if len(phases) == 1 else f"phase {ph.name}: {why}")
        took_part = {pid for ph in phases for pid in ph.replies}
        row["clients_ok"] = len([pid for pid in took_part if str(pid) not in failed])
        for key, name in ((wire.CLIENT_SECONDS, "client_seconds"), (wire.CLIENT_BOOT_SECONDS, "client_boot_seconds")):
            value = _per_client_sum(phases, key)
            if value is not None:
                row[name] = value
        on_gpu = [rep.metrics.get(wire.CLIENT_ON_GPU) for rep in first.ok().values()]
        if any(v is not None for v in on_gpu):  # the device the clients really used, not the server's view
            row["clients_on_gpu"] = sum(1 for v in on_gpu if v == 1.0)
        if failed:
            row["failed"] = failed
        restored = {str(pid): int(rep.metrics[wire.STATE_RESTORED]) for ph in phases for pid, rep in ph.ok().items()
                    if wire.STATE_RESTORED in rep.metrics}
        if restored:
            row["state_restored"] = dict(sorted(restored.items()))
        server: dict[str, MetricValue] = {}
        for ph in phases:
            server.update(ph.server_metrics)
        if server:
            row["server"] = server
        row["phases"] = [self._phase_row(ph) for ph in phases]

    @staticmethod
    def _phase_row(ph: PhaseOutcome) -> dict[str, Any]:
        out: dict[str, Any] = {
            "phase": ph.name, "kind": ph.kind, "seconds": ph.seconds, "server_seconds": ph.server_seconds,
            "bytes_down": ph.bytes_down, "bytes_up": ph.bytes_up,
            "clients": len(ph.replies), "clients_ok": len(ph.ok()),
        }
        loss = mean_finite([rep.metrics.get("train_loss") for rep in ph.ok().values()])
        if loss is not None:
            out["train_loss"] = loss
        return out

    def document(self) -> dict[str, Any]:
        """The result document (``run.json``)."""
        from graphfl.common.config import config_hash

        curve = [self.rounds[r] for r in sorted(self.rounds)]
        final = self._final_eval(curve)
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

    @staticmethod
    def _final_eval(curve: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """``test_loss``, ``test_acc`` (and :data:`TASK_FINAL_KEYS`) of ``final``: those of the last
        evaluated round (``eval_round``), by :func:`final_value` — never an older round's value when
        the last one's is missing or not finite. Infinite values stay ``inf`` here (``null`` in the
        strict JSON of ``run.json``, ``inf`` in ``run.md``) and ``non_finite`` says which metric,
        round and clients.
        """
        final: dict[str, Any] = {"test_loss": None, "test_acc": None}
        evaluated = [row for row in curve if row.get("clients_evaluated")]
        if not evaluated:
            return final
        last = evaluated[-1]
        final["eval_round"] = last.get("round")
        notes = []
        for key in ("test_loss", "test_acc", *TASK_FINAL_KEYS):
            value, note = final_value(last, key)
            if value is not None or key in final:
                final[key] = value
            if note:
                notes.append(note)
        if notes:
            final["non_finite"] = "; ".join(notes)
        return final

    def flush(self, plot: bool = False) -> None:
        """Write the result files (atomically) when the run has an output folder."""
        if self.out_dir is None:
            return
        from graphfl.common.results import write_results

        write_results(self.out_dir, self.document(), plot=plot)

    def fail(self, reason: str) -> str | None:
        """Mark the run ``failed`` with ``reason`` and write the result files.

        Returns ``None``, or why they could not be written (a full disk, ...): ``run.json`` then
        keeps its last complete version, and the caller's error says so.
        """
        self.status = "failed"
        self.extra["error"] = reason
        try:
            self.flush(plot=True)
        except OSError as exc:
            logger.error("could not write the failed status: %s", exc)
            return f"run.json could not be updated ({exc}): it still says 'running'"
        return None

    def emit(self, event: dict[str, Any]) -> None:
        """Hand a progress event to the progress callback (whose failures are only logged)."""
        if self.progress is not None:
            try:
                self.progress(event)
            except Exception:  # progress display must never break a run
                logger.debug("progress callback failed", exc_info=True)


def write_failure(exc: BaseException, out_dir: Path | None, disk: str | None = None) -> str:
    """The error of a run stopped by storage: what failed (the file and errno text of a failed
    write, or ``exc`` and ``disk``, the note that the output folder's disk is full), what to do
    about it, and, when the run has a checkpoint, that ``graphfl run --resume`` continues from it.
    """
    from graphfl.common.results import ResultsWriteError, how_to_fix
    from graphfl.server.checkpoint import resume_hint

    folder = out_dir if out_dir is not None else Path(getattr(exc, "filename", None) or ".").parent
    what = str(exc) if isinstance(exc, ResultsWriteError) else f"{type(exc).__name__}: {exc}"
    if disk:
        fix = f"{disk}: free space on it"
    elif isinstance(exc, OSError):
        fix = how_to_fix(exc, folder)
    else:
        fix = ""
    parts = [what, fix, resume_hint(out_dir) if out_dir is not None else ""]
    return "; ".join(p for p in parts if p)
