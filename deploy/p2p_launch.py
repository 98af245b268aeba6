"""``graphfl p2p``: start N peer processes on 127.0.0.1, watch them, collect, tear down.

The launcher writes ``<out>/network.toml`` (free ports, the ``[run]`` settings and, unless
``insecure``, a fresh CA and per-peer certificates under ``<out>/certs``), starts one
``python -m graphfl.p2p peer`` process per peer (logs in ``<out>/logs``), shows progress from
the peers' status files, and writes ``<out>/p2p.{json,md,png}``.

Teardown is bounded: on Ctrl-C, on the overall deadline, or when a peer crashes under
``on-missing = "fail"``, every peer gets SIGTERM, then SIGKILL after 5 s. Peers also receive
SIGTERM if the launcher itself dies (``PR_SET_PDEATHSIG`` on Linux), so no orphans remain.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from graphfl.common.certs import generate_network_certs
from graphfl.common.config import ConfigError, device_problem
from graphfl.common.envinfo import env_info
from graphfl.common.ports import free_ports
from graphfl.common.results import atomic_write_bytes, atomic_write_text, markdown_table, write_json
from graphfl.deploy.p2p_outdir import claim_network_folder
from graphfl.p2p.algorithms import registry
from graphfl.p2p.algorithms.registry import PrepareContext
from graphfl.p2p.config import P2PConfig, TlsSection, load_network_file, parse_p2p_config, write_network_file
from graphfl.p2p.oracles import feature_columns, make_oracle
from graphfl.p2p.peer import problem_spec
from graphfl.p2p.topology import make_topology
from graphfl.tasks.tabular import EDGES_FILE, device_files

logger = logging.getLogger(__name__)

KILL_GRACE_S = 5.0


class LaunchError(RuntimeError):
    """The local network could not be started or did not finish in time."""


def prepare_network(
    out: Path, topology: str | None, peers: int | None, overrides: Mapping[str, Any], *, insecure: bool = False,
    mixing: str = "metropolis", seed: int = 0, data_dir: str | Path | None = None, reserve_ports: bool = True,
    device: str | None = None,
) -> Path:
    """Write ``<out>/network.toml`` (and certificates); returns its path.

    ``data_dir`` (``--data-dir``): the users' own data, one ``device-<id>.csv`` per peer
    (docs/data.md): sets ``problem = "csv"`` (unless another problem is given), ``data-dir``, the
    feature order (``features``, from device 0) and, by default, the number of peers (one per
    device file) and the graph (``DIR/edges.txt`` when no topology is given). The algorithm may
    replace the graph (:meth:`~graphfl.p2p.algorithms.base.P2PAlgorithm.graph_for`: FedADMM-Local-ES
    runs on the complete graph). Then the algorithm's ``prepare`` hook runs in this process
    (FedADMM: ``lam = "cv"``); its settings go into the network file, its report into
    ``<out>/prepare.json``. ``reserve_ports=False`` (the in-process engine, which opens no socket)
    writes placeholder ports ``20000 + id`` instead of probing free ones.
    """
    out.mkdir(parents=True, exist_ok=True)
    overrides = dict(overrides)
    if data_dir is not None:
        folder = Path(data_dir).resolve()
        files = device_files(folder)
        overrides["data-dir"] = str(folder)
        overrides.setdefault("problem", "csv")
        if not overrides.get("features"):
            overrides["features"] = ",".join(feature_columns(folder, 0))
        if peers is None:
            peers = len(files)
        elif peers != len(files):
            raise ConfigError(f"{folder} holds {len(files)} device files but --peers says {peers}")
        if topology is None and (folder / EDGES_FILE).is_file():
            topology = str(folder / EDGES_FILE)
    topology = topology or "ring"
    if topology.endswith(".toml"):
        base = load_network_file(topology)
        topo = base.topology
        if peers is not None and peers != topo.n:
            raise ConfigError(f"{topology} has {topo.n} peers, --peers says {peers}")
        run = parse_p2p_config(dict(overrides), base=base.run)
    else:
        n = peers if peers is not None else (None if Path(topology).is_file() else 5)
        def ports_for(k: int) -> list[int]:
            return free_ports(k) if reserve_ports else [20000 + i for i in range(k)]

        ports = ports_for(n) if n is not None else None
        topo = make_topology(topology, n, ports=ports, seed=seed, mixing=mixing)
        if ports is None:  # edge-list file: now we know n
            topo = make_topology(topology, topo.n, ports=ports_for(topo.n), seed=seed, mixing=mixing)
        run = parse_p2p_config(dict(overrides))
    algo = run.make_algorithm()
    given = [(i, j) for i, j, _ in topo.edges]
    wanted = sorted((min(i, j), max(i, j)) for i, j in algo.graph_for(given, topo.n))
    if wanted != given:
        logger.warning("%s runs on its own graph (%d edges) instead of %s (%d edges)", run.algorithm, len(wanted),
                       topo.name, len(given))
        weights = {(i, j): w for i, j, w in topo.edges}
        topo = dataclasses.replace(topo, edges=tuple((i, j, weights.get((i, j), 1.0)) for i, j in wanted),
                                   name=f"{topo.name}-complete" if len(wanted) == topo.n * (topo.n - 1) // 2 else topo.name)
    algo.check_graph(wanted, topo.n)
    topo.mixing_matrix()  # validate before starting anything
    if device is not None:  # --device: every peer's device (auto | cpu | cuda | cuda:N)
        problem = device_problem(device)
        if problem:
            raise ConfigError(f"--device {device!r} is not valid; {problem}")
        topo = dataclasses.replace(topo, peers=tuple(dataclasses.replace(p, device=device) for p in topo.peers))
    if insecure:
        tls = TlsSection(insecure=True)
    else:
        generate_network_certs(out / "certs", topo.n)
        tls = TlsSection(ca="certs/ca.crt", cert="certs/peer-{id}.crt", key="certs/peer-{id}.key")
    path = write_network_file(out / "network.toml", topo, run, tls)
    spec = registry.get(run.algorithm)
    if spec.prepare is not None:
        net = load_network_file(path)

        def problems() -> list[Any]:
            return [make_oracle(i, problem_spec(net, i), partition=net.topology.peer(i).partition)
                    for i in range(net.topology.n)]

        ctx = PrepareContext(problems, tuple(wanted), topo.n, run.rounds)
        changes, report = spec.prepare(run.params, ctx)
        if changes:
            run = parse_p2p_config(changes, base=run)
            path = write_network_file(out / "network.toml", topo, run, tls)
        if report:
            write_json(out / "prepare.json", report)
    return path


def _pdeathsig() -> None:  # pragma: no cover - runs in the child
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class PeerProcesses:
    """The peer processes of one local network; a context manager that always tears down."""

    def __init__(self, network_file: Path, out: Path, ids: Iterable[int], env: Mapping[str, str] | None = None,
                 args: Sequence[str] = ()) -> None:
        self.network_file = Path(network_file)
        self.out = Path(out)
        self.args = list(args)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.started_at: dict[int, float] = {}
        """Wall-clock time each peer process was spawned (start-up time = its ``serving_at`` minus this)."""
        self.logs: dict[int, Any] = {}
        self.prefix: dict[int, list[str]] = {}
        """Per peer, a command prefix (e.g. ``ip netns exec NS``: the network bench's namespaces)."""
        # MALLOC_ARENA_MAX=2: gRPC's threads otherwise each get a glibc arena holding freed 1 MB
        # chunks, which raises every peer's resident set, not its round time (measured in docs/p2p.md,
        # "Lighter peers"). An explicit value in the environment wins.
        self.env = {"MALLOC_ARENA_MAX": "2", **os.environ, "GRAPHFL_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1",
                    "PYTHONUNBUFFERED": "1", **(env or {})}
        for i in ids:
            self.start(i)

    def start(self, i: int, args: Sequence[str] | None = None) -> subprocess.Popen[bytes]:
        """Start peer ``i`` (``graphfl peer``) with the common ``args`` (e.g. ``--resume``) or ``args``."""
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        log = open(self.out / "logs" / f"peer-{i}.log", "ab")
        self.started_at[i] = time.time()
        cmd = [*self.prefix.get(i, []), sys.executable, "-m", "graphfl.p2p", "peer",
               "--topology", str(self.network_file), "--id", str(i),
               "--out", str(self.out), *(self.args if args is None else args)]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                                preexec_fn=_pdeathsig if sys.platform.startswith("linux") else None)
        self.procs[i], self.logs[i] = proc, log
        return proc

    def status(self, i: int) -> dict[str, Any]:
        """Peer ``i``'s last status file (``{}`` before it wrote one)."""
        try:
            st: dict[str, Any] = json.loads((self.out / f"peer-{i}.status.json").read_text())
        except (OSError, ValueError):
            return {}
        return st

    def exit_codes(self) -> dict[int, int | None]:
        return {i: p.poll() for i, p in self.procs.items()}

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        p = self.procs[i]
        if p.poll() is None:
            p.send_signal(sig)
            p.wait(KILL_GRACE_S)

    def wait_all(self, deadline: float, on_tick: Callable[[Mapping[int, int | None]], None] | None = None,
                 stop_on_crash: bool = False) -> bool:
        """Wait until every process exits or the monotonic ``deadline``; ``True`` if all exited."""
        while time.monotonic() < deadline:
            codes = self.exit_codes()
            if on_tick is not None:
                on_tick(codes)
            if all(c is not None for c in codes.values()):
                return True
            if stop_on_crash and any(c not in (None, 0) for c in codes.values()):
                return False
            time.sleep(0.2)
        return False

    def stop_all(self) -> None:
        """SIGTERM everything still running, SIGKILL after a grace period; bounded."""
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + KILL_GRACE_S
        for p in self.procs.values():
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(2.0)
        for log in self.logs.values():
            log.close()

    def __enter__(self) -> PeerProcesses:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop_all()


def collect(out: Path, network_file: Path, exit_codes: Mapping[int, int | None] | None = None,
            wall_s: float | None = None) -> dict[str, Any]:
    """Aggregate ``peer-<i>.json``/``.npz`` into the ``p2p`` result dict."""
    net = load_network_file(network_file)
    n = net.topology.n
    peers: dict[str, Any] = {}
    thetas = []
    by_round: dict[int, list[dict[str, Any]]] = {}
    for i in range(n):
        f = out / f"peer-{i}.json"
        res: dict[str, Any] = (json.loads(f.read_text()) if f.is_file()
                               else {"outcome": "no result (crashed?)", "records": []})
        npz = out / f"peer-{i}.npz"
        if npz.is_file():
            with np.load(npz, allow_pickle=False) as z:
                thetas.append(z["theta"].astype(np.float64))
        recs: list[dict[str, Any]] = res.get("records", [])
        for r in recs:
            by_round.setdefault(r["round"], []).append(r)
        last = recs[-1] if recs else {}
        peers[str(i)] = {
            "outcome": res.get("outcome"),
            "error": res.get("error"),
            "exit_code": None if exit_codes is None else exit_codes.get(i),
            "start_t": res.get("start_t"),
            "final_t": res.get("final_t"),
            "rounds_done": len(recs),
            "test_loss": last.get("test_loss"),
            "train_loss": last.get("train_loss"),
            "bytes_sent": int(sum(r["bytes_sent"] for r in recs)),
            "bytes_received": int(sum(r["bytes_received"] for r in recs)),
            "payload_sent": int(sum(r["payload_sent"] for r in recs)),
            "compute_s": float(sum(r["compute_s"] for r in recs)),
            "comm_s": float(sum(r["comm_s"] for r in recs)),
            "skipped_rounds": sum(1 for r in recs if r["missing"]),
            "seconds": res.get("seconds"),
        }
        report = res.get("report") or {}
        if report:
            peers[str(i)]["report"] = report
            if report.get("metrics"):
                peers[str(i)]["metrics"] = report["metrics"]
            if report.get("estimate") is not None:
                peers[str(i)]["estimate"] = report["estimate"]

    def mean(vals: list[Any]) -> float | None:
        v = [x for x in vals if x is not None]
        return float(np.mean(v)) if v else None

    curve = []
    total_bytes = 0
    for k in sorted(by_round):
        rs = by_round[k]
        total_bytes += sum(r["bytes_sent"] for r in rs)
        curve.append({
            "round": k, "peers": len(rs),
            "test_loss": mean([r["test_loss"] for r in rs]), "train_loss": mean([r["train_loss"] for r in rs]),
            "local_disagreement": mean([r["local_disagreement"] for r in rs]),
            "bytes": total_bytes, "bytes_up": int(sum(r["bytes_sent"] for r in rs)),
            "bytes_down": int(sum(r["bytes_received"] for r in rs)),
            "seconds": max(r["seconds"] for r in rs),
            "compute_s": mean([r["compute_s"] for r in rs]), "comm_s": mean([r["comm_s"] for r in rs]),
            "missing": sorted({m for r in rs for m in r["missing"]}),
        })
    consensus = None
    if len(thetas) >= 2:
        x = np.stack(thetas)
        consensus = float(np.mean(np.sum((x - x.mean(axis=0)) ** 2, axis=1)))
    ok = all(p["outcome"] == "done" for p in peers.values())
    metric_keys = sorted({k for p in peers.values() for k in p.get("metrics", {})})
    final_metrics = {k: mean([p.get("metrics", {}).get(k) for p in peers.values()]) for k in metric_keys}
    final = {
        **final_metrics,
        "test_loss": mean([p["test_loss"] for p in peers.values()]),
        "train_loss": mean([p["train_loss"] for p in peers.values()]),
        "consensus": consensus,
        "bytes_sent": int(sum(p["bytes_sent"] for p in peers.values())),
        "payload_sent": int(sum(p["payload_sent"] for p in peers.values())),
        "seconds": wall_s,
        "peers_done": sum(p["outcome"] == "done" for p in peers.values()),
    }
    doc: dict[str, Any] = {
        "name": "p2p",
        "ok": ok,
        "config": {"run": dataclasses.asdict(net.run), "network": net.topology.name, "peers": n,
                   "edges": [list(e) for e in net.topology.edges], "mixing": net.topology.mixing,
                   "tls": not net.tls.insecure, "topology_version": net.topology.fingerprint},
        "methods": {net.run.algorithm: {"final": final, "curve": curve}},
        "peers": peers,
        "env": env_info(),
    }
    selection = edge_selection_summary(net.topology.n, [(i, j) for i, j, _ in net.topology.edges], peers)
    if selection is not None:
        doc["edge_selection"] = selection
    prep = out / "prepare.json"
    if prep.is_file():
        doc["prepare"] = json.loads(prep.read_text())
    return doc


def edge_selection_summary(n: int, edges: Sequence[tuple[int, int]], peers: Mapping[str, Any]) -> dict[str, Any] | None:
    """The network's edge selection from the peers' reports: each edge's owner's decision
    (``kept``, ``dropped`` as ``[i, j]``, ``i < j``; ``tests`` with ``W²``, df, p-value); an edge
    whose owner left no report counts as ``unknown``. ``None`` if no peer selected edges.
    """
    records: dict[tuple[int, int], dict[str, Any]] = {}
    any_selection = False
    for pid, p in peers.items():
        sel = (p.get("report") or {}).get("selection")
        if sel is None:
            continue
        any_selection = True
        for r in sel:
            if r.get("decided_by") == int(pid):
                records[(int(r["edge"][0]), int(r["edge"][1]))] = r
    if not any_selection:
        return None
    kept = sorted([list(e) for e, r in records.items() if r["kept"]])
    dropped = sorted([list(e) for e, r in records.items() if not r["kept"]])
    unknown = sorted([[i, j] for i, j in edges if (i, j) not in records])
    return {"tested": len(edges), "kept": kept, "dropped": dropped, "unknown": unknown,
            "tests": [{**records[e], "edge": list(e)} for e in sorted(records)]}


def write_report(out: Path, result: dict[str, Any]) -> None:
    """``p2p.json``, ``p2p.md`` (summary, per-peer table, estimates and edge selection) and
    ``p2p.png`` (loss vs rounds and vs bytes; with edge selection or per-peer estimates, a panel
    with the graph: kept edges solid, dropped edges dashed).
    """
    write_json(out / "p2p.json", result)
    algo, m = next(iter(result["methods"].items()))
    fin = m["final"]
    rows = [[i, p["outcome"], p["rounds_done"], p["test_loss"], p["train_loss"], p["bytes_sent"], p["compute_s"],
             p["comm_s"], p["skipped_rounds"], p["error"] or ""] for i, p in result["peers"].items()]
    cfg = result["config"]
    metric_keys = [k for k in fin if k.startswith(("test_", "train_")) and k not in ("test_loss", "train_loss")]
    text = [
        f"# p2p run: {algo} on {cfg['network']} ({cfg['peers']} peers, {'mutual TLS' if cfg['tls'] else 'plaintext'})",
        "",
        f"rounds {cfg['run']['rounds']}, parameters {cfg['run']['params']}, problem {cfg['run']['problem']}, "
        f"mixing {cfg['mixing']}, on-missing {cfg['run']['on_missing']}",
        "",
        markdown_table(columns=["mean test loss", "mean train loss", "consensus distance", "bytes sent (wire)", "payload sent",
                  "wall s", "peers done", *(f"mean {k}" for k in metric_keys)], rows=
                 [[fin["test_loss"], fin["train_loss"], fin["consensus"], fin["bytes_sent"], fin["payload_sent"],
                   fin["seconds"], fin["peers_done"], *(fin[k] for k in metric_keys)]]),
        "",
        markdown_table(columns=["peer", "outcome", "rounds", "test loss", "train loss", "bytes sent", "compute s", "comm s",
                  "rounds with skips", "error"], rows=rows),
        "",
    ]
    with_estimates = {i: p for i, p in result["peers"].items() if p.get("estimate") is not None}
    if with_estimates:
        features = next((p["report"].get("features") for p in with_estimates.values() if p["report"].get("features")), None)
        dim = max(len(p["estimate"]) for p in with_estimates.values())
        if dim <= 30:
            names = features if features and len(features) == dim else [f"θ[{k}]" for k in range(dim)]
            text += ["## Estimates per peer", "",
                     markdown_table(columns=["peer", *names, *metric_keys],
                                    rows=[[i, *p["estimate"], *(p.get("metrics", {}).get(k) for k in metric_keys)]
                                          for i, p in with_estimates.items()]), ""]
    sel = result.get("edge_selection")
    if sel is not None:
        text += [f"## Edge selection: {len(sel['kept'])} of {sel['tested']} edges kept", "",
                 markdown_table(columns=["edge", "kept", "W²", "df", "p-value", "decided by"],
                                rows=[[f"{t['edge'][0]}-{t['edge'][1]}", t["kept"], t["w2"], t["df"], t["pvalue"],
                                       t["decided_by"]] for t in sel["tests"]]), ""]
        if sel["unknown"]:
            text += [f"edges without a decision (owner crashed?): {sel['unknown']}", ""]
    cv = (result.get("prepare") or {}).get("lambda_cv")
    if cv:
        text += [f"λ chosen by {cv['folds']}-fold cross-validation: {cv['chosen']:g}", "",
                 markdown_table(columns=["λ", "mean held-out loss", "se"],
                                rows=list(zip(cv["lambdas"], cv["mean_loss"], cv["se_loss"]))), ""]
    atomic_write_text(out / "p2p.md", "\n".join(text))
    plot_report(out / "p2p.png", result)


def plot_report(path: Path, result: Mapping[str, Any]) -> None:
    """The curves of :func:`write_report`, plus the graph panel when there is something to show on it."""
    import matplotlib  # slow to import: only when a report is drawn

    matplotlib.use("Agg")  # before pyplot
    import matplotlib.pyplot as plt

    algo, m = next(iter(result["methods"].items()))
    cfg = result["config"]
    sel = result.get("edge_selection")
    graph = sel is not None or any(p.get("estimate") is not None for p in result["peers"].values())
    graph = graph and cfg["peers"] <= 200
    panels = [("round", "communication round"), ("bytes", "bytes sent (all peers)")]
    fig, axes = plt.subplots(1, len(panels) + int(graph), figsize=(5.5 * (len(panels) + int(graph)), 4.2), squeeze=False)
    for ax, (x_key, xlabel) in zip(axes[0], panels):
        pts = [(r[x_key], r["test_loss"]) for r in m["curve"] if r.get("test_loss") is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=algo)
            if all(y > 0 for y in ys):
                ax.set_yscale("log")
            ax.legend(fontsize=7)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean local test loss")
        ax.grid(alpha=0.3)
    if graph:
        draw_graph(axes[0][-1], cfg["peers"], [tuple(e[:2]) for e in cfg["edges"]], sel)
    fig.suptitle(f"{algo} on {cfg['network']}")
    fig.tight_layout()
    try:
        atomic_write_bytes(path, lambda fh: fig.savefig(fh, format="png", dpi=110))
    finally:
        plt.close(fig)


def draw_graph(ax: Any, n: int, edges: Sequence[tuple[int, int]], selection: Mapping[str, Any] | None) -> None:
    """Peers on a circle; kept (or, without selection, all) edges solid, dropped dashed, undecided dotted."""
    ang = 2 * np.pi * np.arange(n) / max(n, 1)
    pos = np.stack([np.cos(ang), np.sin(ang)], axis=1)
    dropped = {tuple(e) for e in selection["dropped"]} if selection else set()
    unknown = {tuple(e) for e in selection["unknown"]} if selection else set()
    for i, j in edges:
        e = (min(i, j), max(i, j))
        style = "--" if e in dropped else (":" if e in unknown else "-")
        color = "tab:red" if e in dropped else ("tab:gray" if e in unknown else "tab:blue")
        ax.plot(*zip(pos[i], pos[j]), linestyle=style, color=color, lw=1.2, alpha=0.8 if style == "-" else 0.6)
    ax.scatter(pos[:, 0], pos[:, 1], s=160, color="white", edgecolors="black", zorder=3)
    for k in range(n):
        ax.annotate(str(k), pos[k], ha="center", va="center", fontsize=8, zorder=4)
    if selection:
        ax.set_title(f"edges: {len(selection['kept'])} kept (solid), {len(selection['dropped'])} dropped (dashed)",
                     fontsize=9)
    else:
        ax.set_title(f"graph: {len(edges)} edges", fontsize=9)
    ax.set_aspect("equal")
    ax.axis("off")


def default_out() -> Path:
    """``runs/p2p-<timestamp>``: a new folder per network run."""
    return Path("runs") / time.strftime("p2p-%Y%m%d-%H%M%S")


def launch(
    topology: str | None, peers: int | None, overrides: Mapping[str, Any], *, out: Path | None = None,
    insecure: bool = False, mixing: str = "metropolis", timeout: float | None = None, progress: bool = True,
    data_dir: str | Path | None = None, device: str | None = None, overwrite: bool = False,
) -> dict[str, Any]:
    """Run a whole local network; returns the result dict plus ``text`` (a one-line summary).

    ``out`` is claimed first (:func:`graphfl.deploy.p2p_outdir.claim_network_folder`): a folder in use
    or holding files is refused unless ``overwrite`` (which replaces only a p2p run's files);
    its lock is held until the run's report is written.

    Raises
    ------
    ConfigError
        ``out`` is in use, holds files, or cannot be created.
    LaunchError
        If the peers do not finish within the bound (they are torn down first).
    KeyboardInterrupt
        After tearing every peer down.
    """
    out = Path(out) if out is not None else default_out()
    with claim_network_folder(out, overwrite):
        return _launch_claimed(topology, peers, overrides, out, insecure, mixing, timeout, progress, data_dir, device)


def _launch_claimed(
    topology: str | None, peers: int | None, overrides: Mapping[str, Any], out: Path, insecure: bool, mixing: str,
    timeout: float | None, progress: bool, data_dir: str | Path | None, device: str | None,
) -> dict[str, Any]:
    seed = int(overrides.get("seed", 0))
    network_file = prepare_network(out, topology, peers, overrides, insecure=insecure, mixing=mixing, seed=seed,
                                   data_dir=data_dir, device=device)
    net = load_network_file(network_file)
    run: P2PConfig = net.run
    n = net.topology.n
    bound = timeout or (run.connect_timeout + run.rounds * run.round_timeout + 60.0)
    t0 = time.monotonic()
    with ExitStack() as stack:
        procs = stack.enter_context(PeerProcesses(network_file, out, range(n)))
        tick = _progress(stack, procs, n, run.rounds) if progress else None
        finished = procs.wait_all(t0 + bound, on_tick=tick, stop_on_crash=run.on_missing == "fail")
        if not finished:
            codes = procs.exit_codes()
            crashed = {i: c for i, c in codes.items() if c not in (None, 0)}
            procs.stop_all()
            if not crashed:
                raise LaunchError(f"peers did not finish within {bound:.0f} s; stopped them (logs in {out / 'logs'})")
        codes = procs.exit_codes()
    wall = time.monotonic() - t0
    result = collect(out, network_file, codes, wall)
    write_report(out, result)
    fin = result["methods"][run.algorithm]["final"]
    tl = fin["test_loss"]
    extra = "".join(f", mean {k} {fin[k]:.4g}" for k in ("test_mse", "test_acc", "test_error")
                    if fin.get(k) is not None)
    sel = result.get("edge_selection")
    if sel is not None:
        extra += f", edges kept {len(sel['kept'])}/{sel['tested']}"
    result["text"] = (
        f"{run.algorithm}: {fin['peers_done']}/{n} peers done in {wall:.1f} s, mean test loss "
        f"{'n/a' if tl is None else f'{tl:.4g}'}{extra}, consensus {fin['consensus']}, results in {out}/p2p.json"
    )
    if not result["ok"]:
        bad = {i: (p["outcome"], p["error"]) for i, p in result["peers"].items() if p["outcome"] != "done"}
        result["text"] += f"\nnot done: {bad} (logs in {out / 'logs'})"
    return result


def _progress(stack: ExitStack, procs: PeerProcesses, n: int, rounds: int) -> Callable[[Mapping[int, int | None]], None]:
    bar = stack.enter_context(Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                       TextColumn("{task.fields[info]}"), TimeElapsedColumn(), transient=False))
    per_peer = n <= 16
    tasks = ({i: bar.add_task(f"peer {i}", total=rounds, info="") for i in range(n)} if per_peer
             else {-1: bar.add_task(f"{n} peers (slowest)", total=rounds, info="")})

    def tick(codes: Mapping[int, int | None]) -> None:
        sts = {i: procs.status(i) for i in range(n)}
        if per_peer:
            for i, st in sts.items():
                info = st.get("state", "starting")
                if st.get("test_loss") is not None:
                    info += f" test {st['test_loss']:.4g}"
                if codes.get(i) not in (None, 0):
                    info = f"exited {codes[i]}: {st.get('state', '')}"
                bar.update(tasks[i], completed=st.get("round", 0), info=info)
        else:
            done = min((st.get("round", 0) for st in sts.values()), default=0)
            bad = sum(1 for c in codes.values() if c not in (None, 0))
            bar.update(tasks[-1], completed=done, info=f"{bad} failed" if bad else "")

    return tick
