"""glibc's mmap threshold for the SuperLink and SuperNodes graphfl's launcher starts (opt-in).

A SuperLink or SuperNode passes a large message on as chunks of a few MB each (request bodies,
protobuf messages, TLS buffers) and frees them once they are forwarded. With glibc's defaults the
first freed buffer above the mmap threshold (128 kB to start with) raises that threshold to its
size ("dynamic threshold", and the trim threshold to twice that), so every later chunk buffer
comes from the heap (of the main or a thread's arena), whose freed memory is given back only from
the top: the process's resident set climbs round after round although the objects are freed.
``MALLOC_MMAP_THRESHOLD_=1048576`` fixes the threshold at 1 MiB (and switches the dynamic
adjustment off): every buffer of 1 MiB or more is ``mmap``-ed and given back to the kernel on
``free``. Smaller allocations are unchanged.

It trades time for memory: the freed chunk buffers go back to the kernel, and every new one costs
fresh page faults (a slower round; both measured in docs/deployment.md). It is therefore off
unless ``GRAPHFL_FLOWER_MALLOC=release`` asks for it (``default``, or unset: glibc's defaults).
The setting is for the SuperLink and the SuperNodes only, not for the processes they start (the
ServerApp, warm executors and workers, cold ClientApps): those allocate model-sized numpy and torch
buffers all the time, and with every such buffer ``mmap``-ed each one costs fresh page faults
(their share of a round is larger). :func:`process_env` is what graphfl's launcher
(:class:`~graphfl.deploy.federation.LocalFederation`) adds to the environment of a process it
starts through graphfl's wrappers (``python -m graphfl.deploy.superlink`` / ``supernode``): the
threshold and ``GRAPHFL_MALLOC_OWN`` naming it; the wrapper then removes both from its own
``os.environ`` first thing (:func:`keep_to_this_process`; glibc has read the variable when the
process started), so its children start with the launcher's environment. The stock
``flower-superlink`` / ``flower-supernode`` commands get nothing (their children would inherit it).
Nothing is added when the environment sets ``MALLOC_MMAP_THRESHOLD_`` itself (the user's value
is kept, and reaches every process as before) or names ``glibc.malloc.mmap_threshold`` in
``GLIBC_TUNABLES``.

It is a glibc environment variable, read once when a process starts; other C libraries (musl,
macOS) ignore it.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"
MMAP_THRESHOLD = 1 << 20
"""Bytes from which glibc ``mmap``-s an allocation (and unmaps it on ``free``)."""
TUNABLE = "glibc.malloc.mmap_threshold"
SWITCH_ENV = "GRAPHFL_FLOWER_MALLOC"
"""``release``: the SuperLink and SuperNodes get :data:`MMAP_THRESHOLD`; ``default`` or unset: glibc's defaults."""
SWITCH_VALUES = ("default", "release")
OWN_ENV = "GRAPHFL_MALLOC_OWN"
"""Names (comma-separated) of allocator variables meant for the process itself, not its children."""
WRAPPERS = ("graphfl.deploy.superlink", "graphfl.deploy.supernode")
"""Modules that run Flower's SuperLink / SuperNode in their own process and call :func:`keep_to_this_process`."""


def flower_malloc_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The allocator variables to add to ``environ`` for graphfl's SuperLink or SuperNode.

    Parameters
    ----------
    environ
        The environment the process would otherwise get (the launcher's, plus its own settings).

    Returns
    -------
    dict
        ``{"MALLOC_MMAP_THRESHOLD_": "1048576"}`` when ``GRAPHFL_FLOWER_MALLOC=release`` and the
        environment does not set the threshold itself (variable or glibc tunable); ``{}`` otherwise.

    Raises
    ------
    ValueError
        ``GRAPHFL_FLOWER_MALLOC`` is neither ``release`` nor ``default`` (nor empty).
    """
    switch = environ.get(SWITCH_ENV, "").strip().lower() or "default"
    if switch not in SWITCH_VALUES:
        raise ValueError(f"{SWITCH_ENV} must be one of {SWITCH_VALUES}, got {environ[SWITCH_ENV]!r}")
    if switch == "default" or MMAP_THRESHOLD_ENV in environ or TUNABLE in environ.get("GLIBC_TUNABLES", ""):
        return {}
    return {MMAP_THRESHOLD_ENV: str(MMAP_THRESHOLD)}


def describe(environ: Mapping[str, str], added: Mapping[str, str]) -> str:
    """One log line: which mmap threshold the processes started with ``environ`` use, and who chose it.

    ``added`` is what :func:`flower_malloc_env` returned for it.
    """
    if added:
        return (f"{MMAP_THRESHOLD_ENV}={added[MMAP_THRESHOLD_ENV]} for the SuperLink and SuperNodes "
                f"({SWITCH_ENV}={environ.get(SWITCH_ENV, '')})")
    if MMAP_THRESHOLD_ENV in environ:
        return f"{MMAP_THRESHOLD_ENV}={environ[MMAP_THRESHOLD_ENV]} (from the environment, every process)"
    if TUNABLE in environ.get("GLIBC_TUNABLES", ""):
        return f"mmap threshold from GLIBC_TUNABLES={environ['GLIBC_TUNABLES']} (from the environment, every process)"
    return f"glibc's default mmap threshold ({SWITCH_ENV}=release sets 1 MiB for the SuperLink and SuperNodes)"


def process_env(argv: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """Variables to add to the environment of the process ``argv`` that graphfl's launcher starts.

    Parameters
    ----------
    argv
        The command (possibly behind a prefix such as ``ip netns exec NS``).
    environ
        The environment the process gets otherwise.

    Returns
    -------
    dict
        :func:`flower_malloc_env` plus ``GRAPHFL_MALLOC_OWN`` naming it when ``argv`` runs one of
        graphfl's wrappers (``python -m graphfl.deploy.superlink|supernode``); ``{}`` otherwise.
    """
    runs_wrapper = any(a == "-m" and b in WRAPPERS for a, b in zip(argv, argv[1:]))
    added = flower_malloc_env(environ) if runs_wrapper else {}
    return {**added, OWN_ENV: ",".join(added)} if added else {}


def keep_to_this_process(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Remove the variables ``GRAPHFL_MALLOC_OWN`` names (and it) from ``environ``; return them.

    Called first thing by graphfl's SuperLink and SuperNode wrappers on ``os.environ``: glibc read
    the variables when this process started, and the processes it starts get the rest unchanged.
    Only names starting with ``MALLOC_`` are removed.
    """
    names = [n for n in environ.pop(OWN_ENV, "").split(",") if n.startswith("MALLOC_")]
    return {n: environ.pop(n) for n in names if n in environ}
