"""B2's BiG-FL rows after a change to BiG-FL, beside an earlier B2 result's other rows.

Re-running every B2 method to compare one changed method costs most of the benchmark; the other
methods' code did not change, so their per-seed results in an earlier B2 JSON (same tasks, seeds,
rounds, optimiser) are the comparison. This module tunes BiG-FL on the validation split of the
earlier result's tuning generator (first seed only; never on test), runs it on the train graph of
each generator and on the smooth generator's test graph (φ learned on the train graph, frozen;
and the φ = I control), and writes per-seed paired differences against every earlier method and
the constant predictors.

Tuning grid (smaller than the quick form's, to fit a shared CPU): step × κ at λ = 0.1, α = 0.02,
then λ at the chosen step and κ, α fixed at 0.02 (the quick form chose 0.02 among {0.02, 0.05}).
The grid is written in the result.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.bench import multicenter as mc
from graphfl.bench.runcache import RunCache
from graphfl.tasks.holdout import validation_task

logger = logging.getLogger(__name__)

NAME = "multicenter-bigfl"


@dataclass(frozen=True)
class RerunForm:
    """BiG-FL's grid and what is run (the rounds and seeds come from the earlier result)."""

    lrs: tuple[float, ...] = (1.0, 3.0)
    kappas: tuple[float, ...] = (1.0, 0.3, 0.1)
    """Above the data Hessian's curvature deficit (ALGORITHMS.md §0.1 C2 c); a run whose LL was not
    strongly convex in some round is excluded from the choice (:func:`mc.bigfl_inadmissible`)."""
    lambdas: tuple[float, ...] = (0.01, 0.1, 1.0)
    alpha: float = 2e-2
    ridge: str = "proximal"
    generators: tuple[str, ...] = ("smooth", "mixture")
    testgraph: tuple[str, ...] = ("smooth",)
    workers: int = 2
    notes: tuple[str, ...] = ()
    """What happened outside the grid (cells stopped, and why), written into the result."""


def _settings(lr: float, kappa: float, lam: float, form: RerunForm) -> dict[str, Any]:
    return {"lr": lr, "bigfl.lam": lam, "bigfl.alpha": form.alpha, "bigfl.kappa": kappa,
            "bigfl.ridge": form.ridge}


def _job(args: tuple[Any, ...]) -> dict[str, Any] | None:
    """One cached BiG-FL run in a worker process (``None`` when it fails, logged)."""
    cache_dir, task, rounds, seed, settings, hook_phi = args
    mc._cache = RunCache(Path(cache_dir))
    hook = hook_key = None
    if hook_phi is not None:
        import torch

        phi = torch.as_tensor(np.asarray(hook_phi))
        hook, hook_key = mc.phi_hook(phi), mc.phi_key(phi)
    try:
        r = mc.run_any("bigfl", task, mc.NODES, rounds, seed, settings, mc.TRAIN,
                       hook=hook, hook_key=hook_key or "")
    except (RuntimeError, ValueError, ArithmeticError) as exc:
        logger.warning("bigfl %s seed %d %s failed: %s", task, seed, settings, exc)
        return None
    if "phi" in r:
        r["phi"] = np.asarray(r["phi"])
    return r


def _run_all(jobs: list[tuple[Any, ...]], workers: int) -> list[dict[str, Any] | None]:
    if workers <= 1:
        return [_job(j) for j in jobs]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_job, jobs))


def _val(r: dict[str, Any] | None) -> float | None:
    s = float("inf") if r is None else mc.val_score(r, False)
    return s if np.isfinite(s) else None


def _admissible_val(r: dict[str, Any] | None) -> float | None:
    """The validation score of a run that may be chosen: ``None`` when it failed or its LL was not
    strongly convex in some round (:func:`graphfl.bench.multicenter.bigfl_inadmissible`).
    """
    return None if r is None or mc.bigfl_inadmissible(r) is not None else _val(r)


def _excluded(r: dict[str, Any] | None) -> str | None:
    return None if r is None else mc.bigfl_inadmissible(r)


def _curvature(r: dict[str, Any] | None) -> float | None:
    if r is None:
        return None
    vals = [v for row in r["curve"] if (v := mc._server_metric(row, "ll_min_curvature")) is not None]
    return min(vals) if vals else None


def tune(prev: dict[str, Any], form: RerunForm, cache: Path) -> dict[str, Any]:
    """Step × κ, then λ, on validation (the earlier result's first tuning generator, first seed)."""
    gen = prev["config"]["tune_generators"][0]
    task = validation_task(mc.GENERATORS[gen])
    rounds, seed = int(prev["config"]["rounds"]), int(prev["config"]["tuning_seed"])
    lam0 = mc.BIGFL_DEFAULT["bigfl.lam"]
    cells = [(lr, k) for lr in form.lrs for k in form.kappas]
    runs = _run_all([(str(cache), task, rounds, seed, _settings(lr, k, lam0, form), None) for lr, k in cells],
                    form.workers)
    step_kappa = {f"lr={lr:g}, kappa={k:g}": {"val_mse": _val(r), "min_ll_curvature": _curvature(r),
                                              "phi_minus_identity": None if r is None else
                                              mc._server_metric(r["curve"][-1], "phi_minus_identity"),
                                              "excluded": _excluded(r),
                                              "implicit_unconverged_rounds": None if r is None else
                                              len(mc.implicit_unconverged_rounds(r))}
                  for (lr, k), r in zip(cells, runs)}
    for key, row in step_kappa.items():
        if row["excluded"]:
            logger.warning("bigfl tuning %s on %s: %s", key, task, row["excluded"])
    scored = [(s, lr, k) for (lr, k), r in zip(cells, runs) if (s := _admissible_val(r)) is not None]
    if not scored:
        raise RuntimeError(f"bigfl: every step/kappa in {cells} failed or had a lower level that was not strongly "
                           f"convex on {task}; extend the kappa grid upwards")
    _, lr, kappa = min(scored)
    mc.check_bigfl_grid(form.lambdas)
    lams = [lam for lam in form.lambdas if lam != lam0]
    lam_runs = _run_all([(str(cache), task, rounds, seed, _settings(lr, kappa, lam, form), None) for lam in lams],
                        form.workers)
    by_lam = {lam0: runs[cells.index((lr, kappa))], **dict(zip(lams, lam_runs))}
    lam_grid = {f"lam={lam:g}": {"val_mse": _val(r), "phi_minus_identity": None if r is None else
                                 mc._server_metric(r["curve"][-1], "phi_minus_identity"), "excluded": _excluded(r)}
                for lam, r in sorted(by_lam.items())}
    best_lam = min(((s, lam) for lam, r in by_lam.items() if (s := _admissible_val(r)) is not None),
                   default=(None, lam0))[1]
    return {"task": task, "seed": seed, "rounds": rounds, "step_kappa_grid": step_kappa, "lambda_grid": lam_grid,
            "settings": _settings(lr, kappa, best_lam, form),
            "note": "step x kappa at lambda = 0.1, alpha = 0.02; then lambda at the chosen step and kappa; "
                    "alpha fixed at 0.02; lambda = 0 (BiG-FL disabled) is not in the grid; min_ll_curvature = "
                    "the smallest ll_min_curvature of the run (<= 0: the LL was not strongly convex there, and "
                    "the run is excluded from the choice, ALGORITHMS.md §0.1 C2 c)"}


def _prev_method(prev_res: dict[str, Any], name: str) -> dict[str, Any]:
    return {"final": prev_res["methods"][name]["final"]}


def compare(prev_res: dict[str, Any], new: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Per-seed ``new BiG-FL − method`` for each earlier method, the earlier BiG-FL and the constants."""
    out = {f"bigfl_minus_{m.replace(' ', '_')}": mc._paired(new, _prev_method(prev_res, m)) for m in names}
    for c, v in prev_res.get("constant_predictors", {}).items():
        out[f"bigfl_minus_constant_{c}"] = mc._paired(new, {"final": {"per_seed": v["per_seed"]}})
    return out


def rerun(previous: Path, out: Path, form: RerunForm | None = None, cache: Path | None = None) -> dict[str, Any]:
    """Tune and run BiG-FL as in the earlier B2 result ``previous`` and write ``<out>/multicenter-bigfl.*``."""
    from graphfl.common.envinfo import env_info
    from graphfl.common.results import atomic_write_text, write_json

    form = form or RerunForm()
    t0 = time.perf_counter()
    prev = json.loads(Path(previous).read_text())
    out.mkdir(parents=True, exist_ok=True)
    cache = cache or out / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    seeds, rounds = [int(s) for s in prev["config"]["seeds"]], int(prev["config"]["rounds"])
    tuning = tune(prev, form, cache)
    st = tuning["settings"]
    results: dict[str, Any] = {}
    phis: dict[tuple[str, int], Any] = {}
    for gen in form.generators:
        task = mc.GENERATORS[gen]
        runs = _run_all([(str(cache), task, rounds, s, st, None) for s in seeds], form.workers)
        if any(r is None for r in runs):
            raise RuntimeError(f"bigfl failed on {task} for seed(s) {[s for s, r in zip(seeds, runs) if r is None]}")
        ok = [r for r in runs if r is not None]
        for s, r in zip(seeds, ok):
            phis[(gen, s)] = r.pop("phi")
        new = {**mc._combine(ok, "test_loss"), "settings": st}
        prev_res = prev["results"][gen]
        names = [m for m in prev_res["methods"]]
        results[gen] = {"task": task, "graph": "train", "bigfl": new,
                        "bigfl_phi": mc.bigfl_phi_report(ok, seeds, f"{gen} generator, train graph"),
                        "min_ll_curvature_per_seed": [_curvature(r) for r in ok],
                        "earlier": {m: prev_res["methods"][m]["final"] for m in names},
                        "constant_predictors": prev_res.get("constant_predictors", {}),
                        "at_constant_level": mc.at_constant_level({"bigfl": new}, prev_res["constant_predictors"],
                                                                  f"{gen} generator, train graph"),
                        "paired": compare(prev_res, new, names)}
    testgraph: dict[str, Any] = {}
    for gen in form.testgraph:
        if gen not in form.generators:
            continue
        task = mc.GENERATORS[gen] + mc.TESTGRAPH_SUFFIX
        frozen = {**st, "bigfl.alpha": 0.0, "bigfl.hypergrad-mode": "first_order"}
        jobs = [(str(cache), task, rounds, s, frozen, phis[(gen, s)]) for s in seeds]
        jobs += [(str(cache), task, rounds, s, frozen, None) for s in seeds]
        runs = _run_all(jobs, form.workers)
        if any(r is None for r in runs):
            raise RuntimeError(f"bigfl failed on {task}")
        ok = [r for r in runs if r is not None]
        for r in ok:
            r.pop("phi", None)
        learned = {**mc._combine(ok[:len(seeds)], "test_loss"), "settings": frozen,
                   "protocol": "phi learned on the train graph (same seed), frozen"}
        ident = {**mc._combine(ok[len(seeds):], "test_loss"), "settings": frozen, "protocol": "control: phi = I frozen"}
        prev_res = prev["testgraph"][gen]
        names = [m for m in prev_res["methods"] if not m.startswith("bigfl")]
        paired = compare(prev_res, learned, names)
        paired["bigfl_learned_minus_identity"] = mc._paired(learned, ident)
        testgraph[gen] = {"task": task, "graph": "test", "bigfl": learned, "bigfl (phi = I)": ident,
                          "earlier": {m: prev_res["methods"][m]["final"] for m in prev_res["methods"]},
                          "constant_predictors": prev_res.get("constant_predictors", {}),
                          "at_constant_level": mc.at_constant_level({"bigfl": learned, "bigfl (phi = I)": ident},
                                                                    prev_res["constant_predictors"],
                                                                    f"{gen} generator, test graph"),
                          "paired": paired}
    doc: dict[str, Any] = {
        "name": NAME, "previous": str(previous),
        "config": {"seeds": seeds, "rounds": rounds, "nodes": mc.NODES, "train": mc.TRAIN, "form": asdict(form),
                   "earlier_config": prev["config"]},
        "tuning": tuning, "results": results, "testgraph": testgraph,
        "env": env_info(), "wall_seconds": time.perf_counter() - t0,
    }
    write_json(out / f"{NAME}.json", doc)
    atomic_write_text(out / f"{NAME}.md", render_markdown(doc))
    return doc


def _row(name: str, f: dict[str, Any], settings: str = "") -> str:
    per = ", ".join("–" if v is None else f"{v:.4f}" for v in f["per_seed"])
    return f"| {name} | {settings} | {mc._pm(f.get('test_loss'), f.get('test_loss_sd'))} | {per} |"


def render_markdown(doc: dict[str, Any]) -> str:
    cfg, t = doc["config"], doc["tuning"]
    lines = [f"# B2 BiG-FL rows re-run ({NAME})", "",
             f"BiG-FL re-run with seeds {cfg['seeds']}, {cfg['rounds']} rounds, {cfg['nodes']} clients, B2's optimiser; "
             f"the other rows are the earlier result `{doc['previous']}` (same tasks, seeds, rounds; their code did not "
             "change). Local test MSE, lower is better; paired differences per seed, negative = BiG-FL better.", "",
             f"## Tuning on validation ({t['task']}, seed {t['seed']})", "",
             "| step, κ (λ = 0.1, α = 0.02) | val MSE | min ll_min_curvature | ‖φ − I‖_F | excluded |",
             "|---|---|---|---|---|"]
    for k, v in t["step_kappa_grid"].items():
        lines.append(f"| {k} | {mc._pm(v['val_mse'], None)} | {mc._pm(v['min_ll_curvature'], None, '{:.3g}')} | "
                     f"{mc._pm(v['phi_minus_identity'], None, '{:.3f}')} |"
                     + (f" {v['excluded']} |" if v.get("excluded") else " |"))
    lines += ["", "| λ (chosen step, κ) | val MSE | ‖φ − I‖_F |", "|---|---|---|"]
    for k, v in t["lambda_grid"].items():
        lines.append(f"| {k.split('=')[1]} | {mc._pm(v['val_mse'], None)} | {mc._pm(v['phi_minus_identity'], None, '{:.3f}')} |"
                     + (f" {v['excluded']}" if v.get("excluded") else ""))
    lines += ["", f"Chosen: {mc._settings_str(t['settings'])}. {t['note']}.", ""]
    for where, block in (("train graph", doc["results"]), ("test graph", doc["testgraph"])):
        for gen, res in block.items():
            lines += [f"## {gen} generator ({res['task']}), {where}", "",
                      "| method | settings | final test MSE | per seed |", "|---|---|---|---|"]
            lines.append(_row("**bigfl (this run)**", res["bigfl"]["final"], mc._settings_str(res["bigfl"]["settings"])))
            if "bigfl (phi = I)" in res:
                lines.append(_row("bigfl (phi = I) (this run)", res["bigfl (phi = I)"]["final"]))
            for m, f in res["earlier"].items():
                lines.append(_row(f"{m} (earlier)", f))
            for c, v in res["constant_predictors"].items():
                lines.append(_row(f"constant predictor: {c}", {"test_loss": v["test_loss"],
                                                                "test_loss_sd": v["test_loss_sd"],
                                                                "per_seed": v["per_seed"]}))
            lines += [""]
            if res.get("at_constant_level"):
                lines += [f"**At the constant-predictor level** (≥ {mc.CONSTANT_LEVEL:g} × the best constant): "
                          f"{', '.join(res['at_constant_level'])}.", ""]
            lines += ["Paired per seed: " + "; ".join(f"{k} {mc._fmt_d(v)}" for k, v in res["paired"].items()), ""]
            if "bigfl_phi" in res:
                curv = ", ".join("–" if v is None else f"{v:.3g}" for v in res["min_ll_curvature_per_seed"])
                lines += [f"Smallest ll_min_curvature per seed: {curv}.", ""]
                lines += mc._phi_lines(res["bigfl_phi"], res["bigfl"]["curve"])
    notes = doc["config"]["form"].get("notes") or []
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    lines += [f"Wall time {doc['wall_seconds']:.0f} s. Environment: {doc['env']}", ""]
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    import argparse

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ap = argparse.ArgumentParser(description=(__doc__ or NAME).splitlines()[0])
    ap.add_argument("--previous", type=Path, default=Path("docs/results/multicenter-quick/multicenter.json"))
    ap.add_argument("--out", type=Path, default=Path("docs/results/multicenter-quick-bigfl-fix"))
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--generators", default="smooth,mixture", help="comma-separated, in the order run")
    ap.add_argument("--lrs", default="1,3", help="step grid, comma-separated")
    ap.add_argument("--lambdas", default="0.01,0.1,1", help="lambda grid, comma-separated (all > 0)")
    ap.add_argument("--kappas", default="1,0.3,0.1", help="kappa grid, comma-separated")
    ap.add_argument("--note", action="append", default=[], help="a line for the result's notes")
    args = ap.parse_args()
    gens = tuple(g for g in args.generators.split(",") if g)
    form = RerunForm(workers=args.workers, generators=gens, lrs=tuple(float(x) for x in args.lrs.split(",")),
                     lambdas=tuple(float(x) for x in args.lambdas.split(",")),
                     kappas=tuple(float(x) for x in args.kappas.split(",")), notes=tuple(args.note))
    rerun(args.previous, args.out, form, args.cache)
