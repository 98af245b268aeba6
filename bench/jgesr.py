"""Benchmark B7 (ALGORITHMS.md §8.9, §11; seed 002 Table 1): JGESR under noisy, lossy uplinks.

Seven methods — FedAvg, FedProx, CFL, FedAMP, pFedGraph, JGESR (PDCA), JGESR (Two-step) — on a
Dirichlet non-IID partition of ``--task`` (digits | mnist | cifar10), every upload passing the
noisy channel (:mod:`graphfl.client.noisy_channel`: ``y = m ⊙ θ + n``, ``σ = c·mean|θ|``):

* **table** (shaped like the paper's Table 1): two noise levels ``c``, no missing entries;
* **missing-rate sweep** at the first noise level: ``r`` over :attr:`Form.missing_rates`;
* metric: the mean over clients of the test accuracy of the model each client is given after the
  last round (its personalised model for CFL/FedAMP/pFedGraph/JGESR, the global one for
  FedAvg/FedProx), mean ± sd over seeds.

Fairness: one optimiser for all (plain SGD, the same local steps and batch); the step size of
*each method* is chosen from a small grid on a validation split of the clients' training data
(:func:`graphfl.tasks.holdout.validation_task`; at the first noise level, no missing entries,
first seed), never on test. Every setting the paper did not give is listed in the result file
(:func:`unspecified`). ``run(quick, seed, out, task)`` writes ``<out>/jgesr.{json,md,png}``;
finished runs are cached under ``<out>/cache`` (an interrupted benchmark resumes).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.tasks.holdout import VALIDATION_FRACTION, validation_task

from .runcache import RunCache

logger = logging.getLogger(__name__)

NAME = "jgesr"
TASKS = ("digits", "mnist", "cifar10")

METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "FedAvg": ("fedavg", {}),
    "FedProx": ("fedprox", {"fedprox.mu": 0.01}),
    "CFL": ("cfl", {"cfl.warmup-rounds": 5}),
    "FedAMP": ("fedamp", {}),
    "pFedGraph": ("pfedgraph", {}),
    "JGESR-PDCA": ("jgesr", {"jgesr.solver": "pdca", "jgesr.log-graph": False}),
    "JGESR-two-step": ("jgesr", {"jgesr.solver": "two-step", "jgesr.log-graph": False}),
}
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
    noise_levels: tuple[float, float]
    missing_rates: tuple[float, ...]
    lr_grid: tuple[float, ...]
    max_samples: int


QUICK = Form(nodes=10, rounds=20, local_steps=10, batch_size=32, seeds=3, noise_levels=(0.5, 1.0),
             missing_rates=(0.0, 0.3, 0.5), lr_grid=(0.1, 0.3, 1.0), max_samples=0)
FULL = Form(nodes=10, rounds=100, local_steps=50, batch_size=64, seeds=3, noise_levels=(0.5, 1.0),
            missing_rates=(0.0, 0.1, 0.2, 0.3, 0.5), lr_grid=(0.01, 0.03, 0.1, 0.3, 1.0), max_samples=0)
DIRICHLET = 0.5
QUICK_MAX_SAMPLES = {"mnist": 6000, "cifar10": 6000}


def unspecified(form: Form, task: str) -> list[str]:
    """Every choice the paper does not give (the paper's values were stripped; ALGORITHMS.md §8.9)."""
    return [
        f"task {task}; {form.nodes} clients; Dirichlet alpha {DIRICHLET}; local train/test split 80/20",
        f"{form.rounds} rounds, {form.local_steps} local SGD steps of batch {form.batch_size} per round "
        "(plain SGD, momentum 0), the same for every method",
        f"step size per method from {list(form.lr_grid)} on validation ({VALIDATION_FRACTION:.0%} of each "
        "client's training data; noise level 1, no missing entries, first seed), by mean validation accuracy",
        f"noise levels c = {list(form.noise_levels)} with sigma = c * mean|theta| of each upload (the paper: "
        "mean|theta^0| of the initial model; one sigma per upload)",
        f"missing rates {list(form.missing_rates)} at noise level 1; lost entries are 0 + noise on the wire, "
        "their mask reaches the server (only JGESR uses it)",
        "JGESR: lambda 1, alpha 1, beta 0.1 (scaled problem, mean-1 client weights), tol 1e-4, warm starts, "
        "cosine initial graph (ALGORITHMS.md §8, reconstructed)",
        "FedProx mu 0.01; CFL eps1 0.4, eps2 1.6, warm-up 5 rounds, complete linkage; FedAMP heuristic "
        "(self weight 0.3, scale 10, prox mu 0.1); pFedGraph alpha 0.8, clip 0.9, lam 0.01",
        "model: the task's model (digits: MLP 64-64-10; mnist/cifar10: CNN conv5x5(32)-pool-conv5x5(64)-pool-"
        "FC(512)-FC(10))",
        f"seeds: {form.seeds} (mean ± sd over seeds of the mean client test accuracy after the last round)",
    ]


_cache = RunCache(None)
RESUMABLE = True
"""An interrupted run continues in the same ``--out`` (finished runs come from ``<out>/cache``)."""


def run_one(method: str, task: str, form: Form, seed: int, lr: float, noise: float, missing: float) -> dict[str, Any]:
    """One in-process run of ``method``; returns the accuracy curve and the final accuracy."""
    strategy, params = METHODS[method]
    values: dict[str, Any] = {
        "strategy": strategy, "task": task, "nodes": form.nodes, "rounds": form.rounds, "seed": seed,
        "engine": "inprocess", "train.lr": lr, "train.local-steps": form.local_steps,
        "train.batch-size": form.batch_size, "train.momentum": 0.0, "data.dirichlet-alpha": DIRICHLET,
        "channel.noise": noise, "channel.missing": missing, **params,
    }
    max_samples = form.max_samples or QUICK_MAX_SAMPLES.get(task.removesuffix("+val"), 0)
    if max_samples:
        values["data.max-samples"] = max_samples
    key = {"method": method, **values}

    def compute() -> dict[str, Any]:
        from graphfl.common.config import parse_run_config
        from graphfl.server.inprocess import run_federated_inprocess
        from graphfl.server.rounds import RunError

        t0 = time.perf_counter()
        try:
            doc, _ = run_federated_inprocess(parse_run_config(values))
        except RunError as exc:  # e.g. every upload NaN at a too large step: a failed setting, not a crash
            logger.warning("%s lr %g diverged: %s", method, lr, exc)
            return {"acc": [], "final": None, "error": str(exc), "wall_seconds": time.perf_counter() - t0}
        curve = doc["methods"][strategy]["curve"]
        agg = [r.get("server_seconds") for r in curve[1:]]
        return {"acc": [r.get("test_acc") for r in curve], "final": curve[-1].get("test_acc"),
                "wall_seconds": time.perf_counter() - t0, "server_seconds": agg}

    result = _cache(key, compute)
    logger.info("%s %s seed %d lr %g c %g r %g: acc %.4f", method, task, seed, lr, noise, missing,
                result["final"] or float("nan"))
    return result


def _stats(values: list[float | None]) -> dict[str, Any]:
    xs = np.asarray([v for v in values if v is not None], dtype=float)
    if xs.size == 0:
        return {"mean": None, "sd": None, "n": 0}
    return {"mean": float(xs.mean()), "sd": float(xs.std(ddof=1)) if xs.size > 1 else 0.0, "n": int(xs.size)}


def tune(task: str, form: Form, seed: int) -> dict[str, dict[str, Any]]:
    """Step size per method on the validation view of ``task`` (noise level 1, no missing entries)."""
    val = validation_task(task)
    out: dict[str, dict[str, Any]] = {}
    for method in METHODS:
        scores = {lr: run_one(method, val, form, seed, lr, form.noise_levels[0], 0.0)["final"] for lr in form.lr_grid}
        finite = {lr: s for lr, s in scores.items() if s is not None and np.isfinite(s)}
        best = max(finite, key=lambda lr: finite[lr]) if finite else form.lr_grid[0]
        out[method] = {"lr": best, "validation_acc": {str(k): v for k, v in scores.items()}}
    return out


def run(quick: bool = False, seed: int = 0, out: Path | None = None, task: str = "digits") -> dict[str, Any]:
    """Tune, run the table and the missing-rate sweep; write ``<out>/jgesr.{json,md,png}``."""
    global _cache
    if task not in TASKS:
        raise ValueError(f"bench jgesr: task {task!r} is not one of {list(TASKS)}")
    form = QUICK if quick else FULL
    if out is not None:
        _cache = RunCache(out / "cache")
    t0 = time.perf_counter()
    tuned = tune(task, form, seed)
    seeds = [seed + k for k in range(form.seeds)]
    table: dict[str, dict[str, Any]] = {}
    sweep: dict[str, list[dict[str, Any]]] = {}
    for method in METHODS:
        lr = tuned[method]["lr"]
        row: dict[str, Any] = {}
        for level, c in enumerate(form.noise_levels, start=1):
            finals = [run_one(method, task, form, s, lr, c, 0.0)["final"] for s in seeds]
            row[f"noise{level}"] = {"c": c, **_stats(finals), "runs": finals}
        table[method] = row
        points = []
        for r in form.missing_rates:
            finals = [run_one(method, task, form, s, lr, form.noise_levels[0], r)["final"] for s in seeds]
            points.append({"missing": r, **_stats(finals), "runs": finals})
        sweep[method] = points
    doc: dict[str, Any] = {
        "name": NAME, "task": task, "quick": quick, "seed": seed, "form": form.__dict__,
        "tuned": tuned, "table": table, "missing_sweep": sweep, "paper_mnist": PAPER_MNIST,
        "unspecified": unspecified(form, task), "wall_seconds": time.perf_counter() - t0,
    }
    if out is not None:
        _write(out, doc, form)
    return doc


def _pct(stat: dict[str, Any]) -> str:
    if stat.get("mean") is None:
        return "–"
    return f"{100 * stat['mean']:.2f} ± {100 * stat['sd']:.2f}"


def _write(out: Path, doc: dict[str, Any], form: Form) -> None:
    from graphfl.common.envinfo import env_info
    from graphfl.common.results import atomic_write_text, markdown_table, plot_panels, write_json

    doc["env"] = env_info()
    write_json(out / f"{NAME}.json", doc)
    c1, c2 = form.noise_levels
    rows = []
    for method, row in doc["table"].items():
        paper = PAPER_MNIST.get(method, (None, None))
        rows.append({"method": method, "lr": doc["tuned"][method]["lr"], f"c={c1}": _pct(row["noise1"]),
                     f"c={c2}": _pct(row["noise2"]), "paper MNIST n1": paper[0], "paper MNIST n2": paper[1]})
    sweep_rows = []
    for method, points in doc["missing_sweep"].items():
        sweep_rows.append({"method": method, **{f"r={p['missing']}": _pct(p) for p in points}})
    md = [f"# {NAME} ({doc['task']}{', quick' if doc['quick'] else ''})", "",
          f"Mean client test accuracy (%) after {form.rounds} rounds, mean ± sd over {form.seeds} seeds; "
          "uploads through the noisy channel, no missing entries. The paper's MNIST numbers are shown for "
          "reference only (other task, other settings).", "",
          markdown_table(rows, list(rows[0])), "",
          f"## Missing-rate sweep (noise c = {c1})", "", markdown_table(sweep_rows, list(sweep_rows[0])), "",
          "## Settings not given by the paper", ""] + [f"- {s}" for s in doc["unspecified"]]
    atomic_write_text(out / f"{NAME}.md", "\n".join(md) + "\n")
    series = {m: [{"missing": p["missing"], "acc": p["mean"], "sd": p["sd"]} for p in pts]
              for m, pts in doc["missing_sweep"].items()}
    plot_panels(out / f"{NAME}.png", [{"x": "missing", "y": "acc", "band": "sd", "series": series,
                                       "xlabel": "missing rate r", "ylabel": "mean client test accuracy",
                                       "title": f"{doc['task']}, noise c = {c1}"}],
                "JGESR vs baselines under a noisy, lossy uplink")
