"""Typed, frozen run configuration, parsed once at the edge.

Every experiment is described by one :class:`RunConfig`. It is built from a flat mapping of
``key = value`` pairs (Flower's ``context.run_config``, a ``--config FILE.toml`` file, or
``--set key=value`` overrides). Nested TOML tables are flattened with ``.``; ``_`` and ``-``
are interchangeable in keys. Unknown keys and bad values raise :class:`ConfigError` with the
list of valid choices. Nothing deeper in the code base indexes raw dicts.

Strategy hyperparameters live under the strategy's name (``fedprox.mu = 0.01``); each
registered strategy declares them as a frozen dataclass (see :mod:`graphfl.common.registry`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

import tomli_w

from graphfl.common import registry
from graphfl.common.errors import ConfigError as ConfigError  # re-exported: graphfl.common.config.ConfigError

Scalar = bool | int | float | str


def normalize_key(key: str) -> str:
    """Canonical flat key: lower case, ``-`` inside names (``train.local_steps`` -> ``train.local-steps``)."""
    return key.strip().lower().replace("_", "-")


def _field_key(name: str) -> str:
    return name.replace("_", "-")


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested TOML tables into ``a.b`` keys (Flower flattens its run config the same way)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        full = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, prefix=f"{full}."))
        else:
            out[normalize_key(full)] = value
    return out


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Coerce a TOML/CLI scalar to the declared type, or raise a ConfigError naming ``where``."""
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if typ is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        if not math.isfinite(out):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return out
    if typ is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    raise TypeError(f"unsupported config field type {typ!r} at {where}")


def build_dataclass(
    cls: type, values: Mapping[str, Any], section: str, **given: Any
) -> Any:
    """Build a frozen dataclass from flat ``{field-key: value}``; unknown keys are errors.

    A key listed in the class's ``RENAMED_KEYS`` (``{old-key: what replaced it}``) is an error
    that names its replacement.

    ``values`` uses canonical keys (``local-steps``). Choices declared in a field's
    ``metadata["choices"]`` are enforced, as are ``metadata["min"]``/``["max"]`` bounds.
    Fields passed in ``given`` (already-built sub-objects) are not read from ``values``.
    """
    hints = get_type_hints(cls)
    known = {_field_key(f.name): f for f in fields(cls) if f.init and f.name not in given}
    unknown = sorted(set(values) - set(known))
    renamed = getattr(cls, "RENAMED_KEYS", {})
    for key in unknown:
        if key in renamed:
            label = f"{section}.{key}" if section else key
            raise ConfigError(f"{label} no longer exists; use {renamed[key]}")
    if unknown:
        where = f"[{section}]" if section else "top level"
        raise ConfigError(
            f"unknown key(s) {unknown} in {where}; valid keys: {sorted(known)}"
        )
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        f = known[key]
        label = f"{section}.{key}" if section else key
        coerced = _coerce(value, hints[f.name], label)
        choices = f.metadata.get("choices")
        if choices is not None and coerced not in choices:
            raise ConfigError(f"{label} = {coerced!r} is not valid; choose one of {sorted(choices)}")
        check = f.metadata.get("check")
        if check is not None:
            problem = check(coerced)
            if problem:
                raise ConfigError(f"{label} = {coerced!r} is not valid; {problem}")
        lo, hi = f.metadata.get("min"), f.metadata.get("max")
        if lo is not None and coerced < lo:
            raise ConfigError(f"{label} = {coerced!r} must be >= {lo}")
        if hi is not None and coerced > hi:
            raise ConfigError(f"{label} = {coerced!r} must be <= {hi}")
        kwargs[f.name] = coerced
    return cls(**kwargs, **given)


def dataclass_to_flat(obj: Any, section: str = "") -> dict[str, Scalar]:
    """Inverse of :func:`build_dataclass` for scalar dataclasses (nested ones are recursed)."""
    out: dict[str, Scalar] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        key = f"{section}.{_field_key(f.name)}" if section else _field_key(f.name)
        if dataclasses.is_dataclass(value):
            out.update(dataclass_to_flat(value, key))
        else:
            out[key] = value
    return out


def positive(**extra: Any) -> dict[str, Any]:
    """Field metadata for a count that must be at least 1."""
    return {"min": 1, **extra}


@dataclass(frozen=True)
class TrainConfig:
    """Client-side local training (shared by every strategy unless it overrides it).

    Each round a client runs ``local_steps`` minibatch SGD steps of size ``batch_size`` with
    learning rate ``lr`` (and optional momentum / weight decay) from the model it received.
    """

    local_steps: int = field(default=50, metadata=positive())
    batch_size: int = field(default=32, metadata=positive())
    lr: float = field(default=0.1, metadata={"min": 0.0})
    momentum: float = field(default=0.0, metadata={"min": 0.0, "max": 1.0})
    weight_decay: float = field(default=0.0, metadata={"min": 0.0})
    eval_local: bool = False
    """Also evaluate each client's locally trained model of the last round (the model it uploaded,
    before aggregation) on its test split, reported as ``local_test_loss`` / ``local_test_acc``
    ("global model + local fine-tuning"). Served by the trainers with the generic SGD round and
    evaluation (fedavg, fedprox, fedamp, local, jgesr, cfl, pfedgraph); any other strategy refuses it."""


HASH_OMIT_AT_DEFAULT: dict[str, Scalar] = {"train.eval-local": False, "data.client-samples": 0, "data.cluster-std": 0.0}
"""Keys left out of :func:`config_hash` while at these values, so the hash of every run that
does not use them is the one it had before they existed."""


DATA_SPLITS = ("auto", "random", "scaffold")


@dataclass(frozen=True)
class DataConfig:
    """How a task's data is split among clients (ALGORITHMS.md §1.3)."""

    dirichlet_alpha: float = field(default=0.5, metadata={"min": 1e-6})
    min_partition_size: int = field(default=10, metadata=positive())
    test_fraction: float = field(default=0.2, metadata={"min": 0.0, "max": 0.9})
    max_samples: int = field(default=0, metadata={"min": 0})  # 0 = all; subsample big datasets
    split: str = field(default="auto", metadata={"choices": DATA_SPLITS})
    """Train/test split where a task offers a choice: ``auto`` (the task's default), ``random``
    or ``scaffold`` (bbbp: Bemis–Murcko scaffolds, unseen in training; its default)."""
    dim: int = field(default=0, metadata={"min": 0})
    """Model size of tasks that take one: ``synthetic-vector``'s number of parameters (0 = the
    task's default, 100 000). Other tasks ignore it."""
    client_samples: int = field(default=0, metadata={"min": 0})
    """Training rows per client of tasks that take one (``synthetic-multicenter*``: 0 = the task's
    default, 100; the test rows stay the task's default). Other tasks ignore it."""
    cluster_std: float = field(default=0.0, metadata={"min": 0.0})
    """Standard deviation of each mixture component around its center, for tasks with planted
    clusters that take one (``synthetic-multicenter*``: 0 = the task's default, 0.5; smaller =
    clusters further apart relative to their spread). Other tasks ignore it."""


COMPRESS_KINDS = ("none", "quant", "topk")


@dataclass(frozen=True)
class CompressConfig:
    """Compression of client uploads, for every strategy (:mod:`graphfl.common.compress`).

    ``kind``: ``none`` (default; uploads unchanged), ``quant`` (unbiased ``bits``-bit
    stochastic quantisation) or ``topk`` (keep the fraction ``k`` of largest entries per array,
    with per-client error memory).
    """

    kind: str = field(default="none", metadata={"choices": COMPRESS_KINDS})
    bits: int = field(default=8, metadata={"min": 1, "max": 16})
    k: float = field(default=0.1, metadata={"min": 1e-9, "max": 1.0})


@dataclass(frozen=True)
class ChannelConfig:
    """Noisy, lossy uplink of seed 002 (ALGORITHMS.md §8.2), applied to every training reply.

    ``y = m ⊙ θ + n`` with ``m_c ~ Bernoulli(1 − missing)`` per entry and AWGN of standard
    deviation ``σ = noise · mean|θ|`` (one σ per upload). Off (exact copies) when both are 0.
    The client-side Flower mod :func:`graphfl.client.noisy_channel.noisy_channel_mod` reads
    these keys; the in-process driver applies the same function.
    """

    noise: float = field(default=0.0, metadata={"min": 0.0})
    missing: float = field(default=0.0, metadata={"min": 0.0, "max": 1.0})

    @property
    def active(self) -> bool:
        """Whether the channel changes anything."""
        return self.noise > 0 or self.missing > 0


ENGINES = ("local-deployment", "simulation", "inprocess", "batched")
"""``batched``: the in-process engine with a round's clients trained stacked (:mod:`graphfl.server.batched`)."""
DEVICES = ("auto", "cpu", "cuda")


def device_problem(device: str) -> str | None:
    """Why ``device`` is not a valid device name (``auto``, ``cpu``, ``cuda`` or ``cuda:N``), else ``None``."""
    if device in DEVICES:
        return None
    head, _, index = device.partition(":")
    if head == "cuda" and index.isdigit():
        return None
    return f"choose one of {list(DEVICES)} or cuda:N (N = a GPU index, e.g. cuda:0)"


def run_key_problem(key: str) -> str | None:
    """Why ``key`` cannot name a run's client-state folder (it becomes a path component), else ``None``."""
    if key == "" or (len(key) <= 64 and all(c.isalnum() or c in "-_" for c in key) and key[0].isalnum()):
        return None
    return "use at most 64 letters, digits, '-' and '_', starting with a letter or digit"


@dataclass(frozen=True)
class RunConfig:
    """The whole description of one federated run; written next to every result."""

    strategy: str = "fedavg"
    task: str = "digits"
    rounds: int = field(default=3, metadata=positive())
    nodes: int = field(default=4, metadata=positive())
    seed: int = 0
    engine: str = field(default="local-deployment", metadata={"choices": ENGINES})
    data_dir: str = ""
    out_dir: str = ""
    device: str = field(default="auto", metadata={"check": device_problem})
    fraction_train: float = field(default=1.0, metadata={"min": 0.0, "max": 1.0})
    round_timeout: float = field(default=300.0, metadata={"min": 1.0})
    connect_timeout: float = field(default=60.0, metadata={"min": 1.0})
    min_replies: int = field(default=1, metadata={"min": 0})
    """A phase with fewer valid replies than this fails the run (0: carry on with none)."""
    graph_file: str = ""
    resume: bool = False
    """Continue the run whose checkpoint is in ``<out-dir>/checkpoint`` (set by ``graphfl run --resume``)."""
    run_key: str = field(default="", metadata={"check": run_key_problem})
    """Stable name of a run across ``--resume`` (new Flower run ids): client state on disk is kept
    under it (``graphfl run`` sets a fresh one; empty = no persistent client state)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    compress: CompressConfig = field(default_factory=CompressConfig)
    channel: ChannelConfig = field(default_factory=ChannelConfig)
    # Hyperparameters of the chosen strategy (a frozen dataclass from the registry).
    params: Any = None

    def to_flat(self) -> dict[str, Scalar]:
        """Flat ``key = value`` form (the keys of ``[tool.flwr.app.config]``)."""
        out = dataclass_to_flat(dataclasses.replace(self, params=None))
        out.pop("params", None)
        if self.params is not None:
            out.update(dataclass_to_flat(self.params, self.strategy))
        return out

    def to_json(self) -> dict[str, Any]:
        """Nested, JSON-ready form for result files."""
        out = dataclasses.asdict(dataclasses.replace(self, params=None))
        out["params"] = dataclasses.asdict(self.params) if self.params is not None else {}
        return out


_SECTIONS = {"train": TrainConfig, "data": DataConfig, "compress": CompressConfig, "channel": ChannelConfig}


def parse_run_config(flat: Mapping[str, Any], *, ignore_other_strategies: bool = True) -> RunConfig:
    """Build and validate a :class:`RunConfig` from flat keys.

    Parameters
    ----------
    flat
        ``{"strategy": "fedprox", "train.lr": 0.1, "fedprox.mu": 0.01, ...}``; nested
        mappings are flattened first.
    ignore_other_strategies
        Flower's run config carries the defaults of *every* strategy's section; those of
        strategies other than the selected one are ignored (but must still name a
        registered strategy). From a user's file, keys of another strategy are errors.
    """
    values = flatten(flat)
    top_fields = {
        _field_key(f.name) for f in fields(RunConfig) if f.name not in ("train", "data", "compress", "channel", "params")
    }
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    strategy_sections: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        head, _, rest = key.partition(".")
        if not rest:
            if key not in top_fields:
                raise ConfigError(
                    f"unknown key {key!r}; valid top-level keys: {sorted(top_fields)}, "
                    f"sections: {sorted(_SECTIONS)} and one per strategy {registry.names()}"
                )
            top[key] = value
        elif head in sections:
            sections[head][rest] = value
        else:
            strategy_sections.setdefault(head, {})[rest] = value

    strategy = str(top.get("strategy", RunConfig.strategy))
    spec = registry.get(strategy)  # raises ConfigError listing valid names
    for name in strategy_sections:
        if name == strategy:
            continue
        if name not in registry.names():
            raise ConfigError(
                f"unknown section {name!r}; valid sections: {sorted(_SECTIONS)} and "
                f"strategies {registry.names()}"
            )
        if not ignore_other_strategies:
            raise ConfigError(
                f"section [{name}] configures strategy {name!r} but strategy = {strategy!r}"
            )
    cfg: RunConfig = build_dataclass(
        RunConfig,
        top,
        section="",
        train=build_dataclass(TrainConfig, sections["train"], "train"),
        data=build_dataclass(DataConfig, sections["data"], "data"),
        compress=build_dataclass(CompressConfig, sections["compress"], "compress"),
        channel=build_dataclass(ChannelConfig, sections["channel"], "channel"),
        params=build_dataclass(spec.params, strategy_sections.get(strategy, {}), section=strategy),
    )
    registry.check_task(cfg.task)  # raises ConfigError listing valid task names
    return cfg


def config_from_json(doc: Mapping[str, Any]) -> RunConfig:
    """Inverse of :meth:`RunConfig.to_json` (a run folder's ``config.json``), validated like any config.

    Raises
    ------
    ConfigError
        When ``doc`` is not a run config (names the bad key or value).
    """
    if not isinstance(doc, Mapping):
        raise ConfigError(f"a run config must be a JSON object, got {type(doc).__name__}")
    values = dict(doc)
    params = values.pop("params", None) or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"config 'params' must be an object, got {params!r}")
    flat = flatten(values)
    strategy = str(values.get("strategy", RunConfig.strategy))
    flat.update(flatten(params, prefix=f"{strategy}."))
    return parse_run_config(flat, ignore_other_strategies=False)


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a config TOML file; a missing or malformed file is a ConfigError naming the path."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None


def parse_assignment(text: str) -> tuple[str, Any]:
    """Parse one ``key=value`` override; the value is TOML (bare words are taken as strings)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} must look like key=value")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return normalize_key(key), value


def all_defaults_flat() -> dict[str, Scalar]:
    """Defaults of every key, including every registered strategy's section.

    This is what ``[tool.flwr.app.config]`` must contain (Flower only accepts overrides of
    keys that exist there).
    """
    out = dataclass_to_flat(RunConfig())
    out.pop("params", None)
    for name in registry.names():
        out.update(dataclass_to_flat(registry.get(name).params(), name))
    return out


def stable_hash(obj: Any) -> str:
    """Short SHA-256 of ``obj``'s canonical JSON (sorted keys): the one config-hash function.

    Used for run configs (:func:`config_hash`), p2p run settings (compared in handshakes) and
    topology fingerprints.
    """
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def config_hash(cfg: RunConfig) -> str:
    """Stable short hash of a resolved run config (written next to its results); keys of
    :data:`HASH_OMIT_AT_DEFAULT` at their listed value are left out.
    """
    flat = cfg.to_flat()
    return stable_hash({k: v for k, v in flat.items() if k not in HASH_OMIT_AT_DEFAULT or HASH_OMIT_AT_DEFAULT[k] != v})


def dump_toml(doc: Mapping[str, Any]) -> str:
    """TOML text of a nested mapping (``tomli-w``, the one TOML writer of graphfl)."""
    return tomli_w.dumps(doc)


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`flatten`: ``{"train.lr": 0.1}`` -> ``{"train": {"lr": 0.1}}``."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *heads, last = key.split(".")
        for head in heads:
            node = node.setdefault(head, {})
        node[last] = value
    return out
