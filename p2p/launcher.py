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

from graphfl.common.certs import generate_network_certs
from graphfl.common.config import ConfigError
from graphfl.common.envinfo import env_info
from graphfl.common.ports import free_ports
from graphfl.common.results import markdown_table, plot_panels, write_json
from graphfl.p2p.config import P2PConfig, TlsSection, load_network_file, parse_p2p_config, write_network_file
from graphfl.p2p.topology import make_topology

logger = logging.getLogger(__name__)

KILL_GRACE_S = 5.0


class LaunchError(RuntimeError):
    """The local network could not be started or did not finish in time."""


def prepare_network(
    out: Path, topology: str, peers: int | None, overrides: Mapping[str, Any], *, insecure: bool = False,
    mixing: str = "metropolis", seed: int = 0,
) -> Path:
    """Write ``<out>/network.toml`` (and certificates); returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    if topology.endswith(".toml"):
        base = load_network_file(topology)
        topo = base.topology
        if peers is not None and peers != topo.n:
            raise ConfigError(f"{topology} has {topo.n} peers, --peers says {peers}")
        run = parse_p2p_config(dict(overrides), base=base.run)
    else:
        n = peers if peers is not None else (None if Path(topology).is_file() else 5)
        ports = free_ports(n) if n is not None else None
        topo = make_topology(topology, n, ports=ports, seed=seed, mixing=mixing)
        if ports is None:  # edge-list file: now we know n
            topo = make_topology(topology, topo.n, ports=free_ports(topo.n), seed=seed, mixing=mixing)
        run = parse_p2p_config(dict(overrides))
    topo.mixing_matrix()  # validate before starting anything
    if insecure:
        tls = TlsSection(insecure=True)
    else:
        generate_network_certs(out / "certs", topo.n)
        tls = TlsSection(ca="certs/ca.crt", cert="certs/peer-{id}.crt", key="certs/peer-{id}.key")
    return write_network_file(out / "network.toml", topo, run, tls)


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
        self.logs: dict[int, Any] = {}
        self.env = {**os.environ, "GRAPHFL_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        for i in ids:
            self.start(i)

    def start(self, i: int, args: Sequence[str] | None = None) -> subprocess.Popen[bytes]:
        """Start peer ``i`` (``graphfl peer``) with the common ``args`` (e.g. ``--resume``) or ``args``."""
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        log = open(self.out / "logs" / f"peer-{i}.log", "ab")
        cmd = [sys.executable, "-m", "graphfl.p2p", "peer", "--topology", str(self.network_file), "--id", str(i),
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
    final = {
        "test_loss": mean([p["test_loss"] for p in peers.values()]),
        "train_loss": mean([p["train_loss"] for p in peers.values()]),
        "consensus": consensus,
        "bytes_sent": int(sum(p["bytes_sent"] for p in peers.values())),
        "payload_sent": int(sum(p["payload_sent"] for p in peers.values())),
        "seconds": wall_s,
        "peers_done": sum(p["outcome"] == "done" for p in peers.values()),
    }
    import dataclasses

    return {
        "name": "p2p",
        "ok": ok,
        "config": {"run": dataclasses.asdict(net.run), "network": net.topology.name, "peers": n,
                   "edges": [list(e) for e in net.topology.edges], "mixing": net.topology.mixing,
                   "tls": not net.tls.insecure, "topology_version": net.topology.fingerprint},
        "methods": {net.run.algorithm: {"final": final, "curve": curve}},
        "peers": peers,
        "env": env_info(),
    }


def write_report(out: Path, result: dict[str, Any]) -> None:
    """``p2p.json``, ``p2p.md`` (summary + per-peer table) and ``p2p.png`` (loss and bytes per round)."""
    write_json(out / "p2p.json", result)
    algo, m = next(iter(result["methods"].items()))
    fin = m["final"]
    rows = [[i, p["outcome"], p["rounds_done"], p["test_loss"], p["train_loss"], p["bytes_sent"], p["compute_s"],
             p["comm_s"], p["skipped_rounds"], p["error"] or ""] for i, p in result["peers"].items()]
    cfg = result["config"]
    text = [
        f"# p2p run: {algo} on {cfg['network']} ({cfg['peers']} peers, {'mutual TLS' if cfg['tls'] else 'plaintext'})",
        "",
        f"rounds {cfg['run']['rounds']}, parameters {cfg['run']['params']}, problem {cfg['run']['problem']}, "
        f"mixing {cfg['mixing']}, on-missing {cfg['run']['on_missing']}",
        "",
        markdown_table(columns=["mean test loss", "mean train loss", "consensus distance", "bytes sent (wire)", "payload sent",
                  "wall s", "peers done"], rows=
                 [[fin["test_loss"], fin["train_loss"], fin["consensus"], fin["bytes_sent"], fin["payload_sent"],
                   fin["seconds"], fin["peers_done"]]]),
        "",
        markdown_table(columns=["peer", "outcome", "rounds", "test loss", "train loss", "bytes sent", "compute s", "comm s",
                  "rounds with skips", "error"], rows=rows),
        "",
    ]
    (out / "p2p.md").write_text("\n".join(text))
    plot_panels(out / "p2p.png", [
        {"x": "round", "y": "test_loss", "ylabel": "mean local test loss", "series": {algo: m["curve"]}, "logy": True},
        {"x": "bytes", "y": "test_loss", "xlabel": "bytes sent (all peers)", "ylabel": "mean local test loss",
         "series": {algo: m["curve"]}, "logy": True},
    ], title=f"{algo} on {cfg['network']}")


def launch(
    topology: str, peers: int | None, overrides: Mapping[str, Any], *, out: Path | None = None,
    insecure: bool = False, mixing: str = "metropolis", timeout: float | None = None, progress: bool = True,
) -> dict[str, Any]:
    """Run a whole local network; returns the result dict plus ``text`` (a one-line summary).

    Raises
    ------
    LaunchError
        If the peers do not finish within the bound (they are torn down first).
    KeyboardInterrupt
        After tearing every peer down.
    """
    out = Path(out) if out is not None else Path("runs") / time.strftime("p2p-%Y%m%d-%H%M%S")
    seed = int(overrides.get("seed", 0))
    network_file = prepare_network(out, topology, peers, overrides, insecure=insecure, mixing=mixing, seed=seed)
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
    result["text"] = (
        f"{run.algorithm}: {fin['peers_done']}/{n} peers done in {wall:.1f} s, mean test loss "
        f"{'n/a' if tl is None else f'{tl:.4g}'}, consensus {fin['consensus']}, results in {out}/p2p.json"
    )
    if not result["ok"]:
        bad = {i: (p["outcome"], p["error"]) for i, p in result["peers"].items() if p["outcome"] != "done"}
        result["text"] += f"\nnot done: {bad} (logs in {out / 'logs'})"
    return result


def _progress(stack: ExitStack, procs: PeerProcesses, n: int, rounds: int) -> Callable[[Mapping[int, int | None]], None]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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
