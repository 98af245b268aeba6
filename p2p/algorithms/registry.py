"""Registry of p2p algorithms: one name -> its hyperparameter type and its factory.

Each algorithm module registers itself at import (one :func:`register` call, the name taken
from the algorithm class), e.g. ``graphfl.p2p.algorithms.dfl_gt``. The built-in modules are
listed in :data:`BUILTIN_MODULES`; out-of-tree modules are named in ``GRAPHFL_PLUGINS`` (the
same variable as the server-side registry, :mod:`graphfl.common.registry`), which every peer
process inherits. The config (:mod:`graphfl.p2p.config`: ``algorithm`` choices and the
per-algorithm ``[run]`` keys), the CLI and both runtimes read everything from here.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic

from graphfl.common.config import ConfigError, build_dataclass, normalize_key
from graphfl.p2p.algorithms.base import P, P2PAlgorithm

BUILTIN_MODULES: tuple[str, ...] = (
    "graphfl.p2p.algorithms.dfl_gt",
    "graphfl.p2p.algorithms.dfl_sgd",
    "graphfl.p2p.algorithms.gossip",
    "graphfl.p2p.algorithms.admm",
    "graphfl.p2p.algorithms.fedrelax",
)
PLUGINS_ENV = "GRAPHFL_PLUGINS"


@dataclass(frozen=True)
class PrepareContext:
    """What an algorithm's ``prepare`` hook may use before a local network starts (``graphfl p2p``).

    Attributes
    ----------
    problems
        Builds every node's local problem (loads every device's data: call it only when needed).
    edges
        The communication graph ``(i, j)``, ``i < j``.
    num_nodes, rounds
        ``n`` and the configured number of rounds.
    """

    problems: Callable[[], Sequence[Any]]
    edges: tuple[tuple[int, int], ...]
    num_nodes: int
    rounds: int


Prepare = Callable[[Any, PrepareContext], tuple[dict[str, Any], dict[str, Any]]]
"""``prepare(params, context) -> ([run] overrides, report)``: work done once, in the launcher's
process, before the peers start (FedADMM: ``lam = "cv"`` resolved by cross-validation). The
overrides are written into the network file (so every peer agrees); the report goes to ``p2p.json``."""


@dataclass(frozen=True)
class P2PAlgorithmSpec(Generic[P]):
    """One p2p algorithm.

    Attributes
    ----------
    name
        The one name used everywhere (``[run] algorithm``, ``--algorithm``, handshakes, results).
    params
        Frozen dataclass of hyperparameters (field metadata ``choices``/``min``/``max`` are
        enforced when parsed from a network file); its defaults are the documented defaults.
    factory
        ``factory(params) -> P2PAlgorithm`` (usually the algorithm class itself).
    summary
        One line for help texts.
    example
        A small ``[run]`` configuration (flat keys: a ``problem`` the algorithm runs on, and
        parameter values) that finishes in seconds; the contract test
        (``tests/test_p2p_contract.py``) runs every registered algorithm on it, in one process
        and as real peer processes.
    prepare
        Optional :data:`Prepare` hook run by ``graphfl p2p`` before the peers start.
    problems
        The problems the algorithm runs on (empty: any). A ``[run]`` without ``problem`` gets the
        first; any other problem is refused when the configuration is parsed, before a peer starts.
    """

    name: str
    params: type[P]
    factory: Callable[[P], P2PAlgorithm[P, Any]]
    summary: str = ""
    example: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {"problem": "linreg"})
    prepare: Prepare | None = None
    problems: tuple[str, ...] = ()

    def param_keys(self) -> list[str]:
        """The ``[run]`` keys of this algorithm's hyperparameters (``init-tracker``, ...)."""
        return [normalize_key(f.name) for f in dataclasses.fields(self.params)]  # type: ignore[arg-type]

    def make_params(self, values: Mapping[str, Any] | None = None) -> P:
        """Parse flat ``{key: value}`` into :attr:`params` (unknown keys are errors naming the valid ones)."""
        flat = {normalize_key(k): v for k, v in (values or {}).items()}
        params: P = build_dataclass(self.params, flat, f"run ({self.name})")
        return params

    def create(self, params: P | None = None) -> P2PAlgorithm[P, Any]:
        """The algorithm with ``params`` (default: the documented defaults)."""
        p = self.params() if params is None else params
        if not isinstance(p, self.params):
            raise ConfigError(f"algorithm {self.name!r} takes {self.params.__name__}, got {type(p).__name__}")
        return self.factory(p)


_REGISTRY: dict[str, P2PAlgorithmSpec[Any]] = {}
_loaded: set[str] = set()


def register(spec: P2PAlgorithmSpec[P]) -> P2PAlgorithmSpec[P]:
    """Add an algorithm; a second, different spec under a taken name is an error."""
    if not spec.name:
        raise ValueError(f"p2p algorithm spec for {spec.factory!r} has an empty name")
    if not dataclasses.is_dataclass(spec.params):
        raise TypeError(f"p2p algorithm {spec.name!r}: params must be a dataclass type, got {spec.params!r}")
    existing = _REGISTRY.get(spec.name)
    if existing is not None and existing != spec:
        raise ValueError(f"p2p algorithm {spec.name!r} is already registered (by {existing.factory!r})")
    _REGISTRY[spec.name] = spec
    return spec


def _load() -> None:
    plugins = [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]
    for module in (*BUILTIN_MODULES, *plugins):
        if module in _loaded:
            continue
        try:
            importlib.import_module(module)
        except ImportError as exc:
            origin = "built-in p2p algorithm module" if module in BUILTIN_MODULES else f"{PLUGINS_ENV}: plug-in module"
            raise ConfigError(f"{origin} {module!r} cannot be imported: {exc}") from None
        _loaded.add(module)


def names() -> list[str]:
    """Every registered p2p algorithm name, sorted."""
    _load()
    return sorted(_REGISTRY)


def get(name: str) -> P2PAlgorithmSpec[Any]:
    """The spec of ``name``; an unknown name is a :class:`ConfigError` listing the valid ones."""
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown p2p algorithm {name!r}; valid: {sorted(_REGISTRY)}") from None


def create(name: str, params: Any = None, **values: Any) -> P2PAlgorithm[Any, Any]:
    """Build algorithm ``name`` from a params object, or from flat keys (``create("dfl-gt", tau=2)``)."""
    spec = get(name)
    if params is not None and values:
        raise TypeError("give either a params object or keyword values, not both")
    return spec.create(params if params is not None else spec.make_params(values))


def all_specs() -> list[P2PAlgorithmSpec[Any]]:
    """Every registered spec, by name."""
    return [get(n) for n in names()]
