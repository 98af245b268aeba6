"""``graphfl p2p --engine inprocess``: the whole network in this process, same config, same result files.

The network file is prepared exactly as for the process engine (:func:`graphfl.deploy.p2p_launch.prepare_network`:
topology, mixing rule, ``[run]`` settings, the algorithm's ``prepare`` hook), then every node's
local problem is built from it (:func:`graphfl.p2p.peer.problem_spec`, the peers' own rule) and the
algorithm runs in lock-step:

* an algorithm that runs on stacked nodes (gossip, DFL-SGD, DFL-GT, without a robust ``combine``)
  on least-squares or ``vector`` problems with equal data shapes: the vectorised engine
  (:mod:`graphfl.p2p.vectorised`: the algorithm's own steps on all nodes as ``(n, d)`` arrays);
* anything else: the per-node driver :func:`graphfl.p2p.driver.run_network_inprocess`.

No sockets, no TLS, no failures: every neighbour is always heard. ``<out>/p2p.{json,md,png}`` have
the process engine's layout (:func:`graphfl.deploy.p2p_launch.write_report`); ``config.engine`` says
which engine and path ran, per-peer ``compute_s``/``comm_s`` are ``null`` (nothing is timed per
peer), and ``<out>/peer-<id>.npz`` holds each node's output arrays. A failure (an exception in a
step, a non-finite final model) is reported as ``ok: false`` with the error, never as done.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.common.envinfo import env_info
from graphfl.common.finite import node_divergence
from graphfl.deploy.p2p_launch import prepare_network, write_report
from graphfl.p2p import checkpoint
from graphfl.p2p.algorithms.base import NodeContext, NodeState
from graphfl.p2p.config import load_network_file
from graphfl.p2p.driver import run_network_inprocess
from graphfl.p2p.oracles import make_oracle
from graphfl.p2p.peer import problem_spec
from graphfl.p2p.vectorised import run_vectorised, supports

logger = logging.getLogger(__name__)

ENGINES = ("process", "inprocess")


def launch_inprocess(topology: str | None, peers: int | None, overrides: Mapping[str, Any], *, out: Path | None = None,
                     mixing: str = "metropolis", data_dir: str | Path | None = None,
                     vectorise: bool = True, device: str | None = None) -> dict[str, Any]:
    """Run a whole network in this process; returns the result dict plus ``text`` (one-line summary).

    ``vectorise=False`` forces the per-node driver (tests compare the two).
    """
    out = Path(out) if out is not None else Path("runs") / time.strftime("p2p-%Y%m%d-%H%M%S")
    seed = int(overrides.get("seed", 0))
    network_file = prepare_network(out, topology, peers, overrides, insecure=True, mixing=mixing, seed=seed,
                                   data_dir=data_dir, reserve_ports=False, device=device)
    net = load_network_file(network_file)
    run, topo = net.run, net.topology
    n = topo.n
    algo = run.make_algorithm()
    w, adj = topo.mixing_matrix(), topo.adjacency()
    t0 = time.monotonic()
    oracles = [make_oracle(i, problem_spec(net, i), partition=topo.peer(i).partition) for i in range(n)]
    setup_s = time.monotonic() - t0
    path = "vectorised" if vectorise and supports(algo, oracles) else "per-node"
    error: str | None = None
    states: list[NodeState] = []
    curve: list[dict[str, Any]] = []
    wire_round = payload_round = 0
    t1 = time.monotonic()
    try:
        if path == "vectorised":
            states, curve, wire_round, payload_round = run_vectorised(algo, oracles, w, run.iterations,
                                                                      eval_every=run.eval_every)
        else:
            res = run_network_inprocess(algo, oracles, w, run.iterations, adjacency=adj, eval_every=run.eval_every)
            states, curve, wire_round, payload_round = (res.states, res.curve, res.wire_bytes_per_round,
                                                        res.payload_bytes_per_round)
    except Exception as exc:  # noqa: BLE001  (reported, not hidden: ok = false with the error and traceback)
        error = f"{type(exc).__name__}: {exc}"
        logger.error("in-process run failed: %s", error)
        tb = traceback.format_exc()
    run_s = time.monotonic() - t1
    ctxs = NodeContext.for_network(w, adj)
    peers_doc: dict[str, Any] = {}
    rounds_done = curve[-1]["round"] if curve else 0
    for i in range(n):
        if error is not None or i >= len(states):
            peers_doc[str(i)] = {"outcome": "error", "error": error, "rounds_done": 0, "test_loss": None,
                                 "train_loss": None, "bytes_sent": 0, "bytes_received": 0, "payload_sent": 0,
                                 "compute_s": None, "comm_s": None, "skipped_rounds": 0, "seconds": run_s}
            continue
        st = states[i]
        test_loss = float(algo.evaluate(st, oracles[i]))
        diverged = node_divergence(st.theta, test_loss, float(st.loss))
        share = ctxs[i].degree / max(1, sum(c.degree for c in ctxs))  # exact for broadcast messages
        report = algo.report(st, oracles[i], ctxs[i])
        peers_doc[str(i)] = {
            "outcome": "done" if diverged is None else "diverged",
            "error": diverged,
            "exit_code": None, "start_t": 0, "final_t": st.t, "rounds_done": rounds_done,
            "test_loss": test_loss if np.isfinite(test_loss) else None,
            "train_loss": float(st.loss) if np.isfinite(st.loss) else None,
            "bytes_sent": int(round(share * wire_round * rounds_done)),
            "bytes_received": int(round(share * wire_round * rounds_done)),
            "payload_sent": int(round(share * payload_round * rounds_done)),
            "compute_s": None, "comm_s": None, "skipped_rounds": 0, "seconds": run_s,
        }
        if report:
            peers_doc[str(i)]["report"] = report
            if report.get("metrics"):
                peers_doc[str(i)]["metrics"] = report["metrics"]
            if report.get("estimate") is not None:
                peers_doc[str(i)]["estimate"] = report["estimate"]
        checkpoint.savez(out / f"peer-{i}.npz", **algo.output(st, oracles[i]))
    ok = error is None and all(p["outcome"] == "done" for p in peers_doc.values())
    last = curve[-1] if curve else {}
    final = {
        "test_loss": last.get("test_loss"), "train_loss": last.get("train_loss"),
        "avg_model_test_loss": last.get("avg_model_test_loss"), "consensus": last.get("consensus"),
        "bytes_sent": int(last.get("bytes", 0)), "payload_sent": int(last.get("payload_bytes", 0)),
        "seconds": setup_s + run_s, "peers_done": sum(p["outcome"] == "done" for p in peers_doc.values()),
        "seconds_per_round": run_s / rounds_done if rounds_done else None,
    }
    doc: dict[str, Any] = {
        "name": "p2p", "ok": ok,
        "config": {"run": dataclasses.asdict(run), "network": topo.name, "peers": n,
                   "edges": [list(e) for e in topo.edges], "mixing": topo.mixing, "tls": False,
                   "topology_version": topo.fingerprint, "engine": "inprocess", "engine_path": path},
        "methods": {run.algorithm: {"final": final, "curve": curve}},
        "peers": peers_doc,
        "timing": {"setup_s": setup_s, "run_s": run_s},
        "env": env_info(),
    }
    if error is not None:
        doc["error"] = error
        doc["traceback"] = tb
    prep = out / "prepare.json"
    if prep.is_file():
        doc["prepare"] = json.loads(prep.read_text())
    write_report(out, doc)
    tl = final["test_loss"]
    doc["text"] = (f"{run.algorithm} (in-process, {path}): {final['peers_done']}/{n} nodes done, {rounds_done} rounds "
                   f"in {run_s:.2f} s ({1000 * (final['seconds_per_round'] or 0):.1f} ms/round), mean test loss "
                   f"{'n/a' if tl is None else f'{tl:.4g}'}, consensus {final['consensus']}, results in {out}/p2p.json")
    if not ok:
        bad = {i: (p["outcome"], p["error"]) for i, p in peers_doc.items() if p["outcome"] != "done"}
        doc["text"] += f"\nnot done: {dict(list(bad.items())[:5])}{' ...' if len(bad) > 5 else ''}"
    return doc
