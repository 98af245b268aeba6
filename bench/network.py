"""Benchmark ``network``: both runtimes over emulated links.

Several hosts are emulated on one machine, and each runtime is run across links with latency,
jitter, a bandwidth limit and loss:

* **Flower**: one ``flower-superlink`` and ``nodes`` SuperNodes (warm ClientApp workers, TLS on);
  every SuperNode reaches the SuperLink through its own :class:`~graphfl.bench.linkemu.LinkProxy`
  (``--superlink 127.0.0.1:<proxy port>``; the proxy relays TCP unchanged, so TLS still checks the
  SuperLink's certificate for ``127.0.0.1``). The operator's ``flwr`` CLI and the ServerApp talk to
  the SuperLink directly (they sit beside it). Strategies: FedAvg and pFedGraph (graph-aware), one
  after the other on the same federation, on ``digits``.
* **p2p**: ``nodes`` peer processes on a ring, DFL-GT on ``digits``, mutual TLS. Each peer binds its
  real port (``graphfl peer --listen``) and the network file every peer reads lists, for each
  peer, the port of a proxy in front of it, so every connection ``i -> j`` crosses an emulated
  link (one TCP connection per neighbour pair and direction, each with its own link state).

Emulation method (``--emulation``, recorded with its reason under ``emulation`` in the results):
:func:`detect_netem` tries ``netem`` in a throwaway namespace (root only). ``auto`` uses network
namespaces + veth pairs + netem (:mod:`graphfl.bench.netns`: each host behind its own shaped
access link; stalls and resets, user-space notions, are listed as not emulated, and loss is
packet loss, ``loss_pct``) where the kernel has netem, and the user-space emulator
(:mod:`graphfl.bench.linkemu`) otherwise; ``user-space`` always the proxies; ``netns`` always
namespaces (without netem, bandwidth-only profiles shaped by ``tbf``).

Measured per (profile, runtime / strategy): seconds per round (median), time to target loss
(the first round whose mean test loss is within :data:`TARGET_SLACK` of the **lan** run's final
loss of the same runtime and strategy; seconds summed over rounds 1..r, join excluded), payload
bytes (graphfl's count) and wire bytes (what crossed the proxies: TLS, HTTP or gRPC framing, polls), failures
(Flower: rounds with fewer replies than nodes; p2p: rounds in which a peer skipped a missing
neighbour; connection resets and stalls of the links), and the final test loss / accuracy.

``run(quick, seed, out)`` writes ``<out>/network.{json,md,png}`` (and each run's own files under
``<out>/runs``). ``--quick``: 3 profiles, 4 nodes, 3 Flower rounds, 20 p2p rounds, one seed. The
full form: 4 profiles (adds ``wan-resets``), 8 Flower rounds, 50 p2p rounds, 2 seeds.

On the benchmark harness (:mod:`graphfl.bench.harness`) in its measurement mode (``cache="none"``):
points = the link profiles, methods = ``flower-<strategy>`` and ``p2p-dfl-gt``, seeds = the plan's
seeds (training seeds), one **joint cell per (profile, seed)** (:func:`measure_profile`: one
emulated network, the Flower federation with each strategy in turn, then the p2p ring, as
above), metrics = the figures above (a run counts as failed only when it completed no round; its
errors stay in ``runs`` and ``summary``), paired per seed ``p2p-dfl-gt − flower-fedavg`` and
``flower-pfedgraph − flower-fedavg``. The time to target is read against the same run's ``lan``
cell of the same seed when the results are aggregated, after every cell was measured. Nothing
is cached across runs: the values are times over links emulated in this run (the emulation
method itself detected per run). What this module adds: the emulation (its detection, the
proxies, the namespaces), the runs, the per-(runtime, strategy, profile) ``summary`` rows (medians
over seeds, as before), the link profiles' table and the loss-vs-time plot.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from graphfl.bench.linkemu import LinkProfile, LinkProxy
from graphfl.common.config import parse_run_config
from graphfl.common.results import markdown_table, plot_panels
from graphfl.deploy.federation import FederationError, LocalFederation

from .harness import Bench, Cell, Metric, run_bench
from .report import build_doc, write_report

logger = logging.getLogger(__name__)

NAME = "network"
NODES = 4
TASK = "digits"
STRATEGIES = ("fedavg", "pfedgraph")
TARGET_SLACK = 0.05
"""Target loss = (1 + slack) x the lan run's final test loss (same runtime and strategy)."""

PROFILES: dict[str, LinkProfile] = {
    "lan": LinkProfile("lan", delay_ms=0.5, rate_mbit=1000.0),
    "wan": LinkProfile("wan", delay_ms=40.0, jitter_ms=10.0, rate_mbit=20.0),
    "edge-lossy": LinkProfile("edge-lossy", delay_ms=100.0, jitter_ms=30.0, rate_mbit=5.0,
                              stall_per_s=0.5, stall_ms=300.0, loss_pct=1.0),
    "wan-resets": LinkProfile("wan-resets", delay_ms=40.0, jitter_ms=10.0, rate_mbit=20.0, reset_per_s=0.05),
}
FLOWER_ROUND_TIMEOUT_S = 120.0
"""A Flower round waits this long for replies before it goes on without the missing ones."""
QUICK_PROFILES = ("lan", "wan", "edge-lossy")
FULL_PROFILES = ("lan", "wan", "edge-lossy", "wan-resets")

P2P_SETTINGS: dict[str, Any] = {"algorithm": "dfl-gt", "problem": TASK, "tau": 5, "alpha0": 0.5,
                                "standardize": False, "round-timeout": 15.0, "send-timeout": 15.0,
                                "connect-timeout": 60.0, "data-path": "grpc"}
"""DFL-GT on digits: 5 local steps per round, alpha0/sqrt(t+1) with alpha0 = 0.5, raw inputs (per-node
standardisation divides by near-zero pixel deviations of some nodes); 15 s per round before a
neighbour counts as missing. ``data-path`` stays ``grpc``: the emulated links sit in front of each
peer's gRPC port, and the socket data path's ports (chosen at start) would bypass them."""


@dataclass
class Plan:
    """What one form of the benchmark runs."""

    profiles: tuple[str, ...]
    flower_rounds: int
    p2p_rounds: int
    seeds: tuple[int, ...]
    strategies: tuple[str, ...] = STRATEGIES
    nodes: int = NODES


def plan_for(quick: bool, seed: int = 0) -> Plan:
    """``--quick``: 3 profiles, 3 Flower / 20 p2p rounds, one seed; full: 4 profiles, 8 / 50 rounds, 2 seeds."""
    if quick:
        return Plan(QUICK_PROFILES, 3, 20, (seed,))
    return Plan(FULL_PROFILES, 8, 50, (seed, seed + 1))


# ------------------------------------------------------------------------------------------
# emulation method
# ------------------------------------------------------------------------------------------
def detect_netem() -> dict[str, Any]:
    """Whether ``tc ... netem`` works here: tried on ``lo`` of a throwaway network namespace (deleted again).

    Returns ``{"root", "netns", "netem", "detail"}``. Needs root, ``ip`` and ``tc``; touches no
    interface outside the namespace.
    """
    res: dict[str, Any] = {"root": os.geteuid() == 0, "netns": False, "netem": False, "detail": ""}
    if not res["root"]:
        res["detail"] = "not root: network namespaces and qdiscs need root"
        return res
    if shutil.which("ip") is None or shutil.which("tc") is None:
        res["detail"] = "`ip` or `tc` not installed (iproute2)"
        return res
    ns = f"graphfl-netem-probe-{os.getpid()}"

    def sh(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=10)

    try:
        made = sh("ip", "netns", "add", ns)
        if made.returncode != 0:
            res["detail"] = f"`ip netns add` failed: {made.stderr.strip()}"
            return res
        res["netns"] = True
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        probe = sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
        res["netem"] = probe.returncode == 0
        res["detail"] = ("netem qdisc accepted" if res["netem"]
                         else f"`tc qdisc add ... netem` failed: {probe.stderr.strip() or probe.stdout.strip()}")
    except (OSError, subprocess.TimeoutExpired) as exc:
        res["detail"] = f"probe failed: {exc}"
    finally:
        if res["netns"]:
            sh("ip", "netns", "del", ns)
    return res


EMULATIONS = ("auto", "user-space", "netns")
"""``auto``: network namespaces + netem where the kernel has netem (and this is root), else the
user-space emulator; ``user-space``: always the proxies; ``netns``: always namespaces (without
netem only bandwidth-only profiles, shaped by tbf)."""


def emulation_method(probe: dict[str, Any], requested: str = "auto",
                     profiles: Sequence[LinkProfile] = ()) -> dict[str, Any]:
    """The method this run uses, and why: ``{"method", "why", "probe", "not_emulated"}``.

    ``method`` is ``user-space``, ``netns-netem`` or ``netns-tbf``. Raises
    :class:`~graphfl.common.config.ConfigError` for an unknown ``requested``, and for ``netns``
    where namespaces cannot be made or a profile needs netem that the kernel lacks (before
    anything starts).
    """
    from graphfl.bench.netns import needs_netem, not_emulated
    from graphfl.common.config import ConfigError

    if requested not in EMULATIONS:
        raise ConfigError(f"--emulation must be one of {', '.join(EMULATIONS)}, got {requested!r}")
    netns_ok = bool(probe.get("root")) and bool(probe.get("netns"))
    if requested == "user-space":
        method, why = "user-space", "user-space emulator requested (--emulation user-space)"
    elif requested == "auto" and not probe["netem"]:
        method, why = "user-space", f"netem not available on this kernel ({probe['detail']}); user-space emulator used"
    elif not netns_ok:
        raise ConfigError(f"--emulation netns: network namespaces cannot be made here ({probe['detail']})")
    elif probe["netem"]:
        method, why = "netns-netem", ("network namespaces + veth pairs on a bridge, each host behind its own netem "
                                      "access link (delay, jitter, loss, rate)")
    else:
        needy = {p.name: needs_netem(p) for p in profiles if needs_netem(p)}
        if needy:
            raise ConfigError(f"--emulation netns without netem ({probe['detail']}) can only shape bandwidth; "
                           f"profiles {needy} need netem: use --emulation auto or user-space")
        method, why = "netns-tbf", (f"network namespaces + veth pairs on a bridge, bandwidth shaped by tbf "
                                    f"(no netem here: {probe['detail']})")
    skipped = {p.name: not_emulated(p) for p in profiles if method != "user-space" and not_emulated(p)}
    return {"method": method, "why": why, "probe": probe, "not_emulated": skipped}


# ------------------------------------------------------------------------------------------
# proxies
# ------------------------------------------------------------------------------------------
def proxy_totals(proxies: Sequence[LinkProxy]) -> dict[str, float]:
    """Counters summed over ``proxies`` (bytes each way, connections, resets, stalls, ...)."""
    total: dict[str, float] = {}
    for p in proxies:
        for k, v in p.stats().items():
            total[k] = total.get(k, 0.0) + v
    return total


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


@dataclass
class ProxiedFederation(LocalFederation):
    """A :class:`LocalFederation` whose SuperNodes reach the SuperLink through one :class:`LinkProxy` each."""

    profile: LinkProfile = field(default_factory=lambda: PROFILES["lan"])
    seed: int = 0
    proxies: list[LinkProxy] = field(init=False, default_factory=list)

    def supernode_superlink(self, partition_id: int) -> str:
        proxy = LinkProxy("127.0.0.1", self.superlink_port, self.profile, seed=self.seed * 1000 + partition_id)
        self.proxies.append(proxy)
        return proxy.address

    def stop(self) -> list[int]:
        try:
            return super().stop()
        finally:
            for p in self.proxies:
                p.close()


@dataclass
class NetnsFederation(LocalFederation):
    """A :class:`LocalFederation` whose SuperNodes run in the namespaces of a :class:`NetnsLab`.

    The SuperLink binds the lab's bridge address in the root namespace (its certificate names
    it); SuperNode ``i`` runs in host ``i``'s namespace (``ip netns exec``) and dials the bridge
    address through its own shaped access link. Its warm executor and worker are its children,
    in the same namespace.
    """

    lab: Any = None

    def supernode_prefix(self, partition_id: int) -> list[str]:
        return list(self.lab.prefix(partition_id))


# ------------------------------------------------------------------------------------------
# Flower
# ------------------------------------------------------------------------------------------
def flower_runs(profile: LinkProfile, out: Path, seed: int, rounds: int, strategies: Sequence[str],
                nodes: int = NODES, lab: Any = None) -> list[dict[str, Any]]:
    """One federation over ``profile``; each strategy run on it in turn; one result dict per strategy.

    ``lab`` (a :class:`~graphfl.bench.netns.NetnsLab` of ``nodes`` hosts, already shaped with
    ``profile``): the SuperNodes run in its namespaces instead of behind user-space proxies.
    """
    from graphfl.deploy.run import prepare, write_overrides
    from graphfl.server.flower_app import write_app_dir

    results = []
    t0 = time.perf_counter()
    fed: LocalFederation
    counters: Callable[[], dict[str, float]]
    if lab is None:
        proxied = fed = ProxiedFederation(out, nodes, tls=True, clientapp_mode="warm", profile=profile, seed=seed)
        counters = lambda: proxy_totals(proxied.proxies)  # noqa: E731
    else:
        fed = NetnsFederation(out, nodes, tls=True, clientapp_mode="warm", superlink_host=lab.gateway, lab=lab)
        counters = lab.counters
    with fed:
        startup = time.perf_counter() - t0
        for strategy in strategies:
            cfg, run_out = prepare(parse_run_config({"strategy": strategy, "task": TASK, "nodes": nodes, "rounds": rounds,
                                                     "seed": seed, "engine": "local-deployment",
                                                     "round-timeout": FLOWER_ROUND_TIMEOUT_S,
                                                     "out-dir": str(out / strategy)}))
            before = counters()
            sub = fed.submitter()
            handle = sub.submit(write_app_dir(run_out / "app"), write_overrides(run_out / "run-config.toml", cfg), run_out)
            t_run = time.perf_counter()
            error = None
            try:
                sub.wait(handle, timeout=cfg.connect_timeout + (rounds + 2) * cfg.round_timeout, health=fed.health,
                         status_every=2.0)
            except (FederationError, TimeoutError) as exc:  # recorded, the bench goes on with the next run
                logger.warning("flower %s over %s failed: %s", strategy, profile.name, exc)
                error = str(exc)
            wall = time.perf_counter() - t_run
            res = flower_result(run_out, strategy, nodes)
            res.update({"runtime": "flower", "strategy": strategy, "profile": profile.name, "seed": seed,
                        "federation_start": startup, "wall": wall, "error": error,
                        "link": _delta(counters(), before)})
            results.append(res)
    return results


def flower_result(run_out: Path, strategy: str, nodes: int) -> dict[str, Any]:
    """Per-round seconds, losses, bytes and replies of one graphfl run (its ``run.json``)."""
    try:
        doc = json.loads((run_out / "run.json").read_text())
        curve = doc["methods"][strategy]["curve"]
    except (OSError, ValueError, KeyError) as exc:
        return {"rounds": [], "losses": [], "status": f"no run.json ({exc})", "rounds_completed": 0}
    rows = [r for r in curve if r["round"] >= 1]
    join = curve[0] if curve and curve[0]["round"] == 0 else {}
    return {
        "status": doc.get("status"),
        "join": join.get("seconds"),
        "initial_loss": join.get("test_loss"),
        "rounds": [r["seconds"] for r in rows],
        "losses": [r.get("test_loss") for r in rows],
        "accs": [r.get("test_acc") for r in rows],
        "rounds_completed": len(rows),
        "payload_bytes": int(sum((r.get("bytes_up") or 0) + (r.get("bytes_down") or 0) for r in curve)),
        "failed_rounds": sum(1 for r in rows if (r.get("clients_ok") or 0) < nodes),
        "missing_replies": int(sum(max(0, nodes - (r.get("clients_ok") or 0)) for r in rows)),
        "final_loss": rows[-1].get("test_loss") if rows else None,
        "final_acc": rows[-1].get("test_acc") if rows else None,
    }


# ------------------------------------------------------------------------------------------
# p2p
# ------------------------------------------------------------------------------------------
def p2p_run(profile: LinkProfile, out: Path, seed: int, rounds: int, nodes: int = NODES,
            lab: Any = None) -> dict[str, Any]:
    """DFL-GT on a ring of ``nodes`` peer processes, every connection through a proxy with ``profile``.

    ``lab`` (a :class:`~graphfl.bench.netns.NetnsLab`): peer ``i`` runs in host ``i``'s namespace
    at its address there (certificates re-issued to name the lab's addresses), no proxies.
    """
    from graphfl.common.certs import generate_network_certs
    from graphfl.deploy.p2p_launch import PeerProcesses, collect, prepare_network
    from graphfl.deploy.p2p_launch import write_report as write_peer_report
    from graphfl.p2p.config import load_network_file, write_network_file

    settings = {**P2P_SETTINGS, "rounds": rounds, "seed": seed}
    real_file = prepare_network(out, "ring", nodes, settings, seed=seed)
    net = load_network_file(real_file)
    listen = {p.id: p.address for p in net.topology.peers}
    proxies: list[LinkProxy] = []
    args: dict[int, list[str]] = {}
    try:
        if lab is None:
            for p in net.topology.peers:
                host, _, port = p.address.rpartition(":")
                proxies.append(LinkProxy(host, int(port), profile, seed=seed * 1000 + 100 + p.id))
            addresses = {p.id: proxies[p.id].address for p in net.topology.peers}
            args = {i: ["--listen", listen[i]] for i in range(nodes)}
        else:
            generate_network_certs(out / "certs", nodes,
                                   hosts=("127.0.0.1", "localhost", *(lab.address(i) for i in range(nodes))))
            addresses = {p.id: f"{lab.address(p.id)}:{p.address.rpartition(':')[2]}" for p in net.topology.peers}
            args = {i: [] for i in range(nodes)}
        topo = dataclasses.replace(net.topology, peers=tuple(
            dataclasses.replace(p, address=addresses[p.id]) for p in net.topology.peers))
        network_file = write_network_file(out / "network.toml", topo, net.run, net.tls)
        bound = net.run.connect_timeout + rounds * net.run.round_timeout + 60.0
        before = lab.counters() if lab is not None else {}
        t0 = time.monotonic()
        error = None
        with PeerProcesses(network_file, out, ()) as procs:
            if lab is not None:
                procs.prefix = {i: lab.prefix(i) for i in range(nodes)}
            for i in range(nodes):
                procs.start(i, args[i])
            if not procs.wait_all(t0 + bound):
                error = f"peers did not finish within {bound:.0f} s"
                procs.stop_all()
            codes = procs.exit_codes()
        wall = time.monotonic() - t0
        if lab is None:
            link = proxy_totals(proxies)
        else:  # every peer-to-peer byte leaves one host and reaches another: count it once, on the way out
            moved = _delta(lab.counters(), before)
            link = {"bytes_up": moved["bytes_up"], "bytes_down": 0.0, "drops": moved["drops"]}
    finally:
        for proxy in proxies:
            proxy.close()
    doc = collect(out, network_file, codes, wall)
    write_peer_report(out, doc)
    if not doc["ok"] and error is None:
        error = "; ".join(f"peer {i}: {p['outcome']} (exit {p['exit_code']})"
                          for i, p in doc["peers"].items() if p["outcome"] != "done")
    m = doc["methods"][net.run.algorithm]
    curve = m["curve"]
    cumulative = [c["seconds"] for c in curve]  # a peer's record holds seconds since its first round began
    per_round = [b - a for a, b in zip([0.0, *cumulative[:-1]], cumulative)]
    return {
        "runtime": "p2p", "strategy": net.run.algorithm, "profile": profile.name, "seed": seed,
        "status": "done" if doc["ok"] else "incomplete", "error": error, "wall": wall,
        "rounds": per_round, "losses": [c["test_loss"] for c in curve], "accs": [None] * len(curve),
        "rounds_completed": len(curve),
        "payload_bytes": int(m["final"]["payload_sent"]),
        "failed_rounds": sum(1 for c in curve if c["missing"]),
        "missing_replies": int(sum(p.get("skipped_rounds", 0) for p in doc["peers"].values())),
        "final_loss": m["final"]["test_loss"], "final_acc": None,
        "peers_done": m["final"]["peers_done"], "link": link,
    }


# ------------------------------------------------------------------------------------------
# summary
# ------------------------------------------------------------------------------------------
def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(statistics.median(vals)) if vals else None


def time_to_target(rounds: Sequence[float], losses: Sequence[float | None], target: float | None) -> float | None:
    """Seconds of rounds 1..r for the first round r whose loss is <= ``target``; ``None`` if never reached."""
    if target is None:
        return None
    elapsed = 0.0
    for sec, loss in zip(rounds, losses):
        elapsed += sec
        if loss is not None and loss <= target:
            return elapsed
    return None


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (runtime, strategy, profile): medians over seeds of each run's figures."""
    keys = sorted({(r["runtime"], r["strategy"], r["profile"]) for r in runs}, key=lambda k: (k[0], k[1]))
    targets: dict[tuple[str, str, int], float | None] = {}
    for r in runs:
        if r["profile"] == "lan":
            targets[(r["runtime"], r["strategy"], r["seed"])] = (
                None if r.get("final_loss") is None else r["final_loss"] * (1 + TARGET_SLACK))
    rows = []
    order = {name: i for i, name in enumerate(PROFILES)}
    for runtime, strategy, profile in sorted(keys, key=lambda k: (k[0], k[1], order.get(k[2], 99))):
        group = [r for r in runs if (r["runtime"], r["strategy"], r["profile"]) == (runtime, strategy, profile)]
        ttt = [time_to_target(r["rounds"], r["losses"], targets.get((runtime, strategy, r["seed"]))) for r in group]
        per_round = [_median(r["rounds"]) for r in group]
        rows.append({
            "runtime": runtime, "strategy": strategy, "profile": profile, "seeds": len(group),
            "s_per_round": _median(per_round),
            "time_to_target_s": _median(ttt) if all(t is not None for t in ttt) else None,
            "target_reached": f"{sum(t is not None for t in ttt)}/{len(ttt)}",
            "rounds_completed": f"{sum(r['rounds_completed'] for r in group)}",
            "final_loss": _median([r.get("final_loss") for r in group]),
            "final_acc": _median([r.get("final_acc") for r in group]),
            "payload_MB": _median([r["payload_bytes"] / 1e6 for r in group]),
            "wire_MB": _median([(r["link"].get("bytes_up", 0) + r["link"].get("bytes_down", 0)) / 1e6 for r in group]),
            "failed_rounds": int(sum(r["failed_rounds"] for r in group)),
            "missing_replies": int(sum(r["missing_replies"] for r in group)),
            "link_resets": int(sum(r["link"].get("resets", 0) for r in group)),
            "link_stalls": int(sum(r["link"].get("stalls", 0) for r in group)),
            "errors": "; ".join(sorted({str(r["error"]) for r in group if r.get("error")})) or "",
        })
    return rows


METRICS = (Metric("s_per_round", "s/round (median)", fmt=".3f"),
           Metric("time_to_target_s", "time to target s", fmt=".2f"),
           Metric("final_loss", "final loss", fmt=".4f"),
           Metric("final_acc", "final acc", lower_is_better=False, fmt=".4f"),
           Metric("payload_MB", "payload MB", fmt=".3f"),
           Metric("wire_MB", "wire MB", fmt=".3f"),
           Metric("failed_rounds", "failed rounds", fmt=".0f", paired=False),
           Metric("missing_replies", "missing", fmt=".0f", paired=False),
           Metric("link_resets", "resets", fmt=".0f", paired=False),
           Metric("link_stalls", "stalls", fmt=".0f", paired=False))
REFERENCE = "flower-fedavg"


def method_name(res: dict[str, Any]) -> str:
    """A run's method on the harness: ``<runtime>-<strategy>`` (``flower-fedavg``, ``p2p-dfl-gt``)."""
    return f"{res['runtime']}-{res['strategy']}"


def run_final(res: dict[str, Any], targets: dict[tuple[str, str, int], float | None]) -> dict[str, Any]:
    """One run's metrics (:data:`METRICS`); ``targets``: the lan runs' target losses by (runtime, strategy, seed)."""
    link = res.get("link") or {}
    return {"s_per_round": _median(res["rounds"]),
            "time_to_target_s": time_to_target(res["rounds"], res["losses"],
                                               targets.get((res["runtime"], res["strategy"], res["seed"]))),
            "final_loss": res.get("final_loss"), "final_acc": res.get("final_acc"),
            "payload_MB": res.get("payload_bytes", 0) / 1e6,
            "wire_MB": (link.get("bytes_up", 0) + link.get("bytes_down", 0)) / 1e6,
            "failed_rounds": res.get("failed_rounds", 0), "missing_replies": res.get("missing_replies", 0),
            "link_resets": link.get("resets", 0), "link_stalls": link.get("stalls", 0)}


def lan_target(res: dict[str, Any]) -> float | None:
    """The target loss a lan run sets for its runtime, strategy and seed (:data:`TARGET_SLACK`)."""
    return None if res.get("final_loss") is None else res["final_loss"] * (1 + TARGET_SLACK)


def run_failed(res: dict[str, Any]) -> str | None:
    """Why a run counts as failed on the harness: it completed no round (its other errors stay in ``runs``).

    A joint cell's whole result (``methods``: every run of a profile and seed) has not failed.
    """
    if res.get("rounds_completed") or "methods" in res:
        return None
    return str(res.get("error") or res.get("status") or "no round completed")


def measure_profile(out: Path, plan: Plan, method: str, say: Callable[[str], None],
                    targets: dict[tuple[str, str, int], float | None], cell: Cell) -> dict[str, Any]:
    """Profile ``cell.at["profile"]`` with seed ``cell.seed``: one emulated network, Flower's strategies, the ring."""
    name, s = cell.at["profile"], cell.seed
    profile = PROFILES[name]
    runs: list[dict[str, Any]] = []
    with _lab(method, plan.nodes, profile) as lab:
        say(f"seed {s}, {name}: Flower ({', '.join(plan.strategies)}), {plan.flower_rounds} rounds")
        for res in flower_runs(profile, out / "runs" / f"flower-{name}-s{s}", s, plan.flower_rounds,
                               plan.strategies, plan.nodes, lab=lab):
            runs.append(res)
            say(f"  {res['strategy']}: rounds " + ", ".join(f"{x:.2f}" for x in res["rounds"]) + " s")
        say(f"seed {s}, {name}: p2p DFL-GT, {plan.p2p_rounds} rounds")
        res = p2p_run(profile, out / "runs" / f"p2p-{name}-s{s}", s, plan.p2p_rounds, plan.nodes, lab=lab)
    runs.append(res)
    say(f"  p2p: median round {_median(res['rounds']) or float('nan'):.3f} s, "
        f"{res['rounds_completed']} rounds, {res['failed_rounds']} with a missing neighbour")
    if name == "lan":
        for r in runs:
            targets[(r["runtime"], r["strategy"], s)] = lan_target(r)
    return {"runs": runs, "methods": {method_name(r): r for r in runs}}


def declare(out: Path, plan: Plan, method: str, say: Callable[[str], None]) -> tuple[Bench, dict[Any, Any]]:
    """The benchmark on the harness, measurement mode; also the lan targets its cells fill in."""
    targets: dict[tuple[str, str, int], float | None] = {}
    methods = [f"flower-{s}" for s in plan.strategies] + [f"p2p-{P2P_SETTINGS['algorithm']}"]
    pairs = [(m, REFERENCE) for m in methods if m != REFERENCE] if REFERENCE in methods else []
    bench = Bench(name=NAME, title=f"bench network: Flower and p2p over emulated links ({method})",
                  methods=methods, points=[{"profile": n} for n in plan.profiles], seeds=list(plan.seeds),
                  metrics=METRICS, run_cell=partial(measure_profile, out, plan, method, say, targets), joint=True,
                  final=lambda res: run_final(res, targets), failed=run_failed, pairs=pairs, cache="none")
    return bench, targets


def run(quick: bool = False, seed: int = 0, out: Path | None = None, plan: Plan | None = None,
        progress: Callable[[str], None] | None = None, emulation: str = "auto") -> dict[str, Any]:
    """Run the benchmark; write ``<out>/network.{json,md,png}``; return the document.

    ``emulation`` (``--emulation``): ``auto``, ``user-space`` or ``netns`` (:data:`EMULATIONS`).
    """
    out = Path(out or "runs/bench-network").resolve()
    out.mkdir(parents=True, exist_ok=True)
    plan = plan or plan_for(quick, seed)
    say = progress or (lambda text: logger.info("%s", text))
    load_before = os.getloadavg()
    how = emulation_method(detect_netem(), emulation, [PROFILES[n] for n in plan.profiles])
    say(f"emulation: {how['why']}")
    if how["not_emulated"]:
        say(f"not emulated by the kernel path: {how['not_emulated']}")
    bench, _ = declare(out, plan, how["method"], say)
    outcome = run_bench(bench, None)
    runs = [r for point in plan.profiles for s in plan.seeds
            for r in outcome.joint[((("profile", point),), s)].get("runs", [])]
    config = {"quick": quick, "nodes": plan.nodes, "task": TASK,
              "strategies": list(plan.strategies), "flower_rounds": plan.flower_rounds,
              "p2p_rounds": plan.p2p_rounds, "p2p_settings": P2P_SETTINGS, "target_slack": TARGET_SLACK,
              "profiles": {n: PROFILES[n].to_dict() for n in plan.profiles},
              "flower": ("warm ClientApp workers, TLS, " + (
                  "one proxy per SuperNode -> SuperLink" if how["method"] == "user-space"
                  else "SuperNode i in namespace i, behind its own shaped access link")),
              "p2p": "ring, mutual TLS, " + (
                  "one proxy in front of each peer (each connection its own link)" if how["method"] == "user-space"
                  else "peer i in namespace i: a path i -> j crosses i's uplink and j's downlink")}
    doc = build_doc(bench, outcome, quick, config, extra={
        "emulation": how, "summary": summarize(runs), "runs": runs,
        "load_average": {"start": list(load_before), "end": list(os.getloadavg()), "cpus": os.cpu_count()}})
    text = render(doc).split("\n")
    profiles_at, env_at = text.index("## Link profiles (each direction of each connection)"), text.index("## Environment")
    load = doc["load_average"]
    write_report(out, doc, intro=text[2:profiles_at - 1], sections=[
        *text[profiles_at:env_at],
        f"Load average (1/5/15 min) at start {_loads(load['start'])}, at end {_loads(load['end'])} on "
        f"{load['cpus']} CPUs."])
    plot(out / f"{NAME}.png", doc)
    return doc


def _lab(method: str, hosts: int, profile: LinkProfile) -> Any:
    """A :class:`~graphfl.bench.netns.NetnsLab` for the kernel methods; a context giving ``None`` otherwise."""
    import contextlib

    from graphfl.bench.netns import NetnsLab

    if method == "user-space":
        return contextlib.nullcontext(None)
    return NetnsLab(hosts, profile, netem=method == "netns-netem")


def _f(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def render(doc: dict[str, Any]) -> str:
    """The Markdown report."""
    cfg = doc["config"]
    lines = [f"# bench network ({'quick' if cfg['quick'] else 'full'})", "",
             f"Emulation: **{doc['emulation']['method']}** — {doc['emulation']['why']}.", "",
             *([f"Not emulated by the kernel path (user-space notions): {doc['emulation']['not_emulated']}.", ""]
               if doc["emulation"].get("not_emulated") else []),
             f"{cfg['nodes']} nodes on `{cfg['task']}`; Flower: {', '.join(cfg['strategies'])}, "
             f"{cfg['flower_rounds']} rounds ({cfg['flower']}); p2p: DFL-GT, {cfg['p2p_rounds']} rounds "
             f"({cfg['p2p']}); seeds {cfg['seeds']}.", "",
             "## Link profiles (each direction of each connection)", ""]
    prow = [{"profile": n, "delay ms": f"{p['delay_ms']:g}", "jitter ms": f"±{p['jitter_ms']:g}",
             "rate Mbit/s": "unlimited" if p["rate_mbit"] is None else f"{p['rate_mbit']:g}",
             "stalls": f"{p['stall_per_s']:g}/s × {p['stall_ms']:g} ms" if p["stall_per_s"] else "none",
             "resets": f"{p['reset_per_s']:g}/s" if p["reset_per_s"] else "none"} for n, p in cfg["profiles"].items()]
    lines += [markdown_table(prow, list(prow[0])), "",
              "## Per runtime, strategy and profile (medians over seeds)", "",
              f"s/round: median over rounds (median over seeds). Time to target: seconds of rounds 1..r until the "
              f"mean test loss is within {100 * cfg['target_slack']:.0f} % of the lan run's final loss (same runtime "
              "and strategy; join excluded). payload: graphfl's model bytes; wire: bytes through the proxies (TLS, "
              "HTTP, gRPC, polls). Failed rounds: Flower rounds with fewer replies than nodes / p2p rounds in which a "
              "peer went on without a neighbour; missing: replies (Flower) / peer-rounds (p2p) missed; resets and "
              "stalls: link events (a stall is counted once per outage window that held data, per direction and "
              "connection).", ""]
    rows = [{"runtime": r["runtime"], "strategy": r["strategy"], "profile": r["profile"],
             "s/round": _f(r["s_per_round"], 3), "time to target s": _f(r["time_to_target_s"]),
             "reached": r["target_reached"], "final loss": _f(r["final_loss"], 4), "final acc": _f(r["final_acc"], 4),
             "payload MB": _f(r["payload_MB"], 3), "wire MB": _f(r["wire_MB"], 3),
             "failed rounds": r["failed_rounds"], "missing": r["missing_replies"],
             "resets": r["link_resets"], "stalls": r["link_stalls"], "errors": r["errors"] or "–"}
            for r in doc["summary"]]
    if rows:
        lines += [markdown_table(rows, list(rows[0])), ""]
    env = doc.get("env", {})
    load = doc.get("load_average") or {}
    lines += ["## Environment", "", markdown_table([env], list(env)), "",
              f"Benchmark wall time: {doc['seconds']:.0f} s."
              + (f" Load average (1/5/15 min) at start {_loads(load['start'])}, at end {_loads(load['end'])} on "
                 f"{load['cpus']} CPUs." if load else ""), ""]
    return "\n".join(lines)


def _loads(values: Sequence[float]) -> str:
    return "/".join(f"{v:.1f}" for v in values)


def plot(path: Path, doc: dict[str, Any]) -> None:
    """Loss against elapsed seconds per run (seed 0 of each), and seconds per round per profile."""
    loss_series: dict[str, list[dict[str, Any]]] = {}
    first_seed = doc["config"]["seeds"][0]
    for r in doc["runs"]:
        if r["seed"] != first_seed:
            continue
        elapsed, pts = 0.0, []
        for sec, loss in zip(r["rounds"], r["losses"]):
            elapsed += sec
            pts.append({"t": elapsed, "loss": loss})
        loss_series[f"{r['runtime']}/{r['strategy']}/{r['profile']}"] = pts
    prof_index = {n: i for i, n in enumerate(doc["config"]["profiles"])}
    bars: dict[str, list[dict[str, Any]]] = {}
    for row in doc["summary"]:
        bars.setdefault(f"{row['runtime']}/{row['strategy']}", []).append(
            {"profile": prof_index.get(row["profile"], -1), "s": row["s_per_round"]})
    panels = [{"x": "t", "y": "loss", "series": loss_series, "title": "mean test loss vs elapsed seconds (join excluded)",
               "xlabel": "seconds", "ylabel": "test loss", "logx": True},
              {"x": "profile", "y": "s", "series": bars, "logy": True,
               "title": "seconds per round; profile " + ", ".join(f"{i}={n}" for n, i in prof_index.items()),
               "xlabel": "profile", "ylabel": "seconds"}]
    try:
        plot_panels(path, panels, "graphfl bench network")
    except Exception:
        logger.exception("could not draw %s", path)
