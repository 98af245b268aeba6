"""``graphfl peer`` and ``graphfl p2p`` commands (wired into the main CLI with :func:`register`).

Also runnable without the main CLI: ``python -m graphfl.p2p peer ...`` / ``python -m graphfl.p2p p2p ...``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import typer

from graphfl.common.config import ConfigError, parse_assignment
from graphfl.p2p.algorithms import registry
from graphfl.p2p.config import load_network_file

TOPOLOGY_HELP = "ring | grid | complete | erdos-renyi | knn | a network .toml | an edge-list file"
_ALGORITHMS = " | ".join(registry.names())


def _overrides(items: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        key, value = parse_assignment(item)
        out[key] = value
    return out


def peer_command(
    topology: Path = typer.Option(..., "--topology", help="network file (.toml) with peers, edges, \\[run] and \\[tls]"),
    peer_id: int = typer.Option(..., "--id", help="this peer's id in the network file"),
    out: Path = typer.Option(Path("runs/p2p"), "--out", help="directory for peer-<id>.json/.npz"),
    insecure: bool = typer.Option(False, "--insecure", help="plaintext gRPC (no TLS); must be explicit"),
    set_: list[str] | None = typer.Option(None, "--set", help="override a \\[run] key, e.g. --set rounds=50"),
    resume: bool = typer.Option(False, "--resume", help="continue from this peer's checkpoint in --out"),
    device: str | None = typer.Option(None, "--device", help="auto | cpu | cuda | cuda:N (overrides the network "
                                      "file's; auto keeps models under 100k parameters on the CPU)"),
    listen: str | None = typer.Option(None, "--listen", help="HOST:PORT to bind when it differs from this peer's "
                                      "address in the network file (port forwarding, NAT, a link emulator)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace this peer's finished results in --out "
                                   "(default: refuse them; --resume continues instead)"),
) -> None:
    """Run one p2p peer process (one per device)."""
    # imported when the command runs: every graphfl command imports this module at start-up
    from graphfl.deploy.p2p_outdir import claim_peer_folder
    from graphfl.p2p.peer import main

    try:
        overrides = _overrides(set_)
        lock = claim_peer_folder(out, peer_id, resume=resume, overwrite=overwrite,
                                 rounds=_rounds_of(topology, overrides))
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    with lock:  # held while the peer runs; the OS drops it if the process is killed
        code = main(str(topology), peer_id, str(out), overrides, insecure, resume, device, listen)
    raise typer.Exit(code)


def _rounds_of(topology: Path, overrides: dict[str, Any]) -> int | None:
    """The rounds a peer of ``topology`` runs with ``overrides`` (``None`` if the file does not load:
    the peer then reports why).
    """
    try:
        return load_network_file(str(topology), overrides).run.rounds
    except (ConfigError, OSError, ValueError):
        return None


DASHBOARD: Callable[[Path], AbstractContextManager[Any]] | None = None
"""Serves the live dashboard of an output folder for the life of a ``with`` block; set by the
``graphfl`` command line (the dashboard sits above this layer), ``None`` under ``python -m graphfl.p2p``."""


def p2p_command(
    algorithm: str = typer.Option("dfl-gt", "--algorithm", help="a registered p2p algorithm: " + _ALGORITHMS),
    topology: str | None = typer.Option(None, "--topology", help=TOPOLOGY_HELP + " (default ring, or DIR/edges.txt)"),
    graph: Path | None = typer.Option(None, "--graph", help="the graph as an edge-list file ('i j [weight]' lines)"),
    data_dir: Path | None = typer.Option(None, "--data-dir",
                                         help="your data: DIR/device-<id>.csv, one per peer (problem csv; docs/data.md)"),
    peers: int | None = typer.Option(None, "--peers", help="number of peers (default 5, or one per device file)"),
    rounds: int = typer.Option(100, "--rounds", help="communication rounds"),
    out: Path | None = typer.Option(None, "--out", help="output directory (default runs/p2p-<timestamp>)"),
    tau: int | None = typer.Option(None, "--tau", help="gossip every tau local steps (algorithms with a tau)"),
    problem: str | None = typer.Option(None, "--problem",
                                       help="a task name, or linreg | clusters | clusters-logistic | csv | vector "
                                            "(default synthetic-dfl, or csv with --data-dir)"),
    mixing: str = typer.Option("metropolis", "--mixing", help="metropolis | max-degree | laplacian"),
    seed: int = typer.Option(0, "--seed"),
    insecure: bool = typer.Option(False, "--insecure", help="plaintext (default: a fresh CA and mutual TLS)"),
    timeout: float = typer.Option(0.0, "--timeout", help="overall bound in seconds (0 = derived from rounds)"),
    set_: list[str] | None = typer.Option(None, "--set", help="override a \\[run] key, e.g. --set round-timeout=5"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress display"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace a previous p2p run's files in --out "
                                   "(default: refuse a non-empty --out)"),
    device: str | None = typer.Option(None, "--device", help="every peer's device: auto | cpu | cuda | cuda:N "
                                      "(auto keeps models under 100k parameters on the CPU)"),
    engine: str = typer.Option("process", "--engine",
                               help="process (one peer process per node, gRPC) | inprocess (all nodes in this process, "
                                    "lock-step, no sockets; 1000+ nodes on linear models)"),
    dashboard: bool = typer.Option(False, "--dashboard", help="serve the live dashboard of --out on 127.0.0.1 "
                                   "(address printed) while the network runs"),
) -> None:
    """Launch N local peer processes on 127.0.0.1 (or run the network in-process), results in <out>/p2p.{json,md,png}."""
    # imported when the command runs (gRPC, the peers' problems): graphfl imports this module at start-up
    from graphfl.deploy.p2p_inprocess import ENGINES, launch_inprocess
    from graphfl.deploy.p2p_launch import LaunchError, default_out, launch
    from graphfl.deploy.p2p_outdir import claim_network_folder
    from graphfl.tasks.base import DataError

    try:
        if graph is not None and topology is not None:
            raise ConfigError("give --graph or --topology, not both")
        overrides: dict[str, Any] = {"algorithm": algorithm, "rounds": rounds, "seed": seed}
        if problem is not None:
            overrides["problem"] = problem
        if tau is not None:
            overrides["tau"] = tau
        overrides.update(_overrides(set_))
        if engine not in ENGINES:
            raise ConfigError(f"--engine {engine!r} is not valid; choose one of {list(ENGINES)}")
        if dashboard and DASHBOARD is None:
            raise ConfigError("--dashboard needs the graphfl command (graphfl p2p --dashboard)")
        folder = out if out is not None else default_out()
        with DASHBOARD(folder) if dashboard and DASHBOARD is not None else nullcontext():
            if engine == "inprocess":
                if insecure or timeout:
                    raise ConfigError("--insecure and --timeout apply to the process engine only "
                                      "(inprocess opens no socket)")
                with claim_network_folder(folder, overwrite):
                    summary = launch_inprocess(str(graph) if graph is not None else topology, peers, overrides,
                                               out=folder, mixing=mixing, data_dir=data_dir, device=device)
                typer.echo(summary["text"])
                raise typer.Exit(0 if summary["ok"] else 1)
            summary = launch(str(graph) if graph is not None else topology, peers, overrides, out=folder,
                             insecure=insecure, mixing=mixing, timeout=timeout or None, progress=not quiet,
                             data_dir=data_dir, device=device, overwrite=overwrite)
    except (ConfigError, LaunchError, DataError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        typer.echo("interrupted; all peers stopped", err=True)
        raise typer.Exit(130) from None
    typer.echo(summary["text"])
    raise typer.Exit(0 if summary["ok"] else 1)


def register(app: typer.Typer) -> None:
    """Add ``peer`` and ``p2p`` to the graphfl typer app."""
    app.command("peer")(peer_command)
    app.command("p2p")(p2p_command)


def make_app() -> typer.Typer:
    """A stand-alone Typer app with the ``peer`` and ``p2p`` commands (``python -m graphfl.p2p``)."""
    app = typer.Typer(add_completion=False, no_args_is_help=True, help="graphfl peer-to-peer layer")
    register(app)
    return app
