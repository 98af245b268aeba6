"""Benchmark ``deploy-perhop``: where one round of a large model spends its time in graphfl's Flower deployment.

For each model size ``d`` (float32 parameters) and ``n`` nodes, the Flower round of
:func:`graphfl.bench.p2p_throughput.measure_flower` (FedAvg on ``synthetic-vector``: ``n``
messages of ``4d`` bytes down, ``n`` up, TLS on as ``graphfl run`` starts it, warm ClientApp
workers) runs with timing hooks in every process (:mod:`bench/perhop_trace/sitecustomize.py`,
put first on ``PYTHONPATH`` for that deployment only). In the same repeat graphfl's p2p ring
moves the same bytes (:func:`graphfl.bench.p2p_throughput.measure_ring`, gRPC data path, TLS),
and the parallel raw-socket floor runs with and without TLS (:func:`parallel_floor`): their
difference is what TLS itself costs for these bytes.

**Per-hop split** (wall clock, one clock for all processes). A round is the ServerApp's
:func:`graphfl.server.rounds.run_phase` window ``[P0, P1]``. Inside it the boundaries are the
instants at which the *last* message reached each stage (a barrier view: the round ends when the
slowest message has passed every hop):

1. ``serverapp_push``: ``P0`` → end of the ServerApp's last push request
   (configure the payloads, build the Flower messages, serialise, hash, push the objects);
2. ``superlink_to_supernode``: → end of the last SuperNode's last ``Fleet/PullObject`` (the
   SuperNode's poll for the message, then one request per object);
3. ``supernode_to_worker``: → end of the last warm worker's last ``ClientAppIo/Pull*`` before it
   replies (task claim, message and objects pulled from the SuperNode);
4. ``worker_compute``: → start of the last worker's first ``ClientAppIo/Push*`` (inflate,
   deserialise, one SGD step, serialise, hash the reply);
5. ``worker_to_supernode``: → end of the last worker's last ``ClientAppIo/Push*``;
6. ``supernode_to_superlink``: → end of the last SuperNode's last ``Fleet/Push*``;
7. ``superlink_to_serverapp``: → end of the ServerApp's last ``ServerAppIo/Pull*`` (its poll,
   then one request per object);
8. ``serverapp_aggregate``: → ``P1`` (inflate, validate, FedAvg).

Each boundary is clamped to be no earlier than the previous one, so the hops sum to ``P1 - P0``;
that sum is checked against the round time graphfl's recorder wrote into ``run.json`` (an
independent clock read) and both are reported.

**Per-activity split**: exclusive seconds per round and process role of graphfl's own packing
(:func:`graphfl.common.records.pack_arrays` / ``unpack_arrays``) and of each hooked Flower
function (array serialisation ``np.save`` / deserialisation, chunking, deflate / inflate of the
message objects, SHA-256 object ids, the SuperLink's in-memory object store, object content
validation) and of the requests between the processes (caller side, by method: count, seconds,
bytes; this Flower's Fleet, ServerApp and ClientApp APIs are protobuf over HTTP/1.1, one POST
per request).

**Memory**: each Flower process's peak resident set (``VmHWM``) and its resident set just before
the first round, sampled from ``/proc`` every 0.25 s; the growth is reported per model byte and
per in-flight message.

The machine this runs on may be shared: every case is repeated (fresh deployment, fresh ring),
the median and the spread (min..max) over repeats are reported. ``run(quick, seed, out)`` writes
``<out>/deploy_perhop.{json,md}`` (after each repeat the cases measured so far, so a stopped run
keeps what it measured; at the end the full result) and keeps the traces under ``<out>/cases``;
:func:`reanalyse` recomputes the splits from them.

On the benchmark harness (:mod:`graphfl.bench.harness`) in its measurement mode (``cache="none"``):
points = the cases ``(params, nodes)``, methods = what one repeat measures (``flower``: the traced
deployment's round window; ``p2p``: the ring; ``floor-plain`` / ``floor-tls``: the parallel
floors), seeds = repeats, one **joint cell per (case, repeat)** (:func:`measure_repeat`: the four
measured together, one after the other, on the same machine state), metrics = round seconds
(each repeat's median over rounds 2..), the recorder's round and Flower / p2p, paired per repeat
``flower − p2p`` and ``floor-tls − floor-plain`` (what TLS costs). Nothing is cached across runs.
What this module adds: the traced deployment, the per-hop, per-activity and memory splits, their
median (min..max) ``summary`` per case, the ``cases`` with every repeat, and its own tables.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any

from graphfl.bench.p2p_throughput import measure_flower, measure_ring, parallel_floor
from graphfl.common.envinfo import env_info
from graphfl.common.results import markdown_table, write_json

from .harness import Bench, Cell, Metric, run_bench
from .report import build_doc, write_report

logger = logging.getLogger(__name__)

NAME = "deploy_perhop"
FULL_SIZES = (1_000_000, 10_000_000)
QUICK_SIZES = (10_000,)
FULL_NODES = 4
QUICK_NODES = 2
REPEATS = 3
ROUNDS = 3
"""Flower rounds per deployment; rounds 2.. are measured (round 1 carries the workers' first load)."""
RING_ROUNDS = 8
TRACE_CODE = Path(__file__).resolve().parent / "perhop_trace"
NOTES = ("Hooks: bench/perhop_trace/sitecustomize.py times graphfl's packing, Flower's functions and the requests "
         "between the processes (Flower's ProtobufClient: protobuf over HTTP) in every process of the deployment "
         "(a few microseconds per event, one JSON line each). Activity and request seconds are exclusive, of the "
         "thread that ran them, summed over threads and processes of a role: wall seconds can exceed the hop when "
         "threads run in parallel and include waiting for a core on a loaded machine; CPU seconds "
         "(time.thread_time) do not. The server side of each request (uvicorn in the SuperLink and SuperNodes) "
         "is not hooked.")
HOPS = ("serverapp_push", "superlink_to_supernode", "supernode_to_worker", "worker_compute",
        "worker_to_supernode", "supernode_to_superlink", "superlink_to_serverapp", "serverapp_aggregate")
ACTIVITIES = ("graphfl_pack_arrays", "graphfl_unpack_arrays", "graphfl_array_record",
              "serialise_array", "deserialise_array", "chunk_array", "deflate", "inflate", "hash_sha256",
              "object_store_put", "object_store_get", "validate_object")
ROLES = ("serverapp", "superlink", "supernode", "worker")
TITLE = "Where a Flower round's time goes (graphfl deployment, TLS, warm workers)"


class RssMonitor:
    """Samples ``VmRSS`` and ``VmHWM`` of the processes that registered in a trace folder, every ``period`` s."""

    def __init__(self, trace_dir: Path, period: float = 0.25) -> None:
        self.trace_dir, self.period = trace_dir, period
        self.samples: dict[int, list[tuple[float, float, float]]] = defaultdict(list)  # pid -> (t, rss MB, hwm MB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> RssMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            for f in self.trace_dir.glob("trace-*.jsonl"):
                pid = int(f.stem.split("-")[1])
                try:
                    text = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                vals = {ln.split(":")[0]: int(ln.split()[1]) / 1024 for ln in text.splitlines()
                        if ln.startswith(("VmRSS:", "VmHWM:"))}
                if "VmRSS" in vals and "VmHWM" in vals:
                    self.samples[pid].append((time.time(), vals["VmRSS"], vals["VmHWM"]))


def load_trace(trace_dir: Path) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """The processes (pid -> ``proc`` record) and the events of a trace folder; a cut last line is skipped."""
    procs: dict[int, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    for f in sorted(trace_dir.glob("trace-*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if ev.get("kind") == "proc":
                procs[int(ev["pid"])] = ev
            else:
                events.append(ev)
    return procs, events


def _norm(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


PUSH = ("pushmessages", "pushobject")
PULL = ("pullmessages", "pullobject")
WORKER_PULL = ("pulltaskinput", *PULL)
WORKER_PUSH = (*PUSH, "pushtaskoutput")


def _rpc(events: list[dict[str, Any]], pids: set[int], needles: tuple[str, ...]) -> list[dict[str, Any]]:
    """The caller-side requests of ``pids`` whose name (``<path>|<method>``, case, ``-`` and ``_``
    ignored) holds one of ``needles``: the process's role says which API it calls (heartbeats,
    logs and task polls are not message traffic and match none).
    """
    return [e for e in events if e["kind"] == "rpc_c" and e["pid"] in pids
            and any(n in _norm(e["name"]) for n in needles)]


def hop_split(procs: dict[int, dict[str, Any]], events: list[dict[str, Any]], p0: float, p1: float) -> dict[str, Any]:
    """Seconds of each hop of :data:`HOPS` in the round window ``[p0, p1]`` (module docstring: the boundaries).

    A boundary with no event (a hop the trace did not see) is listed in ``missing`` and takes the
    previous boundary (that hop counts 0 s).
    """
    win = [e for e in events if e.get("t0", 0) >= p0 and e.get("t1", 0) <= p1]
    by_role: dict[str, set[int]] = defaultdict(set)
    for pid, p in procs.items():
        by_role[p["role"]].add(pid)
    sapp, nodes, workers = by_role["serverapp"], by_role["supernode"], by_role["worker"]

    def last_end(calls: list[dict[str, Any]]) -> float | None:
        return max((c["t1"] for c in calls), default=None)

    w_first_push: dict[int, float] = {}
    for c in _rpc(win, workers, WORKER_PUSH):
        w_first_push[c["pid"]] = min(w_first_push.get(c["pid"], c["t0"]), c["t0"])
    w_pull = [c for c in _rpc(win, workers, WORKER_PULL) if c["t1"] <= w_first_push.get(c["pid"], p1)]
    marks = [
        last_end(_rpc(win, sapp, PUSH)),
        last_end(_rpc(win, nodes, ("pullobject",))),
        last_end(w_pull),
        max(w_first_push.values(), default=None),
        last_end(_rpc(win, workers, WORKER_PUSH)),
        last_end(_rpc(win, nodes, PUSH)),
        last_end(_rpc(win, sapp, PULL)),
        p1,
    ]
    hops: dict[str, float] = {}
    missing: list[str] = []
    prev = p0
    for name, mark in zip(HOPS, marks):
        if mark is None:
            missing.append(name)
            mark = prev
        mark = min(max(mark, prev), p1)
        hops[name] = mark - prev
        prev = mark
    return {"hops": hops, "missing": missing, "window_s": p1 - p0}


def activity_split(procs: dict[int, dict[str, Any]], events: list[dict[str, Any]], p0: float,
                   p1: float) -> dict[str, Any]:
    """Per role: exclusive seconds per activity, and per gRPC method (caller side) calls, seconds and bytes."""
    acts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    cpu: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    rpcs: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    for e in events:
        if not (e.get("t0", 0) >= p0 and e.get("t1", 0) <= p1) or e["pid"] not in procs:
            continue
        role = procs[e["pid"]]["role"]
        if e["kind"] == "act":
            acts[role][e["name"]] += e["excl"]
            if "cpu" in e:
                cpu[role][e["name"]] += e["cpu"]
        elif e["kind"] in ("rpc_c", "rpc_s"):
            side = "call" if e["kind"] == "rpc_c" else "serve"
            r = rpcs[role][f"{side} {e['name'].rsplit('|', 1)[-1].rsplit('/', 1)[-1]}"]
            r["count"] += 1
            r["seconds"] += e["t1"] - e["t0"]
            r["excl_seconds"] += e["excl"]
            if "cpu" in e:
                r["cpu_seconds"] += e["cpu"]
            r["bytes"] += (e.get("req") or 0) + (e.get("resp") or 0)
    return {"activities": {k: dict(v) for k, v in acts.items()},
            "activities_cpu": {k: dict(v) for k, v in cpu.items()},
            "rpc": {k: {m: dict(x) for m, x in v.items()} for k, v in rpcs.items()}}


def memory_split(procs: dict[int, dict[str, Any]], samples: dict[int, list[tuple[float, float, float]]],
                 first_round_t0: float, model_bytes: int, nodes: int) -> dict[str, Any]:
    """Peak RSS (``VmHWM``) and growth over the RSS before the first round, per role (the largest process)."""
    out: dict[str, Any] = {}
    model_mb = model_bytes / 2**20
    for pid, s in samples.items():
        role = procs.get(pid, {}).get("role")
        if role not in ROLES or not s:
            continue
        before = [rss for t, rss, _ in s if t <= first_round_t0]
        peak = max(h for _, _, h in s)
        base = before[-1] if before else min(rss for _, rss, _ in s)
        in_flight = nodes if role in ("superlink", "serverapp") else 1  # messages of one direction held at once
        row = {"peak_mb": peak, "before_mb": base, "growth_mb": peak - base,
               "growth_over_model": (peak - base) / model_mb,
               "growth_per_in_flight_message_over_model": (peak - base) / (model_mb * in_flight),
               "in_flight_messages": in_flight}
        if role not in out or row["peak_mb"] > out[role]["peak_mb"]:
            out[role] = row
    return out


def round_splits(trace_dir: Path, recorder: list[float]) -> list[dict[str, Any]]:
    """Per ``run_phase`` window of a trace folder: the hop and activity splits, the recorder's round seconds."""
    procs, events = load_trace(trace_dir)
    out = []
    for ph in sorted((e for e in events if e["kind"] == "phase"), key=lambda e: e["t0"]):
        r = int(ph.get("round", 0))
        split = hop_split(procs, events, ph["t0"], ph["t1"])
        split.update(activity_split(procs, events, ph["t0"], ph["t1"]))
        split["round"] = r
        split["recorder_round_s"] = recorder[r - 1] if 0 < r <= len(recorder) else None
        out.append(split)
    return out


def reanalyse(out: Path) -> dict[str, Any]:
    """Recompute every repeat's round splits from the traces kept under ``out/cases`` (memory and the
    ring as measured) and rewrite ``<out>/deploy_perhop.{json,md}``: a changed analysis needs no new run.
    """
    out = Path(out)
    doc = json.loads((out / f"{NAME}.json").read_text())
    for case in doc["cases"]:
        for k, rep in enumerate(case["repeats"]):
            trace = out / "cases" / f"{case['params']}-{case['nodes']}" / f"rep{k}" / "flower" / "trace"
            if trace.is_dir():
                rep["flower"]["rounds"] = round_splits(trace, rep["flower"].get("round_s") or [])
    doc["summary"] = [summarise(c) for c in doc["cases"]]
    if "results" in doc:  # a finished run (the harness layout); else the cases a stopped run measured
        _write_report(out, doc)
    else:
        write_json(out / f"{NAME}.json", doc)
        (out / f"{NAME}.md").write_text(render(doc))
    return doc


def profile_flower(out: Path, d: int, n: int, rounds: int, timeout: float) -> dict[str, Any]:
    """One traced Flower deployment (TLS, warm workers): its result, and per measured round the hop,
    activity and memory splits.
    """
    if not (TRACE_CODE / "sitecustomize.py").is_file():
        raise FileNotFoundError(f"{TRACE_CODE / 'sitecustomize.py'}: the timing hooks are missing (they ship with a "
                                "checkout of graphfl, not as package data); without them no hop can be split")
    trace_dir = out / "trace"
    trace_dir.mkdir(parents=True, exist_ok=True)
    saved = {k: os.environ.get(k) for k in ("GRAPHFL_PERHOP_TRACE", "PYTHONPATH")}
    os.environ["GRAPHFL_PERHOP_TRACE"] = str(trace_dir)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TRACE_CODE), *([saved["PYTHONPATH"]] if saved["PYTHONPATH"] else [])])
    try:
        with RssMonitor(trace_dir) as mon:
            fl = measure_flower(out / "run", d, n, rounds, insecure=False, timeout=timeout)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    procs, events = load_trace(trace_dir)
    phases = sorted((e for e in events if e["kind"] == "phase"), key=lambda e: e["t0"])
    fl["rounds"] = round_splits(trace_dir, fl.get("round_s") or [])
    fl["memory"] = memory_split(procs, mon.samples, phases[0]["t0"] if phases else 0.0, 4 * d, n)
    fl["roles"] = sorted({p["role"] for p in procs.values()})
    fl["hook_errors"] = [e for e in events if e["kind"] == "hook_error"]
    return fl


def _spread(values: list[float | None]) -> dict[str, float | None]:
    v = [float(x) for x in values if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": float(statistics.median(v)), "min": min(v), "max": max(v), "n": len(v)}


def _rep_median(rep: dict[str, Any], get: Any) -> float | None:
    """A repeat's median over its measured rounds 2.. (all rounds when there is only one) of ``get(round)``."""
    rounds = [r for r in rep["flower"].get("rounds", []) if r["round"] >= 2] or rep["flower"].get("rounds", [])
    vals = [get(r) for r in rounds]
    vals = [x for x in vals if x is not None]
    return float(statistics.median(vals)) if vals else None


def summarise(case: dict[str, Any]) -> dict[str, Any]:
    """Median and spread over repeats (each repeat: the median over its measured rounds 2..)."""
    reps = case["repeats"]
    rep_median = _rep_median

    s: dict[str, Any] = {"params": case["params"], "nodes": case["nodes"], "model_mb": 4 * case["params"] / 2**20}
    s["flower_round_s"] = _spread([rep_median(r, lambda x: x["window_s"]) for r in reps])
    s["recorder_round_s"] = _spread([rep_median(r, lambda x: x["recorder_round_s"]) for r in reps])
    s["p2p_round_s"] = _spread([r["ring"].get("median_round_s") for r in reps])
    s["flower_over_p2p"] = _spread([(rep_median(r, lambda x: x["window_s"]) or 0) / r["ring"]["median_round_s"]
                                    if r["ring"].get("median_round_s") else None for r in reps])
    s["floor_plain_s"] = _spread([r["floor_plain_s"] for r in reps])
    s["floor_tls_s"] = _spread([r["floor_tls_s"] for r in reps])
    s["hops"] = {h: _spread([rep_median(r, lambda x, h=h: x["hops"][h]) for r in reps]) for h in HOPS}
    acts: dict[str, Any] = {}
    for role in ROLES:
        for a in ACTIVITIES:
            sp = _spread([rep_median(r, lambda x, role=role, a=a: x["activities"].get(role, {}).get(a, 0.0))
                          for r in reps])
            if sp["median"]:
                acts[f"{role}:{a}"] = sp
    s["activities"] = acts
    cpu: dict[str, Any] = {}
    for role in ROLES:
        for a in ACTIVITIES:
            sp = _spread([rep_median(r, lambda x, role=role, a=a: x.get("activities_cpu", {}).get(role, {}).get(a)
                                     if x.get("activities_cpu") else None) for r in reps])
            if sp["median"]:
                cpu[f"{role}:{a}"] = sp
    s["activities_cpu"] = cpu
    rpc_keys = sorted({(role, m) for r in reps for rd in r["flower"].get("rounds", [])
                       for role, ms in rd["rpc"].items() for m in ms})
    s["rpc"] = {f"{role}:{m}": {k: _spread([rep_median(r, lambda x, role=role, m=m, k=k:
                                                        x["rpc"].get(role, {}).get(m, {}).get(
                                                            k, 0.0 if k != "cpu_seconds" or x.get("activities_cpu")
                                                            else None))
                                             for r in reps])["median"] for k in ("count", "seconds", "cpu_seconds", "bytes")}
                for role, m in rpc_keys if role in ROLES}
    s["memory"] = {role: {k: _spread([r["flower"].get("memory", {}).get(role, {}).get(k) for r in reps])
                          for k in ("peak_mb", "before_mb", "growth_mb", "growth_over_model",
                                    "growth_per_in_flight_message_over_model")}
                   for role in ROLES}
    s["ok"] = all(r["flower"].get("ok") and r["ring"].get("ok") for r in reps)
    return s


def _fmt(sp: dict[str, Any], digits: int = 3) -> str:
    if sp.get("median") is None:
        return "-"
    return f"{sp['median']:.{digits}f} ({sp['min']:.{digits}f}..{sp['max']:.{digits}f})"


def render(doc: dict[str, Any]) -> str:
    """The Markdown report of a result dict (what :func:`run` writes)."""
    parts = [f"# {TITLE}\n\n"
             f"{doc['config']['repeats']} repeats per case (fresh deployment and ring each); every cell is the "
             "median over repeats of the per-repeat median over rounds 2.., with (min..max) over repeats. "
             f"Machine: {doc['config']['cpus']} CPUs, shared (load average at start "
             f"{doc['config'].get('loadavg')}).\n"]
    for s in doc["summary"]:
        hops = [[h, _fmt(s["hops"][h]), (f"{100 * s['hops'][h]['median'] / s['flower_round_s']['median']:.0f}%"
                                         if s["hops"][h]["median"] is not None and s["flower_round_s"]["median"]
                                         else "-")] for h in HOPS]
        hop_sum = sum(s["hops"][h]["median"] or 0 for h in HOPS)
        parts.append(
            f"\n## {s['params']:,} parameters ({s['model_mb']:.1f} MB) x {s['nodes']} nodes\n\n"
            f"Flower round {_fmt(s['flower_round_s'])} s (recorder: {_fmt(s['recorder_round_s'])} s); "
            f"p2p ring, same bytes, same run: {_fmt(s['p2p_round_s'])} s; **Flower / p2p "
            f"{_fmt(s['flower_over_p2p'], 1)}x**. Raw-socket parallel floor {_fmt(s['floor_plain_s'])} s plain, "
            f"{_fmt(s['floor_tls_s'])} s TLS.\n\n### Per hop (wall clock, seconds)\n\n"
            + markdown_table(columns=["hop", "s median (min..max)", "share of round"], rows=hops)
            + f"\n\nSum of hop medians {hop_sum:.3f} s.\n\n"
            "### Per activity (exclusive wall seconds of the calls per round, waiting for a core included)\n\n"
            + markdown_table(columns=["role:activity", "s median (min..max)"],
                             rows=[[k, _fmt(v)] for k, v in sorted(s["activities"].items(),
                                                                   key=lambda kv: -(kv[1]["median"] or 0))])
            + "\n\n### Per activity, CPU seconds of the thread (``time.thread_time``, exclusive; the "
            "repeats that recorded it)\n\n"
            + markdown_table(columns=["role:activity", "CPU s median (min..max)", "repeats"],
                             rows=[[k, _fmt(v), v["n"]] for k, v in sorted(s.get("activities_cpu", {}).items(),
                                                                          key=lambda kv: -(kv[1]["median"] or 0))])
            + "\n\n### Requests per round between the processes (caller side; protobuf over HTTP; medians)\n\n"
            + markdown_table(columns=["role:method", "requests", "seconds (summed over threads)", "s per request",
                                      "caller CPU s", "MB"],
                             rows=[[k, v["count"], v["seconds"],
                                    v["seconds"] / v["count"] if v["count"] and v["seconds"] is not None else None,
                                    v.get("cpu_seconds"),
                                    (v["bytes"] or 0) / 2**20]
                                   for k, v in sorted(s["rpc"].items(), key=lambda kv: -(kv[1]["seconds"] or 0))])
            + "\n\n### Memory (peak RSS and its growth over the RSS before round 1)\n\n"
            + markdown_table(columns=["role", "peak MB", "before MB", "growth MB", "growth / model bytes",
                                      "growth / (model x in-flight messages)"],
                             rows=[[role, _fmt(m["peak_mb"], 0), _fmt(m["before_mb"], 0), _fmt(m["growth_mb"], 0),
                                    _fmt(m["growth_over_model"], 1),
                                    _fmt(m["growth_per_in_flight_message_over_model"], 1)]
                                   for role, m in s["memory"].items()])
            + "\n")
    parts.append(f"\n{doc['notes']}\n")
    return "".join(parts)


METHODS = ("flower", "p2p", "floor-plain", "floor-tls")
METRICS = (Metric("round_s", "round s", fmt=".4f"),
           Metric("recorder_round_s", "recorder round s", fmt=".4f", paired=False),
           Metric("flower_over_p2p", "Flower / p2p", fmt=".2f", paired=False))
PAIRS = (("flower", "p2p"), ("floor-tls", "floor-plain"))


def repeat_methods(rep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A repeat's share per method (:data:`METRICS`; ``failed`` when a run did not complete)."""
    fl, ring = rep["flower"], rep["ring"]
    window = _rep_median(rep, lambda x: x["window_s"])
    p2p = ring.get("median_round_s")
    return {"flower": {"final": {"round_s": window, "recorder_round_s": _rep_median(rep, lambda x: x["recorder_round_s"]),
                                 "flower_over_p2p": window / p2p if window and p2p else None},
                       "failed": None if fl.get("ok") and window is not None else
                       f"Flower run not completed: {fl.get('error') or 'no round traced'}"},
            "p2p": {"final": {"round_s": p2p},
                    "failed": None if ring.get("ok") and p2p else f"ring did not finish (exit codes "
                                                                  f"{ring.get('exit_codes')})"},
            "floor-plain": {"final": {"round_s": rep["floor_plain_s"]}},
            "floor-tls": {"final": {"round_s": rep["floor_tls_s"]}}}


def measure_repeat(out: Path, cert_dir: Path, rounds: int, done: list[tuple[dict[str, Any], int, dict[str, Any]]],
                   write: Any, cell: Cell) -> dict[str, Any]:
    """Repeat ``cell.seed`` of case ``cell.at``: the traced Flower deployment, the ring, both floors, now.

    Appends the repeat to ``done`` and calls ``write()`` (the cases measured so far on disk).
    """
    d, n, k = cell.at["params"], cell.at["nodes"], cell.seed
    folder = out / "cases" / f"{d}-{n}" / f"rep{k}"
    logger.info("deploy-perhop: %d params x %d nodes, repeat %d", d, n, k + 1)
    fl = profile_flower(folder / "flower", d, n, rounds, timeout=600 + 10 * n)
    ring = measure_ring(folder / "ring", d, n, RING_ROUNDS, insecure=False, timeout=600 + 10 * n)
    plain = parallel_floor(d, n, rounds=5)
    tls = parallel_floor(d, n, rounds=5, cert_dir=cert_dir)
    rep = {"flower": fl, "ring": {k2: v for k2, v in ring.items() if k2 != "round_s"},
           "floor_plain_s": plain["median_round_s"], "floor_tls_s": tls["median_round_s"]}
    done.append((dict(cell.at), k, rep))
    write()  # a stopped run keeps what it measured
    return {"repeat": rep, "methods": repeat_methods(rep)}


def _cases(done: list[tuple[dict[str, Any], int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The measured repeats grouped by case, in order: ``{params, nodes, repeats}``."""
    cases: dict[tuple[int, int], dict[str, Any]] = {}
    for at, _k, rep in done:
        key = (at["params"], at["nodes"])
        cases.setdefault(key, {"params": key[0], "nodes": key[1], "repeats": []})["repeats"].append(rep)
    return list(cases.values())


def run(quick: bool, seed: int, out: Path, sizes: tuple[int, ...] | None = None, nodes: int | None = None,
        repeats: int | None = None, rounds: int | None = None) -> dict[str, Any]:
    """Measure and write ``<out>/deploy_perhop.{json,md}``; returns the result dict.

    Quick form: 10k parameters x 2 nodes, one repeat. ``sizes``, ``nodes``, ``repeats``,
    ``rounds`` override the form's grid.
    """
    from graphfl.common.certs import generate_tls

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = sizes or (QUICK_SIZES if quick else FULL_SIZES)
    n = nodes or (QUICK_NODES if quick else FULL_NODES)
    repeats = repeats or (1 if quick else REPEATS)
    rounds = rounds or ROUNDS
    cert_dir = out / "floor-certs"
    generate_tls(cert_dir)
    done: list[tuple[dict[str, Any], int, dict[str, Any]]] = []

    def write() -> None:
        _write(out, _cases(done), quick, seed, sizes, n, repeats, rounds)

    bench = Bench(name=NAME, title=TITLE, methods=METHODS, points=[{"params": d, "nodes": n} for d in sizes],
                  seeds=list(range(repeats)), metrics=METRICS,
                  run_cell=partial(measure_repeat, out, cert_dir, rounds, done, write), joint=True, pairs=PAIRS,
                  cost=lambda c: float(c.at["params"] * c.at["nodes"]), cache="none")
    outcome = run_bench(bench, None)
    cases = _cases(done)
    doc = build_doc(bench, outcome, quick, _config(quick, seed, sizes, n, repeats, rounds), extra={
        "hops": list(HOPS), "cases": cases, "summary": [summarise(c) for c in cases], "notes": NOTES})
    _write_report(out, doc)
    return doc


def _config(quick: bool, seed: int, sizes: tuple[int, ...], n: int, repeats: int, rounds: int) -> dict[str, Any]:
    return {"quick": quick, "seed": seed, "sizes": list(sizes), "nodes": n, "repeats": repeats,
            "rounds": rounds, "ring_rounds": RING_ROUNDS, "tls": True, "clientapp_mode": "warm",
            "cpus": os.cpu_count(), "loadavg": os.getloadavg()}


def _write_report(out: Path, doc: dict[str, Any]) -> None:
    """``<out>/deploy_perhop.{json,md}`` of a harness result: the common tables, then :func:`render`'s."""
    text = render(doc).split("\n")
    write_report(out, doc, intro=text[2:3], sections=text[3:])


def _write(out: Path, cases: list[dict[str, Any]], quick: bool, seed: int, sizes: tuple[int, ...], n: int,
           repeats: int, rounds: int) -> dict[str, Any]:
    """Write ``<out>/deploy_perhop.{json,md}`` for the cases measured so far while the run goes on (this
    layout: ``cases`` and ``summary``, no harness tables); returns the document.
    """
    doc = {"name": NAME, "config": _config(quick, seed, sizes, n, repeats, rounds),
           "hops": list(HOPS), "cases": cases, "summary": [summarise(c) for c in cases],
           "notes": NOTES,
           "env": env_info()}
    write_json(out / f"{NAME}.json", doc)
    (out / f"{NAME}.md").write_text(render(doc))
    return doc
