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
import importlib.util
import json
import logging
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from graphfl.common import run_lock
from graphfl.common.config import ConfigError, RunConfig, dump_toml, nest
from graphfl.common.ports import port_open
from graphfl.common.results import full_disk, how_to_fix
from graphfl.deploy import ray_cluster
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


RUN_FILES = ("config.json", "run.json", "run.md", "run.png", "progress.jsonl", "run-config.toml",
             "logs", "certs", "app", ".flwr", "checkpoint", "client-state", *run_lock.LOCK_FILES)
"""What a run writes into its output folder (``--overwrite`` removes exactly these, its lock files excepted)."""


def claim_out_dir(out: Path, overwrite: bool = False, **owner: Any) -> run_lock.FolderLock:
    """Create the run's output folder and take its lock, or refuse a folder that is unusable, in use or full.

    Ownership (:mod:`graphfl.common.run_lock`): the folder's lock is taken first, with one system
    call, so of two runs claiming one folder at once exactly one gets it; the other is refused with
    the owner's pid, host and command. Then the content is checked under the lock: a run never
    reuses an older run's files as its own, so a non-empty folder is refused unless ``overwrite``
    is set, and then only graphfl's own run files (:data:`RUN_FILES`) are removed; a folder with
    anything else in it is refused even then. The lock file itself does not count. ``owner``
    (e.g. the run key) is written into the lock file. The caller holds the returned lock for the
    run's life and releases it at the end (the OS releases it if the process dies).

    Raises
    ------
    ConfigError
        The path is a file, lies under a file, cannot be created or written, holds files, or
        another process owns it (:class:`~graphfl.common.run_lock.FolderBusy`).
    """
    lock = run_lock.claim_output_folder(out, overwrite=overwrite, kind="run", own_file=RUN_FILES.__contains__,
                                        role="launcher", **owner)
    try:
        probe = out / ".graphfl-write-test"
        try:
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"--out {out}: cannot write there ({exc.strerror or exc})") from None
    except BaseException:
        lock.release()
        raise
    return lock


def finalize_status(out: Path, status: str, reason: str, cfg: RunConfig | None = None) -> str | None:
    """Make ``run.json`` say how the run ended when its ServerApp could not (Ctrl-C, crash).

    A ``run.json`` that still says ``running`` gets ``status`` and ``error = reason``; a missing
    one is written with just the config, the status and the reason. A finished run's file is
    left as it is. Returns ``None``, or why ``run.json`` could not be written (a full disk, ...),
    in one sentence for the error the launcher reports; the file then keeps its last version.
    """
    from graphfl.common.results import write_json

    path = out / "run.json"
    try:
        doc = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        doc = None
    if doc is not None and doc.get("status") not in (None, "running"):
        return None
    said = doc.get("status") if doc is not None else None
    if doc is None:
        doc = {"name": "run", "config": cfg.to_json() if cfg is not None else {}, "methods": {}}
    doc["status"] = status
    doc["error"] = reason
    try:
        write_json(path, doc)
    except OSError as exc:
        logger.error("could not mark %s %r: %s", path, status, exc)
        return (f"run.json could not be updated ({exc}): it still says {said!r}" if said else
                f"run.json could not be written ({exc})") + f"; {how_to_fix(exc, out)}"
    return None


def prepare(cfg: RunConfig, overwrite: bool = False) -> tuple[RunConfig, Path]:
    """Claim the output folder (:func:`claim_out_dir`), resolve out-dir (absolute; it is written by
    the ServerApp in another cwd) and data-dir, and write ``config.json``.

    The folder's lock is released on return: a caller that runs the federation itself leaves the
    folder to its ServerApp, which then owns it (:func:`graphfl.server.app.own_out_dir`);
    :func:`run_experiment` keeps the lock for the run's life instead.
    """
    cfg, lock = _prepare_held(cfg, overwrite)
    lock.release()
    return cfg, lock.folder


def _prepare_held(cfg: RunConfig, overwrite: bool) -> tuple[RunConfig, run_lock.FolderLock]:
    """:func:`prepare`, returning the folder's held lock (its owner names the run key)."""
    import os

    from graphfl.common.results import atomic_write_text

    run_key = cfg.run_key or new_run_key()
    lock = claim_out_dir((Path(cfg.out_dir) if cfg.out_dir else default_out_dir()).resolve(), overwrite,
                         run_key=run_key)
    out = lock.folder
    try:
        data_dir = cfg.data_dir or os.environ.get("GRAPHFL_DATA", "")
        if data_dir:
            data_dir = str(Path(data_dir).resolve())
        cfg = dataclasses.replace(cfg, out_dir=str(out), data_dir=data_dir, run_key=run_key)
        atomic_write_text(out / "config.json", json.dumps(cfg.to_json(), indent=2) + "\n")
    except BaseException:
        lock.release()
        raise
    return cfg, lock


def new_run_key() -> str:
    """A fresh run key (names the run's client-state folder; kept across ``--resume``)."""
    import uuid

    return uuid.uuid4().hex[:16]


def prepare_resume(out: Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """The config to continue the run in ``out`` with (its ``config.json`` plus ``overrides``).

    Refused (one line each) when ``out`` is not a graphfl run folder, holds no checkpoint, the
    overrides change a key a resume may not change, or the run already completed all its
    rounds (``rounds`` must then grow). Writes the new ``config.json`` (with ``resume = true``,
    the same ``run-key``).

    The folder's lock is taken for the check and the write (nested when the caller holds it, as
    ``graphfl run --resume`` does for the whole run): a run still alive in ``out`` refuses it with
    :class:`~graphfl.common.run_lock.FolderBusy` before anything is read or written.

    Raises
    ------
    ConfigError
        With the folder and the reason.
    """
    out = out.resolve()
    if not out.is_dir():
        raise ConfigError(f"--resume {out}: not a folder")
    with run_lock.acquire(out, role="launcher"):
        return _resume_config(out, overrides)


def _resume_config(out: Path, overrides: dict[str, Any] | None) -> RunConfig:
    from graphfl.common.config import config_from_json, parse_run_config
    from graphfl.common.results import atomic_write_text
    from graphfl.server import checkpoint

    path = out / "config.json"
    try:
        saved = config_from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        raise ConfigError(f"--resume {out}: no config.json there (not a graphfl run folder)") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--resume {out}: {path.name} is unusable: {exc}") from None
    if not saved.run_key:
        raise ConfigError(f"--resume {out}: its config has no run-key (written by an older graphfl); start it again")
    meta = checkpoint.read_meta(checkpoint.checkpoint_dir(out))
    flat = {**saved.to_flat(), **(overrides or {}), "out-dir": str(out), "resume": True, "run-key": saved.run_key}
    cfg = parse_run_config(flat, ignore_other_strategies=False)
    checkpoint.check_config(meta, cfg, checkpoint.checkpoint_dir(out) / checkpoint.META)
    status = _status(out)
    if status == "completed" and cfg.rounds <= int(meta["round"]):
        raise ConfigError(f"--resume {out}: the run already completed its {meta['round']} rounds; "
                          f"give --rounds N (N > {meta['round']}) to continue it")
    atomic_write_text(path, json.dumps(cfg.to_json(), indent=2) + "\n")
    logger.info("resuming %s after round %s (it ended %s)", out, meta["round"], status or "without a status")
    return cfg


def _status(out: Path) -> str | None:
    try:
        status = json.loads((out / "run.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None
    return str(status) if status is not None else None


def preflight(cfg: RunConfig) -> None:
    """Fail fast, before any process starts or any file is written, on a run that cannot work.

    Checks the algorithm's minimum number of clients, that the task's data loads and that the
    strategy's trainer serves the client-side options set (``train.eval-local``).
    """
    from graphfl.common import registry
    from graphfl.tasks import registry as tasks

    if cfg.engine == "simulation" and importlib.util.find_spec("ray") is None:
        raise ConfigError("engine = simulation needs Ray, which edge installs leave out: "
                          "pip install 'graphfl[simulation]'")
    spec = registry.get(cfg.strategy)
    if cfg.nodes < spec.min_clients:
        raise ConfigError(f"{cfg.strategy} needs at least {spec.min_clients} clients, got nodes = {cfg.nodes}")
    task = tasks.create(cfg.task, data=cfg.data, data_dir=cfg.data_dir, seed=cfg.seed)
    task.client_data(0, cfg.nodes)
    from graphfl.client.handler import check_client_options

    check_client_options(cfg)
    if spec.preflight is not None:
        from graphfl.client.training import get_arrays, param_keys

        model = task.build_model()
        spec.preflight(cfg, get_arrays(model), param_keys(model))


def run_experiment(
    cfg: RunConfig,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    superlink: str | None = None,
    root_certificates: str | None = None,
    insecure: bool = False,
    run_timeout: float | None = None,
    node_auth: bool = False,
    overwrite: bool = False,
    clientapp_mode: str = "warm",
    on_federation: Callable[[LocalFederation], None] | None = None,
    ray_address: str | None = None,
) -> Path:
    """Run ``cfg``; return the output folder (holding ``run.json``, ``run.md``, ``run.png``).

    The output folder must be new or empty (``overwrite`` replaces a previous run's files), except
    for a resume (``cfg.resume``, a config from :func:`prepare_resume`), which continues the run
    in ``cfg.out_dir`` from its checkpoint on a fresh deployment.
    ``clientapp_mode`` (local deployments): ``warm`` runs each SuperNode's ClientApps in a
    long-lived worker, ``cold`` starts a stock ``flwr-clientapp`` process per message.
    When the run is interrupted (Ctrl-C) or its federation fails, ``run.json`` says so
    (``status`` ``interrupted`` / ``failed`` and the reason) before the error propagates.
    ``on_federation`` (local deployments) is called with the started :class:`LocalFederation`
    before the run is submitted: ``graphfl bench faults`` uses it to reach the processes it
    kills, stops and restarts.
    ``ray_address`` (``HOST:PORT``; default ``$GRAPHFL_RAY_ADDRESS``) makes a simulation join that
    existing Ray cluster instead of starting its own (:mod:`graphfl.deploy.ray_cluster`): it is
    checked before anything is written, and ``run.json`` records the cluster under ``ray_cluster``.
    """
    cluster = _ray_cluster(cfg, superlink, ray_address)
    if superlink is None:
        preflight(cfg)
    if cfg.resume:
        out = Path(cfg.out_dir)
        lock = run_lock.acquire(out, role="launcher", run_key=cfg.run_key)  # nested when the caller holds it
    else:
        cfg, lock = _prepare_held(cfg, overwrite)
        out = lock.folder
    timeout = run_timeout or (cfg.connect_timeout + (cfg.rounds + 2) * cfg.round_timeout)
    try:
        _launch(cfg, out, timeout, on_event, superlink, root_certificates, insecure, node_auth, clientapp_mode,
                on_federation, cluster)
    except KeyboardInterrupt:
        note = finalize_status(out, "interrupted", "stopped by the user (Ctrl-C) before the run finished", cfg)
        if note:
            logger.error("%s", note)
        raise
    except (FederationError, TimeoutError) as exc:
        notes = [n for n in (finalize_status(out, "failed", str(exc), cfg), full_disk(out)) if n]
        if notes:  # the ServerApp may have been unable to say it: the disk the launcher sees
            from graphfl.server.checkpoint import resume_hint

            raise FederationError("; ".join(n for n in (str(exc), *notes, resume_hint(out)) if n)) from exc
        raise
    except OSError as exc:  # the launcher's own files: app folder, run config, logs, certificates
        from graphfl.server.checkpoint import resume_hint

        reason = "; ".join(n for n in (str(exc), how_to_fix(exc, out), resume_hint(out)) if n)
        note = finalize_status(out, "failed", reason, cfg)
        raise FederationError(f"{reason}; {note}" if note else reason) from exc
    finally:
        if cluster is not None:
            ray_cluster.record(out, cluster)
        lock.release()
    return out


def _ray_cluster(cfg: RunConfig, superlink: str | None, address: str | None) -> ray_cluster.RayCluster | None:
    """The existing Ray cluster the run joins (probed, bounded), or ``None`` for Flower's own local Ray.

    ``$GRAPHFL_RAY_ADDRESS`` applies to simulations started here and is ignored by other runs (a
    benchmark mixes engines); the option given for another engine or with ``--superlink`` is refused.
    """
    given = ray_cluster.OPTION if address else f"${ray_cluster.ENV_VAR}"
    address = ray_cluster.resolve_address(address)
    local_simulation = cfg.engine == "simulation" and superlink is None
    if address is None or (given != ray_cluster.OPTION and not local_simulation):
        return None
    if not local_simulation:
        where = f"--superlink {superlink}" if superlink is not None else f"engine = {cfg.engine}"
        raise ConfigError(f"{given} {address}: only a simulation started here joins a Ray cluster "
                          f"(--engine simulation without --superlink), not {where}")
    return ray_cluster.probe(address, option=given)


def _launch(
    cfg: RunConfig, out: Path, timeout: float, on_event: Callable[[dict[str, Any]], None] | None,
    superlink: str | None, root_certificates: str | None, insecure: bool, node_auth: bool,
    clientapp_mode: str = "warm", on_federation: Callable[[LocalFederation], None] | None = None,
    cluster: ray_cluster.RayCluster | None = None,
) -> None:
    """Run ``cfg`` on the chosen engine (in-process, a local federation, or a remote SuperLink)."""
    if superlink is None and cfg.engine in ("inprocess", "batched"):
        from graphfl.server.inprocess import run_federated_inprocess

        with run_lock.acquire(out, name=run_lock.WRITER_LOCK_NAME, role="inprocess", run_key=cfg.run_key):
            run_federated_inprocess(cfg, out, progress=on_event)
        return

    from graphfl.client.state_store import CLIENT_STATE_DIR
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
        return

    simulation = cfg.engine == "simulation"
    with LocalFederation(out, cfg.nodes, tls=True, simulation=simulation, node_auth=node_auth and not simulation,
                         start_timeout=cfg.connect_timeout, clientapp_mode=clientapp_mode,
                         device=cfg.device, state_dir=out / CLIENT_STATE_DIR,
                         env=ray_cluster.superlink_env(cluster) if simulation else {}) as fed:
        if on_federation is not None:
            on_federation(fed)
        sub = fed.submitter()
        fed_cfg = f"num-supernodes={cfg.nodes} client-resources-num-cpus=1" if simulation else None
        handle = sub.submit(app_dir, overrides, out, federation_config=fed_cfg)
        if on_event:
            on_event({"event": "submitted", "run_id": handle.run_id, "superlink": fed.address})
        sub.wait(handle, on_event, timeout=timeout, health=fed.health)
