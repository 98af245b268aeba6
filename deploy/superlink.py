"""graphfl's SuperLink entry point: Flower's own SuperLink, with its API-specific middleware gated by path.

``python -m graphfl.deploy.superlink [--middleware gated|stock] -- <flower-superlink arguments>``

``--middleware gated`` (the default) runs Flower's SuperLink in this process after installing the
fast path ``superlink-gates`` (:mod:`graphfl.flowerx.superlink_gates`): each middleware that acts on
one API only runs for that API's paths, so a request crosses fewer layers and reaches exactly the
middleware code that acts on it in stock Flower. Where the seam was not verified on the installed
Flower, the fast path is off (one log line) and the SuperLink runs unchanged. ``--middleware stock``
(and a Flower whose SuperLink entry point moved) execs the ``flower-superlink`` command itself.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from graphfl.deploy.flower_malloc import keep_to_this_process
from graphfl.flowerx import entrypoints
from graphfl.flowerx.superlink_gates import install_gated_middleware

logger = logging.getLogger("graphfl.deploy.superlink")


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split ``[ours] -- [flower-superlink's]``."""
    from graphfl.deploy.supernode import split_at_dashes

    ours, flower = split_at_dashes(argv)
    p = argparse.ArgumentParser(prog="python -m graphfl.deploy.superlink",
                                description="Flower's SuperLink with its API-specific middleware gated by path.")
    p.add_argument("--middleware", choices=("gated", "stock"), default="gated")
    return p.parse_args(ours), flower


def main(argv: Sequence[str] | None = None) -> int:
    """Install the path gates (unless ``--middleware stock``), then run Flower's SuperLink."""
    own = keep_to_this_process(os.environ)   # allocator settings for this process, not the ServerApp's
    args, flower_args = parse_args(sys.argv[1:] if argv is None else argv)
    entry = entrypoints.superlink_entry() if args.middleware == "gated" else None
    if own:
        from graphfl.deploy.warm import own_log_handler

        own_log_handler(logger)
        logger.info("allocator: %s %s", ", ".join(f"{n}={v}" for n, v in own.items()),
                    "for this process only" if entry is not None else
                    "not applied: this process runs the stock flower-superlink, whose children would inherit it")
    if entry is None:
        entrypoints.exec_stock("flower-superlink", flower_args)
    assert entry is not None
    install_gated_middleware()
    entrypoints.run_entry(entry, "flower-superlink", flower_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
