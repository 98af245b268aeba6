"""Registry of algorithms: one name -> its hyperparameters, server core and client trainer.

Built-in algorithms register themselves when their module is imported; modules are imported
lazily by name so the ClientApp (a fresh process per message in deployment) imports only the
algorithm it runs. Adding an algorithm = one module in ``strategies/`` calling
:func:`register`, plus its name in ``_BUILTIN_MODULES``; the server and client apps do not
change.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from graphfl.common.config import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from graphfl.client.base import ClientTrainer
    from graphfl.strategies.base import ServerCore


@dataclass(frozen=True)
class AlgorithmSpec:
    """What the rest of graphfl needs to know about one server-coordinated algorithm.

    Attributes
    ----------
    name
        The one name used everywhere (CLI, config section, result files).
    params
        Frozen dataclass of hyperparameters; its defaults are the documented defaults.
    server_core
        ``factory(ctx: ServerContext) -> ServerCore`` (pure math, no Flower).
    client_trainer
        ``factory(ctx: ClientContext) -> ClientTrainer`` (local update on a client).
    summary
        One line for ``graphfl list``.
    """

    name: str
    params: type
    server_core: Callable[..., "ServerCore"]
    client_trainer: Callable[..., "ClientTrainer"]
    summary: str = ""


# name -> module that registers it. Keep sorted; later issues add fesem, bigfl, jgesr, ...
_BUILTIN_MODULES: dict[str, str] = {
    "bigfl": "graphfl.strategies.bigfl",
    "fedavg": "graphfl.strategies.fedavg",
    "fedprox": "graphfl.strategies.fedavg",
    "fesem": "graphfl.strategies.fesem",
    "local": "graphfl.strategies.local",
}

_REGISTRY: dict[str, AlgorithmSpec] = {}

PLUGINS_ENV = "GRAPHFL_PLUGINS"
"""Comma-separated modules imported on first registry use; each may call :func:`register`.
The variable is inherited by SuperNodes and their ClientApps, so plug-in algorithms run
in deployment without touching graphfl."""

_plugins_loaded: set[str] = set()


def _load_plugins() -> None:
    for module in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        if module in _plugins_loaded:
            continue
        _plugins_loaded.add(module)
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"{PLUGINS_ENV}: cannot import plug-in module {module!r}: {exc}") from None


def register(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Add an algorithm; registering a second, different spec under a taken name is an error."""
    existing = _REGISTRY.get(spec.name)
    if existing is not None and existing != spec:
        raise ValueError(f"algorithm {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def names() -> list[str]:
    """All known algorithm names (built-in and registered at run time), sorted."""
    _load_plugins()
    return sorted(set(_BUILTIN_MODULES) | set(_REGISTRY))


def get(name: str) -> AlgorithmSpec:
    """Look up an algorithm by name, importing its module on first use."""
    _load_plugins()
    if name not in _REGISTRY and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown strategy {name!r}; valid strategies: {names()}") from None


def all_specs() -> list[AlgorithmSpec]:
    return [get(n) for n in names()]


def describe(name: str) -> dict[str, Any]:
    import dataclasses

    spec = get(name)
    return {"name": spec.name, "summary": spec.summary, "params": dataclasses.asdict(spec.params())}
