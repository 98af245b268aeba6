"""``graphfl run``: one experiment on the chosen engine, with progress and result files.

Engines
-------
``local-deployment``
    A real SuperLink + N SuperNodes on 127.0.0.1 (TLS on by default; ``node_auth`` adds
    SuperNode authentication with registered keys) started for this run and stopped afterwards.
``simulation``
    A simulation SuperLink (Flower's Ray engine), also started and stopped for this run.
``inprocess``
    The same cores and trainers in this process (no Flower), for quick checks and benchmarks.
``--superlink HOST:PORT``
    Submit to an existing SuperLink (multi-host); results are written by the ServerApp on
    the SuperLink's machine, under ``out-dir`` there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from graphfl.common.config import RunConfig, dump_toml, nest
from graphfl.common.ports import port_open
from graphfl.deploy.federation import FederationError, LocalFederation, Submitter, write_connection
from graphfl.deploy.processes import ProcessGroup

logger = logging.getLogger(__name__)


def default_out_dir(base: str | Path = "runs") -> Path:
    """``runs/<timestamp with milliseconds>``: a new folder per run."""
    return Path(base) / datetime.now().strftime("%Y%m%d-%H%M%S-%f")[:-3]


def write_overrides(path: Path, cfg: RunConfig) -> Path:
    """The resolved config as a Flower ``--run-config`` TOML file (dotted keys)."""
    path.write_text(dump_toml(nest(cfg.to_flat())))
    return path


def prepare(cfg: RunConfig) -> tuple[RunConfig, Path]:
    """Resolve out-dir (absolute; it is written by the ServerApp in another cwd) and data-dir."""
    import os

    out = Path(cfg.out_dir) if cfg.out_dir else default_out_dir()
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    data_dir = cfg.data_dir or os.environ.get("GRAPHFL_DATA", "")
    if data_dir:
        data_dir = str(Path(data_dir).resolve())
    cfg = dataclasses.replace(cfg, out_dir=str(out), data_dir=data_dir)
    (out / "config.json").write_text(json.dumps(cfg.to_json(), indent=2) + "\n")
    return cfg, out


def preflight(cfg: RunConfig) -> None:
    """Fail fast, before any process starts, when the task's data cannot be loaded."""
    from graphfl.tasks import registry as tasks

    task = tasks.create(cfg.task, data=cfg.data, data_dir=cfg.data_dir, seed=cfg.seed)
    task.client_data(0, cfg.nodes)


def run_experiment(
    cfg: RunConfig,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    superlink: str | None = None,
    root_certificates: str | None = None,
    insecure: bool = False,
    run_timeout: float | None = None,
    node_auth: bool = False,
) -> Path:
    """Run ``cfg``; return the output folder (holding ``run.json``, ``run.md``, ``run.png``)."""
    cfg, out = prepare(cfg)
    timeout = run_timeout or (cfg.connect_timeout + (cfg.rounds + 2) * cfg.round_timeout)
    if superlink is None:
        preflight(cfg)
    if superlink is None and cfg.engine == "inprocess":
        from graphfl.server.inprocess import run_federated_inprocess

        run_federated_inprocess(cfg, out, progress=on_event)
        return out

    from graphfl.server.flower_app import write_app_dir

    app_dir = write_app_dir(out / "app")
    overrides = write_overrides(out / "run-config.toml", cfg)

    if superlink is not None:
        host, _, port = superlink.rpartition(":")
        if not port.isdigit() or not host:
            raise FederationError(f"--superlink must be HOST:PORT, got {superlink!r}")
        if not port_open(host.strip("[]"), int(port), timeout=5.0):
            raise FederationError(f"cannot reach a SuperLink at {superlink} (no TCP connection within 5 s)")
        flwr_home = out / ".flwr"
        ca = None if insecure else root_certificates
        if not insecure and not ca:
            raise FederationError("--superlink needs --root-certificates CA.crt (or --insecure)")
        write_connection(flwr_home, superlink, Path(ca) if ca else None)
        env = ProcessGroup(out / "logs", env={"FLWR_HOME": str(flwr_home)}).base_env()
        sub = Submitter(flwr_home, env)
        handle = sub.submit(app_dir, overrides, out)
        logger.info("submitted run %d to %s; results are written on the SuperLink host under %s",
                    handle.run_id, superlink, cfg.out_dir)
        sub.wait_status(handle.run_id, timeout, on_event)
        return out

    simulation = cfg.engine == "simulation"
    with LocalFederation(out, cfg.nodes, tls=True, simulation=simulation, node_auth=node_auth and not simulation,
                         start_timeout=cfg.connect_timeout) as fed:
        sub = fed.submitter()
        fed_cfg = f"num-supernodes={cfg.nodes} client-resources-num-cpus=1" if simulation else None
        handle = sub.submit(app_dir, overrides, out, federation_config=fed_cfg)
        if on_event:
            on_event({"event": "submitted", "run_id": handle.run_id, "superlink": fed.address})
        sub.wait(handle, on_event, timeout=timeout, health=fed.health)
    return out
