#!/bin/sh
# Start p2p peer ID (graphfl-peer@ID.service): `graphfl peer`, with --resume when the peer's
# checkpoint exists in the output folder (so a restart after a crash continues the run).
# Environment: GRAPHFL_NETWORK (network .toml), GRAPHFL_PEER_OUT (output folder),
# GRAPHFL_PEER_ARGS (extra options, split on spaces), GRAPHFL_BIN (default: graphfl on PATH).
set -eu
if [ "$#" -ne 1 ]; then
    echo "usage: $0 PEER_ID" >&2
    exit 2
fi
id="$1"
case "$id" in
    ''|*[!0-9]*) echo "error: peer id must be a non-negative integer, got '$id'" >&2; exit 2 ;;
esac
: "${GRAPHFL_NETWORK:?set GRAPHFL_NETWORK to the network .toml}"
out="${GRAPHFL_PEER_OUT:-/var/lib/graphfl/p2p}"
bin="${GRAPHFL_BIN:-graphfl}"
resume=""
if [ -f "$out/peer-$id.ckpt.json" ]; then
    resume="--resume"
    echo "peer $id: checkpoint found in $out, resuming" >&2
fi
# shellcheck disable=SC2086  # GRAPHFL_PEER_ARGS is a list of options
exec "$bin" peer --topology "$GRAPHFL_NETWORK" --id "$id" --out "$out" $resume ${GRAPHFL_PEER_ARGS:-}
