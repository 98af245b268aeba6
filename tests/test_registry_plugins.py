"""``GRAPHFL_PLUGINS``: a plug-in that fails to import is a ConfigError naming it, and is retried."""

from __future__ import annotations

import importlib
import sys
import uuid

import pytest

from graphfl.common import registry
from graphfl.common.config import ConfigError

PLUGIN = """
from dataclasses import dataclass

from graphfl.common.registry import AlgorithmSpec, register


@dataclass(frozen=True)
class Params:
    pass


register(AlgorithmSpec("{algo}", Params, lambda ctx: None, "plug-in test"))
"""


@pytest.fixture
def isolated_registry(monkeypatch):
    """Registry tables and the loaded-plug-in set as copies, so nothing leaks into other tests."""
    monkeypatch.setattr(registry, "_SERVER", dict(registry._SERVER))
    monkeypatch.setattr(registry, "_CLIENT", dict(registry._CLIENT))
    monkeypatch.setattr(registry, "_plugins_loaded", set(registry._plugins_loaded))
    return registry


def test_failing_plugin_import_is_a_config_error_naming_it_and_is_retried(tmp_path, monkeypatch, isolated_registry):
    module = f"graphfl_test_plugin_{uuid.uuid4().hex[:8]}"
    algo = f"plug-{module[-8:]}"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(registry.PLUGINS_ENV, f"{module}, ")
    try:
        # 1. The module does not exist.
        with pytest.raises(ConfigError, match=rf"GRAPHFL_PLUGINS: cannot import plug-in module '{module}'"):
            registry.names()
        assert module not in registry._plugins_loaded

        # 2. It exists but its own import fails (a dependency is missing): named too, with the cause.
        (tmp_path / f"{module}.py").write_text("import graphfl_no_such_dependency  # noqa\n")
        importlib.invalidate_caches()
        with pytest.raises(ConfigError, match=rf"'{module}'.*graphfl_no_such_dependency"):
            registry.get("fedavg")                    # any registry use loads the plug-ins first
        assert module not in registry._plugins_loaded and module not in sys.modules

        # 3. Fixed: the next registry use imports it again, and its algorithm is there.
        (tmp_path / f"{module}.py").write_text(PLUGIN.format(algo=algo))
        importlib.invalidate_caches()
        assert algo in registry.names()
        assert registry.get(algo).summary == "plug-in test"
        assert module in registry._plugins_loaded
    finally:
        sys.modules.pop(module, None)


def test_loaded_plugin_is_imported_once(tmp_path, monkeypatch, isolated_registry):
    module = f"graphfl_test_plugin_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text("import builtins\nbuiltins.__dict__.setdefault('_graphfl_imports', []).append(1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(registry.PLUGINS_ENV, module)
    import builtins

    try:
        registry.names()
        registry.names()
        sys.modules.pop(module)                        # even if evicted, it is not imported again
        registry.names()
        assert builtins.__dict__.pop("_graphfl_imports") == [1]
    finally:
        sys.modules.pop(module, None)
        builtins.__dict__.pop("_graphfl_imports", None)
