"""The kernel's error for bad input: :class:`ConfigError`.

It lives apart from :mod:`graphfl.common.config` so that the registry (which raises it) and the
config parser (which reads the registry) import it without importing each other.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names it and the valid choices."""
