#!/usr/bin/env bash
# Type-check graphfl with mypy (strict on the kernel `common/` and the server cores `strategies/`).
# The repository root is the `graphfl` package, so mypy sees it through a link named graphfl.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$root/.typecheck"
ln -sfn "$root" "$root/.typecheck/graphfl"
cd "$root/.typecheck"
exec mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.typecheck/.mypy_cache" -p graphfl "$@"
