"""Network descriptions: peers (id, address, data partition, device) and weighted undirected edges.

A network is read from the ``[network]``, ``[[peers]]`` and ``[[edges]]`` tables of a TOML file
(see ``docs/p2p.md``) or generated (``ring``, ``grid``, ``complete``, ``erdos-renyi``, ``knn``,
or an edge-list file). Peer ids are ``0 .. n-1``; they index the rows of the mixing matrix
(ALGORITHMS.md §1.2).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from graphfl.common.config import ConfigError, dump_toml, load_toml, stable_hash
from graphfl.common.graph import read_edge_list
from graphfl.p2p.addresses import check_distinct
from graphfl.p2p.mixing import mixing_matrix

if TYPE_CHECKING:
    import networkx as nx

logger = logging.getLogger(__name__)

GENERATORS = ("ring", "grid", "complete", "erdos-renyi", "knn")


@dataclass(frozen=True)
class PeerInfo:
    """One peer: its id, the address it listens on, its data partition, its device and its own data.

    ``data`` (optional) is the peer's own data for problem ``csv``: its CSV file or the folder
    holding ``device-<partition>.csv`` (relative paths are relative to the network file). It is
    local to the device, so it is not part of the topology fingerprint.

    ``data_port`` (``data-port``, optional) is the port of the peer's socket data path
    (``[run] data-path = "socket"``) on the host of its address; 0 lets the OS choose one. The
    peer announces it in the handshake, so it is not part of the fingerprint either. A fixed one
    is what a firewall can open.
    """

    id: int
    address: str
    partition: int
    device: str = "auto"
    data: str = ""
    data_port: int = 0


@dataclass(frozen=True)
class Topology:
    """Peers and weighted undirected edges ``(i, j, w)`` with ``i < j`` and ``w > 0``."""

    peers: tuple[PeerInfo, ...]
    edges: tuple[tuple[int, int, float], ...]
    name: str = "network"
    version: int = 1
    mixing: str = "metropolis"
    mixing_variant: str = "dmax+1"
    mixing_epsilon: str = ""
    _adj: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.peers)
        ids = [p.id for p in self.peers]
        if ids != list(range(n)):
            raise ConfigError(f"peer ids must be 0..{n - 1} in order, got {ids}")
        try:  # the same host:port under two spellings (localhost / 127.0.0.1, :050051) is refused too
            check_distinct([(p.id, p.address) for p in self.peers])
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        adj = np.zeros((n, n))
        for i, j, w in self.edges:
            if not (0 <= i < n and 0 <= j < n):
                raise ConfigError(f"edge ({i}, {j}) names a peer outside 0..{n - 1}")
            if i == j:
                raise ConfigError(f"edge ({i}, {j}) is a self loop")
            if not (math.isfinite(w) and w > 0):
                raise ConfigError(f"edge ({i}, {j}) has weight {w!r}; weights must be finite and > 0")
            if adj[i, j] != 0:
                raise ConfigError(f"edge ({i}, {j}) is listed twice")
            adj[i, j] = adj[j, i] = w
        object.__setattr__(self, "_adj", adj)

    @property
    def n(self) -> int:
        return len(self.peers)

    def adjacency(self) -> np.ndarray:
        """Symmetric weighted adjacency (copy)."""
        adj: np.ndarray = self._adj.copy()
        return adj

    def neighbours(self, i: int) -> list[int]:
        """Sorted neighbour ids of peer ``i`` (excluding ``i``)."""
        return [int(j) for j in np.nonzero(self._adj[i])[0]]

    def peer(self, i: int) -> PeerInfo:
        if not 0 <= i < self.n:
            raise ConfigError(f"peer id {i} is not in this network (ids 0..{self.n - 1})")
        return self.peers[i]

    def mixing_matrix(self) -> np.ndarray:
        """The validated mixing matrix of this network's rule (:mod:`graphfl.p2p.mixing`)."""
        eps: float | str | None
        if self.mixing_epsilon in ("", None):
            eps = None
        elif self.mixing_epsilon == "best":
            eps = "best"
        else:
            eps = float(self.mixing_epsilon)
        return mixing_matrix(self._adj, self.mixing, variant=self.mixing_variant, epsilon=eps)

    @property
    def fingerprint(self) -> str:
        """``"<version>:<hash of peers, edges and mixing rule>"``, compared in handshakes."""
        digest = stable_hash({
            "peers": [[p.id, p.address, p.partition] for p in self.peers],
            "edges": [[i, j, w] for i, j, w in self.edges],
            "mixing": [self.mixing, self.mixing_variant, self.mixing_epsilon],
        })
        return f"{self.version}:{digest}"

    def to_doc(self) -> dict[str, Any]:
        """The ``[network]``, ``[[peers]]``, ``[[edges]]`` tables (see :func:`topology_from_dict`)."""
        doc: dict[str, Any] = {
            "network": {"name": self.name, "version": self.version, "mixing": self.mixing,
                        "mixing-variant": self.mixing_variant, "mixing-epsilon": self.mixing_epsilon},
            "peers": [{"id": p.id, "address": p.address, "partition": p.partition, "device": p.device,
                       **({"data": p.data} if p.data else {}),
                       **({"data-port": p.data_port} if p.data_port else {})} for p in self.peers],
        }
        if self.edges:
            doc["edges"] = [{"nodes": [i, j], "weight": w} for i, j, w in self.edges]
        return doc

    def to_toml(self) -> str:
        """:meth:`to_doc` as TOML text."""
        return dump_toml(self.to_doc())


def _edges_from_graph(g: nx.Graph) -> tuple[tuple[int, int, float], ...]:
    out = []
    for u, v, data in g.edges(data=True):
        i, j = (int(u), int(v)) if u < v else (int(v), int(u))
        out.append((i, j, float(data.get("weight", 1.0))))
    return tuple(sorted(out))


def default_peers(n: int, host: str = "127.0.0.1", ports: Sequence[int] | None = None) -> tuple[PeerInfo, ...]:
    """``n`` peers on ``host`` with the given ports (default ``50051 + i``), partition = id."""
    ports = list(ports) if ports is not None else [50051 + i for i in range(n)]
    if len(ports) != n:
        raise ConfigError(f"{n} peers need {n} ports, got {len(ports)}")
    return tuple(PeerInfo(i, f"{host}:{ports[i]}", i) for i in range(n))


def generate_graph(kind: str, n: int, *, seed: int = 0, p: float = 0.5, k: int = 2) -> nx.Graph:
    """Graph of ``n`` nodes ``0..n-1`` of a named kind.

    ``grid`` uses the most square ``r x c = n`` factorisation; ``erdos-renyi`` draws ``G(n, p)``
    (up to 100 draws until connected); ``knn`` places ``n`` points uniformly in the unit square
    and links each to its ``k`` nearest (symmetrised), weight ``exp(-dist² / median²)``.
    """
    import networkx as nx  # only the generators need it (a peer process reading a network file does not)

    if n < 1:
        raise ConfigError(f"a network needs at least 1 peer, got {n}")
    if kind == "ring":
        g = nx.cycle_graph(n) if n >= 3 else nx.path_graph(n)
    elif kind == "complete":
        g = nx.complete_graph(n)
    elif kind == "grid":
        r = max(d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0)
        g = nx.convert_node_labels_to_integers(nx.grid_2d_graph(r, n // r), ordering="sorted")
    elif kind == "erdos-renyi":
        if not 0 < p <= 1:
            raise ConfigError(f"erdos-renyi edge probability must be in (0, 1], got {p}")
        g = nx.gnp_random_graph(n, p, seed=seed)
        for extra in range(1, 100):
            if n < 2 or nx.is_connected(g):
                break
            g = nx.gnp_random_graph(n, p, seed=seed + 1000 * extra)
        else:
            logger.warning("erdos-renyi G(%d, %g) stayed disconnected after 100 draws", n, p)
    elif kind == "knn":
        if not 1 <= k < max(n, 2):
            raise ConfigError(f"knn needs 1 <= k < n, got k={k}, n={n}")
        pts = np.random.default_rng(seed).uniform(size=(n, 2))
        d = np.linalg.norm(pts[:, None, :] - pts[None, :, :], axis=-1)
        g = nx.Graph()
        g.add_nodes_from(range(n))
        pairs = set()
        for i in range(n):
            for j in np.argsort(d[i])[1 : k + 1]:
                pairs.add((min(i, int(j)), max(i, int(j))))
        scale = float(np.median([d[i, j] for i, j in pairs])) or 1.0
        for i, j in sorted(pairs):
            g.add_edge(i, j, weight=float(np.exp(-((d[i, j] / scale) ** 2))))
    else:
        raise ConfigError(f"unknown topology {kind!r}; choose one of {list(GENERATORS)} or a .toml / edge-list file")
    return g


def make_topology(
    kind: str,
    n: int | None = None,
    *,
    ports: Sequence[int] | None = None,
    host: str = "127.0.0.1",
    seed: int = 0,
    p: float = 0.5,
    k: int = 2,
    mixing: str = "metropolis",
    mixing_variant: str = "dmax+1",
    mixing_epsilon: str = "",
) -> Topology:
    """A :class:`Topology` from a generator name, an edge-list file or a network TOML file."""
    path = Path(kind)
    if kind.endswith(".toml"):
        topo = load_topology(path)
        if n is not None and n != topo.n:
            raise ConfigError(f"{path} describes {topo.n} peers but {n} were asked for")
        return topo
    if kind not in GENERATORS:
        if not path.is_file():
            raise ConfigError(
                f"unknown topology {kind!r}; choose one of {list(GENERATORS)}, a network .toml or an edge-list file"
            )
        parsed = read_edge_list(path)
        m, edges = parsed.num_nodes, parsed.edges
        if n is not None and n < m:
            raise ConfigError(f"{path} names peers up to {m - 1} but only {n} were asked for")
        n = n if n is not None else m
        name = path.stem
    else:
        if n is None:
            raise ConfigError(f"topology {kind!r} needs a number of peers")
        edges = _edges_from_graph(generate_graph(kind, n, seed=seed, p=p, k=k))
        name = f"{kind}-{n}"
    return Topology(
        peers=default_peers(n, host, ports),
        edges=edges,
        name=name,
        mixing=mixing,
        mixing_variant=mixing_variant,
        mixing_epsilon=mixing_epsilon,
    )


_NETWORK_KEYS = {"name", "version", "mixing", "mixing-variant", "mixing-epsilon", "edge-list"}
_PEER_KEYS = {"id", "address", "partition", "device", "data", "data-port"}
_EDGE_KEYS = {"nodes", "weight"}


def _norm(d: Mapping[str, Any]) -> dict[str, Any]:
    return {str(k).lower().replace("_", "-"): v for k, v in d.items()}


def topology_from_dict(doc: Mapping[str, Any], where: str = "network file", base: Path | None = None) -> Topology:
    """Parse the ``network``/``peers``/``edges`` tables of an already-loaded TOML document."""
    net = _norm(doc.get("network", {}))
    unknown = sorted(set(net) - _NETWORK_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown} in [network]; valid: {sorted(_NETWORK_KEYS)}")
    raw_peers = doc.get("peers")
    if not isinstance(raw_peers, list) or not raw_peers:
        raise ConfigError(f"{where}: needs at least one [[peers]] table (id, address)")
    peers = []
    for idx, rp in enumerate(raw_peers):
        rp = _norm(rp)
        unknown = sorted(set(rp) - _PEER_KEYS)
        if unknown:
            raise ConfigError(f"{where}: [[peers]] #{idx}: unknown key(s) {unknown}; valid: {sorted(_PEER_KEYS)}")
        if "id" not in rp or "address" not in rp:
            raise ConfigError(f"{where}: [[peers]] #{idx} needs 'id' and 'address'")
        try:
            pid = int(rp["id"])
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: [[peers]] #{idx}: id must be an integer, got {rp['id']!r}") from None
        addr = str(rp["address"])
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"{where}: peer {pid}: address must be HOST:PORT, got {addr!r}")
        data = str(rp.get("data", ""))
        if data and base is not None and not Path(data).is_absolute():
            data = str(base / data)
        data_port = rp.get("data-port", 0)
        if isinstance(data_port, bool) or not isinstance(data_port, int) or not 0 <= data_port <= 65535:
            raise ConfigError(f"{where}: peer {pid}: data-port must be an integer in 0..65535 (0 = chosen by the OS), "
                              f"got {data_port!r}")
        peers.append(PeerInfo(pid, addr, int(rp.get("partition", pid)), str(rp.get("device", "auto")), data,
                              data_port))
    peers.sort(key=lambda p: p.id)
    edges: list[tuple[int, int, float]] = []
    if "edge-list" in net:
        ef = Path(net["edge-list"])
        if base is not None and not ef.is_absolute():
            ef = base / ef
        edges_t = read_edge_list(ef).edges
        edges.extend(edges_t)
    for idx, re_ in enumerate(doc.get("edges", [])):
        re_ = _norm(re_)
        unknown = sorted(set(re_) - _EDGE_KEYS)
        if unknown:
            raise ConfigError(f"{where}: [[edges]] #{idx}: unknown key(s) {unknown}; valid: {sorted(_EDGE_KEYS)}")
        nodes = re_.get("nodes")
        if not (isinstance(nodes, list) and len(nodes) == 2 and all(isinstance(x, int) for x in nodes)):
            raise ConfigError(f"{where}: [[edges]] #{idx}: 'nodes' must be two peer ids, got {nodes!r}")
        i, j = sorted(nodes)
        edges.append((i, j, float(re_.get("weight", 1.0))))
    return Topology(
        peers=tuple(peers),
        edges=tuple(sorted(edges)),
        name=str(net.get("name", "network")),
        version=int(net.get("version", 1)),
        mixing=str(net.get("mixing", "metropolis")),
        mixing_variant=str(net.get("mixing-variant", "dmax+1")),
        mixing_epsilon=str(net.get("mixing-epsilon", "")),
    )


def load_topology(path: str | Path) -> Topology:
    """Read a network TOML file (other tables, e.g. ``[run]`` and ``[tls]``, are ignored here)."""
    p = Path(path)
    return topology_from_dict(load_toml(p), where=str(p), base=p.parent)
