"""A local federation of real Flower processes, and run submission to any SuperLink.

:class:`LocalFederation` starts one ``flower-superlink`` and N ``flower-supernode`` processes
on 127.0.0.1 (free ports, TLS with a fresh CA by default; or a simulation SuperLink), with a
project-local ``FLWR_HOME`` so nothing touches ``~/.flwr``. :func:`submit_and_wait` submits a
graphfl run with ``flwr run`` (the stable CLI route, FLOWER_NOTES.md §3d), follows its
``progress.jsonl``, and polls ``flwr list`` with a bound on every wait.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphfl.common.certs import ServerTlsFiles, generate_tls
from graphfl.common.config import dump_toml
from graphfl.common.ports import free_port, port_open
from graphfl.deploy import flower_malloc
from graphfl.deploy.processes import Managed, ProcessGroup, tail

logger = logging.getLogger(__name__)

CONNECTION = "graphfl"

STATUS_RETRY_WAITS_S = (1.0, 2.0)
"""Waits before asking again for a run's status when the ``flwr`` CLI found the SuperLink unavailable
(a cut TLS handshake, a dropped connection): a query reads only, so asking again is safe, and one
lost connection does not end the wait for a run that goes on. Submitting is not retried: the CLI's
"unavailable" also covers a request that reached the SuperLink."""

UNAVAILABLE = "Connection to the SuperLink is unavailable"
"""What the ``flwr`` CLI prints for any failed HTTP request (it hides the cause)."""


class FederationError(RuntimeError):
    """The federation or the run failed; the message says where to look."""


SUPERLINK_MIDDLEWARE = ("gated", "stock")
"""``gated``: Flower's SuperLink run by :mod:`graphfl.deploy.superlink`, its API-specific middleware
gated by path (the default); ``stock``: the ``flower-superlink`` command unchanged."""


def superlink_argv(host: str, port: int, tls: ServerTlsFiles | None, simulation: bool = False,
                   database: Path | None = None, node_auth: bool = False, middleware: str = "gated") -> list[str]:
    """Command line of a SuperLink with graphfl's defaults (no runtime installs).

    ``middleware="gated"`` runs ``python -m graphfl.deploy.superlink -- <flower-superlink args>``;
    ``"stock"`` runs ``flower-superlink <args>`` itself.
    """
    if middleware not in SUPERLINK_MIDDLEWARE:
        raise ValueError(f"superlink middleware must be one of {SUPERLINK_MIDDLEWARE}, got {middleware!r}")
    command = (["flower-superlink"] if middleware == "stock"
               else [sys.executable, "-m", "graphfl.deploy.superlink", "--"])
    argv = [*command, "--host", host, "--port", str(port),
            "--disable-runtime-dependency-installation"]
    if tls is None:
        argv.append("--insecure")
    else:
        argv += ["--ssl-ca-certfile", str(tls.ca_cert), "--ssl-certfile", str(tls.server_cert),
                 "--ssl-keyfile", str(tls.server_key)]
    if simulation:
        argv.append("--simulation")
    if database is not None:
        argv += ["--database", str(database)]
    if node_auth:
        argv.append("--enable-supernode-auth")
    return argv


CLIENTAPP_MODES = ("warm", "cold")
"""``warm``: ClientApps run in a long-lived worker per SuperNode (graphfl's executor, the default
for local deployments and ``graphfl supernode``); ``cold``: stock Flower, one ``flwr-clientapp``
process per message."""


def supernode_argv(superlink: str, port: int, partition_id: int, num_partitions: int,
                   ca_cert: Path | None, device: str | None = None, auth_key: Path | None = None,
                   max_wait_time: float | None = None, host: str = "127.0.0.1",
                   clientapp_mode: str = "cold", polls: str | None = None,
                   trace: Path | None = None, state_dir: Path | None = None,
                   data_dir: Path | None = None) -> list[str]:
    """Command line of a SuperNode serving partition ``partition_id`` of ``num_partitions``.

    ``clientapp_mode="cold"`` with stock polls (the defaults) is the stock ``flower-supernode``;
    anything else runs Flower's SuperNode through :mod:`graphfl.deploy.supernode` (``warm``:
    graphfl's warm ClientApp executor; ``polls="fast"``, the default with ``warm``: no 3 s idle
    sleep). ``trace`` (warm) collects per-task timings as JSON lines. ``state_dir`` goes into the
    node config as ``state-dir``: the ClientApp mirrors its state there (absolute path, keyed by
    the run's ``run-key`` and the partition id) so it survives a restart and a ``--resume``.
    ``data_dir`` goes into the node config as ``data-dir``: this SuperNode's own data folder, which
    replaces the run's ``data-dir`` for its client (e.g. a folder holding only its ``device-<id>.csv``).
    """
    if clientapp_mode not in CLIENTAPP_MODES:
        raise ValueError(f"clientapp mode must be one of {CLIENTAPP_MODES}, got {clientapp_mode!r}")
    polls = polls or ("fast" if clientapp_mode == "warm" else "stock")
    if polls not in ("fast", "stock"):
        raise ValueError(f"polls must be 'fast' or 'stock', got {polls!r}")
    node_config = f"partition-id={partition_id} num-partitions={num_partitions}"
    if device:
        node_config += f" device='{device}'"
    if state_dir is not None:
        folder = str(Path(state_dir).resolve())
        if "'" in folder or any(c.isspace() for c in folder):
            raise ValueError(f"state dir {folder!r}: a node-config path cannot hold quotes or spaces")
        node_config += f" state-dir='{folder}'"
    if data_dir is not None:
        folder = str(Path(data_dir).resolve())
        if "'" in folder or any(c.isspace() for c in folder):
            raise ValueError(f"data dir {folder!r}: a node-config path cannot hold quotes or spaces")
        node_config += f" data-dir='{folder}'"
    argv = ["--superlink", superlink, "--host", host, "--port", str(port), "--node-config", node_config]
    argv += ["--insecure"] if ca_cert is None else ["--root-certificates", str(ca_cert)]
    if auth_key is not None:
        argv += ["--auth-supernode-private-key", str(auth_key)]
    if max_wait_time is not None:
        argv += ["--max-wait-time", str(max_wait_time)]
    if clientapp_mode == "cold" and polls == "stock":
        return ["flower-supernode", *argv]
    ours = ["--clientapp-mode", clientapp_mode, "--polls", polls]
    if device and clientapp_mode == "warm":
        ours += ["--device", device]
    if trace is not None and clientapp_mode == "warm":
        ours += ["--trace", str(trace)]
    return [sys.executable, "-m", "graphfl.deploy.supernode", *ours, "--", *argv]


def write_connection(flwr_home: Path, address: str, ca_cert: Path | None, name: str = CONNECTION) -> None:
    """Write ``$FLWR_HOME/config.toml`` with one SuperLink connection (the default)."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    connection: dict[str, Any] = {"address": address}
    if ca_cert is None:
        connection["insecure"] = True
    else:
        connection["root-certificates"] = str(Path(ca_cert).resolve())
    (flwr_home / "config.toml").write_text(dump_toml({"superlink": {"default": name, name: connection}}))


def flwr_cli(args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run ``flwr ARGS --format json``; return its JSON, or raise naming the command."""
    argv = [str(Path(sys.executable).with_name("flwr")), *args, "--format", "json"]
    if not Path(argv[0]).exists():
        argv[0] = "flwr"
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise FederationError(f"`flwr {' '.join(args)}` did not answer within {timeout:.0f} s") from None
    text = proc.stdout.strip()
    start = text.find("{")
    try:
        doc = json.loads(text[start:]) if start >= 0 else {}
    except json.JSONDecodeError:
        doc = {}
    if proc.returncode != 0 or not doc.get("success", False):
        detail = doc.get("error-message") or (proc.stderr.strip() + "\n" + proc.stdout.strip()).strip()
        raise FederationError(f"`flwr {' '.join(args)}` failed: {detail[-2000:]}")
    return doc


@dataclass
class RunHandle:
    """A submitted run: its Flower run id and the folder its ServerApp writes to."""

    run_id: int
    out_dir: Path


@dataclass
class Submitter:
    """Submits runs to one SuperLink connection (``$FLWR_HOME/config.toml``)."""

    flwr_home: Path
    env: dict[str, str]
    connection: str = CONNECTION
    cli_timeout: float = 60.0

    def submit(self, app_dir: Path, overrides_file: Path, out_dir: Path,
               federation_config: str | None = None) -> RunHandle:
        args = ["run", str(app_dir), self.connection, "--run-config", str(overrides_file)]
        if federation_config:
            args += ["--federation-config", federation_config]
        doc = flwr_cli(args, self.env, self.cli_timeout)
        return RunHandle(int(doc["run-id"]), out_dir)

    def status(self, run_id: int, retry_waits: tuple[float, ...] = STATUS_RETRY_WAITS_S) -> str:
        """The run's status (``flwr list --run-id``), asked again after each of ``retry_waits`` while
        the CLI finds the SuperLink unavailable; other failures, and the last try's, are raised.
        """
        for wait in (*retry_waits, None):
            try:
                doc = flwr_cli(["list", self.connection, "--run-id", str(run_id)], self.env, self.cli_timeout)
                break
            except FederationError as exc:
                if wait is None or UNAVAILABLE not in str(exc):
                    raise
                logger.warning("run %d: the SuperLink was unavailable to `flwr list`; asking again in %.0f s",
                               run_id, wait)
                time.sleep(wait)
        runs = doc.get("runs") or []
        return str(runs[0].get("status", "unknown")) if runs else "unknown"

    def stop(self, run_id: int) -> None:
        try:
            flwr_cli(["stop", str(run_id), self.connection], self.env, self.cli_timeout)
        except FederationError as exc:
            logger.debug("flwr stop: %s", exc)

    def wait_status(self, run_id: int, timeout: float,
                    on_event: Callable[[dict[str, Any]], None] | None = None, interval: float = 3.0) -> None:
        """Poll ``flwr list`` until the run finishes (for SuperLinks on other machines, whose
        ServerApp writes its progress file there); bounded by ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status(run_id)
            if on_event is not None:
                on_event({"event": "status", "run_id": run_id, "status": status})
            if status.startswith("finished"):
                if status != "finished:completed":
                    raise FederationError(f"run {run_id} ended with status {status!r}; see `flwr log {run_id}`")
                return
            time.sleep(interval)
        self.stop(run_id)
        raise FederationError(f"run {run_id} did not finish within {timeout:.0f} s")

    def wait(self, handle: RunHandle, on_event: Callable[[dict[str, Any]], None] | None = None,
             timeout: float = 3600.0, status_every: float = 5.0,
             health: Callable[[], None] | None = None) -> dict[str, Any]:
        """Follow ``progress.jsonl`` until the run is done; bounded by ``timeout``.

        The SuperLink is asked for the run's status (``flwr list``, a fresh CLI process that costs
        about a second of CPU) only when no progress event arrived for ``status_every`` s: a run
        that reports every round is never asked, a stalled or crashed one is found within
        ``status_every`` s of its last event. Raises :class:`FederationError` when the run fails
        or stops reporting.
        """
        progress = handle.out_dir / "progress.jsonl"

        def read() -> list[dict[str, Any]]:
            return events_of_run(_read_events(progress), handle.run_id)

        seen = 0
        deadline = time.monotonic() + timeout
        next_status = time.monotonic() + status_every
        while True:
            events = read()
            for ev in events[seen:]:
                if on_event is not None:
                    on_event(ev)
                if ev.get("event") == "error":
                    raise FederationError(f"run {handle.run_id} failed: {ev.get('error')}")
            if len(events) > seen:   # the run reports: no need to ask the SuperLink about it
                next_status = time.monotonic() + status_every
            seen = len(events)
            if events and events[-1].get("event") == "done":
                return events[-1]
            if health is not None:
                health()
            now = time.monotonic()
            if now >= next_status:
                status = self.status(handle.run_id)
                if status.startswith("finished"):
                    events = read()
                    if events and events[-1].get("event") == "done":
                        continue
                    raise FederationError(
                        f"run {handle.run_id} ended with status {status!r} before finishing; "
                        f"see the SuperLink log in {handle.out_dir / 'logs'}")
                next_status = now + status_every
            if now >= deadline:
                self.stop(handle.run_id)
                raise FederationError(f"run {handle.run_id} did not finish within {timeout:.0f} s")
            time.sleep(0.2)


def events_of_run(events: list[dict[str, Any]], run_id: int) -> list[dict[str, Any]]:
    """The progress events written by the ServerApp of Flower run ``run_id`` (others are ignored)."""
    return [ev for ev in events if ev.get("run_id") == run_id]


def _read_events(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written right now
    return events


@dataclass
class LocalFederation:
    """One SuperLink and ``nodes`` SuperNodes as real processes on 127.0.0.1.

    Use as a context manager; on exit (normal, exception or Ctrl-C) every process is stopped.
    ``simulation=True`` starts a simulation SuperLink instead (no SuperNodes; Ray runs the
    ClientApps) — still a real process with its own FLWR_HOME. ``clientapp_mode`` picks how
    SuperNodes run ClientApps (``warm``, the default, or ``cold``, see :data:`CLIENTAPP_MODES`);
    ``device`` goes into every SuperNode's node config (and, warm, creates each worker's CUDA
    context at start-up); ``polls`` overrides the SuperNode poll mode (``fast``/``stock``,
    for measurements); ``superlink_middleware`` picks graphfl's path-gated SuperLink (``gated``,
    the default) or the stock ``flower-superlink`` (see :data:`SUPERLINK_MIDDLEWARE`);
    ``state_dir`` (every SuperNode's ``state-dir``) persists client state; ``data_dirs`` maps a
    partition id to its SuperNode's own ``data-dir`` (node config). ``superlink_host``
    is the address the SuperLink binds and everyone here dials (127.0.0.1; the network bench's
    namespaces use their bridge's address), ``tls_hosts`` extra names in its certificate.
    Warm SuperNodes write per-task timings to ``logs/warm-<i>.jsonl``;
    :meth:`start` returns once their workers hold torch (bounded by ``warm_timeout``, apart
    from ``start_timeout`` for registering with the SuperLink).
    """

    run_dir: Path
    nodes: int
    tls: bool = True
    simulation: bool = False
    start_timeout: float = 60.0
    node_auth: bool = False
    env: dict[str, str] = field(default_factory=dict)
    superlink_port: int = 0
    clientapp_mode: str = "warm"
    device: str | None = None
    polls: str | None = None
    superlink_middleware: str = "gated"
    superlink_host: str = "127.0.0.1"
    tls_hosts: tuple[str, ...] = ()
    warm_timeout: float = 300.0
    state_dir: Path | None = None
    data_dirs: dict[int, Path] = field(default_factory=dict)
    group: ProcessGroup = field(init=False)
    tls_files: ServerTlsFiles | None = field(init=False, default=None)
    _warm: set[str] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        if self.clientapp_mode not in CLIENTAPP_MODES:
            raise FederationError(f"clientapp mode must be one of {CLIENTAPP_MODES}, got {self.clientapp_mode!r}")
        if self.superlink_middleware not in SUPERLINK_MIDDLEWARE:
            raise FederationError(f"superlink middleware must be one of {SUPERLINK_MIDDLEWARE}, "
                                  f"got {self.superlink_middleware!r}")
        self.run_dir = Path(self.run_dir).resolve()
        self.flwr_home = self.run_dir / ".flwr"
        self.env = {"FLWR_HOME": str(self.flwr_home), **self.env}
        self.group = ProcessGroup(self.run_dir / "logs", env=self.env)
        try:
            added = flower_malloc.flower_malloc_env(self.group.base_env())
        except ValueError as exc:
            raise FederationError(str(exc)) from None
        self.malloc_added = added
        self.malloc_note = flower_malloc.describe(self.group.base_env(), added)

    def start_process(self, name: str, argv: list[str]) -> Managed:
        """Start ``argv`` in :attr:`group` with :func:`flower_malloc.process_env` added (with
        ``GRAPHFL_FLOWER_MALLOC=release``, graphfl's SuperLink and SuperNode wrappers get glibc's fixed
        mmap threshold, not their children).
        """
        extra = flower_malloc.process_env(argv, self.group.base_env())
        if extra:
            logger.debug("%s starts with %s", name, extra)
        return self.group.start(name, argv, extra_env=extra)

    @property
    def address(self) -> str:
        return f"{self.superlink_host}:{self.superlink_port}"

    def __enter__(self) -> LocalFederation:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.tls and not self.simulation:
            self.tls_files = generate_tls(self.run_dir / "certs", hosts=[self.superlink_host, *self.tls_hosts])
        if self.node_auth and self.tls_files is None:
            raise FederationError("SuperNode authentication needs TLS (Flower refuses it with --insecure)")
        self.superlink_port = self.superlink_port or free_port()
        logger.log(logging.INFO if self.malloc_added else logging.DEBUG, "allocator: %s", self.malloc_note)
        self.start_process("superlink", superlink_argv(self.superlink_host, self.superlink_port, self.tls_files,
                                                     simulation=self.simulation, node_auth=self.node_auth,
                                                     middleware=self.superlink_middleware))
        self.group.wait_for(f"SuperLink on {self.address}", lambda: port_open(self.superlink_host, self.superlink_port),
                            self.start_timeout)
        ca = self.tls_files.ca_cert if self.tls_files else None
        write_connection(self.flwr_home, self.address, ca)
        if self.simulation:
            return
        keys = self.register_node_keys(self.nodes) if self.node_auth else [None] * self.nodes
        started = [self.start_supernode(i, auth_key=keys[i]) for i in range(self.nodes)]
        self.wait_supernodes(started)

    def start_supernode(self, partition_id: int, name: str | None = None, auth_key: Path | None = None,
                        clientapp_mode: str | None = None) -> Managed:
        """Start the SuperNode serving ``partition_id`` (in this federation's ClientApp mode unless
        ``clientapp_mode`` is given); see :meth:`wait_supernodes`.
        """
        name = name or f"supernode-{partition_id}"
        mode = clientapp_mode or self.clientapp_mode
        ca = self.tls_files.ca_cert if self.tls_files else None
        trace = self.run_dir / "logs" / f"warm-{partition_id}.jsonl" if mode == "warm" else None
        argv = supernode_argv(
            self.supernode_superlink(partition_id), free_port(), partition_id, self.nodes, ca, device=self.device,
            auth_key=auth_key, max_wait_time=self.start_timeout, clientapp_mode=mode, polls=self.polls, trace=trace,
            state_dir=self.state_dir, data_dir=self.data_dirs.get(partition_id))
        proc = self.start_process(name, [*self.supernode_prefix(partition_id), *argv])
        if mode == "warm":
            self._warm.add(name)
        return proc

    def supernode_superlink(self, partition_id: int) -> str:
        """The SuperLink address SuperNode ``partition_id`` dials (subclasses put a link in between)."""
        return self.address

    def supernode_prefix(self, partition_id: int) -> list[str]:
        """Command prefix of SuperNode ``partition_id`` (e.g. ``ip netns exec NS``; none here)."""
        return []

    def wait_supernodes(self, started: list[Managed]) -> None:
        """Wait (bounded) until the SuperNodes registered with the SuperLink and warm ones' workers are ready."""
        from graphfl.deploy.supernode import WARM_OFF_LINE
        from graphfl.deploy.warm import READY_LINE

        self.group.wait_for(f"{len(started)} SuperNodes registered with {self.address}",
                            lambda: all("SuperNode ID" in _read(p.log_path) for p in started), self.start_timeout)
        warm = [p for p in started if p.name in self._warm]
        if warm:   # ready, or the warm fast path is off there (stock ClientApp processes)
            self.group.wait_for(f"the warm ClientApp workers of {len(warm)} SuperNodes",
                                lambda: all(any(line in _read(p.log_path) for line in (READY_LINE, WARM_OFF_LINE))
                                            for p in warm), self.warm_timeout)

    def register_node_keys(self, count: int, first: int = 0) -> list[Path]:
        """Generate ``count`` SuperNode key pairs and register their public keys with the
        SuperLink (``flwr supernode register``); returns the private key paths.
        """
        from graphfl.common.certs import generate_node_keys

        pairs = generate_node_keys(self.run_dir / "certs" / "keys", count, first=first)
        sub = self.submitter()
        for _, pub in pairs:
            flwr_cli(["supernode", "register", str(pub), sub.connection], sub.env, sub.cli_timeout)
        return [priv for priv, _ in pairs]

    def submitter(self) -> Submitter:
        return Submitter(self.flwr_home, self.group.base_env())

    def health(self) -> None:
        """Raise if the SuperLink died (SuperNodes are allowed to come and go)."""
        sl = self.group.procs[0]
        if sl.popen.poll() is not None:
            raise FederationError(f"the SuperLink exited with code {sl.popen.returncode}:\n{tail(sl.log_path)}")

    def stop(self) -> list[int]:
        return self.group.stop()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
