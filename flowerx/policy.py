"""Which of graphfl's Flower fast paths run: each one only on the Flower versions it was verified on.

A *fast path* is graphfl code in this package that reaches into Flower's non-public internals
(a module attribute wrapped, a private module imported, a retry invoker adjusted) to make a
deployment faster or sturdier. Each has a name (:class:`FastPath`), the ``flwr`` versions it was
verified on, and the stock Flower behaviour that runs without it.

The rule, the same for every fast path: it is **on** when the installed ``flwr`` version is one of
its verified versions *and* its structural check passes (the internals it wraps still exist and
still contain what the wrapper relies on). Otherwise it is **off**: one ``WARNING`` line names it,
says why and what runs instead, and graphfl uses stock Flower behaviour. Never an exception, never
a refusal to run. The decision is taken once per process and fast path (:func:`decide`).

Two environment variables act on the rule (both read at each decision):

* :data:`VERSION_ENV` -- treat the installed Flower as this version (how the tests check that an
  unverified Flower runs on the stock paths without installing one);
* :data:`OFF_ENV` -- comma-separated fast path names (or ``all``) to switch off on purpose.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

logger = logging.getLogger("graphfl.flowerx")

VERIFIED_FLOWER: tuple[str, ...] = ("1.41.0", "1.42.0")
"""The ``flwr`` releases every fast path here was read against and tested on."""

VERSION_ENV = "GRAPHFL_FLOWERX_VERSION"
"""When set, the Flower version the fast paths decide on (instead of the installed one)."""

OFF_ENV = "GRAPHFL_FLOWERX_OFF"
"""Comma-separated names of fast paths to switch off (``all``: every one)."""


@dataclass(frozen=True)
class FastPath:
    """One use of Flower's internals, with what runs without it."""

    name: str
    what: str
    """What it does, one phrase."""
    stock: str
    """What runs when it is off (Flower's stock behaviour), one phrase."""
    verified: tuple[str, ...] = VERIFIED_FLOWER


_decisions: dict[str, bool] = {}


def installed_flower() -> str:
    """Version of the installed ``flwr`` distribution (``"none"`` when it is missing)."""
    try:
        return metadata.version("flwr")
    except metadata.PackageNotFoundError:
        return "none"


def flower_version() -> str:
    """The version the fast paths decide on: :data:`VERSION_ENV` if set, else the installed one."""
    return os.environ.get(VERSION_ENV) or installed_flower()


def _switched_off(name: str) -> bool:
    names = {n.strip() for n in os.environ.get(OFF_ENV, "").split(",") if n.strip()}
    return name in names or "all" in names


def why_off(path: FastPath, check: Callable[[], str | None] | None = None) -> str | None:
    """Why ``path`` must be off here, or ``None`` when it may be on.

    ``check`` returns a reason when the internals ``path`` wraps are not what it was written for;
    it runs only on a verified version, and an exception it raises is a reason too.
    """
    if _switched_off(path.name):
        return f"switched off by {OFF_ENV}"
    version = flower_version()
    if version not in path.verified:
        return f"flwr {version} is not a version it was verified on ({', '.join(path.verified)})"
    if check is None:
        return None
    try:
        return check()
    except Exception as exc:  # noqa: BLE001 - a check that cannot run means the internals moved
        return f"its check of Flower's internals failed ({type(exc).__name__}: {exc})"


def decide(path: FastPath, check: Callable[[], str | None] | None = None) -> bool:
    """Whether ``path`` runs in this process; the first decision is logged when it is off and kept.

    Returns
    -------
    bool
        ``True``: use the fast path. ``False``: use Flower's stock behaviour (one warning line
        names the fast path, the reason and the stock behaviour, once per process).
    """
    if path.name in _decisions:
        return _decisions[path.name]
    reason = why_off(path, check)
    on = reason is None
    if not on:
        logger.warning("graphfl fast path %r (%s) is off: %s; %s", path.name, path.what, reason, path.stock)
    _decisions[path.name] = on
    return on


def decisions() -> dict[str, bool]:
    """The fast paths decided so far in this process: name -> on."""
    return dict(_decisions)


def forget() -> None:
    """Drop this process's decisions (tests that change the environment between two decisions)."""
    _decisions.clear()
