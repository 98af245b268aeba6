"""The ``graphfl`` command line (typer + rich). See ``graphfl --help`` and README.md.

Stable commands (DESIGN.md): ``run``, ``superlink``, ``supernode``, ``peer``, ``p2p``,
``bench``; plus ``certs`` (TLS material and SuperNode keys) and ``list``.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from graphfl.common.config import ConfigError, device_problem

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="graphfl: graph-aware federated learning on Flower and a gRPC peer-to-peer layer.")
console = Console(stderr=True)
logger = logging.getLogger("graphfl.cli")

BENCHMARKS = {
    "admm": "graphfl.bench.admm",
    "apflgate": "graphfl.bench.apflgate",
    "fedrelax": "graphfl.bench.fedrelax",
    "jgesr": "graphfl.bench.jgesr",
    "jgesr-cost": "graphfl.bench.jgesr_cost",
    "heterogeneity": "graphfl.bench.heterogeneity",
    "multicenter-regime": "graphfl.bench.multicenter_regime",
    "multicenter": "graphfl.bench.multicenter",
    "dfl": "graphfl.bench.dfl",
    "dfl-regime": "graphfl.bench.dfl_regime",
    "engine": "graphfl.bench.engine",
    "p2p-throughput": "graphfl.bench.p2p_throughput",
    "deploy": "graphfl.bench.deploy",
    "deploy-perhop": "graphfl.bench.deploy_perhop",
    "network": "graphfl.bench.network",
    "faults": "graphfl.bench.faults",
}


def setup_logging(verbose: bool = False) -> None:
    """Rich log handler for the command line; graphfl at INFO (DEBUG with ``verbose``), others at WARNING."""
    level = logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=logging.WARNING, format="%(message)s", datefmt="[%X]",
                        handlers=[RichHandler(console=console, show_path=False)], force=True)
    logging.getLogger("graphfl").setLevel(level)


def fail(message: str, code: int = 2) -> None:
    """Print ``error: message`` and exit with ``code``."""
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code)


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    setup_logging(verbose)


def build_config(config_file: Path | None, sets: list[str], flags: dict[str, Any]):
    """Defaults < --config FILE < --set key=value < explicit flags; validated once.

    When no source sets ``nodes``, the run uses the task's ``default_nodes`` (``graphfl list``:
    digits 4, bbbp 16, ciao 28, ...; DESIGN/ALGORITHMS give each task's client count), not
    the generic default of :class:`~graphfl.common.config.RunConfig`.
    """
    from graphfl.common.config import RunConfig, flatten, load_toml, parse_assignment, parse_run_config
    from graphfl.tasks import registry as tasks

    values: dict[str, Any] = {}
    if config_file is not None:
        values.update(flatten(load_toml(config_file)))
    for item in sets:
        key, value = parse_assignment(item)
        values[key] = value
    values.update({k: v for k, v in flags.items() if v is not None})
    task = str(values.get("task", RunConfig.task))
    if "nodes" not in values and task in tasks.names():  # an unknown task is reported by parse_run_config
        values["nodes"] = tasks.get(task).spec.default_nodes
    return parse_run_config(values, ignore_other_strategies=False)


class RoundPrinter:
    """Shows a progress bar and one line per evaluated round."""

    def __init__(self, rounds: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, transient=False)
        self.task = self.progress.add_task("starting", total=rounds)
        self.last_eval: int | None = None

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def __call__(self, ev: dict[str, Any]) -> None:
        kind = ev.get("event")
        if kind == "submitted":
            self.progress.update(self.task, description=f"run {ev['run_id']} on {ev['superlink']}")
        elif kind in ("round", "done"):
            r = int(ev.get("round", 0))
            parts = ["final" if kind == "done" else ("join" if r == 0 else f"round {r}")]
            if kind == "round" and r > 0 and ev.get("train_loss") is not None:
                parts.append(f"train loss {ev['train_loss']:.4g}")
            if kind == "round" and ev.get("seconds") is not None:
                parts.append(f"{ev['seconds']:.2f} s")
            eval_round = ev.get("eval_round", r)
            if ev.get("test_loss") is not None and eval_round != self.last_eval:
                self.last_eval = eval_round
                what = "initial model" if eval_round == 0 else f"after round {eval_round}"
                acc = f", acc {ev['test_acc']:.4f}" if ev.get("test_acc") is not None else ""
                acc += "".join(f", {name} {ev[k]:.4f}" for k, name in (("test_auc", "ROC-AUC"), ("test_mae", "MAE"))
                               if ev.get(k) is not None)
                parts.append(f"| {what}: test loss {ev['test_loss']:.4g}{acc}")
            self.progress.console.print("  ".join(parts))
            self.progress.update(self.task, completed=r, description="training" if kind == "round" else "done")
        elif kind == "status":
            self.progress.update(self.task, description=f"run {ev['run_id']}: {ev['status']}")
        elif kind == "resumed":
            self.progress.console.print(f"resumed from the checkpoint of round {ev.get('round')}")
            self.progress.update(self.task, completed=int(ev.get("round", 0)), description="training")


@app.command()
def run(
    strategy: str | None = typer.Option(None, help="Algorithm name (see `graphfl list`)."),
    task: str | None = typer.Option(None, help="Task name (see `graphfl list`)."),
    nodes: int | None = typer.Option(None, help="Number of clients / SuperNodes (default: the task's own count, "
                                     "`graphfl list`: digits 4, bbbp 16, ciao 28)."),
    rounds: int | None = typer.Option(None, help="Federated rounds."),
    engine: str | None = typer.Option(None, help="local-deployment | simulation | inprocess | batched "
                                          "(in-process, a round's clients trained as one stacked computation)."),
    config: Path | None = typer.Option(None, "--config", help="TOML file with run-config keys."),
    out: Path | None = typer.Option(None, "--out", help="Output folder (default ./runs/<timestamp>)."),
    seed: int | None = typer.Option(None, help="Random seed."),
    data_dir: Path | None = typer.Option(None, help="Data folder (default $GRAPHFL_DATA)."),
    set_: list[str] = typer.Option([], "--set", help="Override any key: --set train.lr=0.1 (repeatable)."),
    superlink: str | None = typer.Option(None, help="Submit to an existing SuperLink HOST:PORT."),
    root_certificates: Path | None = typer.Option(None, help="CA certificate of --superlink."),
    insecure: bool = typer.Option(False, help="Plain HTTP to --superlink (no TLS)."),
    node_auth: bool = typer.Option(False, help="Local deployment: SuperNodes authenticate with registered keys."),
    overwrite: bool = typer.Option(False, help="Replace a previous run's files in --out (default: refuse a non-empty --out)."),
    device: str | None = typer.Option(None, help="auto | cpu | cuda | cuda:N (goes into each SuperNode's node config)."),
    clientapp_mode: str = typer.Option("warm", help="Local deployment: warm (one long-lived ClientApp worker per "
                                       "SuperNode) or cold (stock Flower: a flwr-clientapp process per message)."),
    resume: Path | None = typer.Option(None, "--resume", help="Continue the run in this folder from its checkpoint "
                                       "(its config.json; --rounds may grow it; other changes are refused)."),
    dashboard: bool = typer.Option(False, "--dashboard", help="Serve the live dashboard of this run on "
                                   "127.0.0.1 (address printed) while it runs."),
    ray_address: str | None = typer.Option(None, "--ray-address", help="Simulation: join the existing Ray "
                                           "cluster whose head is HOST:PORT (`ray start --head` prints it) "
                                           "instead of starting a local Ray (default $GRAPHFL_RAY_ADDRESS)."),
) -> None:
    """Run one experiment and write run.json / run.md / run.png (or continue one with --resume DIR)."""
    flags = {"strategy": strategy, "task": task, "nodes": nodes, "rounds": rounds, "engine": engine,
             "seed": seed, "out-dir": str(out) if out else None, "data-dir": str(data_dir) if data_dir else None,
             "device": device}
    if clientapp_mode not in ("warm", "cold"):
        fail(f"--clientapp-mode must be warm or cold, got {clientapp_mode!r}")
    with ExitStack() as owned:  # --resume: the folder is this process's from the check to the run's end
        try:
            if resume is not None:
                if resume.is_dir():
                    from graphfl.common import run_lock

                    owned.enter_context(run_lock.acquire(resume.resolve(), role="launcher"))
                cfg = _resume_config(resume, out, config, set_, flags)
            else:
                cfg = build_config(config, set_, flags)
        except ConfigError as exc:
            fail(str(exc))
        if dashboard:
            import dataclasses

            from graphfl.deploy.run import default_out_dir

            if not cfg.out_dir:
                cfg = dataclasses.replace(cfg, out_dir=str(default_out_dir()))
            server = _start_dashboard([Path(cfg.out_dir)])
            owned.callback(_stop_dashboard, server)
        _run_and_report(cfg, superlink, root_certificates, insecure, node_auth, overwrite, clientapp_mode,
                        ray_address)
        if dashboard and sys.stdin.isatty():
            console.print(f"run finished; the dashboard stays at {server.url()} until Ctrl-C")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass


def _run_and_report(cfg: Any, superlink: str | None, root_certificates: Path | None, insecure: bool,
                    node_auth: bool, overwrite: bool, clientapp_mode: str, ray_address: str | None = None) -> None:
    """Run ``cfg`` with the progress display; one error line (exit 1) for a run that cannot finish."""
    from graphfl.deploy.federation import FederationError
    from graphfl.deploy.run import run_experiment
    from graphfl.server.rounds import RunError
    from graphfl.tasks.base import DataError

    where = f"SuperLink {superlink}" if superlink else cfg.engine
    console.print(f"[bold]graphfl run[/]: {cfg.strategy} on {cfg.task}, {cfg.nodes} nodes, "
                  f"{cfg.rounds} rounds, {where}{f', resuming {cfg.out_dir}' if cfg.resume else ''}")
    try:
        with RoundPrinter(cfg.rounds) as printer:
            out_dir = run_experiment(cfg, printer, superlink=superlink,
                                     root_certificates=str(root_certificates) if root_certificates else None,
                                     insecure=insecure, node_auth=node_auth, overwrite=overwrite,
                                     clientapp_mode=clientapp_mode, ray_address=ray_address)
    except (FederationError, DataError, ConfigError, TimeoutError, RunError) as exc:
        fail(str(exc), code=1)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: the run's processes were stopped and run.json marks the run "
                      "'interrupted'[/]")
        raise typer.Exit(130) from None
    if superlink:
        console.print(f"run finished on {superlink}; results are on the SuperLink host under {cfg.out_dir or 'its out-dir'}")
        return
    _print_final(out_dir)


def _resume_config(folder: Path, out: Path | None, config: Path | None, sets: list[str], flags: dict[str, Any]):
    """The config of ``graphfl run --resume FOLDER`` (FOLDER's config.json plus the given flags)."""
    from graphfl.common.config import flatten, load_toml, parse_assignment
    from graphfl.deploy.run import prepare_resume

    if out is not None and out.resolve() != folder.resolve():
        raise ConfigError(f"--resume {folder} continues the run in that folder; --out {out} must be left out")
    overrides: dict[str, Any] = flatten(load_toml(config)) if config else {}
    overrides.update({k: v for k, v in flags.items() if v is not None and k != "out-dir"})
    overrides.update(dict(parse_assignment(a) for a in sets))
    return prepare_resume(folder, overrides)


def _print_final(out_dir: Path) -> None:
    import json

    doc = json.loads((out_dir / "run.json").read_text())
    table = Table(title=f"results in {out_dir}")
    extra = [k for k in ("test_auc", "test_mae") if any(r["final"].get(k) is not None for r in doc["methods"].values())]
    for col in ("method", "test_loss", "test_acc", *extra, "seconds/round", "rounds"):
        table.add_column(col)
    for name, res in doc["methods"].items():
        fin = res["final"]
        fmt = lambda v: "–" if v is None else f"{v:.4g}"  # noqa: E731
        table.add_row(name, fmt(fin.get("test_loss")), fmt(fin.get("test_acc")), *(fmt(fin.get(k)) for k in extra),
                      fmt(fin.get("seconds_per_round")), str(fin.get("rounds_completed")))
    Console().print(table)


def _start_dashboard(folders: list[Path], host: str = "127.0.0.1", port: int = 0) -> Any:
    """Bind the dashboard on ``host:port``, serve it on a daemon thread and print its address."""
    from graphfl.dashboard.server import make_server, serve_in_thread

    try:
        server = make_server(folders, host=host, port=port)
    except OSError as exc:
        fail(f"the dashboard cannot listen on {host}:{port}: {exc.strerror or exc}")
    serve_in_thread(server)
    console.print(f"[bold]dashboard[/]: {server.url()}"
                  + ("  (the token in this address is required; keep it private)" if server.dashboard.token else ""))
    return server


@contextmanager
def _dashboard_beside(folder: Path) -> Iterator[None]:
    """The dashboard of ``folder`` for the life of a ``with`` block (``--dashboard``)."""
    server = _start_dashboard([folder])
    try:
        yield
    finally:
        _stop_dashboard(server)


def _stop_dashboard(server: Any, grace_s: float = 2.5) -> None:
    """Stop the dashboard of ``graphfl run --dashboard`` after ``grace_s`` seconds (more than the
    page's 1 s poll, so an open page shows the run's last state before the server goes).
    """
    time.sleep(grace_s)
    server.shutdown()
    server.server_close()


@app.command()
def dashboard(
    folders: list[Path] = typer.Argument(..., help="Run folders, p2p output folders or benchmark result folders."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on; any non-loopback host requires the printed "
                             "one-time token."),
    port: int = typer.Option(0, help="Port (0: a free one)."),
) -> None:
    """Serve a live, read-only web view of run / p2p / benchmark folders (docs/dashboard.md)."""
    if not 0 <= port <= 65535:
        fail(f"--port must be 0..65535, got {port}")
    server = _start_dashboard(list(folders), host, port)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        console.print("dashboard stopped")
    finally:
        server.shutdown()
        server.server_close()


@app.command("list")
def list_() -> None:
    """List strategies, tasks and benchmarks."""
    from graphfl.common import registry
    from graphfl.tasks import registry as tasks

    t = Table(title="strategies")
    t.add_column("name")
    t.add_column("summary")
    t.add_column("parameters")
    for spec in registry.all_specs():
        import dataclasses

        t.add_row(spec.name, spec.summary, ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(spec.params()).items()))
    Console().print(t)
    t = Table(title="tasks")
    for col in ("name", "kind", "default nodes", "summary"):
        t.add_column(col)
    for name in tasks.names():
        s = tasks.get(name).spec
        t.add_row(s.name, s.kind, str(s.default_nodes), s.summary)
    Console().print(t)
    Console().print("benchmarks: " + ", ".join(sorted(BENCHMARKS)))


@app.command()
def certs(
    out: Path = typer.Argument(..., help="Folder for ca.crt, server.pem, server.key (and keys/, p2p/)."),
    host: list[str] = typer.Option([], "--host", help="Extra IP/DNS name of the SuperLink (repeatable)."),
    node_keys: int = typer.Option(0, help="Also write N SuperNode auth key pairs into OUT/keys."),
    peers: int = typer.Option(0, help="Also write a p2p network CA and N peer certificates into OUT/p2p."),
    peer_host: list[str] = typer.Option([], "--peer-host", help="Extra IP/DNS name in every peer certificate "
                                        "(repeatable; peers are checked by their name peer-<id>, so this is optional)."),
    days: int = typer.Option(365, help="Validity in days."),
    overwrite: bool = typer.Option(False, help="Replace the CA and everything else already in OUT."),
) -> None:
    """Generate all TLS material for a federation: a CA and SuperLink certificate, optional SuperNode
    authentication keys (--node-keys N) and an optional p2p network CA with N peer certificates (--peers N).

    Private keys are written with mode 0600. Keep ca.key and p2p/ca.key on the machine that made them;
    docs/edge-guide.md lists which files go to which device.
    """
    from graphfl.common.certs import default_hosts, generate_network_certs, generate_node_keys, generate_tls

    for name, value in (("--node-keys", node_keys), ("--peers", peers)):
        if value < 0:
            fail(f"{name} must be >= 0, got {value}")
    if days < 1:
        fail(f"--days must be >= 1, got {days}")
    existing = [p for p in (out / "ca.crt", out / "p2p" / "ca.crt") if p.exists()]
    if existing and not overwrite:
        fail(f"{existing[0]} exists: a new CA invalidates every certificate and device set up with the old one; "
             "give --overwrite to replace it, or another folder")
    files = generate_tls(out, host, days=days)
    console.print(f"CA {files.ca_cert}\nserver certificate {files.server_cert} (key {files.server_key})")
    if node_keys:
        pairs = generate_node_keys(out / "keys", node_keys)
        console.print(f"{len(pairs)} SuperNode key pairs in {out / 'keys'} (register the .pub files with "
                      "`flwr supernode register`)")
    if peers:
        p2p_dir = generate_network_certs(out / "p2p", peers, tuple(default_hosts(peer_host)), days=days)
        console.print(f"p2p CA and {peers} peer certificates in {p2p_dir} (device i gets ca.crt, "
                      "peer-<i>.crt, peer-<i>.key)")


@app.command()
def superlink(
    host: str = typer.Option("127.0.0.1", help="Address to bind (0.0.0.0 for other machines)."),
    port: int = typer.Option(9091, help="Port for Fleet, Control and Runtime APIs."),
    certs_dir: Path | None = typer.Option(None, "--certs", help="Folder from `graphfl certs` (TLS)."),
    insecure: bool = typer.Option(False, help="No TLS (only on trusted networks)."),
    simulation: bool = typer.Option(False, help="Simulation SuperLink (Ray)."),
    database: Path | None = typer.Option(None, help="SQLite state file (default in memory)."),
    node_auth: bool = typer.Option(False, help="Only registered SuperNodes may connect."),
    middleware: str = typer.Option("gated", help="gated: Flower's SuperLink with its Control/Fleet/Runtime-only "
                                   "middleware skipped on other APIs' paths (faster requests); stock: "
                                   "flower-superlink unchanged."),
) -> None:
    """Start a Flower SuperLink with graphfl's defaults (no runtime installs, no telemetry)."""
    from graphfl.common.certs import ServerTlsFiles
    from graphfl.deploy.federation import superlink_argv

    tls = None
    if not insecure:
        if certs_dir is None:
            fail("give --certs DIR (see `graphfl certs`) or --insecure")
            return
        tls = ServerTlsFiles(certs_dir / "ca.crt", certs_dir / "server.pem", certs_dir / "server.key")
    if tls:
        for p in (tls.ca_cert, tls.server_cert, tls.server_key):
            if not p.is_file():
                fail(f"missing TLS file {p} (create it with `graphfl certs {certs_dir}`)")
    from graphfl.deploy.federation import SUPERLINK_MIDDLEWARE

    if middleware not in SUPERLINK_MIDDLEWARE:
        fail(f"--middleware must be one of {', '.join(SUPERLINK_MIDDLEWARE)}, got {middleware!r}")
    _exec(superlink_argv(host, port, tls, simulation=simulation, database=database, node_auth=node_auth,
                         middleware=middleware))


@app.command()
def supernode(
    superlink_addr: str = typer.Option(..., "--superlink", help="SuperLink HOST:PORT."),
    partition_id: int = typer.Option(..., help="This client's partition (0..N-1)."),
    num_partitions: int = typer.Option(..., help="Number of partitions N (= run's nodes)."),
    device: str | None = typer.Option(None, help="auto | cpu | cuda | cuda:N (default: cuda if available)."),
    root_certificates: Path | None = typer.Option(None, help="CA certificate of the SuperLink."),
    insecure: bool = typer.Option(False, help="Plain HTTP (only if the SuperLink is --insecure)."),
    port: int = typer.Option(9094, help="Local ClientApp API port (distinct per SuperNode on one host)."),
    auth_key: Path | None = typer.Option(None, help="Private key for SuperNode authentication."),
    max_wait_time: float | None = typer.Option(None, help="Give up after S seconds without the SuperLink."),
    clientapp_mode: str = typer.Option("warm", help="warm: ClientApps run in one long-lived worker (torch, data and "
                                       "CUDA context kept); cold: stock Flower, a flwr-clientapp process per message."),
    state_dir: Path | None = typer.Option(None, help="Mirror the client's state to this folder (keyed by the run's "
                                          "run-key and the partition id): it survives a restart and `graphfl run --resume`."),
    data_dir: Path | None = typer.Option(None, help="This SuperNode's own data folder (e.g. holding only its "
                                         "device-<id>.csv); replaces the run's data-dir for its client."),
) -> None:
    """Start a Flower SuperNode serving one graphfl partition."""
    from graphfl.deploy.federation import supernode_argv

    if not insecure and root_certificates is None:
        fail("give --root-certificates CA.crt or --insecure")
    if root_certificates is not None and not root_certificates.is_file():
        fail(f"CA certificate not found: {root_certificates}")
    if not 0 <= partition_id < num_partitions:
        fail(f"--partition-id must be in 0..{num_partitions - 1}")
    if device is not None and device_problem(device):
        fail(f"--device {device!r} is not valid; {device_problem(device)}")
    if clientapp_mode not in ("warm", "cold"):
        fail("--clientapp-mode must be warm or cold")
    if data_dir is not None and not data_dir.is_dir():
        fail(f"--data-dir {data_dir}: not a folder")
    _exec(supernode_argv(superlink_addr, port, partition_id, num_partitions, root_certificates,
                         device=device, auth_key=auth_key, max_wait_time=max_wait_time,
                         clientapp_mode=clientapp_mode, state_dir=state_dir, data_dir=data_dir))


def _exec(argv: list[str]) -> None:
    from graphfl.deploy.processes import QUIET_FLOWER_ENV

    os.environ.update({k: v for k, v in QUIET_FLOWER_ENV.items() if k not in os.environ})
    console.print("exec: " + " ".join(argv))
    try:
        os.execvp(argv[0], argv)
    except FileNotFoundError:
        fail(f"{argv[0]} not found on PATH; install graphfl (which installs flwr) in this environment")


@app.command()
def bench(
    name: str = typer.Argument(..., help="Benchmark: " + ", ".join(sorted(BENCHMARKS))),
    quick: bool = typer.Option(False, help="Small version that finishes in minutes."),
    seed: int = typer.Option(0, help="Base random seed."),
    out: Path | None = typer.Option(None, "--out", help="Output folder (default ./runs/bench-NAME-<ts>)."),
    task: str | None = typer.Option(None, "--task",
                                    help="Task, for benchmarks that take one "
                                         "(apflgate; jgesr: digits, digits-permuted, mnist, cifar10)."),
    data_dir: str | None = typer.Option(None, "--data-dir", help="Data folder, for benchmarks that take one."),
    emulation: str | None = typer.Option(None, "--emulation",
                                         help="Link emulation, for benchmarks that take one (network: auto = "
                                         "namespaces + netem where the kernel has netem, else user-space; "
                                         "user-space; netns)."),
    form: str | None = typer.Option(None, "--form",
                                    help="Form between --quick and the full one, for benchmarks that have one "
                                         "(admm: paper; jgesr: regime, on digits-permuted unless --task; "
                                         "heterogeneity: personal, personal-bbbp, personal-bbbp-r20, "
                                         "personal-bbbp-r20-skews, personal-bbbp-r20x16; "
                                         "p2p-throughput: 4-nodes; "
                                         "multicenter-regime: bigfl)."),
) -> None:
    """Reproduce a paper experiment; writes <out>/<name>.json/.md/.png."""
    from graphfl.deploy.run import default_out_dir

    if name not in BENCHMARKS:
        fail(f"unknown benchmark {name!r}; valid: {sorted(BENCHMARKS)}")
    try:
        module = importlib.import_module(BENCHMARKS[name])
    except ImportError as exc:
        fail(f"benchmark {name!r} is not available: {exc}")
    extra: dict[str, str] = {}
    accepted = inspect.signature(module.run).parameters
    for option, value in (("task", task), ("data_dir", data_dir), ("emulation", emulation), ("form", form)):
        if value is None:
            continue
        if option not in accepted:
            fail(f"benchmark {name!r} takes no --{option.replace('_', '-')}")
        extra[option] = value
    if task is not None:
        from graphfl.tasks import registry as task_registry

        task_registry.get(task)  # ConfigError listing the valid tasks
    out_dir = (out or default_out_dir(f"runs/bench-{name}")).resolve()
    if out_dir.is_dir() and any(out_dir.iterdir()) and not getattr(module, "RESUMABLE", False):
        present = sorted(p.name for p in out_dir.iterdir())
        fail(f"--out {out_dir} already holds {', '.join(present[:6])}{' ...' if len(present) > 6 else ''}; "
             f"benchmark {name!r} does not continue an earlier run, so its files would mix with this one's: "
             "choose a new --out (benchmarks with a run cache, e.g. apflgate, continue in the same --out)")
    out_dir.mkdir(parents=True, exist_ok=True)
    module.run(quick=quick, seed=seed, out=out_dir, **extra)
    console.print(f"results in {out_dir}")


def _register_plugins() -> None:
    """Commands defined next to their subsystem (p2p)."""
    try:
        plugin = importlib.import_module("graphfl.deploy.p2p_cli")
    except ImportError as exc:  # the p2p layer may be absent in a trimmed install
        logger.debug("p2p commands unavailable: %s", exc)
        return
    plugin.register(app)
    # graphfl p2p --dashboard (deploy/ cannot import the dashboard, which sits above it)
    setattr(plugin, "DASHBOARD", _dashboard_beside)  # noqa: B010 (a module loaded by name)


_register_plugins()


def main() -> None:
    """Entry point of the ``graphfl`` command."""
    try:
        app()
    except ConfigError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        sys.exit(2)


if __name__ == "__main__":  # pragma: no cover
    main()
