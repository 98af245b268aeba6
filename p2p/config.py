"""The p2p run configuration and the network file that carries it.

A network file (``docs/p2p.md``) has the topology tables (``[network]``, ``[[peers]]``,
``[[edges]]``), a ``[run]`` table with the :class:`P2PConfig` keys and an optional ``[tls]``
table (``ca``, ``cert``, ``key``; ``{id}`` in a path is replaced by the peer id; or
``insecure = true`` for plaintext, which must be asked for explicitly). It is parsed once,
here, into frozen dataclasses; unknown keys are errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from graphfl.common.certs import PeerTlsFiles
from graphfl.common.config import (
    ConfigError,
    build_dataclass,
    dataclass_to_flat,
    dump_toml,
    flatten,
    load_toml,
    normalize_key,
    stable_hash,
)
from graphfl.p2p.topology import Topology, topology_from_dict

P2P_ALGORITHMS = ("dfl-sgd", "dfl-gt", "gossip")


@dataclass(frozen=True)
class P2PConfig:
    """Everything every peer of a network must agree on (its hash is checked in handshakes).

    ``rounds`` counts communication rounds; a peer runs ``rounds * tau`` iterations.
    """

    algorithm: str = field(default="dfl-gt", metadata={"choices": P2P_ALGORITHMS})
    rounds: int = field(default=100, metadata={"min": 1})
    tau: int = field(default=1, metadata={"min": 1})
    alpha0: float = field(default=0.1, metadata={"min": 0.0})
    step_rule: str = field(default="inv-sqrt", metadata={"choices": ("inv-sqrt", "constant")})
    init_tracker: str = field(default="gnsd", metadata={"choices": ("gnsd", "zero")})
    same_batch_difference: bool = False
    problem: str = "synthetic-dfl"
    batch_size: int = field(default=32, metadata={"min": 1})
    dim: int = field(default=10, metadata={"min": 1})
    samples: int = field(default=200, metadata={"min": 1})
    standardize: bool = True
    input_scale: float = field(default=1.0, metadata={"min": 0.0})
    seed: int = 0
    on_missing: str = field(default="skip", metadata={"choices": ("skip", "fail")})
    reweight: str = field(default="self", metadata={"choices": ("self", "proportional")})
    round_timeout: float = field(default=30.0, metadata={"min": 0.01})
    send_timeout: float = field(default=30.0, metadata={"min": 0.01})
    connect_timeout: float = field(default=60.0, metadata={"min": 0.1})
    max_ahead: int = field(default=4, metadata={"min": 1})
    chunk_bytes: int = field(default=1 << 20, metadata={"min": 1024, "max": 3 << 20})
    eval_every: int = field(default=1, metadata={"min": 1})
    min_round_seconds: float = field(default=0.0, metadata={"min": 0.0})

    @property
    def iterations(self) -> int:
        return self.rounds * self.tau

    def hash(self) -> str:
        """Stable short hash of the settings (compared in handshakes)."""
        return stable_hash(asdict(self))

    def to_doc(self) -> dict[str, Any]:
        """The ``[run]`` table (flat keys, as in a network file)."""
        return {"run": dataclass_to_flat(self)}


def parse_p2p_config(values: Mapping[str, Any], base: P2PConfig | None = None) -> P2PConfig:
    """Build a :class:`P2PConfig` from flat keys (``round-timeout = 5``), on top of ``base``."""
    flat = {normalize_key(k): v for k, v in flatten(values).items()}
    cfg = build_dataclass(P2PConfig, {**(dataclass_to_flat(base) if base else {}), **flat}, "run")
    return cfg


@dataclass(frozen=True)
class TlsSection:
    """The ``[tls]`` table of a network file (paths may contain ``{id}``)."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    insecure: bool = False


@dataclass(frozen=True)
class NetworkFile:
    """A parsed network file."""

    path: Path
    topology: Topology
    run: P2PConfig
    tls: TlsSection

    def tls_files(self, peer_id: int) -> PeerTlsFiles | None:
        """TLS files of peer ``peer_id`` (paths relative to the network file), or ``None`` if insecure.

        Raises
        ------
        ConfigError
            If neither certificates nor ``insecure = true`` are given.
        """
        if self.tls.insecure:
            return None
        if not (self.tls.ca and self.tls.cert and self.tls.key):
            raise ConfigError(
                f"{self.path}: no TLS certificates in [tls] (ca, cert, key); give them, or set "
                "[tls] insecure = true (or --insecure) to run in plaintext"
            )

        def resolve(p: str) -> Path:
            q = Path(p.replace("{id}", str(peer_id)))
            return q if q.is_absolute() else self.path.parent / q

        return PeerTlsFiles(resolve(self.tls.ca), resolve(self.tls.cert), resolve(self.tls.key))

    def with_run(self, **changes: Any) -> NetworkFile:
        return replace(self, run=replace(self.run, **changes))


_SECTIONS = {"network", "peers", "edges", "run", "tls"}


def load_network_file(path: str | Path, overrides: Mapping[str, Any] | None = None) -> NetworkFile:
    """Read a network file; ``overrides`` are flat ``[run]`` keys (``{"rounds": 5}``)."""
    p = Path(path)
    doc = load_toml(p)
    unknown = sorted(set(doc) - _SECTIONS)
    if unknown:
        raise ConfigError(f"{p}: unknown table(s) {unknown}; valid: {sorted(_SECTIONS)}")
    topo = topology_from_dict(doc, where=str(p), base=p.parent)
    run = parse_p2p_config({**doc.get("run", {}), **(overrides or {})})
    tls = build_dataclass(TlsSection, {normalize_key(k): v for k, v in doc.get("tls", {}).items()}, "tls")
    return NetworkFile(p, topo, run, tls)


def write_network_file(path: str | Path, topology: Topology, run: P2PConfig, tls: TlsSection) -> Path:
    """Write a network file readable by :func:`load_network_file`."""
    p = Path(path)
    tls_table: dict[str, Any] = {"insecure": True} if tls.insecure else {"ca": tls.ca, "cert": tls.cert, "key": tls.key}
    p.write_text(dump_toml({**topology.to_doc(), **run.to_doc(), "tls": tls_table}))
    return p
