"""Benchmark B6 ``fedrelax`` (ALGORITHMS.md §7.7, §11; seed 003 = Jung, FedRelax).

The seed has no experiments; §7.7 reconstructs a stand-in from the reference code's demo.

Part 1 — two clusters (§7.7): 20 devices, devices 0–9 draw ``y = sin(2πx)``, devices 10–19
``y = 1 − 2x``, ``x ~ U[0, 1]``, noise ``N(0, 0.1²)``; 20 training, 20 validation and 20 test
points per device (the test split is added here so that λ and tree depth can be tuned on
validation and reported on test). Local models: ``DecisionTreeRegressor`` (depth 4 in the
reference configuration); ``D'`` = the grid ``{0.0, 0.1, …, 0.9}``; 100 iterations.
Graphs: **descriptor** = the reference code's 3-NN on ``c_i = (mean x_i, mean y_i)`` with
weights ``exp(−‖c_i − c_j‖/100)``; **prediction** = 3-NN on the devices' local predictions on
``D'`` (reconstructed: what FedRelax shares anyway), same weights; **cluster** = the true
clusters (an oracle graph). Methods: Local (λ = 0, depth tuned on validation), Pooled (one tree
on every device's data, depth tuned), Cluster-pooled (one tree per true cluster; oracle),
FedRelax in the reference configuration (descriptor graph, λ = 0.1, depth 4) and FedRelax with
λ tuned on validation on each graph. Metric: mean over devices of the test MSE.

Part 2 — a real network of devices: the 16-domain review data FDU-MTL (shared/data/fdu_mtl).
Each of the 15 product/movie domains is a device (binary sentiment, its own vocabulary and label
noise: a natural set of related but different tasks); MR, the 16th domain (movie-review
sentences), plays the public unlabelled set ``D'`` — its labels are never read. Features
(fitted on ``D'`` only, so no device's text is shared): binary TF-IDF over the tokens seen at
least twice in ``D'`` → 100-dimensional truncated SVD of ``D'`` (a word absent from ``D'``
would get no SVD loading anyway). Each
device trains on ``n_train`` rows sampled from its training file (the last 200 lines are its
validation set, as in the paper that released the data), and is tested on its 400 test rows.
Local models: ridge regression on the 0/1 label (FedRelax's least-squares form, Algorithm 2,
solved exactly by ``linear_closed_form``); predicted class = output > 0.5. Graphs: 3-NN on the
local models' predictions on ``D'``, and the complete graph. Ridge α and λ are tuned on
validation accuracy (FedRelax keeps Local's α and tunes λ). Metrics: mean test accuracy and MSE over
devices. Skipped, with the reason in the result, when the data folder (``--data-dir``/``$GRAPHFL_DATA``) has no ``fdu_mtl``.

FedRelax runs through :func:`fedrelax`, the ONE adapter of this module: today it calls the
all-nodes reference loop :func:`graphfl.p2p.fedrelax_math.run_fedrelax_reference`; when the p2p
algorithm ``fedrelax`` exists, its body becomes one call of the p2p in-process driver.

``--quick``: 3 seeds, λ grid of 5, ``n_train = 100``; about 2–4 minutes on 2 idle cores. Full:
5 seeds, ``n_train ∈ {100, 400}``. ``run(quick, seed, out)`` writes ``<out>/fedrelax.{json,md,png}``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from threadpoolctl import threadpool_limits

from graphfl.common.envinfo import env_info
from graphfl.common.graph import knn_graph
from graphfl.common.results import atomic_write_text, markdown_table, plot_panels, write_json
from graphfl.p2p.fedrelax_math import FedRelaxResult, linear_closed_form, run_fedrelax_reference
from graphfl.tasks.base import DataError
from graphfl.tasks.labeled import default_data_dir

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]
Split = tuple[FloatArray, FloatArray]

NAME = "fedrelax"
N_NODES = 20
N_POINTS = 20
NOISE = 0.1
GRID_SHARED = np.round(np.arange(10) * 0.1, 1)[:, None]
REF_LAMBDA = 0.1
REF_DEPTH = 4
DEPTHS = (1, 2, 3, 4, 6)
FDU_DOMAINS = ("apparel", "baby", "books", "camera_photo", "dvd", "electronics", "health_personal_care", "imdb",
               "kitchen_housewares", "magazines", "music", "software", "sports_outdoors", "toys_games", "video")
FDU_PUBLIC = "MR"
FDU_DEV = 200
FDU_DIM = 100
RIDGES = (0.1, 1.0, 10.0)

UNSPECIFIED = {
    "two_cluster": "ALGORITHMS §7.7 stand-in is itself reconstructed (the seed has no experiments); "
                   "a 20-point test split per device is added for honest reporting",
    "stopping": "max_iter = 100, early stop when every device's predictions on D' change by <= 1e-6 relative "
                "(§7.3, reconstructed)",
    "tree_random_state": "DecisionTreeRegressor(random_state=device id)",
    "lambda_scaling": "reference-code scaling λ/m' (seed eq. 12 λ = 2 x this λ)",
    "tuning": "Local and Pooled tune tree depth over DEPTHS, FedRelax tunes λ over the grid (depth 4), each on the "
              "mean validation MSE; FDU-MTL: Local and Pooled tune ridge α over RIDGES, FedRelax tunes λ (with Local's "
              "α), on mean validation accuracy (ties: lower validation MSE)",
    "prediction_graph": "3-NN (union) on the devices' local predictions on D', weights exp(-d/100) like the "
                        "reference descriptor graph (reconstructed)",
    "fdu_mtl": "15 devices (MR = public unlabelled D', labels unused); binary TF-IDF (vocabulary: tokens in >= 2 "
               "D' sentences) -> SVD(100), both fitted on D' only; n_train rows sampled per device with "
               "default_rng([seed, device]); last 200 training-file lines = validation; D' for FedRelax = 100 MR "
               "sentences (default_rng([seed, 99])); FedRelax uses the ridge α that Local chose on validation",
}


@dataclass(frozen=True)
class Plan:
    """The resolved configuration of one run."""

    seeds: tuple[int, ...]
    lambdas: tuple[float, ...]
    max_iter: int = 100
    fdu_train_sizes: tuple[int, ...] = (100,)
    fdu_shared: int = 100
    fdu_lambdas: tuple[float, ...] = (0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0)


def make_plan(quick: bool, seed: int) -> Plan:
    """``--quick``: 3 seeds, n_train = 100; full: 5 seeds, n_train ∈ {100, 400}."""
    if quick:
        return Plan(seeds=(seed, seed + 1, seed + 2), lambdas=(0.01, 0.1, 1.0, 10.0))
    return Plan(seeds=tuple(seed + k for k in range(5)), lambdas=(0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0),
                fdu_train_sizes=(100, 400))


# ---------------------------------------------------------------------------------------------
# the one FedRelax adapter
# ---------------------------------------------------------------------------------------------


def fedrelax(estimators: Any, data: Sequence[Split], x_shared: FloatArray, adjacency: FloatArray, lam: float, *,
             max_iter: int, seed: int, solver: str = "generic", ridge: float = 0.0) -> FedRelaxResult:
    """FedRelax on ``adjacency`` (local init, reference-code λ scaling); returns every device's model.

    The only place this module runs FedRelax. Today: the all-nodes reference loop
    ``run_fedrelax_reference``. To run the real p2p algorithm later, replace the call below by the
    p2p in-process driver with algorithm ``fedrelax`` (one line); the arguments map one to one.
    """
    return run_fedrelax_reference(estimators, data, x_shared, adjacency, lam=lam, max_iter=max_iter,
                                  solver=solver, ridge=ridge, seed=seed)  # type: ignore[arg-type]


def weighted_knn(points: FloatArray, k: int = 3, ref_distance: float = 100.0) -> FloatArray:
    """k-NN (union-symmetrised) with weights ``exp(−‖c_i − c_j‖/ref_distance)`` (reference code)."""
    mask = knn_graph(points, k)
    dist = np.sqrt(((points[:, None, :] - points[None, :, :]) ** 2).sum(-1))
    out: FloatArray = mask * np.exp(-dist / ref_distance)
    return out


def _mse(model: Any, x: FloatArray, y: FloatArray) -> float:
    return float(np.mean((np.asarray(model.predict(x), dtype=np.float64) - y) ** 2))


def _mean_sd(values: Sequence[float]) -> tuple[float, float | None]:
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), (float(arr.std(ddof=1)) if arr.size > 1 else None)


# ---------------------------------------------------------------------------------------------
# part 1: two clusters, trees
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TwoClusters:
    """Per-device train/validation/test splits (x as one column) and the true cluster ids."""

    train: list[Split]
    val: list[Split]
    test: list[Split]
    clusters: npt.NDArray[np.int64]


def truth(cluster: int, x: FloatArray) -> FloatArray:
    """Cluster 0: ``sin(2πx)``; cluster 1: ``1 − 2x``."""
    out: FloatArray = np.sin(2 * np.pi * x) if cluster == 0 else 1.0 - 2.0 * x
    return out


def two_clusters(seed: int, n_nodes: int = N_NODES, n_points: int = N_POINTS) -> TwoClusters:
    """Draw Part 1's data with ``default_rng([seed, 3, device])``."""
    clusters = (np.arange(n_nodes) >= n_nodes // 2).astype(np.int64)
    splits: list[list[Split]] = [[], [], []]
    for i in range(n_nodes):
        rng = np.random.default_rng([seed, 3, i])
        for part in splits:
            x = rng.uniform(0.0, 1.0, n_points)
            part.append((x[:, None], truth(int(clusters[i]), x) + NOISE * rng.standard_normal(n_points)))
    return TwoClusters(splits[0], splits[1], splits[2], clusters)


def _trees(depth: int, n: int) -> list[Any]:
    from sklearn.tree import DecisionTreeRegressor

    return [DecisionTreeRegressor(max_depth=depth, random_state=i) for i in range(n)]


def _score(models: Sequence[Any], parts: Sequence[Split]) -> float:
    return float(np.mean([_mse(m, x, y) for m, (x, y) in zip(models, parts)]))


def run_two_clusters(seed: int, plan: Plan) -> dict[str, Any]:
    """Every Part 1 method on one draw: validation/test MSE, chosen settings, the λ path per graph."""
    from sklearn.tree import DecisionTreeRegressor

    t0 = time.perf_counter()
    d = two_clusters(seed)
    n = len(d.train)
    out: dict[str, Any] = {"seed": seed, "methods": {}, "paths": {}}
    # local (depth tuned) = FedRelax with no iterations
    best: tuple[float, int, Any] | None = None
    for depth in DEPTHS:
        res = fedrelax(_trees(depth, n), d.train, GRID_SHARED, np.zeros((n, n)), 0.0, max_iter=0, seed=seed)
        v = _score(res.models, d.val)
        if best is None or v < best[0]:
            best = (v, depth, res.models)
    assert best is not None
    out["methods"]["local"] = {"val_mse": best[0], "test_mse": _score(best[2], d.test), "depth": best[1]}
    local_ref = fedrelax(_trees(REF_DEPTH, n), d.train, GRID_SHARED, np.zeros((n, n)), 0.0, max_iter=0,
                         seed=seed).models
    local_preds = np.stack([np.asarray(m.predict(GRID_SHARED)) for m in local_ref])
    # pooled over all devices, and per true cluster (oracle)
    for name, groups in (("pooled", [list(range(n))]),
                         ("cluster-pooled", [list(np.flatnonzero(d.clusters == c)) for c in (0, 1)])):
        best_p: tuple[float, int, list[Any]] | None = None
        for depth in DEPTHS:
            models: list[Any] = [None] * n
            for g in groups:
                x = np.vstack([d.train[i][0] for i in g])
                y = np.concatenate([d.train[i][1] for i in g])
                tree = DecisionTreeRegressor(max_depth=depth, random_state=0).fit(x, y)
                for i in g:
                    models[i] = tree
            v = _score(models, d.val)
            if best_p is None or v < best_p[0]:
                best_p = (v, depth, models)
        assert best_p is not None
        out["methods"][name] = {"val_mse": best_p[0], "test_mse": _score(best_p[2], d.test), "depth": best_p[1]}
    means = np.array([[x.mean(), y.mean()] for x, y in d.train])
    graphs = {"descriptor": weighted_knn(means), "prediction": weighted_knn(local_preds),
              "cluster": (d.clusters[:, None] == d.clusters[None, :]).astype(np.float64) - np.eye(n)}
    lambdas = sorted(set(plan.lambdas) | {REF_LAMBDA})
    tuned_models: dict[str, list[Any]] = {}
    for gname, adj in graphs.items():
        path = []
        best_val = math.inf
        for lam in lambdas:
            res = fedrelax(_trees(REF_DEPTH, n), d.train, GRID_SHARED, adj, lam, max_iter=plan.max_iter, seed=seed)
            path.append({"lambda": lam, "val_mse": _score(res.models, d.val), "test_mse": _score(res.models, d.test),
                         "iterations": res.iterations, "converged": res.converged})
            if path[-1]["val_mse"] < best_val:
                best_val, tuned_models[gname] = path[-1]["val_mse"], res.models
        out["paths"][gname] = path
        tuned = min(path, key=lambda r: r["val_mse"])
        out["methods"][f"fedrelax-{gname}"] = {**tuned, "depth": REF_DEPTH}
        cross = float(np.sum(adj[d.clusters[:, None] != d.clusters[None, :]] > 0) / 2)
        out.setdefault("graphs", {})[gname] = {"edges": float(np.count_nonzero(adj) / 2), "cross_cluster_edges": cross}
    ref = next(r for r in out["paths"]["descriptor"] if r["lambda"] == REF_LAMBDA)
    out["methods"]["fedrelax-reference"] = {**ref, "depth": REF_DEPTH}
    # fitted functions of one device per cluster (for the plot)
    xs = np.linspace(0, 1, 101)[:, None]
    fr = tuned_models["prediction"]
    out["functions"] = {str(i): {"x": xs[:, 0].tolist(), "truth": truth(int(d.clusters[i]), xs[:, 0]).tolist(),
                                 "local": np.asarray(local_ref[i].predict(xs)).tolist(),
                                 "fedrelax": np.asarray(fr[i].predict(xs)).tolist()} for i in (0, n - 1)}
    out["seconds"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------------------------
# part 2: FDU-MTL, ridge regression
# ---------------------------------------------------------------------------------------------


def read_fdu(path: Path) -> tuple[npt.NDArray[np.int64], list[str]]:
    """Labels and texts of one FDU-MTL file (``label<TAB>text`` per line, read as Latin-1, README)."""
    if not path.is_file():
        raise DataError(f"{path} not found: FDU-MTL files go under <data>/fdu_mtl/ (see shared/data/fdu_mtl/README.md)")
    labels: list[int] = []
    texts: list[str] = []
    with path.open(encoding="latin-1", newline="\n") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.rstrip("\n")
            if not line:
                continue
            label, sep, text = line.partition("\t")
            if not sep or label not in ("0", "1"):
                raise DataError(f"{path}:{lineno}: expected '<0|1>\\t<text>'")
            labels.append(int(label))
            texts.append(text)
    return np.asarray(labels, dtype=np.int64), texts


@dataclass(frozen=True)
class FduDevices:
    """Dense features per device: pools to sample training rows from, validation and test; ``D'`` features."""

    domains: tuple[str, ...]
    pool: list[Split]
    val: list[Split]
    test: list[Split]
    public: FloatArray


def load_fdu(root: Path) -> FduDevices:
    """Read FDU-MTL and featurise it (module docstring; every transform fitted on MR = ``D'`` only)."""
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfVectorizer

    folder = root / "fdu_mtl"
    public_texts = read_fdu(folder / f"{FDU_PUBLIC}.task.train")[1] + read_fdu(folder / f"{FDU_PUBLIC}.task.test")[1]
    tfidf = TfidfVectorizer(binary=True, min_df=2, token_pattern=r"(?u)\S+").fit(public_texts)
    dim = min(FDU_DIM, len(tfidf.vocabulary_) - 1)
    svd = TruncatedSVD(dim, random_state=0).fit(tfidf.transform(public_texts))

    def feats(texts: list[str]) -> FloatArray:
        out: FloatArray = np.asarray(svd.transform(tfidf.transform(texts)), dtype=np.float64)
        return out

    pool, val, test = [], [], []
    for dom in FDU_DOMAINS:
        y_tr, t_tr = read_fdu(folder / f"{dom}.task.train")
        y_te, t_te = read_fdu(folder / f"{dom}.task.test")
        f_tr = feats(t_tr)
        pool.append((f_tr[:-FDU_DEV], y_tr[:-FDU_DEV].astype(np.float64)))
        val.append((f_tr[-FDU_DEV:], y_tr[-FDU_DEV:].astype(np.float64)))
        test.append((feats(t_te), y_te.astype(np.float64)))
    return FduDevices(FDU_DOMAINS, pool, val, test, feats(public_texts))


def _acc(model: Any, x: FloatArray, y: FloatArray) -> float:
    return float(np.mean((np.asarray(model.predict(x)) > 0.5) == (y > 0.5)))


def _scores(models: Sequence[Any], parts: Sequence[Split]) -> dict[str, float]:
    return {"mse": float(np.mean([_mse(m, x, y) for m, (x, y) in zip(models, parts)])),
            "acc": float(np.mean([_acc(m, x, y) for m, (x, y) in zip(models, parts)]))}


def _validation_key(row: dict[str, Any]) -> tuple[float, float]:
    """Part 2 model selection: highest mean validation accuracy (the reported metric), then lowest MSE."""
    return (row["val_acc"], -row["val_mse"])


def run_fdu(devices: FduDevices, n_train: int, seed: int, plan: Plan) -> dict[str, Any]:
    """Local, Pooled and FedRelax (3-NN prediction graph, complete graph) on one draw of training rows."""
    t0 = time.perf_counter()
    n = len(devices.domains)
    train: list[Split] = []
    for i, (x, y) in enumerate(devices.pool):
        idx = np.sort(np.random.default_rng([seed, i]).choice(len(y), size=min(n_train, len(y)), replace=False))
        train.append((x[idx], y[idx]))
    shared = devices.public[np.sort(np.random.default_rng([seed, 99]).choice(len(devices.public), plan.fdu_shared,
                                                                             replace=False))]
    empty = np.zeros((n, n))
    out: dict[str, Any] = {"seed": seed, "n_train": n_train, "methods": {}, "paths": {}}

    def record(name: str, models: Sequence[Any], **extra: Any) -> dict[str, Any]:
        v, te = _scores(models, devices.val), _scores(models, devices.test)
        return {"val_mse": v["mse"], "val_acc": v["acc"], "test_mse": te["mse"], "test_acc": te["acc"], **extra}

    local_by_ridge = {r: fedrelax(None, train, shared, empty, 0.0, max_iter=0, seed=seed, solver="linear", ridge=r)
                      for r in RIDGES}
    local_rows = {r: record("local", res.models, ridge=r) for r, res in local_by_ridge.items()}
    ridge = max(local_rows, key=lambda r: _validation_key(local_rows[r]))
    out["methods"]["local"] = local_rows[ridge]
    pooled_rows = []
    for r in RIDGES:
        xp = np.vstack([x for x, _ in train])
        yp = np.concatenate([y for _, y in train])
        model = linear_closed_form(xp, yp, shared, [], [], 0.0, ridge=r)
        pooled_rows.append(record("pooled", [model] * n, ridge=r))
    out["methods"]["pooled"] = max(pooled_rows, key=_validation_key)
    preds = np.stack([np.asarray(m.predict(shared)) for m in local_by_ridge[ridge].models])
    graphs = {"prediction": weighted_knn(preds), "complete": np.ones((n, n)) - np.eye(n)}
    for gname, adj in graphs.items():
        path = []
        for lam in plan.fdu_lambdas:
            res = fedrelax(None, train, shared, adj, lam, max_iter=plan.max_iter, seed=seed, solver="linear", ridge=ridge)
            path.append(record(gname, res.models, **{"lambda": lam, "ridge": ridge, "iterations": res.iterations}))
        out["paths"][gname] = path
        out["methods"][f"fedrelax-{gname}"] = max(path, key=_validation_key)
    out["graph_neighbours"] = {devices.domains[i]: [devices.domains[j] for j in np.flatnonzero(graphs["prediction"][i])]
                               for i in range(n)}
    out["seconds"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

P1_METHODS = ("local", "pooled", "cluster-pooled", "fedrelax-reference", "fedrelax-descriptor", "fedrelax-prediction",
              "fedrelax-cluster")
P1_LABELS = {"local": "Local (depth tuned)", "pooled": "Pooled (depth tuned)",
             "cluster-pooled": "Cluster-pooled (oracle)",
             "fedrelax-reference": "FedRelax reference (descriptor graph, λ=0.1, depth 4)",
             "fedrelax-descriptor": "FedRelax, descriptor graph, λ tuned",
             "fedrelax-prediction": "FedRelax, prediction 3-NN graph, λ tuned",
             "fedrelax-cluster": "FedRelax, true-cluster graph (oracle), λ tuned"}
P2_METHODS = ("local", "pooled", "fedrelax-prediction", "fedrelax-complete")
P2_LABELS = {"local": "Local ridge", "pooled": "Pooled ridge", "fedrelax-prediction": "FedRelax, prediction 3-NN graph",
             "fedrelax-complete": "FedRelax, complete graph"}


def _aggregate(runs: list[dict[str, Any]], methods: Sequence[str], keys: Sequence[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for m in methods:
        entry: dict[str, Any] = {}
        for k in keys:
            mean, sd = _mean_sd([r["methods"][m][k] for r in runs])
            entry[k], entry[f"{k}_sd"] = mean, sd
        for k in ("lambda", "depth", "ridge"):
            if k in runs[0]["methods"][m]:
                entry[f"{k}_per_seed"] = [r["methods"][m][k] for r in runs]
        out[m] = entry
    return out


def _pm(entry: dict[str, Any], key: str) -> str:
    sd = entry.get(f"{key}_sd")
    return f"{entry[key]:.4f}" + (f" ± {sd:.4f}" if sd is not None else "")


def _path_curve(runs: list[dict[str, Any]], graph: str, key: str, by_ridge: bool = False) -> list[dict[str, Any]]:
    """Mean over seeds of ``key`` along the λ path (for FDU, at each seed's chosen ridge)."""
    lams = sorted({row["lambda"] for row in runs[0]["paths"][graph]})
    out = []
    for lam in lams:
        vals = []
        for r in runs:
            rows = [row for row in r["paths"][graph] if row["lambda"] == lam]
            if by_ridge:
                rows = [max(rows, key=_validation_key)]
            vals.append(rows[0][key])
        mean, sd = _mean_sd(vals)
        out.append({"lambda": lam, key: mean, f"{key}_sd": sd or 0.0})
    return out


def run(quick: bool, seed: int, out: Path, data_dir: str | Path | None = None,
        plan: Plan | None = None) -> dict[str, Any]:
    """Run B6 and write ``<out>/fedrelax.{json,md,png}``; returns the result dict.

    ``data_dir``: the data folder (default ``$GRAPHFL_DATA``, else ``~/.cache/graphfl/data``);
    ``plan`` overrides the quick/full plan (tests).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    plan = plan or make_plan(quick, seed)
    with threadpool_limits(1):  # tiny least-squares problems: BLAS threads only cost time (20x on a busy machine)
        return _run(quick, plan, out, data_dir, t_start)


def _run(quick: bool, plan: Plan, out: Path, data_dir: str | Path | None, t_start: float) -> dict[str, Any]:
    p1_runs = [run_two_clusters(s, plan) for s in plan.seeds]
    p1 = _aggregate(p1_runs, P1_METHODS, ("val_mse", "test_mse"))
    root = Path(data_dir) if data_dir else default_data_dir()
    p2: dict[int, dict[str, Any]] = {}
    p2_runs: dict[int, list[dict[str, Any]]] = {}
    skipped: str | None = None
    try:
        devices = load_fdu(root)
    except DataError as exc:
        skipped = f"FDU-MTL part skipped: {exc}"
        logger.warning("%s", skipped)
    else:
        for n_train in plan.fdu_train_sizes:
            p2_runs[n_train] = [run_fdu(devices, n_train, s, plan) for s in plan.seeds]
            p2[n_train] = _aggregate(p2_runs[n_train], P2_METHODS, ("val_mse", "test_mse", "val_acc", "test_acc"))
    methods: dict[str, Any] = {}
    for m in P1_METHODS:
        methods[f"two-cluster/{m}"] = {"final": {"test_mse": p1[m]["test_mse"], "test_acc": None, **p1[m]}, "curve": []}
    for g in ("descriptor", "prediction", "cluster"):
        methods[f"two-cluster/fedrelax-{g}"]["curve"] = _path_curve(p1_runs, g, "test_mse")
    for n_train, agg in p2.items():
        for m in P2_METHODS:
            methods[f"fdu_mtl-n{n_train}/{m}"] = {"final": agg[m], "curve": []}
        for g in ("prediction", "complete"):
            methods[f"fdu_mtl-n{n_train}/fedrelax-{g}"]["curve"] = _path_curve(p2_runs[n_train], g, "test_acc", True)
    doc: dict[str, Any] = {
        "name": NAME,
        "config": {**asdict(plan), "quick": quick, "data_dir": str(root), "two_cluster": {
            "nodes": N_NODES, "points_per_split": N_POINTS, "noise_sd": NOISE, "shared_set": GRID_SHARED[:, 0].tolist(),
            "reference": {"lambda": REF_LAMBDA, "depth": REF_DEPTH, "graph": "3-NN on (mean x, mean y), exp(-d/100)"},
            "depths": list(DEPTHS)},
            "fdu_mtl": {"devices": list(FDU_DOMAINS), "public_unlabelled": FDU_PUBLIC, "features": f"SVD({FDU_DIM})",
                        "ridges": list(RIDGES), "validation_rows": FDU_DEV},
            "adapter": "run_fedrelax_reference (all nodes, one process)"},
        "unspecified_settings": UNSPECIFIED,
        "methods": methods,
        "skipped": skipped,
        "two_cluster_runs": p1_runs,
        "fdu_mtl_runs": {str(k): v for k, v in p2_runs.items()},
        "env": env_info(),
        "seconds": time.perf_counter() - t_start,
    }
    write_json(out / f"{NAME}.json", doc)
    atomic_write_text(out / f"{NAME}.md", render_markdown(doc, plan, p1, p1_runs, p2, p2_runs))
    draw(out / f"{NAME}.png", p1, p1_runs, p2, p2_runs)
    return doc


def render_markdown(doc: dict[str, Any], plan: Plan, p1: dict[str, dict[str, Any]], p1_runs: list[dict[str, Any]],
                    p2: dict[int, dict[str, Any]], p2_runs: dict[int, list[dict[str, Any]]]) -> str:
    """Tables for both parts (mean ± sd over seeds) and the graphs' quality."""
    lines = [f"# B6: FedRelax ({'quick' if doc['config']['quick'] else 'full'})", "",
             f"Seeds {list(plan.seeds)}; wall time {doc['seconds']:.0f} s.", "",
             "## Part 1: two clusters, decision trees (ALGORITHMS §7.7 stand-in)", "",
             "Mean over the 20 devices of the test MSE (validation MSE chose λ / depth), mean ± sd over seeds.", "",
             markdown_table(columns=["method", "validation MSE", "test MSE", "chosen (per seed)"],
                            rows=[[P1_LABELS[m], _pm(p1[m], "val_mse"), _pm(p1[m], "test_mse"),
                                   ", ".join(f"{k}={v}" for k in ("lambda", "depth")
                                             for v in [p1[m].get(f"{k}_per_seed")] if v is not None)]
                                  for m in P1_METHODS]), "",
             markdown_table(columns=["graph", "edges", "cross-cluster edges"],
                            rows=[[g, float(np.mean([r["graphs"][g]["edges"] for r in p1_runs])),
                                   float(np.mean([r["graphs"][g]["cross_cluster_edges"] for r in p1_runs]))]
                                  for g in ("descriptor", "prediction", "cluster")]), ""]
    if doc["skipped"]:
        lines += ["## Part 2: FDU-MTL", "", doc["skipped"], ""]
    for n_train, agg in p2.items():
        lines += [f"## Part 2: FDU-MTL, 15 devices, {n_train} training reviews each, ridge regression", "",
                  markdown_table(columns=["method", "validation acc", "test acc", "test MSE", "λ / ridge (per seed)"],
                                 rows=[[P2_LABELS[m], _pm(agg[m], "val_acc"), _pm(agg[m], "test_acc"),
                                        _pm(agg[m], "test_mse"),
                                        ", ".join(f"{k}={v}" for k in ("lambda", "ridge")
                                                  for v in [agg[m].get(f"{k}_per_seed")] if v is not None)]
                                       for m in P2_METHODS]), ""]
        nb = p2_runs[n_train][0]["graph_neighbours"]
        lines += [f"Prediction 3-NN graph (seed {p2_runs[n_train][0]['seed']}): "
                  + "; ".join(f"{d} → {', '.join(v)}" for d, v in nb.items()), ""]
    lines += ["## Settings the sources do not give", ""] + [f"- {k}: {v}" for k, v in doc["unspecified_settings"].items()]
    return "\n".join(lines) + "\n"


def draw(path: Path, p1: dict[str, dict[str, Any]], p1_runs: list[dict[str, Any]], p2: dict[int, dict[str, Any]],
         p2_runs: dict[int, list[dict[str, Any]]]) -> None:
    """Test MSE vs λ (Part 1), fitted functions of two devices, test accuracy vs λ (Part 2)."""
    lams = [row["lambda"] for row in _path_curve(p1_runs, "descriptor", "test_mse")]
    flat = {P1_LABELS[m]: [{"lambda": lam, "test_mse": p1[m]["test_mse"]} for lam in lams]
            for m in ("local", "pooled", "cluster-pooled")}
    series1 = {**{f"FedRelax, {g} graph": _path_curve(p1_runs, g, "test_mse") for g in ("descriptor", "prediction",
                                                                                           "cluster")}, **flat}
    style1 = {P1_LABELS[m]: {"linestyle": "--"} for m in ("local", "pooled", "cluster-pooled")}
    funcs = p1_runs[0]["functions"]
    series2: dict[str, list[dict[str, Any]]] = {}
    for dev, f in funcs.items():
        for key in ("truth", "local", "fedrelax"):
            series2[f"device {dev}: {key}"] = [{"x": x, "y": y} for x, y in zip(f["x"], f[key])]
    panels: list[dict[str, Any]] = [
        {"x": "lambda", "y": "test_mse", "series": series1, "logx": True, "logy": True, "style": style1, "band": None,
         "xlabel": "λ", "ylabel": "mean test MSE", "title": "two clusters, trees depth 4"},
        {"x": "x", "y": "y", "series": series2, "xlabel": "x", "ylabel": "prediction",
         "title": f"fitted functions (seed {p1_runs[0]['seed']}, prediction graph, tuned λ)"},
    ]
    if p2:
        n_train = min(p2)
        runs = p2_runs[n_train]
        lam2 = [row["lambda"] for row in _path_curve(runs, "prediction", "test_acc", True)]
        flat2 = {P2_LABELS[m]: [{"lambda": lam, "test_acc": p2[n_train][m]["test_acc"]} for lam in lam2]
                 for m in ("local", "pooled")}
        series3 = {**{P2_LABELS[f"fedrelax-{g}"]: _path_curve(runs, g, "test_acc", True)
                      for g in ("prediction", "complete")}, **flat2}
        panels.append({"x": "lambda", "y": "test_acc", "series": series3, "logx": True,
                       "style": {P2_LABELS[m]: {"linestyle": "--"} for m in ("local", "pooled")},
                       "xlabel": "λ", "ylabel": "mean test accuracy", "title": f"FDU-MTL, {n_train} reviews per device"})
    if any(math.isnan(float(r["test_mse"])) for c in series1.values() for r in c):
        logger.warning("fedrelax plot: NaN values in the two-cluster curves")
    plot_panels(path, panels, title="B6: FedRelax (seed 003)")
