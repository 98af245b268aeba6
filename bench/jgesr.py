"""Benchmark B7 (ALGORITHMS.md §8.9, §11, §0.1 C4; seed 002 Table 1): JGESR under noisy, lossy uplinks.

Methods (``Form.methods``): the trivial baselines FedAvg and Local (no aggregation), the graph-FL
baselines FedProx, CFL, FedAMP, pFedGraph (full form), and JGESR (PDCA) / JGESR (Two-step), on
a strongly non-IID split of ``--task`` (C4: JGESR can only win by personalising):
``digits`` | ``mnist`` | ``cifar10`` with a Dirichlet(``Form.dirichlet`` = 0.1) label split, or
``digits-permuted`` (3 planted client groups with permuted labels, near-IID inside a group:
Dirichlet 10). Every upload passes the
noisy channel (:mod:`graphfl.client.noisy_channel`: ``y = m ⊙ θ + n``, ``σ = c·mean|θ⁰|`` of the
common initial model):

* **table** (shaped like the paper's Table 1): two noise levels ``c``, no missing entries;
* **missing-rate sweep** at the first noise level: ``r`` over :attr:`Form.missing_rates`;
* metric: the mean over clients of the test accuracy of the model each client is given after the
  last round (its personalised model for CFL/FedAMP/pFedGraph/JGESR, its own for Local, the
  global one for FedAvg/FedProx), mean ± sd over seeds;
* JGESR's collapse diagnostics (C4), per round of every test run: ``shrink_ratio`` =
  ‖ψ − ȳ‖/‖y − ȳ‖ and ``graph_cv`` = the coefficient of variation of the learned graph's
  off-diagonal weights (``diagnostics`` in the JSON, a table and two panels in the plot).

**Regime form** (``form="regime"``, :func:`run_regime`): the quick form's scale and methods over
the full cross noise ``c`` × missing rate ``r`` (:data:`REGIME`, ``c = 0`` a noiseless channel),
every method's step and JGESR's ``(λ, α, β)`` tuned on validation at every point
(:data:`REGIME_TUNE_AT`), each JGESR solver paired per seed with Local and FedAvg
(:func:`verdict`), the collapse diagnostics per point (:func:`collapse_flags`); it writes
``<out>/jgesr-regime.{json,md,png}``.

Fairness: one optimiser for all (plain SGD, the same local steps and batch); the step size of
*each method* is chosen from ``Form.lr_grid`` on a validation split of the clients' training data
(:func:`graphfl.tasks.holdout.validation_task`; at the first noise level, no missing entries,
first seed), never on test; JGESR's ``(λ, α, β)`` are then chosen on the same validation runs
(:func:`tune_graph`: the whole grid ``lam_grid × alpha_grid × beta_grid``, or in the quick form a
coordinate search over it: λ, then α, then β). Every setting the paper did not give is listed in
the result file (:func:`unspecified`).

The benchmark is declared for the harness (:func:`declare`, :mod:`graphfl.bench.harness`): grid
points (noise c, missing rate r), cells through the run cache in ``<out>/cache`` (an interrupted
benchmark resumes), the estimate logged; ``run(quick, seed, out, task)`` writes
``<out>/jgesr.{json,md,png}`` in the harness's layout plus the paper-shaped table, the sweep and
the collapse diagnostics.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.common.results import markdown_table
from graphfl.tasks.holdout import VALIDATION_FRACTION, validation_task

from .harness import Bench, Cell, Metric, Tuning, run_bench
from .report import build_doc, metric_panels, result, write_report
from .stats import fmt_pm

logger = logging.getLogger(__name__)

NAME = "jgesr"
TASKS = ("digits", "digits-permuted", "mnist", "cifar10")

METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "FedAvg": ("fedavg", {}),
    "Local": ("local", {}),
    "FedProx": ("fedprox", {"fedprox.mu": 0.01}),
    "CFL": ("cfl", {"cfl.warmup-rounds": 5}),
    "FedAMP": ("fedamp", {}),
    "pFedGraph": ("pfedgraph", {}),
    "JGESR-PDCA": ("jgesr", {"jgesr.solver": "pdca", "jgesr.log-graph": False}),
    "JGESR-two-step": ("jgesr", {"jgesr.solver": "two-step", "jgesr.log-graph": False}),
}
GRAPH_METHODS = ("JGESR-PDCA", "JGESR-two-step")
"""Methods whose ``(λ, α, β)`` are tuned and whose collapse diagnostics are logged."""
GRAPH_DEFAULT = (1.0, 1.0, 0.1)
"""``(λ, α, β)`` while the step size is tuned (the defaults of ``[jgesr]``)."""
DIAGNOSTICS = ("shrink_ratio", "graph_cv")
ENGINE = "batched"
"""Engine of every run: the batched engine (a round's clients train as one stacked computation;
a strategy or task that does not batch is served client by client by that engine itself, which
logs why). Its numbers equal the in-process engine's up to floating-point summation order."""
PAPER_MNIST = {"JGESR-PDCA": (95.17, 92.68), "JGESR-two-step": (88.99, 83.77), "FedAvg": (90.48, 89.96),
               "FedProx": (90.38, 91.19), "CFL": (92.96, 91.21), "FedAMP": (93.12, 92.40),
               "pFedGraph": (92.76, 92.01)}
"""Seed 002 Table 1, MNIST columns (noise level 1, 2), percent."""


@dataclass(frozen=True)
class Form:
    """What ``--quick`` and the full form run."""

    nodes: int
    rounds: int
    local_steps: int
    batch_size: int
    seeds: int
    noise_levels: tuple[float, ...]
    """Noise levels ``c``: the table's two (quick, full) or the sweep's axis (regime)."""
    missing_rates: tuple[float, ...]
    lr_grid: tuple[float, ...]
    max_samples: int
    methods: tuple[str, ...] = tuple(METHODS)
    dirichlet: float = 0.1
    lam_grid: tuple[float, ...] = (0.1, 0.3, 1.0, 3.0, 10.0)
    alpha_grid: tuple[float, ...] = (0.01, 0.1, 1.0)
    beta_grid: tuple[float, ...] = (0.001, 0.01, 0.1)
    graph_search: str = "grid"
    """``grid`` (every combination) or ``coordinate`` (λ, then α, then β; :func:`tune_graph`)."""


QUICK = Form(nodes=10, rounds=20, local_steps=10, batch_size=32, seeds=3, noise_levels=(1.0, 2.0),
             missing_rates=(0.0, 0.3), lr_grid=(0.3, 1.0), max_samples=0,
             methods=("FedAvg", "Local", "JGESR-PDCA", "JGESR-two-step"), lam_grid=(0.1, 1.0, 10.0),
             graph_search="coordinate")
FULL = Form(nodes=10, rounds=100, local_steps=50, batch_size=64, seeds=3, noise_levels=(1.0, 2.0),
            missing_rates=(0.0, 0.1, 0.2, 0.3, 0.5), lr_grid=(0.01, 0.03, 0.1, 0.3, 1.0), max_samples=0)
QUICK_MAX_SAMPLES = {"mnist": 6000, "cifar10": 6000}
TASK_NODES = {"digits-permuted": 12}
"""Client count where the task fixes it (``digits-permuted``: 3 groups of 4)."""
TASK_DIRICHLET = {"digits-permuted": 10.0}
"""Dirichlet alpha where the planted groups are the heterogeneity (a near-IID split inside each group:
at 0.1 the label skew inside a group hides the groups from any graph)."""
REGIME = dataclasses.replace(QUICK, noise_levels=(0.0, 1.0, 2.0, 4.0), missing_rates=(0.0, 0.2, 0.5))
"""The regime form: the quick form's training scale, methods and grids over the full cross noise
``c`` × missing rate ``r`` (``c = 0``: a noiseless channel; ``c = r = 0``: the channel is off)."""
FORMS = ("quick", "full", "regime")
"""``--form`` values: ``quick`` / ``full`` = the paper-shaped table plus the missing-rate sweep;
``regime`` = :data:`REGIME` (:func:`run_regime`)."""
REGIME_NAME = "jgesr-regime"
"""Name of the regime form's result files (``<out>/jgesr-regime.{json,md,png}``)."""
TUNE_AT = ("point", "noise", "reference")
"""Where the regime form tunes (:func:`tuning_point`)."""
REGIME_TUNE_AT = "point"
"""The regime form's tuning: every method's step and JGESR's (λ, α, β) at every point."""
REGIME_REFERENCES = ("Local", "FedAvg")
"""Each JGESR solver is compared, per seed, with each of these (Local is the trivial baseline: the
bench has no constant predictor)."""
TIE_BAND = 0.01
"""Accuracy (absolute, 1 point) inside which a mean paired difference is a tie."""
COLLAPSE_CV = 0.2
"""Graph CV below which the learned graph counts as near-uniform (ALGORITHMS.md §0.1 C4)."""
COLLAPSE_SHRINK = 0.2
"""Shrink ratio below which JGESR gives every client nearly the mean (the strategy's collapse threshold)."""


def nodes_for(form: Form, task: str) -> int:
    """Clients in a run of ``task`` (``+val`` views included)."""
    return TASK_NODES.get(task.removesuffix("+val"), form.nodes)


def dirichlet_for(form: Form, task: str) -> float:
    """Dirichlet alpha of the label split in a run of ``task`` (``+val`` views included)."""
    return TASK_DIRICHLET.get(task.removesuffix("+val"), form.dirichlet)


def unspecified(form: Form, task: str) -> list[str]:
    """Every choice the paper does not give (the paper's values were stripped; ALGORITHMS.md §8.9)."""
    split = (f"3 planted groups of clients with permuted labels (digits-permuted), Dirichlet alpha "
             f"{dirichlet_for(form, task)} label split (near IID inside a group)" if task in TASK_DIRICHLET
             else f"Dirichlet alpha {form.dirichlet} label split (strongly non-IID, C4)")
    graph = (f"JGESR (lambda, alpha, beta) on validation over lambda {list(form.lam_grid)} x alpha "
             f"{list(form.alpha_grid)} x beta {list(form.beta_grid)} "
             + ("(every combination)" if form.graph_search == "grid"
                else "(coordinate search: lambda at alpha 1, beta 0.1; then alpha; then beta)")
             + ", each solver separately, at its tuned step; graph scale sum_{i<j} w_ij = n (C4), "
             "tol 1e-4, warm starts, cosine initial graph (ALGORITHMS.md §8, reconstructed)")
    return [
        f"task {task}; {nodes_for(form, task)} clients; {split}; local train/test split 80/20",
        f"{form.rounds} rounds, {form.local_steps} local SGD steps of batch {form.batch_size} per round "
        "(plain SGD, momentum 0), the same for every method",
        f"step size per method from {list(form.lr_grid)} on validation ({VALIDATION_FRACTION:.0%} of each "
        "client's training data; noise level 1, no missing entries, first seed), by mean validation accuracy "
        f"(JGESR at (lambda, alpha, beta) = {GRAPH_DEFAULT})",
        graph,
        f"noise levels c = {list(form.noise_levels)} with sigma = c * mean|theta^0| of the common initial model "
        "(seed 002), one sigma for the run",
        f"missing rates {list(form.missing_rates)} at noise level 1; lost entries are 0 + noise on the wire, "
        "their mask reaches the server (only JGESR uses it)",
        "FedProx mu 0.01; CFL eps1 0.4, eps2 1.6, warm-up 5 rounds, complete linkage; FedAMP heuristic "
        "(self weight 0.3, scale 10, prox mu 0.1); pFedGraph alpha 0.8, clip 0.9, lam 0.01",
        "model: the task's model (digits: MLP 64-64-10; mnist/cifar10: CNN conv5x5(32)-pool-conv5x5(64)-pool-"
        "FC(512)-FC(10))",
        f"methods: {', '.join(form.methods)}",
        f"seeds: {form.seeds} (mean ± sd over seeds of the mean client test accuracy after the last round)",
        f"engine: {ENGINE} (equal to the in-process engine up to summation order; each cached run records "
        "its engine, chunk or per-client fallback)",
    ]


RESUMABLE = True
"""An interrupted run continues in the same ``--out`` (finished cells come from ``<out>/cache``)."""


def run_values(method: str, task: str, form: Form, seed: int, lr: float, noise: float, missing: float,
               graph: tuple[float, float, float] | None = None) -> dict[str, Any]:
    """The run configuration of one run of ``method`` (``graph`` = JGESR's ``(λ, α, β)``, ignored by the others).

    ``{"method": method, **run_values(...)}`` is the run's cache key.
    """
    strategy, params = METHODS[method]
    values: dict[str, Any] = {
        "strategy": strategy, "task": task, "nodes": nodes_for(form, task), "rounds": form.rounds, "seed": seed,
        "engine": ENGINE, "train.lr": lr, "train.local-steps": form.local_steps,
        "train.batch-size": form.batch_size, "train.momentum": 0.0, "data.dirichlet-alpha": dirichlet_for(form, task),
        "channel.noise": noise, "channel.missing": missing, **params,
    }
    if strategy == "jgesr":
        lam, alpha, beta = graph if graph is not None else GRAPH_DEFAULT
        values.update({"jgesr.lam": lam, "jgesr.alpha": alpha, "jgesr.beta": beta})
    max_samples = form.max_samples or QUICK_MAX_SAMPLES.get(task.removesuffix("+val"), 0)
    if max_samples:
        values["data.max-samples"] = max_samples
    return values


def run_one(method: str, task: str, form: Form, seed: int, lr: float, noise: float, missing: float,
            graph: tuple[float, float, float] | None = None) -> dict[str, Any]:
    """One run of ``method`` on :data:`ENGINE` in this process: accuracy curve, final accuracy,
    JGESR's diagnostics per round, and ``engine``: the engine's facts from the run's record
    (``engine``, and ``batch_chunk`` or ``batched_fallback``: why it ran client by client).

    A run that fails (e.g. every upload NaN at a too large step) returns ``final = None`` and
    ``error``: a failed setting, not a crash.
    """
    from graphfl.common.config import parse_run_config
    from graphfl.server.inprocess import run_federated_inprocess
    from graphfl.server.rounds import RunError

    values = run_values(method, task, form, seed, lr, noise, missing, graph)
    strategy = values["strategy"]
    t0 = time.perf_counter()
    try:
        doc, _ = run_federated_inprocess(parse_run_config(values))
    except RunError as exc:
        logger.warning("%s lr %g diverged: %s", method, lr, exc)
        return {"acc": [], "final": None, "error": str(exc), "wall_seconds": time.perf_counter() - t0}
    curve = doc["methods"][strategy]["curve"]
    agg = [r.get("server_seconds") for r in curve[1:]]
    out = {"acc": [r.get("test_acc") for r in curve], "final": curve[-1].get("test_acc"),
           "wall_seconds": time.perf_counter() - t0, "server_seconds": agg,
           "engine": {k: v for k, v in doc.get("env", {}).items() if k in ("batch_chunk", "batched_fallback")}
           | {"engine": values["engine"]}}
    if strategy == "jgesr":
        for name in DIAGNOSTICS:
            out[name] = [(r.get("server") or {}).get(name) for r in curve[1:]]
    logger.info("%s %s seed %d lr %g c %g r %g%s: acc %.4f", method, task, seed, lr, noise, missing,
                f" graph {values.get('jgesr.lam')}, {values.get('jgesr.alpha')}, {values.get('jgesr.beta')}"
                if strategy == "jgesr" else "", out["final"] or float("nan"))
    return out


def _cell_args(cell: Cell, task: str, form: Form) -> tuple[Any, ...]:
    graph = cell.settings.get("graph")
    return (cell.method, validation_task(task) if cell.split == "val" else task, form, cell.seed,
            cell.settings["lr"], cell.at["noise"], cell.at["missing"], tuple(graph) if graph is not None else None)


def _best(scores: dict[Any, float | None], fallback: Any) -> Any:
    """The key with the highest finite score (the first one on ties), else ``fallback``."""
    finite = {k: v for k, v in scores.items() if v is not None and np.isfinite(v)}
    return max(finite, key=lambda k: finite[k]) if finite else fallback


def tune_graph(form: Form, score: Callable[[tuple[float, float, float]], float | None]) -> dict[str, Any]:
    """JGESR's ``(λ, α, β)``: the point with the best validation accuracy ``score(point)`` (never test).

    ``grid``: every point of ``lam_grid × alpha_grid × beta_grid``. ``coordinate``: λ over
    ``lam_grid`` at ``(α, β)`` = :data:`GRAPH_DEFAULT`'s, then α over ``alpha_grid`` at the best
    λ, then β over ``beta_grid`` at the best ``(λ, α)`` (repeated points come from the cache).
    Highest mean validation accuracy wins; ties keep the earlier point.
    """
    scores: dict[tuple[float, float, float], float | None] = {}
    if form.graph_search == "grid":
        for point in itertools.product(form.lam_grid, form.alpha_grid, form.beta_grid):
            scores[point] = score(point)
        best = _best(scores, GRAPH_DEFAULT)
    elif form.graph_search == "coordinate":
        best = GRAPH_DEFAULT
        for axis, grid in enumerate((form.lam_grid, form.alpha_grid, form.beta_grid)):
            line = {}
            for value in grid:
                lam, alpha, beta = (value if i == axis else best[i] for i in range(3))
                point = (lam, alpha, beta)
                line[point] = scores[point] = score(point)
            best = _best(line, best)
    else:
        raise ValueError(f"Form.graph_search must be 'grid' or 'coordinate', got {form.graph_search!r}")
    lam, alpha, beta = best
    return {"lam": lam, "alpha": alpha, "beta": beta, "search": form.graph_search,
            "validation_acc": [{"lam": p[0], "alpha": p[1], "beta": p[2], "acc": v} for p, v in scores.items()]}


def table_points(form: Form) -> list[dict[str, float]]:
    """The points of the quick and full forms: both noise levels without missing entries, then the
    missing-rate sweep at the first noise level.
    """
    c1, c2 = form.noise_levels
    points = [{"noise": c1, "missing": 0.0}, {"noise": c2, "missing": 0.0}]
    points += [{"noise": c1, "missing": float(r)} for r in form.missing_rates if r != 0.0]
    return points


def regime_points(form: Form) -> list[dict[str, float]]:
    """The points of the regime form: the full cross ``noise_levels × missing_rates`` (noise outer)."""
    return [{"noise": float(c), "missing": float(r)} for c in form.noise_levels for r in form.missing_rates]


def tuning_point(tune_at: str, form: Form) -> Callable[[Mapping[str, Any]], Mapping[str, Any]] | None:
    """Where the validation search of a grid point runs (``Tuning.at``; ``None`` = the point itself).

    ``point``: at every point; ``noise``: at the point's noise level without missing entries;
    ``reference``: at the first noise level without missing entries (the table's rule).
    """
    if tune_at == "point":
        return None
    if tune_at == "noise":
        return lambda p: {"noise": p["noise"], "missing": 0.0}
    if tune_at == "reference":
        c1 = form.noise_levels[0] if 1.0 not in form.noise_levels else 1.0
        return lambda _p: {"noise": c1, "missing": 0.0}
    raise ValueError(f"bench jgesr: tune_at must be one of {list(TUNE_AT)}, got {tune_at!r}")


def _declare(form: Form, seed: int, task: str, *, name: str, title: str, points: list[dict[str, float]],
             at: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None, reference: str | None,
             pairs: list[tuple[str, str]] | None) -> Bench:
    """The bench of either layout: cells, cache keys, tuning (step, then JGESR's graph) and pairs."""

    def refine(method: str, params: dict[str, Any], evaluate: Callable[[dict[str, Any]], float | None]
               ) -> tuple[dict[str, Any], dict[str, Any]]:
        if method not in GRAPH_METHODS:
            return params, {}
        g = tune_graph(form, lambda point: evaluate({**params, "graph": point}))
        return {**params, "graph": (g["lam"], g["alpha"], g["beta"])}, g

    return Bench(
        name=name, title=title, methods=form.methods, points=points,
        seeds=[seed + k for k in range(form.seeds)],
        metrics=(Metric("acc", "accuracy (%)", lower_is_better=False, fmt=".2f", scale=100.0),),
        run_cell=lambda cell: run_one(*_cell_args(cell, task, form)),
        key=lambda cell: {"method": cell.method, **run_values(*_cell_args(cell, task, form))},
        final=lambda r: {"acc": r.get("final")},
        failed=lambda r: r.get("error") or (None if r.get("final") is not None else "no final accuracy"),
        tuning=Tuning(param="lr", grid=form.lr_grid, metric="acc", lower_is_better=False, max_extensions=0,
                      at=at, if_all_fail=form.lr_grid[0], refine=refine),
        reference=reference, pairs=pairs,
        cost=lambda cell: 5.0 if cell.method in GRAPH_METHODS else 1.0)


def declare(form: Form, seed: int, task: str) -> Bench:
    """B7 on the harness: points (noise c, missing rate r), the table's and the sweep's.

    The step of each method is tuned on validation at noise level 1 without missing entries (one
    search for all points, first seed); JGESR's ``(λ, α, β)`` are then tuned at that step
    (:func:`tune_graph`).
    """
    c1 = form.noise_levels[0]
    return _declare(form, seed, task, name=NAME, title=f"B7: JGESR under a noisy, lossy uplink ({task})",
                    points=table_points(form), at=lambda _p: {"noise": c1, "missing": 0.0},
                    reference="FedAvg" if "FedAvg" in form.methods else None, pairs=None)


def regime_pairs(form: Form) -> list[tuple[str, str]]:
    """The paired comparisons of the regime form: each JGESR solver against each of
    :data:`REGIME_REFERENCES`, then Local − FedAvg.
    """
    pairs = [(m, ref) for m in GRAPH_METHODS if m in form.methods for ref in REGIME_REFERENCES
             if ref in form.methods]
    if {"Local", "FedAvg"} <= set(form.methods):
        pairs.append(("Local", "FedAvg"))
    return pairs


def declare_regime(form: Form, seed: int, task: str, tune_at: str = "point") -> Bench:
    """The regime form on the harness: every ``(noise c, missing rate r)`` of the cross, tuned where
    ``tune_at`` says (:func:`tuning_point`), paired against Local and FedAvg (:func:`regime_pairs`).
    """
    return _declare(form, seed, task, name=REGIME_NAME,
                    title=f"B7 regime: JGESR against FedAvg and Local over noise × missing rate ({task})",
                    points=regime_points(form), at=tuning_point(tune_at, form), reference=None,
                    pairs=regime_pairs(form))


DEFAULT_TASK = {"regime": "digits-permuted"}
"""The task a form runs on when none is given (``digits`` for the others): the regime form's
question (when does JGESR beat Local?) needs clients in groups whose tasks conflict."""


def run(quick: bool = False, seed: int = 0, out: Path | None = None, task: str | None = None,
        form: str | None = None) -> dict[str, Any]:
    """Tune and run one form: ``form`` when given (one of :data:`FORMS`), else ``quick`` or ``full``.

    ``quick`` / ``full``: the table and the missing-rate sweep, ``<out>/jgesr.{json,md,png}``;
    ``regime``: :func:`run_regime`, ``<out>/jgesr-regime.{json,md,png}``. ``task`` defaults to
    :data:`DEFAULT_TASK` of the form, else ``digits``.
    """
    name = form if form is not None else ("quick" if quick else "full")
    if name not in FORMS:
        raise ValueError(f"unknown form {name!r} of benchmark {NAME!r}; valid: {', '.join(FORMS)}")
    task = task if task is not None else DEFAULT_TASK.get(name, "digits")
    if task not in TASKS:
        raise ValueError(f"bench jgesr: task {task!r} is not one of {list(TASKS)}")
    if name == "regime":
        return run_regime(seed=seed, out=out, task=task)
    spec = QUICK if name == "quick" else FULL
    unknown = [m for m in spec.methods if m not in METHODS]
    if unknown:
        raise ValueError(f"bench jgesr: unknown methods {unknown}; valid: {list(METHODS)}")
    bench = declare(spec, seed, task)
    outcome = run_bench(bench, out)
    diagnostics: dict[str, dict[str, Any]] = {}
    for level, c in enumerate(spec.noise_levels, start=1):
        for method in spec.methods:
            if method in GRAPH_METHODS:
                runs = outcome.runs[((("noise", c), ("missing", 0.0))), method]
                diagnostics.setdefault(method, {})[f"noise{level}"] = _diagnostics(
                    [r or {} for r in runs], list(bench.seeds))
    config = {"task": task, **{k: list(v) if isinstance(v, tuple) else v for k, v in spec.__dict__.items()},
              "nodes": nodes_for(spec, task), "dirichlet": dirichlet_for(spec, task), "tuning_seed": seed,
              "validation_fraction": VALIDATION_FRACTION}
    doc = build_doc(bench, outcome, name == "quick", config, extra={
        "task": task, "diagnostics": diagnostics, "paper_mnist": PAPER_MNIST, "unspecified": unspecified(spec, task)})
    if out is not None:
        _write(Path(out), doc, spec)
    return doc


def _diagnostics(runs: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """Per-round ``shrink_ratio`` / ``graph_cv`` of each seed's run, their mean per round and a summary."""
    per_seed = [{"seed": s, **{k: r.get(k, []) for k in DIAGNOSTICS}} for s, r in zip(seeds, runs)]
    out: dict[str, Any] = {"runs": per_seed}
    for key in DIAGNOSTICS:
        rows = [[v for v in r[key]] for r in per_seed if r[key]]
        if not rows:
            out[key] = {"mean_per_round": [], "last": None, "min": None}
            continue
        width = min(len(x) for x in rows)
        arr = np.array([[np.nan if v is None else v for v in x[:width]] for x in rows], dtype=float)
        per_round = [None if np.all(np.isnan(col)) else float(np.nanmean(col)) for col in arr.T]
        finite = arr[np.isfinite(arr)]
        out[key] = {"mean_per_round": per_round, "last": per_round[-1] if per_round else None,
                    "min": float(finite.min()) if finite.size else None}
    return out


def _pct(stat: dict[str, Any]) -> str:
    return fmt_pm(stat, ".2f", scale=100.0)


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _write(out: Path, doc: dict[str, Any], form: Form) -> None:
    c1, c2 = form.noise_levels
    rows = []
    for method in form.methods:
        paper = PAPER_MNIST.get(method, (None, None))
        params = result(doc, method, noise=c1, missing=0.0)["params"]
        g = params.get("graph")
        rows.append({"method": method, "lr": params["lr"],
                     "(λ, α, β)": f"({g[0]:g}, {g[1]:g}, {g[2]:g})" if g else "",
                     f"c={c1}": _pct(result(doc, method, noise=c1, missing=0.0)["metrics"]["acc"]),
                     f"c={c2}": _pct(result(doc, method, noise=c2, missing=0.0)["metrics"]["acc"]),
                     "paper MNIST n1": paper[0], "paper MNIST n2": paper[1]})
    sweep_rows = [{"method": method, **{f"r={r}": _pct(result(doc, method, noise=c1, missing=float(r))["metrics"]["acc"])
                                        for r in form.missing_rates}} for method in form.methods]
    diag_rows = []
    for method, levels in doc["diagnostics"].items():
        for level, d in levels.items():
            diag_rows.append({"method": method, "c": form.noise_levels[int(level.removeprefix("noise")) - 1],
                              "graph_cv last": _num(d["graph_cv"]["last"]), "graph_cv min": _num(d["graph_cv"]["min"]),
                              "shrink_ratio last": _num(d["shrink_ratio"]["last"]),
                              "shrink_ratio min": _num(d["shrink_ratio"]["min"])})
    intro = [f"Mean client test accuracy (%) after {form.rounds} rounds, mean ± sd over {form.seeds} seeds; uploads "
             "through the noisy channel (noise c, missing rate r). The step (and JGESR's (λ, α, β)) of each method "
             f"is tuned on validation at c = {c1}, r = 0."]
    sections = ["## As the paper's Table 1 (no missing entries)", "",
                "The paper's MNIST numbers are shown for reference only (other task, other settings).", "",
                markdown_table(rows, list(rows[0])), "",
                f"## Missing-rate sweep (noise c = {c1})", "", markdown_table(sweep_rows, list(sweep_rows[0])), ""]
    if diag_rows:
        sections += ["## JGESR collapse diagnostics (ALGORITHMS.md §0.1 C4)", "",
                     "Per round of each test run: `graph_cv` = coefficient of variation of the learned graph's "
                     "off-diagonal weights (0 = uniform graph), `shrink_ratio` = ‖ψ − ȳ‖/‖y − ȳ‖ (0 = every client "
                     "gets the mean, i.e. FedAvg). Last round (mean over seeds) and minimum over rounds and seeds; "
                     "every round is in the JSON (`diagnostics`).", "",
                     markdown_table(diag_rows, list(diag_rows[0])), ""]
    sections += ["## Settings not given by the paper", ""] + [f"- {s}" for s in doc["unspecified"]]
    panels = metric_panels(doc, "acc", "noise", where={"missing": 0.0}, xlabel="noise level c (sigma = c mean|theta0|)",
                           ylabel="mean client test accuracy", title=f"{doc['task']}, no missing entries")
    if len(form.missing_rates) > 1:
        panels += metric_panels(doc, "acc", "missing", where={"noise": c1}, xlabel="missing rate r",
                                ylabel="mean client test accuracy", title=f"{doc['task']}, noise c = {c1}")
    for key in DIAGNOSTICS:
        curves = {f"{m} c={form.noise_levels[int(lv.removeprefix('noise')) - 1]}":
                  [{"round": i + 1, key: v} for i, v in enumerate(d[key]["mean_per_round"])]
                  for m, levels in doc["diagnostics"].items() for lv, d in levels.items()}
        if any(curves.values()):
            panels.append({"x": "round", "y": key, "series": curves, "xlabel": "round",
                           "ylabel": f"{key} (mean over seeds)", "title": f"JGESR {key} per round"})
    write_report(out, doc, intro=intro, sections=sections, panels=panels,
                 plot_title="JGESR vs baselines under a noisy, lossy uplink")


def regime_unspecified(form: Form, task: str, tune_at: str) -> list[str]:
    """:func:`unspecified` with the regime form's tuning, channel grid and comparisons."""
    lines = unspecified(form, task)
    where = {"point": "at every (c, r) point", "noise": "at each noise level c without missing entries",
             "reference": "at c = 1 without missing entries, one search for all points"}[tune_at]
    lines[2] = (f"step size per method from {list(form.lr_grid)} on validation ({VALIDATION_FRACTION:.0%} of each "
                f"client's training data, first seed) {where}, by mean validation accuracy (JGESR at (lambda, alpha, "
                f"beta) = {GRAPH_DEFAULT}); then JGESR's (lambda, alpha, beta) on the same validation runs")
    lines[4] = (f"noise levels c = {list(form.noise_levels)} with sigma = c * mean|theta^0| of the common initial "
                "model (seed 002), one sigma for the run; c = 0 is a noiseless channel (and c = r = 0 no channel)")
    lines[5] = (f"missing rates {list(form.missing_rates)} at every noise level (the full cross); lost entries are "
                "0 + noise on the wire, their mask reaches the server (only JGESR uses it)")
    lines.append(f"paired per-seed differences of each JGESR solver against {', '.join(REGIME_REFERENCES)}; "
                 f"verdict band {TIE_BAND * 100:g} accuracy point; Local is the trivial baseline (no constant "
                 "predictor in this bench; Local never crosses the channel)")
    return lines


def verdict(paired: dict[str, Any], expected: int) -> dict[str, Any]:
    """A JGESR solver against a reference from the paired per-seed accuracy differences ``a − b``.

    ``wins``: higher on every expected seed and the mean difference above :data:`TIE_BAND`;
    ``loses``: lower on every expected seed (or no finite accuracy on some seed) and the mean
    below ``−TIE_BAND``; ``not testable`` when the reference is missing on some seed; else ``tie``.
    Per-seed counts: ``won`` (d > 0), ``tied`` (d = 0), ``lost`` (d < 0).
    """
    diffs = list(paired.get("per_seed") or [])
    won, lost = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    mean = paired.get("mean")
    if paired.get("first_nonfinite"):
        word = "loses"
    elif paired.get("missing") or paired.get("second_nonfinite") or mean is None or len(diffs) < expected:
        word = "not testable"
    elif won == expected and mean > TIE_BAND:
        word = "wins"
    elif lost == expected and mean < -TIE_BAND:
        word = "loses"
    else:
        word = "tie"
    return {"verdict": word, "mean": mean, "sd": paired.get("sd"), "won": won, "tied": len(diffs) - won - lost,
            "lost": lost, "seeds": len(diffs), "expected": expected, "per_seed": diffs}


def collapse_flags(diag: dict[str, Any]) -> list[str]:
    """Why a point's last-round diagnostics (mean over seeds) count as a collapse: a near-uniform
    graph (``graph_cv`` < :data:`COLLAPSE_CV`) and/or ψ near the mean (``shrink_ratio`` < :data:`COLLAPSE_SHRINK`).
    """
    flags = []
    cv, shrink = diag["graph_cv"]["last"], diag["shrink_ratio"]["last"]
    if cv is not None and cv < COLLAPSE_CV:
        flags.append(f"graph_cv {cv:.3f} < {COLLAPSE_CV:g}")
    if shrink is not None and shrink < COLLAPSE_SHRINK:
        flags.append(f"shrink_ratio {shrink:.3f} < {COLLAPSE_SHRINK:g}")
    return flags


def run_regime(seed: int = 0, out: Path | None = None, task: str = "digits-permuted",
               tune_at: str = REGIME_TUNE_AT, form: Form | None = None) -> dict[str, Any]:
    """The regime form: JGESR against FedAvg and Local over noise × missing rate.

    Every point of :func:`regime_points` runs every method on ``form.seeds`` seeds at the values
    tuned on validation where ``tune_at`` says; the document adds per point JGESR's collapse
    diagnostics (``diagnostics[method]["c=…, r=…"]``, with :func:`collapse_flags`) and the verdicts of
    each solver against Local and FedAvg (:func:`verdict`). Writes ``<out>/jgesr-regime.{json,md,png}``.
    """
    spec = REGIME if form is None else form
    if task not in TASKS:
        raise ValueError(f"bench jgesr: task {task!r} is not one of {list(TASKS)}")
    unknown = [m for m in spec.methods if m not in METHODS]
    if unknown:
        raise ValueError(f"bench jgesr: unknown methods {unknown}; valid: {list(METHODS)}")
    bench = declare_regime(spec, seed, task, tune_at)
    outcome = run_bench(bench, out)
    diagnostics: dict[str, dict[str, Any]] = {}
    for point in bench.points:
        label = _point_label(point)
        for method in spec.methods:
            if method in GRAPH_METHODS:
                runs = outcome.runs[(tuple(point.items()), method)]
                d = _diagnostics([r or {} for r in runs], list(bench.seeds))
                d["collapse"] = collapse_flags(d)
                diagnostics.setdefault(method, {})[label] = d
    config = {"task": task, "form": "regime", "tune_at": tune_at,
              **{k: list(v) if isinstance(v, tuple) else v for k, v in spec.__dict__.items()},
              "nodes": nodes_for(spec, task), "dirichlet": dirichlet_for(spec, task), "tuning_seed": seed,
              "validation_fraction": VALIDATION_FRACTION, "tie_band": TIE_BAND, "collapse_cv": COLLAPSE_CV,
              "collapse_shrink": COLLAPSE_SHRINK}
    doc = build_doc(bench, outcome, True, config, extra={
        "task": task, "diagnostics": diagnostics, "unspecified": regime_unspecified(spec, task, tune_at)})
    doc["verdicts"] = [{"point": p["point"], "a": p["a"], "b": p["b"],
                        **verdict(p["metrics"]["acc"], spec.seeds)} for p in doc["paired"]]
    if out is not None:
        _write_regime(Path(out), doc, spec)
    return doc


def _point_label(point: Mapping[str, Any]) -> str:
    return f"c={point['noise']:g}, r={point['missing']:g}"


def _write_regime(out: Path, doc: dict[str, Any], form: Form) -> None:
    graph = [m for m in GRAPH_METHODS if m in form.methods]
    acc_rows, verdict_rows, diag_rows, tuned_rows = [], [], [], []
    for point in doc["config"]["points"]:
        c, r = point["noise"], point["missing"]
        acc_rows.append({"c": f"{c:g}", "r": f"{r:g}", **{m: _pct(result(doc, m, **point)["metrics"]["acc"])
                                                          for m in form.methods}})
        row: dict[str, Any] = {"c": f"{c:g}", "r": f"{r:g}"}
        for v in doc["verdicts"]:
            if v["point"] == point:
                mean = "–" if v["mean"] is None else f"{v['mean'] * 100:+.2f}"
                sd = "" if v["sd"] is None else f" ± {v['sd'] * 100:.2f}"
                row[f"{v['a']} − {v['b']}"] = (f"{mean}{sd} ({v['won']}/{v['tied']}/{v['lost']}): {v['verdict']}")
        verdict_rows.append(row)
        for m in form.methods:
            params = result(doc, m, **point)["params"]
            g = params.get("graph")
            tuned_rows.append({"c": f"{c:g}", "r": f"{r:g}", "method": m, "lr": params.get("lr"),
                               "(λ, α, β)": f"({g[0]:g}, {g[1]:g}, {g[2]:g})" if g else ""})
        for m in graph:
            d = doc["diagnostics"][m][_point_label(point)]
            diag_rows.append({"c": f"{c:g}", "r": f"{r:g}", "method": m,
                              "graph_cv last": _num(d["graph_cv"]["last"]), "graph_cv min": _num(d["graph_cv"]["min"]),
                              "shrink_ratio last": _num(d["shrink_ratio"]["last"]),
                              "shrink_ratio min": _num(d["shrink_ratio"]["min"]),
                              "collapse (last round)": "; ".join(d["collapse"]) or "no"})
    where = {"point": "at every (c, r) point", "noise": "at each noise level c (r = 0)",
             "reference": "at c = 1, r = 0 (one search for all points)"}[doc["config"]["tune_at"]]
    intro = [f"Mean client test accuracy (%) after {form.rounds} rounds, mean ± sd over {form.seeds} seeds; uploads "
             "through the noisy channel (noise c: sigma = c·mean|θ⁰|; missing rate r). Every method's step and "
             f"JGESR's (λ, α, β) are tuned on validation {where}, never on test. Local is the trivial baseline "
             "(it never crosses the channel; the bench has no constant predictor)."]
    sections = ["## Accuracy per point (%)", "", markdown_table(acc_rows, list(acc_rows[0])), "",
                "## JGESR against Local and FedAvg (paired per seed)", "",
                f"Mean ± sd of the per-seed difference in accuracy points, (won/tied/lost seeds), verdict: `wins` = "
                f"higher on every seed and mean > {TIE_BAND * 100:g} point; `loses` = the reverse; else `tie`.", "",
                markdown_table(verdict_rows, list(verdict_rows[0])), "",
                "## Tuned values per point (validation)", "", markdown_table(tuned_rows, list(tuned_rows[0])), ""]
    if diag_rows:
        sections += ["## JGESR collapse diagnostics per point (ALGORITHMS.md §0.1 C4)", "",
                     "`graph_cv` = coefficient of variation of the learned graph's off-diagonal weights (0 = uniform); "
                     "`shrink_ratio` = ‖ψ − ȳ‖/‖y − ȳ‖ (0 = every client gets the mean, i.e. FedAvg). Last round "
                     "(mean over seeds) and minimum over rounds and seeds; collapse when the last round has "
                     f"graph_cv < {COLLAPSE_CV:g} or shrink_ratio < {COLLAPSE_SHRINK:g}. Every round is in the JSON.",
                     "", markdown_table(diag_rows, list(diag_rows[0])), ""]
    sections += ["## Settings not given by the paper", ""] + [f"- {s}" for s in doc["unspecified"]]
    panels = metric_panels(doc, "acc", "noise", panel_axis="missing", xlabel="noise level c (sigma = c mean|theta0|)",
                           ylabel="mean client test accuracy", title="missing rate r")
    for key in DIAGNOSTICS:
        series = {f"{m} r={r:g}": [{"noise": p["noise"], key: doc["diagnostics"][m][_point_label(p)][key]["last"]}
                                   for p in doc["config"]["points"] if p["missing"] == r
                                   and doc["diagnostics"][m][_point_label(p)][key]["last"] is not None]
                  for m in graph for r in form.missing_rates}
        if any(series.values()):
            panels.append({"x": "noise", "y": key, "series": series, "xlabel": "noise level c",
                           "ylabel": f"{key}, last round (mean over seeds)", "title": f"JGESR {key}"})
    write_report(out, doc, intro=intro, sections=sections, panels=panels,
                 plot_title=f"JGESR vs FedAvg and Local over noise × missing rate ({doc['task']})")
