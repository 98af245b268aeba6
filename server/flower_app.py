"""The Flower App definition (``[tool.flwr.app]``) as code, and FAB folders for runs.

Flower needs a folder with a ``pyproject.toml`` whose ``[tool.flwr.app.config]`` lists every
run-config key (it rejects overrides of keys it does not know). ``graphfl run`` writes such
a folder into each run directory from :func:`app_pyproject`, so it works from an installed
wheel too; the repository's own ``pyproject.toml`` carries the same section for
``flwr run .`` (tests/test_config.py keeps the two identical).
"""

from __future__ import annotations

from pathlib import Path

from graphfl import __version__

PUBLISHER = "graphfl"
SERVERAPP = "graphfl.server.app:app"
CLIENTAPP = "graphfl.client.app:app"


def config_section(defaults: dict[str, object] | None = None) -> dict[str, object]:
    """``[tool.flwr.app.config]`` as nested tables per section (``train``, ``fedprox``, ...)."""
    from graphfl.common.config import all_defaults_flat, nest

    return nest(all_defaults_flat() if defaults is None else defaults)


def app_pyproject() -> str:
    """A complete ``pyproject.toml`` for a graphfl Flower App (FAB)."""
    from graphfl.common.config import dump_toml

    return dump_toml({
        "build-system": {"requires": ["setuptools>=69"], "build-backend": "setuptools.build_meta"},
        "project": {"name": "graphfl-app", "version": __version__,
                    "description": "graphfl run (components come from the installed graphfl package)",
                    "dependencies": []},
        "tool": {"flwr": {"app": {"publisher": PUBLISHER,
                                  "components": {"serverapp": SERVERAPP, "clientapp": CLIENTAPP},
                                  "config": config_section()}}},
    })


def write_app_dir(path: Path) -> Path:
    """Create a FAB source folder at ``path`` (only a pyproject.toml; code comes from graphfl)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "pyproject.toml").write_text(app_pyproject())
    return path
