"""Benchmark B1 ``dfl`` (ALGORITHMS.md §2.10, §11; seed 000 §10.2, Fig. 10.1).

The paper's experiment: heterogeneous nonlinear regression (task ``synthetic-dfl``: node inputs
on node-specific intervals, node-specific nonlinearity, one shared ``w*``), a three-layer MLP
(10→64→64→1), step ``alpha0/√(t+1)``, FedAvg vs DFL-SGD vs DFL-GT. The paper reports
(qualitatively, no numbers) FedAvg fastest and DFL-GT faster than DFL-SGD.

Fair set-up (issue 10):

* **Topologies.** The paper's 5-node network (a ring ``C_5``, Metropolis weights all 1/3;
  ALGORITHMS §2.10 reconstruction) and a slowly mixing 20-node ring (node ``i`` uses interval and
  nonlinearity ``i mod 5``, so every neighbour has a different task: the heterogeneity bias that
  gradient tracking removes grows with ``1/(1 − λ₂(W))``, about 1.5 on ``C_5`` and 31 on ``C_20``).
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

``run(quick, seed, out)`` writes ``<out>/dfl.{json,md,png}``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.common.envinfo import env_info
from graphfl.common.results import markdown_table, plot_panels, write_json
from graphfl.p2p.algorithms import NodeState, registry
from graphfl.p2p.driver import run_network_inprocess
from graphfl.p2p.oracles import ProblemSpec, make_oracle
from graphfl.p2p.topology import make_topology
from graphfl.tasks.holdout import VALIDATION_FRACTION, validation_task

from .runcache import RunCache
from .tuning import search_grid

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

_cache = RunCache(None)  # run() points it at <out>/cache
RESUMABLE = True
"""An interrupted run continues in the same ``--out`` (finished runs come from ``<out>/cache``)."""


def cached_run(method: str, tau: int, alpha0: float, iterations: int, seed: int, n: int,
               split: str = "test", eval_points: int = 20, with_stationarity: bool = True) -> dict[str, Any]:
    """:func:`run_method` through the run cache (divergences are cached too and re-raised)."""
    key = {"bench": NAME, "method": method, "tau": tau, "alpha0": alpha0, "iterations": iterations, "seed": seed,
           "n": n, "split": split, "eval_points": eval_points, "stationarity": with_stationarity,
           "inputs": INPUTS, "metrics": METRICS_VERSION}

    def go() -> dict[str, Any]:
        try:
            return run_method(method, tau, alpha0, iterations, seed, n, split=split, eval_points=eval_points,
                              with_stationarity=with_stationarity)
        except Diverged as exc:
            return {"diverged": str(exc)}

    out = _cache(key, go)
    if "diverged" in out:
        raise Diverged(out["diverged"])
    return out


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


def run_with_backoff(method: str, tau: int, alpha0: float, form: Form, seed: int,
                     n: int) -> tuple[dict[str, Any] | None, float | None]:
    """The test run at the tuned ``alpha0``; if its *training* loss diverges, the next smaller step.

    The smaller steps are the grid's, then halvings of its smallest value (:data:`BACKOFF_HALVINGS`
    of them). Divergence is detected on the minibatch training loss only, so this uses no test
    data. Returns ``(run, alpha0 used)`` or ``(None, None)`` when every smaller step diverges too.
    """
    smallest = min(form.grid)
    below = [smallest / 2**k for k in range(1, BACKOFF_HALVINGS + 1)]
    for a0 in sorted({alpha0, *(a for a in form.grid if a <= alpha0), *below}, reverse=True):
        try:
            return cached_run(method, tau, a0, form.iterations, seed, n, eval_points=form.eval_points), a0
        except Diverged as exc:
            logger.warning("%s (seed %d); backing off to the next smaller step", exc, seed)
    return None, None


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


def tune(tau: int, n: int, form: Form, seed: int) -> dict[str, Any]:
    """One ``alpha0`` for all :data:`METHODS` at this (``n``-ring, ``tau``), by validation loss.

    Criterion (ALGORITHMS §0.1 C1): the mean over the methods of the global-model validation MSE
    (last 10 % of evaluation points; first seed, 20 % of the training data held out). A value at
    which any method diverges is not eligible. A winning edge of the grid is extended (×2 or ÷2,
    at most :data:`GRID_EXTENSIONS` steps, :func:`~graphfl.bench.tuning.search_grid`).
    """
    why: dict[str, str] = {}
    per_method: dict[str, dict[str, float | None]] = {m: {} for m in METHODS}

    def score(a0: float) -> float | None:
        losses: list[float] = []
        for m in METHODS:
            try:
                r = cached_run(m, tau, a0, form.iterations, seed, n, split="val",
                               eval_points=form.eval_points, with_stationarity=False)
            except Diverged as exc:
                why[f"{a0:g}"] = str(exc)
                per_method[m][f"{a0:g}"] = None
                return None
            loss = float(r["final"]["avg_model_test_loss"])
            per_method[m][f"{a0:g}"] = loss
            losses.append(loss)
        return float(np.mean(losses))

    try:
        found = search_grid(score, form.grid, factor=2.0, max_extensions=GRID_EXTENSIONS)
    except RuntimeError:
        raise RuntimeError(f"tau={tau} n={n}: every alpha0 in {form.grid} diverged for some method: {why}") from None
    return {"grid_val_loss": found.grid_scores(), "per_method_val_loss": per_method, "diverged": why,
            "alpha0": found.chosen, "at_grid_edge": found.at_edge, "extended": found.extended}


def _loss(v: float | None) -> str:
    return "–" if v is None else f"{v:.4f}"


def _pm(values: list[float]) -> dict[str, Any]:
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"mean": None, "sd": None, "per_seed": values}
    return {"mean": float(np.mean(vals)), "sd": float(np.std(vals, ddof=1)) if len(vals) > 1 else None,
            "per_seed": vals}


def paired(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Per-seed ``a − b`` of final ``key`` (negative = ``a`` better), mean ± sd and sign count."""
    diffs = [float(x[key]) - float(y[key]) for x, y in zip(a, b) if x.get(key) is not None and y.get(key) is not None]
    out = _pm(diffs)
    out["first_better"] = int(sum(d < 0 for d in diffs))
    out["seeds"] = len(diffs)
    return out


def _mean_curve(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    curve = []
    for k, c in enumerate(runs[0]["curve"]):
        row = dict(c)
        for key in ("test_loss", "avg_model_test_loss", "exchanged_models_test_loss", "stationarity", "consensus"):
            vals = [r["curve"][k].get(key) for r in runs]
            if all(v is not None for v in vals):
                row[key] = float(np.mean(vals))
                if key in ("test_loss", "avg_model_test_loss"):
                    row[f"{key}_sd"] = float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0
        curve.append(row)
    return curve


def run(quick: bool, seed: int, out: Path) -> dict[str, Any]:
    """Run B1 and write ``<out>/dfl.{json,md,png}``; returns the result dict."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(1)
    form = QUICK if quick else FULL
    seeds = [seed + k for k in range(form.seeds)]
    t_start = time.perf_counter()
    global _cache
    _cache = RunCache(out / "cache")
    tuning: dict[str, dict[str, dict[str, Any]]] = {}
    methods: dict[str, Any] = {}
    pairs: dict[str, dict[str, Any]] = {}
    ordering: dict[str, dict[str, Any]] = {}
    for topo, n in TOPOLOGIES.items():
        tuning[topo], pairs[topo], ordering[topo] = {}, {}, {}
        for tau in TAUS:
            logger.info("B1 %s tau=%d: tuning the shared alpha0 on validation", topo, tau)
            tuned = tune(tau, n, form, seed)
            finals: dict[str, list[dict[str, Any]]] = {}
            for m in METHODS:
                runs: list[dict[str, Any]] = []
                diverged = 0
                used: list[float | None] = []
                for s in seeds:
                    r, a0 = run_with_backoff(m, tau, tuned["alpha0"], form, s, n)
                    used.append(a0)
                    if r is None:
                        diverged += 1
                    else:
                        runs.append(r)
                label = f"{topo} {m} tau={tau}"
                if not runs:
                    methods[label] = {"final": {"test_loss": None, "diverged": diverged}, "curve": []}
                    continue
                per_seed = [r["final"] for r in runs]
                finals[m] = per_seed if not diverged else []
                final = {key: _pm([f[key] for f in per_seed])
                         for key in ("test_loss", "test_loss_over_run", "avg_model_test_loss", "avg_model_over_run",
                                     "exchanged_models_test_loss", "stationarity", "consensus")}
                methods[label] = {
                    "topology": topo, "nodes": n, "tau": tau, "method": m, "alpha0": tuned["alpha0"],
                    "alpha0_used_per_seed": used,
                    "final": {**{k: v["mean"] for k, v in final.items()},
                              **{f"{k}_sd": v["sd"] for k, v in final.items()},
                              "rounds": per_seed[0]["rounds"], "bytes": per_seed[0]["bytes"],
                              "diverged": diverged, "seconds": float(np.mean([r["seconds"] for r in runs]))},
                    "per_seed": final,
                    "curve": _mean_curve(runs),
                }
            tuning[topo][str(tau)] = tuned
            if all(finals.get(m) for m in METHODS):
                keys = ("avg_model_test_loss", "avg_model_over_run", "exchanged_models_test_loss", "test_loss",
                        "test_loss_over_run", "stationarity")
                pairs[topo][str(tau)] = {
                    "gt_minus_sgd": {k: paired(finals["dfl-gt"], finals["dfl-sgd"], k) for k in keys},
                    "fedavg_minus_gt": {k: paired(finals["fedavg"], finals["dfl-gt"], k) for k in keys},
                    "fedavg_minus_sgd": {k: paired(finals["fedavg"], finals["dfl-sgd"], k) for k in keys},
                }
                means = {m: methods[f"{topo} {m} tau={tau}"]["final"] for m in METHODS}
                by_speed = sorted(METHODS, key=lambda m: means[m]["avg_model_over_run"])
                by_final = sorted(METHODS, key=lambda m: means[m]["avg_model_test_loss"])
                by_own = sorted(METHODS, key=lambda m: means[m]["test_loss"])
                paper = ["fedavg", "dfl-gt", "dfl-sgd"]
                ordering[topo][str(tau)] = {
                    "global_model_by_mean_over_run": by_speed, "global_model_by_final": by_final,
                    "own_model_by_final": by_own,
                    "paper_order_by_speed": by_speed == paper, "paper_order_by_final": by_final == paper,
                }
    doc = {
        "name": NAME,
        "config": {"quick": quick, "seeds": seeds, "topologies": TOPOLOGIES, "taus": list(TAUS),
                   "iterations": form.iterations, "alpha0_grid": list(form.grid), "eval_points": form.eval_points,
                   "batch_size": BATCH, "model": "MLP 10-64-64-1 (ReLU)",
                   "step": "alpha0/sqrt(t+1), one alpha0 per (topology, tau) for all methods",
                   "inputs": "standardised with the pooled training mean/sd of all nodes", "tuning_seed": seed,
                   "primary_metric": "global model (FedAvg server model / DFL node average) test MSE",
                   "validation_fraction": VALIDATION_FRACTION, "paper_alpha0": PAPER_ALPHA0},
        "unspecified_settings": UNSPECIFIED,
        "paper": {"figure": "seed 000 Fig. 10.1 (test loss vs communication rounds, 5 nodes)",
                  "claims": ["FedAvg converges fastest", "DFL-GT converges faster than DFL-SGD"],
                  "numbers": None},
        "tuning": tuning,
        "methods": methods,
        "paired": pairs,
        "ordering": ordering,
        "env": env_info(),
        "seconds": time.perf_counter() - t_start,
    }
    doc["verdict"] = verdict(doc)
    write_json(out / f"{NAME}.json", doc)
    (out / f"{NAME}.md").write_text(render_markdown(doc))
    plot(doc, out / f"{NAME}.png")
    return doc


def verdict(doc: dict[str, Any]) -> list[str]:
    """One line per (topology, tau): does the paper's ordering appear on the global model, with the paired numbers."""
    lines = []
    for topo, per_tau in doc["paired"].items():
        for tau, p in per_tau.items():
            o = doc["ordering"][topo][tau]
            gs, fg = p["gt_minus_sgd"], p["fedavg_minus_gt"]

            def cnt(d: dict[str, Any]) -> str:
                return f"{d['first_better']}/{d['seeds']}"

            lines.append(
                f"{topo} tau={tau}: global model, speed order {' < '.join(o['global_model_by_mean_over_run'])}, "
                f"final order {' < '.join(o['global_model_by_final'])} (paper: fedavg < dfl-gt < dfl-sgd); "
                f"GT-SGD global model over run {_fmt_pm(gs['avg_model_over_run'])} (GT better in "
                f"{cnt(gs['avg_model_over_run'])} seeds), final {_fmt_pm(gs['avg_model_test_loss'])} "
                f"({cnt(gs['avg_model_test_loss'])}), stationarity {_fmt_pm(gs['stationarity'])} "
                f"({cnt(gs['stationarity'])}); FedAvg-GT global model over run {_fmt_pm(fg['avg_model_over_run'])} "
                f"({cnt(fg['avg_model_over_run'])}); personalisation (own model after local steps) GT-SGD final "
                f"{_fmt_pm(gs['test_loss'])} ({cnt(gs['test_loss'])})")
    return lines


def _fmt_pm(d: dict[str, Any]) -> str:
    if d.get("mean") is None:
        return "–"
    return f"{d['mean']:+.4g}" + ("" if d.get("sd") is None else f" ± {d['sd']:.2g}")


def render_markdown(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    lines = [
        "# B1: FedAvg vs DFL-SGD vs DFL-GT (seed 000 Fig. 10.1)", "",
        f"{cfg['iterations']} iterations, seeds {cfg['seeds']}, step alpha0/sqrt(t+1) with one alpha0 per "
        f"(topology, tau) for all methods, chosen on the validation split (grid {cfg['alpha0_grid']}, seed "
        f"{cfg['tuning_seed']}); inputs standardised with the pooled training mean/sd of all nodes. Test split, "
        "mean ± sd over seeds. **Global** = the global model (FedAvg's server model, the DFL node average θ̄) on "
        "every node's test split, the primary metric; exchanged = each node's model after the exchange (its "
        "next starting point) on every node's test split; own = node i's model after its local steps on node "
        "i's test split (personalisation); stationarity = ‖(1/n) Σ ∇f_i(θ̄)‖² (full batch, training data); "
        "final = mean of the last 10% of evaluation points, over run = mean of all of them (lower = faster).", "",
        "## Results (test)", "",
    ]
    rows = []
    for res in doc["methods"].values():
        f = res["final"]
        if "topology" not in res:
            continue
        a0 = res["alpha0"] if all(u == res["alpha0"] for u in res["alpha0_used_per_seed"]) else \
            f"{res['alpha0']:g} (used {', '.join('–' if u is None else f'{u:g}' for u in res['alpha0_used_per_seed'])})"
        rows.append([res["topology"], res["tau"], res["method"], a0,
                     _pm_str(f["avg_model_test_loss"], f["avg_model_test_loss_sd"]),
                     _pm_str(f["avg_model_over_run"], f["avg_model_over_run_sd"]),
                     _pm_str(f["exchanged_models_test_loss"], f["exchanged_models_test_loss_sd"]),
                     _pm_str(f["test_loss"], f["test_loss_sd"]),
                     _pm_str(f["stationarity"], f["stationarity_sd"]), _pm_str(f["consensus"], f["consensus_sd"]),
                     f["rounds"], f["diverged"]])
    lines += [markdown_table(rows, ["topology", "tau", "method", "alpha0", "global final", "global over run",
                                    "exchanged final", "own final", "stationarity", "consensus", "rounds",
                                    "diverged"]), ""]
    lines += ["## Paired per seed (negative = first method better; count = seeds where it is better)", ""]
    prow = []
    for topo, per_tau in doc["paired"].items():
        for tau, p in per_tau.items():
            for name, key in (("GT − SGD", "gt_minus_sgd"), ("FedAvg − GT", "fedavg_minus_gt"),
                              ("FedAvg − SGD", "fedavg_minus_sgd")):
                d = p[key]
                prow.append([topo, tau, name] + [f"{_fmt_pm(d[k])} ({d[k]['first_better']}/{d[k]['seeds']})"
                                                 for k in ("avg_model_test_loss", "avg_model_over_run",
                                                           "exchanged_models_test_loss", "test_loss",
                                                           "stationarity")])
    lines += [markdown_table(prow, ["topology", "tau", "pair", "global final", "global over run", "exchanged final",
                                    "own final", "stationarity"]), ""]
    lines += ["## Tuning (validation global-model MSE per alpha0, mean over the methods; – = some method diverged)",
              ""]
    trow = []
    grid = [f"{a:g}" for a in cfg["alpha0_grid"]]
    for topo, per_tau in doc["tuning"].items():
        for tau, t in per_tau.items():
            trow.append([topo, tau] + [t["grid_val_loss"].get(a) for a in grid]
                        + [t["alpha0"], "yes" if t["at_grid_edge"] else "",
                           ", ".join(f"{x:g}: {_loss(t['grid_val_loss'].get(f'{x:g}'))}"
                                     for x in t.get("extended", []))])
    lines += [markdown_table(trow, ["topology", "tau"] + [f"a0={a}" for a in grid]
                             + ["chosen", "edge", "extended (val MSE)"]), ""]
    lines += ["## Against the paper (Fig. 10.1: FedAvg fastest, DFL-GT faster than DFL-SGD)", ""]
    lines += [f"- {v}" for v in doc["verdict"]]
    lines += ["", "## Settings the paper does not give", ""] + [f"- {u}" for u in doc["unspecified_settings"]]
    lines += ["", f"Wall time {doc['seconds']:.0f} s.", ""]
    return "\n".join(lines)


def _pm_str(mean: float | None, sd: float | None) -> str:
    if mean is None:
        return "–"
    fmt = "{:.3e}" if abs(mean) < 1e-3 and mean != 0 else "{:.4f}"
    return fmt.format(mean) + ("" if sd is None else " ± " + fmt.format(sd))


def plot(doc: dict[str, Any], path: Path) -> None:
    panels = []
    for topo in TOPOLOGIES:
        series = {f"{r['method']} tau={r['tau']}": r["curve"] for r in doc["methods"].values()
                  if r.get("topology") == topo and r["curve"]}
        style = {label: {"linestyle": {"1": "-", "5": "--", "10": ":"}[label.split("=")[1]],
                         "color": {"fedavg": "C0", "dfl-sgd": "C1", "dfl-gt": "C2"}[label.split()[0]]}
                 for label in series}
        panels.append({"x": "round", "y": "avg_model_test_loss", "xlabel": "communication rounds",
                       "ylabel": "test MSE of the global model", "series": series, "logy": True, "style": style,
                       "title": f"{topo}: global model (FedAvg server / DFL average)"})
        panels.append({"x": "round", "y": "test_loss", "xlabel": "communication rounds",
                       "ylabel": "mean local test MSE (own model)", "series": series, "logy": True, "style": style,
                       "title": f"{topo}: own model after local steps (personalisation)"})
        panels.append({"x": "round", "y": "stationarity", "xlabel": "communication rounds",
                       "ylabel": "||mean grad f_i(theta_bar)||^2", "series": series, "logy": True, "style": style,
                       "title": f"{topo}: stationarity at the average model"})
    plot_panels(path, panels, title="B1: FedAvg vs DFL-SGD vs DFL-GT (one alpha0, tuned on validation)")
