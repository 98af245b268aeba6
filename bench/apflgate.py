"""Benchmark B8 (ALGORITHMS.md §9.3, §0.1 C5–C7, §11; seed 004 Tables 1–2): APFLGate's α × τ grid beside APFL and FedGATE.

Task-agnostic: ``graphfl bench apflgate --task T`` runs on any registered task (the paper's are
``bbbp``, ROC-AUC, and ``ciao``, MAE). The metric is the first of ``test_auc``, ``test_mae``,
``test_acc``, ``test_loss`` that the task's evaluation reports (higher is better for AUC and
accuracy, lower for MAE and loss).

Protocol (fair comparison):

* one optimiser for every method: plain SGD (momentum 0), ``local-steps`` (R) per round, batch
  32, a constant step per *method*, chosen on the validation split (:mod:`graphfl.tasks.holdout`,
  20 % of each client's training data, first seed) at the method's reference setting —
  APFL α = 0.5, FedGATE τ = R, APFLGate (α = 0.5, τ = R), FedAvg, local-only — and then used
  for every cell of that method's grid (the grid of steps tried and their validation scores are
  in the result);
* τ is read as a multiple of R (``tau-mode = multiple-of-steps``, C5): the poster's printed δ
  rule is unstable for τ ≤ R/2, and its BBBP rows for τ = 0.1, 1, 100 differ by 0.0007, so its
  τ cannot have been the printed one. A cell whose τ is ≤ R/2 even so (τ = 0.1 R) is not run
  and is reported "refused: unstable by construction" with the reason;
* the grid: APFL over α, FedGATE over τ, APFLGate over α × τ (poster: α ∈ {0.1, 0.25, 0.5,
  0.75, 0.9}, τ ∈ {0.1, 1, 10, 100}); FedAvg (where the form runs it) and local-only (tuned the
  same way) as references;
* trivial baselines beside them (C7), no training: a constant predictor (the pooled training
  mean, or majority class) and each client's own constant (its training median, or majority
  class) — a method at their level has learned nothing the data's marginal does not give;
* every cell: ≥ 3 seeds (data split, initialisation, minibatches), mean ± sd of the final test
  metric (the model after the last round: APFL/APFLGate evaluate the personalised mixture
  ``α h(v_i) + (1 − α) h(w_i)`` with the locally trained ``w_i`` (C6), and report the mixture
  with the aggregated ``w`` beside it; FedGATE/FedAvg the global model), averaged over clients;
* compression row: APFLGate at its reference cell with uploads compressed
  (``compress.kind = quant`` 8 and 4 bits, ``topk`` 10 % with error memory), same step and
  seeds; reported: upload bytes over the run and the metric's change against uncompressed.

The benchmark is declared for the harness (:func:`declare`, :mod:`graphfl.bench.harness`): one
grid point per method setting (none for FedAvg / local-only, α for APFL, τ for FedGATE, (α, τ)
for APFLGate, (α, τ, codec) for the compression row), cells through the run cache in
``<out>/cache`` (an interrupted run continues), the estimate logged.
``run(quick, seed, out, task=..., data_dir=...)`` writes ``<out>/apflgate.{json,md,png}`` in the
harness's layout plus the α × τ table, the constant predictors and the compression row.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.common.results import atomic_write_bytes
from graphfl.tasks.holdout import VALIDATION_FRACTION, validation_task

from .harness import Bench, Cell, Metric, Tuning, run_bench
from .report import build_doc, write_report
from .runcache import RunCache
from .stats import paired_difference

logger = logging.getLogger(__name__)

NAME = "apflgate"
METRICS = (("test_auc", True), ("test_mae", False), ("test_acc", True), ("test_loss", False))
"""(metric, higher is better), in order of preference."""
PAPER_ALPHAS = (0.1, 0.25, 0.5, 0.75, 0.9)
PAPER_TAUS = (0.1, 1.0, 10.0, 100.0)
REFERENCE_TAU = 1.0
"""The reference τ, as a multiple of R: τ = R, the methods' default (FedTorch)."""
REFERENCE = {"apfl": {"apfl.alpha": 0.5}, "fedgate": {"fedgate.tau": REFERENCE_TAU},
             "apflgate": {"apflgate.alpha": 0.5, "apflgate.tau": REFERENCE_TAU}, "fedavg": {}, "local": {}}
REFERENCE_CELL = f"0.5,{REFERENCE_TAU:g}"
"""Key of APFLGate's reference cell (α, τ) in the result's grid."""
VIEWS = ("mix_aggregated", "global")
"""Second views of a personalised run kept per cell: the mixture with the aggregated w, the global model."""
COMPRESSIONS: dict[str, dict[str, Any]] = {
    "quant-8bit": {"compress.kind": "quant", "compress.bits": 8},
    "quant-4bit": {"compress.kind": "quant", "compress.bits": 4},
    "topk-10%": {"compress.kind": "topk", "compress.k": 0.1},
}
PAPER: dict[str, dict[str, Any]] = {
    "bbbp": {"metric": "ROC-AUC (higher is better)", "apfl": {"alpha=0.1": 0.7492}, "fedgate": {"tau=100": 0.7703},
             "apflgate": {"0.1,0.1": 0.8342, "0.1,100": 0.8347, "0.1,1": 0.8349, "0.9,10": 0.8429,
                          "0.75,10": 0.844, "0.5,10": 0.8458, "0.25,10": 0.8472, "0.1,10": 0.848}},
    "ciao": {"metric": "MAE (lower is better)", "apfl": {"alpha=0.25": 0.8054}, "fedgate": {"tau=10": 0.8055},
             "apflgate": {"0.1,10": 0.7921, "0.25,10": 0.7895, "0.5,10": 0.7891, "0.75,10": 0.7891,
                          "0.9,10": 0.7891}},
}


@dataclass(frozen=True)
class Form:
    """What ``--quick`` and the full form run."""

    rounds: int
    local_steps: int
    seeds: int
    lr_grid: tuple[float, ...]
    alphas: tuple[float, ...]
    taus: tuple[float, ...]
    nodes: int  # 0 = the task's default number of clients
    batch_size: int = 32
    codecs: tuple[str, ...] = tuple(COMPRESSIONS)
    """Names in :data:`COMPRESSIONS` run in the compression row (none: no compression row)."""
    settings: tuple[tuple[str, Any], ...] = ()
    """Run-config keys set in every run of this form (e.g. ``data.max-samples``)."""
    fedavg: bool = True
    """Also run FedAvg (tuned the same way) as a reference; the poster has no FedAvg column."""
    cells: tuple[tuple[float, float], ...] = ()
    """APFLGate's (α, τ) cells; empty = every pair of ``alphas`` × ``taus``. APFL runs over
    ``alphas``, FedGATE over ``taus``."""
    tau_mode: str = "multiple-of-steps"
    """How every τ of the form is read (``fedgate.tau-mode``): as a multiple of R (C5) or absolute."""
    local: bool = True
    """Also run local-only training (tuned the same way) as a reference."""

    def apflgate_cells(self) -> tuple[tuple[float, float], ...]:
        """The (α, τ) pairs APFLGate runs."""
        return self.cells or tuple((a, t) for a in self.alphas for t in self.taus)


QUICK = Form(rounds=15, local_steps=10, seeds=3, lr_grid=(0.2, 0.5, 1.0), alphas=(0.1, 0.5, 0.9),
             taus=PAPER_TAUS, nodes=8)
FULL = Form(rounds=50, local_steps=20, seeds=3, lr_grid=(0.03, 0.1, 0.3, 1.0), alphas=PAPER_ALPHAS,
            taus=PAPER_TAUS, nodes=0)
QUICK_BY_TASK: dict[str, Form] = {
    # A GIN step costs an order of magnitude more than digits' MLP step (timings in
    # docs/apflgate.md). So: the paper's 16 clients, 5 rounds x 4 steps, a 2-point step grid, the
    # cells the poster reports (α = 0.1 across its τ grid, and the reference α = 0.5; not the
    # full 5 x 4 product), one codec, no FedAvg.
    "bbbp": Form(rounds=5, local_steps=4, seeds=3, lr_grid=(0.1, 0.3), alphas=(0.1, 0.5), taus=PAPER_TAUS,
                 nodes=0, codecs=("quant-4bit",), fedavg=False,
                 cells=((0.1, 0.1), (0.1, 1.0), (0.1, 10.0), (0.1, 100.0), (0.5, 1.0), (0.5, 10.0))),
    # the paper's 28 clients (one per category) on a random 20,000 of the 283,319 ratings: a step
    # costs a GCN pass over the client's whole graph, which grows with the ratings kept; the
    # reference configuration subsamples too (ego networks, ALGORITHMS.md §9.3)
    "ciao": Form(rounds=6, local_steps=4, seeds=3, lr_grid=(0.1, 0.3), alphas=(0.1, 0.5), taus=(1.0, 10.0, 100.0),
                 nodes=0, batch_size=256, codecs=("quant-4bit",),
                 cells=((0.1, 1.0), (0.1, 10.0), (0.1, 100.0), (0.5, 1.0), (0.5, 10.0)),
                 settings=(("data.max-samples", 20000),)),
}
"""Quick forms of the paper's GNN tasks: a GNN step costs 10-100x an MLP step on ``digits``,
so they run fewer rounds, steps, cells and codecs (never fewer than 3 seeds; the step still
tuned per method on validation); every other task uses :data:`QUICK`."""


def form_for(task: str, quick: bool) -> Form:
    """The form ``run`` uses: :data:`FULL`, or the task's quick form (:data:`QUICK_BY_TASK`, else :data:`QUICK`)."""
    return QUICK_BY_TASK.get(task, QUICK) if quick else FULL


def unspecified(form: Form, task: str, nodes: int) -> list[str]:
    """Every choice the poster does not give (ALGORITHMS.md §9.3 'Not stated')."""
    return [
        f"task {task!r}, {nodes} clients, the task's own model, split (Dirichlet α_dir from [data]) and loss",
        f"rounds {form.rounds}, {form.local_steps} local SGD steps per round, batch {form.batch_size}, momentum 0, "
        "weight decay 0, full participation, server step γ = 1",
        *(f"{k} = {v} in every run" for k, v in form.settings),
        f"step grid {list(form.lr_grid)}, extended ×{GRID_FACTOR:g} past a winning edge (at most "
        f"{GRID_EXTENSIONS} steps), chosen per method on validation ({VALIDATION_FRACTION:.0%} of each "
        "client's training data, first seed) at the reference setting "
        + ", ".join(f"{m}: {v or 'defaults'}" for m, v in REFERENCE.items()) + "; the same step for every cell",
        "APFL and APFLGate: output mixing, fixed α (adaptive α off, as in the poster's tables); the personal "
        "model v_i starts from the initial global model and shares the minibatch and step with w_i",
        "FedGATE τ and APFLGate τ: the variance-reduction parameter of the δ update δ += (u_i − ū)/(η τ), "
        + ("read as a multiple of R (tau-mode = multiple-of-steps; the poster's printed rule is unstable for "
           "τ ≤ R/2, ALGORITHMS.md §0.1 C5)" if form.tau_mode == "multiple-of-steps" else "read as τ itself")
        + "; a τ ≤ R/2 is refused, not run",
        "APFL and APFLGate report the mixture with the locally trained w_i (C6) as the metric, the mixture with "
        "the aggregated w and the global model alone beside it",
        f"APFL α {list(form.alphas)}, FedGATE τ {list(form.taus)}, APFLGate (α, τ) "
        f"{[list(c) for c in form.apflgate_cells()]}; {form.seeds} seeds (mean ± sd); final-round metric",
        f"compression {list(form.codecs)}: APFLGate at its reference cell ({REFERENCE_CELL}); quant = unbiased "
        "stochastic b-bit per "
        "array of the update, topk = 10 % largest entries per array with per-client error memory",
        f"engine: {ENGINE} (equal to the in-process engine up to summation order; a task that does not batch "
        "runs client by client on it, the reason logged; each cached run records its engine and chunk or fallback)",
    ]


ENGINE = "batched"
"""Engine of every run: the batched engine (a round's clients train as one stacked computation;
a task that does not batch, as the graph tasks whose PyG batches differ in size, is served
client by client by that engine itself, which logs why). Its numbers equal the in-process
engine's up to floating-point summation order."""
RESUMABLE = True
"""An interrupted run continues in the same ``--out`` (finished cells come from ``<out>/cache``)."""
RUN_ERRORS = (RuntimeError, ValueError, ArithmeticError)
"""A run raising one of these is a failed cell (not stored: the next run tries it again), not a crash."""


def pick_metric(row: dict[str, Any]) -> tuple[str, bool]:
    """The first of :data:`METRICS` that ``row`` (a curve row) carries."""
    for name, higher in METRICS:
        if row.get(name) is not None:
            return name, higher
    raise RuntimeError(f"the run's evaluation has none of {[m for m, _ in METRICS]}")


def tau_mode_setting(strategy: str, form: Form) -> dict[str, Any]:
    """``<strategy>.tau-mode`` of the form for the strategies that have a τ, else nothing."""
    return {f"{strategy}.tau-mode": form.tau_mode} if strategy in ("fedgate", "apflgate") else {}


def refusal(strategy: str, form: Form, extra: dict[str, Any]) -> str | None:
    """Why a cell is not run (its τ is ≤ R/2: unstable by construction, C5), or ``None``."""
    from graphfl.strategies.apfl_math import tau_problem

    key = f"{strategy}.tau"
    if key not in extra:
        return None
    return tau_problem(key, float(extra[key]), form.tau_mode, form.local_steps)


def run_key(strategy: str, task: str, nodes: int, form: Form, seed: int, lr: float, extra: dict[str, Any],
            data_dir: str) -> dict[str, Any]:
    """The run-cache key of one run (its run configuration)."""
    overrides = {"train.local-steps": form.local_steps, "train.batch-size": form.batch_size, "train.momentum": 0.0,
                 "train.lr": lr, **dict(form.settings), **tau_mode_setting(strategy, form), **extra}
    return {"bench": NAME, "strategy": strategy, "task": task, "nodes": nodes, "rounds": form.rounds, "seed": seed,
            "overrides": overrides, "data_dir": data_dir, "engine": ENGINE}


def run_one(strategy: str, task: str, nodes: int, form: Form, seed: int, lr: float, extra: dict[str, Any],
            data_dir: str) -> dict[str, Any]:
    """One run on :data:`ENGINE` in this process: the curve of test metrics and upload bytes, total
    upload bytes, and ``engine``: the engine's facts from the run's record (``engine``, and
    ``batch_chunk`` or ``batched_fallback``: why it ran client by client).
    """
    from graphfl.common.config import parse_run_config
    from graphfl.server.inprocess import run_federated_inprocess

    key = run_key(strategy, task, nodes, form, seed, lr, extra, data_dir)
    cfg = parse_run_config({"strategy": strategy, "task": task, "nodes": nodes, "rounds": form.rounds,
                            "seed": seed, "engine": key["engine"], "data-dir": data_dir, "min-replies": 0,
                            **key["overrides"]})
    t0 = time.perf_counter()
    doc, _ = run_federated_inprocess(cfg)
    curve = doc["methods"][strategy]["curve"]
    tests = ("test_loss", "test_acc", "test_auc", "test_mae")
    keep = ("round", *tests, *(f"{v}_{k}" for v in VIEWS for k in tests), "bytes_up", "bytes_up_decoded")
    return {"curve": [{k: row[k] for k in keep if k in row} for row in curve],
            "bytes_up": int(sum(row.get("bytes_up", 0) or 0 for row in curve)),
            "wall_seconds": time.perf_counter() - t0,
            "engine": {k: v for k, v in doc.get("env", {}).items() if k in ("batch_chunk", "batched_fallback")}
            | {"engine": key["engine"]}}


def final_value(run: dict[str, Any], metric: str) -> float | None:
    v = run["curve"][-1].get(metric)
    return None if v is None or not np.isfinite(v) else float(v)


def _stats(values: list[float | None]) -> dict[str, Any]:
    vals = [v for v in values if v is not None]
    return {"mean": float(np.mean(vals)) if vals else None,
            "sd": float(np.std(vals, ddof=1)) if len(vals) > 1 else None,
            "values": values, "failed": len(values) - len(vals)}


GRID_FACTOR = 3.0
"""A step tried beyond a winning grid edge is this factor past it (the quick grids step ×3)."""
GRID_EXTENSIONS = 2
"""Most steps tried beyond a method's grid (:func:`graphfl.bench.tuning.search_grid`)."""


def methods_at(point: Mapping[str, Any], form: Form) -> list[str]:
    """The method a grid point belongs to: no α/τ = the references, α = APFL, τ = FedGATE, both = APFLGate."""
    keys = set(point) - {"codec"}
    if not keys:
        return (["fedavg"] if form.fedavg else []) + (["local"] if form.local else [])
    return ["apfl"] if keys == {"alpha"} else ["fedgate"] if keys == {"tau"} else ["apflgate"]


def extra_settings(method: str, point: Mapping[str, Any]) -> dict[str, Any]:
    """A point's run-config keys for ``method`` (α, τ, the codec's keys)."""
    out: dict[str, Any] = {}
    if "alpha" in point:
        out[f"{method}.alpha"] = point["alpha"]
    if "tau" in point:
        out[f"{method}.tau"] = point["tau"]
    if point.get("codec"):
        out.update(COMPRESSIONS[point["codec"]])
    return out


def reference_point(point: Mapping[str, Any]) -> dict[str, Any]:
    """Where a point's method is tuned: its reference setting (:data:`REFERENCE`)."""
    out: dict[str, Any] = {}
    if "alpha" in point:
        out["alpha"] = 0.5
    if "tau" in point:
        out["tau"] = REFERENCE_TAU
    return out


def points_of(form: Form) -> list[dict[str, Any]]:
    """FedAvg/local, APFL per α, FedGATE per τ, APFLGate per (α, τ), then the compression row."""
    points: list[dict[str, Any]] = [{}] if form.fedavg or form.local else []
    points += [{"alpha": a} for a in form.alphas] + [{"tau": t} for t in form.taus]
    points += [{"alpha": a, "tau": t} for a, t in form.apflgate_cells()]
    if form.codecs:
        ref = {"alpha": 0.5, "tau": REFERENCE_TAU}
        if ref not in points:
            points.append(ref)
        points += [{**ref, "codec": name} for name in form.codecs]
    return points


def find_metric(task: str, nodes: int, form: Form, seed: int, data_dir: str, cache: RunCache) -> tuple[str, bool]:
    """The task's metric, from APFLGate's first validation run at its reference (a cell the tuning reuses)."""
    for lr in form.lr_grid:
        key = run_key("apflgate", validation_task(task), nodes, form, seed, lr, REFERENCE["apflgate"], data_dir)
        try:
            r = cache(key, partial(run_one, "apflgate", validation_task(task), nodes, form, seed, lr,
                                   REFERENCE["apflgate"], data_dir))
        except RUN_ERRORS as exc:
            logger.warning("apflgate lr=%g failed while finding the metric: %s", lr, exc)
            continue
        return pick_metric(r["curve"][-1])
    raise RuntimeError(f"apflgate: every step in {form.lr_grid} failed on {validation_task(task)}")


def declare(form: Form, seed: int, task: str, nodes: int, data_dir: str, metric: str, higher: bool) -> Bench:
    """B8 on the harness: one point per (method, setting); the step tuned per method at its reference."""
    def args(cell: Cell) -> tuple[Any, ...]:
        return (cell.method, validation_task(task) if cell.split == "val" else task, nodes, form, cell.seed,
                cell.settings["lr"], extra_settings(cell.method, cell.at), data_dir)

    def final(r: dict[str, Any]) -> dict[str, Any]:
        return {metric: final_value(r, metric), **{f"{v}_{metric}": final_value(r, f"{v}_{metric}") for v in VIEWS},
                "bytes_up": r.get("bytes_up")}

    return Bench(
        name=NAME, title=f"B8: APFLGate vs APFL and FedGATE on `{task}` ({nodes} clients)",
        methods=(["fedavg"] if form.fedavg else []) + (["local"] if form.local else []) + ["apfl", "fedgate", "apflgate"],
        points=points_of(form), seeds=[seed + i for i in range(form.seeds)],
        metrics=(Metric(metric, lower_is_better=not higher, fmt=".4f"),
                 *(Metric(f"{v}_{metric}", f"{v} {metric}", lower_is_better=not higher, fmt=".4f") for v in VIEWS),
                 Metric("bytes_up", "upload bytes", fmt=".0f")),
        run_cell=lambda cell: run_one(*args(cell)), key=lambda cell: run_key(*args(cell)), final=final,
        failed=lambda r: r.get("error") or (None if final_value(r, metric) is not None else f"{metric} not finite"),
        tuning=Tuning(param="lr", grid=form.lr_grid, metric=metric, lower_is_better=not higher, factor=GRID_FACTOR,
                      max_extensions=GRID_EXTENSIONS, at=reference_point),
        methods_at=lambda p: methods_at(p, form),
        skip=lambda cell: refusal(cell.method, form, extra_settings(cell.method, cell.at)),
        errors=RUN_ERRORS, curve_keys=(metric,))


def run(quick: bool = False, seed: int = 0, out: Path | str = Path("runs/bench"), task: str = "digits",
        data_dir: str = "") -> dict[str, Any]:
    """Run B8 on ``task`` and write ``<out>/apflgate.{json,md,png}``.

    Parameters
    ----------
    quick
        15 rounds of 10 local steps, 8 clients, 3 seeds, a 3-point step grid, α ∈ {0.1, 0.5, 0.9}
        × the poster's 4 τ values (as multiples of R); ``bbbp`` and ``ciao`` use their own, cheaper
        quick forms (:data:`QUICK_BY_TASK`: the task's clients, 5–6 rounds of 4 steps, chosen
        cells, one codec). The full form: 50 rounds of 20 steps, the task's default number of
        clients, 3 seeds, a 4-point step grid, the poster's 5 × 4 grid.
    seed
        First seed (also the tuning seed); seeds are ``seed, seed+1, ...``.
    out
        Output folder (a ``cache`` folder inside lets an interrupted run continue).
    task, data_dir
        Any registered task (``bbbp`` and ``ciao`` are the paper's) and its data folder.
    """
    import graphfl.strategies.apfl
    import graphfl.strategies.apflgate
    import graphfl.strategies.fedgate  # noqa: F401
    from graphfl.tasks import registry as task_registry

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    form = form_for(task, quick)
    nodes = form.nodes or task_registry.get(task).spec.default_nodes
    metric, higher = find_metric(task, nodes, form, seed, data_dir, RunCache(out / "cache"))
    bench = declare(form, seed, task, nodes, data_dir, metric, higher)
    outcome = run_bench(bench, out)
    seeds = list(bench.seeds)
    trivial = trivial_baselines(task, nodes, form, seeds, data_dir, metric)
    config = {"quick": quick, **asdict(form), "task": task, "nodes": nodes, "tuning_seed": seed,
              "validation_fraction": VALIDATION_FRACTION, "reference_settings": REFERENCE}
    doc = build_doc(bench, outcome, quick, config, extra={
        "task": task, "nodes": nodes, "metric": metric, "higher_is_better": higher, "tau_mode": form.tau_mode,
        "reference_cell": REFERENCE_CELL, "trivial": trivial, "paper": PAPER.get(task),
        "unspecified_settings": unspecified(form, task, nodes)})
    doc["compression"] = compression(doc, form)
    doc["best"] = best_cells(doc)
    write_report(out, doc, intro=intro(doc, form), sections=sections(doc, form))
    try:
        plot(doc, out / f"{NAME}.png")
    except Exception:  # the JSON/MD are already written
        logger.exception("could not draw %s.png", NAME)
    return doc


def trivial_baselines(task: str, nodes: int, form: Form, seeds: list[int], data_dir: str,
                      metric: str) -> dict[str, Any]:
    """Constant predictors' test ``metric`` (mean over clients, mean ± sd over ``seeds``; C7).

    Regression: every client predicts the pooled training mean (``pooled``), or its own training
    median (``per-client``); classification: the pooled majority class, or the client's own.
    No training; the data (split, ``form.settings``) are those of the runs of the same seed.
    """
    import torch

    from graphfl.common.config import parse_run_config
    from graphfl.tasks import registry as tasks

    values: dict[str, list[float | None]] = {"pooled": [], "per-client": []}
    for s in seeds:
        cfg = parse_run_config({"strategy": "fedavg", "task": task, "nodes": nodes, "seed": s, "data-dir": data_dir,
                                "engine": "inprocess", **dict(form.settings)})
        t = tasks.create(cfg.task, data=cfg.data, data_dir=cfg.data_dir, seed=s)
        data = [t.client_data(p, nodes) for p in range(nodes)]
        classification = t.kind == "classification"
        pooled_y = np.concatenate([np.asarray(d.y_train).reshape(-1) for d in data])
        if classification:
            classes = int(max(pooled_y.max(), *(np.asarray(d.y_test).max(initial=0) for d in data))) + 1
            pooled: float = float(np.bincount(pooled_y.astype(np.int64), minlength=classes).argmax())
        else:
            pooled = float(pooled_y.mean())
        loss_fn = t.loss_fn()
        for name in values:
            per_client: list[float] = []
            for d in data:
                y = np.asarray(d.y_test)
                if len(y) == 0:
                    continue
                if classification:
                    own = np.bincount(np.asarray(d.y_train, np.int64).reshape(-1), minlength=classes).argmax()
                    c = int(pooled if name == "pooled" else own)
                    outputs = np.zeros((len(y), classes), np.float32)
                    outputs[:, c] = 1.0
                    m = {"test_acc": float(np.mean(y == c))}
                else:
                    c_r = pooled if name == "pooled" else float(np.median(np.asarray(d.y_train)))
                    outputs = np.full(y.shape, c_r, np.float32)
                    m = {}
                m["test_loss"] = float(loss_fn(torch.as_tensor(outputs), torch.as_tensor(y)))
                m.update(t.metrics(outputs, y))
                if metric in m and np.isfinite(m[metric]):
                    per_client.append(float(m[metric]))
            values[name].append(float(np.mean(per_client)) if per_client else None)
    what = ({"pooled": "the pooled majority class", "per-client": "each client's own majority class"} if classification
            else {"pooled": "the pooled training mean", "per-client": "each client's own training median"})
    return {name: {**_stats(v), "predicts": what[name]} for name, v in values.items()}


def _exact(doc: dict[str, Any], method: str, point: dict[str, Any]) -> dict[str, Any] | None:
    """The result of ``method`` at exactly ``point`` (no other axis set)."""
    for r in doc["results"]:
        if r["method"] == method and r["point"] == point:
            found: dict[str, Any] = r
            return found
    return None


def compression(doc: dict[str, Any], form: Form) -> dict[str, Any]:
    """Per codec: APFLGate's metric and upload bytes at the reference cell, bytes saved, paired change vs none."""
    metric = doc["metric"]
    ref = {"alpha": 0.5, "tau": REFERENCE_TAU}
    raw = _exact(doc, "apflgate", ref)
    if not form.codecs or raw is None:
        return {}
    out: dict[str, Any] = {"none": _summary(raw, metric)}
    for name in form.codecs:
        c = _exact(doc, "apflgate", {**ref, "codec": name})
        if c is None:
            continue
        entry = _summary(c, metric)
        if entry["bytes_up"] and out["none"]["bytes_up"]:
            entry["bytes_saved_fraction"] = 1.0 - entry["bytes_up"] / out["none"]["bytes_up"]
        change = paired_difference(entry["values"], out["none"]["values"], lower_is_better=not doc["higher_is_better"])
        if change["n"]:
            entry["metric_change"] = change
        out[name] = entry
    return out


def _summary(r: dict[str, Any], metric: str) -> dict[str, Any]:
    """A result's metric as ``{mean, sd, values per seed (None = failed), bytes_up}``."""
    per_seed = _per_seed(r, metric)
    return {**_stats(per_seed), "bytes_up": r["metrics"]["bytes_up"]["mean"], "skipped": r.get("skipped")}


def _per_seed(r: dict[str, Any], metric: str) -> list[float | None]:
    """``metric`` per seed with ``None`` for a failed seed (the per-seed list keeps only the finite ones)."""
    vals = iter(r["metrics"][metric]["per_seed"])
    used = r.get("params_per_seed") or []
    return [next(vals, None) if u else None for u in used]


def best_cells(doc: dict[str, Any]) -> dict[str, Any]:
    """Each method's best setting by mean *test* metric (descriptive only; nothing is tuned on it)."""
    sign = -1.0 if doc["higher_is_better"] else 1.0
    metric = doc["metric"]
    out: dict[str, Any] = {}
    for m in ("apfl", "fedgate", "apflgate"):
        cells = [r for r in doc["results"] if r["method"] == m and "codec" not in r["point"]
                 and r["metrics"][metric]["mean"] is not None]
        if cells:
            best = min(cells, key=lambda r: sign * r["metrics"][metric]["mean"])
            out[m] = {"cell": ",".join(f"{v:g}" for v in best["point"].values()),
                      "mean": best["metrics"][metric]["mean"], "sd": best["metrics"][metric]["sd"]}
    return out


def _pm(r: dict[str, Any] | None, metric: str) -> str:
    if r is None:
        return "not run"
    if r.get("skipped"):
        return "refused (τ ≤ R/2)"
    st = r["metrics"][metric]
    if st.get("mean") is None:
        return "failed"
    return f"{st['mean']:.4f} ± {st['sd']:.4f}" if st.get("sd") is not None else f"{st['mean']:.4f}"


def _stat(c: dict[str, Any]) -> str:
    if c.get("mean") is None:
        return "failed"
    return f"{c['mean']:.4f} ± {c['sd']:.4f}" if c.get("sd") is not None else f"{c['mean']:.4f}"


def intro(doc: dict[str, Any], form: Form) -> list[str]:
    m = doc["metric"]
    better = "higher" if doc["higher_is_better"] else "lower"
    lines = [f"Metric: final-round `{m}` ({better} is better), mean ± sd over seeds {doc['config']['seeds']}; "
             f"{form.rounds} rounds × {form.local_steps} local steps" + (" (quick form)." if doc["quick"] else ".")
             + " The views `mix_aggregated` (the mixture with the aggregated w) and `global` (the global model "
             "alone) are reported beside the metric (the mixture with the locally trained w_i, C6)."]
    if form.tau_mode == "multiple-of-steps":
        lines += ["", f"τ is read as a multiple of R = {form.local_steps} local steps (`tau-mode = multiple-of-steps`); "
                  "a τ ≤ R/2 is refused, not run: the δ update is unstable by construction there "
                  "(ALGORITHMS.md §0.1 C5)."]
    return lines


def sections(doc: dict[str, Any], form: Form) -> list[str]:
    """APFLGate's α × τ table, the constant predictors, compression, the paper, the settings."""
    m = doc["metric"]
    unit = " (× R)" if form.tau_mode == "multiple-of-steps" else ""
    cells = form.apflgate_cells()
    alphas = sorted({a for a, _ in cells})
    taus = sorted({t for _, t in cells})
    lines = [f"## APFLGate (rows α, columns τ{unit})", "", f"| α \\ τ{unit} | " + " | ".join(f"{t:g}" for t in taus)
             + " |", "|---|" + "---|" * len(taus)]
    for a in alphas:
        lines.append(f"| {a:g} | " + " | ".join(_pm(_exact(doc, "apflgate", {"alpha": a, "tau": t}), m)
                                                if (a, t) in cells else "not run" for t in taus) + " |")
    lines += ["", "## Constant predictors (no training, C7)", "", "| method | predicts | " + m + " |", "|---|---|---|"]
    for name, c in doc.get("trivial", {}).items():
        lines.append(f"| constant ({name}) | {c['predicts']} | {_stat(c)} |")
    refused = [r["skipped"] for r in doc["results"] if r.get("skipped")]
    if refused:
        lines += ["", f"Refused cells ({len(refused)}), e.g.: {refused[0]}"]
    lines += ["", "Best setting of each method by mean test metric (descriptive): "
              + "; ".join(f"{k} {v['cell']}: {v['mean']:.4f}" for k, v in doc["best"].items()), ""]
    lines += [f"## Compression of uploads (APFLGate at (α, τ{unit}) = ({REFERENCE_CELL}))", "",
              f"| upload codec | {m} | change vs none (paired) | upload bytes per run | bytes saved |",
              "|---|---|---|---|---|"]
    if not doc["compression"]:
        lines.append("| not run in this form | | | | |")
    for name, c in doc["compression"].items():
        ch = c.get("metric_change")
        chs = "—" if not ch else (f"{ch['mean']:+.4f}" + (f" ± {ch['sd']:.4f}" if ch.get("sd") is not None else ""))
        saved = c.get("bytes_saved_fraction")
        lines.append(f"| {name} | {_stat(c)} | {chs} | {c['bytes_up']:.0f} | "
                     f"{'—' if saved is None else f'{saved:.1%}'} |" if c.get("bytes_up") else f"| {name} | failed | | | |")
    paper = doc.get("paper")
    lines += ["", "## Paper (seed 004)", ""]
    if paper:
        lines += [f"Metric: {paper['metric']}. APFL {paper['apfl']}, FedGATE {paper['fedgate']}; APFLGate (α,τ): "
                  + ", ".join(f"({k}) {v}" for k, v in paper["apflgate"].items()), ""]
    else:
        lines += [f"The poster reports BBBP and ciao only; `{doc['task']}` has no paper numbers.", ""]
    lines += ["## Settings the paper does not give", ""] + [f"- {s}" for s in doc["unspecified_settings"]]
    return lines


def plot(doc: dict[str, Any], path: Path) -> None:
    """Heat map of the APFLGate grid, and the per-round metric of each method's reference setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = doc["metric"]
    cells = [tuple(c) for c in doc["config"]["cells"]] or [(a, t) for a in doc["config"]["alphas"]
                                                           for t in doc["config"]["taus"]]
    alphas = sorted({a for a, _ in cells})
    taus = sorted({t for _, t in cells})
    res = {(a, t): _exact(doc, "apflgate", {"alpha": a, "tau": t}) for a, t in cells}
    grid = np.array([[np.nan if (r := res.get((a, t))) is None or r["metrics"][m]["mean"] is None
                      else r["metrics"][m]["mean"] for t in taus] for a in alphas], float)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    im = ax.imshow(grid, cmap="viridis" if doc["higher_is_better"] else "viridis_r", aspect="auto")
    ax.set_xticks(range(len(taus)), [f"{t:g}" for t in taus])
    ax.set_yticks(range(len(alphas)), [f"{a:g}" for a in alphas])
    ax.set_xlabel("τ (× R)" if doc.get("tau_mode") == "multiple-of-steps" else "τ")
    ax.set_ylabel("α")
    ax.set_title(f"APFLGate: final {m} (mean over seeds)")
    for i, a in enumerate(alphas):
        for j, t in enumerate(taus):
            if np.isfinite(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.3f}", ha="center", va="center", color="w", fontsize=8)
            elif (res.get((a, t)) or {}).get("skipped"):
                ax.text(j, i, "refused\nτ ≤ R/2", ha="center", va="center", color="k", fontsize=7)
    fig.colorbar(im, ax=ax)
    ax = axes[1]
    series = {"FedAvg": _exact(doc, "fedavg", {}), "local only": _exact(doc, "local", {}),
              "APFL α=0.5": _exact(doc, "apfl", {"alpha": 0.5}),
              f"FedGATE τ={REFERENCE_TAU:g}": _exact(doc, "fedgate", {"tau": REFERENCE_TAU}),
              f"APFLGate ({REFERENCE_CELL})": _exact(doc, "apflgate", {"alpha": 0.5, "tau": REFERENCE_TAU})}
    for name, r in series.items():
        if r and r.get("curve"):  # FedAvg / local are absent when the form leaves them out
            ax.plot([row["round"] for row in r["curve"]], [row.get(m, np.nan) for row in r["curve"]], label=name)
    for (name, c), style in zip(doc.get("trivial", {}).items(), (":", "-.")):
        if c.get("mean") is not None:
            ax.axhline(c["mean"], color="grey", linestyle=style, label=f"constant ({name})")
    ax.set_xlabel("round")
    ax.set_ylabel(m)
    ax.set_title(f"{doc['task']}: mean {m} over seeds per round")
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        atomic_write_bytes(path, lambda fh: fig.savefig(fh, format="png", dpi=110))
    finally:
        plt.close(fig)


if __name__ == "__main__":  # pragma: no cover
    import argparse

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ap = argparse.ArgumentParser(description=(__doc__ or NAME).splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", default="digits")
    ap.add_argument("--data-dir", default="")
    ap.add_argument("--out", type=Path, default=Path("runs/bench"))
    args = ap.parse_args()
    run(args.quick, args.seed, args.out, task=args.task, data_dir=args.data_dir)
