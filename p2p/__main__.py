"""``python -m graphfl.p2p peer|p2p ...`` (the same commands as ``graphfl peer`` / ``graphfl p2p``).

``peer`` (what the launcher starts, once per peer) is parsed here with :mod:`argparse`, the same
options as ``graphfl peer``, so a peer process does not import typer/click (start-up time of every
peer, docs/p2p.md "Lighter peers"); everything else goes to the typer app.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from graphfl.common.config import ConfigError, parse_assignment


def peer_main(argv: list[str]) -> int:
    """``peer --topology FILE --id I [--out DIR] [--insecure] [--set K=V ...] [--resume] [--device D] [--listen HOST:PORT]``."""
    ap = argparse.ArgumentParser(prog="python -m graphfl.p2p peer", description="Run one p2p peer process.")
    ap.add_argument("--topology", required=True, help="network file (.toml)")
    ap.add_argument("--id", dest="peer_id", type=int, required=True, help="this peer's id in the network file")
    ap.add_argument("--out", default="runs/p2p", help="directory for peer-<id>.json/.npz")
    ap.add_argument("--insecure", action="store_true", help="plaintext gRPC (no TLS); must be explicit")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="override a [run] key, e.g. rounds=50")
    ap.add_argument("--resume", action="store_true", help="continue from this peer's checkpoint in --out")
    ap.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N (overrides the network file's)")
    ap.add_argument("--listen", default=None, help="HOST:PORT to bind when it differs from this peer's address in "
                    "the network file (port forwarding, NAT, a link emulator)")
    args = ap.parse_args(argv)
    overrides = {}
    try:
        for item in args.sets:
            key, value = parse_assignment(item)
            overrides[key] = value
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from graphfl.p2p.peer import main  # gRPC and the peer runtime: only for the peer command

    return main(args.topology, args.peer_id, args.out, overrides, args.insecure, args.resume, args.device,
                args.listen)


COMMANDS_MODULE = "graphfl.deploy.p2p_cli"
"""The typer commands (``p2p``, and ``peer --help``), loaded by name: they start processes, which is
:mod:`graphfl.deploy`'s job, a layer above this package (the same by-name loading as the main CLI's)."""


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "peer" and not {"--help", "-h"} & set(sys.argv[2:]):
        sys.exit(peer_main(sys.argv[2:]))
    importlib.import_module(COMMANDS_MODULE).make_app()()
