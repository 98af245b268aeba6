"""Flower's SuperLink and SuperNode run inside a graphfl process (after its fast paths are installed).

The functions behind the ``flower-superlink`` and ``flower-supernode`` commands live in non-public
modules. :func:`superlink_entry` / :func:`supernode_entry` return them, or ``None`` (with one log
line) when this Flower has moved them; the caller then runs the stock command instead
(:func:`exec_stock`), so a moved entry point costs the fast paths, never the run.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

logger = logging.getLogger("graphfl.flowerx")


def superlink_entry() -> Callable[[], None] | None:
    """``flower_superlink`` (the ``flower-superlink`` command's function), or ``None``."""
    try:
        from flwr.superlink.cli.flower_superlink import flower_superlink
    except ImportError as exc:
        logger.warning("Flower's SuperLink entry point cannot be imported (%s); running the stock "
                       "flower-superlink command without graphfl's fast paths", exc)
        return None
    return flower_superlink


def supernode_entry() -> Callable[[], None] | None:
    """``flower_supernode`` (the ``flower-supernode`` command's function), or ``None``."""
    try:
        from flwr.supernode.cli import flower_supernode
    except ImportError as exc:
        logger.warning("Flower's SuperNode entry point cannot be imported (%s); running the stock "
                       "flower-supernode command without graphfl's fast paths", exc)
        return None
    return flower_supernode


def add_exit_handler(handler: Callable[[], None]) -> bool:
    """Run ``handler`` when Flower's process exits through its own exit path; ``False`` if unavailable."""
    try:
        from flwr.supercore.exit import add_exit_handler as flower_add
    except ImportError:
        return False
    flower_add(handler)
    return True


def run_entry(entry: Callable[[], None], command: str, argv: Sequence[str]) -> None:
    """Run Flower's ``entry`` as ``command argv...`` in this process."""
    sys.argv = [command, *argv]
    entry()


def exec_stock(command: str, argv: Sequence[str]) -> None:
    """Replace this process by Flower's ``command`` (next to the interpreter, else on ``PATH``)."""
    exe = Path(sys.executable).with_name(command)
    if exe.exists():
        os.execv(str(exe), [str(exe), *argv])
    os.execvp(command, [command, *argv])
