"""Sweep "when graph-aware FL helps" (ALGORITHMS.md §0.1): label skew against the methods.

Grid: Dirichlet label skew ``α`` over :attr:`Form.dirichlet` (0.05 = one or two classes per
client … 1.0 = mild skew) on two tasks (:attr:`Form.tasks`):

* ``digits``: no structure between clients beyond the label skew;
* ``digits-permuted``: the same split, then 3 planted client groups with permuted labels
  (``pid mod 3``): clients of different groups have conflicting tasks.

Methods: FedAvg, Local (no aggregation), FeSEM (``K`` tuned), JGESR (PDCA solver, its
``(λ, α, β)`` tuned as :mod:`graphfl.bench.jgesr` does, :func:`graphfl.bench.jgesr.tune_graph`),
pFedGraph (its ``α`` tuned) and two constant predictors, no training: ``Const-own`` predicts each
client's own training majority class, ``Const-pooled`` the pooled training majority class.

Metric: the mean over clients of the test accuracy of the model each client is given after the
last round (its own for Local, the global one for FedAvg, its center for FeSEM — FeSEM's last
local model is kept as ``local_acc`` —, its personalised model for JGESR / pFedGraph); mean ± sd
over seeds and paired per-seed differences of every method against FedAvg and against Local.

Fairness: plain SGD with the same local steps and batch for every method; per grid point, the
step of *each method* is chosen from :attr:`Form.lr_grid` on the validation view of the task
(:func:`graphfl.tasks.holdout.validation_task`, first seed, never test), then at that step the
method's own hyperparameters on the same validation runs: FeSEM's ``K`` over
:attr:`Form.fesem_k`, JGESR's ``(λ, α, β)`` by coordinate search, pFedGraph's ``α`` over
:attr:`Form.pfedgraph_alpha`. The uplink is clean (no channel noise).

Diagnostics that a graph-aware method did not silently degenerate (per test run, last round):
JGESR's ``graph_cv`` (coefficient of variation of the learned graph's off-diagonal weights; 0 =
uniform) and ``shrink_ratio`` (``‖ψ − ȳ‖/‖y − ȳ‖``; 0 = FedAvg); FeSEM's cluster sizes (and ARI
against the planted groups); pFedGraph's graph CV; on ``digits-permuted`` the share of each
learned graph's off-diagonal weight that lies inside the planted groups (``within``; a uniform
graph gives ``(n/3 − 1)/(n − 1)``); the seeds on which pFedGraph's graph is the identity (all
weight on the client itself: pFedGraph is then Local training).

Personalised form (``--form personal``, :data:`PERSONAL`; ALGORITHMS.md §0.1 C5–C7): the same
protocol with FedAvg, Local, APFL, APFLGate, FedGATE and the constants, from strong skew
(Dirichlet 0.05) to B8's 0.5 and the quick form's 1. At its tuned step each gate-family
method's own hyperparameters are chosen on the same validation runs: APFL's mixing weight
over :attr:`Form.apfl_alpha` (plus adaptive ``α_i`` started at 0.5 when
:attr:`Form.apfl_adaptive`), FedGATE's ``τ`` over :attr:`Form.gate_tau` and APFLGate's
``(α, τ)`` over their product. ``τ`` is read as a multiple of the local steps ``R``
(``tau-mode = multiple-of-steps``, C5); a grid with ``τ ≤ R/2`` is refused when the form is
declared (the strategies refuse it too). The personal output is the locally trained copy
(``personal-output = local-copy``, C6). Metric: APFL / APFLGate the mixture
``α_i h(v_i) + (1 − α_i) h(w_i)`` per client (the run's ``test_acc``, as bench apflgate reads
it), FedGATE the global model; their last-round global-model accuracy and the mixture with the
aggregated ``w`` are kept as diagnostics (``global_acc``, ``mix_aggregated_acc``). Their
baseline ``FedAvg-FT`` (:data:`FINE_TUNED`) is FedAvg scored on the same locally trained copy:
each client's model after the last round's local steps from the global model
(``train.eval-local``), with its step tuned on that metric; APFL, APFLGate and FedGATE are
paired with it. The step grid is extended past a winning edge (:attr:`Form.max_extensions`,
every method alike).

Declared on the harness (:mod:`graphfl.bench.harness`): every run goes through the run cache in
``<out>/cache`` (an interrupted sweep resumes), the time estimate is logged; results in
``<out>/heterogeneity.{json,md,png}``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.common.results import markdown_table
from graphfl.tasks.holdout import VALIDATION_FRACTION, validation_task

from . import jgesr as bj
from .harness import Bench, Cell, Metric, Tuning, run_bench, run_inprocess
from .report import build_doc, metric_panels, pair, result, write_report
from .stats import fmt_pm, mean_sd

logger = logging.getLogger(__name__)

NAME = "heterogeneity"
TASKS = ("digits", "digits-permuted")
OTHER_TASKS = ("bbbp",)
"""Tasks a named form may run besides :data:`TASKS` (``bbbp``: the personal form on B8's task)."""
TAU_MODE = "multiple-of-steps"
"""FedGATE / APFLGate read every ``τ`` of a form as a multiple of the local steps ``R`` (C5)."""
TRAINED: dict[str, tuple[str, dict[str, Any]]] = {
    "FedAvg": ("fedavg", {}),
    "FedAvg-FT": ("fedavg", {"train.eval-local": True}),
    "FedAvg-uniform": ("fedavg", {"fedavg.weighted": False}),
    "Local": ("local", {}),
    "FeSEM": ("fesem", {}),
    "JGESR": ("jgesr", {"jgesr.solver": "pdca", "jgesr.log-graph": True}),
    "pFedGraph": ("pfedgraph", {}),
    "APFL": ("apfl", {"apfl.personal-output": "local-copy"}),
    "APFLGate": ("apflgate", {"apflgate.personal-output": "local-copy", "apflgate.tau-mode": TAU_MODE}),
    "FedGATE": ("fedgate", {"fedgate.tau-mode": TAU_MODE}),
}
CONSTANTS = ("Const-own", "Const-pooled")
"""Constant predictors (no training): each client's own training majority class; the pooled one."""
METHODS = (*TRAINED, *CONSTANTS)
"""Every method a form may name."""
GRAPH_METHODS = ("FedAvg", "Local", "FeSEM", "JGESR", "pFedGraph", *CONSTANTS)
"""The methods of the quick and full forms."""
PERSONAL_METHODS = ("FedAvg", "FedAvg-FT", "Local", "APFL", "APFLGate", "FedGATE", *CONSTANTS)
"""The methods of the personalised form."""
FINE_TUNED = "FedAvg-FT"
"""FedAvg scored on each client's model after the last round's local training from the global
model (``train.eval-local``: the run's ``local_test_acc``): "FedAvg + local fine-tuning", the
baseline of the mixing methods, whose personal output is that locally trained copy (C6)."""
UNIFORM = "FedAvg-uniform"
"""FedAvg with uniform client weights (``fedavg.weighted = false``): ``w ← (1/|S|) Σ_i w_i``, the
server average of the gate family (:mod:`graphfl.strategies.fedgate`), where FedAvg weights by
training samples; against it the gate family's client side is compared with the same server rule."""
MIXING = ("APFL", "APFLGate")
"""Methods whose metric is the personal mixture ``α_i h(v_i) + (1 − α_i) h(w_i)``."""
GATE_TAU = ("APFLGate", "FedGATE")
"""Methods with a ``τ`` (tuned over :attr:`Form.gate_tau`, multiples of ``R``)."""
APFL_DEFAULT_ALPHA = 0.5
GATE_DEFAULT_TAU = 1.0
"""``τ = R``, FedTorch's rule (as a multiple of ``R``)."""
REFERENCES = ("FedAvg", "Local")
"""Every method is compared, per seed, with each of these."""
FESEM_DEFAULT_K = 3
PFEDGRAPH_DEFAULT_ALPHA = 0.8
GROUPS = 3
"""Planted groups of ``digits-permuted``."""


@dataclass(frozen=True)
class Form:
    """What ``--quick`` and the full form run."""

    nodes: int
    rounds: int
    local_steps: int
    batch_size: int
    seeds: int
    lr_grid: tuple[float, ...]
    dirichlet: tuple[float, ...] = (0.05, 0.1, 0.3, 1.0)
    tasks: tuple[str, ...] = TASKS
    methods: tuple[str, ...] = GRAPH_METHODS
    fesem_k: tuple[int, ...] = (2, 3, 4)
    pfedgraph_alpha: tuple[float, ...] = (0.2, 0.8, 3.0)
    lam_grid: tuple[float, ...] = (0.1, 1.0, 10.0)
    alpha_grid: tuple[float, ...] = (0.01, 0.1, 1.0)
    beta_grid: tuple[float, ...] = (0.001, 0.01, 0.1)
    graph_search: str = "coordinate"
    apfl_alpha: tuple[float, ...] = (0.25, 0.5, 0.75)
    """Fixed mixing weights ``α`` tried for APFL and APFLGate."""
    apfl_adaptive: bool = True
    """Also try adaptive ``α_i`` (started at :data:`APFL_DEFAULT_ALPHA`, step ``train.lr``)."""
    gate_tau: tuple[float, ...] = (1.0, 10.0, 100.0)
    """``τ`` tried for FedGATE and APFLGate, as multiples of ``R`` (each must exceed 1/2, C5)."""
    engine: str = "batched"
    max_extensions: int = 0
    """Steps tried past a winning edge of :attr:`lr_grid` (factor 3, :func:`graphfl.bench.tuning.search_grid`)."""
    step_below_if_all_fail: bool = False
    """While every step tried for a method failed on validation (diverged, or a client's output not
    finite), try ``smallest / 3`` next, within :attr:`max_extensions` (``Tuning.below_if_all_fail``);
    off: such a method falls back to the grid's smallest step unvalidated."""
    permuted_nodes: int = 12
    """Clients of ``digits-permuted`` (a multiple of its 3 groups: 12 = 3 groups of 4)."""
    metric: str = "acc"
    """What a run is scored on: ``acc`` (mean client test accuracy) or ``auc`` (mean over the
    clients whose test split holds both classes of their ROC-AUC, ``test_auc``; see :func:`run_one`)."""


QUICK = Form(nodes=10, rounds=30, local_steps=10, batch_size=32, seeds=3, lr_grid=(0.1, 0.3, 1.0))
FULL = Form(nodes=20, rounds=100, local_steps=20, batch_size=32, seeds=5, lr_grid=(0.03, 0.1, 0.3, 1.0),
            dirichlet=(0.05, 0.1, 0.3, 1.0, 10.0), graph_search="grid")
PERSONAL = dataclasses.replace(QUICK, seeds=5, dirichlet=(0.05, 0.1, 0.3, 0.5, 1.0), methods=PERSONAL_METHODS,
                               max_extensions=2)
"""The personalised methods against FedAvg and Local as label skew grows (C7: Dirichlet ≤ 0.1
and planted groups, beside B8's 0.5; the quick form's 0.3 and 1 for comparison)."""
PERSONAL_BBBP = dataclasses.replace(
    PERSONAL, tasks=("bbbp",), nodes=16, rounds=5, local_steps=4, seeds=5, dirichlet=(0.2, 0.5, 1.0),
    methods=("FedAvg", "FedAvg-FT", "Local", "APFL", "APFLGate", "FedGATE", "Const-pooled"), metric="auc")
"""The personalised form on B8's task (seed 004: BBBP, 16 clients, ROC-AUC) at
``bench apflgate --quick``'s scale (5 rounds × 4 local steps); a constant predictor's ROC-AUC
is 0.5 by definition (``Const-pooled``). Dirichlet 0.2 is the strongest skew the task's split
allows (``data.min-partition-size`` 10 molecules per client: no partition at 0.1 or 0.15)."""
PERSONAL_BBBP_R20 = dataclasses.replace(PERSONAL_BBBP, rounds=20, dirichlet=(0.5,), step_below_if_all_fail=True)
""":data:`PERSONAL_BBBP` at 20 rounds (the round count of the FedGraphNN configuration
ALGORITHMS.md §9.3 reconstructs B8's settings from), at the paper's Dirichlet 0.5; the step and
the methods' own settings are tuned again at 20 rounds, a step searched below the grid while
every step failed. (A point costs about an hour on one core; the other skews at 20 rounds:
:data:`PERSONAL_BBBP_R20_SKEWS`.)"""
PERSONAL_BBBP_R20_SKEWS = dataclasses.replace(
    PERSONAL_BBBP_R20, dirichlet=PERSONAL_BBBP.dirichlet,
    methods=tuple(x for m in PERSONAL_BBBP_R20.methods for x in ((m, UNIFORM) if m == "FedAvg" else (m,))))
""":data:`PERSONAL_BBBP_R20` over the skews of :data:`PERSONAL_BBBP` (Dirichlet 0.2, 0.5 and 1), with
:data:`UNIFORM` beside FedAvg (the gate family averages its clients uniformly). Tuning is per point
and per method and the cache keys do not name the form, so a run whose ``<out>/cache`` holds a copy
of ``personal-bbbp-r20``'s cache computes only the cells that form did not."""
PERSONAL_BBBP_R20_S16 = dataclasses.replace(PERSONAL_BBBP_R20, local_steps=16)
""":data:`PERSONAL_BBBP_R20` with 16 local steps per round: about 4.5 epochs of a client's ~115
training molecules at batch 32, near the 5 local epochs of the configuration B8's settings are
reconstructed from (ALGORITHMS.md §9.3)."""
FORMS = {"personal": PERSONAL, "personal-bbbp": PERSONAL_BBBP, "personal-bbbp-r20": PERSONAL_BBBP_R20,
         "personal-bbbp-r20-skews": PERSONAL_BBBP_R20_SKEWS, "personal-bbbp-r20x16": PERSONAL_BBBP_R20_S16}
"""Named forms (``graphfl bench heterogeneity --form NAME``)."""
RESUMABLE = True
"""An interrupted sweep continues in the same ``--out`` (finished runs come from ``<out>/cache``)."""


def nodes_for(form: Form, task: str) -> int:
    """Clients in a run of ``task`` (``+val`` views included)."""
    return form.permuted_nodes if task.removesuffix("+val") == "digits-permuted" else form.nodes


METRICS = {"acc": ("accuracy (%)", 100.0, ".2f"), "auc": ("ROC-AUC", 1.0, ".4f")}
"""Per :attr:`Form.metric`: label, display scale and format."""
MIN_DEFINED_CLIENTS = 2
"""A run whose ROC-AUC is defined on fewer clients is a failed setting (:func:`run_failure`): a
client's ROC-AUC is undefined when its test split holds one class *or* its model's outputs are
not finite, and a "mean over clients" of one client says nothing about the others."""


def points(form: Form) -> list[dict[str, Any]]:
    """The grid: every task × every Dirichlet α."""
    return [{"task": t, "dirichlet": float(a)} for t in form.tasks for a in form.dirichlet]


def run_values(method: str, task: str, form: Form, seed: int, dirichlet: float, params: dict[str, Any]
               ) -> dict[str, Any]:
    """The run configuration of one run (``params``: ``lr`` and the method's own tuned values).

    Defaults are filled in (FeSEM ``K`` = 3, pFedGraph ``α`` = 0.8, JGESR's ``(λ, α, β)``
    = :data:`graphfl.bench.jgesr.GRAPH_DEFAULT`, APFL / APFLGate ``α`` = 0.5 fixed, FedGATE /
    APFLGate ``τ`` = 1 × R), so a run at a default and the same run with the
    default named share one cache entry. Constant predictors have no step.
    """
    values: dict[str, Any] = {"task": task, "nodes": nodes_for(form, task), "seed": seed,
                              "data.dirichlet-alpha": dirichlet}
    if method in CONSTANTS:
        return {"strategy": method, **values}
    strategy, extra = TRAINED[method]
    values.update({"strategy": strategy, "rounds": form.rounds, "engine": form.engine, "train.lr": params["lr"],
                   "train.local-steps": form.local_steps, "train.batch-size": form.batch_size,
                   "train.momentum": 0.0, **extra})
    if strategy == "fesem":
        values["fesem.k"] = int(params.get("k", FESEM_DEFAULT_K))
    elif strategy == "pfedgraph":
        values["pfedgraph.alpha"] = float(params.get("alpha", PFEDGRAPH_DEFAULT_ALPHA))
    elif strategy == "jgesr":
        lam, alpha, beta = params.get("graph") or bj.GRAPH_DEFAULT
        values.update({"jgesr.lam": lam, "jgesr.alpha": alpha, "jgesr.beta": beta})
    if method in MIXING:
        values[f"{strategy}.alpha"] = float(params.get("alpha", APFL_DEFAULT_ALPHA))
        if params.get("adaptive"):
            values[f"{strategy}.adaptive-alpha"] = True
    if method in GATE_TAU:
        values[f"{strategy}.tau"] = float(params.get("tau", GATE_DEFAULT_TAU))
    return values


def tau_grid_problem(form: Form) -> str | None:
    """Why the form's ``τ`` grid is refused (a ``τ ≤ R/2``, C5), or ``None``."""
    from graphfl.strategies.apfl_math import tau_problem

    for tau in form.gate_tau:
        if tau <= 0:
            return f"gate_tau {tau:g}: τ is a multiple of R here and must be > 1/2 (0 would mean τ = R: write 1)"
        problem = tau_problem("fedgate.tau", float(tau), TAU_MODE, form.local_steps)
        if problem:
            return problem
    return None


def offdiag_cv(graph: np.ndarray) -> float | None:
    """Coefficient of variation of the off-diagonal entries of ``graph`` (``None`` when they sum to 0)."""
    n = graph.shape[0]
    off = graph[~np.eye(n, dtype=bool)]
    mean = float(off.mean()) if off.size else 0.0
    return float(off.std() / mean) if mean > 0 else None


def within_share(graph: np.ndarray, groups: np.ndarray) -> float | None:
    """Share of the off-diagonal weight of ``graph`` between clients of the same group (``None`` if none)."""
    n = graph.shape[0]
    off = ~np.eye(n, dtype=bool)
    total = float(np.abs(graph[off]).sum())
    same = (groups[:, None] == groups[None, :]) & off
    return float(np.abs(graph[same]).sum() / total) if total > 0 else None


def _graph_stats(graph: Any, task: str, n: int) -> dict[str, Any]:
    if graph is None:
        return {}
    g = np.asarray(graph, dtype=float)
    out: dict[str, Any] = {"graph_cv": offdiag_cv(g)}
    if task.removesuffix("+val") == "digits-permuted":
        out["within"] = within_share(g, np.arange(n) % GROUPS)
    return out


def client_task(task: str, nodes: int, seed: int, dirichlet: float) -> Any:
    """The task whose clients' data the trained runs of this (task, client count, seed, Dirichlet
    α) see, built as a run builds it (a constant predictor and the two-class count read it).
    """
    from graphfl.common.config import parse_run_config
    from graphfl.tasks import registry as tasks

    cfg = parse_run_config({"strategy": "fedavg", "task": task, "nodes": nodes, "seed": seed, "engine": "inprocess",
                            "data.dirichlet-alpha": dirichlet})
    return tasks.create(cfg.task, data=cfg.data, data_dir=cfg.data_dir, seed=seed)


def constant_accuracy(method: str, task: str, form: Form, seed: int, dirichlet: float) -> dict[str, Any]:
    """Mean over clients of a constant predictor's test accuracy (``Const-own`` or ``Const-pooled``).

    The clients' data are those of the trained runs with the same seed (same task, client count
    and Dirichlet split); the class is chosen on training data only.
    """
    n = nodes_for(form, task)
    t = client_task(task, n, seed, dirichlet)
    data = [t.client_data(p, n) for p in range(n)]
    pooled_y = np.concatenate([np.asarray(d.y_train, np.int64).reshape(-1) for d in data])
    pooled = int(np.bincount(pooled_y).argmax())
    accs = []
    for d in data:
        y = np.asarray(d.y_test, np.int64).reshape(-1)
        if y.size == 0:
            continue
        own = int(np.bincount(np.asarray(d.y_train, np.int64).reshape(-1)).argmax())
        accs.append(float(np.mean(y == (own if method == "Const-own" else pooled))))
    return {"final": float(np.mean(accs)) if accs else None, "clients": len(accs)}


@functools.lru_cache(maxsize=64)
def two_class_clients(task: str, nodes: int, seed: int, dirichlet: float) -> int:
    """How many of the ``nodes`` clients' test splits hold both classes (the clients with a ROC-AUC)."""
    t = client_task(task, nodes, seed, dirichlet)
    return sum(1 for p in range(nodes) if np.unique(np.asarray(t.client_data(p, nodes).y_test)).size >= 2)


def constant_auc(task: str, form: Form, seed: int, dirichlet: float) -> dict[str, Any]:
    """A constant predictor's ROC-AUC: 0.5 by definition (every test score ties), over the clients
    whose test split holds both classes (``clients``; ``auc_undefined`` counts the others).
    """
    n = nodes_for(form, task)
    defined = two_class_clients(task, n, seed, dirichlet)
    return {"final": 0.5 if defined else None, "clients": defined, "diag": {"auc_undefined": n - defined}}


def run_one(method: str, task: str, form: Form, seed: int, dirichlet: float, params: dict[str, Any]
            ) -> dict[str, Any]:
    """One run of ``method``: its final score (:attr:`Form.metric`), its curve and the method's diagnostics.

    ``acc``: the mean over clients of the test accuracy. ``auc``: the mean over the clients whose
    test split holds both classes of their ROC-AUC (the task's ``test_auc``, as bench apflgate reads
    it); a client with one class, or with non-finite outputs, has no ROC-AUC and is left out,
    counted in ``diag.auc_undefined``; ``diag.auc_nonfinite`` counts the second kind
    (:func:`run_failure` fails the run on it). A run that fails (e.g. non-finite uploads at a too
    large step) returns ``final = None`` and ``error``: a failed setting, not a crash.
    """
    if method in CONSTANTS:
        if form.metric == "auc":
            return constant_auc(task, form, seed, dirichlet)
        return constant_accuracy(method, task, form, seed, dirichlet)
    values = run_values(method, task, form, seed, dirichlet, params)
    strategy = values["strategy"]
    curve, run = run_inprocess(values, f"{method} {task} seed {seed} {params}")
    if curve is None:
        return run
    last = curve[-1]
    server = last.get("server") or {}
    key = f"test_{form.metric}"
    scored = f"local_{key}" if method == FINE_TUNED else key
    out: dict[str, Any] = {"final": last.get(scored), "acc": [r.get(scored) for r in curve], **run}
    n = values["nodes"]
    undefined = None
    if form.metric != "acc":
        per_client = last.get(f"{scored}_per_client") or {}
        undefined = n - sum(1 for v in per_client.values() if v is not None and np.isfinite(v))
    if strategy == "fesem":
        sizes = server.get("cluster_sizes")
        out["diag"] = {"cluster_sizes": sizes, "nonempty": int(sum(1 for s in sizes or [] if s > 0)),
                       "ari": server.get("ari"), "local_acc": last.get("local_test_acc")}
    elif strategy == "jgesr":
        out["diag"] = {"shrink_ratio": server.get("shrink_ratio"), "graph_cv": server.get("graph_cv"),
                       "shrink_ratio_per_round": [(r.get("server") or {}).get("shrink_ratio") for r in curve[1:]],
                       "graph_cv_per_round": [(r.get("server") or {}).get("graph_cv") for r in curve[1:]],
                       **{k: v for k, v in _graph_stats(server.get("graph"), task, n).items() if k != "graph_cv"}}
    elif strategy == "pfedgraph":
        out["diag"] = _graph_stats(server.get("graph"), task, n)
    elif method in MIXING:
        out["diag"] = {"global_acc": last.get(f"global_{key}"), "mix_aggregated_acc": last.get(f"mix_aggregated_{key}")}
    elif method == FINE_TUNED:
        out["diag"] = {"global_acc": last.get(key)}
    if undefined is not None:
        nonfinite = max(two_class_clients(task, n, seed, dirichlet) - (n - undefined), 0)
        out["diag"] = {**(out.get("diag") or {}), "auc_undefined": undefined, "auc_nonfinite": nonfinite,
                       "clients": n}
    logger.info("%s %s alpha %g seed %d %s: %s %.4f%s", method, task, dirichlet, seed, params, form.metric,
                out["final"] if out["final"] is not None else float("nan"),
                "" if undefined is None else f" ({undefined} of {n} clients without a defined {form.metric})")
    return out


def _task(cell: Cell) -> str:
    task: str = cell.at["task"]
    return validation_task(task) if cell.split == "val" else task


def _args(cell: Cell, form: Form) -> tuple[Any, ...]:
    return cell.method, _task(cell), form, cell.seed, float(cell.at["dirichlet"]), cell.settings


def _best(scores: dict[Any, float | None], fallback: Any) -> Any:
    finite = {k: v for k, v in scores.items() if v is not None and np.isfinite(v)}
    return max(finite, key=lambda k: finite[k]) if finite else fallback


def gate_candidates(method: str, form: Form) -> list[tuple[tuple[str, Any], ...]]:
    """The own settings tried for a gate-family method, the default first.

    APFL: ``α`` over :attr:`Form.apfl_alpha` (+ adaptive from 0.5); FedGATE: ``τ`` over
    :attr:`Form.gate_tau`; APFLGate: the product of both.
    """
    mix: list[tuple[tuple[str, Any], ...]] = [(("alpha", APFL_DEFAULT_ALPHA),)]
    mix += [(("alpha", float(a)),) for a in form.apfl_alpha if float(a) != APFL_DEFAULT_ALPHA]
    if form.apfl_adaptive:
        mix.append((("adaptive", True), ("alpha", APFL_DEFAULT_ALPHA)))
    taus: list[tuple[tuple[str, Any], ...]] = [(("tau", GATE_DEFAULT_TAU),)]
    taus += [(("tau", float(t)),) for t in form.gate_tau if float(t) != GATE_DEFAULT_TAU]
    if method == "APFL":
        return mix
    if method == "FedGATE":
        return taus
    return [m + t for m in mix for t in taus]


def _label(candidate: tuple[tuple[str, Any], ...]) -> str:
    return ",".join(f"{k}={'adaptive' if v is True else format(v, 'g')}" for k, v in candidate)


def refine_for(form: Form) -> Callable[[str, dict[str, Any], Callable[[dict[str, Any]], float | None]],
                                       tuple[dict[str, Any], dict[str, Any]]]:
    """The second tuning stage: each method's own hyperparameters at its tuned step (validation only)."""
    graph_form = dataclasses.replace(bj.QUICK, lam_grid=form.lam_grid, alpha_grid=form.alpha_grid,
                                     beta_grid=form.beta_grid, graph_search=form.graph_search)

    def refine(method: str, params: dict[str, Any], evaluate: Callable[[dict[str, Any]], float | None]
               ) -> tuple[dict[str, Any], dict[str, Any]]:
        if method == "JGESR":
            g = bj.tune_graph(graph_form, lambda point: evaluate({**params, "graph": point}))
            return {**params, "graph": (g["lam"], g["alpha"], g["beta"])}, g
        if method == "FeSEM":
            scores = {k: evaluate({**params, "k": k}) for k in form.fesem_k}
            k = _best(scores, FESEM_DEFAULT_K)
            return {**params, "k": k}, {"k": k, "validation_acc": {str(a): v for a, v in scores.items()}}
        if method == "pFedGraph":
            al = {a: evaluate({**params, "alpha": a}) for a in form.pfedgraph_alpha}
            a = _best(al, PFEDGRAPH_DEFAULT_ALPHA)
            return {**params, "alpha": a}, {"alpha": a, "validation_acc": {f"{x:g}": v for x, v in al.items()}}
        if method in MIXING or method in GATE_TAU:
            grid = gate_candidates(method, form)
            tried = {c: evaluate({**params, **dict(c)}) for c in grid}
            best = dict(_best(tried, grid[0]))
            return {**params, **best}, {**best, "validation_acc": {_label(c): v for c, v in tried.items()}}
        return params, {}

    return refine


def declare(form: Form, seed: int) -> Bench:
    """The sweep on the harness: points (task, Dirichlet α); step then own hyperparameters tuned per point."""
    unknown = [m for m in form.methods if m not in METHODS]
    if unknown:
        raise ValueError(f"bench {NAME}: unknown methods {unknown}; valid: {list(METHODS)}")
    bad = [t for t in form.tasks if t not in (*TASKS, *OTHER_TASKS)]
    if bad:
        raise ValueError(f"bench {NAME}: unknown tasks {bad}; valid: {[*TASKS, *OTHER_TASKS]}")
    if form.metric not in METRICS:
        raise ValueError(f"bench {NAME}: unknown metric {form.metric!r}; valid: {list(METRICS)}")
    if any(m in GATE_TAU for m in form.methods):
        problem = tau_grid_problem(form)
        if problem:
            raise ValueError(f"bench {NAME}: {problem}")
    pairs = pair_list(form)
    label, scale, fmt = METRICS[form.metric]

    def key(cell: Cell) -> dict[str, Any]:
        return {"bench": NAME, "method": cell.method, **run_values(*_args(cell, form))}

    return Bench(
        name=NAME, title=title(form),
        methods=form.methods, points=points(form), seeds=[seed + k for k in range(form.seeds)],
        metrics=(Metric(form.metric, label, lower_is_better=False, fmt=fmt, scale=scale),),
        run_cell=lambda cell: run_one(*_args(cell, form)), key=key,
        final=lambda r: {form.metric: r.get("final")},
        failed=lambda r: run_failure(r, form),
        tuning=Tuning(param="lr", grid=form.lr_grid, metric=form.metric, lower_is_better=False,
                      max_extensions=form.max_extensions, below_if_all_fail=form.step_below_if_all_fail,
                      if_all_fail=form.lr_grid[0], refine=refine_for(form)),
        pairs=pairs,
        cost=lambda cell: 0.05 if cell.method in CONSTANTS else 2.0 if cell.method in ("JGESR", *MIXING) else 1.0)


def run_failure(result: dict[str, Any], form: Form) -> str | None:
    """Why a run's result is a failed setting, or ``None``: an error, no final score, or (``auc``)
    a client whose test split holds both classes but who has no finite ROC-AUC (``auc_nonfinite``:
    its outputs were not finite, the run diverged there), or a ROC-AUC defined on fewer than
    :data:`MIN_DEFINED_CLIENTS` of the run's clients.
    """
    if result.get("error"):
        return str(result["error"])
    if result.get("final") is None:
        return "no final accuracy" if form.metric == "acc" else f"no final {form.metric}"
    diag = result.get("diag") or {}
    if form.metric != "auc":
        return None
    nodes = int(diag.get("clients", form.nodes))
    nonfinite = diag.get("auc_nonfinite")
    if nonfinite:
        return (f"no finite ROC-AUC on {nonfinite} client(s) whose test split holds both classes "
                "(non-finite outputs: the run diverged there)")
    undefined = diag.get("auc_undefined")
    if undefined is not None and nodes - int(undefined) < MIN_DEFINED_CLIENTS:
        return (f"ROC-AUC defined on {nodes - int(undefined)} of {nodes} clients (one-class test splits "
                "or non-finite outputs): not a mean over clients")
    return None


def pair_list(form: Form) -> list[tuple[str, str]]:
    """The paired comparisons ``(method, reference)``: every method against FedAvg and Local;
    APFLGate against APFL (what gradient tracking adds to APFL's mixture); the mixing methods
    and FedGATE against FedAvg-FT (what they add to local fine-tuning of the global model) and
    against :data:`UNIFORM` (what their client side adds to their server's uniform average).
    """
    refs = [r for r in REFERENCES if r in form.methods]
    pairs = [(m, r) for r in refs for m in form.methods if m != r]
    if {"APFLGate", "APFL"} <= set(form.methods):
        pairs.append(("APFLGate", "APFL"))
    if FINE_TUNED in form.methods:
        pairs += [(m, FINE_TUNED) for m in (*MIXING, "FedGATE") if m in form.methods]
    if UNIFORM in form.methods:
        pairs += [(m, UNIFORM) for m in (*MIXING, "FedGATE") if m in form.methods]
    return pairs


def title(form: Form) -> str:
    """The result's title: graph-aware or personalised methods."""
    kind = "personalised" if set(form.methods) & {*MIXING, *GATE_TAU} else "graph-aware"
    return f"When {kind} FL helps: Dirichlet label skew × methods ({', '.join(form.tasks)})"


def unspecified(form: Form) -> list[str]:
    """The sizes and choices of this run, as written in the result."""
    clients = (f"clients: digits {nodes_for(form, 'digits')}, digits-permuted {nodes_for(form, 'digits-permuted')} "
               "(3 planted groups, labels permuted per group)")
    if set(form.tasks) <= set(OTHER_TASKS):
        clients = f"{form.nodes} clients; each client's test split is its share of the scaffold test set (task bbbp)"
    lines = [
        f"tasks {list(form.tasks)}; {clients}; Dirichlet alpha "
        f"{list(form.dirichlet)} label split; local train/test split 80/20",
        f"{form.rounds} rounds, {form.local_steps} local SGD steps of batch {form.batch_size} per round (plain SGD, "
        f"momentum 0), the same for every method; engine {form.engine}; clean uplink (no channel noise)",
    ]
    own = []
    if "FeSEM" in form.methods:
        own.append(f"FeSEM K from {list(form.fesem_k)}")
    if "pFedGraph" in form.methods:
        own.append(f"pFedGraph alpha from {list(form.pfedgraph_alpha)}")
    if "JGESR" in form.methods:
        own.append(f"JGESR (lambda, alpha, beta) over {list(form.lam_grid)} x {list(form.alpha_grid)} x "
                   f"{list(form.beta_grid)} ({form.graph_search} search, as bench jgesr)")
    mixing = f"alpha from {list(form.apfl_alpha)}" + (" or adaptive alpha_i (from 0.5)" if form.apfl_adaptive else "")
    taus = f"tau from {[f'{t:g}R' for t in form.gate_tau]}"
    if "APFL" in form.methods:
        own.append(f"APFL {mixing}")
    if "FedGATE" in form.methods:
        own.append(f"FedGATE {taus}")
    if "APFLGate" in form.methods:
        own.append(f"APFLGate ({mixing}) x ({taus})")
    below = " (or below the smallest step tried while every step failed)" if form.step_below_if_all_fail else ""
    extend = (f", extended past a winning edge{below} by factor 3 up to {form.max_extensions} times, for every method "
              "alike" if form.max_extensions else "")
    val_label = "accuracy" if form.metric == "acc" else METRICS[form.metric][0]
    lines.append(f"per grid point: step per method from {list(form.lr_grid)}{extend} on validation ({VALIDATION_FRACTION:.0%} "
                 f"of each client's training data, first seed) by mean validation {val_label}; then at that step "
                 + ", ".join(own or ["nothing else"]) + "; constants have no step "
                 "(their tuning rows are meaningless)")
    if any(m in form.methods for m in ("FeSEM", "JGESR", "pFedGraph")):
        lines.append("JGESR: PDCA solver, graph scale sum_{i<j} w_ij = n; FeSEM: k-means++ warm-up, prox 0, E-step "
                     "every round; pFedGraph: clip 0.9, lam 0.01")
    if any(m in form.methods for m in (*MIXING, *GATE_TAU)):
        lines.append(f"gate family: tau read as a multiple of R = {form.local_steps} local steps (tau-mode {TAU_MODE}; "
                     "tau <= R/2 is unstable by construction and refused, ALGORITHMS.md §0.1 C5); server step gamma 1; "
                     "APFL/APFLGate personal output with the locally trained copy w_i (personal-output local-copy, C6), "
                     "v_i from the initial global model, same minibatch and step as w_i; metric: APFL/APFLGate the "
                     "personal mixture alpha_i h(v_i) + (1 - alpha_i) h(w_i) per client, FedGATE the global model; "
                     "the mixture with the aggregated w and the global model kept as diagnostics")
    if UNIFORM in form.methods:
        lines.append("FedAvg-uniform: FedAvg with uniform client weights (fedavg.weighted = false), the gate family's "
                     "server average; FedAvg weights clients by their training samples")
    if FINE_TUNED in form.methods:
        lines.append("FedAvg-FT: FedAvg runs with train.eval-local = true (training identical to FedAvg's), scored on each "
                     "client's model after the last round's local steps from the global model (the client's trained w_i "
                     "of the final round, before aggregation) on that client's test split; its step is tuned on "
                     "validation on this metric (its own tuning, not FedAvg's step)")
    if form.metric == "auc":
        lines += [f"metric: ROC-AUC of the class-1 score per client on its test split, averaged over the clients whose "
                  f"test split holds both classes (the task's test_auc, as bench apflgate reads it; a client with one "
                  f"class has no ROC-AUC and is left out, the count per run in the diagnostics), after the last round, "
                  f"{form.seeds} seeds, paired per-seed differences; Const-pooled: any constant predictor, ROC-AUC 0.5 "
                  "by definition (every score ties)",
                  "model: the task's GIN (3 layers x 64)"]
        return lines
    lines += [f"metric: mean over clients of the test accuracy after the last round, {form.seeds} seeds, paired per-seed "
              "differences against FedAvg and against Local",
              "model: MLP 64-64-10 (the digits task's)"]
    return lines


def form_named(quick: bool, form: str | None) -> Form:
    """The form to run: ``form`` from :data:`FORMS` when named, else :data:`QUICK` or :data:`FULL`."""
    if form is None:
        return QUICK if quick else FULL
    if form not in FORMS:
        raise ValueError(f"bench {NAME}: unknown form {form!r}; valid: {sorted(FORMS)}")
    return FORMS[form]


def unused_fields(form: Form) -> set[str]:
    """Fields of ``form`` that none of its methods reads (left out of the result's config)."""
    unused = set()
    if not set(form.methods) & {*MIXING, *GATE_TAU}:
        unused |= {"apfl_alpha", "apfl_adaptive", "gate_tau"}
    if not form.max_extensions:
        unused.add("max_extensions")
    if not form.step_below_if_all_fail:
        unused.add("step_below_if_all_fail")
    if not set(form.methods) & {"FeSEM", "JGESR", "pFedGraph"}:
        unused |= {"fesem_k", "pfedgraph_alpha", "lam_grid", "alpha_grid", "beta_grid", "graph_search"}
    if "digits-permuted" not in form.tasks:
        unused.add("permuted_nodes")
    if form.metric == "acc":
        unused.add("metric")
    return unused


def run(quick: bool = False, seed: int = 0, out: Path | None = None, form: str | None = None) -> dict[str, Any]:
    """Tune and run the sweep; write ``<out>/heterogeneity.{json,md,png}``.

    ``form`` names one of :data:`FORMS` (then ``quick`` is ignored); otherwise the quick or full form.
    """
    chosen = form_named(quick, form)
    bench = declare(chosen, seed)
    outcome = run_bench(bench, out)
    diagnostics = _diagnostics(bench, outcome.runs)
    config = {**{k: list(v) if isinstance(v, tuple) else v for k, v in chosen.__dict__.items()
                 if k not in unused_fields(chosen)},
              "nodes_per_task": {t: nodes_for(chosen, t) for t in chosen.tasks}, "tuning_seed": seed,
              "validation_fraction": VALIDATION_FRACTION, **({"form": form} if form else {})}
    doc = build_doc(bench, outcome, quick, config, extra={"diagnostics": diagnostics, "settings": unspecified(chosen)})
    if out is not None:
        _write(Path(out), doc, chosen)
    return doc


def _diagnostics(bench: Bench, runs: dict[Any, list[dict[str, Any] | None]]) -> list[dict[str, Any]]:
    """Per (point, graph-aware method): each seed's last-round diagnostics and their mean ± sd."""
    out = []
    for (point, method), per_seed in runs.items():
        diags = [(r or {}).get("diag") for r in per_seed]
        if not any(diags):
            continue
        entry: dict[str, Any] = {"point": dict(point), "method": method, "per_seed": diags}
        for k in ("graph_cv", "shrink_ratio", "within", "nonempty", "ari", "local_acc", "global_acc",
                  "mix_aggregated_acc"):
            vals = [d.get(k) for d in diags if d and d.get(k) is not None]
            if vals:
                entry[k] = mean_sd([float(v) for v in vals])
        entry["cluster_sizes"] = [d.get("cluster_sizes") for d in diags if d]
        if method == "pFedGraph":
            entry["identity_graph_seeds"] = sum(1 for d in diags if d and "graph_cv" in d and d["graph_cv"] is None)
        out.append(entry)
    return out


def _num(stat: dict[str, Any] | None, fmt: str = ".2f", scale: float = 1.0) -> str:
    return "–" if not stat or stat.get("mean") is None else fmt_pm(stat, fmt, scale=scale)


def _diff(doc: dict[str, Any], a: str, b: str, point: dict[str, Any], metric: str = "acc") -> str:
    try:
        st = pair(doc, a, b, **point)["metrics"][metric]
    except KeyError:
        return "–"
    if st.get("mean") is None:
        return "–"
    _, scale, fmt = METRICS[metric]
    return (f"{scale * st['mean']:+{fmt}} ± {scale * (st.get('sd') or 0.0):{fmt}} "
            f"({st['first_better']}/{st['seeds']})")


def _write(out: Path, doc: dict[str, Any], form: Form) -> None:
    sections: list[str] = []
    metric = form.metric
    label, scale, fmt = METRICS[metric]
    heading = "mean client test accuracy (%)" if metric == "acc" else f"mean client test {label} (clients with both classes)"
    units = "points of accuracy" if metric == "acc" else label
    for task in form.tasks:
        rows = []
        for method in form.methods:
            row: dict[str, Any] = {"method": method}
            for a in form.dirichlet:
                row[f"α={a:g}"] = _num(result(doc, method, task=task, dirichlet=float(a))["metrics"][metric], fmt, scale)
            rows.append(row)
        sections += [f"## {task}: {heading} by Dirichlet α", "", markdown_table(rows, list(rows[0])), ""]
        if metric != "acc":
            urow = []
            for method in form.methods:
                urow.append({"method": method, **{f"α={a:g}": _undefined(doc, method, {"task": task, "dirichlet": float(a)})
                                                  for a in form.dirichlet}})
            sections += [f"### {task}: clients left out of the mean ({label} undefined: a test split with one class, or "
                         "non-finite outputs), "
                         f"per seed, of {nodes_for(form, task)}", "", markdown_table(urow, list(urow[0])), ""]
        pairs = pair_list(form)
        for ref in dict.fromkeys(r for _, r in pairs):
            prow = []
            for method in [m for m, r in pairs if r == ref]:
                prow.append({"method": f"{method} − {ref}", **{
                    f"α={a:g}": _diff(doc, method, ref, {"task": task, "dirichlet": float(a)}, metric)
                    for a in form.dirichlet}})
            sections += [f"### {task}: paired differences against {ref} ({units}, mean ± sd; "
                         "seeds where the method is better / seeds)", "", markdown_table(prow, list(prow[0])), ""]
    drows = []
    prows = []
    view_label = "accuracy (%)" if metric == "acc" else label
    for d in doc["diagnostics"]:
        if d["method"] in (*MIXING, FINE_TUNED):
            prows.append({"task": d["point"]["task"], "α": f"{d['point']['dirichlet']:g}", "method": d["method"],
                          "personal output, local w_i (the metric)": _num(
                              result(doc, d["method"], **d["point"])["metrics"][metric], fmt, scale),
                          "mixture with aggregated w": _num(d.get("mix_aggregated_acc"), fmt, scale),
                          "global model w": _num(d.get("global_acc"), fmt, scale)})
            continue
        if d["method"] not in ("FeSEM", "JGESR", "pFedGraph"):
            continue
        drows.append({"task": d["point"]["task"], "α": f"{d['point']['dirichlet']:g}", "method": d["method"],
                      "graph_cv": _num(d.get("graph_cv"), ".3f"), "shrink_ratio": _num(d.get("shrink_ratio"), ".3f"),
                      "within-group share": _num(d.get("within"), ".3f"),
                      "non-empty clusters": _num(d.get("nonempty"), ".1f"), "ARI": _num(d.get("ari"), ".3f"),
                      "seeds with graph = I": str(d["identity_graph_seeds"]) if "identity_graph_seeds" in d else "–",
                      "cluster sizes (per seed)": "; ".join(str(s) for s in d.get("cluster_sizes") or [] if s),
                      "FeSEM local acc (%)": _num(d.get("local_acc"), ".2f", 100)})
    if drows:
        n_perm = nodes_for(form, "digits-permuted")
        sections += ["## Diagnostics: did a graph-aware method degenerate?", "",
                     "Last round of each test run, mean ± sd over seeds. `graph_cv`: coefficient of variation of "
                     "the learned graph's off-diagonal weights (0 = uniform graph); `shrink_ratio` = ‖ψ − ȳ‖/‖y − ȳ‖ "
                     "(0 = every client gets the mean: FedAvg; 1 = no smoothing); within-group share: the share of "
                     "the graph's off-diagonal weight inside the planted groups of digits-permuted (a uniform graph "
                     f"gives {(n_perm / GROUPS - 1) / (n_perm - 1):.3f}); FeSEM: non-empty clusters, ARI against the "
                     "planted groups, its clients' last local models' accuracy; seeds with graph = I: pFedGraph runs whose "
                     "collaboration graph put all weight on the client itself (it is then Local training).", "",
                     markdown_table(drows, list(drows[0])), ""]
    if prows:
        sections += ["## Personal outputs (C6): the mixture with the locally trained copy and the other views", "",
                     f"Last round of each test run, {view_label}, mean ± sd over seeds: the metric (APFL / APFLGate: "
                     "the mixture with the client's locally trained w_i; FedAvg-FT: w_i itself, the global model after "
                     "the last round's local steps), the mixture with the server's aggregated w, and the global model "
                     "w alone (FedGATE's metric is its global model; FedAvg-FT's global model is FedAvg's at its step).",
                     "",
                     markdown_table(prows, list(prows[0])), ""]
    sections += ["## Settings", ""] + [f"- {s}" for s in doc["settings"]]
    intro = [f"{heading[0].upper()}{heading[1:]} after {form.rounds} rounds, mean ± sd over {form.seeds} seeds; every "
             "method's step and own hyperparameters tuned on validation per grid point (never on test)."]
    if metric == "auc":
        intro.append("A constant predictor's ROC-AUC is 0.5 by definition (Const-pooled): the trivial baseline.")
    panels = []
    for task in form.tasks:
        panels += metric_panels(doc, metric, "dirichlet", where={"task": task}, xlabel="Dirichlet α (log)",
                                ylabel="mean client test accuracy" if metric == "acc" else f"mean client test {label}",
                                logx=True, title=task)
    kind = "personalised" if set(form.methods) & {*MIXING, *GATE_TAU} else "graph-aware"
    write_report(out, doc, intro=intro, sections=sections, panels=panels,
                 plot_title=f"When {kind} FL helps: label skew")


def _undefined(doc: dict[str, Any], method: str, point: dict[str, Any]) -> str:
    """Per seed, how many clients' test metric was undefined in ``method``'s test runs at ``point``."""
    for d in doc["diagnostics"]:
        if d["method"] == method and d["point"] == point:
            return ", ".join("–" if not s or s.get("auc_undefined") is None else str(s["auc_undefined"])
                             for s in d["per_seed"])
    return "–"


def summary(doc: dict[str, Any], methods: Sequence[str] | None = None) -> list[str]:
    """One line per (task, α): each method's mean accuracy (%), for logs and notes."""
    lines = []
    for task in doc["config"]["tasks"]:
        for a in doc["config"]["dirichlet"]:
            metric = doc["config"].get("metric", "acc")
            _, scale, fmt = METRICS[metric]
            cells = [f"{m} {scale * (result(doc, m, task=task, dirichlet=float(a))['metrics'][metric].get('mean') or 0):{fmt}}"
                     for m in (methods or doc["config"]["methods"])]
            lines.append(f"{task} α={a:g}: " + ", ".join(cells))
    return lines
