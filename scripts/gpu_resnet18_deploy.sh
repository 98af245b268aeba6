#!/usr/bin/env bash
# The GPU path of a real model size: FedAvg on `cifar10-resnet18` (ResNet-18 with GroupNorm,
# 11.2M parameters) deployed with N SuperNodes on one GPU (TLS SuperLink, warm ClientApp workers),
# against the in-process engine running the same work in one process, on the same machine.
#
# Measures per round (rounds after the first): deployment round time, in-process round time and
# their ratio; the clients' own training time inside the deployment; GPU memory per process
# (sampled by nvidia-smi every 0.5 s) and the number of processes that held a CUDA context.
#
# Usage (repository root):  scripts/gpu_resnet18_deploy.sh
# Environment (defaults):   DEVICE=cuda  NODES=4  ROUNDS=3  LOCAL_STEPS=50  BATCH=32
#                           DATA=$PWD/.gpu/data   (holds cifar10/cifar10-jpg-train.tar.gz)
#                           WHEELS=$PWD/.gpu/wheels (Flower and its dependencies, for a machine
#                           without Flower: `pip download flwr==<version> tomli_w --only-binary=:all:
#                           --python-version <py> --platform manylinux2014_x86_64 ... -d .gpu/wheels`,
#                           numpy and uv removed; installed with --no-deps under /tmp/site)
#                           OUT=/tmp/gpu_out      (summary.json, the two runs' folders, nvidia-smi log)
#                           LIMIT=500             (seconds for the whole script; each run gets a bound)
# A machine without a GPU runs the same steps with DEVICE=cpu (a check of the script itself).
set -euo pipefail

DEVICE=${DEVICE:-cuda}
NODES=${NODES:-4}
ROUNDS=${ROUNDS:-3}
LOCAL_STEPS=${LOCAL_STEPS:-50}
BATCH=${BATCH:-32}
DATA=${DATA:-$PWD/.gpu/data}
WHEELS=${WHEELS:-$PWD/.gpu/wheels}
OUT=${OUT:-/tmp/gpu_out}
LIMIT=${LIMIT:-500}
START=$(date +%s)
mkdir -p "$OUT"
export GRAPHFL_CACHE=${GRAPHFL_CACHE:-/tmp/graphfl-cache}

if ! python -c "import flwr" 2>/dev/null; then
    echo "installing Flower from $WHEELS"
    pip install -q --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    export PATH=/tmp/site/bin:$PATH
fi
if ! python -c "import graphfl" 2>/dev/null; then
    mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/graphfl
    export PYTHONPATH=/tmp/pkg${PYTHONPATH:+:$PYTHONPATH}
fi
python -c "import flwr, graphfl, torch; print('flwr', flwr.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"

left() { echo $(( LIMIT - ($(date +%s) - START) )); }
run() {  # run ENGINE OUTDIR ROUNDS
    local budget
    budget=$(left)
    if (( budget < 30 )); then echo "no time left for $1" >&2; return 1; fi
    timeout "$budget" python -m graphfl.cli run --strategy fedavg --task cifar10-resnet18 --nodes "$NODES" \
        --rounds "$3" --engine "$1" --device "$DEVICE" --data-dir "$DATA" --out "$2" --overwrite \
        --set train.local-steps="$LOCAL_STEPS" --set train.batch-size="$BATCH" --set train.lr=0.01 \
        > "$2.log" 2>&1 || { echo "$1 run failed (exit $?), last lines:"; tail -20 "$2.log"; return 1; }
}

SMI=""
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" || true
    nvidia-smi --query-compute-apps=timestamp,pid,used_memory --format=csv,noheader,nounits -lms 500 \
        > "$OUT/gpu_apps.csv" 2>/dev/null &
    SMI=$!
fi
(while true; do ps -eo pid,args --no-headers >> "$OUT/ps.txt"; echo "--" >> "$OUT/ps.txt"; sleep 2; done) &
PS_LOOP=$!
trap 'kill $PS_LOOP ${SMI:-} 2>/dev/null || true' EXIT

# 1 round in process first: data decoded into the cache, CUDA and cuDNN loaded; not measured.
run inprocess "$OUT/warmup" 1
run inprocess "$OUT/inprocess" "$ROUNDS"
run local-deployment "$OUT/deploy" "$ROUNDS" || true

python - "$OUT" "$NODES" "$LOCAL_STEPS" "$BATCH" "$DEVICE" <<'EOF'
import collections, json, pathlib, statistics, sys
out, nodes, steps, batch, device = pathlib.Path(sys.argv[1]), *map(int, sys.argv[2:5]), sys.argv[5]

def rounds(name):
    path = out / name / "run.json"
    if not path.is_file():
        return None
    curve = json.loads(path.read_text())["methods"]["fedavg"]["curve"]
    rows = [r for r in curve if r["round"] > 0]
    timed = rows[1:] or rows                       # the first round pays the workers' start
    return {"round_seconds": [r["seconds"] for r in rows],
            "median_round_seconds": statistics.median(r["seconds"] for r in timed),
            "client_seconds": [r.get("client_seconds") for r in rows],
            "clients_on_gpu": [r.get("clients_on_gpu") for r in rows],
            "bytes_up": [r.get("bytes_up") for r in rows],
            "final_test_loss": rows[-1].get("test_loss") if rows else None}

roles = {}
ps = out / "ps.txt"
if ps.is_file():
    for line in ps.read_text().splitlines():
        pid, _, args = line.strip().partition(" ")
        if pid.isdigit():
            role = ("clientapp-worker" if "graphfl.deploy.warm" in args or "flwr-clientapp" in args
                    else "supernode" if "graphfl.deploy.supernode" in args or "flower-supernode" in args
                    else "superlink" if "graphfl.deploy.superlink" in args or "flower-superlink" in args
                    else "serverapp" if "flwr-serverapp" in args
                    else "graphfl-run" if "graphfl.cli run" in args else "other")
            roles.setdefault(int(pid), (role, args[:160]))
peak = collections.defaultdict(float)
apps = out / "gpu_apps.csv"
if apps.is_file():
    for line in apps.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[1].isdigit():
            try:
                peak[int(parts[1])] = max(peak[int(parts[1])], float(parts[2]))
            except ValueError:
                pass
doc = {"device": device, "gpu": (out / "gpu.txt").read_text().strip() if (out / "gpu.txt").is_file() else None,
       "nodes": nodes, "local_steps": steps, "batch": batch,
       "model_parameters": 11_173_962,
       "inprocess": rounds("inprocess"), "deploy": rounds("deploy"),
       "gpu_memory_peak_mib_by_process": {str(pid): {"peak_mib": mib, "role": roles.get(pid, ("?", ""))[0],
                                                    "args": roles.get(pid, ("?", ""))[1]}
                                          for pid, mib in sorted(peak.items())},
       "cuda_contexts": len(peak) if apps.is_file() else None}
if doc["inprocess"] and doc["deploy"]:
    doc["deploy_over_inprocess"] = doc["deploy"]["median_round_seconds"] / doc["inprocess"]["median_round_seconds"]
    a, b = doc["deploy"]["final_test_loss"], doc["inprocess"]["final_test_loss"]
    doc["final_test_loss_relative_difference"] = abs(a - b) / abs(b) if a is not None and b else None
(out / "summary.json").write_text(json.dumps(doc, indent=1))
print(json.dumps({k: v for k, v in doc.items() if k != "gpu_memory_peak_mib_by_process"}, indent=1))
for pid, rec in doc["gpu_memory_peak_mib_by_process"].items():
    print(f"pid {pid} {rec['role']:>16} peak {rec['peak_mib']:.0f} MiB  {rec['args'][:80]}")
EOF
