"""The benchmarks on the harness give the numbers their own loops gave before it, on tiny configurations.

``tests/data/harness_golden/<bench>.json`` holds the result sections written by each benchmark's
code before it moved onto :mod:`graphfl.bench.harness`, on the configuration its test below sets
(times and the environment left out). Each test runs today's benchmark on the same configuration
and compares every number: exactly where the arithmetic is fixed-order numpy in one process
(admm, fedrelax), with ``rtol = 1e-5`` where it passes through torch (dfl, jgesr, apflgate).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from graphfl.bench import admm, apflgate, dfl, fedrelax, jgesr
from graphfl.bench.report import pair, result

GOLDEN = Path(__file__).parent / "data" / "harness_golden"
SKIP = {"seconds", "wall_seconds", "_key", "pilot_seconds"}


def golden(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((GOLDEN / f"{name}.json").read_text())
    return loaded


class Compare:
    """Counts the values compared and collects every difference (path, golden, now)."""

    def __init__(self, rtol: float) -> None:
        self.rtol, self.count, self.diffs = rtol, 0, []  # type: tuple[float, int, list[str]]

    def __call__(self, want: Any, got: Any, path: str = "") -> None:
        if isinstance(want, dict):
            for k, v in want.items():
                if k in SKIP or k.endswith("seconds"):
                    continue
                if not isinstance(got, dict) or k not in got:
                    self.diffs.append(f"{path}/{k}: missing")
                    continue
                self(v, got[k], f"{path}/{k}")
        elif isinstance(want, list):
            if not isinstance(got, list) or len(want) != len(got):
                self.diffs.append(f"{path}: length {len(want)} != {None if not isinstance(got, list) else len(got)}")
                return
            for i, (a, b) in enumerate(zip(want, got)):
                self(a, b, f"{path}[{i}]")
        elif isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
            self.count += 1
            if not math.isclose(want, got, rel_tol=self.rtol, abs_tol=1e-12):
                self.diffs.append(f"{path}: {want!r} != {got!r}")
        else:
            self.count += 1
            if want != got:
                self.diffs.append(f"{path}: {want!r} != {got!r}")

    def check(self, at_least: int) -> None:
        assert not self.diffs, "\n".join(self.diffs[:20])
        assert self.count >= at_least


def close(want: float | None, got: float | None, rtol: float) -> bool:
    if want is None or got is None:
        return want is None and got is None
    return math.isclose(want, got, rel_tol=rtol, abs_tol=1e-12)


def test_dfl_gives_the_numbers_of_its_own_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = golden("dfl")
    monkeypatch.setattr(dfl, "TOPOLOGIES", {"ring5": 5})
    monkeypatch.setattr(dfl, "TAUS", (5,))
    monkeypatch.setattr(dfl, "QUICK", dfl.Form(iterations=20, seeds=2, grid=(0.05, 0.1, 15.0), eval_points=2))
    doc = dfl.run(quick=True, seed=0, out=tmp_path)
    cmp = Compare(rtol=1e-5)
    for r in old["methods"].values():
        now = result(doc, r["method"], topology=r["topology"], tau=r["tau"])
        for k, st in now["metrics"].items():
            cmp(r["final"][k], st["mean"], f"{r['method']}/{k}")
            cmp(r["final"][f"{k}_sd"], st["sd"], f"{r['method']}/{k}_sd")
        cmp(r["alpha0_used_per_seed"], [u["alpha0"] if u else None for u in now["params_per_seed"]], "alpha0 used")
        cmp(r["final"]["rounds"], now["rounds"], "rounds")
        cmp([{k: c[k] for k in ("avg_model_test_loss", "test_loss", "stationarity")} for c in r["curve"]],
            [{k: c[k] for k in ("avg_model_test_loss", "test_loss", "stationarity")} for c in now["curve"]], "curve")
    names = {"gt_minus_sgd": ("dfl-gt", "dfl-sgd"), "fedavg_minus_gt": ("fedavg", "dfl-gt"),
             "fedavg_minus_sgd": ("fedavg", "dfl-sgd")}
    for topo, per_tau in old["paired"].items():
        for tau, p in per_tau.items():
            for name, (a, b) in names.items():
                now_p = pair(doc, a, b, topology=topo, tau=int(tau))["metrics"]
                for k, d in p[name].items():
                    cmp({f: d[f] for f in ("mean", "sd", "first_better", "seeds")}, now_p[k], f"{name}/{k}")
    for topo, per_tau in old["tuning"].items():
        for tau, t in per_tau.items():
            (now_t,) = [x for x in doc["tuning"] if x["point"] == {"topology": topo, "tau": int(tau)}]
            cmp([t["alpha0"], t["at_grid_edge"], t["extended"], t["grid_val_loss"], t["per_method_val_loss"],
                 t["diverged"]], [now_t["chosen"], now_t["at_edge"], now_t["extended"], now_t["scores"],
                                  now_t["per_method"], now_t["failed"]], "tuning")
    cmp(old["ordering"], doc["ordering"], "ordering")
    cmp.check(at_least=150)


def test_jgesr_gives_the_numbers_of_its_own_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = golden("jgesr")
    form = jgesr.Form(**{**old["form"], **{k: tuple(v) for k, v in old["form"].items() if isinstance(v, list)}})
    monkeypatch.setattr(jgesr, "QUICK", form)
    doc = jgesr.run(quick=True, seed=0, out=tmp_path, task="digits")
    cmp = Compare(rtol=1e-5)
    c1, c2 = form.noise_levels
    for m, row in old["table"].items():
        for level, c in (("noise1", c1), ("noise2", c2)):
            st = result(doc, m, noise=c, missing=0.0)["metrics"]["acc"]
            cmp([row[level]["mean"], row[level]["sd"], row[level]["runs"]], [st["mean"], st["sd"], st["per_seed"]],
                f"{m}/{level}")
        for p in old["missing_sweep"][m]:
            st = result(doc, m, noise=c1, missing=p["missing"])["metrics"]["acc"]
            cmp([p["mean"], p["sd"]], [st["mean"], st["sd"]], f"{m}/missing {p['missing']}")
        params = result(doc, m, noise=c1, missing=0.0)["params"]
        (rec,) = [t for t in doc["tuning"] if t["methods"] == [m]]
        cmp(old["tuned"][m]["lr"], params["lr"], f"{m}/lr")
        cmp({f"{float(k):g}": v for k, v in old["tuned"][m]["validation_acc"].items()}, rec["scores"], f"{m}/val")
        if "graph" in old["tuned"][m]:
            cmp(old["tuned"][m]["graph"], rec["refined"], f"{m}/graph")
    cmp(old["diagnostics"], doc["diagnostics"], "diagnostics")
    cmp.check(at_least=30)


def test_apflgate_gives_the_numbers_of_its_own_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = golden("apflgate")
    monkeypatch.setattr(apflgate, "QUICK", apflgate.Form(rounds=2, local_steps=2, seeds=2, lr_grid=(0.2,),
                                                         alphas=(0.5,), taus=(1.0,), nodes=3,
                                                         codecs=("quant-4bit",), fedavg=False))
    doc = apflgate.run(quick=True, seed=0, out=tmp_path, task="digits")
    m = old["metric"]
    assert doc["metric"] == m
    cmp = Compare(rtol=1e-5)

    def at(method: str, point: dict[str, Any]) -> dict[str, Any]:
        (r,) = [r for r in doc["results"] if r["method"] == method and r["point"] == point]
        return r

    cells = [("local", {}, old["methods"]["local"]), ("apfl", {"alpha": 0.5}, old["methods"]["apfl"]["0.5"]),
             ("fedgate", {"tau": 1.0}, old["methods"]["fedgate"]["1"]),
             ("apflgate", {"alpha": 0.5, "tau": 1.0}, old["methods"]["apflgate"]["0.5,1"])]
    for method, point, oc in cells:
        r = at(method, point)
        cmp([oc["mean"], oc["sd"], [v for v in oc["values"] if v is not None], oc["bytes_up"],
             oc["settings"]["train.lr"]],
            [r["metrics"][m]["mean"], r["metrics"][m]["sd"], r["metrics"][m]["per_seed"], r["metrics"]["bytes_up"]["mean"],
             r["params"]["lr"]], method)
        for view, st in oc.get("views", {}).items():
            cmp([st["mean"], st["sd"]], [r["metrics"][f"{view}_{m}"]["mean"], r["metrics"][f"{view}_{m}"]["sd"]], view)
        cmp(oc["curve_mean"], [row.get(m) for row in r["curve"]], f"{method}/curve")
    for name, oc in old["compression"].items():
        cmp({k: v for k, v in oc.items() if k in ("mean", "sd", "values", "bytes_up", "bytes_saved_fraction")},
            doc["compression"][name], f"compression/{name}")
        if "metric_change" in oc:
            cmp(oc["metric_change"], doc["compression"][name]["metric_change"], f"change/{name}")
    for method, t in old["tuning"].items():
        (rec,) = [x for x in doc["tuning"] if x["methods"] == [method]]
        cmp([t["lr"], t["extended"], t["at_grid_edge"], t["grid"]],
            [rec["chosen"], rec["extended"], rec["at_edge"], rec["scores"]], f"tuning/{method}")
    cmp(old["trivial"], doc["trivial"], "trivial")
    cmp(old["best"], doc["best"], "best")
    cmp.check(at_least=40)


def test_admm_gives_the_numbers_of_its_own_loop(tmp_path: Path) -> None:
    old = golden("admm")
    plan = admm.Plan(flip_settings=((10, 40, 0.0), (10, 40, 0.6)), v_settings=((10, 40, 0.0),), seeds=(0, 1),
                     lambdas=(0.01, 1.0), fixed_lambdas=(0.001, 1.0), cv_folds=2, cv_iter=10, n_iter=40,
                     conv_setting=(10, 40, 0.0), conv_iter=20, conv_every=5, workers=1)
    doc = json.loads(json.dumps(admm.run(quick=True, seed=0, out=tmp_path, plan=plan), default=str))
    cmp = Compare(rtol=1e-9)
    for key in ("methods", "claims", "edge_tests", "runs", "convergence"):
        cmp(old[key], doc[key], key)
    cmp.check(at_least=500)


def test_fedrelax_gives_the_numbers_of_its_own_loop(tmp_path: Path) -> None:
    old = golden("fedrelax")
    plan = fedrelax.Plan(seeds=(0, 1), lambdas=(0.1, 1.0), max_iter=3, mixed_lambdas=(1.0,), fdu_shared=20,
                         fdu_lambdas=(1.0,), fdu_ridges=(1.0,), check_lambdas=(1.0,), check_iters=(1, 3))
    doc = fedrelax.run(quick=True, seed=0, out=tmp_path, data_dir=tmp_path / "no-data", plan=plan)
    doc = json.loads(json.dumps(doc, default=str))
    cmp = Compare(rtol=1e-9)
    for key in ("verdicts", "methods", "diagnostics", "two_cluster_runs"):
        cmp(old[key], doc[key], key)
    cmp(old["paired"], doc["paired_by_part"], "paired")
    assert old["skipped"].startswith("FDU-MTL part skipped") and doc["skipped"].startswith("FDU-MTL part skipped")
    cmp.check(at_least=500)
