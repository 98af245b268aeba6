"""The Flower ``ServerApp``: run config -> strategy -> rounds -> result files.

Runs inside ``flwr-serverapp`` (deployment) or ``flwr-simulation`` (simulation). The run
config (``context.run_config``) is parsed once into a :class:`~graphfl.common.config.RunConfig`.
Results go to ``out-dir`` (an absolute path; the ServerApp's working directory is not the
user's): ``run.json`` after every round, ``run.md``/``run.png`` at the end, and one JSON
line per round in ``progress.jsonl`` for the launcher's progress display.

Who owns ``out-dir`` (:func:`own_out_dir`, :mod:`graphfl.common.run_lock`): the ServerApp
writes only while it holds the folder's writer lock, so one ServerApp at a time writes a folder.
The folder lock itself belongs to ``graphfl run``'s launcher when one on this host claimed the
folder for this run (its lock file names the run key); otherwise (a SuperLink on another
machine, or a run submitted without graphfl's launcher) the ServerApp takes the folder lock
too. A folder owned by another run is refused before anything is written into it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

logger = logging.getLogger(__name__)

app = ServerApp()

PROGRESS_FILE = "progress.jsonl"


def resolve_out_dir(out_dir: str) -> Path:
    """The run's output folder (``out-dir``, else ``./runs/<timestamp>`` in the ServerApp's cwd)."""
    if out_dir:
        path = Path(out_dir)
        if not path.is_absolute():
            logger.warning("out-dir %r is relative to the ServerApp's cwd %s", out_dir, Path.cwd())
        return path
    path = Path.cwd() / "runs" / datetime.now().strftime("%Y%m%d-%H%M%S")
    logger.warning("no out-dir given; writing results to %s", path)
    return path


def progress_writer(path: Path, run_id: int) -> Callable[[dict[str, Any]], None]:
    """A callback that appends one JSON line per progress event to ``path``, stamped with the
    Flower ``run_id`` (the launcher follows only its own run's events).
    """

    def write(event: dict[str, Any]) -> None:
        with path.open("a") as fh:
            fh.write(json.dumps({"time": time.time(), "run_id": run_id, **event}, default=str) + "\n")

    return write


def own_out_dir(out: Path, run_key: str) -> list[Any]:
    """Take ownership of ``out`` for this ServerApp; returns the held locks (release them at the end).

    Rule: first the writer lock (``.graphfl-writer.lock``): another process that writes this
    folder's results refuses it. Then the folder lock (``.graphfl.lock``): free, the ServerApp
    takes it (no launcher owns the folder); held by a ``launcher`` whose lock file names this
    run's ``run_key``, the folder is its own launcher's and the ServerApp writes into it under
    the writer lock alone; held by anyone else, it is refused.

    Raises
    ------
    graphfl.common.run_lock.FolderBusy
        Naming the folder and the process that owns it.
    """
    from graphfl.common import run_lock

    out.mkdir(parents=True, exist_ok=True)
    writer = run_lock.acquire(out, name=run_lock.WRITER_LOCK_NAME, role="serverapp", run_key=run_key)
    try:
        return [writer, run_lock.acquire(out, role="serverapp", run_key=run_key)]
    except run_lock.FolderBusy as busy:
        if busy.owner.get("role") == "launcher" and run_key and busy.owner.get("run_key") == run_key:
            return [writer]
        writer.release()
        raise
    except BaseException:
        writer.release()
        raise


@app.main()
def main(grid: Grid, context: Context) -> None:
    """The ServerApp: parse the run config, run the strategy, write the results."""
    import torch

    from graphfl.common import registry
    from graphfl.common.config import parse_run_config
    from graphfl.common.envinfo import env_info
    from graphfl.common.records import arrays_to_record
    from graphfl.flowerx import array_copies, bounded_pull, object_io, policy
    from graphfl.flowerx.handshake_retry import install_on_grid
    from graphfl.server.flower_adapter import CoreStrategy
    from graphfl.server.inprocess import server_inputs
    from graphfl.server.rounds import RunRecorder

    cfg = parse_run_config(dict(context.run_config))
    out = resolve_out_dir(cfg.out_dir)
    locks = own_out_dir(out, cfg.run_key)  # another run's folder: refused before anything is written
    progress = progress_writer(out / PROGRESS_FILE, int(context.run_id))
    try:
        torch.set_num_threads(1)
        install_on_grid(grid)     # a TLS handshake the SuperLink cuts short is retried, not fatal
        bounded_pull.install()    # the ServerApp's fast paths, decided before run.json records them
        object_io.widen_object_transfers()
        array_copies.install()
        spec = registry.get(cfg.strategy)
        inputs = server_inputs(cfg)
        recorder = RunRecorder(cfg, cfg.strategy, out, progress=progress,
                               env={**env_info(), "engine": cfg.engine, "flower_fast_paths": policy.decisions()})
        strategy = CoreStrategy(cfg, spec, recorder, inputs)
        strategy.start(grid=grid, initial_arrays=arrays_to_record(inputs.initial_arrays), num_rounds=cfg.rounds)
    except BaseException as exc:
        try:
            progress({"event": "error", "error": f"{type(exc).__name__}: {exc}"})
        except OSError as unwritten:  # a full disk: the launcher then finds the run failed through Flower
            logger.error("could not report the error in %s: %s", out / PROGRESS_FILE, unwritten)
        raise
    finally:
        for lock in reversed(locks):
            lock.release()
