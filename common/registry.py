"""Registry of server-coordinated algorithms: one name -> its server half and its client half.

Each half registers itself when its module is imported: the server half
(:class:`AlgorithmSpec`: hyperparameters + :class:`~graphfl.common.core.ServerCore` factory)
from ``strategies/<algo>.py``, the client half (:class:`ClientSpec`:
:class:`~graphfl.common.core.ClientTrainer` factory) from ``client/``. Modules are imported
lazily by name, so a ClientApp imports only its algorithm's client half (and the
hyperparameter dataclass it reads), and ``strategies/`` never imports ``client/``.

Adding an algorithm = one module per half, each calling :func:`register` /
:func:`register_client`, plus the two module names below (or ``GRAPHFL_PLUGINS`` for
modules outside the tree). The server, the client app and the round loop do not change.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic

from graphfl.common.core import ClientContext, ClientTrainer, P, ServerContext, ServerCore
from graphfl.common.errors import ConfigError
from graphfl.common.types import Arrays

if TYPE_CHECKING:  # a type only: graphfl.common.config imports this module (the registry's names)
    from graphfl.common.config import RunConfig


@dataclass(frozen=True)
class AlgorithmSpec(Generic[P]):
    """The server half of one algorithm and what the rest of graphfl needs to know about it.

    Attributes
    ----------
    name
        The one name used everywhere (CLI, config section, result files).
    params
        Frozen dataclass of hyperparameters; its defaults are the documented defaults.
    server_core
        ``factory(ctx: ServerContext[P]) -> ServerCore[P]`` (pure math, no Flower).
    summary
        One line for ``graphfl list``.
    min_clients
        Fewest clients the algorithm can run with (checked before a run starts).
    preflight
        ``preflight(cfg, initial_arrays, param_keys)`` raises :class:`ConfigError` (one line
        naming the setting to change) when the run cannot work with this task's model, e.g. its
        memory needs; called before any process starts and again by the round loop.
    """

    name: str
    params: type[P]
    server_core: Callable[[ServerContext[P]], ServerCore[P]]
    summary: str = ""
    min_clients: int = 1
    preflight: Callable[[RunConfig, Arrays, tuple[str, ...]], None] | None = None


@dataclass(frozen=True)
class ClientSpec(Generic[P]):
    """The client half of one algorithm: ``client_trainer(ctx) -> ClientTrainer[P]``."""

    name: str
    client_trainer: Callable[[ClientContext[P]], ClientTrainer[P]]


# name -> module that registers its server half / its client half. Keep sorted.
_SERVER_MODULES: dict[str, str] = {
    "apfl": "graphfl.strategies.apfl",
    "apflgate": "graphfl.strategies.apflgate",
    "bigfl": "graphfl.strategies.bigfl",
    "cfl": "graphfl.strategies.cfl",
    "fedamp": "graphfl.strategies.fedamp",
    "fedavg": "graphfl.strategies.fedavg",
    "fedgate": "graphfl.strategies.fedgate",
    "fedprox": "graphfl.strategies.fedavg",
    "fesem": "graphfl.strategies.fesem",
    "jgesr": "graphfl.strategies.jgesr",
    "local": "graphfl.strategies.local",
    "pfedgraph": "graphfl.strategies.pfedgraph",
}
_CLIENT_MODULES: dict[str, str] = {
    "apfl": "graphfl.client.gate_trainer",
    "apflgate": "graphfl.client.gate_trainer",
    "bigfl": "graphfl.client.bigfl_trainer",
    "cfl": "graphfl.client.graph_trainers",
    "fedamp": "graphfl.client.graph_trainers",
    "fedavg": "graphfl.client.trainers",
    "fedgate": "graphfl.client.gate_trainer",
    "fedprox": "graphfl.client.trainers",
    "fesem": "graphfl.client.fesem_trainer",
    "jgesr": "graphfl.client.graph_trainers",
    "local": "graphfl.client.trainers",
    "pfedgraph": "graphfl.client.graph_trainers",
}

_SERVER: dict[str, AlgorithmSpec[Any]] = {}
_CLIENT: dict[str, ClientSpec[Any]] = {}

PLUGINS_ENV = "GRAPHFL_PLUGINS"
"""Comma-separated modules imported on first registry use; each may register both halves.
The variable is inherited by SuperNodes and their ClientApps, so plug-in algorithms run
in deployment without touching graphfl."""

_plugins_loaded: set[str] = set()


def _load_plugins() -> None:
    for module in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        if module in _plugins_loaded:
            continue
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"{PLUGINS_ENV}: cannot import plug-in module {module!r}: {exc}") from None
        _plugins_loaded.add(module)


def register(spec: AlgorithmSpec[P]) -> AlgorithmSpec[P]:
    """Add an algorithm's server half; a second, different spec under a taken name is an error."""
    existing = _SERVER.get(spec.name)
    if existing is not None and existing != spec:
        raise ValueError(f"algorithm {spec.name!r} is already registered")
    _SERVER[spec.name] = spec
    return spec


def register_client(spec: ClientSpec[P]) -> ClientSpec[P]:
    """Add an algorithm's client half; a second, different spec under a taken name is an error."""
    existing = _CLIENT.get(spec.name)
    if existing is not None and existing != spec:
        raise ValueError(f"client half of {spec.name!r} is already registered")
    _CLIENT[spec.name] = spec
    return spec


def names() -> list[str]:
    """All known algorithm names (built-in and registered at run time), sorted."""
    _load_plugins()
    return sorted(set(_SERVER_MODULES) | set(_SERVER))


def _lookup(name: str, table: dict[str, Any], modules: dict[str, str], half: str) -> Any:
    _load_plugins()
    if name not in table and name in modules:
        importlib.import_module(modules[name])
    try:
        return table[name]
    except KeyError:
        if name in names():
            raise ConfigError(f"strategy {name!r} has no registered {half} half") from None
        raise ConfigError(f"unknown strategy {name!r}; valid strategies: {names()}") from None


def get(name: str) -> AlgorithmSpec[Any]:
    """The server half of algorithm ``name``, importing its module on first use."""
    spec: AlgorithmSpec[Any] = _lookup(name, _SERVER, _SERVER_MODULES, "server")
    return spec


def get_client(name: str) -> ClientSpec[Any]:
    """The client half of algorithm ``name``, importing its module on first use."""
    spec: ClientSpec[Any] = _lookup(name, _CLIENT, _CLIENT_MODULES, "client")
    return spec


_TASK_REGISTRY_MODULE = "graphfl.tasks.registry"
"""Tasks live a layer above the kernel; config validation reaches their registry by name."""


def check_task(name: str) -> None:
    """Raise :class:`ConfigError` listing the valid tasks unless ``name`` is one."""
    importlib.import_module(_TASK_REGISTRY_MODULE).get(name)


def all_specs() -> list[AlgorithmSpec[Any]]:
    """Server halves of every known algorithm."""
    return [get(n) for n in names()]


def describe(name: str) -> dict[str, Any]:
    """Name, summary and default hyperparameters (for ``graphfl list``)."""
    spec = get(name)
    return {"name": spec.name, "summary": spec.summary, "params": dataclasses.asdict(spec.params())}
