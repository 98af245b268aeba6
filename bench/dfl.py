"""Benchmark B1 ``dfl`` (ALGORITHMS.md §2.10, §11; seed 000 §10.2, Fig. 10.1).

The paper's experiment: heterogeneous nonlinear regression (task ``synthetic-dfl``: node inputs
on node-specific intervals, node-specific nonlinearity, one shared ``w*``), a three-layer MLP
(10→64→64→1), step ``alpha0/√(t+1)``, FedAvg vs DFL-SGD vs DFL-GT. The paper reports
(qualitatively, no numbers) FedAvg fastest and DFL-GT faster than DFL-SGD.

Fair set-up:

* **Topologies.** The paper's 5-node network (a ring ``C_5``, Metropolis weights all 1/3;
  ALGORITHMS §2.10 reconstruction) and a slowly mixing 20-node ring (node ``i`` uses interval and
  nonlinearity ``i mod 5``, so every neighbour has a different task: the heterogeneity bias that
  gradient tracking removes grows with ``1/(1 − λ₂(W))``, about 2.2 on ``C_5`` and 31 on ``C_20``).
  FedAvg = DFL-SGD with ``W = (1/n) 1 1ᵀ`` (full participation, averaging every ``tau`` steps,
  server traffic). All methods run through the registered p2p step functions in one process.
* **Inputs** (ALGORITHMS §0.1 C1). One transform shared by all nodes: every node's inputs are
  standardised with the mean/sd of all nodes' training inputs pooled, so the nodes keep their
  different input ranges (targets are built from the raw inputs, as in the paper). Per-node
  standardisation would give every node the same input distribution with conflicting targets,
  whose consensus optimum is a floor every method reaches early.
* **Step size** (C1). One rule for all methods, as in the paper: ``alpha0/√(t+1)`` with one
  ``alpha0`` per (topology, ``tau``) shared by FedAvg, DFL-SGD and DFL-GT, chosen from a grid that
  contains the paper's 15 by the mean over the three methods of the global-model validation MSE
  (20 % of each node's training data held out, :mod:`graphfl.tasks.holdout`, first seed only,
  last 10 % of evaluation points); a value at which any method leaves the finite range is not
  eligible. The test split is never used for a choice.
* **Metrics** (test split, chosen settings, ``SEEDS`` seeds, mean ± sd). Primary (C1: problem
  P1's goal is one global model): the **global model** on every node's test split — FedAvg's
  server model, the DFL methods' node average ``θ̄`` (the objective of eq. 10.1). Second view of
  the same objective: each node's model right after the exchange (``Σ_j W_ij θ_j``, the model it
  starts its local steps from) on every node's test split, averaged over nodes. Personalisation
  metric, reported after them: own-model loss (node i's model after its local steps on node i's
  test split). Also the stationarity ``‖(1/n) Σ_i ∇f_i(θ̄)‖²`` (full-batch gradients on the
  training data, ALGORITHMS §2.7) and the consensus violation ``(1/n) Σ‖θ_i − θ̄‖²``; per seed the
  paired differences GT − SGD and FedAvg − GT with their sign counts.

The benchmark is declared for the harness (:func:`declare`, :mod:`graphfl.bench.harness`): cells
(topology, tau, method, seed) through the run cache in ``<out>/cache`` (a killed run continues),
the estimate of the remaining time logged, and ``run(quick, seed, out)`` writes
``<out>/dfl.{json,md,png}`` in the harness's layout (:mod:`graphfl.bench.report`) plus one
verdict per claim of the seed (:func:`verdicts`: reproduced / not reproduced with the most likely
reason / not testable, from the paired per-seed differences), the orderings and one line per
(topology, tau).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.p2p.algorithms import NodeState, registry
from graphfl.p2p.driver import run_network_inprocess
from graphfl.p2p.oracles import ProblemSpec, make_oracle
from graphfl.p2p.topology import make_topology
from graphfl.tasks.holdout import VALIDATION_FRACTION, validation_task

from .harness import Bench, Cell, Metric, Tuning, run_bench
from .report import build_doc, curve_panels, pair, result, write_report

logger = logging.getLogger(__name__)

NAME = "dfl"
PROBLEM = "synthetic-dfl"
TOPOLOGIES = {"ring5": 5, "ring20": 20}
PAPER_ALPHA0 = 15.0
TAUS = (1, 5, 10)
METHODS = ("fedavg", "dfl-sgd", "dfl-gt")
BATCH = 32
GRID_EXTENSIONS = 2
"""Most alpha0 values tried beyond the grid when an edge wins (×2 or ÷2 each)."""
TAIL = 0.1  # fraction of evaluation points averaged for "final"
BACKOFF_HALVINGS = 3
"""Steps below the grid a diverging test run may back off to (each half the one before)."""


@dataclass(frozen=True)
class Form:
    """What ``--quick`` and the full form run."""

    iterations: int
    seeds: int
    grid: tuple[float, ...]
    eval_points: int


QUICK = Form(iterations=300, seeds=3, grid=(0.1, 0.2, 0.4, PAPER_ALPHA0), eval_points=15)
FULL = Form(iterations=2000, seeds=3, grid=(0.025, 0.05, 0.1, 0.2, 0.4, 0.8, PAPER_ALPHA0), eval_points=40)

UNSPECIFIED = [
    "topology of the 5-node network: ring C5 (the paper shows no graph); Metropolis weights (1/3)",
    "a second, slowly mixing topology: 20-node ring, node i uses interval/nonlinearity i mod 5",
    "data: input dim 10, w* ~ N(0, I), y = sigma_i(x w*) + N(0, 0.01^2), 1000 train + 200 test per node",
    "inputs standardised with the pooled training mean/sd of all nodes (one shared transform); targets from "
    "the raw inputs",
    "model MLP 10-64-64-1 with ReLU, MSE loss, batch 32, identical initial model on all nodes",
    "step rule alpha0/sqrt(t+1) (the paper's 1/sqrt(t) shifted to avoid t = 0); one alpha0 per "
    "(topology, tau) shared by all three methods, chosen on a grid that contains the paper's 15",
    f"validation: {VALIDATION_FRACTION:.0%} of each node's training data, first seed only; criterion: "
    f"global-model validation MSE over the last {TAIL:.0%} of evaluation points, mean over the three methods; "
    "a value at which any method diverges is not eligible; final runs train on the full training split",
    "tau in {1, 5, 10} (the paper does not give tau)",
    "FedAvg = averaging of all n models every tau steps (full participation)",
    "DFL-GT tracker initialised with the first stochastic gradient (GNSD), not 0 (ALGORITHMS §3.3)",
    "'final' = mean over the last 10% of evaluation points; stationarity and consensus at the last point",
    "global model = FedAvg's server model / the DFL node average theta_bar, on all nodes' test splits",
    "a test run whose training loss diverges at the tuned alpha0 is rerun with the next smaller grid value, "
    f"then with up to {BACKOFF_HALVINGS} halvings of the smallest (recorded per seed as alpha0_used_per_seed)",
]


class Diverged(RuntimeError):
    """A run left the finite range (the step size is too large for this method)."""


INPUTS = "pooled-standardised"
"""The input transform (part of every cached run's key)."""
METRICS_VERSION = 2
"""Bumped when a cached run's recorded metrics change (part of its key)."""

RESUMABLE = True
"""An interrupted run continues in the same ``--out`` (finished cells come from ``<out>/cache``)."""


def cell_key(cell: Cell, form: Form) -> dict[str, Any]:
    """A cell's run-cache key (the key format of every cached B1 run)."""
    test = cell.split == "test"
    return {"bench": NAME, "method": cell.method, "tau": cell.at["tau"], "alpha0": cell.settings["alpha0"],
            "iterations": form.iterations, "seed": cell.seed, "n": TOPOLOGIES[cell.at["topology"]],
            "split": cell.split, "eval_points": form.eval_points, "stationarity": test, "inputs": INPUTS,
            "metrics": METRICS_VERSION}


def run_cell(cell: Cell, form: Form) -> dict[str, Any]:
    """:func:`run_method` for one cell; a divergence is a result (``{"diverged": why}``), cached like any."""
    try:
        return run_method(cell.method, cell.at["tau"], cell.settings["alpha0"], form.iterations, cell.seed,
                          TOPOLOGIES[cell.at["topology"]], split=cell.split, eval_points=form.eval_points,
                          with_stationarity=cell.split == "test")
    except Diverged as exc:
        return {"diverged": str(exc)}


def make_oracles(n: int, seed: int, split: str = "test") -> list[Any]:
    """The ``n`` nodes' oracles; ``split = "val"`` trains on 80 % and evaluates on the held-out 20 %."""
    problem = validation_task(PROBLEM) if split == "val" else PROBLEM
    spec = ProblemSpec(problem, num_nodes=n, seed=seed, batch_size=BATCH, pooled_standardize=True)
    return [make_oracle(i, spec) for i in range(n)]


def mixing(method: str, n: int) -> np.ndarray:
    """FedAvg: ``(1/n) 1 1ᵀ``; the DFL methods: the ``n``-ring with Metropolis weights."""
    if method == "fedavg":
        return np.full((n, n), 1.0 / n)
    w: np.ndarray = make_topology("ring", n).mixing_matrix()
    return w


def stationarity(oracles: list[Any], theta_bar: np.ndarray) -> float:
    """``‖(1/n) Σ_i ∇f_i(θ̄)‖²`` with each node's full-batch training gradient (ALGORITHMS §2.7)."""
    g = np.mean([np.asarray(o.full_grad(theta_bar), np.float64) for o in oracles], axis=0)
    return float(g @ g)


def global_loss(oracles: list[Any], theta: np.ndarray) -> float:
    """``(1/n) Σ_j f_j^test(θ)``: one model on every node's test split (the objective of eq. 10.1)."""
    return float(np.mean([o.test_loss(theta) for o in oracles]))


def exchanged_models_loss(oracles: list[Any], w: np.ndarray, thetas: list[np.ndarray]) -> float:
    """Mean over nodes ``i`` of :func:`global_loss` at ``Σ_j W_ij θ_j``.

    The models the nodes start their next local steps from (after the exchange); for FedAvg
    (``W = (1/n) 1 1ᵀ``) every node's is the server model.
    """
    stacked = np.stack([np.asarray(t, np.float64) for t in thetas])
    mixed = (w @ stacked).astype(np.float32)
    return float(np.mean([global_loss(oracles, m) for m in mixed]))


def run_method(method: str, tau: int, alpha0: float, iterations: int, seed: int, n: int,
               split: str = "test", eval_points: int = 20, with_stationarity: bool = True) -> dict[str, Any]:
    """One run; raises :class:`Diverged` as soon as a loss is non-finite or above 1e6.

    ``with_stationarity`` also records, at the evaluation points, the stationarity and the
    exchanged node models' global loss (:func:`exchanged_models_loss`).
    """
    w = mixing(method, n)
    algo = registry.create("dfl-sgd" if method == "fedavg" else method, tau=tau, alpha0=alpha0)
    oracles = make_oracles(n, seed, split)
    rounds = iterations // tau
    eval_every = max(1, rounds // eval_points)
    stat: dict[int, float] = {}
    exchanged: dict[int, float] = {}

    def on_step(t: int, states: list[NodeState]) -> None:
        if not all(math.isfinite(s.loss) and s.loss < 1e6 for s in states):
            raise Diverged(f"{method}, tau={tau}, alpha0={alpha0}: loss non-finite at iteration {t}")
        last = t + 1 == iterations
        if with_stationarity and (last or ((t + 1) % tau == 0 and ((t // tau) + 1) % eval_every == 0)):
            theta_bar = np.mean([np.asarray(s.theta, np.float64) for s in states], axis=0).astype(np.float32)
            stat[t + 1] = stationarity(oracles, theta_bar)
            exchanged[t + 1] = exchanged_models_loss(oracles, w, [s.theta for s in states])

    t0 = time.perf_counter()
    res = run_network_inprocess(algo, oracles, w, iterations, eval_every=eval_every,
                                bytes_model="server" if method == "fedavg" else "gossip", on_step=on_step)
    curve = [{"round": c["round"], "t": c["t"], "test_loss": c["test_loss"],
              "avg_model_test_loss": c["avg_model_test_loss"], "stationarity": stat.get(c["t"]),
              "exchanged_models_test_loss": exchanged.get(c["t"]),
              "consensus": c["consensus"], "bytes": c["bytes"], "seconds": c["seconds"]}
             for c in res.curve if "test_loss" in c]
    if not all(math.isfinite(c[k]) and c[k] < 1e6 for c in curve for k in ("test_loss", "avg_model_test_loss")):
        raise Diverged(f"{method}, tau={tau}, alpha0={alpha0}: test loss non-finite")
    return {"curve": curve, "seconds": time.perf_counter() - t0, "final": summarize(curve)}


def tail_mean(curve: list[dict[str, Any]], key: str, frac: float = TAIL) -> float:
    vals = [c[key] for c in curve if c.get(key) is not None]
    k = max(1, int(round(len(vals) * frac)))
    return float(np.mean(vals[-k:]))


def summarize(curve: list[dict[str, Any]]) -> dict[str, Any]:
    """Final metrics of one run's curve."""
    last = curve[-1]
    return {"test_loss": tail_mean(curve, "test_loss"),
            "test_loss_over_run": float(np.mean([c["test_loss"] for c in curve])),
            "avg_model_test_loss": tail_mean(curve, "avg_model_test_loss"),
            "avg_model_over_run": float(np.mean([c["avg_model_test_loss"] for c in curve])),
            "exchanged_models_test_loss": (tail_mean(curve, "exchanged_models_test_loss")
                                           if any(c.get("exchanged_models_test_loss") is not None for c in curve)
                                           else None),
            "stationarity": last.get("stationarity"), "consensus": last["consensus"],
            "rounds": last["round"], "bytes": last["bytes"]}


METRICS = (
    Metric("avg_model_test_loss", "global final"),
    Metric("avg_model_over_run", "global over run"),
    Metric("exchanged_models_test_loss", "exchanged final"),
    Metric("test_loss", "own final"),
    Metric("test_loss_over_run", "own over run"),
    Metric("stationarity", "stationarity"),
    Metric("consensus", "consensus"),
)
"""Final metrics per cell (test split): the global model first (ALGORITHMS §0.1 C1)."""
PAIRS = (("dfl-gt", "dfl-sgd"), ("fedavg", "dfl-gt"), ("fedavg", "dfl-sgd"))
"""Paired per-seed differences ``a − b`` (negative = ``a`` better)."""
CURVE_KEYS = ("test_loss", "avg_model_test_loss", "exchanged_models_test_loss", "stationarity", "consensus")
PAPER_ORDER = ["fedavg", "dfl-gt", "dfl-sgd"]


def declare(form: Form, seed: int) -> Bench:
    """B1 on the harness: points (topology, tau), one ``alpha0`` per point shared by the methods.

    Tuning (ALGORITHMS §0.1 C1): the mean over the methods of the global-model validation MSE
    (last 10 % of evaluation points; first seed, 20 % of the training data held out); a value at
    which any method diverges is not eligible; a winning edge of the grid is extended (×2 or ÷2,
    at most :data:`GRID_EXTENSIONS` steps). A test cell that diverges backs off to the next
    smaller step (the grid's, then :data:`BACKOFF_HALVINGS` halvings of its smallest value).
    """
    return Bench(
        name=NAME, title="B1: FedAvg vs DFL-SGD vs DFL-GT (seed 000 Fig. 10.1)", methods=METHODS,
        points=[{"topology": t, "tau": tau} for t in TOPOLOGIES for tau in TAUS],
        seeds=[seed + k for k in range(form.seeds)], metrics=METRICS,
        run_cell=lambda cell: run_cell(cell, form), key=lambda cell: cell_key(cell, form),
        tuning=Tuning(param="alpha0", grid=form.grid, metric="avg_model_test_loss", shared=True, factor=2.0,
                      max_extensions=GRID_EXTENSIONS, backoff_halvings=BACKOFF_HALVINGS),
        pairs=PAIRS, curve_keys=CURVE_KEYS, curve_sd_keys=("test_loss", "avg_model_test_loss"),
        cost=lambda cell: float(TOPOLOGIES[cell.at["topology"]]))


def run(quick: bool, seed: int, out: Path) -> dict[str, Any]:
    """Run B1 and write ``<out>/dfl.{json,md,png}``; returns the result dict."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(1)
    form = QUICK if quick else FULL
    bench = declare(form, seed)
    outcome = run_bench(bench, out)
    config = {"quick": quick, "topologies": TOPOLOGIES, "taus": list(TAUS), "iterations": form.iterations,
              "alpha0_grid": list(form.grid), "eval_points": form.eval_points, "batch_size": BATCH,
              "model": "MLP 10-64-64-1 (ReLU)",
              "step": "alpha0/sqrt(t+1), one alpha0 per (topology, tau) for all methods",
              "inputs": "standardised with the pooled training mean/sd of all nodes", "tuning_seed": seed,
              "primary_metric": "global model (FedAvg server model / DFL node average) test MSE",
              "validation_fraction": VALIDATION_FRACTION, "paper_alpha0": PAPER_ALPHA0}
    for r in outcome.results:  # run facts beside the metrics: the same for every seed
        runs = [x for x in outcome.runs[(tuple(r["point"].items()), r["method"])] if x is not None]
        r["rounds"] = runs[0]["final"]["rounds"] if runs else None
        r["bytes"] = runs[0]["final"]["bytes"] if runs else None
        r["run_seconds"] = float(np.mean([x["seconds"] for x in runs])) if runs else None
    doc = build_doc(bench, outcome, quick, config, extra={
        "unspecified_settings": UNSPECIFIED,
        "paper": {"figure": "seed 000 Fig. 10.1 (test loss vs communication rounds, 5 nodes)",
                  "claims": dict(CLAIMS), "numbers": None}})
    doc["ordering"] = ordering(doc)
    doc["verdict"] = verdict(doc)
    doc["verdict_rule"] = VERDICT_RULE
    doc["verdicts"] = verdicts(doc)
    for name, v in doc["verdicts"].items():
        logger.info("B1 verdict %s: %s", name, v["verdict"])
    write_report(out, doc, intro=[INTRO.format(**config, seeds=bench.seeds)],
                 sections=["## Verdicts (one per claim of seed 000 §10.2)", "", f"Rule: {VERDICT_RULE}.", "",
                           *verdict_lines(doc["verdicts"]), "",
                           "## Orderings per (topology, tau) (Fig. 10.1: FedAvg fastest, DFL-GT faster than DFL-SGD)",
                           "", *[f"- {v}" for v in doc["verdict"]], "", "## Settings the paper does not give", "",
                           *[f"- {u}" for u in UNSPECIFIED]],
                 panels=panels(doc), plot_title="B1: FedAvg vs DFL-SGD vs DFL-GT (one alpha0, tuned on validation)")
    return doc


INTRO = ("{iterations} iterations, seeds {seeds}, step alpha0/sqrt(t+1) with one alpha0 per (topology, tau) for all "
         "methods, chosen on the validation split (grid {alpha0_grid}, seed {tuning_seed}); inputs standardised with "
         "the pooled training mean/sd of all nodes. Test split, mean ± sd over seeds. **Global** = the global model "
         "(FedAvg's server model, the DFL node average θ̄) on every node's test split, the primary metric; exchanged "
         "= each node's model after the exchange (its next starting point) on every node's test split; own = node "
         "i's model after its local steps on node i's test split (personalisation); stationarity = "
         "‖(1/n) Σ ∇f_i(θ̄)‖² (full batch, training data); final = mean of the last 10% of evaluation points, over "
         "run = mean of all of them (lower = faster). A test run that diverged at the tuned alpha0 shows the values "
         "each seed used.")


def ordering(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per (topology, tau) with every method finite: the methods ordered by the global and own model's means."""
    out: dict[str, dict[str, Any]] = {}
    for point in doc["config"]["points"]:
        means = {m: {k: v["mean"] for k, v in result(doc, m, **point)["metrics"].items()} for m in METHODS}
        if any(means[m][k] is None for m in METHODS for k in ("avg_model_over_run", "avg_model_test_loss",
                                                               "test_loss")):
            continue
        by_speed = sorted(METHODS, key=lambda m: means[m]["avg_model_over_run"])
        by_final = sorted(METHODS, key=lambda m: means[m]["avg_model_test_loss"])
        by_own = sorted(METHODS, key=lambda m: means[m]["test_loss"])
        out.setdefault(point["topology"], {})[str(point["tau"])] = {
            "global_model_by_mean_over_run": by_speed, "global_model_by_final": by_final,
            "own_model_by_final": by_own,
            "paper_order_by_speed": by_speed == PAPER_ORDER, "paper_order_by_final": by_final == PAPER_ORDER}
    return out


def verdict(doc: dict[str, Any]) -> list[str]:
    """One line per (topology, tau): does the paper's ordering appear on the global model, with the paired numbers."""
    lines = []
    for topo, per_tau in doc["ordering"].items():
        for tau, o in per_tau.items():
            gs = pair(doc, "dfl-gt", "dfl-sgd", topology=topo, tau=int(tau))["metrics"]
            fg = pair(doc, "fedavg", "dfl-gt", topology=topo, tau=int(tau))["metrics"]

            def cnt(d: dict[str, Any]) -> str:
                return f"{d['first_better']}/{d['seeds']}"

            lines.append(
                f"{topo} tau={tau}: global model, speed order {' < '.join(o['global_model_by_mean_over_run'])}, "
                f"final order {' < '.join(o['global_model_by_final'])} (paper: fedavg < dfl-gt < dfl-sgd); "
                f"GT-SGD global model over run {_fmt_pm(gs['avg_model_over_run'])} (GT better in "
                f"{cnt(gs['avg_model_over_run'])} seeds), final {_fmt_pm(gs['avg_model_test_loss'])} "
                f"({cnt(gs['avg_model_test_loss'])}), stationarity {_fmt_pm(gs['stationarity'])} "
                f"({cnt(gs['stationarity'])}); FedAvg-GT global model over run "
                f"{_fmt_pm(fg['avg_model_over_run'])} ({cnt(fg['avg_model_over_run'])}); personalisation "
                f"(own model after local steps) GT-SGD final {_fmt_pm(gs['test_loss'])} "
                f"({cnt(gs['test_loss'])})")
    return lines


CLAIMS = {
    "fedavg-fastest": "FedAvg converges the fastest, because it aggregates the model completely every round "
                      "(seed 000 §10.2, Fig. 10.1, 5 nodes)",
    "gt-faster-than-sgd": "DFL-GT converges faster than DFL-SGD, as the gradient tracker approximates the full "
                          "gradient as the iterates proceed (seed 000 §10.2, Fig. 10.1, 5 nodes)",
    "gt-under-heterogeneity": "when the data are heterogeneous over the graph, the discrepancy of the local "
                              "distributions slows DSGD/DFL-SGD and gradient tracking improves on it (seed 000 §10.2)",
    "gt-rate": "DFL-GT reaches first-order stationary points at rate O(1/sqrt(nT)) in stationarity and consensus "
               "violation, with tau up to O(T^(1/4)) (seed 000 §10.2, citing its ref. [14])",
}
"""The seed's claims about B1, one verdict each (:func:`verdicts`)."""
CLAIM_NETWORK = {"fedavg-fastest": "ring5", "gt-faster-than-sgd": "ring5", "gt-under-heterogeneity": "ring20"}
"""The network each speed claim is judged on: the paper's 5 nodes; the slowly mixing ring for heterogeneity."""
SPEED = "avg_model_over_run"
"""The speed metric: the global model's test MSE averaged over the run (area under the Fig. 10.1 curve)."""
VERDICT_RULE = (
    "a claim 'a converges faster than b' is reproduced when the per-seed paired difference a − b of the global "
    "model's test MSE averaged over the run's evaluation points (the area under the Fig. 10.1 curve against "
    "communication rounds; lower = faster) is negative on every seed at every tau on the claim's network (ring5, the "
    "paper's 5 nodes; ring20 for the heterogeneity claim); 'FedAvg fastest' needs both FedAvg − DFL-GT and "
    "FedAvg − DFL-SGD; a claim with a cell not yet run is not testable unless a finished cell already contradicts "
    "it; the other network is secondary evidence")


def spectral_factor(n: int) -> float:
    """``1/(1 − λ₂)`` of the ``n``-ring's mixing matrix (λ₂: second largest eigenvalue modulus).

    The factor by which a slowly mixing graph multiplies DSGD's heterogeneity bias, the bias
    gradient tracking removes (seed 000 §10.2 via its ref. [21]).
    """
    ev = np.sort(np.abs(np.linalg.eigvalsh(mixing("dfl-sgd", n))))
    return float(1.0 / (1.0 - ev[-2]))


def _stat_of(doc: dict[str, Any], a: str, b: str, topo: str, tau: int, key: str) -> dict[str, Any] | None:
    """The paired ``a − b`` entry of ``key`` at (topo, tau), ``None`` when absent or without a finite seed."""
    try:
        d = pair(doc, a, b, topology=topo, tau=tau)["metrics"].get(key)
    except KeyError:
        return None
    return d if d and d.get("mean") is not None and d.get("seeds") else None


def _alpha_used(doc: dict[str, Any], method: str, topo: str, tau: int) -> list[float | None]:
    try:
        used = result(doc, method, topology=topo, tau=tau).get("params_per_seed") or []
    except KeyError:
        return []
    return [u.get("alpha0") if u else None for u in used]


def _metric_mean(doc: dict[str, Any], method: str, topo: str, tau: int, key: str) -> float | None:
    try:
        m = result(doc, method, topology=topo, tau=tau)["metrics"].get(key) or {}
    except KeyError:
        return None
    v = m.get("mean")
    return None if v is None else float(v)


def _pair_line(doc: dict[str, Any], a: str, b: str, topo: str, tau: int) -> str:
    d = _stat_of(doc, a, b, topo, tau, SPEED)
    if d is None:
        return f"{topo} tau={tau}: {a} − {b}: not run yet"
    f = _stat_of(doc, a, b, topo, tau, "avg_model_test_loss")
    per = ", ".join(f"{x:+.3g}" for x in d["per_seed"])
    line = (f"{topo} tau={tau}: {a} − {b} global model over run {_fmt_pm(d)} (per seed {per}; {a} faster on "
            f"{d['first_better']}/{d['seeds']})")
    if f is not None:
        line += f", final {_fmt_pm(f)} ({a} better on {f['first_better']}/{f['seeds']})"
    ua, ub = _alpha_used(doc, a, topo, tau), _alpha_used(doc, b, topo, tau)
    if ua != ub:
        line += f"; alpha0 per seed {a} {ua}, {b} {ub} (differ: a back-off)"
    return line


def _speed_claim(doc: dict[str, Any], name: str, a: str, others: tuple[str, ...]) -> dict[str, Any]:
    """Verdict of 'a converges faster than each of others' on :data:`CLAIM_NETWORK` (rule :data:`VERDICT_RULE`)."""
    topo = CLAIM_NETWORK[name]
    if topo not in doc["config"]["topologies"]:
        return {"claim": CLAIMS[name], "network": topo, "verdict": "not testable", "holds_at_tau": [],
                "evidence": [], "reason": f"this form does not run {topo}", "incomplete": []}
    taus = [int(t) for t in doc["config"]["taus"]]
    n_seeds = len(doc["config"]["seeds"])
    evidence: list[str] = []
    holds: list[int] = []
    against: list[tuple[int, str, dict[str, Any]]] = []
    incomplete: list[str] = []
    for tau in taus:
        ok = True
        for b in others:
            d = _stat_of(doc, a, b, topo, tau, SPEED)
            evidence.append(_pair_line(doc, a, b, topo, tau))
            if d is None or d["seeds"] < n_seeds:
                incomplete.append(f"tau={tau} {a} − {b} ({0 if d is None else d['seeds']}/{n_seeds} seeds)")
            if d is not None and d["first_better"] < d["seeds"]:
                ok = False
                against.append((tau, b, d))
            elif d is None or d["seeds"] < n_seeds:
                ok = False
        if ok:
            holds.append(tau)
    secondary = [t for t in doc["config"]["topologies"] if t != topo]
    evidence += [f"(secondary) {_pair_line(doc, a, b, t, tau)}" for t in secondary for tau in taus for b in others]
    if against:
        verdict = "not reproduced"
    elif incomplete:
        verdict = "not testable"
    else:
        verdict = "reproduced"
    out = {"claim": CLAIMS[name], "network": topo, "verdict": verdict, "holds_at_tau": holds,
           "evidence": evidence, "reason": "", "incomplete": incomplete}
    if verdict == "not testable":
        out["reason"] = "cells not yet run: " + "; ".join(incomplete)
    elif verdict == "not reproduced":
        out["reason"] = _reason(doc, topo, a, against)
    return out


def _reason(doc: dict[str, Any], topo: str, a: str, against: list[tuple[int, str, dict[str, Any]]]) -> str:
    """The most likely reason a speed claim failed, from the run's numbers.

    The sign pattern of the failing pairs (slower on every seed, or mixed), a back-off that gave
    the two methods different steps, the step the tuning could reach (the paper's ``alpha0``
    included), the consensus violation (the heterogeneity bias the claim's mechanism acts on) and,
    for DFL-GT, its validation MSE against DFL-SGD's at every common ``alpha0``.
    """
    parts = []
    reversed_ = [(t, b, d) for t, b, d in against if d["first_better"] == 0]
    mixed = [(t, b, d) for t, b, d in against if d["first_better"] > 0]
    if reversed_:
        parts.append(f"{a} is slower on every seed at " + ", ".join(
            f"tau={t} vs {b} ({_fmt_pm(d)})" for t, b, d in reversed_))
    if mixed:
        parts.append("the sign changes across seeds at " + ", ".join(
            f"tau={t} vs {b} ({_fmt_pm(d)}, {a} faster on {d['first_better']}/{d['seeds']})" for t, b, d in mixed))
    confounded = sorted({(t, b) for t, b, _ in against
                         if _alpha_used(doc, a, topo, t) != _alpha_used(doc, b, topo, t)})
    if confounded:
        parts.append("the two runs did not use the same step on every seed (a diverging run backed off) at "
                     + ", ".join(f"tau={t} vs {b}" for t, b in confounded))
    n = int(doc["config"]["topologies"][topo])
    factor = spectral_factor(n)
    taus = sorted({t for t, _, _ in against})
    chosen = sorted({a0 for t in taus for a0 in [_tuned(doc, topo, t)] if a0 is not None})
    paper = float(doc["config"].get("paper_alpha0", PAPER_ALPHA0))
    paper_failed = [t for t in taus if _paper_step_failed(doc, topo, t, paper)]
    step = f"tuned alpha0 {', '.join(f'{c:g}' for c in chosen)}" if chosen else "no tuned alpha0"
    if paper_failed:
        step += f"; the paper's alpha0 = {paper:g} diverged on validation at tau = {', '.join(map(str, paper_failed))}"
    cons = [(t, _metric_mean(doc, "dfl-sgd", topo, t, "consensus")) for t in taus]
    cons_txt = ", ".join(f"tau={t} {c:.2g}" for t, c in cons if c is not None)
    if a == "dfl-gt":
        gc = [(t, _stat_of(doc, "dfl-gt", "dfl-sgd", topo, t, "consensus")) for t in taus]
        gc_txt = ", ".join(f"tau={t} {_fmt_pm(s)} (GT lower on {s['first_better']}/{s['seeds']})"
                           for t, s in gc if s is not None)
        parts.append(
            f"mechanism: gradient tracking removes the heterogeneity bias of the node models, which grows with "
            f"1/(1 − λ₂(W)) = {factor:.1f} on {topo}; here DFL-SGD's consensus violation (1/n)Σ‖θ_i − θ̄‖² at the "
            f"end is already small ({cons_txt})"
            + (f" (GT − SGD consensus {gc_txt})" if gc_txt else "")
            + "; θ̄ moves by the mean of the nodes' latest stochastic gradients under both methods, so the bias "
            f"GT removes barely reaches the global model at these steps ({step})")
        tun = _gt_vs_sgd_tuning(doc, topo, taus)
        if tun:
            parts.append("validation MSE at the same alpha0 (tuning seed): " + tun)
    else:
        parts.append(
            f"mechanism: the decentralised methods use FedAvg's step and mix over a ring with 1/(1 − λ₂(W)) = "
            f"{factor:.1f}; DFL-SGD's consensus violation at the end is small ({cons_txt}), so its θ̄ moves almost "
            f"as FedAvg's server model does and complete averaging gains little ({step})")
    return "; ".join(parts)


def _gt_vs_sgd_tuning(doc: dict[str, Any], topo: str, taus: list[int]) -> str:
    """Per tau: at how many common ``alpha0`` GT's validation MSE is above SGD's, and where only GT diverged."""
    out = []
    for t in doc.get("tuning") or []:
        tau = int(t["point"].get("tau"))
        if t["point"].get("topology") != topo or tau not in taus:
            continue
        pm = t.get("per_method") or {}
        gt, sgd = pm.get("dfl-gt") or {}, pm.get("dfl-sgd") or {}
        both = [v for v in gt if gt.get(v) is not None and sgd.get(v) is not None]
        worse = [v for v in both if gt[v] > sgd[v]]
        only_gt = [v for v in gt if gt.get(v) is None and sgd.get(v) is not None]
        if not both:
            continue
        top = max(both, key=float)
        txt = (f"tau={tau}: GT above SGD at {len(worse)}/{len(both)} common alpha0 (at {top}: "
               f"{gt[top]:.4g} vs {sgd[top]:.4g})")
        if only_gt:
            txt += f", only GT diverged at alpha0 = {', '.join(sorted(only_gt, key=float))}"
        out.append(txt)
    return "; ".join(out)


def _tuned(doc: dict[str, Any], topo: str, tau: int) -> float | None:
    for t in doc.get("tuning") or []:
        if t["point"].get("topology") == topo and int(t["point"].get("tau")) == tau:
            return None if t.get("chosen") is None else float(t["chosen"])
    return None


def _paper_step_failed(doc: dict[str, Any], topo: str, tau: int, paper: float) -> bool:
    for t in doc.get("tuning") or []:
        if t["point"].get("topology") == topo and int(t["point"].get("tau")) == tau:
            return f"{paper:g}" in t.get("scores", {}) and t["scores"][f"{paper:g}"] is None
    return False


def verdicts(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One verdict per claim of :data:`CLAIMS` (``reproduced`` / ``not reproduced`` / ``not testable``).

    Computed from the paired per-seed differences in ``doc`` (rule: :data:`VERDICT_RULE`); each
    verdict carries its evidence lines and, when not reproduced, the most likely reason with the
    run's numbers.
    """
    out = {"fedavg-fastest": _speed_claim(doc, "fedavg-fastest", "fedavg", ("dfl-gt", "dfl-sgd")),
           "gt-faster-than-sgd": _speed_claim(doc, "gt-faster-than-sgd", "dfl-gt", ("dfl-sgd",)),
           "gt-under-heterogeneity": _speed_claim(doc, "gt-under-heterogeneity", "dfl-gt", ("dfl-sgd",))}
    factors = {t: spectral_factor(int(n)) for t, n in doc["config"]["topologies"].items()}
    out["gt-under-heterogeneity"]["evidence"].insert(0, "1/(1 − λ₂(W)): " + ", ".join(
        f"{t} {f:.1f}" for t, f in factors.items()))
    end = []
    for topo in doc["config"]["topologies"]:
        for tau in doc["config"]["taus"]:
            s = _metric_mean(doc, "dfl-gt", topo, int(tau), "stationarity")
            c = _metric_mean(doc, "dfl-gt", topo, int(tau), "consensus")
            if s is not None and c is not None:
                end.append(f"{topo} tau={tau}: DFL-GT stationarity {s:.3g}, consensus {c:.3g} at "
                           f"T = {doc['config']['iterations']}")
    out["gt-rate"] = {"claim": CLAIMS["gt-rate"], "network": None, "verdict": "not testable", "holds_at_tau": [],
                      "evidence": end, "incomplete": [],
                      "reason": "a rate in T (and n) needs runs at several T with everything else fixed; the benchmark "
                                f"runs one T = {doc['config']['iterations']}, and its two networks differ in λ₂ as well "
                                "as in n"}
    return out


def verdict_lines(v: dict[str, dict[str, Any]]) -> list[str]:
    """The Markdown of :func:`verdicts`: one bullet per claim, its evidence and reason indented."""
    lines = []
    for name, x in v.items():
        where = f" (judged on {x['network']}" + (f"; holds at tau = {x['holds_at_tau']}" if x["holds_at_tau"]
                                                   else "") + ")" if x.get("network") else ""
        lines.append(f"- **{name}: {x['verdict']}**{where} — {x['claim']}.")
        lines += [f"  - {e}" for e in x["evidence"]]
        if x["reason"]:
            lines.append(f"  - most likely reason: {x['reason']}")
    return lines


def _fmt_pm(d: dict[str, Any]) -> str:
    """``+mean ± sd`` of a paired difference, the sd to two significant digits."""
    if d.get("mean") is None:
        return "–"
    return f"{d['mean']:+.4g}" + ("" if d.get("sd") is None else f" ± {d['sd']:.2g}")


def panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per topology: the global model, the own model and the stationarity against the rounds."""
    def style(label: str, r: dict[str, Any]) -> dict[str, Any]:
        return {"linestyle": {1: "-", 5: "--", 10: ":"}.get(r["point"]["tau"], "-."),
                "color": {"fedavg": "C0", "dfl-sgd": "C1", "dfl-gt": "C2"}.get(r["method"])}

    common: dict[str, Any] = {"panel_axis": "topology", "series_axes": ("tau",), "logy": True, "style": style,
                              "xlabel": "communication rounds"}
    return (curve_panels(doc, "avg_model_test_loss", ylabel="test MSE of the global model",
                         title="global model (FedAvg server / DFL average)", **common)
            + curve_panels(doc, "test_loss", ylabel="mean local test MSE (own model)",
                           title="own model after local steps (personalisation)", **common)
            + curve_panels(doc, "stationarity", ylabel="||mean grad f_i(theta_bar)||^2",
                           title="stationarity at the average model", **common))
