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
d = 1e6`` on the 2-core development host. ``--quick`` runs one repeat per point, the full form
the median of 3. Writes ``jgesr-cost.{json,md,png}``.

Not on the benchmark harness (:mod:`graphfl.bench.harness`): the values are timings of one
aggregation (median of repeats), which belong to the machine's state during this run; caching
them across runs would mix loads, and there are no seeds, tuning or paired differences.
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

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
    from graphfl.common.config import RunConfig
    from graphfl.common.core import ServerContext

    template = {"w": np.zeros(d, dtype=np.float32)}
    ctx = ServerContext(config=RunConfig(strategy=strategy, params=params), params=params, num_clients=n,
                        initial_arrays=template, param_keys=("w",), num_examples={i: 100 for i in range(n)})
    if strategy == "fedavg":
        from graphfl.strategies.fedavg import FedAvgCore

        return FedAvgCore(ctx)
    from graphfl.strategies.jgesr import JGESRCore

    return JGESRCore(ctx)


def _updates(y: np.ndarray, missing: float, seed: int) -> dict[int, Any]:
    from graphfl.common.types import ClientUpdate

    out = {}
    rng = np.random.default_rng([seed, 77])
    for i in range(y.shape[0]):
        mask: dict[str, np.ndarray] | None = {"w": np.asarray(rng.random(y.shape[1]) >= missing)} if missing else None
        out[i] = ClientUpdate(i, {"w": y[i]}, 100, mask=mask)
    return out


def time_point(method: str, n: int, d: int, seed: int, repeats: int) -> dict[str, Any]:
    """Median seconds of a cold (and for JGESR a warm) aggregation at ``(n, d)``."""
    from graphfl.strategies.fedavg import FedAvgParams
    from graphfl.strategies.jgesr import JGESRConfig

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


def run(quick: bool = False, seed: int = 0, out: Path | None = None) -> dict[str, Any]:
    """Time the grid; write ``<out>/jgesr-cost.{json,md,png}``."""
    from graphfl.common.envinfo import env_info
    from graphfl.common.results import atomic_write_text, markdown_table, plot_panels, write_json

    repeats = 1 if quick else 3
    points = list(EXTRA) + [(n, d) for d in DS for n in NS]
    rows: list[dict[str, Any]] = []
    for n, d in points:
        for method in METHODS:
            if method == "pdca-masked" and d > MASKED_MAX_D:
                rows.append({"method": method, "n": n, "d": d, "seconds": None, "note": "not run (d > 1e5)"})
                continue
            rows.append(time_point(method, n, d, seed, repeats))
    doc: dict[str, Any] = {"name": NAME, "quick": quick, "seed": seed, "rows": rows, "env": env_info(),
           "settings": ["synthetic planted uploads (2 groups, noise 0.5), float32",
                        "JGESR defaults: lam 1, alpha 1, beta 0.1, tol 1e-4, max-outer 1000, max-inner 1, "
                        "max-impute 10, impute-tol 1e-4, work dtype auto (float32 above 4M entries)",
                        "warm: second round, uploads perturbed by 1 %, warm-started from round 1",
                        f"timing: median of {repeats} repeat(s), wall clock, whole aggregate_train"]}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / f"{NAME}.json", doc)
        cols = ["method", "n", "d", "seconds", "seconds_warm", "iterations_cold", "iterations_warm",
                "impute_steps", "meets_target", "note"]
        md = [f"# {NAME}", "", "Seconds per aggregation round (see bench/jgesr_cost.py).", "",
              markdown_table(rows, cols), "", "## Settings", ""] + [f"- {s}" for s in doc["settings"]]
        atomic_write_text(out / f"{NAME}.md", "\n".join(md) + "\n")
        panels = []
        for n in NS:
            series = {m: [r for r in rows if r["method"] == m and r["n"] == n and r["d"] in DS] for m in METHODS}
            panels.append({"x": "d", "y": "seconds", "series": series, "logx": True, "logy": True,
                           "title": f"n = {n}", "xlabel": "parameters d", "ylabel": "seconds / round"})
        plot_panels(out / f"{NAME}.png", panels, "JGESR aggregation cost vs FedAvg")
    return doc
