"""Peer addresses as endpoints: two peers on the same host and port are one socket, so refused.

An address ``HOST:PORT`` names an endpoint by the set of IP addresses its host stands for and its
port as an integer (``:050051`` is port 50051):

* a numeric host (``127.0.0.1``, ``[::1]``, ``::ffff:127.0.0.1``) is normalised by
  :mod:`ipaddress` (an IPv4-mapped IPv6 address is its IPv4 address);
* a name (``localhost``, ``peer-3.lan``) is resolved with :func:`socket.getaddrinfo`, with a
  bounded effort: all names of a network together get :data:`RESOLVE_BUDGET_S` seconds; a name
  that does not resolve in time (or at all) is compared by its text (lower case, no trailing dot),
  and a warning says so.

Two peers clash when their ports are equal and their address sets share an IP (or, for
unresolved names, their texts are equal).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

logger = logging.getLogger(__name__)

RESOLVE_BUDGET_S = 2.0
"""Wall-clock bound of resolving every host name of one network file (getaddrinfo in threads)."""

_RESOLVED: dict[str, frozenset[str]] = {}
"""Names resolved before in this process (a network is validated several times while a run starts)."""


class AddressClash(ValueError):
    """Two peers name the same host:port; the message names both peers."""


@dataclass(frozen=True)
class Endpoint:
    """``hosts``: the normalised IPs (or the name's text when unresolved); ``port`` an integer."""

    hosts: frozenset[str]
    port: int


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` → ``(host, port)``; brackets around an IPv6 host are removed.

    Raises
    ------
    ValueError
        No ``:``, an empty host, or a port that is not an integer in 0..65535.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"address must be HOST:PORT with a port in 0..65535, got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def numeric_host(host: str) -> str | None:
    """The normalised form of a numeric IP host, or ``None`` for a name."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def _lookup(name: str) -> frozenset[str]:
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    out = {numeric_host(str(info[4][0])) for info in infos}
    return frozenset(h for h in out if h is not None)


def resolve_names(names: Iterable[str], budget_s: float = RESOLVE_BUDGET_S) -> dict[str, frozenset[str]]:
    """IPs of each host name, looked up in parallel within ``budget_s`` seconds in all.

    A name that fails or is not answered in time maps to ``{name}`` (its text; logged).
    """
    todo = sorted({n for n in names if n not in _RESOLVED})
    if todo:
        pool = ThreadPoolExecutor(max_workers=min(16, len(todo)), thread_name_prefix="resolve")
        futures = {name: pool.submit(_lookup, name) for name in todo}
        wait(futures.values(), timeout=budget_s)
        pool.shutdown(wait=False, cancel_futures=True)   # a hung lookup is left behind, not waited for
        for name, fut in futures.items():
            ips: frozenset[str] = frozenset()
            if fut.done() and fut.exception() is None:
                ips = fut.result()
            if ips:
                _RESOLVED[name] = ips
            else:
                why = "did not resolve" if fut.done() else f"was not resolved within {budget_s:g} s"
                logger.warning("peer host %r %s; compared with the other addresses by its text", name, why)
    return {n: _RESOLVED.get(n, frozenset({n})) for n in names}


def endpoints(addresses: Sequence[str], budget_s: float = RESOLVE_BUDGET_S) -> list[Endpoint]:
    """The :class:`Endpoint` of each address (module rules), in order."""
    split = [split_address(a) for a in addresses]
    names = {h.lower().rstrip(".") for h, _ in split if numeric_host(h) is None}
    resolved = resolve_names(names, budget_s) if names else {}
    out = []
    for host, port in split:
        num = numeric_host(host)
        out.append(Endpoint(frozenset({num}) if num is not None else resolved[host.lower().rstrip(".")], port))
    return out


def check_distinct(peers: Sequence[tuple[int, str]], budget_s: float = RESOLVE_BUDGET_S) -> None:
    """Refuse two peers ``(id, address)`` on the same endpoint.

    Raises
    ------
    AddressClash
        Naming both peers, their addresses and the shared host:port.
    ValueError
        An address that is not ``HOST:PORT`` (naming the peer).
    """
    t0 = time.monotonic()
    for pid, address in peers:
        try:
            split_address(address)
        except ValueError as exc:
            raise ValueError(f"peer {pid}: {exc}") from None
    eps = endpoints([a for _, a in peers], budget_s)
    seen: dict[tuple[str, int], int] = {}
    for k, ep in enumerate(eps):
        for host in sorted(ep.hosts):
            first = seen.setdefault((host, ep.port), k)
            if first != k:
                (ia, aa), (ib, ab) = peers[first], peers[k]
                raise AddressClash(f"peers {ia} ({aa}) and {ib} ({ab}) are the same host:port "
                                   f"({host}:{ep.port}); every peer needs its own address")
    logger.debug("checked %d peer addresses in %.3f s", len(peers), time.monotonic() - t0)
