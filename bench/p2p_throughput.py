"""Benchmark ``p2p-throughput``: one gossip exchange round of real peer processes vs two raw floors.

For each model size ``d`` (float32 parameters) and ring size ``n``, ``n`` real peer processes
(``python -m graphfl.p2p peer``, gRPC on 127.0.0.1) run plain gossip averaging
(``θ_i ← Σ_j W_ij θ_j``, no gradients) for a few rounds. One round moves ``2n`` messages of
``4d`` bytes (each peer sends θ_i to its two ring neighbours).

*Round time*: for each round, the longest per-peer round duration; the median over rounds
2.. is reported. Two floors, measured in the same run on the same machine, do the same work
with nothing but sockets and numpy:

* **serial floor**: one process serialises the ``2n`` messages (``ndarray.tobytes``), pushes
  them through one loopback TCP socket to a reader thread, rebuilds the arrays
  (``np.frombuffer``) and does the ``n`` mixing sums (:func:`graphfl.p2p.mixing.mix`);
* **parallel floor**: ``n`` processes doing the ring exchange itself — each listens, connects to
  its two neighbours, and per round sends ``θ_i.tobytes()`` to both (one thread each), receives
  both neighbours' bytes into preallocated buffers, rebuilds them with ``np.frombuffer`` and mixes
  with :func:`graphfl.p2p.mixing.mix`; rounds start together (a barrier), the round time is the
  slowest process's. Same bytes, same pattern, no framing, no TLS, no validation.

On a machine with fewer cores than peers the parallel floor is slower than the serial one (the
processes share the cores); on a many-core machine it is the honest floor. graphfl's ratio to
both is reported. *Bytes*: protobuf bytes on the wire (frames incl. headers; HTTP/2 and TCP
framing not counted) vs payload. *Memory per peer*: each peer's maximum resident set
(``getrusage``), and *start-up*: process spawn -> the peer's gRPC server is up (imports, data,
TLS material), the same for the floor's processes.

**Flower, same bytes, same run**: for each case, graphfl's own Flower deployment (real
``flower-superlink`` + ``n`` ``flower-supernode`` processes on 127.0.0.1, warm ClientApp workers,
TLS as the p2p case) runs FedAvg on ``synthetic-vector`` with ``data.dim = d``: a bare
``d``-parameter float32 model, so one round moves ``n`` messages of ``4d`` bytes down and ``n``
up — the same ``2n`` messages as the ring — plus one SGD step per client. Its round time
(median of rounds 2..) is reported beside the p2p round. **Vanilla Flower, same bytes, same run**:
right after it, a stock Flower App (:func:`graphfl.bench.stock_flower.run_vector_app`: Flower's own
``FedAvg``, training only, over a bare ``d``-parameter float32 vector; each ClientApp does one
gradient step ``θ ← θ − η (θ − μ_i)``) runs the same ``rounds`` on the stock ``flower-superlink`` and
``n`` stock ``flower-supernode`` processes (one ``flwr-clientapp`` process per message, Flower's
default 1 s SuperExec poll), TLS as the case; its round (the App's own clock: training exchange +
aggregation, median of rounds 2..) is reported beside graphfl's, with their ratio. The p2p round is
the **whole ring's**:
the interval between the instants at which the last peer finished consecutive rounds
(:func:`network_round_seconds`), after the start-up catch-up. p2pfl is measured only when installed
(it is not a dependency; reported as skipped with the reason otherwise). No figure is copied
from notes.

The in-process engine (``graphfl p2p --engine inprocess``) is measured in the same run: ms per
round of DFL-GT on ``linreg`` with 1000 nodes on a ring, vectorised vs the per-node driver.

``run(quick, seed, out, form=None)`` writes ``<out>/p2p_throughput.{json,md,png}``. ``form="4-nodes"``
runs the full form's 4-node cases only (1M and 10M parameters, plaintext and TLS). The full form adds one
128-peer ring (100k parameters, plaintext) when the machine has the memory for it (1.5 x 128 x
the per-peer estimate ``60 MB + 20 x model bytes``, from the RSS measured in docs/p2p.md; skipped
with the reason otherwise).

On the benchmark harness (:mod:`graphfl.bench.harness`) in its measurement mode (``cache="none"``):
points = the cases ``(params, peers, tls)``, methods = what one case measures (``serial-floor``,
``parallel-floor``, ``parallel-floor-tls`` for TLS cases, ``grpc`` and ``socket`` = graphfl's ring
on either data path, ``flower`` and ``vanilla-flower`` up to :data:`FLOWER_MAX_NODES` nodes), one joint cell per case
(:func:`measure_case`: the floors and graphfl's rounds of a case are measured together), one
repeat (the run's seed), metrics = round seconds, the ratio to the parallel floor, wire/payload
bytes, per-process memory and start-up. The results are ratios of graphfl's round time to floors
measured in the same run on the same machine: every case is measured in the run that writes the
result, none is cached across runs (a cached time beside a fresh floor would compare two loads).
The 128-peer case is skipped by the memory available when the run starts, a Flower case (graphfl's
or vanilla) by the memory available when it is reached (:func:`flower_memory_mb` for both). What
this module adds: the measurements, the per-case ``rows`` with every figure, the in-process engine
and mixing-step timings, and its own tables.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.bench.ring_floor import recv_into, ring_weights
from graphfl.common.ports import free_ports
from graphfl.common.results import markdown_table
from graphfl.deploy.p2p_launch import PeerProcesses, prepare_network
from graphfl.p2p.mixing import mix

from .harness import Bench, Cell, Metric, run_bench
from .report import build_doc, metric_panels, write_report
from .stock_flower import run_vector_app

logger = logging.getLogger(__name__)

NAME = "p2p_throughput"
FULL_SIZES = (1_000_000, 10_000_000)
QUICK_SIZES = (100_000, 1_000_000)
FULL_PEERS = (4, 16)
QUICK_PEERS = (4, 8)
SCALE_PEERS = 128
SCALE_PARAMS = 100_000
"""The full form's large ring: 128 peers, 100k parameters, plaintext, run when memory allows."""
INPROCESS_NODES = 1000
FLOWER_MAX_NODES = 16
"""Largest ring for which the same bytes are also sent through a Flower deployment (one SuperNode per node)."""
FORMS: dict[str, tuple[tuple[int, int, bool], ...]] = {
    "4-nodes": tuple((d, 4, insecure) for insecure in (True, False) for d in FULL_SIZES),
}
"""``--form`` -> its cases ``(params, peers, insecure)``, measured with the full form's rounds."""
RING_ROUNDS_QUICK = 8
RING_ROUNDS_FULL = 20
"""Rounds of a p2p ring and of the parallel floor (the steady state is measured after start-up)."""
RING_MEASURE = ("the whole ring's round: T_k - T_(k-1), T_k = when the last peer finished round k (wall "
                "clock), median over k > max-ahead + 1 (start-up catch-up excluded)")
MAX_AHEAD = 2
"""``max-ahead`` of the measured ring: how many rounds a peer may run ahead of a neighbour."""


def flower_memory_mb(d: int, n: int) -> float:
    """Estimated peak memory (MB) of graphfl's Flower deployment for ``n`` nodes and a ``d``-parameter
    float32 model: per node (SuperNode + warm ClientApp worker) ``200 MB + 32 x model``, plus the
    SuperLink and the ServerApp ``300 MB + 80 x model``.

    Calibrated on this bench's own out-of-memory kill (2026-11-24, 24 GB machine, 10M x 16
    nodes): 16 SuperNode/worker pairs at ~0.37 + ~0.88 GB each, the SuperLink at 2.0 GB, the
    ServerApp at 1.1 GB, 22 GB of processes when the kernel killed the SuperLink. A case whose
    estimate exceeds the memory available is skipped with the reason instead of run into the OOM
    killer (which may pick any process on the machine, the bench's own included).
    """
    model_mb = 4 * d / 2**20
    return n * (200.0 + 32 * model_mb) + 300.0 + 80 * model_mb


def raw_floor(d: int, n: int, repeats: int = 3) -> float:
    """Serial floor: seconds to serialise, push through one loopback TCP socket, rebuild and mix one ring round."""
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
                    recv_into(conn, buf)
                    received.append(np.frombuffer(buf, dtype=np.float32))

        th = threading.Thread(target=reader)
        th.start()
        t0 = time.perf_counter()
        with socket.create_connection(srv.getsockname()) as cli:
            for i in range(n):
                for _ in range(2):  # to the left and the right neighbour
                    cli.sendall(thetas[i].tobytes())
        th.join(120)
        for i in range(n):  # the mixing step, with graphfl's own mix
            row = ring_weights(i, n)
            left, right = (i - 1) % n, (i + 1) % n
            arrays = {i: thetas[i], left: received[2 * left + 1], right: received[2 * right]}
            mix(row, {j: arrays[j] for j in row})
        times.append(time.perf_counter() - t0)
        srv.close()
    return float(statistics.median(times))


def parallel_floor(d: int, n: int, rounds: int = 5, timeout: float = 300.0,
                   cert_dir: Path | None = None) -> dict[str, Any]:
    """Parallel floor: ``n`` processes (``python -m graphfl.bench.ring_floor``) doing the ring exchange;
    each round starts when all finished the previous one; median over rounds 2.. of the slowest process.
    ``cert_dir`` (TLS material from :func:`graphfl.common.certs.generate_tls`): every ring connection
    is TLS, the floor of the TLS cases. Also returns each process's final vector (``peers``: its
    sum and first entries) so a test can check the floor really mixed.
    """
    ports = free_ports(n)
    ctrl_srv = socket.create_server(("127.0.0.1", 0), backlog=n)
    ctrl_srv.settimeout(timeout)
    ctrl_port = ctrl_srv.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "graphfl.bench.ring_floor", str(i), str(n), str(d), str(rounds),
                               ",".join(map(str, ports)), str(ctrl_port), repr(time.time()),
                               *([str(cert_dir)] if cert_dir is not None else [])], env=env)
             for i in range(n)]
    conns: list[socket.socket] = []
    try:
        for _ in range(n):
            conn, _ = ctrl_srv.accept()
            conn.settimeout(timeout)
            conns.append(conn)
        for c in conns:
            recv_into(c, bytearray(1))  # R: listening
        for c in conns:
            c.sendall(b"S")
        for _ in range(rounds):
            for c in conns:
                c.sendall(b"G")
            for c in conns:
                recv_into(c, bytearray(1))  # D
        for c in conns:
            c.sendall(b"E")  # all done: the processes may close their ring sockets
        got = []
        for c in conns:
            with c.makefile("rb") as fh:
                got.append(json.loads(fh.readline()))
    finally:
        for c in conns:
            c.close()
        ctrl_srv.close()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    per_round = [max(g["round_s"][k] for g in got) for k in range(rounds)]
    steady = per_round[1:] or per_round
    got.sort(key=lambda g: g["peer"])
    return {"round_s": per_round, "median_round_s": float(statistics.median(steady)),
            "startup_s": float(statistics.median(g["startup_s"] for g in got)),
            "rss_mb": float(statistics.median(g["rss_mb"] for g in got)),
            "tls_cipher": got[0].get("tls_cipher"), "malloc": sorted({str(g.get("malloc")) for g in got}),
            "peers": [{"theta_sum": g["theta_sum"], "theta_head": g["theta_head"]} for g in got]}


def network_round_seconds(records: list[list[dict[str, Any]]], rounds: int) -> list[float | None]:
    """Seconds per round of the whole ring: ``T_k - T_{k-1}``, where ``T_k`` is the wall-clock time
    at which the **last** peer finished round ``k`` (records' ``wall``); entry 0 is ``None``.

    A per-peer measure (each peer's own round length, max over peers) counts start-up skew as
    round time: with 128 peers starting over ~45 s on 2 cores, an early peer runs ``max-ahead``
    rounds and then waits for the late ones, and that wait landed in its round length (45 s
    "rounds" that were start-up). ``T_k`` only moves when every peer has done round ``k``.
    """
    done_at: list[float | None] = []
    for k in range(rounds):
        walls = [recs[k].get("wall") for recs in records if len(recs) > k]
        done_at.append(max(walls) if len(walls) == len(records) and None not in walls else None)  # type: ignore[type-var]
    out: list[float | None] = [None]
    for k in range(1, rounds):
        a, b = done_at[k - 1], done_at[k]
        out.append(b - a if a is not None and b is not None else None)
    return out


def measure_ring(out: Path, d: int, n: int, rounds: int, insecure: bool, timeout: float,
                 data_path: str = "grpc") -> dict[str, Any]:
    """Run ``n`` gossip peers for ``rounds`` rounds; per-round network times and bytes.

    ``data_path``: ``[run] data-path`` (``grpc`` Push streams or the ``socket`` data path).
    """
    net = prepare_network(out, "ring", n, {
        "algorithm": "gossip", "problem": "vector", "dim": d, "rounds": rounds, "eval-every": 10_000,
        "data-path": data_path,
        "connect-timeout": 180, "round-timeout": 300, "send-timeout": 300, "max-ahead": MAX_AHEAD,
        "checkpoint-every": 0,  # measure the network, not the disk (a 10M model is 40 MB per peer per round)
    }, insecure=insecure)
    t0 = time.monotonic()
    with PeerProcesses(net, out, range(n)) as procs:
        ok = procs.wait_all(t0 + timeout)
        codes = procs.exit_codes()
        spawned = dict(procs.started_at)
    peers: list[dict[str, Any]] = []
    for i in range(n):
        f = out / f"peer-{i}.json"
        peers.append(json.loads(f.read_text()) if f.is_file() else {"outcome": "missing", "records": []})
    done: list[dict[str, Any]] = [p for p in peers if p.get("outcome") == "done"]
    result: dict[str, Any] = {"params": d, "peers": n, "tls": not insecure, "data_path": data_path,
                              "ok": ok and len(done) == n,
                              "exit_codes": codes}
    if not done:
        return result
    per_round = network_round_seconds([p["records"] for p in done], rounds)
    # the first MAX_AHEAD + 1 intervals still carry start-up catch-up (late peers find their
    # neighbours' messages of the next rounds already buffered); fall back to all intervals
    steady = ([x for x in per_round[MAX_AHEAD + 1:] if x is not None]
              or [x for x in per_round if x is not None])
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
        "rss_mb_median": _median([p.get("max_rss_mb") for p in done]),
        "rss_mb_max": max((p["max_rss_mb"] for p in done if p.get("max_rss_mb") is not None), default=None),
        "startup_s_median": _median([p["serving_at"] - spawned[i] for i, p in enumerate(peers)
                                     if p.get("outcome") == "done" and p.get("serving_at") and i in spawned]),
        "torch_imported": sorted({bool(p.get("torch_imported")) for p in done}),
        "malloc": sorted({str(p.get("malloc")) for p in done}),
    })
    return result


def measure_flower(out: Path, d: int, n: int, rounds: int, insecure: bool, timeout: float) -> dict[str, Any]:
    """The Flower round of graphfl's deployment for the same bytes: FedAvg on ``synthetic-vector`` (``d`` params).

    Returns the per-round seconds from the run's ``run.json`` (rounds 1..), the median of rounds
    2.., bytes per round and the run's status; a failed deployment is reported, not raised.
    """
    from graphfl.common.config import parse_run_config
    from graphfl.deploy.run import run_experiment

    cfg = parse_run_config({"strategy": "fedavg", "task": "synthetic-vector", "data": {"dim": d}, "nodes": n,
                            "rounds": rounds, "seed": 0, "out-dir": str(out),
                            "train": {"local-steps": 1, "batch-size": 2}})
    res: dict[str, Any] = {"params": d, "nodes": n, "tls": not insecure, "clientapp_mode": "warm",
                           "strategy": "fedavg", "task": "synthetic-vector"}
    try:
        run_experiment(cfg, insecure=insecure, run_timeout=timeout, clientapp_mode="warm")
    except Exception as exc:  # noqa: BLE001 - a failed deployment is a result of the bench, not its end
        logger.warning("Flower round for %d params, %d nodes failed: %s", d, n, exc)
        res.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    run_json = out / "run.json"
    if not run_json.is_file():
        res.setdefault("ok", False)
        return res
    doc = json.loads(run_json.read_text())
    curve = [c for c in doc["methods"]["fedavg"]["curve"] if c.get("round", 0) >= 1 and "seconds" in c]
    per_round = [float(c["seconds"]) for c in curve]
    steady = per_round[1:] or per_round
    res.update({"status": doc.get("status"), "run_error": doc.get("error"), "round_s": per_round,
                "median_round_s": float(statistics.median(steady)) if steady else None,
                "bytes_per_round": float(np.mean([c.get("bytes_up", 0) + c.get("bytes_down", 0) for c in curve]))
                if curve else None})
    res.setdefault("ok", doc.get("status") == "completed" and len(per_round) == rounds)
    return res


def _median(values: list[Any]) -> float | None:
    v = [float(x) for x in values if x is not None]
    return float(statistics.median(v)) if v else None


def measure_inprocess(out: Path, nodes: int, rounds: int) -> dict[str, Any]:
    """Milliseconds per round of DFL-GT on ``linreg`` with ``nodes`` nodes on a ring: vectorised vs per-node driver."""
    from graphfl.deploy.p2p_inprocess import launch_inprocess

    res: dict[str, Any] = {"nodes": nodes, "rounds": rounds, "algorithm": "dfl-gt", "problem": "linreg"}
    for vec in (True, False):
        doc = launch_inprocess("ring", nodes, {"algorithm": "dfl-gt", "rounds": rounds, "problem": "linreg",
                                               "alpha0": 1e-7, "eval-every": 10 * rounds},
                               out=out / ("vectorised" if vec else "per-node"), vectorise=vec)
        fin = doc["methods"]["dfl-gt"]["final"]
        res["vectorised" if vec else "per_node"] = {"ms_per_round": 1000 * (fin["seconds_per_round"] or float("nan")),
                                                    "setup_s": doc["timing"]["setup_s"], "ok": doc["ok"],
                                                    "test_loss": fin["test_loss"]}
    res["speedup"] = res["per_node"]["ms_per_round"] / res["vectorised"]["ms_per_round"]
    return res


def _mix_float64_copy(weights: dict[int, float], arrays: dict[int, np.ndarray]) -> np.ndarray:
    """A reference mixing rule (float64 accumulator, a float64 copy per term), timed beside :func:`mix`."""
    keys = sorted(weights)
    acc = np.zeros(arrays[keys[0]].shape, dtype=np.float64)
    for j in keys:
        acc += weights[j] * np.asarray(arrays[j], dtype=np.float64)
    return acc.astype(arrays[keys[0]].dtype, copy=False)


def measure_mixing(d: int = 1_000_000, repeats: int = 30) -> dict[str, Any]:
    """One node's mixing step on a ring (3 float32 terms of ``d``): :func:`graphfl.p2p.mixing.mix`
    (float32, in place) vs the float64-with-copies rule it replaced; min and median over interleaved repeats.
    """
    rng = np.random.default_rng(0)
    arrays = {j: rng.standard_normal(d, dtype=np.float32) for j in range(3)}
    weights = {0: 1 / 3, 1: 1 / 3, 2: 1 / 3}
    times: dict[str, list[float]] = {"float32_in_place": [], "float64_copies": []}
    for _ in range(repeats):
        for key, fn in (("float32_in_place", mix), ("float64_copies", _mix_float64_copy)):
            t0 = time.perf_counter()
            fn(weights, arrays)
            times[key].append(time.perf_counter() - t0)
    diff = float(np.max(np.abs(mix(weights, arrays).astype(np.float64)
                               - _mix_float64_copy(weights, arrays).astype(np.float64))))
    out: dict[str, Any] = {"params": d, "terms": 3, "max_abs_difference": diff}
    for key, ts in times.items():
        out[key] = {"min_ms": 1000 * min(ts), "median_ms": 1000 * statistics.median(ts)}
    out["speedup_median"] = out["float64_copies"]["median_ms"] / out["float32_in_place"]["median_ms"]
    out["speedup_min"] = out["float64_copies"]["min_ms"] / out["float32_in_place"]["min_ms"]
    return out


def _mem_available_mb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _fresh(folder: Path) -> None:
    """Remove a case folder left by an earlier run into the same ``--out`` (this bench keeps no
    cache): its peer files or ``run.json`` must never be read as this run's.
    """
    if folder.exists():
        logger.warning("p2p throughput: removing %s from an earlier run into the same --out", folder)
        shutil.rmtree(folder)


def _first_line(text: str, limit: int = 300) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    head = lines[0] if lines else "(no error text)"
    last = lines[-1] if len(lines) > 1 else ""
    joined = f"{head} ... {last}" if last and last != head else head
    return joined[:limit]


def render(doc: Mapping[str, Any]) -> str:
    """The per-case Markdown tables of a result dict (the first part of the report :func:`run` writes)."""
    rows = doc["rows"]
    cfg = doc["config"]
    ring_rounds, rounds = cfg.get("ring_rounds", cfg["rounds"]), cfg["rounds"]
    mixing, skipped, p2pfl, inproc = doc["mixing"], doc["skipped"], doc["p2pfl"], doc["inprocess"]
    cpus = cfg.get("cpus")
    table = markdown_table(
        columns=["params", "peers", "TLS", "gRPC round s (median)", "serial floor s", "parallel floor s", "/ serial",
                 "/ parallel", "parallel TLS floor s", "/ parallel TLS", "wire/payload", "MB/round (wire)",
                 "peer RSS MB (median)", "peer start-up s",
                 "floor proc RSS MB", "floor start-up s", "Flower round s", "Flower / p2p",
                 "vanilla Flower round s", "vanilla / graphfl Flower", "vanilla / p2p", "ok"],
        rows=[[r["params"], r["peers"], r["tls"], r.get("median_round_s"), r["floor_s"], r["parallel_floor_s"],
               r.get("ratio_to_floor"), r.get("ratio_to_parallel_floor"),
               r.get("parallel_floor_tls_s"), r.get("ratio_to_parallel_floor_tls"),
               None if r.get("wire_over_payload") is None else f"{r['wire_over_payload']:.5f}",
               (r.get("wire_bytes_per_round") or 0) / 2**20, r.get("rss_mb_median"), r.get("startup_s_median"),
               r["parallel_floor"]["rss_mb"], r["parallel_floor"]["startup_s"],
               (r.get("flower") or {}).get("median_round_s"), r.get("flower_over_p2p"),
               (r.get("vanilla") or {}).get("median_round_s"), r.get("vanilla_over_flower"), r.get("vanilla_over_p2p"),
               r["ok"]] for r in rows],
    )
    socket_table = markdown_table(
        columns=["params", "peers", "TLS", "socket round s (median)", "/ parallel", "/ parallel TLS",
                 "gRPC round s", "gRPC / socket", "wire/payload", "peer RSS MB (median)", "peer start-up s", "ok"],
        rows=[[r["params"], r["peers"], r["tls"], s.get("median_round_s"), s.get("ratio_to_parallel_floor"),
               s.get("ratio_to_parallel_floor_tls"), r.get("median_round_s"),
               r["median_round_s"] / s["median_round_s"] if r.get("median_round_s") and s.get("median_round_s")
               else None,
               None if s.get("wire_over_payload") is None else f"{s['wire_over_payload']:.5f}",
               s.get("rss_mb_median"), s.get("startup_s_median"), s.get("ok")]
              for r in rows for s in [r.get("socket") or {}] if s],
    )
    ip = inproc
    return (
        f"# p2p throughput (ring, gossip, float32, {ring_rounds} ring rounds, {rounds} Flower rounds)\n\n"
        f"## data-path = grpc (the default: frames in gRPC Push streams)\n\n{table}\n\n"
        + (f"## data-path = socket (the same frames over TCP / TLS connections beside gRPC)\n\n{socket_table}\n\n"
           "Same cases, same floors (measured once per case, above), peers started fresh.\n\n"
           if any(r.get("socket") for r in rows) else "")
        + f"p2p round = {RING_MEASURE}. Flower round = median of rounds 2.. of its run. Vanilla Flower "
          "round = median of rounds 2.. of a stock Flower App's run (its ServerApp's own clock).\n\n"
        "Serial floor = tobytes + one loopback TCP socket + frombuffer + graphfl's mixing sums of the same 2n "
        "messages, one process. Parallel floor = n processes doing the same ring exchange over raw sockets "
        "(same bytes, same pattern); for TLS rows also over TLS sockets (Python's ssl, the same "
        f"certificates' kind as the peers). All measured in this run, on {cpus} CPUs.\n\n"
        f"In-process engine, DFL-GT linreg, {ip['nodes']} nodes on a ring: {ip['vectorised']['ms_per_round']:.1f} "
        f"ms/round vectorised, {ip['per_node']['ms_per_round']:.1f} ms/round per-node driver "
        f"({ip['speedup']:.1f}x).\n\n"
        f"Mixing step, one node of a ring, 1M float32 parameters: {mixing['float32_in_place']['median_ms']:.2f} ms "
        f"(float32 in place) vs {mixing['float64_copies']['median_ms']:.2f} ms (float64 with a copy per term), "
        f"median of interleaved repeats ({mixing['speedup_median']:.1f}x; min: {mixing['speedup_min']:.1f}x), "
        f"largest difference {mixing['max_abs_difference']:.2g}.\n\n"
        f"Flower: {doc['flower']}.\n\n"
        + (f"Vanilla Flower: {doc['vanilla_flower']}.\n\n" if doc.get("vanilla_flower") else "")
        + f"p2pfl: {p2pfl}.\n"
        + ("".join(f"\nSkipped: {x}.\n" for x in skipped))
        + ("".join(f"\nFlower failed for {r['params']} params, {r['peers']} nodes"
                   f"{' (TLS)' if r['tls'] else ''}: {_first_line(r['flower'].get('error', ''))}"
                   + (f" (the run's own error: {_first_line(r['flower']['run_error'])})"
                      if r["flower"].get("run_error") else "") + "\n"
                   for r in rows if r.get("flower") and r["flower"].get("ok") is False))
        + ("".join(f"\nVanilla Flower failed for {r['params']} params, {r['peers']} nodes"
                   f"{' (TLS)' if r['tls'] else ''}: {_first_line(r['vanilla'].get('error', ''))}\n"
                   for r in rows if r.get("vanilla") and r["vanilla"].get("ok") is False))
    )


VANILLA_DESCRIPTION = (
    "measured in this run, right after graphfl's Flower run of the same case: a stock Flower App "
    "(flwr.serverapp.strategy.FedAvg, training only, fraction_evaluate=0) over a bare float32 vector of the "
    "same parameter count, ClientApp = one gradient step theta - lr (theta - mu_i); stock flower-superlink + "
    "stock flower-supernode processes (one flwr-clientapp process per message, SuperExec poll 1 s), TLS as "
    "the case, same nodes and rounds; round = the ServerApp's own clock (training exchange + aggregation), "
    "rounds 2.. median. The same bytes, not the same work: graphfl's Flower case also evaluates the previous "
    "model on each client (piggy-backed on the training reply) and takes its SGD step in torch")

METHODS = ("serial-floor", "parallel-floor", "parallel-floor-tls", "grpc", "socket", "flower", "vanilla-flower")
METRICS = (Metric("round_s", "round s (median)", fmt=".4g"),
           Metric("ratio_to_parallel_floor", "/ parallel floor", fmt=".3g", paired=False),
           Metric("wire_over_payload", "wire/payload", fmt=".5f", paired=False),
           Metric("rss_mb", "RSS MB per process (median)", fmt=".0f", paired=False),
           Metric("startup_s", "start-up s (median)", fmt=".3g", paired=False))
PAIRS = (("grpc", "parallel-floor"), ("socket", "grpc"), ("flower", "grpc"), ("vanilla-flower", "flower"))


def methods_at(point: Mapping[str, Any]) -> list[str]:
    """What a case measures: the TLS floor only for TLS cases, Flower (graphfl's and vanilla) only up to
    :data:`FLOWER_MAX_NODES` nodes.
    """
    return [m for m in METHODS if (m != "parallel-floor-tls" or point["tls"])
            and (m not in ("flower", "vanilla-flower") or point["peers"] <= FLOWER_MAX_NODES)]


def measure_case(out: Path, rounds: int, ring_rounds: int, d: int, n: int, insecure: bool) -> dict[str, Any]:
    """One case's row: both floors, graphfl's ring on both data paths and (up to :data:`FLOWER_MAX_NODES`
    nodes) its Flower deployment for the same bytes, all measured now, one after the other.
    """
    label = f"{'plain' if insecure else 'tls'}-{n}peers"
    logger.info("p2p throughput: %d params, %d peers, %s", d, n, label)
    case = f"{d}-{n}-{label}"
    for folder in (out / "runs" / case, out / "runs" / f"{case}-socket", out / "flower" / case,
                   out / "vanilla" / case):
        _fresh(folder)
    floor = raw_floor(d, n)
    pfloor = parallel_floor(d, n, rounds=ring_rounds)
    res = measure_ring(out / "runs" / case, d, n, ring_rounds, insecure, timeout=900 + 10 * n)
    res["floor_s"] = floor
    res["parallel_floor_s"] = pfloor["median_round_s"]
    res["parallel_floor"] = pfloor
    med = res.get("median_round_s")
    res["ratio_to_floor"] = med / floor if med else None
    res["ratio_to_parallel_floor"] = med / pfloor["median_round_s"] if med else None
    # the same ring with [run] data-path = "socket": the same frames over TCP / TLS instead of gRPC's Push
    sres = measure_ring(out / "runs" / f"{case}-socket", d, n, ring_rounds, insecure, timeout=900 + 10 * n,
                        data_path="socket")
    smed = sres.get("median_round_s")
    sres["ratio_to_parallel_floor"] = smed / pfloor["median_round_s"] if smed else None
    res["socket"] = sres
    if not insecure:  # the same ring over TLS sockets: what the encryption itself costs
        from graphfl.common.certs import generate_tls

        cert_dir = out / "runs" / case / "floor-certs"
        generate_tls(cert_dir)
        tfloor = parallel_floor(d, n, rounds=ring_rounds, cert_dir=cert_dir)
        res["parallel_floor_tls"] = tfloor
        res["parallel_floor_tls_s"] = tfloor["median_round_s"]
        res["ratio_to_parallel_floor_tls"] = med / tfloor["median_round_s"] if med else None
        sres["ratio_to_parallel_floor_tls"] = smed / tfloor["median_round_s"] if smed else None
    if n <= FLOWER_MAX_NODES:
        flower_need, avail = flower_memory_mb(d, n), _mem_available_mb()
        if avail is not None and flower_need > avail:
            reason = (f"Flower, {d} params x {n} nodes: needs ~{flower_need:.0f} MB (bench.p2p_throughput."
                      f"flower_memory_mb), {avail:.0f} MB available; not run")
            logger.warning("p2p throughput: skipping %s", reason)
            res["flower"] = {"ok": None, "skipped": reason}
        else:
            fl = measure_flower(out / "flower" / case, d, n, rounds, insecure, timeout=600 + 10 * n)
            res["flower"] = fl
            fmed = fl.get("median_round_s")
            res["flower_over_p2p"] = fmed / med if (fmed and med) else None
        res.update(measure_vanilla_case(out / "vanilla" / case, d, n, rounds, insecure, res))
    return res


def measure_vanilla_case(out: Path, d: int, n: int, rounds: int, insecure: bool,
                         row: Mapping[str, Any]) -> dict[str, Any]:
    """A case's vanilla Flower entries: ``vanilla`` (:func:`graphfl.bench.stock_flower.run_vector_app`,
    or ``skipped`` with the reason when :func:`flower_memory_mb` exceeds the memory available now),
    ``vanilla_over_flower`` (vanilla round / graphfl's Flower round) and ``vanilla_over_p2p``.
    """
    need, avail = flower_memory_mb(d, n), _mem_available_mb()
    if avail is not None and need > avail:
        reason = (f"vanilla Flower, {d} params x {n} nodes: needs ~{need:.0f} MB (bench.p2p_throughput."
                  f"flower_memory_mb), {avail:.0f} MB available; not run")
        logger.warning("p2p throughput: skipping %s", reason)
        return {"vanilla": {"ok": None, "skipped": reason}}
    van = measure_vanilla(out, d, n, rounds, insecure, timeout=600 + 10 * n)
    vmed = van.get("median_round_s") if van.get("ok") else None
    fmed = (row.get("flower") or {}).get("median_round_s")
    med = row.get("median_round_s")
    return {"vanilla": van, "vanilla_over_flower": vmed / fmed if (vmed and fmed) else None,
            "vanilla_over_p2p": vmed / med if (vmed and med) else None}


def measure_vanilla(out: Path, d: int, n: int, rounds: int, insecure: bool, timeout: float) -> dict[str, Any]:
    """The vanilla Flower round for the same bytes (:func:`graphfl.bench.stock_flower.run_vector_app`)."""
    return run_vector_app(out, d, n, rounds, tls=not insecure, timeout=timeout)


def case_methods(res: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A case row's share per method (``final`` metrics; ``failed`` / ``skipped`` when it has none)."""
    pfloor = res["parallel_floor"]["median_round_s"]

    def ring(r: Mapping[str, Any], name: str) -> dict[str, Any]:
        final = {"round_s": r.get("median_round_s"), "ratio_to_parallel_floor": r.get("ratio_to_parallel_floor"),
                 "wire_over_payload": r.get("wire_over_payload"), "rss_mb": r.get("rss_mb_median"),
                 "startup_s": r.get("startup_s_median")}
        ok = r.get("ok") and final["round_s"] is not None
        return {"final": final, "failed": None if ok else f"{name} ring did not finish (exit codes "
                                                          f"{r.get('exit_codes')})"}

    def floor(f: Mapping[str, Any]) -> dict[str, Any]:
        return {"final": {"round_s": f["median_round_s"], "ratio_to_parallel_floor": f["median_round_s"] / pfloor,
                          "rss_mb": f["rss_mb"], "startup_s": f["startup_s"]}}

    out = {"serial-floor": {"final": {"round_s": res["floor_s"], "ratio_to_parallel_floor": res["floor_s"] / pfloor}},
           "parallel-floor": floor(res["parallel_floor"]), "grpc": ring(res, "gRPC"),
           "socket": ring(res.get("socket") or {}, "socket")}
    if "parallel_floor_tls" in res:
        out["parallel-floor-tls"] = floor(res["parallel_floor_tls"])
    fl = res.get("flower")
    if fl is not None:
        fmed = fl.get("median_round_s")
        if fl.get("skipped"):
            out["flower"] = {"skipped": fl["skipped"]}
        else:
            out["flower"] = {"final": {"round_s": fmed, "ratio_to_parallel_floor": fmed / pfloor if fmed else None},
                             "failed": None if fl.get("ok") and fmed else
                             f"Flower run not completed: {_first_line(fl.get('error') or fl.get('run_error') or '')}"}
    van = res.get("vanilla")
    if van is not None:
        vmed = van.get("median_round_s")
        if van.get("skipped"):
            out["vanilla-flower"] = {"skipped": van["skipped"]}
        else:
            out["vanilla-flower"] = {"final": {"round_s": vmed, "ratio_to_parallel_floor": vmed / pfloor if vmed else None},
                                     "failed": None if van.get("ok") and vmed else
                                     f"vanilla Flower run not completed: {_first_line(van.get('error') or '')}"}
    return out


def _case_cell(out: Path, rounds: int, ring_rounds: int, cell: Cell) -> dict[str, Any]:
    p = cell.at
    row = measure_case(out, rounds, ring_rounds, p["params"], p["peers"], not p["tls"])
    return {"row": row, "methods": case_methods(row)}


def scale_case_skip(d: int, n: int) -> str | None:
    """Why the 128-peer case does not fit now (1.5 x ``n`` x the per-peer estimate ``60 MB + 20 x model``)."""
    per_peer = 60.0 + 20 * 4 * d / 2**20
    avail = _mem_available_mb()
    need = 1.5 * n * per_peer
    if avail is None or avail < need:
        return (f"{n} peers: needs ~{need:.0f} MB ({per_peer:.0f} MB per peer estimated, x1.5), "
                f"{avail if avail is None else round(avail)} MB available")
    return None


def declare(out: Path, seed: int, cases: Sequence[tuple[int, int, bool]], rounds: int, ring_rounds: int) -> Bench:
    """The benchmark on the harness, measurement mode; ``cases`` = ``(params, peers, insecure)``."""
    skipped = {(d, n, insecure): scale_case_skip(d, n) for d, n, insecure in cases if n == SCALE_PEERS}
    for why in skipped.values():
        if why:
            logger.warning("p2p throughput: skipping %s", why)

    def skip(cell: Cell) -> str | None:
        return skipped.get((cell.at["params"], cell.at["peers"], not cell.at["tls"]))

    return Bench(name=NAME, title="p2p exchange round vs raw floors and Flower (ring, gossip, float32)",
                 methods=METHODS, points=[{"params": d, "peers": n, "tls": not insecure} for d, n, insecure in cases],
                 seeds=[seed], metrics=METRICS, run_cell=partial(_case_cell, out, rounds, ring_rounds), joint=True,
                 methods_at=methods_at, skip=skip, pairs=PAIRS, cost=lambda c: float(c.at["peers"] * c.at["params"]),
                 cache="none")


def run(quick: bool, seed: int, out: Path, cases: Sequence[tuple[int, int, bool]] | None = None,
        form: str | None = None) -> dict[str, Any]:
    """Measure and write ``<out>/p2p_throughput.{json,md,png}``; returns the result dict.

    ``cases`` (``(params, peers, insecure)``) replaces the form's grid; ``form`` (a key of
    :data:`FORMS`) picks a named subset of the full form's cases, run with the full form's rounds.
    """
    if form is not None:
        if form not in FORMS:
            raise ValueError(f"unknown p2p-throughput form {form!r}; valid: {sorted(FORMS)}")
        if quick:
            raise ValueError("p2p-throughput: --form and --quick exclude each other (a form runs the full rounds)")
        cases = cases if cases is not None else list(FORMS[form])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = QUICK_SIZES if quick else FULL_SIZES
    peer_counts = QUICK_PEERS if quick else FULL_PEERS
    rounds = 4 if quick else 5  # Flower rounds (seconds each)
    ring_rounds = RING_ROUNDS_QUICK if quick else RING_ROUNDS_FULL  # p2p and floor rounds (milliseconds each)
    if cases is None:
        cases = [(d, n, True) for d in sizes for n in peer_counts]
        if not quick:
            cases += [(d, 4, False) for d in sizes]  # mutual TLS
            cases.append((SCALE_PARAMS, SCALE_PEERS, True))
    bench = declare(out, seed, cases, rounds, ring_rounds)
    outcome = run_bench(bench, None)
    rows = [r["row"] for r in outcome.joint.values() if "row" in r]
    skipped = [str(r["skipped"]) for r in outcome.joint.values() if r.get("skipped")]
    skipped += [r["flower"]["skipped"] for r in rows if (r.get("flower") or {}).get("skipped")]
    skipped += [r["vanilla"]["skipped"] for r in rows if (r.get("vanilla") or {}).get("skipped")]
    inproc = measure_inprocess(out / "inprocess", INPROCESS_NODES, 10 if quick else 30)
    mixing = measure_mixing()
    p2pfl = ("measured" if importlib.util.find_spec("p2pfl") is not None else
             "skipped: p2pfl is not installed (optional; it is not a graphfl dependency)")
    if p2pfl == "measured":  # pragma: no cover - not installed in CI
        p2pfl = "skipped: p2pfl is installed but its ring round is not automated in this bench"
    config = {"seed": seed, "sizes": sorted({d for d, _, _ in cases}), "peers": sorted({n for _, n, _ in cases}),
              "rounds": rounds, "ring_rounds": ring_rounds, "ring_round_measure": RING_MEASURE,
              "form": form, "topology": "ring", "algorithm": "gossip", "dtype": "float32", "cpus": os.cpu_count(),
              "malloc": ("peers and parallel-floor processes keep freed memory (graphfl.common.malloc; rows "
                         "list what each process reported); the serial floor runs in the bench process with "
                         "glibc's defaults (keeping 2n model copies there would hold GBs through the Flower runs)")}
    doc = build_doc(bench, outcome, quick, config, extra={
        "rows": rows, "inprocess": inproc, "mixing": mixing, "skipped": skipped,
        "flower": ("measured in this run: graphfl's Flower deployment (warm ClientApp workers), FedAvg on "
                   "synthetic-vector with the same parameter count, one SGD step per client; rounds 2.. median"),
        "vanilla_flower": VANILLA_DESCRIPTION,
        "p2pfl": p2pfl})
    panels = []
    for tls in sorted({not insecure for _, _, insecure in cases}):
        where = {"tls": tls}
        panels += metric_panels(doc, "round_s", "params", panel_axis="peers", where=where, logx=True,
                                ylabel="round time (s)", title="TLS" if tls else "plaintext")
    panels = [p for p in panels if p["series"]]  # a (tls, peers) pair without a case draws nothing
    for panel in panels:
        panel["logy"] = True
    write_report(out, doc, intro=render(doc).split("\n")[2:], panels=panels,
                 plot_title="p2p exchange round vs raw floors")
    return doc
