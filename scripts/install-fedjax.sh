#!/usr/bin/env bash
# Make a virtual environment with FedJAX 0.0.17 and the JAX stack it needs (the comparator rows of
# `graphfl bench engine`), then print the line that points the bench at it.
#   scripts/install-fedjax.sh [VENV_DIR]        (default: ../venv-fedjax beside the repository)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$root/../venv-fedjax}"
python3 -m venv "$venv"
timeout 600 "$venv/bin/pip" install -q jax==0.4.13 jaxlib==0.4.13 optax==0.1.7 dm-haiku==0.0.10 chex==0.1.82 \
    fedjax==0.0.17 "numpy<2" "scipy<1.13"
"$venv/bin/python" -c "import fedjax, haiku, jax" 
echo "export GRAPHFL_FEDJAX_PYTHON=$(cd "$venv" && pwd)/bin/python"
