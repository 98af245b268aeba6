"""Benchmark ``deploy``: round times of graphfl warm vs graphfl cold vs a vanilla Flower App.

Four variants run the same experiment (``graphfl run``'s default: FedAvg on ``digits``, 4
SuperNodes, 3 rounds of 50 local SGD steps, on 127.0.0.1 with TLS), each on its own freshly
started federation of real ``flower-superlink`` / SuperNode processes:

``graphfl-warm``
    graphfl's default: SuperNodes hand their ClientApp tasks to one long-lived worker each
    (:mod:`graphfl.deploy.warm`), Flower's SuperNode poll sleeps removed.
``graphfl-warm-stocklink``
    ``graphfl-warm`` on the stock ``flower-superlink`` (every request through all nine of its
    middlewares) instead of graphfl's path-gated SuperLink (:mod:`graphfl.deploy.superlink`).
``graphfl-cold``
    ``--clientapp-mode cold``: stock ``flower-supernode``; one ``flwr-clientapp`` process per message.
``vanilla-flower``
    A minimal Flower App written into the output folder at run time: ``flwr.serverapp.strategy.FedAvg``
    (stock ``start()``: ``Grid.send_and_receive``, a training and an evaluation exchange per
    round) and a ClientApp training the same MLP on the same digits partitions with the same
    local SGD (graphfl's task, model and ``sgd_steps``), on a stock SuperLink and SuperNodes with Flower's
    default SuperExec poll interval (1 s; graphfl sets 0.1 s).

Repetitions are interleaved (the order of the variants rotates), ``--quick`` runs 3 of them, the
full form 5 and adds two variants that show what each change buys alone:
``graphfl-warm-stockpolls`` (warm workers, Flower's 3 s / 0.5 s SuperNode sleeps kept) and
``graphfl-cold-fastpolls`` (per-message ClientApp processes, short SuperNode polls).

Measured (seconds; mean ± sd over repetitions, each repetition's value the median over rounds):
*round* (graphfl: one exchange, training with the evaluation piggy-backed; vanilla: its training
plus evaluation exchange, and the training exchange alone), *join* (graphfl's round 0: clients
report and evaluate the initial model; vanilla has none, its first round carries the wait for
nodes), *final evaluation*, final test accuracy. The split of a graphfl round, from the graphfl
side: *ClientApp start* (``client_boot_seconds``: process start or, warm, task claim -> handler),
*handler* (``client_seconds``), and the rest (*transport*: message pickup + reply, polls, server);
warm traces (``logs/warm-<i>.jsonl``) and the server's exchange trace (``logs/exchange.jsonl``)
split the rest further into *server push* (ServerApp -> SuperLink), *pickup* (message created on
the server -> task claimed), *reply push* (ClientApp -> SuperNode) and *reply to server*
(SuperNode -> SuperLink -> ServerApp pull).

``run(quick, seed, out)`` writes ``<out>/deploy.{json,md,png}``; each run's own files stay under
``<out>/runs/``.

On the benchmark harness (:mod:`graphfl.bench.harness`) in its measurement mode (``cache="none"``):
methods = the variants, one point (the experiment: nodes, rounds), seeds = repetitions (every
repetition runs the experiment with the run's seed), one **joint cell per repetition**
(:func:`measure_repetition`: every variant of a repetition on its own federation, one after the
other, the order rotated per repetition, so that load falls on every variant alike), metrics =
the timings above (each repetition's median over rounds) and the round time over graphfl-warm's
in the same repetition, paired per repetition against ``graphfl-warm``. Nothing is cached across
runs: a repetition's numbers belong to the machine's state while it ran. What this module adds:
the variants' runs, the warm-trace split, the worker-model probe, and its own tables
(``summary``, ``ratios_vs_warm``, ``repetitions``, ``worker_models`` beside the harness layout).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from graphfl.common.config import parse_run_config
from graphfl.common.results import markdown_table

from .harness import Bench, Cell, Metric, run_bench
from .report import build_doc, write_report
from .stock_flower import STATUS_EVERY, TIMED_FEDAVG, run_app, write_app

logger = logging.getLogger(__name__)

NAME = "deploy"
BASE_CONFIG: dict[str, Any] = {"strategy": "fedavg", "task": "digits", "nodes": 4, "rounds": 3,
                               "engine": "local-deployment"}
VARIANTS_QUICK = ("graphfl-warm", "graphfl-warm-stocklink", "graphfl-cold", "vanilla-flower")
VARIANTS_FULL = (*VARIANTS_QUICK, "graphfl-warm-stockpolls", "graphfl-cold-fastpolls")
GRAPHFL_VARIANTS: dict[str, tuple[str, str | None, str]] = {
    # variant -> (clientapp mode, SuperNode polls, SuperLink middleware)
    "graphfl-warm": ("warm", None, "gated"),
    "graphfl-warm-stocklink": ("warm", None, "stock"),
    "graphfl-cold": ("cold", None, "gated"),
    "graphfl-warm-stockpolls": ("warm", "stock", "gated"),
    "graphfl-cold-fastpolls": ("cold", "fast", "gated"),
}

# ------------------------------------------------------------------------------------------
# the vanilla Flower App (written at run time, not a package of graphfl)
# ------------------------------------------------------------------------------------------
VANILLA_SERVER = '''"""Vanilla Flower ServerApp: stock FedAvg; only timestamps are added around its hooks."""

import json
import time

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

app = ServerApp()

''' + TIMED_FEDAVG + '''

@app.main()
def main(grid: Grid, context: Context) -> None:
    from vanillafl.task import make_model

    cfg = context.run_config
    n = int(cfg["nodes"])
    t0 = time.time()
    strategy = TimedFedAvg(fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=n,
                           min_evaluate_nodes=n, min_available_nodes=n)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(make_model(int(cfg["seed"])).state_dict()),
                   num_rounds=int(cfg["num-server-rounds"]), train_config=ConfigRecord({"lr": float(cfg["lr"])}))
    doc = {"start": t0, "end": time.time(), "times": strategy.times, "metrics": strategy.metrics}
    with open(str(cfg["out-file"]), "w") as fh:
        json.dump(doc, fh)
'''

VANILLA_CLIENT = '''"""Vanilla Flower ClientApp: the same MLP, digits partition and local SGD as graphfl's FedAvg client."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


def _load(msg, context):
    import torch

    from vanillafl.task import client_data, make_model

    torch.set_num_threads(1)
    cfg = context.run_config
    pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    model = make_model(int(cfg["seed"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    return cfg, pid, model, client_data(int(cfg["seed"]), pid, n)


@app.train()
def train(msg: Message, context: Context) -> Message:
    from graphfl.client.training import sgd_steps
    from graphfl.tasks.partition import client_rng

    cfg, pid, model, (task, data) = _load(msg, context)
    server_round = int(msg.content["config"]["server-round"])
    loss = sgd_steps(model, data, task.loss_fn(), int(cfg["local-steps"]), int(cfg["batch-size"]), float(cfg["lr"]),
                     client_rng(int(cfg["seed"]), 3, pid, server_round))
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"train_loss": float(loss), "num-examples": int(data.num_train)})})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    from graphfl.client.training import evaluate_model

    cfg, pid, model, (task, data) = _load(msg, context)
    m = evaluate_model(model, data.x_test, data.y_test, task.loss_fn(), True)
    metrics = MetricRecord({"test_loss": float(m["test_loss"]), "test_acc": float(m["test_acc"]),
                            "num-examples": int(len(data.y_test))})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
'''

VANILLA_TASK = '''"""The task: graphfl's digits task (model and Dirichlet partition), as any app could import it."""


def make_model(seed):
    from graphfl.tasks import registry

    return registry.create("digits", seed=seed).build_model()


def client_data(seed, pid, n):
    from graphfl.tasks import registry

    task = registry.create("digits", seed=seed)
    return task, task.client_data(pid, n)
'''


def write_vanilla_app(path: Path, cfg: dict[str, Any]) -> Path:
    """Write the vanilla Flower App (``pyproject.toml`` + package ``vanillafl``) into ``path``."""
    return write_app(path, "vanillafl", {"server_app": VANILLA_SERVER, "client_app": VANILLA_CLIENT,
                                         "task": VANILLA_TASK},
                     {"num-server-rounds": int(cfg["rounds"]), "nodes": int(cfg["nodes"]), "seed": int(cfg["seed"]),
                      "local-steps": int(cfg["local-steps"]), "batch-size": int(cfg["batch-size"]),
                      "lr": float(cfg["lr"]), "out-file": ""},
                     doc="Vanilla Flower App for graphfl bench deploy.")


# ------------------------------------------------------------------------------------------
# one repetition of one variant
# ------------------------------------------------------------------------------------------
def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else None


def run_graphfl(variant: str, out: Path, seed: int, rounds: int) -> dict[str, Any]:
    """One graphfl run (``graphfl run`` defaults) in ``variant``'s mode; its timings."""
    from graphfl.deploy.federation import LocalFederation
    from graphfl.deploy.run import prepare, write_overrides
    from graphfl.server.flower_app import write_app_dir

    mode, polls, middleware = GRAPHFL_VARIANTS[variant]
    cfg, out = prepare(parse_run_config({**BASE_CONFIG, "rounds": rounds, "seed": seed, "out-dir": str(out)}))
    t_fed = time.perf_counter()
    with LocalFederation(out, cfg.nodes, tls=True, start_timeout=cfg.connect_timeout, clientapp_mode=mode,
                         polls=polls, device=cfg.device, superlink_middleware=middleware) as fed:
        startup = time.perf_counter() - t_fed
        sub = fed.submitter()
        handle = sub.submit(write_app_dir(out / "app"), write_overrides(out / "run-config.toml", cfg), out)
        t_run = time.perf_counter()
        sub.wait(handle, timeout=cfg.connect_timeout + (cfg.rounds + 2) * cfg.round_timeout, health=fed.health,
                 status_every=2.0)
        wall = time.perf_counter() - t_run
    doc = json.loads((out / "run.json").read_text())
    curve = doc["methods"]["fedavg"]["curve"]
    rows = [r for r in curve if r["round"] >= 1]
    res: dict[str, Any] = {
        "variant": variant, "federation_start": startup, "wall": wall,
        "join": curve[0]["seconds"], "rounds": [r["seconds"] for r in rows],
        "final_eval": rows[-1].get("eval_seconds"), "test_acc": rows[-1].get("test_acc"),
        "boot": [r.get("client_boot_seconds") for r in rows], "handler": [r.get("client_seconds") for r in rows],
    }
    if mode == "warm":
        res.update(_warm_split(out, cfg.nodes, len(rows)))
    return res


def _warm_split(out: Path, nodes: int, rounds: int) -> dict[str, Any]:
    """Per round (1..R), medians over nodes, from the warm traces and the server's exchange trace:
    *server push* (exchange start -> all messages at the SuperLink), *pickup* (message created ->
    task claimed), *reply push* (handler end -> reply at the SuperNode) and *reply to server*
    (reply at the SuperNode -> pulled by the ServerApp: SuperNode push, SuperLink, ServerApp polls).
    """
    from graphfl.server.flower_adapter import EXCHANGE_TRACE

    pickup: list[list[float]] = [[] for _ in range(rounds)]
    reply: list[list[float]] = [[] for _ in range(rounds)]
    to_server: list[list[float]] = [[] for _ in range(rounds)]
    trace = out / "logs" / EXCHANGE_TRACE
    exchanges = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()] if trace.is_file() else []
    train = [e for e in exchanges if e.get("kind") == "train"]
    for i in range(nodes):
        path = out / "logs" / f"warm-{i}.jsonl"
        tasks = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
        for r, t in enumerate(tasks[1:rounds + 1]):          # task 0 is the join, the last the final evaluation
            times = t.get("times", {})
            if "created_at" in t and "acquired" in times:
                pickup[r].append(times["acquired"] - t["created_at"])
            if "handler" in times and "output" in times:
                reply[r].append(times["output"] - times["handler"])
            pulled = train[r]["pulled"].get(str(i)) if r < len(train) else None
            if pulled is not None and "output" in times:
                to_server[r].append(pulled - times["output"])
    return {"server_push": [e["pushed"] - e["start"] for e in train[:rounds]],
            "pickup": [_median(p) for p in pickup], "reply_push": [_median(p) for p in reply],
            "reply_to_server": [_median(p) for p in to_server]}


VANILLA_STATUS_EVERY = STATUS_EVERY
"""Seconds between `flwr list` status checks of a vanilla run (its rounds time themselves)."""


def run_vanilla(out: Path, seed: int, rounds: int) -> dict[str, Any]:
    """One run of the vanilla Flower App on stock SuperNodes (:func:`graphfl.bench.stock_flower.run_app`); its timings."""
    defaults = parse_run_config({**BASE_CONFIG, "rounds": rounds, "seed": seed})
    app_cfg = {"rounds": rounds, "nodes": defaults.nodes, "seed": seed, "local-steps": defaults.train.local_steps,
               "batch-size": defaults.train.batch_size, "lr": defaults.train.lr}
    out.mkdir(parents=True, exist_ok=True)
    app = write_vanilla_app(out / "vanilla-app", app_cfg)
    doc = run_app(out, app, defaults.nodes, tls=True, start_timeout=defaults.connect_timeout,
                  run_timeout=60 + rounds * 300)
    times = {int(k): v for k, v in doc["times"].items()}
    rs = sorted(times)
    return {
        "variant": "vanilla-flower", "federation_start": doc["federation_start"], "wall": doc["wall"],
        "rounds": [times[r]["eval_replies"] - times[r]["train_start"] for r in rs],
        "train_exchange": [times[r]["train_replies"] - times[r]["train_start"] for r in rs],
        "eval_exchange": [times[r]["eval_replies"] - times[r]["eval_start"] for r in rs],
        "first_round": times[rs[0]]["eval_replies"] - doc["start"],
        "test_acc": doc["metrics"].get(str(rs[-1]), {}).get("test_acc"),
    }


# ------------------------------------------------------------------------------------------
# worker models: fork-per-message zygote vs persistent worker vs fresh process (no Flower)
# ------------------------------------------------------------------------------------------
PROBE_SETUP = """
import json, os, sys, time
t0 = time.perf_counter()
import torch
import numpy as np
from graphfl.client.handler import build_runtime, handle
from graphfl.common.config import parse_run_config
from graphfl.common.types import Payload
cfg = parse_run_config({"task": "digits", "nodes": 4})
import_s = time.perf_counter() - t0

def serve(r):
    t = time.perf_counter()
    torch.set_num_threads(1)
    rt = build_runtime(cfg, r % 4, 4)
    model = rt.ctx.task.build_model()
    arrays = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    handle(rt, "train", r + 1, Payload(arrays, {}), {}, True)
    return time.perf_counter() - t
"""

PROBE_MODELS = {
    # a zygote imports everything but runs no torch op (a child of a process with started
    # OpenMP/CUDA threads is unsafe); each message is served by a fork of it
    "zygote": PROBE_SETUP + """
out = []
for r in range(int(sys.argv[1])):
    rd, wr = os.pipe()
    t = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        started = time.perf_counter() - t
        h = serve(r)
        os.write(wr, json.dumps({"start": started, "handler": h, "end": time.perf_counter()}).encode())
        os._exit(0)
    os.close(wr)
    doc = json.loads(os.read(rd, 65536))
    os.waitpid(pid, 0)
    doc["exit"] = time.perf_counter() - doc.pop("end")
    out.append(doc)
print(json.dumps({"import": import_s, "messages": out}))
""",
    # one process serves every message
    "persistent": PROBE_SETUP + """
out = [{"start": 0.0, "handler": serve(r), "exit": 0.0} for r in range(int(sys.argv[1]))]
print(json.dumps({"import": import_s, "messages": out}))
""",
}


def probe_worker_models(messages: int = 6) -> dict[str, Any]:
    """Serve ``messages`` graphfl train messages (digits, eval first) per model and time them:
    ``zygote`` (fork per message from a process that imported torch and graphfl, no torch op run),
    ``persistent`` (one process), ``fresh`` (a new Python process per message, as stock Flower).
    No Flower transport here: only what differs between the models.
    """
    import subprocess
    import sys

    out: dict[str, Any] = {}
    for name, code in PROBE_MODELS.items():
        proc = subprocess.run([sys.executable, "-c", code, str(messages)], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            out[name] = {"error": proc.stderr[-2000:]}
            continue
        out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    fresh = []
    for _ in range(min(messages, 3)):
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", PROBE_MODELS["persistent"], "1"], capture_output=True, text=True,
                              timeout=600)
        total = time.perf_counter() - t
        if proc.returncode == 0:
            inner = json.loads(proc.stdout.strip().splitlines()[-1])
            m = inner["messages"][0]
            fresh.append({"start": inner["import"], "handler": m["handler"],
                          "exit": max(0.0, total - inner["import"] - m["handler"])})
    out["fresh"] = {"messages": fresh}
    for doc in out.values():
        msgs = doc.get("messages") or []
        later = msgs[1:] or msgs
        doc["summary"] = {k: _median([m[k] for m in later]) for k in ("start", "handler", "exit")}
        doc["summary"]["first_handler"] = msgs[0]["handler"] if msgs else None
    return out


# ------------------------------------------------------------------------------------------
# the benchmark
# ------------------------------------------------------------------------------------------
def _stats(values: list[float | None]) -> dict[str, float | None]:
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"mean": None, "sd": None, "n": 0}
    return {"mean": statistics.fmean(vals), "sd": statistics.stdev(vals) if len(vals) > 1 else 0.0, "n": len(vals)}


def _per_rep(reps: list[dict[str, Any]], key: str, rounds_only: bool = True) -> list[float | None]:
    """Each repetition's median over rounds of ``key`` (a per-round list) or its scalar ``key``."""
    out: list[float | None] = []
    for rep in reps:
        value = rep.get(key)
        out.append(_median(value) if isinstance(value, list) else value)
    return out


def summarize(reps: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Mean ± sd over repetitions of each variant's timings (per-round values: median over rounds first)."""
    keys = ("rounds", "join", "final_eval", "boot", "handler", "server_push", "pickup", "reply_push",
            "reply_to_server", "train_exchange",
            "eval_exchange", "first_round", "test_acc", "federation_start", "wall")
    summary: dict[str, dict[str, Any]] = {}
    for variant, runs in reps.items():
        summary[variant] = {k: _stats(_per_rep(runs, k)) for k in keys if any(k in r for r in runs)}
        if "rounds" in summary[variant] and "boot" in summary[variant] and "handler" in summary[variant]:
            rest = []
            for r in runs:
                rr, bb, hh = _median(r["rounds"]), _median(r["boot"]), _median(r["handler"])
                rest.append(None if None in (rr, bb, hh) else rr - bb - hh)   # type: ignore[operator]
            summary[variant]["transport"] = _stats(rest)
    return summary


def ratios(reps: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per repetition (same interleaved run): round time of each other variant / graphfl-warm's."""
    out: dict[str, dict[str, Any]] = {}
    warm = reps.get("graphfl-warm", [])
    for variant, runs in reps.items():
        if variant == "graphfl-warm":
            continue
        vals = []
        for w, o in zip(warm, runs):
            wr, orr = _median(w["rounds"]), _median(o["rounds"])
            if wr and orr:
                vals.append(orr / wr)
        out[variant] = {"per_rep": vals, **_stats(list(vals))}
    return out


def _fmt(st: dict[str, Any] | None, digits: int = 2) -> str:
    if not st or st.get("mean") is None:
        return "–"
    return f"{st['mean']:.{digits}f} ± {st['sd']:.{digits}f}"


METRICS = (Metric("round_s", "round s", fmt=".3f"),
           Metric("round_over_warm", "round / graphfl-warm", fmt=".2f", paired=False),
           Metric("join_s", "join s", fmt=".3f"),
           Metric("final_eval_s", "final eval s", fmt=".3f"),
           Metric("test_acc", "test acc", lower_is_better=False, fmt=".4f"),
           Metric("boot_s", "ClientApp start s", fmt=".3f"),
           Metric("handler_s", "handler s", fmt=".3f"),
           Metric("transport_s", "transport s", fmt=".3f"),
           Metric("train_exchange_s", "vanilla train exchange s", fmt=".3f", paired=False),
           Metric("eval_exchange_s", "vanilla eval exchange s", fmt=".3f", paired=False),
           Metric("first_round_s", "vanilla first round s", fmt=".3f", paired=False),
           Metric("federation_start_s", "federation start s", fmt=".1f"))
"""Per variant and repetition: each per-round timing's median over rounds (transport = round - start - handler)."""
REFERENCE = "graphfl-warm"


def variant_final(res: dict[str, Any], warm_round: float | None) -> dict[str, Any]:
    """One repetition's metrics of a variant (:data:`METRICS`) from its run's timings."""
    rnd, boot, handler = _median(res["rounds"]), _median(res.get("boot") or []), _median(res.get("handler") or [])
    return {"round_s": rnd, "round_over_warm": rnd / warm_round if rnd and warm_round else None,
            "join_s": res.get("join"), "final_eval_s": res.get("final_eval"), "test_acc": res.get("test_acc"),
            "boot_s": boot, "handler_s": handler,
            "transport_s": None if None in (rnd, boot, handler) else rnd - boot - handler,  # type: ignore[operator]
            "train_exchange_s": _median(res.get("train_exchange") or []),
            "eval_exchange_s": _median(res.get("eval_exchange") or []),
            "first_round_s": res.get("first_round"), "federation_start_s": res.get("federation_start")}


def measure_repetition(out: Path, seed: int, rounds: int, variants: tuple[str, ...], say: Callable[[str], None],
                       repetitions: int, cell: Cell) -> dict[str, Any]:
    """Repetition ``cell.seed``: every variant on its own fresh federation, the order rotated by the repetition."""
    k = cell.seed
    order = variants[k % len(variants):] + variants[:k % len(variants)]
    runs: dict[str, dict[str, Any]] = {}
    for variant in order:
        where = out / "runs" / f"{variant}-{k}"
        say(f"repetition {k + 1}/{repetitions}: {variant}")
        res = run_vanilla(where, seed, rounds) if variant == "vanilla-flower" else run_graphfl(variant, where, seed, rounds)
        res["repetition"] = k
        runs[variant] = res
        say("  rounds " + ", ".join(f"{x:.2f}" for x in res["rounds"]) + " s")
    warm = _median(runs[REFERENCE]["rounds"]) if REFERENCE in runs else None
    return {"order": list(order), "runs": runs,
            "methods": {v: {"final": variant_final(r, warm),
                            "curve": [{"round": i + 1, "seconds": x} for i, x in enumerate(r["rounds"])]}
                        for v, r in runs.items()}}


def declare(out: Path, seed: int, rounds: int, variants: tuple[str, ...], repetitions: int,
            say: Callable[[str], None]) -> Bench:
    """The benchmark on the harness, measurement mode: one joint cell per repetition."""
    return Bench(name=NAME, title=f"bench deploy: round times of graphfl warm / cold vs vanilla Flower "
                                  f"({BASE_CONFIG['strategy']} on {BASE_CONFIG['task']})",
                 methods=variants, points=[{"nodes": int(BASE_CONFIG["nodes"]), "rounds": rounds}],
                 seeds=list(range(repetitions)), metrics=METRICS,
                 run_cell=partial(measure_repetition, out, seed, rounds, variants, say, repetitions), joint=True,
                 pairs=[(v, REFERENCE) for v in variants if v != REFERENCE] if REFERENCE in variants else [],
                 curve_keys=("seconds",), curve_sd_keys=("seconds",), cache="none")


def run(quick: bool = False, seed: int = 0, out: Path | None = None,
        progress: Callable[[str], None] | None = None, variants: tuple[str, ...] | None = None,
        repetitions: int | None = None, rounds: int | None = None) -> dict[str, Any]:
    """Run the benchmark; write ``<out>/deploy.{json,md,png}``; return the document.

    ``variants``, ``repetitions``, ``rounds`` replace the form's (a small case for a check).
    """
    out = Path(out or "runs/bench-deploy").resolve()
    out.mkdir(parents=True, exist_ok=True)
    variants = tuple(variants or (VARIANTS_QUICK if quick else VARIANTS_FULL))
    unknown = [v for v in variants if v != "vanilla-flower" and v not in GRAPHFL_VARIANTS]
    if unknown:
        raise ValueError(f"unknown deploy variants {unknown}; valid: {[*GRAPHFL_VARIANTS, 'vanilla-flower']}")
    repetitions = repetitions or (3 if quick else 5)
    rounds = rounds or int(BASE_CONFIG["rounds"])
    say = progress or (lambda text: logger.info("%s", text))
    bench = declare(out, seed, rounds, variants, repetitions, say)
    outcome = run_bench(bench, None)
    reps: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for k in range(repetitions):
        for v, res in outcome.joint[(tuple(bench.points[0].items()), k)]["runs"].items():
            reps[v].append(res)
    summary = summarize(reps)
    say("worker models: zygote vs persistent vs fresh process")
    models = probe_worker_models(4 if quick else 8)
    config = {**BASE_CONFIG, "rounds": rounds, "seed": seed, "repetitions": repetitions, "variants": list(variants),
              "quick": quick, "interleaved": True,
              "repeats": "each repetition runs every variant with the run's seed, the order rotated by one per "
                         "repetition; a metric is the repetition's median over rounds"}
    doc = build_doc(bench, outcome, quick, config, extra={
        "summary": summary, "ratios_vs_warm": ratios(reps), "repetitions": reps, "worker_models": models})
    text = render(doc).split("\n")
    write_report(out, doc, intro=text[2:3], sections=text[4:text.index("## Environment")], panels=_panels(doc),
                 plot_title="graphfl bench deploy")
    return doc


def render(doc: dict[str, Any]) -> str:
    """The Markdown report."""
    s, cfg = doc["summary"], doc["config"]
    lines = [f"# bench deploy ({'quick' if cfg['quick'] else 'full'})", "",
             f"`graphfl run` defaults: {cfg['strategy']} on {cfg['task']}, {cfg['nodes']} SuperNodes, "
             f"{cfg['rounds']} rounds; {cfg['repetitions']} interleaved repetitions; seconds, mean ± sd over "
             "repetitions of each repetition's median over rounds.", "",
             "## Round, join, final evaluation", ""]
    rows = []
    for v, st in s.items():
        rows.append({"variant": v, "round": _fmt(st.get("rounds")), "join": _fmt(st.get("join")),
                     "final eval": _fmt(st.get("final_eval")),
                     "vanilla: train / eval exchange": (f"{_fmt(st.get('train_exchange'))} / {_fmt(st.get('eval_exchange'))}"
                                                         if "train_exchange" in st else "–"),
                     "vanilla: first round": _fmt(st.get("first_round")),
                     "test acc": _fmt(st.get("test_acc"), 4), "federation start": _fmt(st.get("federation_start"), 1)})
    lines += [markdown_table(rows, list(rows[0])), "", "## Ratio of round times to graphfl-warm (same repetition)", ""]
    rrows = [{"variant": v, "ratio": _fmt(r), "per repetition": ", ".join(f"{x:.1f}" for x in r["per_rep"])}
             for v, r in doc["ratios_vs_warm"].items()]
    if rrows:
        lines += [markdown_table(rrows, ["variant", "ratio", "per repetition"]), ""]
    lines += ["## Where a graphfl round goes (from the graphfl side)", "",
              "ClientApp start = process start (cold) or task claim (warm) -> handler; handler = the "
              "client's own work; transport = round - start - handler (pickup, reply, polls, server). "
              "Warm traces split it further: server push (exchange start -> messages at the SuperLink), "
              "pickup (message created -> task claimed; includes the server push), reply push (handler "
              "end -> reply at the SuperNode), reply to server (-> pulled by the ServerApp).", ""]
    srows = [{"variant": v, "round": _fmt(st.get("rounds")), "ClientApp start": _fmt(st.get("boot")),
              "handler": _fmt(st.get("handler")), "transport": _fmt(st.get("transport")),
              "server push (warm)": _fmt(st.get("server_push")), "pickup (warm)": _fmt(st.get("pickup")),
              "reply push (warm)": _fmt(st.get("reply_push")),
              "reply to server (warm)": _fmt(st.get("reply_to_server"))}
             for v, st in s.items() if "boot" in st]
    if srows:
        lines += [markdown_table(srows, list(srows[0])), ""]
    models = doc.get("worker_models") or {}
    if models:
        lines += ["## Worker models (one graphfl train message, no Flower transport)", "",
                  "start = until the handler runs (fork, or for a fresh process Python + imports); handler = "
                  "build the client + evaluate + 50 SGD steps (median of messages 2..; first message apart); "
                  "exit = handler end -> process reaped.", ""]
        mrows = [{"model": name, "start": d["summary"]["start"], "first handler": d["summary"]["first_handler"],
                  "handler": d["summary"]["handler"], "exit": d["summary"]["exit"]}
                 for name, d in models.items() if "summary" in d]
        lines += [markdown_table(mrows, ["model", "start", "first handler", "handler", "exit"]), ""]
    env = doc.get("env", {})
    lines += ["## Environment", "", markdown_table([env], list(env)), "",
              f"Benchmark wall time: {doc['seconds']:.0f} s.", ""]
    return "\n".join(lines)


def _panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Round time per round (mean ± sd over repetitions) per variant, and the split of a graphfl round."""
    series = {r["method"]: r["curve"] for r in doc["results"] if r["curve"]}
    split = []
    for i, (v, st) in enumerate(doc["summary"].items()):
        if "boot" in st:
            split.append({"x": i, "variant": v, "start": st["boot"]["mean"], "handler": st["handler"]["mean"],
                          "transport": st.get("transport", {}).get("mean")})
    panels = [{"x": "round", "y": "seconds", "band": "seconds_sd", "series": series, "logy": True,
               "title": "round time (mean ± sd over repetitions)", "ylabel": "seconds"}]
    if split:
        names = ", ".join(f"{p['x']}={p['variant']}" for p in split)
        panels.append({"x": "x", "y": "value", "title": f"graphfl round split ({names})", "ylabel": "seconds",
                       "series": {part: [{"x": p["x"], "value": p[part]} for p in split]
                                  for part in ("start", "handler", "transport")}})
    return panels
