"""Stock Flower Apps for the benches: written at run time, run with ``flwr run`` on stock processes.

A bench that compares graphfl with *vanilla Flower* writes a minimal Flower App (``pyproject.toml``
+ one package with ``server_app.py``, ``client_app.py`` and more modules) into its output folder
(:func:`write_app`) and runs it on a freshly started federation of the stock ``flower-superlink``
(every middleware) and stock ``flower-supernode`` processes, one ``flwr-clientapp`` process per
message, Flower's default SuperExec poll interval (1 s) (:func:`run_app`). The ServerApp times its
own rounds: :data:`TIMED_FEDAVG` is Flower's ``FedAvg`` with wall-clock marks around its hooks
(``times[round][key]``: ``train_start``, ``train_replies``, ``train_done``, ``eval_start``,
``eval_replies``), which the App writes into the file named by its ``out-file`` run-config key.

Two Apps use it: ``graphfl bench deploy``'s digits MLP (:mod:`graphfl.bench.deploy`) and the
same-bytes vector App of ``graphfl bench p2p-throughput`` (:data:`VECTOR_SERVER`,
:data:`VECTOR_CLIENT`, :func:`run_vector_app`): FedAvg over a bare float32 vector of ``d``
parameters, training only (``fraction_evaluate=0``), so a round moves ``n`` messages of ``4d``
bytes down and ``n`` up, and each ClientApp does one gradient step of ``½‖θ − μ_i‖²``
(``θ ← θ − η (θ − μ_i)``, ``μ_i`` the constant vector ``i + 1``).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from graphfl.common.config import dump_toml

logger = logging.getLogger(__name__)

STOCK_POLL_INTERVAL = "1.0"
"""Flower's default SuperExec task poll interval (s), set explicitly (graphfl's federations use 0.1 s)."""
STATUS_EVERY = 5.0
"""Seconds between `flwr list` status checks of a run (its rounds time themselves)."""

TIMED_FEDAVG = '''
class TimedFedAvg(FedAvg):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.times = {}
        self.metrics = {}

    def _mark(self, r, key):
        self.times.setdefault(r, {})[key] = time.time()

    def configure_train(self, server_round, arrays, config, grid):
        self._mark(server_round, "train_start")
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        self._mark(server_round, "train_replies")
        out = super().aggregate_train(server_round, replies)
        self.metrics.setdefault(server_round, {})["train_replies"] = sum(not m.has_error() for m in replies)
        self._mark(server_round, "train_done")
        return out

    def configure_evaluate(self, server_round, arrays, config, grid):
        self._mark(server_round, "eval_start")
        return super().configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round, replies):
        replies = list(replies)
        self._mark(server_round, "eval_replies")
        accs = [float(m.content["metrics"]["test_acc"]) for m in replies if not m.has_error()]
        self.metrics.setdefault(server_round, {})["test_acc"] = sum(accs) / len(accs) if accs else None
        return super().aggregate_evaluate(server_round, replies)
'''
"""Source of ``TimedFedAvg`` (stock ``FedAvg`` + timestamps), pasted into a ServerApp after its imports."""

VECTOR_SERVER = '''"""Vanilla Flower ServerApp: stock FedAvg over a bare float32 vector; only timestamps are added."""

import json
import time

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

app = ServerApp()
''' + TIMED_FEDAVG + '''

@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    n = int(cfg["nodes"])
    t0 = time.time()
    strategy = TimedFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n,
                           min_evaluate_nodes=0, min_available_nodes=n)
    theta = np.zeros(int(cfg["dim"]), dtype=np.float32)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord([theta]), num_rounds=int(cfg["num-server-rounds"]),
                            train_config=ConfigRecord({"lr": float(cfg["lr"])}))
    final = result.arrays.to_numpy_ndarrays()[0]
    doc = {"start": t0, "end": time.time(), "times": strategy.times, "metrics": strategy.metrics,
           "final": {"size": int(final.size), "dtype": str(final.dtype), "mean": float(final.mean()),
                     "head": [float(x) for x in final[:3]]}}
    with open(str(cfg["out-file"]), "w") as fh:
        json.dump(doc, fh)
'''

VECTOR_CLIENT = '''"""Vanilla Flower ClientApp: one gradient step of 0.5 * |theta - mu|^2 on the received vector."""

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    theta = msg.content["arrays"].to_numpy_ndarrays()[0]
    pid = int(context.node_config["partition-id"])
    lr = np.float32(msg.content["config"]["lr"])
    theta = theta - lr * (theta - np.float32(pid + 1))  # the client's target: the constant vector pid + 1
    content = RecordDict({"arrays": ArrayRecord([theta.astype(np.float32, copy=False)]),
                          "metrics": MetricRecord({"num-examples": 2})})
    return Message(content=content, reply_to=msg)
'''


def write_app(path: Path, package: str, modules: Mapping[str, str], config: Mapping[str, Any],
              doc: str = "Vanilla Flower App for a graphfl bench.") -> Path:
    """Write a Flower App into ``path``: ``pyproject.toml`` and package ``package`` with ``modules``
    (module name -> source; ``server_app`` and ``client_app`` must define ``app``), run config
    ``config`` (every key the Apps read, ``out-file`` included). Returns ``path``.
    """
    missing = {"server_app", "client_app"} - set(modules)
    if missing:
        raise ValueError(f"a Flower App needs modules {sorted(missing)}")
    pkg = path / package
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(f'"""{doc}"""\n')
    for name, source in modules.items():
        (pkg / f"{name}.py").write_text(source)
    (path / "pyproject.toml").write_text(dump_toml({
        "build-system": {"requires": ["setuptools>=69"], "build-backend": "setuptools.build_meta"},
        "project": {"name": package, "version": "1.0.0", "dependencies": []},
        "tool": {"flwr": {"app": {
            "publisher": "graphfl-bench",
            "components": {"serverapp": f"{package}.server_app:app", "clientapp": f"{package}.client_app:app"},
            "config": dict(config),
        }}},
    }))
    return path


def run_app(out: Path, app: Path, nodes: int, tls: bool, start_timeout: float, run_timeout: float) -> dict[str, Any]:
    """Run the App at ``app`` once on a fresh stock federation of ``nodes`` SuperNodes under ``out``.

    The App writes its own timings to ``<out>/vanilla.json`` (passed as ``out-file``); returns
    that document with ``federation_start`` (s to start the federation) and ``wall`` (submit ->
    finished, s). Raises :class:`graphfl.deploy.federation.FederationError` when the run fails
    or does not finish within ``run_timeout``.
    """
    from graphfl.deploy.federation import LocalFederation

    out.mkdir(parents=True, exist_ok=True)
    result_file = (out / "vanilla.json").resolve()
    overrides = out / "run-config.toml"
    overrides.write_text(dump_toml({"out-file": str(result_file)}))
    t_fed = time.perf_counter()
    with LocalFederation(out, nodes, tls=tls, start_timeout=start_timeout,
                         clientapp_mode="cold", superlink_middleware="stock",
                         env={"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": STOCK_POLL_INTERVAL}) as fed:
        startup = time.perf_counter() - t_fed
        sub = fed.submitter()
        t_run = time.perf_counter()
        handle = sub.submit(app, overrides, out)
        # every `flwr list` is a CLI process (about 1 s of CPU): asked every 5 s, not every second, so
        # the monitoring does not slow the measured rounds (which the App times itself)
        sub.wait_status(handle.run_id, timeout=run_timeout, interval=STATUS_EVERY)
        wall = time.perf_counter() - t_run
    doc = json.loads(result_file.read_text())
    doc.update(federation_start=startup, wall=wall)
    return doc


def vector_round_seconds(doc: Mapping[str, Any]) -> list[float]:
    """Per round (1..R, in order) of a vector App's timings: ``train_done - train_start`` (the
    training exchange and the aggregation; the App has no evaluation exchange).
    """
    times = {int(k): v for k, v in doc["times"].items()}
    return [float(times[r]["train_done"] - times[r]["train_start"]) for r in sorted(times)]


def run_vector_app(out: Path, d: int, n: int, rounds: int, tls: bool, timeout: float,
                   lr: float = 0.5, start_timeout: float = 120.0) -> dict[str, Any]:
    """Vanilla Flower, same bytes as graphfl's ``synthetic-vector`` FedAvg: ``n`` stock SuperNodes,
    ``rounds`` rounds of FedAvg over ``d`` float32 parameters (see the module docstring).

    Returns the per-round seconds (``round_s``, :func:`vector_round_seconds`), their median over
    rounds 2.. (``median_round_s``), the final model's summary and ``ok``; a failed run is
    reported (``ok`` False, ``error``), not raised.
    """
    res: dict[str, Any] = {"params": d, "nodes": n, "tls": tls, "rounds": rounds, "strategy": "flwr FedAvg",
                           "clientapp": "stock flower-supernode, one flwr-clientapp process per message",
                           "superlink": "stock flower-superlink", "poll_interval_s": float(STOCK_POLL_INTERVAL)}
    app = write_app(out / "vanilla-app", "vanillavec", {"server_app": VECTOR_SERVER, "client_app": VECTOR_CLIENT},
                    {"num-server-rounds": rounds, "nodes": n, "dim": d, "lr": lr, "out-file": ""},
                    doc="Vanilla Flower App: FedAvg over a bare float32 vector.")
    try:
        doc = run_app(out, app, n, tls, start_timeout=start_timeout, run_timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - a failed run is a result of the bench, not its end
        logger.warning("vanilla Flower for %d params, %d nodes failed: %s", d, n, exc)
        res.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        return res
    per_round = vector_round_seconds(doc)
    steady = per_round[1:] or per_round
    replies = [int(m.get("train_replies", 0)) for m in doc.get("metrics", {}).values()]
    res.update(round_s=per_round, median_round_s=float(statistics.median(steady)) if steady else None,
               federation_start_s=doc["federation_start"], wall_s=doc["wall"], final=doc.get("final"),
               ok=len(per_round) == rounds and replies == [n] * rounds)
    if not res["ok"]:
        res["error"] = f"{len(per_round)} of {rounds} rounds timed, replies per round {replies} (expected {n})"
    return res
