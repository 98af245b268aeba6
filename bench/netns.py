"""Emulated hosts in Linux network namespaces, each behind its own shaped access link.

The kernel path of ``graphfl bench network`` (``--emulation netns``; ``auto`` picks it where the
kernel has ``netem``). Root only; needs ``ip`` and ``tc`` (iproute2)::

    root namespace   bridge <tag>br  10.<a>.<b>.1/24     SuperLink, ServerApp, flwr CLI
       |-- veth <tag>h<i>  (bridge port; its qdisc shapes what host i receives)
    namespace <tag>-h<i>
       `-- veth <tag>p<i>  10.<a>.<b>.<10+i>/24, default route via .1 (its qdisc shapes what host i sends)

Every host has one access link with the profile, both directions: a SuperNode's request crosses
its own link once each way (as with the user-space proxy), while a peer-to-peer path ``i -> j``
crosses host ``i``'s uplink and host ``j``'s downlink — two links, so twice the profile's delay
and loss — as between two devices that each sit behind their own link.

Shaping (:func:`qdisc_argv`): ``netem delay D J loss L rate R limit N`` where the kernel has
netem. Without netem only a bandwidth-only profile can be honoured, with ``tbf`` (the lab then
runs, e.g. in the tests here, whose kernel lacks netem); a profile with delay, jitter, loss,
or loss is refused with :class:`LabError` naming what needs netem. Stalls (``stall_per_s``)
and connection resets (``reset_per_s``) are the user-space emulator's notions: the kernel path
emulates loss as packet loss (``loss_pct``) instead and does not emulate them
(:func:`not_emulated`; the results list them).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from graphfl.bench.linkemu import LinkProfile

logger = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 15.0
"""Bound on every ``ip`` / ``tc`` call."""
NETEM_LIMIT_PACKETS = 10_000
"""netem queue length: room for the bandwidth-delay product of the slowest profile and more."""
TBF_BURST_BYTES = 256 * 1024
"""tbf bucket: larger than a veth's GSO super-packets (64 KiB), which tbf would otherwise drop."""


class LabError(RuntimeError):
    """The namespaces or qdiscs could not be set up (or a profile needs netem that is missing)."""


def needs_netem(profile: LinkProfile) -> list[str]:
    """The settings of ``profile`` that only ``netem`` can emulate (empty: ``tbf`` suffices)."""
    return [k for k in ("delay_ms", "jitter_ms", "loss_pct") if getattr(profile, k)]


def not_emulated(profile: LinkProfile) -> list[str]:
    """The settings of ``profile`` the kernel path does not emulate (user-space notions: stalls, resets)."""
    return [k for k in ("stall_per_s", "reset_per_s") if getattr(profile, k)]


def qdisc_argv(dev: str, profile: LinkProfile, netem: bool) -> list[str] | None:
    """The ``tc`` command shaping what leaves ``dev`` (``None``: the profile needs no qdisc).

    netem: ``tc qdisc replace dev DEV root netem [delay Dms [Jms]] [loss L%] [rate Rmbit] limit N``
    (jitter without a distribution table: uniform, as the user-space emulator's). Without netem:
    ``tc qdisc replace dev DEV root tbf rate Rmbit burst B latency 100ms`` for a bandwidth-only
    profile; :class:`LabError` for any other.
    """
    rate = profile.rate_mbit
    if netem:
        argv = ["tc", "qdisc", "replace", "dev", dev, "root", "netem"]
        if profile.delay_ms or profile.jitter_ms:
            argv += ["delay", f"{profile.delay_ms:g}ms"]
            if profile.jitter_ms:
                argv.append(f"{profile.jitter_ms:g}ms")
        if profile.loss_pct:
            argv += ["loss", f"{profile.loss_pct:g}%"]
        if rate:
            argv += ["rate", f"{rate:g}mbit"]
        return [*argv, "limit", str(NETEM_LIMIT_PACKETS)]
    missing = needs_netem(profile)
    if missing:
        raise LabError(f"link profile {profile.name!r} sets {missing}, which needs the netem qdisc, and this kernel "
                       "has none; use --emulation user-space (or auto)")
    if not rate:
        return None
    return ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate:g}mbit",
            "burst", str(TBF_BURST_BYTES), "latency", "100ms"]


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabError(f"`{' '.join(argv)}` failed: {exc}") from None
    if check and done.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed: {(done.stderr or done.stdout).strip()}")
    return done


def lab_available() -> str | None:
    """``None`` when namespaces can be made here, else why not (not root, no iproute2)."""
    if os.geteuid() != 0:
        return "not root: network namespaces and qdiscs need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "`ip` or `tc` not installed (iproute2)"
    return None


def _free_slot() -> int:
    """A number not used by another lab's bridge on this machine (its tag and subnet derive from it)."""
    taken = {p.name for p in Path("/sys/class/net").iterdir()} if Path("/sys/class/net").is_dir() else set()
    start = os.getpid() % 4000
    for k in range(4000):
        slot = (start + k) % 4000
        if f"gfl{slot}br" not in taken:
            return slot
    raise LabError("no free lab slot (4000 bridges named gfl<k>br exist)")


@dataclass
class NetnsLab:
    """``hosts`` namespaces on one bridge, each behind an access link shaped by ``profile``.

    A context manager: ``__enter__`` builds everything (and removes what it built if a step
    fails), ``__exit__`` deletes the namespaces and the bridge. Stop the processes inside first.
    """

    hosts: int
    profile: LinkProfile
    netem: bool
    slot: int = field(default_factory=_free_slot)
    made_ns: list[str] = field(init=False, default_factory=list)
    made_bridge: bool = field(init=False, default=False)

    @property
    def tag(self) -> str:
        return f"gfl{self.slot}"

    @property
    def subnet(self) -> str:
        return f"10.{200 + self.slot // 250}.{self.slot % 250}"

    @property
    def gateway(self) -> str:
        """The bridge's address in the root namespace (where the SuperLink listens)."""
        return f"{self.subnet}.1"

    def address(self, i: int) -> str:
        """Host ``i``'s address (inside its namespace)."""
        return f"{self.subnet}.{10 + i}"

    def namespace(self, i: int) -> str:
        return f"{self.tag}-h{i}"

    def prefix(self, i: int) -> list[str]:
        """Command prefix that runs a program inside host ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(i)]

    def root_dev(self, i: int) -> str:
        return f"{self.tag}h{i}"

    def host_dev(self, i: int) -> str:
        return f"{self.tag}p{i}"

    def __enter__(self) -> NetnsLab:
        why = lab_available()
        if why:
            raise LabError(why)
        if self.hosts < 1 or self.hosts > 200:
            raise LabError(f"a lab has 1..200 hosts, got {self.hosts}")
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        br = f"{self.tag}br"
        _run(["ip", "link", "add", br, "type", "bridge"])
        self.made_bridge = True
        _run(["ip", "addr", "add", f"{self.gateway}/24", "dev", br])
        _run(["ip", "link", "set", br, "up"])
        for i in range(self.hosts):
            ns, outer, inner = self.namespace(i), self.root_dev(i), self.host_dev(i)
            _run(["ip", "netns", "add", ns])
            self.made_ns.append(ns)
            _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner])
            _run(["ip", "link", "set", inner, "netns", ns])
            _run(["ip", "link", "set", outer, "master", br])
            _run(["ip", "link", "set", outer, "up"])
            inside = self.prefix(i)
            _run([*inside, "ip", "link", "set", "lo", "up"])
            _run([*inside, "ip", "addr", "add", f"{self.address(i)}/24", "dev", inner])
            _run([*inside, "ip", "link", "set", inner, "up"])
            _run([*inside, "ip", "route", "add", "default", "via", self.gateway])
            down = qdisc_argv(outer, self.profile, self.netem)   # root side: what host i receives
            up = qdisc_argv(inner, self.profile, self.netem)     # host side: what host i sends
            if down:
                _run(down)
            if up:
                _run([*inside, *up])
        logger.info("netns lab %s: %d hosts on %s.0/24, profile %s (%s)", self.tag, self.hosts, self.subnet,
                    self.profile.name, "netem" if self.netem else "tbf")

    def counters(self) -> dict[str, float]:
        """Bytes on the hosts' links, summed: ``bytes_up`` (sent by the hosts), ``bytes_down``
        (received by the hosts), ``drops``; read on the root side of each veth.

        A byte between two hosts is counted in both (it leaves one host and reaches another); a
        byte between a host and the root namespace in one.
        """
        total = {"bytes_up": 0.0, "bytes_down": 0.0, "drops": 0.0}
        for i in range(self.hosts):
            stats = Path("/sys/class/net") / self.root_dev(i) / "statistics"
            try:
                total["bytes_down"] += int((stats / "tx_bytes").read_text())
                total["bytes_up"] += int((stats / "rx_bytes").read_text())
                total["drops"] += int((stats / "tx_dropped").read_text()) + int((stats / "rx_dropped").read_text())
            except (OSError, ValueError):
                continue
        return total

    def close(self) -> None:
        """Delete the namespaces (their veths go with them) and the bridge; never raises."""
        for i in range(len(self.made_ns)):  # the kernel frees a namespace's veths later; delete them now
            if Path("/sys/class/net", self.root_dev(i)).exists():
                try:
                    _run(["ip", "link", "del", self.root_dev(i)], check=False)
                except LabError:
                    pass
        for ns in reversed(self.made_ns):
            try:
                done = _run(["ip", "netns", "del", ns], check=False)
                if done.returncode != 0:
                    logger.warning("could not delete network namespace %s: %s", ns, done.stderr.strip())
            except LabError as exc:
                logger.warning("could not delete network namespace %s: %s", ns, exc)
        self.made_ns.clear()
        if self.made_bridge:
            try:
                _run(["ip", "link", "del", f"{self.tag}br"], check=False)
            except LabError as exc:
                logger.warning("could not delete bridge %sbr: %s", self.tag, exc)
            self.made_bridge = False
