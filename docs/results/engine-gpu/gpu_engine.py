"""Device check: the engine table on a GPU, batched vs in-process, one process, rows in order.

Usage: python gpu_engine.py SECONDS [--smoke]. Writes $OUT/gpu_engine.json after every row.
"""
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, "/tmp/pkg")
import torch

from graphfl.common.config import parse_run_config
from graphfl.server.inprocess import run_federated_inprocess

budget = float(sys.argv[1])
smoke = "--smoke" in sys.argv
OUT = os.environ.get("OUT", "/tmp/gpu_out")
os.makedirs(OUT, exist_ok=True)
DATA = os.path.abspath(".gpu/data")
device = "cpu" if smoke else "cuda"
deadline = time.monotonic() + budget

SM = "synthetic-multicenter"
if os.environ.get("ROWS") == "det":
    rows = [("mnist", 100, "batched", 2, 20), ("mnist", 100, "batched-pcf", 2, 30),
            ("mnist", 100, "inprocess", 2, 30), ("mnist", 100, "inprocess", 2, 30)]
elif os.environ.get("ROWS") == "tf32":
    rows = [("mnist", 100, "batched", 2, 20), ("mnist", 100, "inprocess", 2, 30)]
elif smoke:
    rows = [(SM, 10, "batched", 2, 1), (SM, 10, "inprocess", 2, 1), ("mnist", 10, "batched", 1, 1)]
else:
    rows = [(SM, 100, "batched", 3, 5), (SM, 100, "inprocess", 3, 20),
            ("mnist", 100, "batched", 2, 30), ("mnist", 100, "inprocess", 2, 40),
            (SM, 1000, "batched", 3, 15), (SM, 1000, "inprocess", 1, 90),
            (SM, 10000, "batched", 2, 90),
            ("mnist", 1000, "batched", 2, 60), ("mnist", 1000, "inprocess", 1, 120),
            ("mnist", 5000, "batched", 1, 120)]


def config(task, n, engine, rounds):
    """The run configuration of one row (FedAvg, 10 local steps, on ``device``)."""
    flat = {"strategy": "fedavg", "task": task, "nodes": n, "rounds": rounds, "engine": engine, "seed": 0,
            "train.local-steps": 10, "min-replies": 0, "device": device}
    if task == "mnist":
        flat["data-dir"] = DATA
        if n >= 1000:
            flat.update({"data.dirichlet-alpha": 100.0, "data.min-partition-size": 2})
    return parse_run_config(flat)


def summary(doc, wall):
    """Median round seconds, set-up, final test metrics, chunk of one run's result document."""
    method = next(iter(doc["methods"].values()))
    curve = method["curve"]
    secs = [r["seconds"] for r in curve if r["round"] >= 1 and r.get("seconds") is not None]
    env = doc.get("env", {})
    return {"round_s": statistics.median(secs) if secs else None, "round_s_all": secs,
            "setup_s": wall - sum(secs), "test_loss": (method.get("final") or {}).get("test_loss"),
            "test_acc": (method.get("final") or {}).get("test_acc"), "status": doc.get("status"),
            "chunk": env.get("batch_chunk"), "fallback": env.get("batched_fallback"),
            "device_used": env.get("device") or env.get("devices")}


if os.environ.get("DET") == "1":
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
if os.environ.get("TF32") == "0":
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
info = {"tf32_conv": torch.backends.cudnn.allow_tf32, "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "torch": torch.__version__, "cuda": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "rows": []}
# warm-up: libraries and CUDA context, not timed
for engine in ("batched", "inprocess"):
    run_federated_inprocess(config(SM, 2, engine, 1))
for task, n, engine, rounds, est in rows:
    row = {"task": task, "clients": n, "engine": engine, "rounds": rounds, "device": device}
    if time.monotonic() + est > deadline:
        row["skipped"] = f"estimated {est} s, {deadline - time.monotonic():.0f} s left"
        info["rows"].append(row)
        continue
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    import graphfl.client.batched as cb
    real_pcf = cb._per_client_forward
    if engine == "batched-pcf":   # the per-client forward of the stacked step, forced on the GPU
        cb._per_client_forward = lambda model: any(isinstance(x, cb.CONVOLUTIONS) for x in model.modules())
    try:
        doc, _ = run_federated_inprocess(config(task, n, engine.replace("-pcf", ""), rounds))
        row.update(summary(doc, time.perf_counter() - t0))
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["trace"] = traceback.format_exc()[-2000:]
    cb._per_client_forward = real_pcf
    if torch.cuda.is_available():
        row["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 1e6
    row["wall_s"] = time.perf_counter() - t0
    info["rows"].append(row)
    print(json.dumps({k: v for k, v in row.items() if k not in ("trace", "round_s_all")}), flush=True)
    with open(os.path.join(OUT, os.environ.get("NAME", "gpu_engine") + ".json"), "w") as f:
        json.dump(info, f, indent=1)
