"""Seconds per round and set-up time of the engines, in one run: batched, in-process, Flower's
simulation, and FedJAX as an outside comparator.

Each row runs FedAvg (``train.local-steps = 10``, the other settings the defaults) for ``R`` rounds
of one task at one client count on one engine, in this process for the in-process engines
(:func:`graphfl.server.inprocess.run_federated_inprocess`) and through ``graphfl run --engine
simulation`` (Flower's Ray simulation engine, :func:`graphfl.deploy.run.run_experiment`) for the
simulation engine. The ``fedjax`` rows run FedJAX's FedAvg (``bench/fedjax_fedavg.py``) on the
same task shape (per client 100 samples of 8 features and 8 targets, the 8→16→16→8 sigmoid MLP
without biases, MSE, every client every round, the local steps, batch size and step size of the
graphfl rows) in a subprocess with the Python named by ``GRAPHFL_FEDJAX_PYTHON`` (a virtual
environment with FedJAX 0.0.17 and its JAX stack, ``scripts/install-fedjax.sh``); without it the
row says ``not installed``. Reported per row:

* ``round_s``: the median over rounds ``1..R`` of the round's wall time (train phase with its
  piggy-backed evaluation, validation, aggregation, recording);
* ``setup_s``: wall time from the call until round 1 starts (task, data and client runtimes, the
  join round's evaluation; for the simulation engine also the SuperLink and Ray start);
* ``test_loss``: the final mean test loss, and ``rel_diff_vs_inprocess``: its relative difference
  from the in-process engine's (the batched engine must give the same numbers);
* ``chunk``: clients per batched computation (the batched engine's memory bound).

Ratios (``speedup_vs_inprocess``, ``speedup_vs_simulation``, ``speedup_vs_fedjax``: the other
engine's ``round_s`` over the batched engine's) come from rows of the same repeat of the same run.
Before the timed rows, a two-client run on each engine loads the libraries, so no row pays for
imports.

On the benchmark harness (:mod:`graphfl.bench.harness`) in its measurement mode
(``cache="none"``): points = ``(task, clients)``, methods = the engines, seeds = repeats (one by
default, ``run(repeats=...)``), one joint cell per point and repeat (:func:`point_cell`: every
engine planned at the point, one after the other, so the ratios pair rows measured together);
metrics = ``round_s``, ``setup_s``, ``test_loss``, the per-client times, ``chunk`` and the batched
engine's ratios and loss difference; paired per-repeat differences of the batched engine against
each other engine (:data:`PAIRS`). An engine the grid has no row for at a point (in-process at
10 000 clients, simulation above 100) is absent there (:func:`declare`'s ``methods_at``), not
failed; ``fedjax`` without ``$GRAPHFL_FEDJAX_PYTHON`` is a skipped cell with the reason. No
timing is cached across runs: a round time beside another measured under a different load would
not be a ratio of engines. What this module adds: the rows (``rows``, one per engine and repeat,
the layout the dashboard read before the harness), the warm-up, the growth analysis (on the means
over repeats), the profile and the plot panels; after each cell it writes the rows measured so
far, so a stopped run keeps them.

Grid. ``--quick``: synthetic-multicenter (the seed's 512-parameter MLP, 100 samples per client)
at 100 and 1000 clients and digits at 100 clients, 3 rounds; FedJAX at 100 and 1000 clients of
synthetic-multicenter, 4 rounds (its first compiles); the simulation engine at 100
clients of synthetic-multicenter, 2 rounds (its join round alone takes minutes on a loaded
2-core host). Full form: synthetic-multicenter at 10, 100, 1000 and 10 000 clients (the
in-process engine up to 1000), digits at 100, the MNIST CNN at 100 clients (``--data-dir`` with
``mnist/``; 2 rounds), FedJAX at 100 and 1000 clients, the simulation engine at 100 clients of
both tabular tasks. The simulation engine is not run at 1000 clients: its join round alone takes
minutes at 100 clients on a loaded 2-core host and grows with the client count, past the time
a bench run on such a host can take. Writes ``engine.{json,md,png}``: the harness layout
(:mod:`graphfl.bench.report`) with the module's own sections (:func:`own_sections`).

Growth. Each row also gets ``round_s_per_client`` and ``setup_s_per_client``; between consecutive
client counts of one task and engine (the means over repeats, :func:`mean_rows`), the growth
exponent ``log(t2/t1) / log(n2/n1)`` of each time
(:func:`scaling`, linear inside :data:`LINEAR_BAND`) and one sentence per engine saying where the
growth stops being linear (:func:`scaling_sentences`), computed from the rows.

Profile. The full form also profiles round 2 of a separate batched run of the MNIST CNN row
(:func:`profile_round`: ``torch.profiler`` with the parts that
:data:`graphfl.client.batched.PROFILE_LABELS` marks — minibatch gather, forward, backward,
optimizer, unstacking, evaluation — and the rest of the round), written into the result.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from .harness import Bench, Cell, Metric, Outcome, run_bench

logger = logging.getLogger(__name__)

NAME = "engine"
ENGINES = ("batched", "inprocess", "simulation", "fedjax")
FEDJAX_ENV = "GRAPHFL_FEDJAX_PYTHON"
"""Environment variable naming a Python with FedJAX installed (the ``fedjax`` rows)."""
FEDJAX_ROUNDS = 4
FEDJAX_TIMEOUT_S = 900
LOCAL_STEPS = 10
DIGITS_MIN_PARTITION = 4
"""``data.min-partition-size`` of the digits rows (the default 10 has no Dirichlet(0.5) draw at 100 clients)."""


def grid(quick: bool, data_dir: str | None) -> list[dict[str, Any]]:
    """The rows to run: ``task``, ``clients``, ``engine``, ``rounds`` (module docstring)."""
    rows: list[dict[str, Any]] = []
    if quick:
        for n in (100, 1000):
            rows += [{"task": "synthetic-multicenter", "clients": n, "engine": e, "rounds": 3}
                     for e in ("batched", "inprocess")]
        rows += [{"task": "digits", "clients": 100, "engine": e, "rounds": 3} for e in ("batched", "inprocess")]
        rows += [{"task": "synthetic-multicenter", "clients": n, "engine": "fedjax", "rounds": FEDJAX_ROUNDS}
                 for n in (100, 1000)]
        rows.append({"task": "synthetic-multicenter", "clients": 100, "engine": "simulation", "rounds": 2})
        return rows
    for n in (10, 100, 1000, 10_000):
        engines = ("batched", "inprocess") if n <= 1000 else ("batched",)
        rows += [{"task": "synthetic-multicenter", "clients": n, "engine": e, "rounds": 3} for e in engines]
    rows += [{"task": "digits", "clients": 100, "engine": e, "rounds": 3} for e in ("batched", "inprocess")]
    if data_dir and (Path(data_dir) / "mnist").is_dir():
        rows += [{"task": "mnist", "clients": 100, "engine": e, "rounds": 2, "data-dir": data_dir}
                 for e in ("batched", "inprocess")]
    rows += [{"task": "synthetic-multicenter", "clients": n, "engine": "fedjax", "rounds": FEDJAX_ROUNDS}
             for n in (100, 1000)]
    rows += [{"task": t, "clients": 100, "engine": "simulation", "rounds": 3}
             for t in ("synthetic-multicenter", "digits")]
    return rows


def profile_row(plan: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row whose batched round is profiled: the MNIST CNN's (compute-bound), when planned."""
    return next((r for r in plan if r["task"] == "mnist" and r["engine"] == "batched"), None)


def _config(row: dict[str, Any], seed: int, out_dir: str = "") -> Any:
    from graphfl.common.config import parse_run_config

    flat = {"strategy": "fedavg", "task": row["task"], "nodes": row["clients"], "rounds": row["rounds"],
            "engine": row["engine"], "seed": seed, "train.local-steps": LOCAL_STEPS, "min-replies": 0}
    if row["task"] == "digits":   # 1797 samples: 100 clients get 18 each on average, some fewer than 10
        flat["data.min-partition-size"] = DIGITS_MIN_PARTITION
    if row.get("data-dir"):
        flat["data-dir"] = row["data-dir"]
    if out_dir:
        flat["out-dir"] = out_dir
    return parse_run_config(flat)


def _summary(doc: dict[str, Any], wall: float) -> dict[str, Any]:
    """``round_s``, ``setup_s``, ``test_loss`` of a run's result document (module docstring)."""
    method = next(iter(doc["methods"].values()))
    curve = method["curve"]
    rounds = [r["seconds"] for r in curve if r["round"] >= 1 and r.get("seconds") is not None]
    return {"round_s": statistics.median(rounds) if rounds else None,
            "setup_s": wall - sum(rounds), "test_loss": (method.get("final") or {}).get("test_loss"),
            "status": doc.get("status"), "rounds_run": len(rounds),
            "chunk": doc.get("env", {}).get("batch_chunk"), "fallback": doc.get("env", {}).get("batched_fallback")}


def run_fedjax(row: dict[str, Any], seed: int) -> dict[str, Any]:
    """The ``fedjax`` row: ``bench/fedjax_fedavg.py`` under ``$GRAPHFL_FEDJAX_PYTHON`` with the
    graphfl rows' local steps, batch size and step size; ``status = "not installed"`` without it.
    """
    python = os.environ.get(FEDJAX_ENV)
    if not python:
        return {"status": "not installed", "error": f"{FEDJAX_ENV} is not set (scripts/install-fedjax.sh makes one)"}
    train = _config({**row, "engine": "inprocess"}, seed).train
    script = Path(__file__).with_name("fedjax_fedavg.py")
    cmd = [python, str(script), "--clients", str(row["clients"]), "--rounds", str(row["rounds"]),
           "--steps", str(LOCAL_STEPS), "--batch", str(train.batch_size), "--lr", str(train.lr), "--seed", str(seed)]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=FEDJAX_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"status": "failed", "error": f"exit {done.returncode}: {tail[0][:300]}"}
    result = json.loads(lines[-1])
    logger.info("engine bench: fedjax %d clients: %.3f s/round, set-up %.1f s (wall %.1f s)", row["clients"],
                result["round_s"], result["setup_s"], time.perf_counter() - t0)
    return {"round_s": result["round_s"], "setup_s": result["setup_s"], "status": "completed",
            "rounds_run": result["rounds"], "fedjax": result.get("fedjax"), "jax": result.get("jax"),
            "batch": result.get("batch")}


def run_row(row: dict[str, Any], seed: int, work: Path) -> dict[str, Any]:
    """Run one row; its measurements (or ``error`` naming why it did not run)."""
    out = dict(row)
    out.pop("data-dir", None)
    if row["engine"] == "fedjax":
        out.update(run_fedjax(row, seed))
        return out
    t0 = time.perf_counter()
    try:
        if row["engine"] == "simulation":
            from graphfl.deploy.run import run_experiment

            folder = work / f"sim-{row['task']}-{row['clients']}"
            cfg = _config(row, seed, str(folder))
            run_experiment(cfg)
            doc = json.loads((folder / "run.json").read_text())
        else:
            from graphfl.server.inprocess import run_federated_inprocess

            doc, _ = run_federated_inprocess(_config(row, seed))
    except Exception as exc:  # a row that cannot run is reported with the reason (logged), the others run
        logger.exception("engine bench: %s failed", row)
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    out.update(_summary(doc, time.perf_counter() - t0))
    logger.info("engine bench: %s %d clients %s: %.3f s/round, set-up %.1f s", row["task"], row["clients"],
                row["engine"], out["round_s"] or float("nan"), out["setup_s"])
    return out


def _warm_up(engines: set[str], seed: int) -> None:
    """Load the libraries of each in-process engine (a 2-client, 1-round run) before timing."""
    from graphfl.server.inprocess import run_federated_inprocess

    for engine in sorted(engines - {"simulation", "fedjax"}):
        run_federated_inprocess(_config({"task": "synthetic-multicenter", "clients": 2, "engine": engine,
                                         "rounds": 1}, seed))


def ratios(rows: list[dict[str, Any]]) -> None:
    """Add ``round_s_per_client`` and ``setup_s_per_client`` to every row, ``speedup_vs_<engine>``
    and ``rel_diff_vs_inprocess`` to the batched rows (in place); rows pair within one repeat
    (their ``seed``).
    """
    by = {(r["task"], r["clients"], r["engine"], r.get("seed")): r for r in rows}
    for r in rows:
        for key in ("round_s", "setup_s"):
            if r.get(key) is not None and r.get("clients"):
                r[f"{key}_per_client"] = r[key] / r["clients"]
    for r in rows:
        if r["engine"] != "batched" or not r.get("round_s"):
            continue
        for other in ("inprocess", "simulation", "fedjax"):
            o = by.get((r["task"], r["clients"], other, r.get("seed")))
            if o and o.get("round_s"):
                r[f"speedup_vs_{other}"] = o["round_s"] / r["round_s"]
        o = by.get((r["task"], r["clients"], "inprocess", r.get("seed")))
        if o and o.get("test_loss") is not None and r.get("test_loss") is not None:
            r["rel_diff_vs_inprocess"] = abs(r["test_loss"] - o["test_loss"]) / max(abs(o["test_loss"]), 1e-12)


def mean_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per task, client count and engine: ``round_s``, ``setup_s`` and
    ``speedup_vs_inprocess`` averaged over the repeats that measured them (one repeat: its row).
    """
    groups: dict[tuple[Any, Any, Any], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["clients"], r["engine"]), []).append(r)
    out = []
    for (task, clients, eng), rs in groups.items():
        row: dict[str, Any] = {"task": task, "clients": clients, "engine": eng, "repeats": len(rs)}
        for key in ("round_s", "setup_s", "speedup_vs_inprocess"):
            vals = [r[key] for r in rs if r.get(key) is not None]
            if vals:
                row[key] = statistics.fmean(vals)
        out.append(row)
    return out


LINEAR_BAND = (0.8, 1.2)
"""A growth exponent ``d log t / d log n`` inside this band counts as linear in the client count."""


def scaling(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """How ``round_s`` and ``setup_s`` grow with the client count, per task and engine.

    For each pair of consecutive client counts ``n1 < n2`` of one task and engine, the growth
    exponent ``log(t2 / t1) / log(n2 / n1)`` of each time (1: linear; below: a fixed cost still
    dominates; above: worse than linear).
    """
    out: list[dict[str, Any]] = []
    series: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("round_s") and r.get("clients"):
            series.setdefault((r["task"], r["engine"]), []).append(r)
    for (task, engine), pts in series.items():
        pts = sorted(pts, key=lambda r: r["clients"])
        for a, b in zip(pts, pts[1:]):
            if b["clients"] == a["clients"]:
                continue
            span = math.log(b["clients"] / a["clients"])
            item: dict[str, Any] = {"task": task, "engine": engine, "from": a["clients"], "to": b["clients"]}
            for key in ("round_s", "setup_s"):
                if a.get(key) and b.get(key) and a[key] > 0 and b[key] > 0:
                    item[f"{key}_exponent"] = math.log(b[key] / a[key]) / span
            out.append(item)
    return out


def _growth(exponent: float | None) -> str:
    if exponent is None:
        return "not measured"
    lo, hi = LINEAR_BAND
    kind = "sub-linear" if exponent < lo else ("super-linear" if exponent > hi else "linear")
    return f"{kind} (exponent {exponent:.2f})"


def scaling_sentences(steps: list[dict[str, Any]]) -> list[str]:
    """One sentence per task and engine with more than one client count, from :func:`scaling`:
    the growth of each interval and the first client count from which it stops being linear.
    """
    lines = []
    lo, hi = LINEAR_BAND
    for task, engine in dict.fromkeys((s["task"], s["engine"]) for s in steps):
        mine = [s for s in steps if s["task"] == task and s["engine"] == engine]
        parts = []
        for key, label in (("round_s", "round time"), ("setup_s", "set-up")):
            intervals = ", ".join(f"{s['from']}→{s['to']}: {_growth(s.get(f'{key}_exponent'))}" for s in mine)
            off = [s for s in mine if s.get(f"{key}_exponent") is not None
                   and not lo <= s[f"{key}_exponent"] <= hi]
            where = ("linear throughout" if not off else
                     f"not linear from {off[0]['from']} to {off[0]['to']} clients" if len(off) == 1 else
                     "not linear in " + ", ".join(f"{s['from']}→{s['to']}" for s in off))
            parts.append(f"{label} {intervals} ({where})")
        lines.append(f"{task}, {engine}: " + "; ".join(parts) + ".")
    return lines


PROFILE_ROUNDS = 2
"""Rounds of the profiled run: round 2 is profiled (a round whose request also evaluates the
previous round's model, as every round after the first does)."""


def profile_round(row: dict[str, Any], seed: int) -> dict[str, Any]:
    """Where one round of the batched engine spends its time: ``torch.profiler`` over round
    :data:`PROFILE_ROUNDS` of ``row`` (not the join round nor round 1, which evaluates nothing) with the parts that
    :data:`graphfl.client.batched.PROFILE_LABELS` marks (each part's wall seconds summed over the
    round's chunks and steps) and ``other``: the round's wall time outside them (server-side
    aggregation, encoding and recording, the clients' objectives and replies).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    from graphfl.client.batched import PROFILE_LABELS
    from graphfl.server.inprocess import run_federated_inprocess

    prof = profile(activities=[ProfilerActivity.CPU])
    marks: dict[str, float] = {}

    def progress(event: dict[str, Any]) -> None:
        if event.get("event") != "round":
            return
        if event.get("round") == PROFILE_ROUNDS - 1:
            marks["start"] = time.perf_counter()
            prof.start()
        elif event.get("round") == PROFILE_ROUNDS and "start" in marks:
            prof.stop()
            marks["stop"] = time.perf_counter()

    cfg_row = {**row, "engine": "batched", "rounds": PROFILE_ROUNDS}
    out: dict[str, Any] = {"task": row["task"], "clients": row["clients"], "engine": "batched", "round": PROFILE_ROUNDS,
                           "threads": torch.get_num_threads()}
    try:
        doc, _ = run_federated_inprocess(_config(cfg_row, seed), progress=progress)
    except Exception as exc:  # a profile that cannot run is reported with the reason (logged)
        logger.exception("engine bench: profile of %s failed", row)
        return {**out, "error": f"{type(exc).__name__}: {exc}"}
    if "stop" not in marks:
        return {**out, "error": f"round {PROFILE_ROUNDS} did not complete"}
    wall = marks["stop"] - marks["start"]
    names = {label: part for part, label in PROFILE_LABELS.items()}
    parts = {part: 0.0 for part in PROFILE_LABELS}
    calls = {part: 0 for part in PROFILE_LABELS}
    for event in prof.key_averages():
        if event.key in names:
            parts[names[event.key]] += event.cpu_time_total / 1e6
            calls[names[event.key]] += event.count
    parts = {k: v for k, v in parts.items() if calls[k]}
    parts["other"] = max(wall - sum(parts.values()), 0.0)
    out.update({"round_s": wall, "seconds": parts, "share": {k: v / wall for k, v in parts.items()},
                "calls": {k: calls[k] for k in parts if k != "other"},
                "chunk": doc.get("env", {}).get("batch_chunk")})
    logger.info("engine bench: profile of %s %d clients: %s", row["task"], row["clients"],
                ", ".join(f"{k} {v:.2f} s" for k, v in parts.items()))
    return out


def profile_sentence(profile: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Where the profiled round's time goes, and its batched row's speed-up over the in-process engine."""
    if profile.get("error") or not profile.get("seconds"):
        return f"profile of {profile.get('task')}: {profile.get('error', 'not run')}"
    ranked = sorted(profile["seconds"].items(), key=lambda kv: -kv[1])
    share = ", ".join(f"{k} {v:.2f} s ({100 * profile['share'][k]:.0f}%)" for k, v in ranked)
    text = (f"One batched round of {profile['task']} at {profile['clients']} clients (chunk {profile['chunk']}, "
            f"{profile['threads']} torch thread(s), under the profiler) took {profile['round_s']:.2f} s: {share}.")
    row = next((r for r in rows if r["task"] == profile["task"] and r["clients"] == profile["clients"]
                and r["engine"] == "batched"), None)
    if row and row.get("speedup_vs_inprocess"):
        text += f" Its bench row is {row['speedup_vs_inprocess']:.2f}x the in-process engine's round time."
    return text


INTRO = ("Seconds per round and set-up time of the engines (bench/engine.py), every row measured in this run: "
         "points = (task, clients), methods = engines, repeats = seeds.")

METRICS = (Metric("round_s", "s / round", fmt=".4g"), Metric("setup_s", "set-up s", fmt=".4g"),
           Metric("test_loss", "test loss"),
           Metric("rel_diff_vs_inprocess", "|Δ loss| / in-process", fmt=".2e", paired=False),
           Metric("speedup_vs_inprocess", "x in-process", fmt=".3g", lower_is_better=False, paired=False),
           Metric("speedup_vs_simulation", "x simulation", fmt=".3g", lower_is_better=False, paired=False),
           Metric("speedup_vs_fedjax", "x FedJAX", fmt=".3g", lower_is_better=False, paired=False),
           Metric("round_s_per_client", "s / round / client", fmt=".3e"),
           Metric("setup_s_per_client", "set-up s / client", fmt=".3e"),
           Metric("chunk", "chunk", fmt=".0f", paired=False))
"""What a cell reports per engine; the speed-ups and the loss difference are the batched engine's,
against the engine named, within one repeat."""
PAIRS = (("batched", "inprocess"), ("batched", "simulation"), ("batched", "fedjax"))
FINAL_KEYS = tuple(m.name for m in METRICS)
COST = {"batched": 0.1, "inprocess": 1.0, "simulation": 20.0, "fedjax": 0.3}
"""Relative seconds per client of one engine's row (the time estimate's cell weights)."""


def fedjax_skip() -> str | None:
    """Why the ``fedjax`` rows are not run (``None`` when ``$GRAPHFL_FEDJAX_PYTHON`` names a Python)."""
    if os.environ.get(FEDJAX_ENV):
        return None
    return f"FedJAX not installed: {FEDJAX_ENV} is not set (scripts/install-fedjax.sh makes one)"


def engine_share(row: dict[str, Any]) -> dict[str, Any]:
    """A row's share in its cell: ``final`` metrics, ``failed`` naming why it gave no round time,
    or ``skipped`` (FedJAX not installed).
    """
    if row.get("status") == "not installed":
        return {"skipped": f"FedJAX not installed: {row.get('error')}"}
    final = {k: row.get(k) for k in FINAL_KEYS}
    why = row.get("error") or (None if row.get("round_s") else f"no timed round (status {row.get('status')})")
    return {"final": final, "failed": why}


def point_cell(plan: list[dict[str, Any]], work: Path, cell: Cell,
               measured: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One joint cell: every engine planned at the cell's (task, clients), one after the other with
    the cell's seed; the rows with their ratios (:func:`ratios`) and each engine's share.
    ``measured`` collects the rows (the partial result written after each cell).
    """
    at = cell.at
    rows = []
    for planned in plan:
        if planned["task"] == at["task"] and planned["clients"] == at["clients"]:
            rows.append({**run_row(planned, cell.seed, work), "seed": cell.seed})
    ratios(rows)
    if measured is not None:
        measured += rows
    return {"rows": rows, "methods": {r["engine"]: engine_share(r) for r in rows}}


def declare(plan: list[dict[str, Any]], seeds: list[int], work: Path,
            measured: list[dict[str, Any]] | None = None,
            cell: Callable[[Cell], dict[str, Any]] | None = None) -> Bench:
    """The benchmark on the harness's measurement mode: points = the plan's (task, clients), methods
    = the engines planned there (:func:`methods_at`: no in-process row at 10 000 clients, no
    simulation above 100), seeds = repeats, one joint cell per point and repeat (``cell``, default
    :func:`point_cell`); the ``fedjax`` method is skipped with the reason when FedJAX is not
    installed.
    """
    points = [dict(p) for p in dict.fromkeys((("task", r["task"]), ("clients", r["clients"])) for r in plan)]
    at: dict[tuple[str, int], list[str]] = {}
    for r in plan:
        at.setdefault((r["task"], r["clients"]), []).append(r["engine"])

    def methods_at(point: Any) -> list[str]:
        return [e for e in ENGINES if e in at.get((point["task"], point["clients"]), [])]

    def skip(c: Cell) -> str | None:
        return fedjax_skip() if c.method == "fedjax" else None

    def cost(c: Cell) -> float:
        return float(sum(COST[e] * c.at["clients"] for e in methods_at(c.at)))

    return Bench(name=NAME, title="engines: batched vs in-process vs Flower simulation vs FedJAX",
                 methods=[e for e in ENGINES if any(e in v for v in at.values())], points=points, seeds=seeds,
                 metrics=METRICS, run_cell=cell or partial(point_cell, plan, work, measured=measured), joint=True,
                 methods_at=methods_at, skip=skip, pairs=PAIRS, cost=cost, cache="none")


def assemble(bench: Bench, outcome: Outcome, quick: bool, seed: int, wall: float,
             profiled: dict[str, Any] | None = None) -> dict[str, Any]:
    """The result: the harness layout (results, paired, estimate) and the module's own parts
    (``rows``, ``scaling``, ``profile``, ``settings``: :func:`_doc`).
    """
    from .report import build_doc

    rows = [r for res in outcome.joint.values() for r in res.get("rows", [])]
    own = _doc(quick, seed, rows, {}, wall, profiled)
    skipped = sorted({str(r["skipped"]) for r in outcome.results if r.get("skipped")})
    config = {"seed": seed, "repeats": len(bench.seeds), "local_steps": LOCAL_STEPS,
              "rounds": {f"{r['task']} {r['clients']} {r['engine']}": r.get("rounds") for r in rows}}
    extra = {k: v for k, v in own.items() if k not in ("name", "quick", "seed", "env")}
    return build_doc(bench, outcome, quick, config, extra={**extra, "skipped": skipped})


def run(quick: bool = False, seed: int = 0, out: Path | None = None, data_dir: str | None = None,
        repeats: int = 1, plan: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run the grid on the harness (``repeats`` seeds from ``seed``); write ``<out>/engine.{json,md,png}``.

    ``plan`` (rows as :func:`grid` gives them) replaces the form's grid.
    """
    from graphfl.common.envinfo import env_info

    plan = grid(quick, data_dir) if plan is None else plan
    load_before = os.getloadavg()[0]
    t_all = time.perf_counter()
    _warm_up({r["engine"] for r in plan}, seed)
    measured: list[dict[str, Any]] = []
    seeds = list(range(seed, seed + repeats))
    with tempfile.TemporaryDirectory(prefix="graphfl-bench-engine-") as work:
        def cell(c: Cell) -> dict[str, Any]:
            res = point_cell(plan, Path(work), c, measured)
            if out is not None:   # partial results survive an interrupted bench
                write(out, _doc(quick, seed, measured, env_info(), time.perf_counter() - t_all), plot=False)
            return res

        bench = declare(plan, seeds, Path(work), cell=cell)
        outcome = run_bench(bench, None)
    target = profile_row(plan)
    profiled = profile_round(target, seed) if target is not None else None
    doc = assemble(bench, outcome, quick, seed, time.perf_counter() - t_all, profiled)
    doc["load_average"] = {"start": load_before, "end": os.getloadavg()[0]}   # the host is shared: how busy it was
    if out is not None:
        write(out, doc)
    return doc


def _doc(quick: bool, seed: int, rows: list[dict[str, Any]], env: dict[str, Any], wall: float,
         profiled: dict[str, Any] | None = None) -> dict[str, Any]:
    rows = [dict(r) for r in rows]
    ratios(rows)
    means = mean_rows(rows)
    steps = scaling(means)
    extra: dict[str, Any] = {"scaling": steps, "scaling_summary": scaling_sentences(steps)}
    if profiled is not None:
        extra["profile"] = profiled
        extra["profile_summary"] = profile_sentence(profiled, means)
    return {"name": NAME, "quick": quick, "seed": seed, "rows": rows, "env": env, "wall_seconds": wall, **extra,
            "settings": [f"FedAvg, train.local-steps = {LOCAL_STEPS}, the other settings the defaults, seed {seed}; "
                         f"digits: data.min-partition-size = {DIGITS_MIN_PARTITION}",
                         "round_s: median wall seconds of rounds 1..R; setup_s: wall seconds before round 1 "
                         "(data, runtimes, join evaluation; simulation: also SuperLink and Ray start)",
                         "before the timed rows, a 2-client run per in-process engine loads the libraries",
                         "fedjax: FedAvg of FedJAX (bench/fedjax_fedavg.py) on the same task shape in a subprocess "
                         f"(${FEDJAX_ENV}), the graphfl rows' local steps, batch size and step size, JAX's default "
                         "threads; round_s the median of rounds 2..R (round 1 compiles, counted in setup_s with "
                         "the imports)",
                         "speed-ups: the other engine's round_s over the batched engine's, rows of the same "
                         "repeat of this run",
                         "per client: round_s and setup_s over the client count; growth exponent between two "
                         "client counts: log(t2/t1) / log(n2/n1), linear within "
                         f"[{LINEAR_BAND[0]}, {LINEAR_BAND[1]}]",
                         f"profile: torch.profiler over round {PROFILE_ROUNDS} of a separate batched run of the profiled row "
                         "(graphfl.client.batched.PROFILE_LABELS parts, 'other' = the round's wall time outside them)"]}


def own_sections(doc: dict[str, Any]) -> list[str]:
    """The module's own Markdown: the rows (one per engine and repeat, the ratios beside), the growth
    with the client count, where the profiled round's time goes, the settings and the host.
    """
    from graphfl.common.results import markdown_table

    cols = ["task", "clients", "engine", "seed", "rounds", "round_s", "setup_s", "round_s_per_client",
            "setup_s_per_client", "speedup_vs_inprocess", "speedup_vs_simulation", "speedup_vs_fedjax",
            "test_loss", "rel_diff_vs_inprocess", "chunk", "status", "error"]
    if not any("seed" in r for r in doc["rows"]):
        cols.remove("seed")
    md = ["## Rows", "", "Seconds per round and set-up time per engine and repeat, measured in one run "
          "(bench/engine.py); the ratios pair rows of the same repeat.", "", markdown_table(doc["rows"], cols), ""]
    if doc.get("scaling"):
        md += ["## Growth with the client count", "", *[f"- {s}" for s in doc.get("scaling_summary", [])], "",
               markdown_table(doc["scaling"], ["task", "engine", "from", "to", "round_s_exponent",
                                               "setup_s_exponent"]), ""]
    if doc.get("profile"):
        prof = doc["profile"]
        md += ["## Where the time goes", "", doc.get("profile_summary", ""), ""]
        if prof.get("seconds"):
            md += [markdown_table([{"part": k, "seconds": v, "share": prof["share"][k], "calls": prof["calls"].get(k)}
                                   for k, v in prof["seconds"].items()], ["part", "seconds", "share", "calls"]), ""]
    md += ["## Settings", ""] + [f"- {s}" for s in doc["settings"]]
    load = doc.get("load_average")
    md += ["", f"Wall time of the bench: {doc['wall_seconds']:.0f} s; host: {doc['env'].get('cpus')} CPUs, "
               f"torch {doc['env'].get('torch')}, device {doc['env'].get('device', 'cpu')}"
               + (f"; 1-minute load average {load['start']:.1f} at the start, {load['end']:.1f} at the end"
                  if load else "") + "."]
    return md


def panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per task: seconds per round and set-up seconds against the client count, one series per
    engine (the means over repeats); synthetic-multicenter's per-client times.
    """
    means = mean_rows(doc["rows"])
    for r in means:
        for key in ("round_s", "setup_s"):
            if r.get(key) is not None and r.get("clients"):
                r[f"{key}_per_client"] = r[key] / r["clients"]
    out = []
    for task in dict.fromkeys(r["task"] for r in means):
        for key, label in (("round_s", "seconds / round"), ("setup_s", "set-up seconds")):
            series = {e: sorted((r for r in means if r["task"] == task and r["engine"] == e and r.get(key)),
                                key=lambda r: r["clients"]) for e in ENGINES}
            series = {e: s for e, s in series.items() if s}
            if series:
                out.append({"x": "clients", "y": key, "series": series, "logx": True, "logy": True,
                            "title": task, "xlabel": "clients", "ylabel": label})
    for key, label in (("round_s_per_client", "seconds / round / client"), ("setup_s_per_client",
                                                                          "set-up seconds / client")):
        task = "synthetic-multicenter"
        series = {e: sorted((r for r in means if r["task"] == task and r["engine"] == e and r.get(key)),
                            key=lambda r: r["clients"]) for e in ENGINES}
        series = {e: s for e, s in series.items() if len(s) > 1}
        if series:
            out.append({"x": "clients", "y": key, "series": series, "logx": True, "logy": True,
                        "title": f"{task}: per client", "xlabel": "clients", "ylabel": label})
    return out


PLOT_TITLE = "engines: batched vs in-process vs Flower simulation vs FedJAX"


def write(out: Path, doc: dict[str, Any], plot: bool = True) -> None:
    """``engine.json``, ``engine.md`` and ``engine.png``: the harness layout
    (:func:`graphfl.bench.report.write_report`) with the module's sections (:func:`own_sections`)
    when ``doc`` has the harness's ``results``; otherwise the module's rows alone (the partial
    result written after each cell).
    """
    from graphfl.common.results import atomic_write_text, plot_panels, write_json

    from .report import write_report

    out.mkdir(parents=True, exist_ok=True)
    drawn = panels(doc) if plot else []
    if "results" in doc and "config" in doc:
        write_report(out, doc, intro=[INTRO], sections=["\n".join(own_sections(doc))], panels=drawn,
                     plot_title=PLOT_TITLE)
        return
    write_json(out / f"{NAME}.json", doc)
    atomic_write_text(out / f"{NAME}.md", "\n".join([f"# {NAME}", "", *own_sections(doc)]) + "\n")
    if drawn:
        plot_panels(out / f"{NAME}.png", drawn, PLOT_TITLE)
