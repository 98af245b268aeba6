"""Cost of JGESR's aggregation against clients ``n`` and parameters ``d`` beside FedAvg's.

For every ``(n, d)`` of the grid (``n ∈ {10, 50, 100}``, ``d ∈ {1e4, 1e5, 1e6}``, plus the
target point ``n = 50, d = 512``) the server cores aggregate one round of synthetic float32
uploads: two planted groups of clients, ``y = θ_group + 0.5·N(0, 1)`` (ALGORITHMS.md §8's
planted problem). Timed, wall clock, the whole ``aggregate_train`` of the real core (copying the
uploads into the ``n x d`` table, the solve, one payload per client):

* ``fedavg``: :class:`~graphfl.strategies.fedavg.FedAvgCore` (sample-weighted mean);
* ``pdca`` / ``two-step``: :class:`~graphfl.strategies.jgesr.JGESRCore`, a cold round (cosine
  initial graph) and then a *warm* round (the next round's uploads = these + a 1 % perturbation,
  warm-started from the previous ``W``, ``Ψ``);
* ``pdca-masked``: PDCA with 30 % of the entries missing (the channel's masks), for ``d <= 1e5``
  (each MM step costs three ``n²d`` products; at ``d = 1e6`` it is listed as not run).

Settings: the defaults of :class:`~graphfl.strategies.jgesr.JGESRConfig` (tolerance 1e-4 on the
projected-gradient residual: the documented early stop), ``work_dtype = auto`` (float32 above
4M entries). Targets: <= 1 s at ``n = 50, d = 512`` and <= 10 s at ``n = 100,
d = 1e6`` on the 2-core development host. ``--quick`` runs one repeat per point, the full form 3
(mean ± sd over the repeats; the targets are judged on the median). Writes
``jgesr-cost.{json,md,png}``.

On the benchmark harness (:mod:`graphfl.bench.harness`) in its measurement mode (``cache="none"``):
methods = the cores above, points = ``(n, d)``, seeds = repeats (the uploads are the same in every
repeat: drawn from the run's ``seed``), metrics = the cold and warm seconds and the solver's
iteration counts; paired PDCA − two-step per repeat. The values are timings of one aggregation,
which belong to the machine's load during this run: every cell is measured in the run that writes
the result, none is cached across runs. What this module adds: the uploads, the timed call
(:func:`time_point`) and the targets.
"""

from __future__ import annotations

import gc
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.common.config import RunConfig
from graphfl.common.core import ServerContext
from graphfl.common.results import markdown_table
from graphfl.common.types import ClientUpdate
from graphfl.strategies.fedavg import FedAvgCore, FedAvgParams
from graphfl.strategies.jgesr import JGESRConfig, JGESRCore

from .harness import Bench, Cell, Metric, Outcome, run_bench
from .report import build_doc, format_value, metric_panels, write_report

logger = logging.getLogger(__name__)

NAME = "jgesr-cost"
NS = (10, 50, 100)
DS = (10_000, 100_000, 1_000_000)
EXTRA = ((50, 512),)
METHODS = ("fedavg", "pdca", "two-step", "pdca-masked")
MASKED_MAX_D = 100_000
TARGETS = {(50, 512): 1.0, (100, 1_000_000): 10.0}


def _uploads(n: int, d: int, seed: int, perturb: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng([seed, n, d])
    centers = rng.standard_normal((2, d), dtype=np.float32)
    y = np.repeat(centers, [n // 2, n - n // 2], axis=0)
    y += 0.5 * rng.standard_normal((n, d), dtype=np.float32)
    if perturb:
        y += perturb * np.random.default_rng([seed, n, d, 1]).standard_normal((n, d), dtype=np.float32)
    return y


def _core(strategy: str, n: int, d: int, params: Any) -> Any:
    template = {"w": np.zeros(d, dtype=np.float32)}
    ctx = ServerContext(config=RunConfig(strategy=strategy, params=params), params=params, num_clients=n,
                        initial_arrays=template, param_keys=("w",), num_examples={i: 100 for i in range(n)})
    if strategy == "fedavg":
        return FedAvgCore(ctx)
    return JGESRCore(ctx)


def _updates(y: np.ndarray, missing: float, seed: int) -> dict[int, Any]:
    out = {}
    rng = np.random.default_rng([seed, 77])
    for i in range(y.shape[0]):
        mask: dict[str, np.ndarray] | None = {"w": np.asarray(rng.random(y.shape[1]) >= missing)} if missing else None
        out[i] = ClientUpdate(i, {"w": y[i]}, 100, mask=mask)
    return out


def time_point(method: str, n: int, d: int, seed: int, repeats: int) -> dict[str, Any]:
    """Median seconds of a cold (and for JGESR a warm) aggregation at ``(n, d)``."""
    y = _uploads(n, d, seed)
    y_next = _uploads(n, d, seed, perturb=0.01)
    missing = 0.3 if method == "pdca-masked" else 0.0
    ups, ups_next = _updates(y, missing, seed), _updates(y_next, missing, seed + 1)
    cold: list[float] = []
    warm: list[float] = []
    info: dict[str, Any] = {}
    for _ in range(repeats):
        if method == "fedavg":
            core = _core("fedavg", n, d, FedAvgParams())
        else:
            core = _core("jgesr", n, d, JGESRConfig(solver="two-step" if method == "two-step" else "pdca",
                                                    log_graph=False))
        gc.collect()
        t0 = time.perf_counter()
        m1 = core.aggregate_train(1, ups)
        cold.append(time.perf_counter() - t0)
        if method != "fedavg":
            t0 = time.perf_counter()
            m2 = core.aggregate_train(2, ups_next)
            warm.append(time.perf_counter() - t0)
            info = {"iterations_cold": m1["iterations"], "iterations_warm": m2["iterations"],
                    "solve_seconds_cold": m1["solve_seconds"], "solve_seconds_warm": m2["solve_seconds"],
                    "converged": bool(m1["converged"] and m2["converged"]), "impute_steps": m1["impute_steps"]}
        del core
    out: dict[str, Any] = {"method": method, "n": n, "d": d, "seconds": float(np.median(cold)),
                           "repeats": repeats, **info}
    if warm:
        out["seconds_warm"] = float(np.median(warm))
    target = TARGETS.get((n, d))
    if target is not None and method in ("pdca", "two-step"):
        out["target_seconds"] = target
        out["meets_target"] = out["seconds"] <= target
    logger.info("%s n=%d d=%d: %.3f s%s", method, n, d, out["seconds"],
                f" (warm {out['seconds_warm']:.3f} s)" if warm else "")
    return out


METRICS = (Metric("seconds", "cold round s", fmt=".4g"), Metric("seconds_warm", "warm round s", fmt=".4g"),
           Metric("iterations_cold", "iterations cold", fmt=".1f", paired=False),
           Metric("iterations_warm", "iterations warm", fmt=".1f", paired=False),
           Metric("impute_steps", "impute steps", fmt=".1f", paired=False))
FINAL_KEYS = tuple(m.name for m in METRICS)


def measure(seed: int, cell: Cell) -> dict[str, Any]:
    """One repeat (``cell.seed``) of :func:`time_point` at the cell's ``(n, d)``; the uploads come from ``seed``."""
    row = time_point(cell.method, cell.at["n"], cell.at["d"], seed, repeats=1)
    return {"final": {k: row[k] for k in FINAL_KEYS if k in row}, "converged": row.get("converged")}


def skip(cell: Cell) -> str | None:
    """``pdca-masked`` above :data:`MASKED_MAX_D` is not run (three ``n²d`` products per MM step)."""
    return "not run (d > 1e5)" if cell.method == "pdca-masked" and cell.at["d"] > MASKED_MAX_D else None


def declare(seed: int, repeats: int, points: list[tuple[int, int]] | None = None) -> Bench:
    """The benchmark on the harness, measurement mode: every cell timed in this run."""
    grid = points if points is not None else list(EXTRA) + [(n, d) for d in DS for n in NS]
    return Bench(name=NAME, title="JGESR aggregation cost vs FedAvg (seconds per round)", methods=METHODS,
                 points=[{"n": n, "d": d} for n, d in grid], seeds=list(range(repeats)), metrics=METRICS,
                 run_cell=partial(measure, seed), skip=skip, pairs=[("pdca", "two-step")],
                 cost=_cost, cache="none")


def _cost(cell: Cell) -> float:
    """A cell's weight for the time estimate: ``n·d``, a twentieth of it for FedAvg's mean."""
    return float(cell.at["n"] * cell.at["d"]) * (0.05 if cell.method == "fedavg" else 1.0)


def targets(outcome: Outcome) -> list[dict[str, Any]]:
    """The targets of :data:`TARGETS` in this run's grid against the median cold seconds over the repeats."""
    out = []
    for (n, d), target in TARGETS.items():
        for method in ("pdca", "two-step"):
            runs = outcome.runs.get(((("n", n), ("d", d)), method))
            if runs is None:  # the point is not in this run's grid
                continue
            secs = [r["final"]["seconds"] for r in runs if r is not None]
            med = float(np.median(secs)) if secs else None
            out.append({"n": n, "d": d, "method": method, "target_seconds": target, "median_seconds": med,
                        "meets_target": None if med is None else med <= target})
    return out


def run(quick: bool = False, seed: int = 0, out: Path | None = None,
        points: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    """Time the grid (``points`` overrides it) on the harness; write ``<out>/jgesr-cost.{json,md,png}``."""
    repeats = 1 if quick else 3
    bench = declare(seed, repeats, points)
    outcome = run_bench(bench, None)
    settings = ["synthetic planted uploads (2 groups, noise 0.5), float32, the same in every repeat",
                "JGESR defaults: lam 1, alpha 1, beta 0.1, tol 1e-4, max-outer 1000, max-inner 1, "
                "max-impute 10, impute-tol 1e-4, work dtype auto (float32 above 4M entries)",
                "warm: second round, uploads perturbed by 1 %, warm-started from round 1",
                f"timing: {repeats} repeat(s) (a fresh core each), wall clock, whole aggregate_train; "
                "targets judged on the median"]
    doc = build_doc(bench, outcome, quick, {"data_seed": seed, "repeats": repeats, "settings": settings},
                    extra={"targets": targets(outcome)})
    if out is not None:
        tgt = [[t["method"], t["n"], t["d"], t["target_seconds"], format_value(t["median_seconds"], ".4g"),
                {True: "yes", False: "no", None: "–"}[t["meets_target"]]] for t in doc["targets"]]
        sections = ["## Targets (median cold seconds over the repeats)", "",
                    markdown_table(tgt, ["method", "n", "d", "target s", "median s", "met"]), "",
                    "## Settings", ""] + [f"- {x}" for x in settings]
        panels = metric_panels(doc, "seconds", "d", panel_axis="n", logx=True, ylabel="seconds / round (cold)",
                               xlabel="parameters d")
        for panel in panels:
            panel["logy"] = True
        write_report(Path(out), doc, sections=sections, panels=panels, plot_title="JGESR aggregation cost vs FedAvg")
    return doc
