"""Benchmark B4 ``admm`` (ALGORITHMS.md §6.12, §0.1 C3, §11; original paper §5, seed 001 Fig. 2).

The paper's simulation: ``V`` devices in ``K0 = 5`` equal clusters (the characteristic graph
``G0`` = 5 cliques), ``p = 20``, device ``u`` of cluster ``j`` draws ``n`` samples
``x ~ N(0, I_p)``, ``y = xᵀϑ^(j) + N(0, 1)``, ``ϑ^(j) ~ N(0, p^{-1/2} I_p)``. The given graph
``G`` flips every pair's status in ``G0`` with probability ``ϱ``. Loss ``½(y − θᵀx)²``,
``φ = ℓ1``, λ by 5-fold cross-validation, metric ``‖Θ̂ − Θ*‖²_F / V`` (estimation error).

Methods: **FedADMM** on ``G``; **FedADMM-ES** on the edges of ``G`` kept by the Wald/Bonferroni
test (§6.9) with the default covariance (the σ̂²-scaled Hessian form, C3); **FedADMM-Local-ES** on
the edges of the complete graph kept by the same test; **Oracle** = FedADMM on ``G0``;
**Local** = each device's least-squares fit; **Global** = one pooled least-squares fit. Every
FedADMM variant is reported twice: with λ by CV and at each fixed λ of ``Plan.fixed_lambdas``
(C3: CV can sit at an end of its grid). The edge test itself is scored for every covariance
estimator of :data:`graphfl.p2p.algorithms.admm_math.COVARIANCES` (true edges kept, false edges kept).
Panels: error vs ``ϱ`` (Fig. 3) and vs ``V`` (Fig. 2), log scale; and convergence (Fig. 4):
FedADMM full batch and batch 10 against decentralized (sub)gradient descent on the same
objective eq. 5, full batch (D-GD) and batch 10 (D-SGD), for the same number of iterations
(= communication rounds).

FedADMM runs through :func:`fedadmm`, the one adapter of this module:
:func:`graphfl.p2p.algorithms.admm_math.run_admm_stacked`, the reference iteration of Algorithm 1 on stacked
arrays (equal to ``run_admm_reference`` up to rounding, tested; the p2p algorithm ``admm`` equals
the reference too, tests/test_p2p_admm.py).

Every setting the paper does not give is listed in the result's ``unspecified_settings``.
``--quick``: ``V ≥ 40`` (C3): ``V = 40, n = 50, ϱ ∈ {0.1, 0.5, 0.9}``, ``V = 60`` at
``ϱ ∈ {0.1, 0.9}``, 3 seeds, a 5-value λ grid ``10^{-4..0}`` and fixed ``λ ∈ {0.01, 0.1}``
(one worker process per core, ``GRAPHFL_BENCH_WORKERS`` overrides). Full: the paper's grids A
and B (90 settings) with 3 seeds and a 9-value λ grid; the result records its own time estimate
(``config.expected_seconds_full``). ``--form paper`` (:data:`PAPER_FLIPS`): the paper's devices
``V ∈ {40, 60, 80}`` and sample sizes ``n ∈ {50, 100}`` of grid B, ``n = 50`` at seven ϱ of grid B's
``{0, 0.1, …, 0.9}`` and ``n = 100`` at ``ϱ ∈ {0.1, 0.9}`` (grid A's ``ϱ = 0.1`` and ``0.2`` in the
V panel), 3 seeds, the quick form's λ grid and CV iterations (a cut of the full form sized for the
2-core machine; what it leaves out is in the result's ``cut_settings``).

The benchmark is declared for the harness (:func:`declare`, :mod:`graphfl.bench.harness`): one
*joint* cell per (V, n, ϱ, seed) runs all six methods on one draw, computed by the worker
processes and stored in the run cache ``<out>/cache`` (a killed run continues; the convergence
runs are cached too), the estimate logged. ``run(quick, seed, out)`` writes
``<out>/admm.{json,md,png}`` in the harness's layout (results per setting and method, paired
differences of the error) followed by the figure tables, the edge tests, the convergence and the
claims.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from threadpoolctl import threadpool_limits

from graphfl.common.results import markdown_table, plot_panels
from graphfl.p2p.algorithms.admm_math import (
    COVARIANCES,
    CVResult,
    Dataset,
    Edge,
    LeastSquaresLoss,
    LocalStatistics,
    StepSchedule,
    canonical_edges,
    complete_graph_edges,
    cross_validate_lambda,
    default_step_schedule,
    fused_objective,
    global_estimator,
    kfold_ids,
    local_statistics,
    run_admm_stacked,
    select_edges,
)

from .admm_verdicts import VERDICT_RULES, verdicts
from .admm_verdicts import render as render_verdicts
from .harness import Bench, Cell, Metric, run_bench
from .report import build_doc, write_report
from .runcache import RunCache

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]

NAME = "admm"
K0 = 5
P = 20
LOSS = LeastSquaresLoss()
ADMM_METHODS = ("fedadmm", "fedadmm-es", "fedadmm-local-es", "oracle")
METHODS = ADMM_METHODS + ("local", "global")
CONV_METHODS = ("fedadmm", "fedadmm-b10", "d-gd", "d-sgd")
LABELS = {"fedadmm": "FedADMM", "fedadmm-es": "FedADMM-ES", "fedadmm-local-es": "FedADMM-Local-ES",
          "oracle": "Oracle", "local": "Local", "global": "Global", "fedadmm-b10": "FedADMM (batch 10)",
          "d-gd": "D-GD", "d-sgd": "D-SGD (batch 10)"}
GD_STEPS = (0.01, 0.03, 0.1, 0.3, 1.0)
GD_RULES = ("constant", "sqrt")

UNSPECIFIED = {
    "theta_prior": "ϑ^(j) ~ N(0, p^{-1/2} I_p) read as covariance p^{-1/2} I_p (sd p^{-1/4}), 'as printed' (§6.12)",
    "cluster_layout": "device u belongs to cluster u // (V/5) (equal-size blocks of consecutive ids)",
    "flip_coupling": "one U_ij ~ U[0,1] per pair and seed; pair flipped iff U_ij < ϱ (the ϱ grid reuses the same "
                     "data and nested flips, common random numbers)",
    "rho": "ρ = 1 (ALGORITHMS §6.3, reconstructed)",
    "step": "η̃(t) = c/(t+t0) with c = κ̂, t0 = ⌈κ̂ λ̂_max⌉ from the devices' Hessians (default_step_schedule)",
    "estimation_runs": "error figures: full-batch FedADMM, last iterate after n_iter iterations (the estimator Θ̂ "
                       "is the target; the paper does not say how Figs. 2-3 were solved); solved by "
                       "run_admm_stacked (the reference iteration on stacked arrays)",
    "fixed_lambda": "beside λ by CV every FedADMM variant is also solved at each λ of config.fixed_lambdas "
                    "(same iterations); reported as separate tables, never mixed with the CV numbers",
    "n_iter": "600 iterations (the paper's plots show about 600)",
    "lambda_grid": "λ grid (see config.lambdas); ALGORITHMS §6.3 reconstructs 10^{-4..1}",
    "cv": "5-fold CV per device (kfold_ids), held-out squared loss pooled over devices, each fold fit with "
          "cv_iter full-batch iterations (fewer than the final fit, for time); ties -> largest λ",
    "edge_selection": "α = 0.05 (reconstructed); covariance of θ̂_u: σ̂²_u (X_uᵀX_u)^{-1}, σ̂²_u = RSS_u/(n − p) "
                      "(seed 001's Hessian form {nĤ}^{-1}, scaled by the estimated noise variance, ALGORITHMS "
                      "§0.1 C3); Local-ES: Bonferroni over all V(V-1)/2 pairs; the other covariance estimators are "
                      "scored on the same draws (edge_tests) but not used for fitting",
    "global": "pooled least squares over all devices' samples (eq. 3)",
    "replications": "3 seeds (the paper: 100 replications)",
    "convergence": "Fig. 4 setting: the given graph G at the listed ϱ, λ = FedADMM's CV choice for that seed; "
                   "D-GD / D-SGD = decentralized subgradient descent on eq. 5 "
                   "(θ_i -= η(t)[g_i + λ Σ_j sign(θ_i - θ_j)]), step rule and constant tuned per seed on the "
                   "final training objective F(Θ_T) over GD_STEPS x GD_RULES; distance to Θ̂ = FedADMM full batch "
                   "run 4x longer",
}


@dataclass(frozen=True)
class Plan:
    """Everything one benchmark run does (the resolved config written to the JSON)."""

    flip_settings: tuple[tuple[int, int, float], ...]
    v_settings: tuple[tuple[int, int, float], ...]
    seeds: tuple[int, ...]
    lambdas: tuple[float, ...]
    fixed_lambdas: tuple[float, ...] = (0.01, 0.1)
    cv_folds: int = 5
    cv_iter: int = 150
    n_iter: int = 600
    alpha: float = 0.05
    rho: float = 1.0
    conv_setting: tuple[int, int, float] = (20, 50, 0.1)
    conv_iter: int = 600
    conv_batch: int = 10
    conv_every: int = 5
    workers: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    form: str = ""
    """The form this plan is (:data:`FORMS`); empty for a hand-made plan."""
    cuts: tuple[str, ...] = ()
    """What this plan leaves out of the paper's grids."""

    def iterations_per_graph(self) -> int:
        """FedADMM iterations spent on one graph of one draw: the CV fits, the CV-λ fit, the fixed-λ fits."""
        return self.cv_folds * len(self.lambdas) * self.cv_iter + (1 + len(self.fixed_lambdas)) * self.n_iter

    def settings(self) -> list[tuple[int, int, float]]:
        """All (V, n, ϱ) settings of both panels, deduplicated, in order."""
        out: list[tuple[int, int, float]] = []
        for s in self.flip_settings + self.v_settings + (self.conv_setting,):
            if s not in out:
                out.append(s)
        return out


FORMS = ("quick", "paper", "full")
"""The plans of :func:`make_plan`, smallest first."""
PAPER_V = (40, 60, 80)
PAPER_FLIPS = {50: (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9), 100: (0.1, 0.9)}
"""The ``paper`` form's ϱ values per sample size ``n`` (grid B: ``n ∈ {50, 100}``, ``ϱ ∈ {0, 0.1, …, 0.9}``)."""
PAPER_CUTS = (
    "grid B's ϱ ∈ {0.4, 0.6, 0.8} at n = 50 and every ϱ but 0.1 and 0.9 at n = 100 are left out",
    "grid A (Fig. 2) only where it meets grid B: V ∈ {40, 60, 80} at (n, ϱ) ∈ {(50, 0.1), (50, 0.2), (100, 0.1)}; "
    "V ∈ {20, 100}, n = 200 and (n = 100, ϱ = 0.2) are left out",
    "5-value λ grid 10^{-4..0} and 120-iteration CV fits (the full form: 9 values, 200 iterations)",
    "convergence (Fig. 4) at V = 40, n = 50, ϱ = 0.1 only (grid C: V ∈ {40, 60, 80}, n ∈ {50, 100})",
    "3 seeds (the paper: 100 replications)",
)
"""What the ``paper`` form leaves out of the paper's grids (written to the result)."""


def resolve_form(quick: bool, form: str | None) -> str:
    """The form to run: ``form`` when given (one of :data:`FORMS`), else ``quick`` or ``full``.

    ``quick=True`` with another ``form`` is a contradiction and raises ``ValueError`` naming both.
    """
    if form is None:
        return "quick" if quick else "full"
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r} of benchmark {NAME!r}; valid: {', '.join(FORMS)}")
    if quick and form != "quick":
        raise ValueError(f"--quick and --form {form} contradict each other: give one of them")
    return form


def make_plan(quick: bool, seed: int, form: str | None = None) -> Plan:
    """The plan of a form (:func:`resolve_form`): ``quick`` (``V ≥ 40``, ALGORITHMS §0.1 C3), ``paper``
    (:data:`PAPER_V` × :data:`PAPER_FLIPS`, cuts in :data:`PAPER_CUTS`) or ``full`` (paper grids A and B).
    """
    form = resolve_form(quick, form)
    seeds = (seed, seed + 1, seed + 2)
    workers = max(1, int(os.environ.get("GRAPHFL_BENCH_WORKERS", str(os.cpu_count() or 1))))
    quick_lambdas = (0.0001, 0.001, 0.01, 0.1, 1.0)
    if form == "quick":
        return Plan(flip_settings=tuple((40, 50, f) for f in (0.1, 0.5, 0.9)) + ((60, 50, 0.9),),
                    v_settings=((40, 50, 0.1), (60, 50, 0.1)),
                    seeds=seeds, lambdas=quick_lambdas, cv_iter=120, workers=workers,
                    conv_setting=(40, 50, 0.1), form=form)
    if form == "paper":
        return Plan(flip_settings=tuple((v, n, f) for n, flips in PAPER_FLIPS.items() for v in PAPER_V for f in flips),
                    v_settings=tuple((v, n, f) for n, f in ((50, 0.1), (50, 0.2), (100, 0.1)) for v in PAPER_V),
                    seeds=seeds, lambdas=quick_lambdas, cv_iter=120, workers=workers,
                    conv_setting=(40, 50, 0.1), form=form, cuts=PAPER_CUTS)
    flips = tuple(round(0.1 * k, 1) for k in range(10))
    grid_b = tuple((v, n, f) for v in (40, 60, 80) for n in (50, 100) for f in flips)
    grid_a = tuple((v, n, f) for v in (20, 40, 60, 80, 100) for n in (50, 100, 200) for f in (0.1, 0.2))
    return Plan(flip_settings=grid_b, v_settings=grid_a, seeds=seeds,
                lambdas=(0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0), cv_iter=200, workers=workers,
                conv_setting=(40, 50, 0.1), form=form)


# ---------------------------------------------------------------------------------------------
# the simulation of §6.12
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Simulation:
    """One draw: truths ``Θ*`` (V × p), cluster ids, per-device data, ``G0`` and ``G`` (canonical edges)."""

    theta_star: FloatArray
    clusters: npt.NDArray[np.int64]
    data: list[Dataset]
    true_edges: list[Edge]
    graph_edges: list[Edge]


def simulate(n_devices: int, n_samples: int, flip: float, seed: int, *, p: int = P, k0: int = K0) -> Simulation:
    """Draw the §6.12 simulation (rules and seeding in ``UNSPECIFIED``).

    Truths and data come from ``default_rng([seed, 1, V, n])`` (independent of ``ϱ``), the flips
    from ``default_rng([seed, 2, V])``: pair ``{i, j}`` is flipped iff ``U_ij < ϱ``.
    """
    if n_devices % k0:
        raise ValueError(f"V = {n_devices} must be a multiple of K0 = {k0} (equal-size cliques)")
    if not 0.0 <= flip <= 1.0:
        raise ValueError(f"flip probability must lie in [0, 1], got {flip}")
    rng = np.random.default_rng([seed, 1, n_devices, n_samples])
    centers = rng.normal(0.0, math.sqrt(p ** -0.5), size=(k0, p))
    clusters = np.arange(n_devices, dtype=np.int64) // (n_devices // k0)
    data: list[Dataset] = []
    for u in range(n_devices):
        x = rng.standard_normal((n_samples, p))
        data.append((x, x @ centers[clusters[u]] + rng.standard_normal(n_samples)))
    u_flip = np.random.default_rng([seed, 2, n_devices]).random((n_devices, n_devices))
    true_edges, graph_edges = [], []
    for i in range(n_devices):
        for j in range(i):
            same = bool(clusters[i] == clusters[j])
            if same:
                true_edges.append((i, j))
            if same != bool(u_flip[i, j] < flip):
                graph_edges.append((i, j))
    return Simulation(centers[clusters], clusters, data, canonical_edges(true_edges, n_devices),
                      canonical_edges(graph_edges, n_devices))


def estimation_error(theta: FloatArray, theta_star: FloatArray) -> float:
    """``‖Θ − Θ*‖²_F / V`` (§1.4)."""
    return float(np.sum((theta - theta_star) ** 2) / theta_star.shape[0])


# ---------------------------------------------------------------------------------------------
# the one FedADMM adapter, edge selection and λ by cross-validation
# ---------------------------------------------------------------------------------------------


def fedadmm(
    data: Sequence[Dataset],
    edges: Sequence[Edge],
    lam: float,
    *,
    n_iter: int,
    rho: float = 1.0,
    batch_size: int | None = None,
    seed: int = 0,
    step: StepSchedule | None = None,
    on_iteration: Callable[[int, FloatArray], None] | None = None,
    output: str = "last",
) -> FloatArray:
    """FedADMM on ``edges`` (ℓ1 fusion, least squares): returns ``Θ(T)`` or ``Θ̄`` (``output="average"``).

    The only place this module runs FedADMM: :func:`~graphfl.p2p.algorithms.admm_math.run_admm_stacked`
    (Algorithm 1 of ``run_admm_reference`` on stacked arrays; same step schedule, mini-batch draws
    and output, equal up to rounding).
    """
    if step is None:  # the runner's own default, computed here so that it is not logged on every call
        step = default_step_schedule([LOSS.hessian(np.zeros(x.shape[1]), x, y) for x, y in data])
    res = run_admm_stacked(LOSS, data, edges, lam=lam, rho=rho, phi="l1", n_iter=n_iter, step=step,
                           batch_size=batch_size, seed=seed, on_iteration=on_iteration)
    return res.theta_avg if output == "average" else res.theta


def selected_edges(stats: Sequence[LocalStatistics], candidates: Sequence[Edge], alpha: float) -> list[Edge]:
    """Edges of ``candidates`` kept by the Wald/Bonferroni test (§6.9)."""
    return list(select_edges(stats, candidates, alpha=alpha).kept)


def edge_tests(sim: Simulation, alpha: float) -> dict[str, dict[str, dict[str, int]]]:
    """The edge test under every covariance estimator (:data:`COVARIANCES`), scored against ``G0``.

    ``{covariance: {"es" | "local-es": {"true_tested", "true_kept", "false_tested", "false_kept"}}}``:
    ES tests the given graph's edges, Local-ES every pair.
    """
    out: dict[str, dict[str, dict[str, int]]] = {}
    every = complete_graph_edges(len(sim.data))
    for cov in COVARIANCES:
        stats = [local_statistics(LOSS, x, y, covariance=cov) for x, y in sim.data]  # type: ignore[arg-type]
        out[cov] = {}
        for name, tested in (("es", sim.graph_edges), ("local-es", every)):
            kept = set(selected_edges(stats, tested, alpha))
            true = [e for e in tested if sim.clusters[e[0]] == sim.clusters[e[1]]]
            false = [e for e in tested if sim.clusters[e[0]] != sim.clusters[e[1]]]
            out[cov][name] = {"true_tested": len(true), "true_kept": sum(e in kept for e in true),
                              "false_tested": len(false), "false_kept": sum(e in kept for e in false)}
    return out


def choose_lambda(data: Sequence[Dataset], edges: Sequence[Edge], plan: Plan, seed: int) -> CVResult:
    """λ by ``plan.cv_folds``-fold CV over ``plan.lambdas`` (each fit: :func:`fedadmm`, ``cv_iter`` iterations).

    Device ``u`` splits its own rows with ``kfold_ids`` (RNG ``SeedSequence([seed, 7]).spawn(V)[u]``);
    the held-out loss is the squared loss pooled over devices.
    """
    children = np.random.SeedSequence([seed, 7]).spawn(len(data))
    folds = [kfold_ids(x.shape[0], plan.cv_folds, np.random.default_rng(c)) for (x, _), c in zip(data, children)]

    def solve(lam: float, train: tuple[int, ...]) -> FloatArray:
        sub = [(x[np.isin(f, train)], y[np.isin(f, train)]) for (x, y), f in zip(data, folds)]
        return fedadmm(sub, edges, lam, n_iter=plan.cv_iter, rho=plan.rho, seed=seed)

    def held_out(theta: FloatArray, k: int) -> float:
        total, count = 0.0, 0
        for u, ((x, y), f) in enumerate(zip(data, folds)):
            mask = f == k
            total += int(mask.sum()) * LOSS.value(theta[u], x[mask], y[mask])
            count += int(mask.sum())
        return total / count

    return cross_validate_lambda(plan.lambdas, plan.cv_folds, solve, held_out)


def _edge_quality(edges: Sequence[Edge], sim: Simulation) -> dict[str, int]:
    false = sum(1 for i, j in edges if sim.clusters[i] != sim.clusters[j])
    return {"edges": len(edges), "false_edges": false, "true_edges": len(edges) - false,
            "true_edges_missing": len(sim.true_edges) - (len(edges) - false)}


def run_setting(n_devices: int, n_samples: int, flip: float, seed: int, plan: Plan) -> dict[str, Any]:
    """All six methods on one draw; per method the error, λ, graph quality and seconds."""
    with threadpool_limits(1):  # p x p problems: BLAS threads only cost time
        return _run_setting(n_devices, n_samples, flip, seed, plan)


def _run_setting(n_devices: int, n_samples: int, flip: float, seed: int, plan: Plan) -> dict[str, Any]:
    t_start = time.perf_counter()
    sim = simulate(n_devices, n_samples, flip, seed)
    out: dict[str, Any] = {"V": n_devices, "n": n_samples, "flip": flip, "seed": seed, "methods": {}}
    t0 = time.perf_counter()
    stats = [local_statistics(LOSS, x, y) for x, y in sim.data]  # the default covariance (C3)
    local = np.stack([s.theta for s in stats])
    out["methods"]["local"] = {"error": estimation_error(local, sim.theta_star), "seconds": time.perf_counter() - t0}
    t0 = time.perf_counter()
    pooled = global_estimator(LOSS, sim.data, weighting="sample")
    out["methods"]["global"] = {"error": estimation_error(np.tile(pooled, (n_devices, 1)), sim.theta_star),
                                "seconds": time.perf_counter() - t0}
    graphs = {"fedadmm": sim.graph_edges,
              "fedadmm-es": selected_edges(stats, sim.graph_edges, plan.alpha),
              "fedadmm-local-es": selected_edges(stats, complete_graph_edges(n_devices), plan.alpha),
              "oracle": sim.true_edges}
    solved: dict[tuple[Edge, ...], dict[str, Any]] = {}
    for method, edges in graphs.items():
        key = tuple(edges)
        t0 = time.perf_counter()
        if key not in solved:  # identical graph, data and seed: identical result (e.g. perfect selection)
            if edges:
                cv = choose_lambda(sim.data, edges, plan, seed)
                lam, cv_curve = cv.best_lambda, [float(v) for v in cv.mean_loss]
            else:
                lam, cv_curve = 0.0, []
            theta = fedadmm(sim.data, edges, lam, n_iter=plan.n_iter, rho=plan.rho, seed=seed)
            fixed = {}
            for lam_f in plan.fixed_lambdas:
                th_f = fedadmm(sim.data, edges, lam_f, n_iter=plan.n_iter, rho=plan.rho, seed=seed)
                fixed[repr(float(lam_f))] = estimation_error(th_f, sim.theta_star)
            solved[key] = {"error": estimation_error(theta, sim.theta_star), "lambda": lam, "cv_mean_loss": cv_curve,
                           "fixed_lambda_error": fixed}
        res = solved[key]
        out["methods"][method] = {"error": res["error"], "lambda": res["lambda"], "cv_mean_loss": res["cv_mean_loss"],
                                  "fixed_lambda_error": res["fixed_lambda_error"],
                                  **_edge_quality(edges, sim), "seconds": time.perf_counter() - t0}
    out["edge_tests"] = edge_tests(sim, plan.alpha)
    out["seconds"] = time.perf_counter() - t_start
    out["graph_steps"] = int(sum(n_devices + len(g) for g in {tuple(e) for e in graphs.values()}))
    logger.info("admm V=%d n=%d flip=%.1f seed=%d: %s (%.1f s)", n_devices, n_samples, flip, seed,
                ", ".join(f"{m} {r['error']:.3g}" for m, r in out["methods"].items()), out["seconds"])
    return out


# ---------------------------------------------------------------------------------------------
# convergence: FedADMM vs decentralized (sub)gradient descent on eq. 5
# ---------------------------------------------------------------------------------------------


def decentralized_subgradient(
    data: Sequence[Dataset],
    edges: Sequence[Edge],
    lam: float,
    *,
    n_iter: int,
    step_c: float,
    rule: str,
    batch_size: int | None,
    seed: int,
    on_iteration: Callable[[int, FloatArray], None] | None = None,
) -> FloatArray:
    """D-GD / D-SGD on eq. 5: ``θ_i ← θ_i − η(t)[g_i + λ Σ_{j∈N_i} sign(θ_i − θ_j)]``, ``Θ(0) = 0``.

    ``g_i`` is the full gradient of ``M̂_i`` (``batch_size=None``) or the mean over a batch drawn
    without replacement (``default_rng([seed, 11])``). ``η(t) = c`` (``rule="constant"``) or
    ``c/√(t+1)`` (``"sqrt"``). Each iteration every device sends ``θ_i`` to its neighbours
    (one message per edge direction, as FedADMM's node → neighbour message).
    """
    xs = np.stack([x for x, _ in data])
    ys = np.stack([y for _, y in data])
    v, n, p = xs.shape
    theta = np.zeros((v, p))
    e = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    rng = np.random.default_rng([seed, 11])
    for t in range(n_iter):
        if batch_size is None or batch_size >= n:
            xb, yb = xs, ys
        else:
            idx = np.argsort(rng.random((v, n)), axis=1)[:, :batch_size]
            xb = np.take_along_axis(xs, idx[:, :, None], axis=1)
            yb = np.take_along_axis(ys, idx, axis=1)
        resid = np.einsum("vnp,vp->vn", xb, theta) - yb
        grad = np.einsum("vnp,vn->vp", xb, resid) / xb.shape[1]
        if len(e):
            s = np.sign(theta[e[:, 0]] - theta[e[:, 1]])
            np.add.at(grad, e[:, 0], lam * s)
            np.add.at(grad, e[:, 1], -lam * s)
        eta = step_c if rule == "constant" else step_c / math.sqrt(t + 1)
        theta = theta - eta * grad
        if not np.all(np.isfinite(theta)):
            return np.full((v, p), np.inf)
        if on_iteration is not None:
            on_iteration(t, theta)
    return theta


def _tune_subgradient(sim: Simulation, lam: float, n_iter: int, batch: int | None, seed: int) -> dict[str, Any]:
    """Step rule and constant of D-GD/D-SGD with the lowest final training objective F(Θ_T)."""
    best: dict[str, Any] | None = None
    tried = []
    for rule in GD_RULES:
        for c in GD_STEPS:
            with np.errstate(over="ignore", invalid="ignore"):  # a too-large step diverges: scored as inf
                th = decentralized_subgradient(sim.data, sim.graph_edges, lam, n_iter=n_iter, step_c=c, rule=rule,
                                               batch_size=batch, seed=seed)
                f = fused_objective(LOSS, sim.data, th, sim.graph_edges, lam=lam, phi="l1") if np.all(
                    np.isfinite(th)) else math.inf
            f = f if math.isfinite(f) else math.inf
            tried.append({"rule": rule, "c": c, "objective": f})
            if best is None or f < best["objective"]:
                best = {"rule": rule, "c": c, "objective": f}
    assert best is not None
    return {**best, "tried": tried}


def run_convergence(n_devices: int, n_samples: int, flip: float, seed: int, lam: float, plan: Plan) -> dict[str, Any]:
    """Distance to the estimator and estimation error vs iteration for the four methods (Fig. 4)."""
    with threadpool_limits(1):
        return _run_convergence(n_devices, n_samples, flip, seed, lam, plan)


def _run_convergence(n_devices: int, n_samples: int, flip: float, seed: int, lam: float, plan: Plan) -> dict[str, Any]:
    t_start = time.perf_counter()
    sim = simulate(n_devices, n_samples, flip, seed)
    edges = sim.graph_edges
    hat = fedadmm(sim.data, edges, lam, n_iter=4 * plan.conv_iter, rho=plan.rho, seed=seed)
    every = plan.conv_every

    def recorder(store: list[dict[str, Any]], average: bool) -> Callable[[int, FloatArray], None]:
        """Record Θ(t) (or the running average of Θ(1..t)) every ``every`` iterations."""
        total = np.zeros_like(sim.theta_star)

        def cb(t: int, theta: FloatArray) -> None:
            nonlocal total
            total = total + theta
            if (t + 1) % every == 0 or t == 0:
                th = total / (t + 1) if average else theta
                store.append({"round": t + 1, "dist_to_estimator": estimation_error(th, hat),
                              "estimation_error": estimation_error(th, sim.theta_star)})
        return cb

    curves: dict[str, list[dict[str, Any]]] = {m: [] for m in CONV_METHODS}
    curves["fedadmm-b10-avg"] = []
    tuned: dict[str, Any] = {}
    fedadmm(sim.data, edges, lam, n_iter=plan.conv_iter, rho=plan.rho, seed=seed,
            on_iteration=recorder(curves["fedadmm"], False))
    b10_last, b10_avg = recorder(curves["fedadmm-b10"], False), recorder(curves["fedadmm-b10-avg"], True)

    def both(t: int, theta: FloatArray) -> None:
        b10_last(t, theta)
        b10_avg(t, theta)

    fedadmm(sim.data, edges, lam, n_iter=plan.conv_iter, rho=plan.rho, seed=seed, batch_size=plan.conv_batch,
            on_iteration=both)
    for method, batch in (("d-gd", None), ("d-sgd", plan.conv_batch)):
        tuned[method] = _tune_subgradient(sim, lam, plan.conv_iter, batch, seed)
        decentralized_subgradient(sim.data, edges, lam, n_iter=plan.conv_iter, step_c=tuned[method]["c"],
                                  rule=tuned[method]["rule"], batch_size=batch, seed=seed,
                                  on_iteration=recorder(curves[method], False))
    floats = {"fedadmm": 4 * P * len(edges), "fedadmm-b10": 4 * P * len(edges), "fedadmm-b10-avg": 4 * P * len(edges),
              "d-gd": 2 * P * len(edges), "d-sgd": 2 * P * len(edges)}
    return {"V": n_devices, "n": n_samples, "flip": flip, "seed": seed, "lambda": lam, "curves": curves,
            "tuned": tuned, "floats_per_iteration": floats, "estimator_error": estimation_error(hat, sim.theta_star),
            "seconds": time.perf_counter() - t_start}


# ---------------------------------------------------------------------------------------------
# aggregation, report
# ---------------------------------------------------------------------------------------------


def _mean_sd(values: Sequence[float]) -> tuple[float, float | None]:
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), (float(arr.std(ddof=1)) if arr.size > 1 else None)


def summarise(results: list[dict[str, Any]]) -> dict[tuple[int, int, float], dict[str, Any]]:
    """Mean ± sd over seeds of every method's error (and λ, edges) per setting."""
    by: dict[tuple[int, int, float], list[dict[str, Any]]] = {}
    for r in results:
        by.setdefault((r["V"], r["n"], r["flip"]), []).append(r)
    out: dict[tuple[int, int, float], dict[str, Any]] = {}
    for key, runs in by.items():
        row: dict[str, Any] = {"V": key[0], "n": key[1], "flip": key[2], "seeds": [r["seed"] for r in runs]}
        for m in METHODS:
            errs = [r["methods"][m]["error"] for r in runs]
            mean, sd = _mean_sd(errs)
            entry: dict[str, Any] = {"error": mean, "error_sd": sd, "per_seed": errs}
            if m in ADMM_METHODS:
                entry["lambda"] = [r["methods"][m]["lambda"] for r in runs]
                for k in ("edges", "false_edges", "true_edges_missing"):
                    entry[k] = float(np.mean([r["methods"][m][k] for r in runs]))
                fixed: dict[str, Any] = {}
                for lam in runs[0]["methods"][m]["fixed_lambda_error"]:
                    errs_f = [r["methods"][m]["fixed_lambda_error"][lam] for r in runs]
                    mean_f, sd_f = _mean_sd(errs_f)
                    fixed[lam] = {"error": mean_f, "error_sd": sd_f, "per_seed": errs_f}
                entry["fixed_lambda"] = fixed
            row[m] = entry
        row["edge_tests"] = _sum_edge_tests([r["edge_tests"] for r in runs])
        out[key] = row
    return out


def _sum_edge_tests(per_seed: list[dict[str, dict[str, dict[str, int]]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Edge-test counts summed over seeds, with the shares ``true_kept_share`` and ``false_kept_share``."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for cov, by_test in per_seed[0].items():
        out[cov] = {}
        for name in by_test:
            tot = {k: int(sum(r[cov][name][k] for r in per_seed)) for k in by_test[name]}
            out[cov][name] = {**tot,
                              "true_kept_share": tot["true_kept"] / tot["true_tested"] if tot["true_tested"] else None,
                              "false_kept_share": tot["false_kept"] / tot["false_tested"] if tot["false_tested"] else None}
    return out


def _fmt(entry: dict[str, Any]) -> str:
    sd = entry.get("error_sd")
    return f"{entry['error']:.4f}" + (f" ± {sd:.4f}" if sd is not None else "")


def _combine_curves(runs: list[dict[str, Any]], method: str) -> list[dict[str, Any]]:
    base = runs[0]["curves"][method]
    out = []
    for k, point in enumerate(base):
        d = [r["curves"][method][k]["dist_to_estimator"] for r in runs]
        e = [r["curves"][method][k]["estimation_error"] for r in runs]
        dm, dsd = _mean_sd(d)
        em, esd = _mean_sd(e)
        out.append({"round": point["round"], "dist_to_estimator": dm, "dist_to_estimator_sd": dsd,
                    "estimation_error": em, "estimation_error_sd": esd})
    return out


def _first_below(curve: list[dict[str, Any]], key: str, level: float) -> int | None:
    for point in curve:
        if point[key] <= level:
            return int(point["round"])
    return None


def claims(table: dict[tuple[int, int, float], dict[str, Any]], plan: Plan,
           conv: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The paper's claims, checked on the measured means (booleans plus the numbers behind them)."""
    flip_rows = [table[s] for s in plan.flip_settings]
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for row in flip_rows:
        groups.setdefault((row["V"], row["n"]), []).append(row)
    out: dict[str, Any] = {}
    for (v, n), rows in groups.items():
        rows = sorted(rows, key=lambda r: r["flip"])
        top = rows[-1]
        g: dict[str, Any] = {}
        if len(rows) > 1:
            es = [r["fedadmm-es"]["error"] for r in rows]
            les = [r["fedadmm-local-es"]["error"] for r in rows]
            g["es_max_over_min_across_flip"] = max(es) / min(es)
            g["es_flat_in_flip (max/min < 2)"] = max(es) / min(es) < 2.0
            g["local_es_max_over_min_across_flip"] = max(les) / min(les)
            g["local_es_insensitive_to_flip (max/min < 2)"] = max(les) / min(les) < 2.0
        g[f"es_beats_local_at_flip_{top['flip']}"] = top["fedadmm-es"]["error"] < top["local"]["error"]
        g["es_beats_fedadmm_at_every_flip>0"] = all(r["fedadmm-es"]["error"] <= r["fedadmm"]["error"]
                                                    for r in rows if r["flip"] > 0)
        g["es_beats_local_at_every_flip"] = all(r["fedadmm-es"]["error"] < r["local"]["error"] for r in rows)
        if any(r["flip"] >= 0.2 for r in rows):
            g["fedadmm_worse_than_local_for_flip>=0.2 (λ by CV)"] = all(
                r["fedadmm"]["error"] > r["local"]["error"] for r in rows if r["flip"] >= 0.2)
            for lam in plan.fixed_lambdas:
                key = repr(float(lam))
                g[f"fedadmm_worse_than_local_for_flip>=0.2 (λ = {lam:g} fixed)"] = all(
                    r["fedadmm"]["fixed_lambda"][key]["error"] > r["local"]["error"] for r in rows if r["flip"] >= 0.2)
        out[f"V={v}, n={n}"] = g
    if conv:
        final = {m: c[-1]["dist_to_estimator"] for m, c in conv.items() if c}
        out["final_dist_to_estimator"] = final
        out["fedadmm_full_batch_beats_d_gd"] = final["fedadmm"] < final["d-gd"]
        out["fedadmm_batch10_beats_d_sgd"] = final["fedadmm-b10"] < final["d-sgd"]
        level = 1e-2 * float(np.mean([r["oracle"]["error"] for r in flip_rows]))
        out["iterations_to_dist_below_1pct_of_oracle_error"] = {
            m: _first_below(c, "dist_to_estimator", level) for m, c in conv.items()}
    return out


def expected_seconds(plan: Plan, seconds_per_step: float) -> float:
    """Rough wall time of ``plan`` from a measured cost of one node-or-edge step (expected edge counts)."""
    total = 0.0
    for v, _, f in plan.settings():
        pairs = v * (v - 1) / 2
        e0 = K0 * (v // K0) * (v // K0 - 1) / 2
        eg = e0 * (1 - f) + (pairs - e0) * f
        graphs = {round(eg), round(e0 * (1 - f)), round(e0)}  # G, ES, (Local-ES = Oracle when selection is exact)
        per_fit = plan.iterations_per_graph()
        total += len(plan.seeds) * sum((v + e) * per_fit for e in graphs)
    return total * seconds_per_step / max(1, plan.workers)


RESUMABLE = True
"""An interrupted run continues in the same ``--out`` (finished cells come from ``<out>/cache``)."""
CACHE_VERSION = 1
"""Part of every cached cell's key: bump it when a change of code changes a setting's results."""


def setting_key(cell: Cell, plan: Plan) -> dict[str, Any]:
    """The run-cache key of one draw (setting and seed) and everything of ``plan`` its result depends on."""
    fit = {k: getattr(plan, k) for k in ("lambdas", "fixed_lambdas", "cv_folds", "cv_iter", "n_iter", "alpha", "rho")}
    return {"bench": NAME, **cell.at, "seed": cell.seed, **fit, "version": CACHE_VERSION}


def setting_cell(cell: Cell, plan: Plan) -> dict[str, Any]:
    """One joint cell: every method on the draw of ``cell``'s setting and seed (:func:`run_setting`)."""
    at = cell.at
    return run_setting(at["V"], at["n"], at["flip"], cell.seed, plan)


def setting_cost(cell: Cell, plan: Plan) -> float:
    """Relative cost of a cell: node-or-edge steps of its graphs at the expected edge counts."""
    v, f = cell.at["V"], cell.at["flip"]
    pairs = v * (v - 1) / 2
    e0 = K0 * (v // K0) * (v // K0 - 1) / 2
    eg = e0 * (1 - f) + (pairs - e0) * f
    return float(sum(v + e for e in {round(eg), round(e0 * (1 - f)), round(e0)}))


def _final(part: dict[str, Any], plan: Plan) -> dict[str, Any]:
    out = {k: part.get(k) for k in ("error", "lambda", "edges", "false_edges", "true_edges_missing")}
    for lam in plan.fixed_lambdas:
        out[f"error_lambda={lam:g}"] = (part.get("fixed_lambda_error") or {}).get(repr(float(lam)))
    return out


def _failed(result: dict[str, Any]) -> str | None:
    """A method's share fails when its estimation error is not finite (a whole draw never fails)."""
    if "methods" in result:
        return None
    err = result.get("error")
    return None if err is not None and math.isfinite(err) else f"estimation error {err}"


PAIRS = (("fedadmm-es", "local"), ("fedadmm-es", "fedadmm"), ("fedadmm", "local"), ("fedadmm-local-es", "local"))
"""Paired per-seed differences ``a − b`` of the estimation error (negative = ``a`` better)."""


def declare(plan: Plan) -> Bench:
    """B4 on the harness: points (V, n, ϱ) of both panels; one joint cell per draw runs all six methods."""
    return Bench(
        name=NAME, title="B4: FedADMM estimation error (seed 001 / original paper §5)", methods=METHODS,
        points=[{"V": v, "n": n, "flip": f} for v, n, f in plan.settings()], seeds=list(plan.seeds),
        metrics=(Metric("error", "‖Θ̂ − Θ*‖²/V"), Metric("lambda", "λ (CV)", fmt=".4g", paired=False),
                 Metric("edges", fmt=".1f", paired=False), Metric("false_edges", "false edges", fmt=".1f", paired=False),
                 Metric("true_edges_missing", "true edges missing", fmt=".1f", paired=False),
                 *(Metric(f"error_lambda={lam:g}", f"error at λ = {lam:g}") for lam in plan.fixed_lambdas)),
        run_cell=partial(setting_cell, plan=plan), key=partial(setting_key, plan=plan),
        final=partial(_final, plan=plan), failed=_failed, joint=True, workers=plan.workers, pairs=PAIRS,
        cost=partial(setting_cost, plan=plan))


def convergence_runs(plan: Plan, lam_of: dict[tuple[int, int, float, int], float], out: Path) -> list[dict[str, Any]]:
    """:func:`run_convergence` per seed at ``plan.conv_setting`` (through the run cache in ``<out>/cache``)."""
    cache = RunCache(out / "cache")
    cv_, cn, cf = plan.conv_setting
    jobs = [(cv_, cn, cf, s, lam_of[(cv_, cn, cf, s)]) for s in plan.seeds]

    def key(job: tuple[int, int, float, int, float]) -> dict[str, Any]:
        return {"bench": NAME, "convergence": list(job[:3]), "seed": job[3], "lambda": job[4], "rho": plan.rho,
                "conv_iter": plan.conv_iter, "conv_batch": plan.conv_batch, "conv_every": plan.conv_every,
                "version": CACHE_VERSION}

    def given(res: dict[str, Any]) -> dict[str, Any]:
        return res

    def compute(job: tuple[int, int, float, int, float]) -> dict[str, Any]:
        v, n, f, s, lam = job
        return run_convergence(v, n, f, s, lam, plan)

    todo = [j for j in jobs if not cache.has(key(j))]
    if plan.workers > 1 and len(todo) > 1:
        with ProcessPoolExecutor(max_workers=plan.workers) as pool:
            for job, res in zip(todo, pool.map(run_convergence, *zip(*todo), [plan] * len(todo))):
                cache(key(job), partial(given, res))
    return [cache(key(j), partial(compute, j)) for j in jobs]


SECONDS_PER_STEP_PRIOR = 9e-6
"""Seconds per node-or-edge step assumed by the estimate logged before a run starts (the quick form's
cost per step on the shared 2-core machine); the result records the run's own measured cost."""


def run(quick: bool, seed: int, out: Path, plan: Plan | None = None, form: str | None = None) -> dict[str, Any]:
    """Run B4 and write ``<out>/admm.{json,md,png}``; returns the result dict.

    ``form`` picks the plan (:func:`make_plan`; ``None``: ``quick`` or ``full`` by ``quick``);
    ``plan`` overrides both (for tests).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    plan = plan or make_plan(quick, seed, form)
    form_name = plan.form or ("quick" if quick else "full")
    logger.info("B4 (%s form): %d settings x %d seeds on %d worker(s); estimate before the start: about %.0f min "
                "(at %.0f µs per node/edge step, run cache not counted)", form_name, len(plan.settings()),
                len(plan.seeds), plan.workers, expected_seconds(plan, SECONDS_PER_STEP_PRIOR) / 60,
                SECONDS_PER_STEP_PRIOR * 1e6)
    bench = declare(plan)
    outcome = run_bench(bench, out)
    results = [outcome.joint[(tuple({"V": v, "n": n, "flip": f}.items()), s)]
               for (v, n, f) in plan.settings() for s in plan.seeds]
    table = summarise(results)
    lam_of = {(r["V"], r["n"], r["flip"], r["seed"]): r["methods"]["fedadmm"]["lambda"] for r in results}
    conv_runs = convergence_runs(plan, lam_of, out)
    cv_, cn, cf = plan.conv_setting
    conv = {m: _combine_curves(conv_runs, m) for m in (*CONV_METHODS, "fedadmm-b10-avg")}
    steps = sum(r["graph_steps"] for r in results)
    grid_seconds = sum(r["seconds"] for r in results)
    per_step = grid_seconds / max(1, steps * plan.iterations_per_graph())
    full_plan = make_plan(False, seed)
    checked = claims(table, plan, conv)
    verdict = verdicts(table, plan.flip_settings, plan.v_settings, plan.fixed_lambdas, conv, COVARIANCES[0])
    for name, v in verdict.items():
        logger.info("B4 verdict %s: %s", name, v["verdict"])
    ref = table[plan.flip_settings[0]]
    methods: dict[str, Any] = {}
    for m in METHODS:
        methods[m] = {
            "final": {"estimation_error": ref[m]["error"], "estimation_error_sd": ref[m]["error_sd"],
                      "setting": {"V": ref["V"], "n": ref["n"], "flip": ref["flip"]}},
            "grid": [{"V": row["V"], "n": row["n"], "flip": row["flip"], **row[m]} for row in table.values()],
            "curve": conv.get(m, []),
        }
    edge_test_grid = [{"V": row["V"], "n": row["n"], "flip": row["flip"], **row["edge_tests"]} for row in table.values()]
    for m in ("fedadmm-b10", "fedadmm-b10-avg", "d-gd", "d-sgd"):
        c = conv[m]
        methods[m] = {"final": {"dist_to_estimator": c[-1]["dist_to_estimator"],
                                "estimation_error": c[-1]["estimation_error"]}, "curve": c}
    config = {**asdict(plan), "quick": quick, "form_name": form_name, "p": P, "K0": K0,
              "loss": "least squares ½(y-θᵀx)²", "phi": "l1",
              "adapter": "run_admm_stacked (the reference iteration on stacked arrays, one process)",
              "es_covariance": COVARIANCES[0],
              "figures": {"error_vs_flip": [list(x) for x in plan.flip_settings],
                          "error_vs_V": [list(x) for x in plan.v_settings],
                          "convergence": list(plan.conv_setting), "columns": ["V", "n", "flip"],
                          "cv_lambdas": list(plan.lambdas), "fixed_lambdas": list(plan.fixed_lambdas)},
              "seconds_per_step_measured": per_step,
              "expected_seconds": expected_seconds(plan, per_step),
              "expected_seconds_before_start": expected_seconds(plan, SECONDS_PER_STEP_PRIOR),
              "expected_seconds_full": expected_seconds(full_plan, per_step)}
    doc = build_doc(bench, outcome, quick, config, extra={
        "unspecified_settings": UNSPECIFIED,
        "methods": methods,
        "convergence": {"setting": {"V": cv_, "n": cn, "flip": cf},
                        "per_seed": [{k: r[k] for k in ("seed", "lambda", "tuned", "floats_per_iteration",
                                                       "estimator_error", "seconds")} for r in conv_runs]},
        "claims": checked,
        "verdicts": verdict,
        "verdict_rules": VERDICT_RULES,
        "cut_settings": list(plan.cuts),
        "edge_tests": edge_test_grid,
        "runs": [{k: v for k, v in r.items() if k != "_key"} for r in results],
    })
    doc["seconds"] = time.perf_counter() - t_start
    intro = [f"**{form_name} form** (`graphfl bench admm{'' if form_name == 'full' else ' --form ' + form_name}`): "
             f"{len(plan.settings())} settings (V, n, ϱ) x {len(plan.seeds)} seeds; estimate before the start "
             f"{config['expected_seconds_before_start'] / 60:.0f} min; this invocation's wall time "
             f"{doc['seconds'] / 60:.1f} min with {outcome.estimate.get('cells_cached', 0)} of {len(results)} draws "
             f"from the run cache; the draws' own compute time {grid_seconds / 60:.0f} min summed over "
             f"{plan.workers} worker(s).", "",
             "## Verdicts (one per claim of seed 001 / the original paper §5, ALGORITHMS §6.12; rules in the JSON's "
             "verdict_rules)", "", *render_verdicts(verdict), ""]
    write_report(out, doc, intro=intro, sections=render_markdown(doc, plan, table, conv).split("\n"))
    draw(out / f"{NAME}.png", plan, table, conv)
    return doc


def render_markdown(doc: dict[str, Any], plan: Plan, table: dict[tuple[int, int, float], dict[str, Any]],
                    conv: dict[str, list[dict[str, Any]]]) -> str:
    """Tables: error vs ϱ, error vs V, chosen λ and graphs, convergence, claims."""
    cols = [LABELS[m] for m in METHODS]
    grid = doc["config"]["figures"]
    form = doc["config"].get("form_name") or ("quick" if doc["config"]["quick"] else "full")
    lines = [f"## Setting ({form} form)", "",
             f"p = {P}, K0 = {K0}, seeds {list(plan.seeds)}, λ grid {list(plan.lambdas)} by {plan.cv_folds}-fold CV, "
             f"and fixed λ ∈ {list(plan.fixed_lambdas)}; edge test at α = {plan.alpha} with the "
             f"{doc['config']['es_covariance']!r} covariance; error = ‖Θ̂ − Θ*‖²_F / V, mean ± sd over seeds. "
             f"Wall time {doc['seconds']:.0f} s.", "",
             f"Grid (V, n, ϱ): error vs ϱ {[tuple(x) for x in grid['error_vs_flip']]}; error vs V "
             f"{[tuple(x) for x in grid['error_vs_V']]}; convergence {tuple(grid['convergence'])}.", "",
             "## Error vs ϱ (Fig. 3)", "",
             markdown_table(columns=["V", "n", "ϱ", *cols],
                            rows=[[table[s]["V"], table[s]["n"], table[s]["flip"], *[_fmt(table[s][m]) for m in METHODS]]
                                  for s in plan.flip_settings]), "",
             "## Error vs V (Fig. 2)", "",
             markdown_table(columns=["V", "n", "ϱ", *cols],
                            rows=[[table[s]["V"], table[s]["n"], table[s]["flip"], *[_fmt(table[s][m]) for m in METHODS]]
                                  for s in plan.v_settings]), "",
             "## Graphs and λ (means over seeds)", "",
             markdown_table(columns=["V", "n", "ϱ", "method", "edges", "false edges", "true edges missing", "λ per seed"],
                            rows=[[row["V"], row["n"], row["flip"], LABELS[m], row[m]["edges"], row[m]["false_edges"],
                                   row[m]["true_edges_missing"], ", ".join(f"{x:g}" for x in row[m]["lambda"])]
                                  for row in table.values() for m in ADMM_METHODS]), ""]
    for lam in plan.fixed_lambdas:
        key = repr(float(lam))
        lines += [f"## Error vs ϱ and V at fixed λ = {lam:g} (beside the CV tables; Local, Oracle by CV)", "",
                  markdown_table(columns=["V", "n", "ϱ", *[LABELS[m] for m in ADMM_METHODS], "Local", "Oracle (CV λ)"],
                                 rows=[[row["V"], row["n"], row["flip"],
                                        *[_fmt(row[m]["fixed_lambda"][key]) for m in ADMM_METHODS],
                                        _fmt(row["local"]), _fmt(row["oracle"])] for row in table.values()]), ""]
    test_rows = []
    for row in table.values():
        for cov, by_test in row["edge_tests"].items():
            test_rows.append([row["V"], row["n"], row["flip"], cov,
                              *[f"{t['true_kept']}/{t['true_tested']}" for t in (by_test["es"], by_test["local-es"])],
                              *[f"{t['false_kept']}/{t['false_tested']}" for t in (by_test["es"], by_test["local-es"])]])
    lines += ["## Edge test by covariance estimator (summed over seeds)", "",
              f"The fits above use {doc['config']['es_covariance']!r}; ES tests the given graph's edges, Local-ES every "
              f"pair (Bonferroni over the tested edges, α = {plan.alpha}).", "",
              markdown_table(columns=["V", "n", "ϱ", "covariance", "ES true kept", "Local-ES true kept",
                                      "ES false kept", "Local-ES false kept"], rows=test_rows), ""]
    if conv:
        marks = [1, 10, 50, 100, 200, 400, plan.conv_iter]
        rows = []
        for m in (*CONV_METHODS, "fedadmm-b10-avg"):
            by_round = {p["round"]: p for p in conv[m]}
            rows.append([LABELS.get(m, "FedADMM (batch 10), running average Θ̄")]
                        + [by_round[r]["dist_to_estimator"] if r in by_round else None for r in marks])
        s = doc["convergence"]["setting"]
        lines += [f"## Convergence (Fig. 4): ‖Θ(t) − Θ̂‖²_F / V at V = {s['V']}, n = {s['n']}, ϱ = {s['flip']}", "",
                  "Θ̂ = FedADMM full batch run 4x longer; λ = FedADMM's CV choice per seed; D-GD/D-SGD step tuned "
                  "on the final training objective. Per iteration FedADMM sends 4p floats per edge, D-GD 2p.", "",
                  markdown_table(columns=["method", *[f"t={r}" for r in marks]], rows=rows), ""]
    lines += ["## The paper's claims, as measured", ""]
    for k, v in doc["claims"].items():
        if isinstance(v, dict) and k.startswith("V="):
            lines.append(f"- {k}:")
            lines += [f"  - {k2}: {v2}" for k2, v2 in v.items()]
        else:
            lines.append(f"- {k}: {v}")
    lines += ["", "## Settings the paper does not give", ""]
    lines += [f"- {k}: {v}" for k, v in doc["unspecified_settings"].items()]
    if plan.cuts:
        lines += ["", f"## Cut settings (what the {form} form leaves out)", ""] + [f"- {c}" for c in plan.cuts]
    lines += ["", f"Expected wall time of the full grid on this machine: about "
              f"{doc['config']['expected_seconds_full'] / 3600:.1f} h with {plan.workers} worker(s), extrapolated from "
              f"this run's measured cost per node/edge step ({doc['config']['seconds_per_step_measured'] * 1e6:.0f} µs; "
              f"a busy machine inflates it). Set GRAPHFL_BENCH_WORKERS to use more cores.", ""]
    return "\n".join(lines)


def draw(path: Path, plan: Plan, table: dict[tuple[int, int, float], dict[str, Any]],
         conv: dict[str, list[dict[str, Any]]]) -> None:
    """Panels (log y): error vs ϱ with λ by CV (one per V with at least 3 ϱ values at the first n), error
    vs ϱ at the largest fixed λ, error vs V, distance to Θ̂ vs iteration.
    """
    def series(settings: Sequence[tuple[int, int, float]], x: str) -> dict[str, list[dict[str, Any]]]:
        return {LABELS[m]: [{x: table[s][x], "error": table[s][m]["error"], "sd": table[s][m]["error_sd"] or 0.0}
                            for s in settings] for m in METHODS}

    n_flip = sorted({(v, n) for v, n, _ in plan.flip_settings})
    v0, n0 = n_flip[0]
    flip_settings = [s for s in plan.flip_settings if s[:2] == (v0, n0)]
    more_v = [(v, [s for s in plan.flip_settings if s[:2] == (v, n0)]) for v in sorted({v for v, n in n_flip if n == n0})
              if v != v0]
    more_panels = [{"x": "flip", "y": "error", "band": "sd", "series": series(ss, "flip"), "logy": True,
                    "xlabel": "flip probability ϱ", "ylabel": "‖Θ̂−Θ*‖²/V", "title": f"λ by CV, V={v}, n={n0}"}
                   for v, ss in more_v if len(ss) >= 3]
    vn = sorted({(n, f) for _, n, f in plan.v_settings})
    n1, f1 = vn[0]
    v_settings = [s for s in plan.v_settings if (s[1], s[2]) == (n1, f1)]
    conv_series = {LABELS.get(m, "FedADMM (batch 10), Θ̄"): c for m, c in conv.items()}
    lam_f = plan.fixed_lambdas[-1] if plan.fixed_lambdas else None
    fixed_panel: list[dict[str, Any]] = []
    if lam_f is not None:
        key = repr(float(lam_f))
        fixed_series = {f"{LABELS[m]} (λ={lam_f:g})": [{"flip": table[s]["flip"],
                                                        "error": table[s][m]["fixed_lambda"][key]["error"],
                                                        "sd": table[s][m]["fixed_lambda"][key]["error_sd"] or 0.0}
                                                       for s in flip_settings] for m in ADMM_METHODS}
        fixed_series["Local"] = series(flip_settings, "flip")["Local"]
        fixed_panel = [{"x": "flip", "y": "error", "band": "sd", "series": fixed_series, "logy": True,
                        "xlabel": "flip probability ϱ", "ylabel": "‖Θ̂−Θ*‖²/V",
                        "title": f"fixed λ = {lam_f:g}, V={v0}, n={n0}"}]
    plot_panels(path, [
        {"x": "flip", "y": "error", "band": "sd", "series": series(flip_settings, "flip"), "logy": True,
         "xlabel": "flip probability ϱ", "ylabel": "‖Θ̂−Θ*‖²/V", "title": f"λ by CV, V={v0}, n={n0}"},
        *more_panels,
        *fixed_panel,
        {"x": "V", "y": "error", "band": "sd", "series": series(v_settings, "V"), "logy": True,
         "xlabel": "number of devices V", "ylabel": "‖Θ̂−Θ*‖²/V", "title": f"n={n1}, ϱ={f1}"},
        {"x": "round", "y": "dist_to_estimator", "series": conv_series, "logy": True,
         "xlabel": "iteration (communication round)", "ylabel": "‖Θ(t)−Θ̂‖²/V",
         "title": "V={}, n={}, ϱ={}".format(*plan.conv_setting)},
    ], title="B4: FedADMM (seed 001 / original paper §5)")
