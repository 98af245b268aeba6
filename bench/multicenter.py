"""Benchmark B2 (ALGORITHMS.md §11, §5.9; seed 000 Table 10.1 / Fig. 10.3): multi-center FL.

Part 1 — the paper's synthetic experiment: 50 clients whose 8×8 linear ground truths come from
a mixture of 3 Gaussians, 4-NN client graph, MLP 8-16-16-8 (no bias, sigmoid hidden). Methods:
FedAvg, FeSEM (K = 3), BiG-FL and local-only training, all with the same local SGD settings.
Metric: mean over clients of the local test MSE, per round (Fig. 10.3), mean ± sd over seeds.
DFL (DFL-SGD on the same 4-NN graph, Metropolis weights, gossip every ``local-steps``
iterations; the p2p layer's in-process driver) runs with plain SGD at constant step
``lr / (1 - momentum)`` = 1.0, the effective step of the others' momentum SGD (the p2p step
functions have no momentum).

Part 2 — a real dataset with planted clusters: scikit-learn digits split over 12 clients in
3 groups; group g relabels every digit with its own permutation π_g (group 0: identity), so a
single global model cannot fit all groups. The client graph links the clients of a group in a
ring (the task knows it, as the synthetic task knows its 4-NN graph). BiG-FL acts on the last
layer (``bigfl.layers = net.2``), the hidden layer is averaged (FedAvg). Metric: mean local test
accuracy.

Timing: the wall time of each core's ``aggregate_train`` is recorded in the same runs, so
BiG-FL's server time per round (n = 50, d = 512: H = ÂΘφ, UL loss, Neumann hypergradient,
messages) is compared with FedAvg's aggregation time on the same machine.

``run(quick, seed, out)`` writes ``<out>/multicenter.{json,md,png}``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

NAME = "multicenter"
B2_METHODS = ("fedavg", "fesem", "bigfl", "local", "dfl")
REAL_METHODS = ("fedavg", "fesem", "bigfl", "local")

# Shared local training for every method (the spec leaves τ, β, m open; a plain SGD run on
# one client with these settings reaches test MSE ≈ 0.02 after 400 steps).
B2_TRAIN = {"train.lr": 0.1, "train.momentum": 0.9, "train.local-steps": 10, "train.batch-size": 20}
REAL_TRAIN = {"train.lr": 0.05, "train.momentum": 0.9, "train.local-steps": 10,
              "train.batch-size": 20, "data.dirichlet-alpha": 100.0}
METHOD_PARAMS: dict[str, dict[str, Any]] = {
    "fesem": {"fesem.k": 3},
    "bigfl": {},
}
REAL_PARAMS: dict[str, dict[str, Any]] = {
    "fesem": {"fesem.k": 3},
    "bigfl": {"bigfl.layers": "net.2", "bigfl.others": "fedavg"},
}


def run_method(strategy: str, task: str, nodes: int, rounds: int, seed: int,
               overrides: dict[str, Any]) -> dict[str, Any]:
    """One in-process run; returns its curve plus the per-round ``aggregate_train`` seconds."""
    import torch

    import graphfl.strategies.bigfl
    import graphfl.strategies.fesem  # noqa: F401
    from graphfl.common import registry
    from graphfl.common.config import parse_run_config
    from graphfl.common.envinfo import env_info
    from graphfl.server.inprocess import InProcessExchange, server_inputs
    from graphfl.server.rounds import RunRecorder, run_federated

    cfg = parse_run_config({"strategy": strategy, "task": task, "nodes": nodes, "rounds": rounds,
                            "seed": seed, "engine": "inprocess", **overrides})
    torch.set_num_threads(1)
    spec = registry.get(strategy)
    agg_seconds: list[float] = []

    def timed_core(ctx):
        core = spec.server_core(ctx)
        inner = core.aggregate_train

        def aggregate_train(server_round, updates):
            t0 = time.perf_counter()
            out = inner(server_round, updates)
            agg_seconds.append(time.perf_counter() - t0)
            return out

        core.aggregate_train = aggregate_train  # type: ignore[method-assign]
        return core

    timed_spec = dataclasses.replace(spec, server_core=timed_core)
    inputs = server_inputs(cfg)
    recorder = RunRecorder(cfg, strategy, None, name=f"{NAME}-{strategy}",
                           env={**env_info(), "engine": "inprocess"})
    t0 = time.perf_counter()
    run_federated(cfg, timed_spec, InProcessExchange(cfg), inputs, recorder)
    wall = time.perf_counter() - t0
    curve = recorder.document()["methods"][strategy]["curve"]
    return {"curve": curve, "aggregate_seconds": agg_seconds, "wall_seconds": wall,
            "config": cfg.to_json()}


def run_dfl(task: str, nodes: int, rounds: int, seed: int, train: dict[str, Any]) -> dict[str, Any]:
    """DFL-SGD over the task's client graph (in-process p2p driver), in the shape of run_method.

    One round = ``train.local-steps`` iterations, the first of which gossips (ALGORITHMS §2.4
    with ``tau = local-steps``); step ``lr / (1 - momentum)`` constant.
    """
    from graphfl.p2p.algorithms import registry as p2p_registry
    from graphfl.p2p.driver import run_network_inprocess as run_p2p
    from graphfl.p2p.mixing import mixing_matrix
    from graphfl.p2p.oracles import ProblemSpec, make_oracle
    from graphfl.tasks import registry as task_registry

    tau = int(train["train.local-steps"])
    alpha = float(train["train.lr"]) / (1.0 - float(train.get("train.momentum", 0.0)))
    adj = task_registry.create(task, seed=seed).client_graph(nodes)
    if adj is None:
        raise ValueError(f"task {task!r} has no client graph; run_dfl gossips over it")
    w = mixing_matrix(adj, "metropolis")
    spec = ProblemSpec(task, num_nodes=nodes, seed=seed, batch_size=int(train["train.batch-size"]))
    algo = p2p_registry.create("dfl-sgd", tau=tau, alpha0=alpha, step_rule="constant")
    t0 = time.perf_counter()
    res = run_p2p(algo, [make_oracle(i, spec) for i in range(nodes)], w, rounds * tau, eval_every=1)
    wall = time.perf_counter() - t0
    curve = [{"round": c["round"], "test_loss": c["test_loss"], "seconds": wall / max(rounds, 1),
              "bytes_up": c.get("bytes")} for c in res.curve if "test_loss" in c]
    return {"curve": curve, "aggregate_seconds": [], "wall_seconds": wall,
            "config": {"algorithm": "dfl-sgd", "tau": tau, "alpha": alpha, "step_rule": "constant",
                       "mixing": "metropolis", "graph": f"{task} client graph"}}


def _stats(values: list[float | None]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None and np.isfinite(v)]
    if not vals:
        return None, None
    return float(np.mean(vals)), float(np.std(vals, ddof=1)) if len(vals) > 1 else None


def _combine(runs: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """Mean ± sd over seeds, round by round."""
    rounds = sorted({row["round"] for r in runs for row in r["curve"]})
    curve = []
    for rd in rounds:
        rows: list[dict[str, Any]] = [next((row for row in r["curve"] if row["round"] == rd), {}) for r in runs]
        mean, sd = _stats([row.get(metric) for row in rows])
        entry: dict[str, Any] = {"round": rd, metric: mean, f"{metric}_sd": sd}
        for key in ("seconds", "bytes_up", "bytes_down"):
            m, _ = _stats([row.get(key) for row in rows])
            entry[key] = m
        aris = [row.get("server", {}).get("ari") for row in rows]
        if any(a is not None for a in aris):
            entry["ari"], entry["ari_sd"] = _stats(aris)
        curve.append(entry)
    finals = [r["curve"][-1].get(metric) for r in runs]
    mean, sd = _stats(finals)
    agg = [s for r in runs for s in r["aggregate_seconds"]]
    return {
        "final": {metric: mean, f"{metric}_sd": sd, "per_seed": finals,
                  "aggregate_seconds_per_round": float(np.mean(agg)) if agg else None,
                  "wall_seconds": float(np.mean([r["wall_seconds"] for r in runs]))},
        "curve": curve,
    }


def run(quick: bool = False, seed: int = 0, out: Path | str = Path("runs/bench")) -> dict[str, Any]:
    """Run B2 (+ the digits planted-cluster study) and write ``<out>/multicenter.*``.

    Parameters
    ----------
    quick
        1 seed, 20 rounds (B2) and 10 rounds (digits): about 2 minutes on 2 cores. The full
        form uses 3 seeds (``seed, seed+1, seed+2``), 40 rounds (B2) and 25 rounds (digits),
        about 10 minutes.
    seed
        First seed.
    out
        Output folder.
    """
    from graphfl.common.envinfo import env_info
    from graphfl.common.results import atomic_write_text, write_json


    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [seed] if quick else [seed, seed + 1, seed + 2]
    b2_rounds, real_rounds = (20, 10) if quick else (40, 25)
    t_start = time.perf_counter()

    b2: dict[str, Any] = {}
    b2_runs: dict[str, list[dict[str, Any]]] = {}
    for method in B2_METHODS:
        runs = []
        for s in seeds:
            logger.info("B2 %s seed %d (%d rounds)", method, s, b2_rounds)
            if method == "dfl":
                runs.append(run_dfl("synthetic-multicenter", 50, b2_rounds, s, B2_TRAIN))
                continue
            runs.append(run_method(method, "synthetic-multicenter", 50, b2_rounds, s,
                                   {**B2_TRAIN, **METHOD_PARAMS.get(method, {})}))
        b2_runs[method] = runs
        b2[method] = _combine(runs, "test_loss")

    real: dict[str, Any] = {}
    for method in REAL_METHODS:
        runs = []
        for s in seeds:
            logger.info("digits-permuted %s seed %d (%d rounds)", method, s, real_rounds)
            runs.append(run_method(method, "digits-permuted", 12, real_rounds, s,
                                   {**REAL_TRAIN, **REAL_PARAMS.get(method, {})}))
        real[method] = _combine(runs, "test_acc")
        loss = _combine(runs, "test_loss")
        real[method]["final"]["test_loss"] = loss["final"]["test_loss"]
        real[method]["final"]["test_loss_sd"] = loss["final"]["test_loss_sd"]

    timing = {
        "n": 50, "d": 512,
        "bigfl_server_seconds_per_round": b2["bigfl"]["final"]["aggregate_seconds_per_round"],
        "fedavg_aggregate_seconds_per_round": b2["fedavg"]["final"]["aggregate_seconds_per_round"],
        "fesem_server_seconds_per_round": b2["fesem"]["final"]["aggregate_seconds_per_round"],
        "bigfl_round_wall_seconds": _stats([row.get("seconds") for r in b2_runs["bigfl"]
                                            for row in r["curve"][1:]])[0],
        "fedavg_round_wall_seconds": _stats([row.get("seconds") for r in b2_runs["fedavg"]
                                             for row in r["curve"][1:]])[0],
    }
    doc = {
        "name": NAME,
        "config": {
            "quick": quick, "seeds": seeds, "b2_rounds": b2_rounds, "real_rounds": real_rounds,
            "b2": {"task": "synthetic-multicenter", "nodes": 50, **B2_TRAIN, "params": METHOD_PARAMS},
            "real": {"task": "digits-permuted", "nodes": 12, **REAL_TRAIN, "params": REAL_PARAMS},
            "resolved": {m: b2_runs[m][0]["config"] for m in B2_METHODS},
        },
        "methods": b2,
        "real_data": {"task": "digits-permuted", "metric": "test_acc", "methods": real},
        "timing": timing,
        "env": env_info(),
        "wall_seconds": time.perf_counter() - t_start,
    }
    write_json(out / f"{NAME}.json", doc)
    atomic_write_text(out / f"{NAME}.md", render_markdown(doc))
    try:
        plot(doc, out / f"{NAME}.png")
    except Exception:  # the JSON/MD are already written
        logger.exception("could not draw %s.png", NAME)
    return doc


def _pm(mean: float | None, sd: float | None, fmt: str = "{:.4f}") -> str:
    if mean is None:
        return "–"
    return fmt.format(mean) + ("" if sd is None else " ± " + fmt.format(sd))


def render_markdown(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    lines = [f"# {NAME} (B2, seed 000 Fig. 10.3)", "",
             f"Seeds {cfg['seeds']}; synthetic: 50 clients, {cfg['b2_rounds']} rounds; "
             f"digits-permuted: 12 clients, {cfg['real_rounds']} rounds. Mean ± sd over seeds.", "",
             "## Synthetic multi-center task: mean local test MSE (lower is better)", "",
             "| method | final test MSE | per seed | ARI (FeSEM) | server s/round |",
             "|---|---|---|---|---|"]
    for m, res in doc["methods"].items():
        f = res["final"]
        last = res["curve"][-1]
        ari = _pm(last.get("ari"), last.get("ari_sd"), "{:.2f}") if "ari" in last else "–"
        per = ", ".join("–" if v is None else f"{v:.4f}" for v in f["per_seed"])
        srv = f.get("aggregate_seconds_per_round")
        lines.append(f"| {m} | {_pm(f['test_loss'], f['test_loss_sd'])} | {per} | {ari} | "
                     f"{'–' if srv is None else f'{srv:.4f}'} |")
    lines += ["", "## Digits with permuted-label client groups: mean local test accuracy", "",
              "| method | final test acc | final test loss | per seed acc |", "|---|---|---|---|"]
    for m, res in doc["real_data"]["methods"].items():
        f = res["final"]
        per = ", ".join("–" if v is None else f"{v:.3f}" for v in f["per_seed"])
        lines.append(f"| {m} | {_pm(f['test_acc'], f['test_acc_sd'], '{:.3f}')} | "
                     f"{_pm(f.get('test_loss'), f.get('test_loss_sd'))} | {per} |")
    t = doc["timing"]
    lines += ["", "## Server time per round (n = 50, d = 512, same runs)", "",
              "| quantity | seconds |", "|---|---|"]
    for key in ("bigfl_server_seconds_per_round", "fedavg_aggregate_seconds_per_round",
                "fesem_server_seconds_per_round", "bigfl_round_wall_seconds",
                "fedavg_round_wall_seconds"):
        v = t.get(key)
        lines.append(f"| {key} | {'–' if v is None else f'{v:.4f}'} |")
    lines += ["", "## Curves (mean test MSE per round)", "",
              "| round | " + " | ".join(doc["methods"]) + " |",
              "|---|" + "---|" * len(doc["methods"])]
    rounds = [row["round"] for row in next(iter(doc["methods"].values()))["curve"]]
    by_round = {m: {row["round"]: row for row in res["curve"]} for m, res in doc["methods"].items()}
    for rd in rounds:
        vals = [_pm(by_round[m].get(rd, {}).get("test_loss"), by_round[m].get(rd, {}).get("test_loss_sd"))
                for m in doc["methods"]]
        lines.append(f"| {rd} | " + " | ".join(vals) + " |")
    lines += ["", f"Total wall time: {doc['wall_seconds']:.0f} s. Environment: "
              f"{doc['env']}", ""]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Mean ± sd over seeds per round: synthetic test MSE and digits accuracy."""
    from graphfl.common.results import plot_panels

    plot_panels(path, [
        {"x": "round", "y": "test_loss", "band": "test_loss_sd", "logy": True,
         "title": "synthetic multi-center: local test MSE",
         "series": {m: r["curve"] for m, r in doc["methods"].items()}},
        {"x": "round", "y": "test_acc", "band": "test_acc_sd",
         "title": "digits, permuted-label groups: test accuracy",
         "series": {m: r["curve"] for m, r in doc["real_data"]["methods"].items()}},
    ])


if __name__ == "__main__":  # pragma: no cover
    import argparse

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/bench"))
    args = ap.parse_args()
    run(args.quick, args.seed, args.out)
