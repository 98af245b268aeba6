"""Benchmark ``p2p-throughput``: one gossip exchange round of real peer processes vs a raw floor.

For each model size ``d`` (float32 parameters) and ring size ``n``, ``n`` real peer processes
(``python -m graphfl.p2p peer``, gRPC on 127.0.0.1) run plain gossip averaging
(``θ_i ← Σ_j W_ij θ_j``, no gradients) for a few rounds. One round moves ``2n`` messages of
``4d`` bytes (each peer sends θ_i to its two ring neighbours) — the same number of bytes as a
Flower round with ``n`` clients (``n`` downloads + ``n`` uploads through the SuperLink).

*Round time*: for each round, the longest per-peer round duration; the median over rounds
2.. is reported. *Floor*, measured in the same run on the same machine: serialise the same
``2n`` messages (``ndarray.tobytes``), push them through one plain loopback TCP socket to a
reader thread, rebuild the arrays (``np.frombuffer(...).copy()``) and do the ``n`` weighted
three-term sums of the mixing step — sequentially, in one process. *Bytes*: protobuf bytes on
the wire (frames incl. headers; HTTP/2 and TCP framing not counted) vs payload.

Flower's deployment round times for the same model sizes (FLOWER_NOTES.md §4a, measured on
these machines with the same echo-style round) are listed next to ours.

``run(quick, seed, out)`` writes ``<out>/p2p_throughput.{json,md,png}``.
"""

from __future__ import annotations

import json
import logging
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.common.envinfo import env_info
from graphfl.common.results import markdown_table, plot_panels, write_json
from graphfl.p2p.launcher import PeerProcesses, prepare_network

logger = logging.getLogger(__name__)

NAME = "p2p_throughput"
FULL_SIZES = (1_000_000, 10_000_000)
QUICK_SIZES = (100_000, 1_000_000)
FULL_PEERS = (4, 16)
QUICK_PEERS = (4, 8)
# FLOWER_NOTES.md §4a, median round time (s), 1M / 10M params, "deployment, insecure, defaults"
# and "simulation (Ray)", same machine class. 1M = 1,011,010 params, 10M = 10,020,010 params.
FLOWER_ROUND_S = {
    ("deployment", 4): {1_000_000: 6.36, 10_000_000: 8.72},
    ("deployment", 16): {1_000_000: 19.5, 10_000_000: 36.1},
    ("simulation", 4): {1_000_000: 0.38, 10_000_000: 1.23},
    ("simulation", 16): {1_000_000: 0.79, 10_000_000: 4.18},
}


def raw_floor(d: int, n: int, repeats: int = 3) -> float:
    """Seconds to serialise, push through loopback TCP, rebuild and mix one ring round (median)."""
    rng = np.random.default_rng(0)
    thetas = [rng.standard_normal(d, dtype=np.float32) for _ in range(n)]
    nbytes = 4 * d
    times = []
    for _ in range(repeats):
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        received: list[np.ndarray] = []

        def reader(srv: socket.socket = srv, received: list[np.ndarray] = received) -> None:
            conn, _ = srv.accept()
            with conn:
                for _ in range(2 * n):
                    buf = bytearray(nbytes)
                    view = memoryview(buf)
                    got = 0
                    while got < nbytes:
                        k = conn.recv_into(view[got:], nbytes - got)
                        if k == 0:
                            raise ConnectionError("floor socket closed early")
                        got += k
                    received.append(np.frombuffer(buf, dtype=np.float32).copy())

        th = threading.Thread(target=reader)
        th.start()
        t0 = time.perf_counter()
        with socket.create_connection(srv.getsockname()) as cli:
            for i in range(n):
                for _ in range(2):  # to the left and the right neighbour
                    cli.sendall(thetas[i].tobytes())
        th.join(120)
        for i in range(n):  # the mixing step: 1/3 (own + left + right), in float64 like graphfl.p2p.mixing.mix
            acc = thetas[i].astype(np.float64) / 3
            acc += received[(2 * i) % (2 * n)].astype(np.float64) / 3
            acc += received[(2 * i + 1) % (2 * n)].astype(np.float64) / 3
            acc.astype(np.float32)
        times.append(time.perf_counter() - t0)
        srv.close()
    return float(statistics.median(times))


def measure_ring(out: Path, d: int, n: int, rounds: int, insecure: bool, timeout: float) -> dict[str, Any]:
    """Run ``n`` gossip peers for ``rounds`` rounds; per-round network times and bytes."""
    net = prepare_network(out, "ring", n, {
        "algorithm": "gossip", "problem": "vector", "dim": d, "rounds": rounds, "eval-every": 10_000,
        "connect-timeout": 180, "round-timeout": 300, "send-timeout": 300, "max-ahead": 2,
        "checkpoint-every": 0,  # measure the network, not the disk (a 10M model is 40 MB per peer per round)
    }, insecure=insecure)
    t0 = time.monotonic()
    with PeerProcesses(net, out, range(n)) as procs:
        ok = procs.wait_all(t0 + timeout)
        codes = procs.exit_codes()
    peers: list[dict[str, Any]] = []
    for i in range(n):
        f = out / f"peer-{i}.json"
        peers.append(json.loads(f.read_text()) if f.is_file() else {"outcome": "missing", "records": []})
    done: list[dict[str, Any]] = [p for p in peers if p.get("outcome") == "done"]
    result: dict[str, Any] = {"params": d, "peers": n, "tls": not insecure, "ok": ok and len(done) == n,
                              "exit_codes": codes}
    if not done:
        return result
    per_round = []
    for k in range(rounds):
        durs = []
        for p in done:
            recs = p["records"]
            if len(recs) > k:
                prev = recs[k - 1]["seconds"] if k > 0 else 0.0
                durs.append(recs[k]["seconds"] - prev)
        per_round.append(max(durs) if durs else None)
    steady = [x for x in per_round[1:] if x is not None] or [x for x in per_round if x is not None]
    rec0 = [p["records"] for p in done]
    wire = sum(r["bytes_sent"] for recs in rec0 for r in recs[1:])
    payload = sum(r["payload_sent"] for recs in rec0 for r in recs[1:])
    result.update({
        "round_s": per_round,
        "median_round_s": float(statistics.median(steady)),
        "wire_bytes_per_round": wire / max(1, rounds - 1),
        "payload_bytes_per_round": payload / max(1, rounds - 1),
        "wire_over_payload": wire / payload if payload else None,
        "comm_s_mean": float(np.mean([r["comm_s"] for recs in rec0 for r in recs[1:]])),
    })
    return result


def run(quick: bool, seed: int, out: Path) -> dict[str, Any]:
    """Measure and write ``<out>/p2p_throughput.{json,md,png}``; returns the result dict."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = QUICK_SIZES if quick else FULL_SIZES
    peer_counts = QUICK_PEERS if quick else FULL_PEERS
    rounds = 4 if quick else 5
    cases = [(d, n, True) for d in sizes for n in peer_counts]
    if not quick:
        cases += [(d, 4, False) for d in sizes]  # mutual TLS
    rows = []
    methods: dict[str, Any] = {}
    for d, n, insecure in cases:
        label = f"{'plain' if insecure else 'tls'}-{n}peers"
        logger.info("p2p throughput: %d params, %d peers, %s", d, n, label)
        floor = raw_floor(d, n)
        res = measure_ring(out / "runs" / f"{d}-{n}-{label}", d, n, rounds, insecure, timeout=900)
        res["floor_s"] = floor
        res["ratio_to_floor"] = res["median_round_s"] / floor if res.get("median_round_s") else None
        key = min(FLOWER_ROUND_S.get(("deployment", n), {}), key=lambda p: abs(p - d), default=None)
        flower = flower_sim = None
        if key is not None and abs(key - d) < 0.1 * d:
            flower = FLOWER_ROUND_S.get(("deployment", n), {}).get(key)
            flower_sim = FLOWER_ROUND_S.get(("simulation", n), {}).get(key) if flower else None
        res["flower_deployment_round_s"] = flower
        res["flower_simulation_round_s"] = flower_sim
        rows.append(res)
        m = methods.setdefault(label, {"final": {}, "curve": []})
        m["curve"].append({"round": len(m["curve"]) + 1, "params": d, "seconds": res.get("median_round_s"),
                           "floor_s": floor, "ratio": res["ratio_to_floor"],
                           "bytes_up": res.get("wire_bytes_per_round"), "payload": res.get("payload_bytes_per_round")})
        m["final"][str(d)] = {"round_s": res.get("median_round_s"), "ratio_to_floor": res["ratio_to_floor"]}
    doc = {
        "name": NAME,
        "config": {"quick": quick, "seed": seed, "sizes": list(sizes), "peers": list(peer_counts), "rounds": rounds,
                   "topology": "ring", "algorithm": "gossip", "dtype": "float32",
                   "flower_reference": "FLOWER_NOTES.md §4a (deployment, insecure, defaults; simulation)"},
        "methods": methods,
        "rows": rows,
        "env": env_info(),
    }
    write_json(out / f"{NAME}.json", doc)
    table = markdown_table(
        columns=["params", "peers", "TLS", "round s (median)", "floor s", "ratio", "wire/payload", "MB/round (wire)",
                 "Flower deploy s", "Flower sim s", "ok"],
        rows=[[r["params"], r["peers"], r["tls"], r.get("median_round_s"), r["floor_s"], r.get("ratio_to_floor"),
               None if r.get("wire_over_payload") is None else f"{r['wire_over_payload']:.5f}",
               (r.get("wire_bytes_per_round") or 0) / 2**20, r["flower_deployment_round_s"],
               r["flower_simulation_round_s"], r["ok"]] for r in rows],
    )
    (out / f"{NAME}.md").write_text(
        f"# p2p throughput (ring, gossip, float32, {rounds} rounds, median of rounds 2..)\n\n{table}\n\n"
        "Floor = tobytes + plain loopback TCP + frombuffer copy + mixing sums of the same 2n messages, "
        "sequential, same run. Flower columns: FLOWER_NOTES.md §4a (same byte count per round: n down + n up).\n"
    )
    plot_panels(out / f"{NAME}.png", [
        {"x": "params", "y": "seconds", "ylabel": "round time (s)", "series": {k: v["curve"] for k, v in methods.items()},
         "logx": True, "logy": True},
        {"x": "params", "y": "ratio", "ylabel": "round time / floor", "series": {k: v["curve"] for k, v in methods.items()},
         "logx": True},
    ], title="p2p exchange round vs raw floor")
    return doc
