"""The p2p run configuration and the network file that carries it.

A network file (``docs/p2p.md``) has the topology tables (``[network]``, ``[[peers]]``,
``[[edges]]``), a ``[run]`` table with the :class:`P2PConfig` keys and an optional ``[tls]``
table (``ca``, ``cert``, ``key``; ``{id}`` in a path is replaced by the peer id; or
``insecure = true`` for plaintext, which must be asked for explicitly). It is parsed once,
here, into frozen dataclasses; unknown keys are errors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from graphfl.common.certs import PeerTlsFiles
from graphfl.common.config import (
    ConfigError,
    build_dataclass,
    dataclass_to_flat,
    dump_toml,
    load_toml,
    normalize_key,
    stable_hash,
)
from graphfl.p2p.algorithms import registry
from graphfl.p2p.algorithms.base import P2PAlgorithm
from graphfl.p2p.algorithms.robust import RobustRule, with_robust_combine
from graphfl.p2p.codec import DEFAULT_CHUNK_BYTES
from graphfl.p2p.topology import Topology, topology_from_dict

DEFAULT_ALGORITHM = "dfl-gt"


@dataclass(frozen=True)
class P2PConfig:
    """Everything every peer of a network must agree on (its hash is checked in handshakes).

    The general keys are the fields below; ``params`` holds the chosen algorithm's
    hyperparameters (its registered params dataclass, :mod:`graphfl.p2p.algorithms.registry`),
    whose keys sit in the same flat ``[run]`` table (``tau``, ``alpha0``, ``init-tracker``, ...).
    ``rounds`` counts communication rounds; a peer runs ``rounds * period`` iterations
    (``period`` = ``tau`` for the DFL algorithms).

    Data keys: ``data-dir`` (problem ``csv``: the folder of ``device-<id>.csv`` files; relative
    to the network file; a peer's own ``data`` in ``[[peers]]`` overrides it), ``features`` (the
    feature columns in order, comma separated; ``""`` = the device file's order; the launcher
    fills it in from device 0), ``shared-samples`` (``m'``, rows of the generated shared set
    ``D'`` of the built-in problems, FedRelax).

    Untrusted networks: ``combine`` (``mix`` | ``clipped`` | ``trimmed``), ``combine-clip``
    (``τ``; 0 = the median neighbour distance) and ``combine-trim`` (``b``) choose a robust
    combine for the mixing algorithms (:mod:`graphfl.p2p.algorithms.robust`).
    """

    algorithm: str = DEFAULT_ALGORITHM
    rounds: int = field(default=100, metadata={"min": 1})
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
    chunk_bytes: int = field(default=DEFAULT_CHUNK_BYTES, metadata={"min": 1024, "max": 64 << 20})
    data_path: str = field(default="grpc", metadata={"choices": ("grpc", "socket")})
    eval_every: int = field(default=1, metadata={"min": 1})
    min_round_seconds: float = field(default=0.0, metadata={"min": 0.0})
    checkpoint_every: int = field(default=1, metadata={"min": 0})
    data_dir: str = ""
    features: str = ""
    shared_samples: int = field(default=50, metadata={"min": 1})
    combine: str = field(default="mix", metadata={"choices": ("mix", "clipped", "trimmed")})
    combine_clip: float = field(default=0.0, metadata={"min": 0.0})
    combine_trim: int = field(default=1, metadata={"min": 0})
    params: Any = None

    def __post_init__(self) -> None:
        spec = registry.get(self.algorithm)  # ConfigError listing the valid names
        if self.params is None:
            object.__setattr__(self, "params", spec.params())
        elif not isinstance(self.params, spec.params):
            raise ConfigError(f"[run] params of algorithm {self.algorithm!r} must be {spec.params.__name__}, "
                              f"got {type(self.params).__name__}")
        if self.combine != "mix":
            self.make_algorithm()  # ConfigError now if the algorithm has a combine of its own

    @property
    def robust_rule(self) -> RobustRule:
        """``[run] combine`` / ``combine-clip`` / ``combine-trim`` (:mod:`graphfl.p2p.algorithms.robust`)."""
        return RobustRule(self.combine, self.combine_clip, self.combine_trim)

    def make_algorithm(self) -> P2PAlgorithm[Any, Any]:
        """The configured algorithm (registry factory applied to :attr:`params`), with the robust
        combine of ``[run] combine`` when it is not ``mix``.
        """
        return with_robust_combine(registry.get(self.algorithm).create(self.params), self.robust_rule)

    @property
    def iterations(self) -> int:
        return self.rounds * self.make_algorithm().period

    def hash(self) -> str:
        """Stable short hash of the settings, algorithm parameters included (compared in handshakes)."""
        return stable_hash(asdict(self))

    def to_flat(self) -> dict[str, Any]:
        """Flat ``[run]`` keys: the general keys and the algorithm's parameters."""
        out = _general_flat(self)
        out.update(dataclass_to_flat(self.params))
        return out

    def to_doc(self) -> dict[str, Any]:
        """The ``[run]`` table (flat keys, as in a network file)."""
        return {"run": self.to_flat()}


GENERAL_KEYS: tuple[str, ...] = tuple(normalize_key(f.name) for f in fields(P2PConfig) if f.name != "params")


def _general_flat(cfg: P2PConfig) -> dict[str, Any]:
    return {normalize_key(f.name): getattr(cfg, f.name) for f in fields(cfg) if f.name != "params"}


def _owners(key: str) -> list[str]:
    return [s.name for s in registry.all_specs() if key in s.param_keys()]


def _table_keys() -> set[str]:
    """Parameter keys of any registered algorithm that take a TOML table (field metadata ``table``)."""
    out: set[str] = set()
    for spec in registry.all_specs():
        out |= {normalize_key(f.name) for f in fields(spec.params) if f.metadata.get("table")}
    return out


def _flatten_run(values: Mapping[str, Any], tables: set[str], prefix: str = "") -> dict[str, Any]:
    """:func:`flatten`, except that a table under a key in ``tables`` (``model-args``, also as
    ``fedrelax.model-args``) is kept whole, as canonical JSON text with its keys as written.
    """
    out: dict[str, Any] = {}
    for key, value in values.items():
        full = normalize_key(f"{prefix}{key}")
        if full.rpartition(".")[2] in tables and isinstance(value, Mapping):
            out[full] = json.dumps(dict(value), sort_keys=True)
        elif isinstance(value, Mapping):
            out.update(_flatten_run(value, tables, prefix=f"{full}."))
        else:
            out[full] = value
    return out


def parse_p2p_config(values: Mapping[str, Any], base: P2PConfig | None = None) -> P2PConfig:
    """Build a :class:`P2PConfig` from flat keys (``round-timeout = 5``, ``tau = 2``), on top of ``base``.

    Keys are the general ones (:data:`GENERAL_KEYS`) and those of the chosen algorithm's
    params. When ``values`` changes the algorithm, ``base``'s algorithm parameters are dropped.
    An algorithm's key may also be written with the algorithm's name in front
    (``fedrelax.model = "..."``, i.e. a ``[run.fedrelax]`` table); a parameter declared as a
    table (``fedrelax.model-args = {max_depth = 3}``) keeps its table, stored as JSON text.

    Raises
    ------
    ConfigError
        Naming an unknown key (and the algorithm it belongs to, if another one), a bad value,
        or an unknown algorithm (with the valid names).
    """
    flat = _flatten_run(values, _table_keys())
    merged: dict[str, Any] = {}
    if base is not None:
        merged.update(_general_flat(base))
        if flat.get("algorithm", base.algorithm) == base.algorithm:
            merged.update(dataclass_to_flat(base.params))
    merged.update(flat)
    algorithm = str(merged.get("algorithm", DEFAULT_ALGORITHM))
    spec = registry.get(algorithm)
    if spec.problems:
        if "problem" not in flat and str(merged.get("problem", "")) not in spec.problems:
            merged["problem"] = spec.problems[0]
        elif str(merged["problem"]) not in spec.problems:
            raise ConfigError(f"algorithm {algorithm!r} runs on tabular data: problem must be one of "
                              f"{list(spec.problems)}, got {merged['problem']!r} (--problem linreg, or --data-dir DIR "
                              "for your own device-<id>.csv files)")
    for key in [k for k in merged if k.startswith(f"{algorithm}.")]:  # fedrelax.model -> model
        short = key[len(algorithm) + 1:]
        if short in merged and key in flat and short not in flat:
            merged.pop(short)  # the prefixed key given now overrides the base's plain key
        if short in merged:
            raise ConfigError(f"[run] gives both {short!r} and {key!r}; write one of them")
        merged[short] = merged.pop(key)
    clash = sorted(set(spec.param_keys()) & set(GENERAL_KEYS))
    if clash:
        raise ConfigError(f"algorithm {algorithm!r} declares parameter(s) {clash} that are general [run] keys; rename them")
    general = {k: v for k, v in merged.items() if k in GENERAL_KEYS}
    own = {k: v for k, v in merged.items() if k in spec.param_keys()}
    unknown = sorted(set(merged) - set(general) - set(own))
    if unknown:
        others = {k: _owners(k) for k in unknown}
        hint = "; ".join(f"{k!r} is a key of {o}" for k, o in others.items() if o)
        raise ConfigError(
            f"unknown key(s) {unknown} in [run] for algorithm {algorithm!r}"
            + (f" ({hint})" if hint else "")
            + f"; valid keys: {sorted(GENERAL_KEYS)} and {algorithm}'s {spec.param_keys()}"
        )
    params = spec.make_params(own)
    cfg: P2PConfig = build_dataclass(P2PConfig, general, "run", params=params)
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
