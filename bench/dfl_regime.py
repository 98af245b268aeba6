"""Benchmark ``dfl-regime``: where DFL-GT beats DFL-SGD on the global model (seed 000 §10.2).

Theory (seed 000 §10.2 via its ref. [21]; ALGORITHMS §2–§3): with a **constant** step ``α`` the
fixed point of DFL-SGD (``θ_i = Σ_j W_ij θ_j − α ∇f_i(θ_i)``) keeps the nodes apart by
``O(α ζ / (1 − λ₂(W)))`` (``ζ``: spread of the local gradients at the optimum); averaging the
fixed-point equation gives ``Σ_i ∇f_i(θ_i) = 0``, so the node average ``θ̄`` is off the optimum
only where the local Hessians ``H_i`` differ (``θ̄ − θ* = −(Σ H_i)⁻¹ Σ H_i (θ_i − θ̄)``); gradient
tracking's fixed point has ``θ_i = θ*`` exactly. With a decaying step both biases vanish.

Problem (least squares, one linear model, no intercept). Seed ``s`` draws ``w* ~ N(0, I_d)``;
node ``i`` has its own true parameter ``w_i = w* + h u_i`` (``u_i ~ N(0, I_d)``; ``h`` the
heterogeneity level) and its own input scales ``x_k ~ N(0, s_ik²)``, ``s_ik = exp(SCALE_SPREAD
z_ik)`` (different Hessians, so DFL-SGD's node spread reaches ``θ̄``); ``y = xᵀ w_i + N(0,
NOISE²)``; :data:`TRAIN_ROWS` training and :data:`TEST_ROWS` test rows per node. Validation
split: the first 80 % of the training rows train, the last 20 % evaluate (the test rows are
never used for a choice).

Methods (all through the registered p2p step functions on the vectorised engine,
:func:`graphfl.p2p.vectorised.run_vectorised`; ``tau = 1``): DFL-SGD and DFL-GT on the
topology's Metropolis matrix, FedAvg = DFL-SGD with ``W = (1/n) 1 1ᵀ``, local-only = DFL-SGD with
``W = I``. Batch ``full`` = every training row every step (deterministic gradients), ``small`` =
:data:`SMALL_BATCH` rows drawn with replacement.

Step (ALGORITHMS §0.1 C1). Per cell (heterogeneity, topology, step rule, batch) one ``α0`` for
DFL-SGD and DFL-GT together, chosen from :data:`GRID` by the mean of the two methods'
global-model validation MSE (first seed; a value where either leaves the finite range is not
eligible); FedAvg and local-only are tuned on the same grid each on its own (baselines).

Metrics (test split, chosen step, seeds, mean ± sd): the global model ``θ̄``'s test MSE on all
nodes' test rows (final = mean over the last 10 % of evaluation points; over run = mean over all
evaluation points), its excess training objective ``F(θ̄) − F(θ*)`` (``F = (1/n) Σ f_i``,
``θ*`` its exact minimiser), the consensus violation ``(1/n) Σ ‖θ_i − θ̄‖²`` at the end; paired
per-seed differences GT − SGD. Verdict per cell (:func:`cell_verdict`): ``GT wins`` when GT's
final global test MSE is lower on every seed and the mean difference exceeds
:data:`TIE_BAND` of DFL-SGD's mean, ``GT loses`` symmetrically or when GT diverged on a seed,
``not testable`` when DFL-SGD diverged on a seed (or a seed is missing), ``tie`` otherwise.

On the benchmark harness (:mod:`graphfl.bench.harness`): :func:`declare` gives the points (the plan
entries of :func:`cells`), methods, seeds, metrics and the validation-tuned step (``Tuning.groups``:
DFL-SGD with DFL-GT, FedAvg and local-only each alone; every grid value failing fails the test
cells); run-cache keys are :func:`cache_key`'s. What this module adds to the harness's layout: the
per-entry rows with their verdicts (``cells``, :func:`cell_row`), the ``summary`` lines, the
fixed-step view (:func:`fixed_step_view`) and its own plot.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.p2p.algorithms import registry
from graphfl.p2p.oracles import TabularOracle
from graphfl.p2p.topology import make_topology
from graphfl.p2p.vectorised import run_vectorised

from .harness import Bench, Cell, Metric, Outcome, Tuning, run_bench
from .report import build_doc, write_report
from .runcache import RunCache
from .stats import mean_sd, paired_difference

logger = logging.getLogger(__name__)

NAME = "dfl_regime"
METHODS = ("dfl-sgd", "dfl-gt", "fedavg", "local")
SHARED = ("dfl-sgd", "dfl-gt")
"""The methods that share one step per cell (C1)."""
TOPOLOGIES = {"ring5": ("ring", 5), "ring20": ("ring", 20), "complete20": ("complete", 20)}
RULES = ("constant", "inv-sqrt")
BATCHES = ("full", "small")
HET_BASE = 0.05
HET_LEVELS = (0.0, 0.5, 2.0, 8.0)
"""Multiples of :data:`HET_BASE`: ``h`` = level × base."""
DIM = 10
TRAIN_ROWS = 100
TEST_ROWS = 200
NOISE = 0.5
SCALE_SPREAD = 0.5
SMALL_BATCH = 5
VAL_FRACTION = 0.2
GRID = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
TAIL = 0.1
TIE_BAND = 0.001
"""Relative band of DFL-SGD's mean final global test MSE inside which a difference is a tie."""
RESUMABLE = True
KEY_VERSION = 1


@dataclass(frozen=True)
class Form:
    """What ``--quick`` and the full form run."""

    budgets: tuple[int, ...]
    """Iteration budgets ``T`` (a cell axis: a short budget makes the validation-best step larger)."""
    seeds: int
    eval_points: int
    het_levels: tuple[float, ...] = HET_LEVELS
    topologies: tuple[str, ...] = tuple(TOPOLOGIES)


FULL = Form(budgets=(1000, 200), seeds=3, eval_points=20)
QUICK = Form(budgets=(300,), seeds=3, eval_points=10, het_levels=(0.0, 8.0), topologies=("ring5", "ring20"))


def node_data(seed: int, n: int, het: float) -> list[dict[str, np.ndarray]]:
    """Every node's raw arrays (module docstring): ``x``/``y`` training, ``x_test``/``y_test``, ``w``."""
    rng = np.random.default_rng([seed, 71])
    w_star = rng.normal(size=DIM)
    out = []
    for i in range(n):
        r = np.random.default_rng([seed, 72, i])
        w = w_star + het * HET_BASE * r.normal(size=DIM)
        scale = np.exp(SCALE_SPREAD * r.normal(size=DIM))
        x = r.normal(size=(TRAIN_ROWS, DIM)) * scale
        xt = r.normal(size=(TEST_ROWS, DIM)) * scale
        out.append({"x": x, "y": x @ w + NOISE * r.normal(size=TRAIN_ROWS), "x_test": xt,
                    "y_test": xt @ w + NOISE * r.normal(size=TEST_ROWS), "w": w, "scale": scale})
    return out


def use_full_batch(oracle: TabularOracle) -> TabularOracle:
    """Make ``oracle.sample`` return every training row (deterministic full-batch gradients)."""
    rows = np.arange(len(oracle.y_train))
    # an instance attribute: the oracle stays a TabularOracle, so the vectorised engine still stacks it
    oracle.sample = lambda: rows  # type: ignore[method-assign]
    return oracle


def make_oracles(seed: int, n: int, het: float, batch: str, split: str) -> list[TabularOracle]:
    """The nodes' least-squares oracles; ``split = "val"`` trains on 80 % and evaluates on the other 20 %."""
    cut = int(round(TRAIN_ROWS * (1 - VAL_FRACTION)))
    oracles = []
    for i, d in enumerate(node_data(seed, n, het)):
        if split == "val":
            xs, ys, xe, ye = d["x"][:cut], d["y"][:cut], d["x"][cut:], d["y"][cut:]
        else:
            xs, ys, xe, ye = d["x"], d["y"], d["x_test"], d["y_test"]
        o = TabularOracle(i, "dfl-regime", xs, ys, xe, ye, seed=seed,
                          batch_size=len(ys) if batch == "full" else SMALL_BATCH)
        oracles.append(use_full_batch(o) if batch == "full" else o)
    return oracles


def optimum(oracles: list[TabularOracle]) -> tuple[np.ndarray, float]:
    """``θ* = argmin F``, ``F(θ) = (1/n) Σ_i ‖X_i θ − y_i‖²/(2 m_i)``, and ``F(θ*)``."""
    h = sum(o.x_train.T @ o.x_train / len(o.y_train) for o in oracles)
    g = sum(o.x_train.T @ o.y_train / len(o.y_train) for o in oracles)
    theta = np.linalg.solve(h, g)
    return theta, objective(oracles, theta)


def objective(oracles: list[TabularOracle], theta: np.ndarray) -> float:
    """``F(θ)`` on the training rows."""
    return float(np.mean([0.5 * np.mean((o.x_train @ theta - o.y_train) ** 2) for o in oracles]))


def population_risk(seed: int, n: int, het: float, theta: np.ndarray) -> float:
    """The global model's expected test MSE over the data distribution (an infinite test set):
    ``(1/n) Σ_i ½ [Σ_k s_ik² (θ − w_i)_k² + NOISE²]``.
    """
    return float(np.mean([0.5 * (np.sum(d["scale"] ** 2 * (theta - d["w"]) ** 2) + NOISE ** 2)
                          for d in node_data(seed, n, het)]))


def mixing(method: str, topology: str) -> np.ndarray:
    """FedAvg ``(1/n) 1 1ᵀ``, local-only ``I``, the DFL methods the topology's Metropolis matrix."""
    kind, n = TOPOLOGIES[topology]
    if method == "fedavg":
        return np.full((n, n), 1.0 / n)
    if method == "local":
        return np.eye(n)
    w: np.ndarray = make_topology(kind, n).mixing_matrix()
    return w


def spectral_factor(topology: str) -> float:
    """``1/(1 − λ₂(W))`` of the topology's mixing matrix (λ₂: second largest eigenvalue modulus)."""
    ev = np.sort(np.abs(np.linalg.eigvalsh(mixing("dfl-sgd", topology))))
    return float(1.0 / max(1e-12, 1.0 - ev[-2]))


def run_one(method: str, topology: str, het: float, rule: str, batch: str, alpha0: float, seed: int,
            split: str, iterations: int, eval_points: int) -> dict[str, Any]:
    """One run; ``{"diverged": why}`` when a recorded loss leaves the finite range (or exceeds 1e6)."""
    n = TOPOLOGIES[topology][1]
    oracles = make_oracles(seed, n, het, batch, split)
    algo = registry.create("dfl-gt" if method == "dfl-gt" else "dfl-sgd", tau=1, alpha0=alpha0, step_rule=rule)
    eval_every = max(1, iterations // eval_points)
    t0 = time.perf_counter()
    with np.errstate(all="ignore"):
        states, curve, _, _ = run_vectorised(algo, oracles, mixing(method, topology), iterations,
                                             eval_every=eval_every)
    pts = [c for c in curve if "avg_model_test_loss" in c]
    glob = [c["avg_model_test_loss"] for c in pts]
    if not all(np.isfinite(v) and v < 1e6 for v in glob + [c["consensus"] for c in pts]):
        return {"diverged": f"{method} {topology} h={het} {rule} {batch} alpha0={alpha0}: loss non-finite"}
    thetas = np.stack([s.theta for s in states])
    theta_bar = thetas.mean(axis=0)
    theta_star, f_star = optimum(oracles)
    k = max(1, int(round(len(glob) * TAIL)))
    return {"final": {"global": float(np.mean(glob[-k:])), "global_over_run": float(np.mean(glob)),
                      "own": float(np.mean([c["test_loss"] for c in pts[-k:]])),
                      "excess": objective(oracles, theta_bar) - f_star,
                      "population": population_risk(seed, n, het, theta_bar),
                      "dist_opt": float(np.linalg.norm(theta_bar - theta_star)),
                      "consensus": float(pts[-1]["consensus"])},
            "curve": [{"t": c["t"], "global": c["avg_model_test_loss"], "consensus": c["consensus"]} for c in pts],
            "seconds": time.perf_counter() - t0}


def cell_verdict(gt: list[float | None], sgd: list[float | None], expected: int | None = None) -> str:
    """``GT wins`` / ``GT loses`` / ``tie`` from the per-seed final global test MSE (rule: module docstring).

    ``gt[k]`` and ``sgd[k]`` belong to the same seed (``None`` or non-finite: that run diverged) of
    ``expected`` seeds. ``not run`` when neither method has a finite value; ``GT loses`` when GT
    diverged on some seed; ``not testable`` when a seed is missing or DFL-SGD diverged on some seed.
    """
    d = paired_difference(gt, sgd, expected=expected)
    if d["first_nonfinite"] == list(range(len(gt))) and d["second_nonfinite"] == list(range(len(sgd))):
        return "not run"
    if d["first_nonfinite"]:
        return "GT loses"
    if d["missing"] or d["second_nonfinite"] or d["mean"] is None:
        return "not testable"
    band = TIE_BAND * float(np.mean([float(x) for x in sgd if x is not None]))
    if d["first_better"] == d["seeds"] and d["mean"] < -band:
        return "GT wins"
    if d["first_better"] == 0 and d["mean"] > band and all(x > 0 for x in d["per_seed"]):
        return "GT loses"
    return "tie"


def cells(form: Form) -> list[dict[str, Any]]:
    """The plan: every (budget, heterogeneity level, topology, step rule, batch)."""
    return [{"T": big_t, "het": lvl * 1.0, "topology": t, "rule": r, "batch": b} for big_t in form.budgets
            for lvl in form.het_levels for t in form.topologies for r in RULES for b in BATCHES]


KEYS = ("global", "global_over_run", "own", "excess", "population", "dist_opt", "consensus")
"""The metrics of a run's ``final`` dict."""
PAIRED = ("global", "global_over_run", "excess", "population", "consensus")
"""The metrics with paired per-seed differences GT − SGD."""
METRICS = [Metric("global", "final global test MSE"), Metric("global_over_run", "global test MSE over run"),
           Metric("own", "own-model test MSE", paired=False), Metric("excess", "excess F(θ̄)−F*"),
           Metric("population", "population risk"), Metric("dist_opt", "‖θ̄ − θ*‖", paired=False),
           Metric("consensus", "consensus violation")]


def cache_key(form: Form, method: str, cell: dict[str, Any], alpha0: float | None, seed: int,
              split: str) -> dict[str, Any]:
    """The run-cache key of one run (``cell``: a plan entry of :func:`cells`)."""
    where = {k: v for k, v in cell.items() if k != "T"}
    return {"bench": NAME, "v": KEY_VERSION, "method": method, **where, "alpha0": alpha0, "seed": seed,
            "split": split, "iterations": cell["T"], "eval_points": form.eval_points}


def compute(form: Form, cell: Cell) -> dict[str, Any]:
    """:func:`run_one` for a harness cell (point = a plan entry, ``alpha0`` tuned)."""
    c = cell.at
    return run_one(cell.method, c["topology"], c["het"] * 1.0, c["rule"], c["batch"], cell.settings["alpha0"],
                   cell.seed, cell.split, c["T"], form.eval_points)


def declare(form: Form, seeds: list[int], points: list[dict[str, Any]] | None = None,
            run: Any = None, key: Any = None) -> Bench:
    """The benchmark on the harness: points = :func:`cells`, the step shared by DFL-SGD and DFL-GT (C1).

    ``run(cell)`` / ``key(cell)`` replace the computation and the cache key (default: :func:`compute`,
    :func:`cache_key`).
    """
    return Bench(
        name=NAME, title="dfl-regime: where DFL-GT beats DFL-SGD on the global model", methods=METHODS,
        points=points if points is not None else cells(form), seeds=seeds, metrics=METRICS,
        run_cell=run or partial(compute, form),
        key=key or (lambda c: cache_key(form, c.method, c.at, c.settings.get("alpha0"), c.seed, c.split)),
        tuning=Tuning(param="alpha0", grid=GRID, metric="global", groups=[SHARED], max_extensions=0,
                      fail_if_all_fail=True),
        pairs=[("dfl-gt", "dfl-sgd")], cost=_cost)


def _cost(cell: Cell) -> float:
    """A cell's weight for the time estimate: iterations × nodes."""
    return float(cell.at["T"]) * TOPOLOGIES.get(cell.at["topology"], ("", 1))[1]


def _tuning_by_method(outcome: Outcome) -> dict[tuple[str, str], dict[str, Any]]:
    """(repr of the point, method) -> the harness's validation search that chose the method's step."""
    out = {}
    for rec in outcome.tuning:
        for m in rec["methods"]:
            out[(repr(sorted(rec["point"].items())), m)] = rec
    return out


def cell_row(cell: dict[str, Any], outcome: Outcome, seeds: list[int]) -> dict[str, Any]:
    """One plan entry's row: the step each method used, per-method mean ± sd, GT − SGD and the verdicts."""
    recs = _tuning_by_method(outcome)
    point = tuple(cell.items())

    def record(m: str) -> dict[str, Any]:
        rec = recs[(repr(sorted(cell.items())), m)]
        return {"chosen": rec["chosen"], "scores": rec["scores"], "per_method": rec["per_method"]}

    tuning = {"shared": record(SHARED[0]), **{m: record(m) for m in METHODS if m not in SHARED}}
    res: dict[str, Any] = {}
    by_seed: dict[str, dict[str, list[float | None]]] = {}
    for m in METHODS:
        runs = outcome.runs[(point, m)]
        by_seed[m] = {k: [r["final"][k] if r is not None else None for r in runs] for k in KEYS}  # None: diverged
        res[m] = {"alpha0": tuning["shared" if m in SHARED else m]["chosen"],
                  "metrics": {k: mean_sd(v) for k, v in by_seed[m].items()}}  # curves stay in the cache
    gt, sgd = by_seed["dfl-gt"], by_seed["dfl-sgd"]
    pairs = {k: paired_difference(gt[k], sgd[k], expected=len(seeds)) for k in PAIRED}
    return {"cell": cell, "tuning": tuning, "results": res, "gt_minus_sgd": pairs,
            "verdict": cell_verdict(gt["global"], sgd["global"], len(seeds)),
            "verdict_population": cell_verdict(gt["population"], sgd["population"], len(seeds)),
            "verdict_speed": cell_verdict(gt["global_over_run"], sgd["global_over_run"], len(seeds))}


def run_cell(go: Any, cell: dict[str, Any], seeds: list[int]) -> dict[str, Any]:
    """Tuning and test runs of one plan entry through ``go(method, cell, alpha0, seed, split)`` (no cache):
    the harness on that one point, then :func:`cell_row`.
    """
    bench = declare(QUICK, seeds, points=[cell],
                    run=lambda c: go(c.method, c.at, c.settings["alpha0"], c.seed, c.split),
                    key=lambda c: {"method": c.method, **c.at, **c.settings, "seed": c.seed, "split": c.split})
    return cell_row(cell, run_bench(bench, None), seeds)


def _runner(cache: RunCache, form: Form) -> Any:
    """``go(method, cell, alpha0, seed, split)``: one run through the benchmark's cache (same keys as the harness)."""
    def go(method: str, cell: dict[str, Any], alpha0: float, seed: int, split: str) -> dict[str, Any]:
        return cache(cache_key(form, method, cell, alpha0, seed, split),
                     lambda: run_one(method, cell["topology"], cell["het"] * 1.0, cell["rule"], cell["batch"],
                                     alpha0, seed, split, cell["T"], form.eval_points))
    return go


def fixed_step_view(go: Any, form: Form, seeds: list[int]) -> list[dict[str, Any]]:
    """GT − SGD on the test split at every grid step (not tuned): the strongest heterogeneity, constant step,
    the longest budget, every topology and batch; a step where either method diverges on a seed is left out.

    A diagnostic beside the tuned comparison: how the gap grows with the step (theory: DFL-SGD's bias is
    ``O(α ζ / (1 − λ₂))``, DFL-GT's none).
    """
    rows = []
    for topo in form.topologies:
        for batch in BATCHES:
            cell = {"T": max(form.budgets), "het": max(form.het_levels) * 1.0, "topology": topo, "rule": "constant",
                    "batch": batch}
            for a in GRID:
                runs = {m: [go(m, cell, a, s, "test") for s in seeds] for m in SHARED}
                if any("diverged" in r for rs in runs.values() for r in rs):
                    continue
                fin = {m: {k: [r["final"][k] for r in rs] for k in ("global", "population", "excess", "consensus")}
                       for m, rs in runs.items()}
                rows.append({"cell": cell, "alpha0": a,
                             "sgd": {k: mean_sd(v) for k, v in fin["dfl-sgd"].items()},
                             "gt": {k: mean_sd(v) for k, v in fin["dfl-gt"].items()},
                             "gt_minus_sgd": {k: paired_difference(fin["dfl-gt"][k], fin["dfl-sgd"][k])
                                              for k in ("global", "population")}})
    return rows


def _pm(m: dict[str, Any], fmt: str = ".4g") -> str:
    if m.get("mean") is None:
        return "–"
    return f"{m['mean']:{fmt}}" + ("" if m.get("sd") is None else f" ± {m['sd']:.2g}")


def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Verdict lines computed from the cells: where GT wins, ties and loses (test MSE, then population risk)."""
    out = []
    for key, what in (("verdict", "final global test MSE"), ("verdict_population", "global population risk"),
                      ("verdict_speed", "global test MSE averaged over the run (speed)")):
        out.append(f"- on the {what}:")
        for v in ("GT wins", "tie", "GT loses", "not testable", "not run"):
            hit = [r["cell"] for r in rows if r[key] == v]
            if not hit and v in ("not testable", "not run"):
                continue
            desc = "; ".join(_where(c) for c in hit)
            out.append(f"  - **{v}** in {len(hit)}/{len(rows)} cells" + (f": {desc}" if hit else ""))
        for big_t in sorted({r["cell"]["T"] for r in rows}):
            for rule in RULES:
                for batch in BATCHES:
                    sel = [r for r in rows if r["cell"]["rule"] == rule and r["cell"]["batch"] == batch
                           and r["cell"]["T"] == big_t]
                    wins = sum(r[key] == "GT wins" for r in sel)
                    loses = sum(r[key] == "GT loses" for r in sel)
                    ties = sum(r[key] == "tie" for r in sel)
                    out.append(f"  - T={big_t}, {rule} step, {batch} batch: GT wins {wins}, ties "
                               f"{ties}, loses {loses} of {len(sel)} cells"
                               + (f" ({len(sel) - wins - ties - loses} not testable or not run)"
                                  if len(sel) > wins + ties + loses else ""))
    return out


def report(doc: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The Markdown report's own parts: the intro (setting and verdicts) and the sections after the
    harness's tables (cells, fixed steps, validation scores per method).
    """
    cfg = doc["config"]
    intro = [f"T = {cfg['budgets']} iterations (a cell axis), tau = 1, seeds {cfg['seeds']}, n×d = nodes×{DIM}, "
             f"{TRAIN_ROWS} train / {TEST_ROWS} test rows per node, noise sd {NOISE}, input-scale spread "
             f"{SCALE_SPREAD}, small batch {SMALL_BATCH}; heterogeneity h = level × {HET_BASE} (w_i = w* + h u_i); "
             f"step grid {list(GRID)} (one alpha0 per cell shared by DFL-SGD and DFL-GT, chosen on validation of "
             f"seed {cfg['seeds'][0]} by their mean global-model MSE; FedAvg and local-only tuned each on its own). "
             "1/(1 − λ₂): " + ", ".join(f"{t} {f:.1f}" for t, f in cfg["spectral_factor"].items()) + ".", "",
             "## Verdicts", "", f"Rule: {cfg['verdict_rule']}", ""] + summary_lines(doc["cells"])
    lines = ["", "## Cells (test split; global model θ̄; final = last 10 % of evaluation points)", "",
             "| T | h | topology | step | batch | alpha0 (SGD=GT) | DFL-SGD global | DFL-GT global | GT − SGD (paired) "
             "| GT better | GT − SGD over run | SGD excess F(θ̄)−F* | GT excess | SGD consensus | GT consensus "
             "| GT − SGD population risk (paired) | FedAvg global | local-only global | verdict (test) "
             "| verdict (population) | verdict (over run) |",
             "|" + "---|" * 21]
    for r in doc["cells"]:
        c, res, p = r["cell"], r["results"], r["gt_minus_sgd"]
        lines.append(
            f"| {c['T']} | {c['het'] * HET_BASE:g} | {c['topology']} | {c['rule']} | {c['batch']} | {res['dfl-gt']['alpha0']} "
            f"| {_pm(res['dfl-sgd']['metrics']['global'])} | {_pm(res['dfl-gt']['metrics']['global'])} "
            f"| {_pm(p['global'], '+.3g')} | {p['global']['first_better']}/{p['global']['seeds']} "
            f"| {_pm(p['global_over_run'], '+.3g')} "
            f"| {_pm(res['dfl-sgd']['metrics']['excess'], '.2g')} | {_pm(res['dfl-gt']['metrics']['excess'], '.2g')} "
            f"| {_pm(res['dfl-sgd']['metrics']['consensus'], '.2g')} "
            f"| {_pm(res['dfl-gt']['metrics']['consensus'], '.2g')} "
            f"| {_pm(p['population'], '+.3g')} ({p['population']['first_better']}/{p['population']['seeds']}) "
            f"| {_pm(res['fedavg']['metrics']['global'])} ({res['fedavg']['alpha0']}) "
            f"| {_pm(res['local']['metrics']['global'])} ({res['local']['alpha0']}) | {r['verdict']} "
            f"| {r['verdict_population']} | {r['verdict_speed']} |")
    fixed = doc.get("fixed_step") or []
    if fixed:
        lines += ["", "## Fixed steps (not tuned; test split; GT − SGD paired over seeds)", "",
                  "| topology | batch | alpha0 | DFL-SGD global | DFL-GT global | GT − SGD global (GT better) "
                  "| GT − SGD population (GT better) | SGD excess | GT excess | SGD consensus |", "|" + "---|" * 10]
        for r in fixed:
            c, g, p = r["cell"], r["gt_minus_sgd"]["global"], r["gt_minus_sgd"]["population"]
            lines.append(f"| {c['topology']} | {c['batch']} | {r['alpha0']:g} | {_pm(r['sgd']['global'])} "
                         f"| {_pm(r['gt']['global'])} | {_pm(g, '+.3g')} ({g['first_better']}/{g['seeds']}) "
                         f"| {_pm(p, '+.3g')} ({p['first_better']}/{p['seeds']}) | {_pm(r['sgd']['excess'], '.2g')} "
                         f"| {_pm(r['gt']['excess'], '.2g')} | {_pm(r['sgd']['consensus'], '.2g')} |")
    lines += ["", "## Validation scores (tuning seed; DFL-SGD / DFL-GT; div = diverged, – = not run after "
              "DFL-SGD diverged)", ""]
    for r in doc["cells"]:
        c, t = r["cell"], r["tuning"]["shared"]
        per = t["per_method"]
        lines.append(f"- {_where(c)}: chosen {t['chosen']}; "
                     + ", ".join(f"{a}: SGD {_f(per['dfl-sgd'].get(a), a in per['dfl-sgd'])} / GT "
                                 f"{_f(per['dfl-gt'].get(a), a in per['dfl-gt'])}" for a in t["scores"]))
    return intro, lines


def _where(c: dict[str, Any]) -> str:
    return f"T={c['T']} h={c['het'] * HET_BASE:g} {c['topology']} {c['rule']} {c['batch']}"


def _f(v: float | None, run: bool = True) -> str:
    return "–" if not run else "div" if v is None else f"{v:.4g}"


def plot(doc: dict[str, Any], path: Path) -> None:
    """Relative GT − SGD difference against h, one panel per (rule, batch): test MSE (top), population risk."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, len(RULES) * len(BATCHES), figsize=(16, 8), sharey="row")
    combos = [(r, b) for r in RULES for b in BATCHES]
    for row, metric in enumerate(("global", "population")):
        for ax, (rule, batch) in zip(grid[row], combos):
            _panel(ax, doc, rule, batch, metric)
        grid[row][0].set_ylabel(f"(GT − SGD)/SGD, % of {'test MSE' if metric == 'global' else 'population risk'}"
                                "\n(<0: GT better)")
    grid[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _panel(ax: Any, doc: dict[str, Any], rule: str, batch: str, metric: str) -> None:
    """One panel: relative paired GT − SGD difference of ``metric`` against h, one line per (topology, T)."""
    for k, topo in enumerate(doc["config"]["topologies"]):
        for j, big_t in enumerate(doc["config"]["budgets"]):
            sel = [r for r in doc["cells"] if r["cell"]["rule"] == rule and r["cell"]["batch"] == batch
                   and r["cell"]["topology"] == topo and r["cell"]["T"] == big_t]
            xs, ys, es = [], [], []
            for r in sel:
                sgd = r["results"]["dfl-sgd"]["metrics"][metric]["mean"]
                d = r["gt_minus_sgd"][metric]
                if sgd and d["mean"] is not None:
                    xs.append(r["cell"]["het"] * HET_BASE)
                    ys.append(100 * d["mean"] / sgd)
                    es.append(100 * (d["sd"] or 0.0) / sgd)
            ax.errorbar([x + 1e-3 * k for x in xs], ys, yerr=es, marker="o", label=f"{topo} T={big_t}", capsize=3,
                        color=f"C{k}", linestyle=("-", "--", ":")[j % 3])
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("symlog", linthresh=0.02)
    ax.set_xlim(-0.002, 1.5 * max(doc["config"]["het_levels"]) * HET_BASE + 0.01)
    ax.set_title(f"{rule} step, {batch} batch")
    ax.set_xlabel("heterogeneity h")


VERDICT_RULE = (f"per cell, 'GT wins' when DFL-GT's final global-model test MSE is lower than DFL-SGD's on every "
                f"seed (paired, same data, same shared alpha0) and the mean difference exceeds {TIE_BAND:.1%} of "
                "DFL-SGD's mean; 'GT loses' symmetrically or when DFL-GT diverged on a seed; 'not testable' when DFL-SGD "
                "diverged on a seed; otherwise 'tie'; the same rule on the population risk "
                "(exact expected test MSE) and on the test MSE averaged over the run's evaluation points (speed)")


def run(quick: bool = False, seed: int = 0, out: Path | str = ".", form: Form | None = None) -> dict[str, Any]:
    """Run the plan (:func:`cells`) on the harness into ``<out>`` (cache ``<out>/cache``) and write
    ``dfl_regime.{json,md,png}``: the harness's layout plus ``cells`` (one row per plan entry with its
    verdicts), ``summary`` and ``fixed_step``.
    """
    f = form or (QUICK if quick else FULL)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [seed + k for k in range(f.seeds)]
    bench = declare(f, seeds)
    outcome = run_bench(bench, out)
    rows = [cell_row(dict(p), outcome, seeds) for p in bench.points]
    go = _runner(RunCache(out / "cache"), f)
    config = {"budgets": list(f.budgets), "seeds": seeds, "eval_points": f.eval_points, "tau": 1,
              "het_base": HET_BASE, "het_levels": list(f.het_levels), "topologies": list(f.topologies),
              "rules": list(RULES), "batches": list(BATCHES), "step_grid": list(GRID), "dim": DIM,
              "train_rows": TRAIN_ROWS, "test_rows": TEST_ROWS, "noise": NOISE,
              "scale_spread": SCALE_SPREAD, "small_batch": SMALL_BATCH, "tie_band": TIE_BAND,
              "verdict_rule": VERDICT_RULE, "spectral_factor": {t: spectral_factor(t) for t in f.topologies}}
    doc = build_doc(bench, outcome, quick, config, extra={
        "bench": "dfl-regime", "cells": rows, "summary": summary_lines(rows),
        "fixed_step": fixed_step_view(go, f, seeds)})
    intro, sections = report(doc)
    write_report(out, doc, intro=intro, sections=sections)
    plot(doc, out / f"{NAME}.png")
    return doc
