"""Benchmark ``multicenter-regime``: where FeSEM beats FedAvg and local training (seed 000 Fig. 10.3).

At the paper's setting (50 clients, 100 samples each) every client has enough data to fit its own
8×8 linear map, so local training beats one model per cluster. This sweep varies the conditions
that decide the ranking on ``synthetic-multicenter`` (the mixture generator: client i's ground
truth is its mixture sample, 3 planted clusters; :class:`graphfl.tasks.synthetic.SyntheticMulticenter`):

* ``samples``: training rows per client (``data.client-samples``; the test rows stay 100) — few
  rows is where pooling a cluster's clients should beat local training;
* ``std``: the standard deviation of each mixture component (``data.cluster-std``; the paper's
  0.5). The centers are ``U[-0.5, 0.5]^64``: per coordinate the spread between clusters has
  variance 1/12 (sd ≈ 0.29), the spread inside a cluster ``std²``, so the share of a client's
  ground-truth variance one model per cluster explains is about ``(1/12) / (1/12 + std²)``
  (std 0.05: 97 %, 0.15: 79 %, 0.5: 25 %): a small ``std`` gives tight, separated clusters, the
  paper's 0.5 already overlapping ones;
* ``nodes``: the number of clients (the form's ``nodes``);
* ``rounds``: the training budget, the same for every method at a point (the form's ``rounds``;
  the points of :attr:`Form.long` also at ``long_rounds``). The data are noise-free, so a client
  with at least 8 rows determines its own 8×8 map and Local's error keeps falling with rounds,
  while one model per cluster stops at the within-cluster spread: the budget decides the
  ranking where both are close.

Methods: FedAvg (one global model), Local (no aggregation), FeSEM (``K`` = 3, the planted number,
not tuned; its warm-up length tuned), and two constant predictors, no training: ``Const-own``
predicts each client's own training mean of ``y``, ``Const-pooled`` the mean over all clients'
training rows. DFL is left out: the multicenter DFL runner builds its p2p oracles from the task
name alone (:class:`graphfl.p2p.oracles.ProblemSpec` carries no ``data.*`` settings), so the
knobs of this sweep would not reach its data.

Fairness: plain SGD (momentum 0), the same local steps, batch and rounds for every method, the
batched engine; per grid point the step of *each method* is chosen from :attr:`Form.lr_grid` on
the validation view of the task (:func:`graphfl.tasks.holdout.validation_task`: 20 % of each
client's training rows, first seed; never the test split) by the mean validation MSE after the
last round, then FeSEM's warm-up length over :attr:`Form.fesem_warmups` at its step.

Metric: the mean over clients of the test MSE of the model each client is given after the last
round (its own for Local, the global one for FedAvg, its cluster center for FeSEM; FeSEM's last
local model is kept as a diagnostic), mean ± sd over seeds, paired per-seed differences of every
method against FedAvg and against Local. Verdict per grid point and reference
(:func:`verdict`): ``FeSEM wins`` when FeSEM's MSE is lower on every expected seed
(:func:`~graphfl.bench.stats.first_better_on_every_seed`) and the mean difference exceeds
:data:`TIE_BAND` of the reference's mean; ``FeSEM loses`` symmetrically, or when FeSEM has no
finite result on a seed; ``not testable`` when the reference has none on a seed or a seed is
missing; ``tie`` otherwise.

Diagnostics (per test run, last round): FeSEM's adjusted Rand index against the planted clusters,
its non-empty clusters and sizes (a FeSEM that collapsed to one cluster shows ARI ≈ 0 and one
non-empty cluster), its clients' last local models' test MSE.

Declared on the harness (:mod:`graphfl.bench.harness`): every run goes through the run cache in
``<out>/cache`` (an interrupted sweep resumes), the time estimate is logged; results in
``<out>/multicenter-regime.{json,md,png}``.

**BiG-FL form** (``--form bigfl``, :data:`FORMS`; opt-in, the default forms and their cache keys
do not change): BiG-FL (strategy ``bigfl``, ALGORITHMS.md §0.1 C2) beside the other methods at a
reduced point set (:data:`BIGFL_FORM`), results in ``<out>/multicenter-regime-bigfl.*``. Its
graph is the task's client graph: the 4-NN graph (symmetrised by union) of the clients' mixture
samples, i.e. of their true task vectors (an oracle graph). Its settings (:class:`BigflSpec`):
α fixed (not tuned per point); at λ = :attr:`BigflSpec.base_lam` the step by the form's search at
κ = :attr:`BigflSpec.kappa` (a step outside :attr:`BigflSpec.steps` is not run: "skipped"), each
further κ with its best step of the form's grid (:func:`refine_bigfl`), then λ from
:attr:`BigflSpec.lambdas` (all > 0, :func:`~graphfl.bench.multicenter.check_bigfl_grid`) at the
best (κ, step) pair, then κ beyond a winning edge of the κ grid at that λ (kept only when it
lowers the validation MSE), on the same validation view, seed and budget as the other methods. A validation
run whose lower level is not strongly convex in some round is stopped there and excluded
(:func:`~graphfl.bench.multicenter.tuning_stop_rule`, :func:`~graphfl.bench.multicenter.bigfl_inadmissible`);
with no admissible setting the test cells are not run. Per test run the final ``‖φ − I‖_F``
(server metric ``phi_minus_identity``) is kept; a run below
:data:`~graphfl.bench.multicenter.PHI_MOVED` is flagged degenerate (φ did not move) in the result
and the log. BiG-FL is compared per seed with FedAvg, Local and FeSEM (:func:`verdict`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.common.results import markdown_table
from graphfl.tasks.holdout import VALIDATION_FRACTION, validation_task

from .harness import Bench, Cell, Metric, Tuning, run_bench, run_inprocess
from .report import build_doc, metric_panels, pair, result, write_report
from .stats import first_better_on_every_seed, fmt_pm, mean_sd, paired_difference
from .tuning import search_grid

logger = logging.getLogger(__name__)

NAME = "multicenter-regime"
BIGFL_NAME = "multicenter-regime-bigfl"
"""The name (and result files) of the BiG-FL form; its cells share :data:`NAME`'s cache keys."""
BIGFL = "BiG-FL"
BIGFL_REFERENCES = ("FedAvg", "Local", "FeSEM")
"""BiG-FL is compared, per seed, with each of these."""
TASK = "synthetic-multicenter"
TRAINED: dict[str, str] = {"FedAvg": "fedavg", "Local": "local", "FeSEM": "fesem"}
CONSTANTS = ("Const-own", "Const-pooled")
"""Constant predictors (no training): each client's own training mean of ``y``; the pooled mean."""
METHODS = (*TRAINED, *CONSTANTS)
REFERENCES = ("FedAvg", "Local")
"""Every method is compared, per seed, with each of these."""
FESEM_K = 3
"""FeSEM's number of centers: the planted number of clusters (not tuned)."""
FESEM_DEFAULT_WARMUP = 200
TRAIN = {"train.momentum": 0.0, "train.local-steps": 10, "train.batch-size": 20}
"""The local optimiser of every method (bench multicenter's)."""
TIE_BAND = 0.02
"""Relative band of the reference's mean test MSE inside which a mean difference is a tie."""
RESUMABLE = True
"""An interrupted sweep continues in the same ``--out`` (finished runs come from ``<out>/cache``)."""


@dataclass(frozen=True)
class Form:
    """What ``--quick`` and the full form run."""

    rounds: int
    seeds: int
    samples: tuple[int, ...]
    stds: tuple[float, ...]
    nodes: tuple[int, ...] = (50,)
    lr_grid: tuple[float, ...] = (0.3, 1.0, 3.0)
    fesem_warmups: tuple[int, ...] = (10, FESEM_DEFAULT_WARMUP)
    methods: tuple[str, ...] = METHODS
    engine: str = "batched"
    long_rounds: int = 0
    """Rounds of the points in :attr:`long` (0: none)."""
    long: tuple[tuple[int, int, float], ...] = ()
    """``(nodes, samples, std)`` points run again with :attr:`long_rounds` rounds (tuned again there)."""
    cut: tuple[str, ...] = ()
    """What this form leaves out for time (written in the result)."""


FULL = Form(rounds=50, seeds=3, samples=(5, 10, 20, 100), stds=(0.05, 0.15, 0.5), nodes=(50, 20),
            long_rounds=200, long=tuple((50, m, s) for s in (0.05, 0.15) for m in (5, 20, 100)),
            cut=("the smooth generator (synthetic-multicenter-smooth)", "FeSEM's K (fixed at the planted 3)",
                 "DFL (module docstring)", "200 rounds only at 50 clients, std 0.05 / 0.15, samples 5 / 20 / 100 "
                 "(bench multicenter-full runs 200 rounds at the paper's std 0.5, 100 samples)"))
QUICK = Form(rounds=15, seeds=3, samples=(10, 100), stds=(0.05, 0.5), lr_grid=(1.0, 3.0), fesem_warmups=(10,),
             cut=("most of the grid (quick form)",))


@dataclass(frozen=True)
class BigflSpec:
    """BiG-FL's settings in the BiG-FL form (module docstring)."""

    steps: tuple[float, ...] = (0.1, 0.3, 1.0, 3.0, 9.0)
    """The steps BiG-FL may run: the search is the form's (``lr_grid``, a winning edge extended once);
    a value outside these is skipped for BiG-FL (the default: the full form's grid and its extensions,
    so BiG-FL's step search is the other methods')."""
    lambdas: tuple[float, ...] = (0.01, 0.1, 1.0, 10.0)
    """λ grid (one λ for both levels), tuned at the chosen step; every value > 0."""
    base_lam: float = 0.1
    """λ of the step search (a value of :attr:`lambdas`)."""
    kappa: float = 0.3
    """LL ridge weight κ of the step search (bench multicenter's validation choice at 50 clients, 200 rounds)."""
    other_kappas: tuple[float, ...] = (0.1,)
    """Further κ tried on validation, each with its best step of the form's ``lr_grid`` (not extended),
    at λ = :attr:`base_lam`; the best admissible (κ, step) pair is kept for the λ search."""
    alpha: float = 0.005
    """Normalised UL step length α, fixed (bench multicenter's validation choice)."""
    lambda_extensions: int = 2
    """λ tried beyond a winning edge of :attr:`lambdas` (÷ or × 10, :func:`~graphfl.bench.tuning.search_grid`)."""
    kappa_extensions: int = 1
    """κ tried beyond the chosen κ when it is an edge of the κ grid (:attr:`kappa` and
    :attr:`other_kappas`; ÷ or × 3), after λ's search and at the chosen λ, each with its best step of
    the form's ``lr_grid`` (:func:`refine_bigfl`)."""
    seconds_per_round: float = 1.0
    """Measured seconds per BiG-FL round at 20 clients on one core (the time estimate)."""

    def __post_init__(self) -> None:
        from .multicenter import check_bigfl_grid

        check_bigfl_grid(self.lambdas)
        if self.base_lam not in self.lambdas:
            raise ValueError(f"BigflSpec: base_lam {self.base_lam} is not in lambdas {list(self.lambdas)}")


BIGFL_FORM = Form(rounds=50, seeds=3, samples=(5, 10, 20, 100), stds=(0.05, 0.15, 0.5), nodes=(20,),
                  cut=("the smooth generator (synthetic-multicenter-smooth)", "FeSEM's K (fixed at the planted 3)",
                       "DFL (module docstring)", "BiG-FL's alpha (fixed, not tuned per point)",
                       "50 clients and 200 rounds (BiG-FL's cost)"))
"""The BiG-FL form's points: 20 clients, 50 rounds, m ∈ {5, 10, 20, 100} × std ∈ {0.05, 0.15, 0.5} (run
in the order of :func:`bigfl_points`); the other methods' grids are :data:`FULL`'s, so their cells are
those of the full form's run cache."""
BIGFL_FIRST = ((5, 0.05), (5, 0.5), (100, 0.05), (100, 0.5))
"""``(samples, std)`` points the BiG-FL form runs first (few rows / many rows × tight / the paper's spread)."""
FORMS: dict[str, tuple[Form, BigflSpec]] = {"bigfl": (BIGFL_FORM, BigflSpec())}
"""Named forms (``--form``): the form and BiG-FL's settings."""
SECONDS_PER_ROUND = {"FedAvg": 0.1, "FeSEM": 0.1, "Local": 0.05}
"""Declared seconds per round of the other methods in the BiG-FL form (its time estimate)."""


def bigfl_points(form: Form) -> list[dict[str, Any]]:
    """The form's points, those of :data:`BIGFL_FIRST` first (an interrupted run has the corners)."""
    pts = points(form)

    def rank(p: dict[str, Any]) -> int:
        at = (int(p["samples"]), float(p["std"]))
        return BIGFL_FIRST.index(at) if at in BIGFL_FIRST else len(BIGFL_FIRST)

    return sorted(pts, key=rank)  # stable: the rest in the form's order


def methods_of(form: Form, bigfl: BigflSpec | None) -> tuple[str, ...]:
    """The methods run: the form's, and BiG-FL last when ``bigfl`` is given."""
    return (*form.methods, BIGFL) if bigfl is not None else form.methods


def points(form: Form) -> list[dict[str, Any]]:
    """The grid: clients × samples per client × component std at ``rounds``, then the :attr:`Form.long` points."""
    base = [{"nodes": int(n), "samples": int(m), "std": float(s), "rounds": form.rounds}
            for n in form.nodes for m in form.samples for s in form.stds]
    long = [{"nodes": int(n), "samples": int(m), "std": float(s), "rounds": form.long_rounds}
            for n, m, s in form.long] if form.long_rounds else []
    return base + long


def run_values(method: str, task: str, form: Form, seed: int, point: dict[str, Any], params: dict[str, Any],
               bigfl: BigflSpec | None = None) -> dict[str, Any]:
    """The run configuration of one run (``params``: ``lr``, FeSEM's ``warmup``, BiG-FL's ``lam``).

    Constant predictors have no step (their key carries none, so every tuning value shares one
    cache entry). BiG-FL's λ defaults to :attr:`BigflSpec.base_lam` (the step search's).
    """
    values: dict[str, Any] = {"task": task, "nodes": int(point["nodes"]), "seed": seed,
                              "data.client-samples": int(point["samples"]), "data.cluster-std": float(point["std"])}
    if method in CONSTANTS:
        return {"strategy": method, **values}
    if method == BIGFL:
        spec = bigfl or BigflSpec()
        values.update({"strategy": "bigfl", "rounds": int(point.get("rounds", form.rounds)), "engine": form.engine,
                       "train.lr": float(params["lr"]), **TRAIN, "bigfl.kappa": float(params.get("kappa", spec.kappa)),
                       "bigfl.lam": float(params.get("lam", spec.base_lam)), "bigfl.alpha": float(spec.alpha)})
        return values
    strategy = TRAINED[method]
    values.update({"strategy": strategy, "rounds": int(point.get("rounds", form.rounds)), "engine": form.engine,
                   "train.lr": float(params["lr"]), **TRAIN})
    if strategy == "fesem":
        values.update({"fesem.k": FESEM_K, "fesem.warmup-steps": int(params.get("warmup", FESEM_DEFAULT_WARMUP))})
    return values


def _task(task: str, point: dict[str, Any], seed: int) -> Any:
    from graphfl.common.config import parse_run_config
    from graphfl.tasks import registry as tasks

    cfg = parse_run_config({"strategy": "fedavg", "task": task, "nodes": int(point["nodes"]), "seed": seed,
                            "engine": "inprocess", "data.client-samples": int(point["samples"]),
                            "data.cluster-std": float(point["std"])})
    return tasks.create(cfg.task, data=cfg.data, data_dir=cfg.data_dir, seed=seed)


def constant_mse(method: str, task: str, seed: int, point: dict[str, Any]) -> dict[str, Any]:
    """Mean over clients of a constant predictor's test MSE (over a client's test rows and outputs).

    The clients' data are those of the trained runs with the same seed and point; the constant
    is computed on training rows only.
    """
    n = int(point["nodes"])
    t = _task(task, point, seed)
    data = [t.client_data(p, n) for p in range(n)]
    pooled = np.concatenate([np.asarray(d.y_train, np.float64) for d in data]).mean(axis=0)
    mses = []
    for d in data:
        y = np.asarray(d.y_test, np.float64)
        c = np.asarray(d.y_train, np.float64).mean(axis=0) if method == "Const-own" else pooled
        mses.append(float(np.mean((y - c) ** 2)))
    return {"final": float(np.mean(mses)), "clients": n}


BIGFL_SERVER_KEYS = ("phi_minus_identity", "hypergrad_norm", "implicit_residual", "implicit_converged",
                     "ll_min_curvature", "ll_strongly_convex")
"""The server metrics of a BiG-FL run kept per round in its result."""


def bigfl_result(run: dict[str, Any], validation: bool) -> dict[str, Any]:
    """A BiG-FL cell's result from a :func:`~graphfl.bench.multicenter.run_method` record.

    Keeps the final test MSE, the MSE curve and per round :data:`BIGFL_SERVER_KEYS`. A run whose
    lower level was not strongly convex in some round
    (:func:`~graphfl.bench.multicenter.bigfl_inadmissible`) is ``excluded`` when ``validation``
    (a failed cell: the tuning never chooses it); a test run keeps its MSE and carries the
    reason in ``diag.inadmissible``. ``diag.phi_minus_identity`` is the last round's ``‖φ − I‖_F``.
    """
    from .multicenter import bigfl_inadmissible, implicit_unconverged_rounds

    curve = run.get("curve") or []
    slim = [{"round": row.get("round"), "server": {k: (row.get("server") or {}).get(k) for k in BIGFL_SERVER_KEYS}}
            for row in curve]
    why = bigfl_inadmissible(run)
    last = curve[-1] if curve else {}
    final = last.get("test_loss")
    phi = (last.get("server") or {}).get("phi_minus_identity")
    out: dict[str, Any] = {
        "final": float(final) if final is not None and np.isfinite(final) else None,
        "mse": [r.get("test_loss") for r in curve], "curve": slim,
        "diag": {"phi_minus_identity": None if phi is None else float(phi), "inadmissible": why,
                 "stopped_early": run.get("stopped_early"),
                 "implicit_unconverged_rounds": implicit_unconverged_rounds(run)},
        "wall_seconds": run.get("wall_seconds")}
    if out["final"] is None:
        out["error"] = f"final test MSE {final}"
    if why is not None and validation:
        out["excluded"] = why
    return out


def run_bigfl(values: dict[str, Any]) -> dict[str, Any]:
    """One BiG-FL run of the flat configuration ``values`` (:func:`~graphfl.bench.multicenter.run_method`).

    On a validation task the round loop stops after the first round whose lower level is not
    strongly convex (:func:`~graphfl.bench.multicenter.tuning_stop_rule`). A run the round loop
    stops for non-finite uploads is a failed setting (``final = None``, ``error``), not a crash.
    """
    from graphfl.server.rounds import RunError

    from .multicenter import run_method, tuning_stop_rule

    v = dict(values)
    strategy, task = v.pop("strategy"), v.pop("task")
    nodes, rounds, seed = int(v.pop("nodes")), int(v.pop("rounds")), int(v.pop("seed"))
    try:
        run = run_method(strategy, task, nodes, rounds, seed, v, stop_when=tuning_stop_rule(strategy, task))
    except (RunError, ArithmeticError) as exc:
        logger.warning("BiG-FL %s seed %d diverged: %s", task, seed, exc)
        return {"final": None, "error": str(exc)}
    run.pop("phi", None)  # a tensor; the result keeps its distance to I per round
    return bigfl_result(run, validation=task != TASK)


def run_one(method: str, task: str, form: Form, seed: int, point: dict[str, Any], params: dict[str, Any],
            bigfl: BigflSpec | None = None) -> dict[str, Any]:
    """One run of ``method``: final mean client test MSE, its curve and FeSEM's / BiG-FL's diagnostics.

    A run that fails (non-finite uploads at a too large step) returns ``final = None`` and
    ``error``: a failed setting, not a crash.
    """
    if method in CONSTANTS:
        return constant_mse(method, task, seed, point)
    if method == BIGFL:
        res = run_bigfl(run_values(method, task, form, seed, point, params, bigfl))
        diag = res.get("diag") or {}
        logger.info("%s %s seed %d %s: test MSE %s, ||phi - I||_F %s%s", method, point, seed, params, res.get("final"),
                    diag.get("phi_minus_identity"), f" ({res['excluded']})" if res.get("excluded") else "")
        return res
    import torch

    torch.set_num_threads(1)
    values = run_values(method, task, form, seed, point, params)
    strategy = values["strategy"]
    curve, run = run_inprocess(values, f"{method} {task} seed {seed} {params}")
    if curve is None:
        return run
    last = curve[-1]
    final = last.get("test_loss")
    if final is None or not np.isfinite(final):
        return {"final": None, "error": f"final test MSE {final}", **run}
    out: dict[str, Any] = {"final": float(final), "mse": [r.get("test_loss") for r in curve], **run}
    if strategy == "fesem":
        server = last.get("server") or {}
        sizes = server.get("cluster_sizes")
        out["diag"] = {"cluster_sizes": sizes, "nonempty": int(sum(1 for s in sizes or [] if s > 0)),
                       "ari": server.get("ari"), "local_mse": last.get("local_test_loss")}
        if server.get("ari") is not None and server["ari"] < 0.5:
            logger.warning("FeSEM %s seed %d %s: ARI %.3f against the planted clusters (sizes %s): its clusters "
                           "are not the planted ones", task, seed, point, server["ari"], sizes)
    logger.info("%s %s seed %d %s: test MSE %.4g", method, point, seed, params, out["final"])
    return out


def _task_of(cell: Cell) -> str:
    return validation_task(TASK) if cell.split == "val" else TASK


def _args(cell: Cell, form: Form, bigfl: BigflSpec | None = None) -> tuple[Any, ...]:
    return cell.method, _task_of(cell), form, cell.seed, cell.at, cell.settings, bigfl


NO_ADMISSIBLE = "no admissible BiG-FL setting on validation"


def refine_for(form: Form, bigfl: BigflSpec | None = None
               ) -> Callable[[str, dict[str, Any], Callable[[dict[str, Any]], float | None]],
                             tuple[dict[str, Any], dict[str, Any]]]:
    """The second tuning stage (validation only): FeSEM's warm-up length at its tuned step; BiG-FL's
    κ, step and λ by :func:`refine_bigfl` (an excluded or failed setting is not eligible; with
    none eligible ``lam`` is ``None`` and the test cells are not run).
    """

    def refine(method: str, params: dict[str, Any], evaluate: Callable[[dict[str, Any]], float | None]
               ) -> tuple[dict[str, Any], dict[str, Any]]:
        if method == BIGFL and bigfl is not None:
            return refine_bigfl(form, bigfl, params, evaluate)
        if method != "FeSEM" or len(form.fesem_warmups) < 2:
            return params, {}
        scores = {w: evaluate({**params, "warmup": w}) for w in form.fesem_warmups}
        finite = {w: v for w, v in scores.items() if v is not None and np.isfinite(v)}
        w = min(finite, key=lambda k: finite[k]) if finite else FESEM_DEFAULT_WARMUP
        return {**params, "warmup": w}, {"warmup": w, "validation_mse": {str(k): v for k, v in scores.items()}}

    return refine


def bigfl_skip(bigfl: BigflSpec) -> Callable[[Cell], str | None]:
    """Why a BiG-FL cell is not run: a validation step outside :attr:`BigflSpec.steps` (the form's
    step grid is the other methods'), or a test cell without an admissible setting.
    """

    def skip(cell: Cell) -> str | None:
        if cell.method != BIGFL:
            return None
        st = cell.settings
        if "lam" in st and st["lam"] is None:
            return NO_ADMISSIBLE
        if cell.split == "val" and not any(np.isclose(float(st["lr"]), s, rtol=1e-9) for s in bigfl.steps):
            return f"step {st['lr']:g} is not in BiG-FL's step grid {list(bigfl.steps)}"
        return None

    return skip


def _finite(scores: dict[Any, float | None]) -> dict[Any, float]:
    return {k: float(v) for k, v in scores.items() if v is not None and np.isfinite(v)}


def refine_bigfl(form: Form, bigfl: BigflSpec, params: dict[str, Any],
                 evaluate: Callable[[dict[str, Any]], float | None]) -> tuple[dict[str, Any], dict[str, Any]]:
    """BiG-FL's κ and λ on validation after its step search at κ = :attr:`BigflSpec.kappa`.

    Each κ of :attr:`BigflSpec.other_kappas` gets its best step of ``form.lr_grid`` (at
    :attr:`BigflSpec.base_lam`); the (κ, step) pair with the lowest validation MSE is kept, then λ
    from :attr:`BigflSpec.lambdas` at that pair, searched beyond a winning edge (÷ or × 10, at most
    :attr:`BigflSpec.lambda_extensions` more; ``lambda_at_edge`` when still unbracketed). Then, when
    the chosen κ is at an edge of the κ tried, κ is searched beyond it at the chosen λ (÷ or × 3, at
    most :attr:`BigflSpec.kappa_extensions` more, each with its best step of ``form.lr_grid``); a
    κ beyond replaces the chosen (κ, step) only when its validation MSE at that λ is lower by more
    than :data:`~graphfl.bench.multicenter.KAPPA_RTOL` (relative), so each pass can only lower the
    validation MSE of the final setting (``kappa_at_edge``: the chosen κ is still the smallest or
    the largest tried). Excluded (inadmissible) and failed runs score ``None`` and are never chosen; with no
    admissible setting ``lam`` is ``None`` (the test cells are then not run).
    """
    from .multicenter import KAPPA_FACTOR, KAPPA_RTOL, LAMBDA_FACTOR

    base = {"lr": params["lr"], "kappa": bigfl.kappa}
    pairs: dict[tuple[float, float], float | None] = {(bigfl.kappa, float(params["lr"])): evaluate(base)}
    per_kappa: dict[str, Any] = {f"{bigfl.kappa:g}": {"lr": params["lr"], "from": "step search"}}

    def best_step(k: float, lam: float | None = None) -> tuple[tuple[float, float] | None, dict[str, float | None]]:
        """κ = ``k``'s best (step, validation MSE) of ``form.lr_grid`` (``None``: none admissible), and
        every step's score.
        """
        at_lam = {} if lam is None else {"lam": lam}
        steps = {float(s): evaluate({"lr": float(s), "kappa": k, **at_lam}) for s in form.lr_grid}
        ok = _finite(steps)
        best = min(ok, key=lambda s: ok[s]) if ok else None
        return (None if best is None else (best, ok[best])), {f"{s:g}": v for s, v in steps.items()}

    for k in bigfl.other_kappas:
        best, scores = best_step(k)
        per_kappa[f"{k:g}"] = {"lr": None if best is None else best[0], "validation_mse": scores}
        if best is not None:
            pairs[(k, best[0])] = best[1]
    okp = _finite(pairs)
    tried = [bigfl.kappa, *bigfl.other_kappas]
    record: dict[str, Any] = {"per_kappa": per_kappa, "alpha": bigfl.alpha, "step_search_lam": bigfl.base_lam,
                              "kappa_grid": list(tried), "kappa_extended": [], "kappa_at_edge": False,
                              "lambda_grid": list(bigfl.lambdas)}
    if not okp:
        record.update(kappa=None, lam=None, validation_mse={})
        return {**base, "lam": None}, record
    kappa, lr = min(okp, key=lambda kp: okp[kp])
    at = {"lr": lr, "kappa": kappa}
    try:  # a λ winning at an edge of the grid is searched beyond it (÷ or × 10), as in bench multicenter
        found = search_grid(lambda v: evaluate({**at, "lam": v}), bigfl.lambdas, factor=LAMBDA_FACTOR,
                            max_extensions=bigfl.lambda_extensions)
    except RuntimeError:  # every λ failed or was excluded
        record.update(kappa=kappa, lr=lr, lam=None, validation_mse={str(v): None for v in bigfl.lambdas},
                      lambda_extended=[], lambda_at_edge=False)
        return {**at, "lam": None}, record
    lam = found.chosen
    record.update(lam=lam, validation_mse={str(v): found.scores[v] for v in sorted(found.scores)},
                  lambda_extended=list(found.extended), lambda_at_edge=found.at_edge)
    if found.at_edge:
        logger.warning("%s BiG-FL: lambda %g still wins at the edge of what was tried %s", NAME, lam,
                       sorted(found.scores))
    score = found.scores[lam]
    assert score is not None  # search_grid chooses a finite score
    while len(record["kappa_extended"]) < bigfl.kappa_extensions and kappa in (min(tried), max(tried)):
        nxt = float(f"{(kappa / KAPPA_FACTOR if kappa == min(tried) else kappa * KAPPA_FACTOR):.6g}")
        tried.append(nxt)
        record["kappa_extended"].append(nxt)
        best, scores = best_step(nxt, lam)
        per_kappa[f"{nxt:g}"] = {"lr": None if best is None else best[0], "validation_mse": scores,
                                 "at_lambda": lam}
        if best is None or not best[1] < score * (1 - KAPPA_RTOL):
            break
        kappa, (lr, score) = nxt, best
        logger.info("%s BiG-FL: kappa %g (step %g) beyond the kappa tried is better at lambda %g: %.4g",
                    NAME, kappa, lr, lam, score)
    record["kappa_at_edge"] = kappa in (min(tried), max(tried))  # unbracketed on at least one side
    record.update(kappa=kappa, lr=lr, validation_mse_final=score)
    return {"lr": lr, "kappa": kappa, "lam": lam}, record


def declare(form: Form, seed: int, bigfl: BigflSpec | None = None,
            only: Sequence[dict[str, Any]] | None = None) -> Bench:
    """The sweep on the harness: points (nodes, samples, std); each method's step tuned per point.

    ``bigfl``: the BiG-FL form (module docstring); ``only``: run these of the form's points.
    """
    unknown = [m for m in form.methods if m not in METHODS]
    if unknown:
        raise ValueError(f"bench {NAME}: unknown methods {unknown}; valid: {list(METHODS)}")
    methods = methods_of(form, bigfl)
    refs = [r for r in REFERENCES if r in form.methods]
    pairs = [(m, r) for r in refs for m in methods if m != r]
    if bigfl is not None:
        pairs += [(BIGFL, r) for r in BIGFL_REFERENCES if r in form.methods and r not in refs]

    def key(cell: Cell) -> dict[str, Any]:
        return {"bench": NAME, "method": cell.method, **run_values(*_args(cell, form, bigfl))}

    def failed(r: dict[str, Any]) -> str | None:
        return r.get("error") or r.get("excluded") or (None if r.get("final") is not None else "no final test MSE")

    extra: dict[str, Any] = {}
    if bigfl is not None:
        def seconds(cell: Cell) -> float:
            if cell.method in CONSTANTS:
                return 1.0
            per = bigfl.seconds_per_round if cell.method == BIGFL else SECONDS_PER_ROUND[cell.method]
            return float(cell.at.get("rounds", form.rounds)) * per

        extra = {"skip": bigfl_skip(bigfl), "seconds": seconds}
    return Bench(
        name=NAME if bigfl is None else BIGFL_NAME,
        title=("Where FeSEM helps: samples per client × cluster spread (synthetic-multicenter)" if bigfl is None else
               "Where BiG-FL helps: samples per client × cluster spread (synthetic-multicenter)"),
        methods=methods, points=points(form) if only is None else [dict(p) for p in only],
        seeds=[seed + k for k in range(form.seeds)],
        metrics=(Metric("mse", "test MSE", lower_is_better=True),),
        run_cell=lambda cell: run_one(*_args(cell, form, bigfl)), key=key,
        final=lambda r: {"mse": r.get("final")},
        failed=failed,
        tuning=Tuning(param="lr", grid=form.lr_grid, metric="mse", lower_is_better=True, max_extensions=1,
                      if_all_fail=form.lr_grid[0], refine=refine_for(form, bigfl)),
        pairs=pairs,
        cost=lambda cell: 0.02 if cell.method in CONSTANTS else 0.4 if cell.method == "Local" else 1.0, **extra)


def verdict(fesem: Sequence[float | None], ref: Sequence[float | None], expected: int, name: str = "FeSEM"
            ) -> dict[str, Any]:
    """A method (``name``, default FeSEM) against a reference from the per-seed final test MSE (rule:
    module docstring; the words name the method).
    """
    d = paired_difference(list(fesem), list(ref), lower_is_better=True, expected=expected)
    rev = paired_difference(list(ref), list(fesem), lower_is_better=True, expected=expected)
    refs = [float(x) for x in ref if x is not None and np.isfinite(x)]
    band = TIE_BAND * float(np.mean(refs)) if refs else None
    if d["first_nonfinite"]:
        word = f"{name} loses"
    elif d["missing"] or d["second_nonfinite"] or d["mean"] is None or band is None:
        word = "not testable"
    elif first_better_on_every_seed(d) and d["mean"] < -band:
        word = f"{name} wins"
    elif first_better_on_every_seed(rev) and d["mean"] > band:
        word = f"{name} loses"
    else:
        word = "tie"
    return {"verdict": word, "mean": d["mean"], "sd": d.get("sd"), "first_better": d["first_better"],
            "seeds": d["seeds"], "expected": expected, "band": band, "per_seed": d.get("per_seed")}


def verdicts(doc: dict[str, Any], form: Form, runs: dict[str, dict[str, list[float | None]]],
             bigfl: BigflSpec | None = None, missing: set[tuple[str, str, int]] | None = None
             ) -> list[dict[str, Any]]:
    """One entry per grid point: FeSEM − FedAvg and FeSEM − Local verdicts (and BiG-FL − FedAvg / Local /
    FeSEM in the BiG-FL form) and the best method: the lowest mean test MSE among the methods with a
    finite result on every seed (a mean over fewer seeds is not compared; ``None`` when no method has one).

    ``runs[repr(sorted(point.items()))][method]``: the per-seed final test MSE (``None``: failed).
    ``missing``: ``(point key, method, seed index)`` of cells a cache-only report did not find; such
    a seed is left out of the pair (so the verdict is ``not testable``), not counted as a failure.
    """
    gone = missing or set()

    def paired(k: str, a: str, b: str) -> tuple[list[float | None], list[float | None]]:
        keep = [i for i in range(len(runs[k][a])) if (k, a, i) not in gone and (k, b, i) not in gone]
        return [runs[k][a][i] for i in keep], [runs[k][b][i] for i in keep]

    out = []
    for p in doc["config"]["points"]:
        k = repr(sorted(p.items()))
        entry: dict[str, Any] = {"point": p}
        for ref in REFERENCES:
            if "FeSEM" in form.methods and ref in form.methods:
                entry[f"FeSEM vs {ref}"] = verdict(*paired(k, "FeSEM", ref), form.seeds)
        if bigfl is not None:
            for ref in BIGFL_REFERENCES:
                if ref in form.methods:
                    entry[f"{BIGFL} vs {ref}"] = verdict(*paired(k, BIGFL, ref), form.seeds, name=BIGFL)
        complete = {m: result(doc, m, **p)["metrics"]["mse"].get("mean") for m in methods_of(form, bigfl)
                    if _complete(runs[k].get(m), k, m, gone, form.seeds)}
        finite = {m: v for m, v in complete.items() if v is not None}
        entry["best"] = min(finite, key=lambda m: finite[m]) if finite else None
        out.append(entry)
    return out


def _complete(per_seed: list[float | None] | None, key: str, method: str, gone: set[tuple[str, str, int]],
              seeds: int) -> bool:
    """Whether ``method`` has a finite test MSE on each of the ``seeds`` seeds at point ``key``."""
    if per_seed is None or len(per_seed) != seeds:
        return False
    return all(v is not None and bool(np.isfinite(v)) and (key, method, i) not in gone for i, v in enumerate(per_seed))


def _diagnostics(bench: Bench, runs: dict[Any, list[dict[str, Any] | None]]) -> list[dict[str, Any]]:
    """Per point: FeSEM's per-seed last-round diagnostics and their mean ± sd."""
    out = []
    for (point, method), per_seed in runs.items():
        if method != "FeSEM":
            continue
        diags = [(r or {}).get("diag") for r in per_seed]
        entry: dict[str, Any] = {"point": dict(point), "method": method, "per_seed": diags}
        for k in ("ari", "nonempty", "local_mse"):
            vals = [d.get(k) for d in diags if d and d.get(k) is not None]
            entry[k] = mean_sd([float(v) for v in vals]) if vals else None
        entry["collapsed_seeds"] = sum(1 for d in diags if d and d.get("nonempty") == 1)
        out.append(entry)
    return out


def bigfl_diagnostics(runs: dict[Any, list[dict[str, Any] | None]], seeds: Sequence[int]) -> list[dict[str, Any]]:
    """Per point: BiG-FL's final ``‖φ − I‖_F`` per test seed, its mean ± sd, the degenerate seeds.

    A seed whose final ``‖φ − I‖_F`` is below :data:`~graphfl.bench.multicenter.PHI_MOVED` (or
    missing) is degenerate: φ stayed at the identity, the upper level did not act (logged as a
    warning). Test runs whose lower level was not strongly convex in some round are listed in
    ``inadmissible``.
    """
    from .multicenter import PHI_MOVED

    out = []
    for (point, method), per_seed in runs.items():
        if method != BIGFL:
            continue
        phis: list[float | None] = []
        degenerate: list[int] = []
        inadmissible: dict[str, str] = {}
        unconverged: dict[str, list[int]] = {}
        for s, r in zip(seeds, per_seed):
            d = (r or {}).get("diag") or {}
            phi = d.get("phi_minus_identity")
            phis.append(phi)
            if r is not None and (phi is None or phi < PHI_MOVED):
                degenerate.append(int(s))
            if d.get("inadmissible"):
                inadmissible[str(s)] = str(d["inadmissible"])
            if d.get("implicit_unconverged_rounds"):
                unconverged[str(s)] = list(d["implicit_unconverged_rounds"])
        finite = [float(v) for v in phis if v is not None]
        if degenerate:
            logger.warning("BiG-FL %s: ||phi - I||_F %s stayed below %g for seed(s) %s: phi did not move, the upper "
                           "level did not act (degenerate)", dict(point), phis, PHI_MOVED, degenerate)
        if inadmissible:
            logger.warning("BiG-FL %s: test run(s) with a lower level not strongly convex: %s", dict(point),
                           inadmissible)
        out.append({"point": dict(point), "method": method, "phi_minus_identity": phis,
                    "phi": mean_sd(finite) if finite else None, "threshold": PHI_MOVED,
                    "degenerate_seeds": degenerate, "inadmissible": inadmissible,
                    "implicit_unconverged_rounds": unconverged})
    return out


def unspecified(form: Form) -> list[str]:
    """The sizes and choices of this run, as written in the result."""
    return [
        f"task {TASK} (mixture generator: client i's 8x8 ground truth is its mixture sample; 3 planted clusters, "
        "centers U[-0.5, 0.5]^64); grid: clients "
        f"{list(form.nodes)} x training rows per client {list(form.samples)} (data.client-samples; 100 test rows "
        f"per client) x mixture component std {list(form.stds)} (data.cluster-std; the paper's 0.5)",
        f"{form.rounds} rounds for every method (R in the point; the points {[list(x) for x in form.long]} "
        f"(nodes, samples, std) also at R = {form.long_rounds}, tuned again there), "
        f"{TRAIN['train.local-steps']} local SGD steps of batch "
        f"{TRAIN['train.batch-size']} per round (plain SGD, momentum 0); engine {form.engine}",
        f"per grid point: step per method from {list(form.lr_grid)} (a winning edge extended once by x3 or /3) on "
        f"validation ({VALIDATION_FRACTION:.0%} of each client's training rows, first seed) by the mean validation "
        f"MSE after the last round; then FeSEM's warm-up local steps from {list(form.fesem_warmups)} at that step; "
        "constants have no step (their tuning rows are meaningless)",
        f"FeSEM: K = {FESEM_K} (the planted number, not tuned), k-means++ on the warmed-up models, prox 0, E-step "
        "every round; its warm-up round runs the chosen warm-up local steps (more local steps than the other "
        "methods' first round)",
        f"metric: mean over clients of the test MSE (inputs scaled to [-1, 1]) after the last round, {form.seeds} "
        f"seeds, paired per-seed differences against FedAvg and against Local; verdict band {TIE_BAND:.0%} of the "
        "reference's mean",
        "model: MLP 8-16-16-8 (no bias, sigmoid hidden, linear output; the task's)",
        "left out for time or by design: " + ("; ".join(form.cut) if form.cut else "nothing"),
    ]


def bigfl_settings(form: Form, bigfl: BigflSpec) -> list[str]:
    """BiG-FL's settings, graph and grids, as written in the result."""
    return [
        f"BiG-FL (strategy bigfl, ALGORITHMS.md §0.1 C2): alpha = {bigfl.alpha:g} FIXED (bench multicenter's "
        "validation choice at 50 clients, 100 rows, 200 rounds on the smooth generator; not re-tuned per point); "
        f"per point on validation (first seed): at kappa = {bigfl.kappa:g} (bench multicenter's choice) the step from "
        f"{list(form.lr_grid)} (a winning edge extended once by x3 or /3, as for the other methods; steps BiG-FL "
        f"may run: {list(bigfl.steps)}) at lambda = {bigfl.base_lam:g}, then lambda from {list(bigfl.lambdas)} (one "
        f"lambda for both levels; lambda = 0 is BiG-FL disabled and never in the grid; a winning edge searched "
        f"beyond, /10 or x10, at most {bigfl.lambda_extensions} more) at the best (kappa, step) "
        f"pair, where kappa {list(bigfl.other_kappas)} each get their best step of {list(form.lr_grid)} (not "
        f"extended) at the same lambda; then, at the chosen lambda, a kappa at an edge of those tried is searched "
        f"beyond it (/3 or x3, at most {bigfl.kappa_extensions} more, each with its best step) and replaces it only "
        "when its validation MSE is lower",
        "BiG-FL: a validation run whose lower level is not strongly convex in some round (ll_min_curvature <= 0, "
        "C2 c) is stopped at that round and excluded from the choice; with no admissible setting BiG-FL's test "
        "cells are not run (reported not testable, never replaced by another method)",
        "BiG-FL's graph: the task's client graph, the 4-NN graph (symmetrised by union) of the clients' mixture "
        "samples, i.e. of their true task vectors (an oracle graph: at small std its edges stay inside the planted "
        "clusters); phi acts on every parameter of the model (bigfl.layers default)",
        "BiG-FL's output: the mean over clients of the test MSE of each client's own lower-level model after the "
        "last round; diagnostics per test run: final ||phi - I||_F (server metric phi_minus_identity; below "
        "0.05 = degenerate, phi did not move)",
        f"budget: BiG-FL runs the same {form.rounds} rounds, {TRAIN['train.local-steps']} local steps of batch "
        f"{TRAIN['train.batch-size']} (plain SGD) as the other methods; engine {form.engine}",
    ]


def _complete_points(form: Form, seed: int, bigfl: BigflSpec | None, out: Path | None
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The form's points whose tuning the run cache holds in full, and the others (cache-only report)."""
    from .harness import MissingCell

    done, missing = [], []
    for p in (points(form) if bigfl is None else bigfl_points(form)):
        try:
            run_bench(declare(form, seed, bigfl, only=[p]), out, cache_only=True)
        except MissingCell:
            missing.append(p)
        else:
            done.append(p)
    return done, missing


def _estimate(bench: Bench, form: Form, bigfl: BigflSpec) -> float:
    """Upper bound of the BiG-FL form's seconds when nothing is cached: every point's BiG-FL step
    search (one extension), κ with its best step (the extensions beyond the κ grid included), λ
    search (its extensions included) and test runs, each for every round.
    """
    kappas = len(bigfl.other_kappas) + bigfl.kappa_extensions
    per_point = (len(form.lr_grid) + 1 + kappas * len(form.lr_grid) + len(bigfl.lambdas) - 1
                 + bigfl.lambda_extensions + form.seeds)
    return float(len(bench.points) * per_point * form.rounds * bigfl.seconds_per_round)


def run(quick: bool = False, seed: int = 0, out: Path | None = None, spec: Form | None = None,
        form: str | None = None, bigfl: BigflSpec | None = None, cache_only: bool = False) -> dict[str, Any]:
    """Tune and run the sweep; write ``<out>/multicenter-regime.{json,md,png}``.

    ``spec`` replaces the form ``quick`` names (tests run a tiny one); ``form`` names one of
    :data:`FORMS` (``bigfl``: the BiG-FL form, ``<out>/multicenter-regime-bigfl.*``); ``bigfl``
    adds BiG-FL with these settings to ``spec``. ``cache_only``: report what the run cache holds,
    compute nothing; a point whose tuning is not complete there is listed in ``missing_points``.
    """
    if form is not None:
        if form not in FORMS:
            raise ValueError(f"bench {NAME}: unknown form {form!r}; valid: {sorted(FORMS)}")
        spec, bigfl = spec or FORMS[form][0], bigfl or FORMS[form][1]
    f = spec or (QUICK if quick else FULL)
    missing_points: list[dict[str, Any]] = []
    only = None if bigfl is None else bigfl_points(f)
    if cache_only:
        only, missing_points = _complete_points(f, seed, bigfl, out)
        if missing_points:
            logger.warning("%s: points without a complete tuning in the cache (not reported): %s",
                           NAME if bigfl is None else BIGFL_NAME, missing_points)
    bench = declare(f, seed, bigfl, only=only)
    if bigfl is not None:
        logger.info("%s: BiG-FL about %.2g s per round; upper bound with nothing cached: %d points x (%d step + "
                    "%d other-kappa step + %d lambda validation + %d test runs) x %d rounds = about %.0f min of BiG-FL",
                    BIGFL_NAME, bigfl.seconds_per_round, len(bench.points), len(f.lr_grid) + 1,
                    len(bigfl.other_kappas) * len(f.lr_grid),
                    len(bigfl.lambdas) - 1, f.seeds, f.rounds, _estimate(bench, f, bigfl) / 60)
    outcome = run_bench(bench, out, cache_only=cache_only)
    return _report(bench, outcome, f, seed, quick, out, bigfl, missing_points)


def _report(bench: Bench, outcome: Any, form: Form, seed: int, quick: bool, out: Path | None,
            bigfl: BigflSpec | None, missing_points: list[dict[str, Any]]) -> dict[str, Any]:
    per_seed: dict[str, dict[str, list[float | None]]] = {}
    for (point, method), rs in outcome.runs.items():
        per_seed.setdefault(repr(sorted(dict(point).items())), {})[method] = [
            None if r is None else r.get("final") for r in rs]
    config = {**{k: list(v) if isinstance(v, tuple) else v for k, v in form.__dict__.items()},
              "task": TASK, "tuning_seed": seed, "validation_fraction": VALIDATION_FRACTION, "tie_band": TIE_BAND,
              "fesem_k": FESEM_K, "train": TRAIN}
    extra: dict[str, Any] = {"diagnostics": _diagnostics(bench, outcome.runs), "settings": unspecified(form)}
    if bigfl is not None:
        config["bigfl"] = {k: list(v) if isinstance(v, tuple) else v for k, v in bigfl.__dict__.items()}
        extra["settings"] = extra["settings"] + bigfl_settings(form, bigfl)
        extra["bigfl_diagnostics"] = bigfl_diagnostics(outcome.runs, bench.seeds)
        extra["missing_points"] = missing_points
        extra["missing_cells"] = [c.label() for c in outcome.missing]
    doc = build_doc(bench, outcome, quick, config, extra=extra)
    seeds = list(bench.seeds)
    missing = {(repr(sorted(dict(c.point).items())), c.method, seeds.index(c.seed)) for c in outcome.missing
               if c.split == "test" and c.seed in seeds}
    doc["verdicts"] = verdicts(doc, form, per_seed, bigfl, missing)
    if out is not None:
        _write(Path(out), doc, form, bigfl)
    for line in summary(doc):
        logger.info("%s", line)
    return doc


def _num(stat: dict[str, Any] | None, fmt: str = ".4g") -> str:
    return "–" if not stat or stat.get("mean") is None else fmt_pm(stat, fmt)


def _diff(doc: dict[str, Any], a: str, b: str, point: dict[str, Any]) -> str:
    try:
        st = pair(doc, a, b, **point)["metrics"]["mse"]
    except KeyError:
        return "–"
    if st.get("mean") is None:
        return "–"
    return f"{st['mean']:+.4g} ± {st.get('sd') or 0.0:.2g} ({st['first_better']}/{st['seeds']})"


def _where(p: dict[str, Any]) -> str:
    return f"n={p['nodes']}, m={p['samples']}, std={p['std']:g}, R={p['rounds']}"


def _write(out: Path, doc: dict[str, Any], form: Form, bigfl: BigflSpec | None = None) -> None:
    pts = doc["config"]["points"]
    methods = methods_of(form, bigfl)
    rows = []
    for p in pts:
        row: dict[str, Any] = {"point": _where(p)}
        for m in methods:
            row[m] = _num(result(doc, m, **p)["metrics"]["mse"])
        rows.append(row)
    sections = ["## Mean client test MSE (mean ± sd over seeds)", "", markdown_table(rows, list(rows[0])), ""]
    vrows = []
    for v in doc["verdicts"]:
        row = {"point": _where(v["point"]), "best": v["best"] or "–"}
        for k, e in v.items():
            if " vs " not in k or not e:
                continue
            mean = "–" if e["mean"] is None else f"{e['mean']:+.4g}"
            row[k.replace(" vs ", " − ")] = f"{mean} ({e['first_better']}/{e['expected']}): {e['verdict']}"
        vrows.append(row)
    sections += ["## Verdicts (computed from the paired per-seed differences)", "",
                 f"FeSEM − reference: mean difference of test MSE (seeds where FeSEM is better / expected seeds): "
                 f"verdict. `wins` = better on every seed and |mean| > {TIE_BAND:.0%} of the reference's mean; "
                 "`loses` = the reverse; otherwise `tie`. `best`: the lowest mean test MSE among the methods "
                 "with a finite result on every seed.", "", markdown_table(vrows, list(vrows[0])), ""]
    for ref in REFERENCES:
        if ref not in form.methods:
            continue
        prow = []
        for m in methods:
            if m == ref:
                continue
            prow.append({"method": f"{m} − {ref}", **{_where(p): _diff(doc, m, ref, p) for p in pts}})
        sections += [f"### Paired differences against {ref} (test MSE, mean ± sd; seeds where the method is "
                     "better / seeds)", "", markdown_table(prow, list(prow[0])), ""]
    drows = []
    for d in doc["diagnostics"]:
        drows.append({"point": _where(d["point"]), "ARI": _num(d.get("ari"), ".3f"),
                      "non-empty clusters": _num(d.get("nonempty"), ".1f"),
                      "seeds collapsed to 1 cluster": str(d["collapsed_seeds"]),
                      "cluster sizes (per seed)": "; ".join(str((x or {}).get("cluster_sizes")) for x in d["per_seed"]),
                      "FeSEM local-model MSE": _num(d.get("local_mse"))})
    if drows:
        sections += ["## Diagnostics: did FeSEM find the planted clusters?", "",
                     "Last round of each test run, mean ± sd over seeds: adjusted Rand index of FeSEM's assignment "
                     "against the planted clusters (1 = exact, ≈ 0 = unrelated), non-empty clusters, cluster sizes, "
                     "and the test MSE of its clients' last local models (FeSEM's output is the center's).", "",
                     markdown_table(drows, list(drows[0])), ""]
    if bigfl is not None:
        sections += _bigfl_sections(doc, pts)
    sections += ["## Settings", ""] + [f"- {s}" for s in doc["settings"]]
    intro = [f"Mean client test MSE after R rounds (R = {form.rounds}; some points also {form.long_rounds}), "
             f"mean ± sd over {form.seeds} seeds; every method's "
             "step tuned on validation per grid point (never on test)."]
    panels = []
    shown = [(int(n), float(s), form.rounds) for n in form.nodes for s in form.stds]
    if form.long_rounds:
        shown += list(dict.fromkeys((int(n), float(s), form.long_rounds) for n, _, s in form.long))
    for n, s, r in shown:
        panels += metric_panels(doc, "mse", "samples", where={"nodes": n, "std": s, "rounds": r},
                                xlabel="training rows per client (log)", ylabel="mean client test MSE",
                                logx=True, title=f"{n} clients, cluster std {s:g}, {r} rounds")
    write_report(out, doc, intro=intro, sections=sections, panels=panels,
                 plot_title=("Where FeSEM helps" if bigfl is None else "Where BiG-FL helps")
                 + ": samples per client × cluster spread")


def _bigfl_sections(doc: dict[str, Any], pts: list[dict[str, Any]]) -> list[str]:
    """The BiG-FL form's extra Markdown: BiG-FL − FeSEM, φ diagnostics, tuning, what is missing."""
    out: list[str] = []
    prow = [{"method": f"{BIGFL} − FeSEM", **{_where(p): _diff(doc, BIGFL, "FeSEM", p) for p in pts}}]
    out += ["### Paired differences against FeSEM (test MSE, mean ± sd; seeds where BiG-FL is better / seeds)", "",
            markdown_table(prow, list(prow[0])), ""]
    drows = []
    for d in doc.get("bigfl_diagnostics", []):
        phis = ", ".join("–" if v is None else f"{v:.3g}" for v in d["phi_minus_identity"])
        drows.append({"point": _where(d["point"]), "‖φ − I‖_F (mean ± sd)": _num(d.get("phi"), ".3g"),
                      "per seed": phis, "degenerate seeds (< 0.05)": str(d["degenerate_seeds"] or "none"),
                      "inadmissible test runs": str(d["inadmissible"] or "none")})
    if drows:
        out += ["## Diagnostics: did BiG-FL's φ move?", "",
                "Final ‖φ − I‖_F of each test run (server metric `phi_minus_identity`); a run below "
                f"{drows and doc['bigfl_diagnostics'][0]['threshold']:g} is degenerate (the upper level did not act).",
                "", markdown_table(drows, list(drows[0])), ""]
    trows = []
    for t in doc.get("tuning", []):
        if t.get("methods") != [BIGFL] and t.get("method") != BIGFL:
            continue
        ref = t.get("refined") or {}
        steps = ", ".join(f"{k}: {'–' if v is None else f'{v:.4g}'}" for k, v in (t.get("scores") or {}).items())
        lams = ", ".join(f"{k}: {'–' if v is None else f'{v:.4g}'}" for k, v in (ref.get("validation_mse") or {}).items())
        kap = "; ".join(f"κ {k}" + ("" if e.get("at_lambda") is None else f" (at λ {e['at_lambda']:g})") + ": "
                        + ", ".join(f"{s}: {'–' if v is None else f'{v:.4g}'}"
                                    for s, v in (e.get("validation_mse") or {}).items())
                        for k, e in (ref.get("per_kappa") or {}).items() if e.get("validation_mse"))
        trows.append({"point": _where(t["point"]), "val MSE per step (κ first)": steps or "–",
                      "val MSE per step, other κ": kap or "–",
                      "chosen κ, step": f"{ref.get('kappa')}, {ref.get('lr', t.get('chosen'))}"
                      + (" (κ at the edge of what was tried)" if ref.get("kappa_at_edge") else ""),
                      "val MSE per lambda": lams or "–",
                      "chosen lambda": str(ref.get("lam")) + (" (at the edge of what was tried)"
                                                              if ref.get("lambda_at_edge") else ""),
                      "excluded / skipped": "; ".join(f"{k}: {v}" for k, v in (t.get("failed") or {}).items()) or "–"})
    if trows:
        out += ["## BiG-FL's tuning (validation, first seed)", "", markdown_table(trows, list(trows[0])), ""]
    missing = doc.get("missing_points") or []
    cells = doc.get("missing_cells") or []
    out += ["## Missing", "",
            ("Points not run (their tuning is not complete in the run cache): "
             + "; ".join(_where(p) for p in missing)) if missing else "Every point of the form is reported.",
            "", ("Test cells not in the cache (verdicts that need them: not testable): " + "; ".join(cells)) if cells
            else "No test cell of a reported point is missing.", ""]
    return out


def summary(doc: dict[str, Any]) -> list[str]:
    """One line per grid point: the verdicts and the best method, for logs and notes."""
    lines = []
    for v in doc["verdicts"]:
        parts = [f"{k}: {e['verdict']}" for k, e in v.items() if " vs " in k]
        lines.append(f"{_where(v['point'])}: best {v['best']}; " + "; ".join(parts))
    return lines
