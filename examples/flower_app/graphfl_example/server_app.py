"""The ServerApp: Flower's quickstart with ``FedAvg`` swapped for a graphfl strategy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, Strategy

import graphfl.flower as gf
from graphfl_example.task import client_graph, make_model

app = ServerApp()


def make_strategy(name: str, cfg: Any) -> gf.GraphflStrategy:
    """The graphfl strategy ``name`` with settings for the example's 3 planted groups."""
    mu = float(cfg["prox-mu"])
    common: dict[str, Any] = {"min_available_nodes": 3, "seed": 0,
                              "fraction_evaluate": float(cfg.get("fraction-evaluate", 1.0))}
    if name == "fedavg":
        return gf.FedAvg(**common)
    if name == "fedprox":
        return gf.FedProx(mu=mu, **common)
    if name == "fesem":
        return gf.FeSEM(k=3, prox_lambda=mu / 2, **common)
    if name == "jgesr":
        return gf.JGESR(**common)
    if name == "cfl":
        return gf.CFL(warmup_rounds=1, min_cluster_size=2, eps1=10.0, eps2=0.0, **common)
    if name == "fedamp":
        return gf.FedAMP(prox_mu=mu, **common)
    if name == "fedgate":
        return gf.FedGATE(client_lr=float(cfg["lr"]), local_steps=int(cfg["local-steps"]), **common)
    if name == "local":
        return gf.Local(**common)
    if name == "apfl":
        return gf.APFL(client_lr=float(cfg["lr"]), **common)
    if name == "apflgate":
        return gf.APFLGate(client_lr=float(cfg["lr"]), local_steps=int(cfg["local-steps"]), **common)
    if name == "bigfl":
        return gf.BiGFL(client_graph=client_graph(3), **common)
    if name == "pfedgraph":
        return gf.PFedGraph(lam=float(cfg["pfedgraph-lam"]), **common)
    raise ValueError(f"unknown strategy {name!r}")


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run each strategy named in ``strategies``; write results.json and every client's final model."""
    cfg = context.run_config
    out = Path(str(cfg["out-dir"])) if cfg["out-dir"] else None
    results: dict[str, Any] = {}
    wrapped = {s.strip() for s in str(cfg["dp-strategies"]).split(",") if s.strip()}
    for name in (s.strip() for s in str(cfg["strategies"]).split(",")):
        strategy = make_strategy(name, cfg)
        runner: Strategy = strategy
        if name in wrapped:
            runner = DifferentialPrivacyServerSideFixedClipping(
                strategy, noise_multiplier=float(cfg["dp-noise"]), clipping_norm=float(cfg["dp-clip"]),
                num_sampled_clients=3)
        result = runner.start(grid=grid, initial_arrays=ArrayRecord(make_model().state_dict()),
                              num_rounds=int(cfg["num-server-rounds"]), train_config=ConfigRecord({"lr": float(cfg["lr"])}))
        results[name] = {
            "train_metrics": {r: dict(m) for r, m in result.train_metrics_clientapp.items()},
            "evaluate_metrics": {r: dict(m) for r, m in result.evaluate_metrics_clientapp.items()},
            "client_evaluations": strategy.client_evaluations,
            "server_metrics": strategy.server_metrics,
            "partition_of_node": {str(k): v for k, v in strategy.pid_of_node.items()},
            "final_arrays": list(result.arrays.keys()),
        }
        if out is not None and name != "local":   # local-only models never leave the clients; APFL: w
            for pid in range(strategy.n):
                np.savez(out / f"{name}-client-{pid}.npz", **strategy.client_arrays(pid))
    if out is not None:
        (out / "results.json").write_text(json.dumps(results, default=float))
