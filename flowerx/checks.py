"""Structural checks of Flower's internals: does a wrapped function still hold what its wrapper relies on.

Each function returns ``None`` when the check passes and otherwise the reason, a phrase that goes
into the one log line of :func:`graphfl.flowerx.policy.decide`.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable


def source_of(obj: object) -> str:
    """The source text of ``obj`` (``""`` when it cannot be read, e.g. a compiled build)."""
    try:
        return inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""


def lacks_source(obj: object, what: str, needles: Iterable[str]) -> str | None:
    """Reason when the source of ``obj`` (Flower's ``what``) lacks one of ``needles``, else ``None``."""
    source = source_of(obj)
    if not source:
        return f"the source of Flower's {what} cannot be read"
    missing = [n for n in needles if n not in source]
    return f"Flower's {what} no longer contains {missing}" if missing else None


def lacks_attributes(module: object, names: Iterable[str]) -> str | None:
    """Reason when ``module`` lacks one of ``names``, else ``None``."""
    missing = [n for n in names if not hasattr(module, n)]
    return f"{getattr(module, '__name__', module)} has no {missing}" if missing else None


def first_reason(*reasons: str | None) -> str | None:
    """The first reason that is not ``None``."""
    return next((r for r in reasons if r is not None), None)
