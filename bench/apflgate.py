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

``run(quick, seed, out, task=..., data_dir=...)`` writes ``<out>/apflgate.{json,md,png}``.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.tasks.holdout import VALIDATION_FRACTION, validation_task

from .runcache import RunCache
from .tuning import search_grid

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
    # Measured on the shared 2-core machine (docs/apflgate.md): a GIN step on 32 molecules costs
    # ~11 ms CPU (digits' MLP: <1 ms) and the bench got a quarter of a core, ~9 s per round of 16
    # clients x 5 steps. So: the paper's 16 clients, 5 rounds x 4 steps, a 2-point step grid, the
    # cells the poster reports (α = 0.1 across its τ grid, and the reference α = 0.5; not the
    # full 5 x 4 product), one codec, no FedAvg.
    "bbbp": Form(rounds=5, local_steps=4, seeds=3, lr_grid=(0.1, 0.3), alphas=(0.1, 0.5), taus=PAPER_TAUS,
                 nodes=0, codecs=("quant-4bit",), fedavg=False,
                 cells=((0.1, 0.1), (0.1, 1.0), (0.1, 10.0), (0.1, 100.0), (0.5, 1.0), (0.5, 10.0))),
    # the paper's 28 clients (one per category) on a random 20,000 of the 283,319 ratings: a step
    # costs a GCN pass over the client's whole graph (0.5 s CPU for all 28 clients on all ratings,
    # 0.14 s on 60,000); the reference configuration subsamples too (ego networks, ALGORITHMS.md §9.3)
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
    ]


_cache = RunCache(None)  # run() points it at <out>/cache
RESUMABLE = True
"""An interrupted run continues in the same ``--out`` (finished runs come from ``<out>/cache``)."""


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


def run_one(strategy: str, task: str, nodes: int, form: Form, seed: int, lr: float, extra: dict[str, Any],
            data_dir: str) -> dict[str, Any]:
    """One in-process run (through the run cache): final metric row, total upload bytes, curve."""
    overrides = {"train.local-steps": form.local_steps, "train.batch-size": form.batch_size, "train.momentum": 0.0,
                 "train.lr": lr, **dict(form.settings), **tau_mode_setting(strategy, form), **extra}
    key = {"bench": NAME, "strategy": strategy, "task": task, "nodes": nodes, "rounds": form.rounds, "seed": seed,
           "overrides": overrides, "data_dir": data_dir}

    def compute() -> dict[str, Any]:
        from graphfl.common.config import parse_run_config
        from graphfl.server.inprocess import run_federated_inprocess

        cfg = parse_run_config({"strategy": strategy, "task": task, "nodes": nodes, "rounds": form.rounds,
                                "seed": seed, "engine": "inprocess", "data-dir": data_dir, "min-replies": 0,
                                **overrides})
        t0 = time.perf_counter()
        doc, _ = run_federated_inprocess(cfg)
        curve = doc["methods"][strategy]["curve"]
        tests = ("test_loss", "test_acc", "test_auc", "test_mae")
        keep = ("round", *tests, *(f"{v}_{k}" for v in VIEWS for k in tests), "bytes_up", "bytes_up_decoded")
        return {"curve": [{k: row[k] for k in keep if k in row} for row in curve],
                "bytes_up": int(sum(row.get("bytes_up", 0) or 0 for row in curve)),
                "wall_seconds": time.perf_counter() - t0}

    return _cache(key, compute)


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


def tune(strategy: str, task: str, nodes: int, form: Form, seed: int, data_dir: str) -> dict[str, Any]:
    """The step of ``strategy`` at its reference setting, by the validation metric.

    The grid is ``form.lr_grid``, extended past an unbracketed winner by :data:`GRID_FACTOR` (at
    most :data:`GRID_EXTENSIONS` steps, :func:`graphfl.bench.tuning.search_grid`); every step
    tried is in the result's ``grid``, the extra ones also in ``extended``.
    """
    val = validation_task(task)
    found: dict[str, Any] = {"metric": "", "higher": True}

    def score(lr: float) -> float | None:
        try:
            r = run_one(strategy, val, nodes, form, seed, lr, REFERENCE[strategy], data_dir)
        except (RuntimeError, ValueError, ArithmeticError) as exc:  # a diverging step must not stop the bench
            logger.warning("tuning %s lr=%g failed: %s", strategy, lr, exc)
            return None
        metric, higher = pick_metric(r["curve"][-1])
        found.update(metric=metric, higher=higher)
        value = final_value(r, metric)
        return None if value is None else (-value if higher else value)

    try:
        search = search_grid(score, form.lr_grid, factor=GRID_FACTOR, max_extensions=GRID_EXTENSIONS)
    except RuntimeError:
        raise RuntimeError(f"{strategy}: every step in {form.lr_grid} failed on {val}") from None
    sign = -1.0 if found["higher"] else 1.0
    scores = {k: (None if v is None else sign * v) for k, v in search.grid_scores().items()}
    return {"grid": scores, "metric": found["metric"], "lr": search.chosen, "extended": search.extended,
            "at_grid_edge": search.at_edge}


def cell(strategy: str, task: str, nodes: int, form: Form, seeds: list[int], lr: float, extra: dict[str, Any],
         metric: str, data_dir: str) -> dict[str, Any]:
    """Mean ± sd over ``seeds`` of the final test metric (and upload bytes) of one setting.

    A setting :func:`refusal` refuses is not run: its entry has ``refused`` (the reason) and no
    values. Personalised runs also give the final metric of each of :data:`VIEWS` (``views``).
    """
    why = refusal(strategy, form, extra)
    if why is not None:
        logger.info("%s %s refused: %s", strategy, extra, why)
        return {"mean": None, "sd": None, "values": [], "failed": 0, "refused": why,
                "settings": {**extra, "train.lr": lr}, "bytes_up": None}
    values: list[float | None] = []
    views: dict[str, list[float | None]] = {v: [] for v in VIEWS}
    bytes_up: list[int] = []
    curves: list[list[float | None]] = []
    for s in seeds:
        try:
            r = run_one(strategy, task, nodes, form, s, lr, extra, data_dir)
        except (RuntimeError, ValueError, ArithmeticError) as exc:
            logger.warning("%s %s seed %d failed: %s", strategy, extra, s, exc)
            values.append(None)
            continue
        values.append(final_value(r, metric))
        for v in VIEWS:
            views[v].append(final_value(r, f"{v}_{metric}"))
        bytes_up.append(r["bytes_up"])
        curves.append([row.get(metric) for row in r["curve"]])
    out = _stats(values)
    out["settings"] = {**extra, "train.lr": lr}
    out["views"] = {v: _stats(vals) for v, vals in views.items() if any(x is not None for x in vals)}
    out["bytes_up"] = float(np.mean(bytes_up)) if bytes_up else None
    if curves:
        arr = np.array([[np.nan if v is None else v for v in c] for c in curves], dtype=float)
        with warnings.catch_warnings():   # a round no seed has a value for (e.g. all failed) is None, not a warning
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = np.nanmean(arr, axis=0)
        out["curve_mean"] = [None if np.isnan(v) else float(v) for v in mean]
    return out


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
    from graphfl.common.envinfo import env_info
    from graphfl.common.results import atomic_write_text, write_json
    from graphfl.tasks import registry as task_registry

    global _cache
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _cache = RunCache(out / "cache")
    t_start = time.perf_counter()
    form = form_for(task, quick)
    nodes = form.nodes or task_registry.get(task).spec.default_nodes
    seeds = [seed + i for i in range(form.seeds)]

    methods = (("fedavg",) if form.fedavg else ()) + (("local",) if form.local else ()) + ("apfl", "fedgate", "apflgate")
    tuning = {m: tune(m, task, nodes, form, seed, data_dir) for m in methods}
    metric = tuning["apflgate"]["metric"]
    higher = dict(METRICS)[metric]
    lr = {m: t["lr"] for m, t in tuning.items()}
    logger.info("tuned steps: %s (validation %s)", lr, metric)

    fedavg = cell("fedavg", task, nodes, form, seeds, lr["fedavg"], {}, metric, data_dir) if form.fedavg else None
    local = cell("local", task, nodes, form, seeds, lr["local"], {}, metric, data_dir) if form.local else None
    trivial = trivial_baselines(task, nodes, form, seeds, data_dir, metric)
    apfl = {f"{a:g}": cell("apfl", task, nodes, form, seeds, lr["apfl"], {"apfl.alpha": a}, metric, data_dir)
            for a in form.alphas}
    fedgate = {f"{t:g}": cell("fedgate", task, nodes, form, seeds, lr["fedgate"], {"fedgate.tau": t}, metric, data_dir)
               for t in form.taus}
    grid = {f"{a:g},{t:g}": cell("apflgate", task, nodes, form, seeds, lr["apflgate"],
                                 {"apflgate.alpha": a, "apflgate.tau": t}, metric, data_dir)
            for a, t in form.apflgate_cells()}
    ref = REFERENCE["apflgate"]
    compression: dict[str, Any] = {}
    if form.codecs:   # the uncompressed reference cell is run only to compare codecs against it
        compression["none"] = raw = cell("apflgate", task, nodes, form, seeds, lr["apflgate"], ref, metric, data_dir)
    for name in form.codecs:
        keys = COMPRESSIONS[name]
        c = cell("apflgate", task, nodes, form, seeds, lr["apflgate"], {**ref, **keys}, metric, data_dir)
        if c["bytes_up"] and raw["bytes_up"]:
            c["bytes_saved_fraction"] = 1.0 - c["bytes_up"] / raw["bytes_up"]
        pairs = [(x, y) for x, y in zip(c["values"], raw["values"]) if x is not None and y is not None]
        if pairs:
            d = [x - y for x, y in pairs]
            c["metric_change"] = {"mean": float(np.mean(d)), "sd": float(np.std(d, ddof=1)) if len(d) > 1 else None}
        compression[name] = c

    doc: dict[str, Any] = {
        "name": NAME, "task": task, "nodes": nodes, "metric": metric, "higher_is_better": higher,
        "form": {"quick": quick, **asdict(form), "seeds_used": seeds}, "unspecified_settings": unspecified(form, task, nodes),
        "paper": PAPER.get(task), "tuning": tuning,
        "tau_mode": form.tau_mode, "reference_cell": REFERENCE_CELL, "trivial": trivial,
        "methods": {"fedavg": fedavg, "local": local, "apfl": apfl, "fedgate": fedgate, "apflgate": grid},
        "compression": compression, "env": env_info(), "wall_seconds": time.perf_counter() - t_start,
    }
    doc["best"] = best_cells(doc)
    write_json(out / f"{NAME}.json", doc)
    atomic_write_text(out / f"{NAME}.md", render_markdown(doc))
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


def best_cells(doc: dict[str, Any]) -> dict[str, Any]:
    """Each method's best cell by mean *test* metric (descriptive only; nothing is tuned on it)."""
    sign = -1.0 if doc["higher_is_better"] else 1.0
    out: dict[str, Any] = {}
    for m in ("apfl", "fedgate", "apflgate"):
        cells = {k: v for k, v in doc["methods"][m].items() if v["mean"] is not None}
        if cells:
            k = min(cells, key=lambda c: sign * cells[c]["mean"])
            out[m] = {"cell": k, "mean": cells[k]["mean"], "sd": cells[k]["sd"]}
    return out


def _grid_axes(doc: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Rows (α) and columns (τ) of the APFLGate table: every α and τ of a cell that ran, sorted."""
    pairs = [tuple(float(v) for v in k.split(",")) for k in doc["methods"]["apflgate"]]
    return [f"{a:g}" for a in sorted({a for a, _ in pairs})], [f"{t:g}" for t in sorted({t for _, t in pairs})]


def _pm(c: dict[str, Any] | None) -> str:
    if c and c.get("refused"):
        return "refused (τ ≤ R/2)"
    if not c or c.get("mean") is None:
        return "failed"
    sd = c.get("sd")
    return f"{c['mean']:.4f} ± {sd:.4f}" if sd is not None else f"{c['mean']:.4f}"


def render_markdown(doc: dict[str, Any]) -> str:
    """Tables: APFLGate α × τ, baselines (constants, FedAvg, local, APFL per α, FedGATE per τ), both
    personal output forms, compression; tuning; settings.
    """
    m, form = doc["metric"], doc["form"]
    better = "higher" if doc["higher_is_better"] else "lower"
    lines = [f"# B8: APFLGate vs APFL and FedGATE on `{doc['task']}` ({doc['nodes']} clients)", "",
             f"Metric: final-round `{m}` ({better} is better), mean ± sd over seeds {form['seeds_used']}; "
             f"{form['rounds']} rounds × {form['local_steps']} local steps"
             + (" (quick form)." if form["quick"] else "."), ""]
    alphas, taus = _grid_axes(doc)
    unit = " (× R)" if doc.get("tau_mode") == "multiple-of-steps" else ""
    if unit:
        lines += [f"τ is read as a multiple of R = {form['local_steps']} local steps (`tau-mode = multiple-of-steps`); "
                  "a τ ≤ R/2 is refused, not run: the δ update is unstable by construction there "
                  "(ALGORITHMS.md §0.1 C5).", ""]
    lines += [f"## APFLGate (rows α, columns τ{unit})", "", f"| α \\ τ{unit} | " + " | ".join(taus) + " |",
              "|---|" + "---|" * len(taus)]
    for a in alphas:
        lines.append(f"| {a} | " + " | ".join(_pm(doc["methods"]["apflgate"][f"{a},{t}"])
                                              if f"{a},{t}" in doc["methods"]["apflgate"] else "not run"
                                              for t in taus) + " |")
    lines += ["", "## Baselines", "", "| method | setting | " + m + " |", "|---|---|---|"]
    for name, c in doc.get("trivial", {}).items():
        lines.append(f"| constant ({name}) | predicts {c['predicts']} | {_pm(c)} |")
    lines += [f"| FedAvg | — | {_pm(doc['methods']['fedavg']) if doc['methods']['fedavg'] else 'not run'} |",
              f"| local only | — | {_pm(doc['methods'].get('local')) if doc['methods'].get('local') else 'not run'} |"]
    lines += [f"| APFL | α = {a} | {_pm(c)} |" for a, c in doc["methods"]["apfl"].items()]
    lines += [f"| FedGATE | τ = {t}{unit} | {_pm(c)} |" for t, c in doc["methods"]["fedgate"].items()]
    lines += ["", "## Personal output: mixture with the locally trained w_i (the metric above) vs the aggregated w",
              "", "| method | setting | local-copy mixture | aggregated-w mixture | global model alone |",
              "|---|---|---|---|---|"]
    for meth, label, fmt in (("apfl", "APFL", "α = {}"), ("apflgate", "APFLGate", "(α, τ{}) = ({})")):
        for k, c in doc["methods"][meth].items():
            if c.get("refused"):
                continue
            views = c.get("views", {})
            setting = fmt.format(k) if meth == "apfl" else fmt.format(unit, k)
            lines.append(f"| {label} | {setting} | {_pm(c)} | {_pm(views.get('mix_aggregated'))} | "
                         f"{_pm(views.get('global'))} |")
    refused = [c["refused"] for meth in ("fedgate", "apflgate") for c in doc["methods"][meth].values()
               if c.get("refused")]
    if refused:
        lines += ["", f"Refused cells ({len(refused)}), e.g.: {refused[0]}"]
    lines += ["", "Best cell of each method by mean test metric (descriptive): "
              + "; ".join(f"{k} {v['cell']}: {v['mean']:.4f}" for k, v in doc["best"].items()), ""]
    lines += [f"## Compression of uploads (APFLGate at (α, τ{unit}) = ({doc.get('reference_cell', REFERENCE_CELL)}))", "",
              f"| upload codec | {m} | change vs none (paired) | upload bytes per run | bytes saved |",
              "|---|---|---|---|---|"]
    if not doc["compression"]:
        lines.append("| not run in this form | | | | |")
    for name, c in doc["compression"].items():
        ch = c.get("metric_change")
        chs = "—" if not ch else (f"{ch['mean']:+.4f}" + (f" ± {ch['sd']:.4f}" if ch.get("sd") is not None else ""))
        saved = c.get("bytes_saved_fraction")
        lines.append(f"| {name} | {_pm(c)} | {chs} | {c['bytes_up']:.0f} | "
                     f"{'—' if saved is None else f'{saved:.1%}'} |" if c.get("bytes_up") else f"| {name} | failed | | | |")
    lines += ["", "## Step sizes (tuned on validation)", "", "| method | grid (validation " + m + ") | chosen |",
              "|---|---|---|"]
    for meth, t in doc["tuning"].items():
        grid = ", ".join(f"{k}: {'fail' if v is None else f'{v:.4f}'}" for k, v in t["grid"].items())
        lines.append(f"| {meth} | {grid} | {t['lr']:g}{' (grid edge)' if t['at_grid_edge'] else ''}"
                     f"{' (extended: ' + ', '.join(f'{x:g}' for x in t['extended']) + ')' if t.get('extended') else ''} |")
    paper = doc.get("paper")
    lines += ["", "## Paper (seed 004)", ""]
    if paper:
        lines += [f"Metric: {paper['metric']}. APFL {paper['apfl']}, FedGATE {paper['fedgate']}; APFLGate (α,τ): "
                  + ", ".join(f"({k}) {v}" for k, v in paper["apflgate"].items()), ""]
    else:
        lines += [f"The poster reports BBBP and ciao only; `{doc['task']}` has no paper numbers.", ""]
    lines += ["## Settings the paper does not give", ""] + [f"- {s}" for s in doc["unspecified_settings"]]
    lines += ["", f"Wall time {doc['wall_seconds']:.0f} s.", ""]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Heat map of the APFLGate grid, and the per-round metric of each method's reference setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = doc["metric"]
    alphas, taus = _grid_axes(doc)
    cells = doc["methods"]["apflgate"]
    grid = np.array([[np.nan if (c := cells.get(f"{a},{t}")) is None or c["mean"] is None else c["mean"]
                      for t in taus] for a in alphas], float)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    im = ax.imshow(grid, cmap="viridis" if doc["higher_is_better"] else "viridis_r", aspect="auto")
    ax.set_xticks(range(len(taus)), taus)
    ax.set_yticks(range(len(alphas)), alphas)
    ax.set_xlabel("τ (× R)" if doc.get("tau_mode") == "multiple-of-steps" else "τ")
    ax.set_ylabel("α")
    ax.set_title(f"APFLGate: final {m} (mean over seeds)")
    for i in range(len(alphas)):
        for j in range(len(taus)):
            if np.isfinite(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.3f}", ha="center", va="center", color="w", fontsize=8)
            elif (cells.get(f"{alphas[i]},{taus[j]}") or {}).get("refused"):
                ax.text(j, i, "refused\nτ ≤ R/2", ha="center", va="center", color="k", fontsize=7)
    fig.colorbar(im, ax=ax)
    ax = axes[1]
    ref = doc.get("reference_cell", REFERENCE_CELL)
    tau_ref = ref.split(",")[1]
    series = {"FedAvg": doc["methods"]["fedavg"], "local only": doc["methods"].get("local"),
              "APFL α=0.5": doc["methods"]["apfl"].get("0.5"),
              f"FedGATE τ={tau_ref}": doc["methods"]["fedgate"].get(tau_ref),
              f"APFLGate ({ref})": doc["methods"]["apflgate"].get(ref)}
    for name, c in series.items():
        if c and c.get("curve_mean"):  # FedAvg / local are None when the form leaves them out
            ys = [np.nan if v is None else v for v in c["curve_mean"]]
            ax.plot(range(len(ys)), ys, label=name)
    for (name, c), style in zip(doc.get("trivial", {}).items(), (":", "-.")):
        if c.get("mean") is not None:
            ax.axhline(c["mean"], color="grey", linestyle=style, label=f"constant ({name})")
    ax.set_xlabel("round")
    ax.set_ylabel(m)
    ax.set_title(f"{doc['task']}: mean {m} over seeds per round")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
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
