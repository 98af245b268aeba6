"""The benchmark harness: a benchmark declares what to run, the harness runs, resumes, tunes and reports.

A benchmark is a :class:`Bench`: its methods, its grid points (e.g. ``{"topology": "ring5",
"tau": 1}``), its seeds, its metrics, and what one **cell** computes (``run_cell``: one method at
one grid point with one seed and one setting of the tuned parameter, on the test split or on the
validation split). :func:`run_bench` then

1. **resumes**: every cell goes through the run cache (:class:`~graphfl.bench.runcache.RunCache`
   under ``<out>/cache``, keyed by ``Bench.key``), so a killed benchmark continues where it
   stopped; a failed cell (diverged, error) is cached too;
2. **tunes on validation** where the benchmark declares a :class:`Tuning`: per grid point (or at
   the point ``Tuning.at`` names), one value for all methods (``shared``), per group of methods
   (``groups``) or per method, by
   :func:`~graphfl.bench.tuning.search_grid` on the cells' validation metric — the test split is
   never used for a choice; a test cell that fails at the chosen value backs off to smaller
   values when ``Tuning.backoff_halvings`` is set;
3. **estimates the remaining time**: before the first cell it logs how many cells are cached and
   how many are to run (a dry pass through the same tuning code, reading only the cache); with a
   declared ``Bench.seconds`` it logs the estimate then, otherwise right after the first computed
   cell (its time × the remaining cells' ``Bench.cost`` weights), then once per computed cell;
   :attr:`Outcome.estimate` keeps that plan and adds the cells the run computed
   (``cells_computed``) and read from the cache (``cells_read``; ``cells_missing`` in a cache-only
   report), which the report's footer states;
4. **aggregates**: per (point, method) each metric's mean ± sd over seeds with the per-seed values
   (:mod:`graphfl.bench.stats`), the mean curve, and paired per-seed differences against
   ``Bench.reference`` (or the declared ``pairs``);
5. **reports** in one layout (:mod:`graphfl.bench.report`): ``<out>/<name>.{json,md,png}``.

**Shared caches and stages.** A benchmark whose processes share one cache declares
``Bench.claim_wait``: a cell is computed under a claim file (:mod:`graphfl.bench.claims`), and a
process that needs a cell another live process is computing waits for its result instead of
computing it twice. ``run_bench(..., cache_only=True)`` reports what the cache holds and computes
nothing (a missing cell is a failed cell, listed in :attr:`Outcome.missing`). A benchmark whose
stages feed each other runs a stage as a ``Bench`` with each method's settings fixed
(``Bench.params``, chosen by an earlier stage), and single cells through :class:`CellRunner`.

What stays in a benchmark module is what is specific to it: the problem, ``run_cell``, its cache
key, the extra verdicts or tables it writes beside the common ones.

**Measurement mode** (``Bench(cache="none")``, the system benchmarks: timings, throughput). The
same declaration — methods = the systems or engines compared, points = sizes, seeds = repeats,
metrics — the same estimate and the same report, but no run cache: every cell of a result is
measured in the run that writes it, one cell after the other in one process (``workers`` must be
1). A timing belongs to the machine's load while it was measured; a cached timing from an earlier
run, set beside one measured now, would compare two loads, so the ratios a result shows are only
sound within one run. The result says so (``config.cache = "none"`` and the run line of the
Markdown); a killed measurement starts again from the first cell.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from . import claims
from .runcache import RunCache
from .stats import mean_curve, mean_sd, paired_difference
from .tuning import EveryStepFailed, search_grid

logger = logging.getLogger(__name__)

__all__ = ["Bench", "Cell", "CellRunner", "Metric", "MissingCell", "Tuning", "Outcome", "run_bench", "plan",
           "run_inprocess", "tune"]

Point = Mapping[str, Any]


def _items(d: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(d.items())


@dataclass(frozen=True)
class Cell:
    """One unit of work: ``method`` at grid ``point`` with ``seed`` and the tuned ``params``, on ``split``."""

    point: tuple[tuple[str, Any], ...]
    method: str
    seed: int
    params: tuple[tuple[str, Any], ...] = ()
    split: str = "test"

    @property
    def at(self) -> dict[str, Any]:
        """The grid point as a dict."""
        return dict(self.point)

    @property
    def settings(self) -> dict[str, Any]:
        """The tuned parameters as a dict."""
        return dict(self.params)

    def label(self) -> str:
        parts = [f"{k}={v}" for k, v in self.point] + [self.method, f"seed {self.seed}"]
        parts += [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.params]
        return " ".join(parts) + ("" if self.split == "test" else f" ({self.split})")


@dataclass(frozen=True)
class Metric:
    """A metric a cell reports in its ``final`` dict.

    ``fmt`` formats its values in the Markdown tables (``auto``: ``.3e`` below 1e-3, else ``.4f``);
    ``scale`` multiplies them there only (e.g. 100 for percent).
    """

    name: str
    label: str = ""
    lower_is_better: bool = True
    fmt: str = "auto"
    scale: float = 1.0
    paired: bool = True
    """Whether paired differences are reported for it (not for e.g. a chosen λ or an edge count)."""

    @property
    def title(self) -> str:
        return self.label or self.name


@dataclass(frozen=True)
class Tuning:
    """How a parameter is chosen on validation cells (never on test).

    Parameters
    ----------
    param
        Name of the tuned parameter (a cell's ``params`` key).
    grid
        Initial values (positive), or a function of the tuning point giving them.
    metric
        The validation cell's ``final`` metric scored.
    lower_is_better
        Direction of ``metric``.
    shared
        One value for all methods at a point, scored by the mean over the methods; a value at which
        any method fails is not eligible (the methods are evaluated in order and the first failure
        ends that value's evaluation). Otherwise one value per method.
    groups
        Methods tuned together as ``shared`` tunes all of them (one value per group, scored by the
        group's mean); a method in no group is tuned on its own. Overrides ``shared``.
    factor, max_extensions
        :func:`~graphfl.bench.tuning.search_grid`'s extension past a winning edge.
    seed
        The seed of the validation cells (default: the benchmark's first seed).
    at
        The point whose tuning applies at a grid point (default: the point itself).
    backoff_halvings
        When set, a test cell that fails at the chosen value is rerun with the next smaller value
        of the grid, then with up to this many halvings of the grid's smallest value.
    below_if_all_fail
        While every value tried failed, try smaller ones (``smallest / factor``, within
        ``max_extensions``; :func:`~graphfl.bench.tuning.search_grid`) before ``if_all_fail``
        or ``fail_if_all_fail`` apply: for a step size, failing everywhere is most often divergence.
    if_all_fail
        Value used when every grid value fails (``None``: raise :class:`RuntimeError`, unless
        ``fail_if_all_fail``).
    fail_if_all_fail
        When every grid value fails, the tuned value is ``None`` and the group's test cells are
        failed ("no eligible <param> on validation") without being run.
    refine
        Second stage after the grid search: ``refine(method, params, evaluate) -> (params, record)``
        where ``evaluate(params)`` returns the validation metric of a cell (``None`` when it failed).
    """

    param: str
    grid: Sequence[float] | Callable[[Point], Sequence[float]]
    metric: str
    lower_is_better: bool = True
    shared: bool = False
    groups: Sequence[Sequence[str]] | None = None
    factor: float = 3.0
    max_extensions: int = 0
    seed: int | None = None
    at: Callable[[Point], Point] | None = None
    backoff_halvings: int | None = None
    below_if_all_fail: bool = False
    if_all_fail: float | None = None
    fail_if_all_fail: bool = False
    refine: Callable[[str, dict[str, Any], Callable[[dict[str, Any]], float | None]],
                     tuple[dict[str, Any], dict[str, Any]]] | None = None

    def values(self, point: Point) -> tuple[float, ...]:
        grid = self.grid(point) if callable(self.grid) else self.grid
        return tuple(float(v) for v in grid)


@dataclass
class Bench:
    """A benchmark's declaration (see the module docstring).

    ``run_cell(cell)`` returns a JSON-able dict; ``final(result)`` its metrics (default
    ``result["final"]``); ``failed(result)`` why it failed or ``None`` (default: the result's
    ``failed``, ``diverged`` or ``error`` entry; a skipped cell always fails). ``key(cell)`` is its
    run-cache key (default: the benchmark's name, the cell's point, method, seed, params and
    split). ``cost(cell)`` weighs
    cells for the time estimate (default 1 each); ``seconds(cell)`` declares a cell's expected
    seconds (then the estimate needs no timed cell). ``curve_keys`` are averaged over seeds into
    each (point, method)'s ``curve`` (``curve_sd_keys`` also get a ``<key>_sd``).
    """

    name: str
    title: str
    methods: Sequence[str]
    points: Sequence[Point]
    seeds: Sequence[int]
    metrics: Sequence[Metric]
    run_cell: Callable[[Cell], dict[str, Any]]
    key: Callable[[Cell], dict[str, Any]] | None = None
    final: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None
    failed: Callable[[dict[str, Any]], str | None] | None = None
    tuning: Tuning | None = None
    reference: str | None = None
    pairs: Sequence[tuple[str, str]] | None = None
    cost: Callable[[Cell], float] | None = None
    seconds: Callable[[Cell], float] | None = None
    curve_keys: Sequence[str] = ()
    curve_sd_keys: Sequence[str] = ()
    methods_at: Callable[[Point], Sequence[str]] | None = None
    """The methods run at a point (default: all of ``methods``)."""
    skip: Callable[[Cell], str | None] | None = None
    """Why a cell is not run at all (neither run nor cached; reported as ``skipped``), or ``None``."""
    errors: tuple[type[BaseException], ...] = ()
    """Exceptions of ``run_cell`` that make a cell failed without storing it (the next run retries it)."""
    fatal: tuple[type[BaseException], ...] = ()
    """Exceptions raised although they are among ``errors`` (e.g. a refused configuration, which
    says nothing about the quality of the setting tried)."""
    joint: bool = False
    """One cell computes every method of a (point, seed) at once (shared data, shared graph): the
    cell's method is :data:`JOINT` and ``part(result, method)`` is a method's share of the result
    (default ``result["methods"][method]``), which ``final`` and ``failed`` then read."""
    part: Callable[[dict[str, Any], str], dict[str, Any]] | None = None
    workers: int = 1
    """Processes computing pending cells at once (benchmarks without tuning only; ``run_cell``
    must then be picklable: a module-level function or a ``functools.partial`` of one)."""
    cache: str = "run"
    """``run``: every cell goes through the run cache under ``<out>/cache`` (resume); ``none``:
    measurement mode (module docstring), every cell computed in this run, nothing stored."""
    params: Callable[[Point, str], Mapping[str, Any]] | None = None
    """The fixed settings of a method at a point, for a benchmark without ``tuning`` (e.g. the
    settings an earlier stage chose on validation); default none."""
    claim_wait: Callable[[Cell], float] | None = None
    """Several processes share the cache: a cell is computed under a claim file
    (:mod:`graphfl.bench.claims`), and a process needing a cell another live process is computing
    waits for it, at most ``claim_wait(cell)`` seconds. ``None``: no claims (one process per cache)."""
    missing: Callable[[Cell], str] | None = None
    """What a cache-only pass says of a cell not in the cache (default ``"<label> not in the cache"``)."""

    def __post_init__(self) -> None:
        if self.cache not in CACHE_MODES:
            raise ValueError(f"{self.name}: cache={self.cache!r}; expected one of {CACHE_MODES}")
        if self.cache == "none" and self.workers != 1:
            raise ValueError(f"{self.name}: measurement mode (cache='none') measures one cell at a time; "
                             f"workers={self.workers} would time cells under each other's load")

    def cache_folder(self, out: Path | None) -> Path | None:
        """The run cache's folder: ``<out>/cache``, or ``None`` (no cache: no ``out``, or measurement mode)."""
        return out / "cache" if out is not None and self.cache == "run" else None

    def share(self, result: dict[str, Any], method: str) -> dict[str, Any]:
        """A joint cell's share for ``method`` (the result itself for a per-method cell)."""
        if not self.joint or result.get("_pending") or result.get("skipped"):
            return result
        if self.part is not None:
            return self.part(result, method)
        found: dict[str, Any] = result["methods"][method]
        return found

    def methods_for(self, point: Point) -> list[str]:
        return list(self.methods_at(point) if self.methods_at else self.methods)

    def cell_key(self, cell: Cell) -> dict[str, Any]:
        if self.key is not None:
            return self.key(cell)
        return {"bench": self.name, **cell.at, "method": cell.method, "seed": cell.seed, **cell.settings,
                "split": cell.split}

    def finals(self, result: dict[str, Any]) -> Mapping[str, Any]:
        if self.final is not None:
            return self.final(result)
        f: Mapping[str, Any] = result.get("final") or {}
        return f

    def failure(self, result: dict[str, Any]) -> str | None:
        if result.get("skipped"):
            return str(result["skipped"])
        if result.get(MISSING):
            return str(result[MISSING])
        if self.failed is not None:
            return self.failed(result)
        for k in ("failed", "diverged", "error"):
            v = result.get(k)
            if isinstance(v, str) and v or v is True:  # a message (a number under these names is a value)
                return str(v)
        return None

    def pair_list(self) -> list[tuple[str, str]]:
        if self.pairs is not None:
            return list(self.pairs)
        if self.reference is None:
            return []
        return [(m, self.reference) for m in self.methods if m != self.reference]


MISSING = "_missing"
"""A cache-only pass's stand-in for a cell not in the cache: ``{MISSING: why}`` (a failed cell)."""


class MissingCell(LookupError):
    """A cell a cache-only pass did not find in the run cache (the message says which, and how far it got)."""


CACHE_MODES = ("run", "none")
"""``Bench.cache``: through the run cache, or measurement mode (module docstring)."""

JOINT = "*"
"""The method of a joint cell (:attr:`Bench.joint`)."""


class NotCached(Exception):
    """A dry pass reached a cell that is not in the cache."""


@dataclass
class _Progress:
    """Counts and times computed cells; logs the estimate of the remaining time."""

    bench: Bench
    pending: list[Cell]
    done: int = 0
    count: int = 0
    workers: int = 1
    computed_seconds: float = 0.0
    computed_weight: float = 0.0
    estimate: dict[str, Any] = field(default_factory=dict)

    def weight(self, cell: Cell) -> float:
        return float(self.bench.cost(cell)) if self.bench.cost else 1.0

    def remaining_weight(self) -> float:
        return sum(self.weight(c) for c in self.pending[self.done:])

    def computed(self, cell: Cell, seconds: float) -> None:
        self.computed_seconds += seconds
        self.computed_weight += self.weight(cell)
        self.done = min(self.done + 1, len(self.pending))
        self.count += 1
        left = self.remaining_weight() * self.computed_seconds / max(self.computed_weight, 1e-12) / self.workers
        if not self.estimate.get("from"):
            self.estimate.update({"from": "timed first cell", "first_cell": cell.label(),
                                  "first_cell_seconds": seconds, "seconds": seconds + left})
            logger.info("%s: the first cell (%s) took %.1f s; estimate: about %s more for the %d cells left "
                        "(tuning extensions and back-offs not counted)", self.bench.name, cell.label(), seconds,
                        _duration(left), len(self.pending) - self.done)
        else:
            logger.info("%s: cell %d of about %d done (%s, %.1f s); about %s left", self.bench.name, self.count,
                        max(self.count, len(self.pending)), cell.label(), seconds, _duration(left))


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


class CellRunner:
    """Evaluates cells through the cache: ``CellRunner(bench, cache)(cell)`` is the cell's result.

    In ``dry`` mode (the plan) it only reads the cache: a missing validation cell raises
    :class:`NotCached` (what follows depends on it), a missing test cell is recorded in ``missing``
    and answered with a placeholder (:data:`PENDING`), so the walk goes on. With ``cache_only`` (a
    report of what the cache holds) nothing is computed either: a missing cell, validation or test,
    is recorded in ``missing`` and answered with ``{MISSING: Bench.missing(cell)}``, a failed cell
    (:meth:`require` raises :class:`MissingCell` instead), or, for a validation cell (a tuning would
    choose on part of its grid), raises :class:`MissingCell`. Otherwise a missing cell is computed and
    stored, under a claim file when the benchmark declares ``claim_wait``.
    """

    def __init__(self, bench: Bench, cache: RunCache, dry: bool = False, progress: _Progress | None = None,
                 cache_only: bool = False) -> None:
        self.bench, self.cache, self.dry, self.progress = bench, cache, dry, progress
        self.cache_only = cache_only
        self.seen: list[Cell] = []
        self.missing: list[Cell] = []
        self.read: set[str] = set()
        """Keys of the cells a run (not a dry pass) answered from the cache that it had not computed."""
        self.computed: set[str] = set()
        """Keys of the cells a run computed (a later visit of one reads it back: not counted as read)."""
        self.memo: dict[str, dict[str, Any]] = {}
        """Results by key: those the worker pool computed, and every result when there is no cache folder."""

    def __call__(self, cell: Cell) -> dict[str, Any]:
        skip = self.bench.skip(cell) if self.bench.skip is not None else None
        if skip:
            return {"skipped": skip}
        key = self.bench.cell_key(cell)
        self.seen.append(cell)
        if self.dry:
            found = self.cache.get(key)
            if found is None:
                self.missing.append(cell)
                if cell.split != "test":
                    raise NotCached(cell.label())
                return dict(PENDING)
            return found
        if repr(key) in self.memo:
            return self.memo[repr(key)]
        if self.cache.has(key):
            if repr(key) not in self.computed:
                self.read.add(repr(key))
            return self.cache(key, lambda: {})
        if self.cache_only:
            self.missing.append(cell)
            why = self.bench.missing(cell) if self.bench.missing is not None else f"{cell.label()} not in the cache"
            if cell.split != "test":  # what follows depends on it: no choice is made on part of a grid
                raise MissingCell(why)
            return {MISSING: why}
        t0 = time.perf_counter()
        try:
            if self.bench.claim_wait is not None and self.cache.folder is not None:
                result = claims.compute_claimed(self.cache, key, lambda: self.bench.run_cell(cell),
                                                self.bench.claim_wait(cell), f"{self.bench.name} {cell.label()}")
            else:
                result = self.cache(key, lambda: self.bench.run_cell(cell))
        except self.bench.errors as exc:  # a failed cell, not stored: the next run tries it again
            if isinstance(exc, self.bench.fatal):
                raise
            logger.warning("%s %s failed: %s", self.bench.name, cell.label(), exc)
            return {"error": f"{type(exc).__name__}: {exc}"}
        if self.cache.folder is None:
            self.memo[repr(key)] = result
        self.computed.add(repr(key))
        if self.progress is not None:
            self.progress.computed(cell, time.perf_counter() - t0)
        return result

    def require(self, cell: Cell) -> dict[str, Any]:
        """The cell's result; :class:`MissingCell` where a cache-only pass does not find it."""
        result = self(cell)
        if result.get(MISSING):
            raise MissingCell(str(result[MISSING]))
        return result


PENDING = {"_pending": True}
"""A dry pass's stand-in for a test cell not yet cached."""


@dataclass
class Outcome:
    """What :func:`run_bench` computed, before the report."""

    results: list[dict[str, Any]]
    paired: list[dict[str, Any]]
    tuning: list[dict[str, Any]]
    estimate: dict[str, Any]
    runs: dict[tuple[tuple[tuple[str, Any], ...], str], list[dict[str, Any] | None]]
    """(point, method) -> per-seed cell results (``None`` where every setting failed)."""
    seconds: float
    joint: dict[tuple[tuple[tuple[str, Any], ...], int], dict[str, Any]] = field(default_factory=dict)
    """(point, seed) -> the whole result of a joint cell (:attr:`Bench.joint`)."""
    missing: list[Cell] = field(default_factory=list)
    """The cells a cache-only run did not find in the cache, in run order."""


def _tune(bench: Bench, point: Point, run: CellRunner) -> dict[tuple[str, ...], dict[str, Any]]:
    """Tuned params per method at ``point`` (key ``(method,)``) and the record of the search."""
    tn = bench.tuning
    assert tn is not None
    tpoint = dict(tn.at(point) if tn.at else point)
    seed = tn.seed if tn.seed is not None else bench.seeds[0]
    methods = bench.methods_for(tpoint)
    sign = 1.0 if tn.lower_is_better else -1.0

    def val(method: str, params: dict[str, Any]) -> tuple[float | None, str | None]:
        res = run(Cell(_items(tpoint), method, seed, _items(params), "val"))
        why = bench.failure(res)
        if why:
            return None, why
        v = bench.finals(res).get(tn.metric)
        if v is None or not math.isfinite(float(v)):
            return None, f"{tn.metric} is {v}"
        return float(v), None

    def search(group: list[str]) -> dict[str, Any]:
        scores: dict[str, float | None] = {}
        per_method: dict[str, dict[str, float | None]] = {m: {} for m in group}
        failed: dict[str, str] = {}

        def score(value: float) -> float | None:
            vals: list[float] = []
            for m in group:
                v, why = val(m, {tn.param: value})
                per_method[m][f"{value:g}"] = v
                if v is None:
                    failed[f"{value:g}"] = str(why)
                    scores[f"{value:g}"] = None
                    return None
                vals.append(v)
            s = sum(vals) / len(vals)
            scores[f"{value:g}"] = s
            return sign * s

        grid = tn.values(tpoint)
        record: dict[str, Any] = {"point": tpoint, "methods": group, "param": tn.param, "seed": seed,
                                  "initial_grid": list(grid)}
        try:
            found = search_grid(score, grid, factor=tn.factor, max_extensions=tn.max_extensions,
                                below_if_all_fail=tn.below_if_all_fail)
        except RuntimeError as exc:
            beyond = exc.extended if isinstance(exc, EveryStepFailed) else []
            if tn.fail_if_all_fail:
                record.update(chosen=None, at_edge=False, extended=beyond, all_failed=True)
            elif tn.if_all_fail is None:
                raise RuntimeError(f"{bench.name} {_label(tpoint)}: every {tn.param} in "
                                   f"{sorted({*map(float, grid), *beyond})} failed for some method of {group}: "
                                   f"{failed}") from None
            else:
                record.update(chosen=tn.if_all_fail, at_edge=False, extended=beyond, all_failed=True)
        else:
            record.update(chosen=found.chosen, at_edge=found.at_edge, extended=found.extended)
        record.update(scores={k: scores[k] for k in sorted(scores, key=float)}, per_method=per_method,
                      failed=failed)
        return record

    if tn.groups is not None:
        together = [[m for m in g if m in methods] for g in tn.groups]
        groups = [g for g in together if g] + [[m] for m in methods if not any(m in g for g in together)]
        groups.sort(key=lambda g: methods.index(g[0]))
    else:
        groups = [methods] if tn.shared else [[m] for m in methods]
    out: dict[tuple[str, ...], dict[str, Any]] = {}
    for group in groups:
        rec = search(group)
        params = {tn.param: rec["chosen"]}
        if tn.refine is not None and rec["chosen"] is not None:
            for m in group:
                def evaluate(p: dict[str, Any], m: str = m) -> float | None:
                    return val(m, p)[0]

                params_m, extra = tn.refine(m, dict(params), evaluate)
                out[(m,)] = {**rec, "methods": [m], "params": params_m, "refined": extra}
        else:
            for m in group:
                out[(m,)] = {**rec, "params": params}
    return out


def tune(bench: Bench, point: Point, run: CellRunner) -> dict[tuple[str, ...], dict[str, Any]]:
    """``bench.tuning`` at ``point`` on its validation cells through ``run``: per method (key ``(method,)``)
    the record of the search (``scores`` per value, ``chosen``, ``at_edge``, ``extended``, ``failed``
    with why, ``params``) — the tuning step of :func:`run_bench`, for a stage that uses the choice itself.
    """
    return _tune(bench, point, run)


def _label(point: Point) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items()) or "-"


def _candidates(tn: Tuning, point: Point, chosen: float) -> list[float]:
    """The values a test cell tries, in order: the chosen value first, then (with
    ``backoff_halvings``) every smaller value of the grid and of the halvings of its smallest
    value, largest first. Never a value above the chosen one (a grid extension can choose below
    the grid's smallest value; the halvings above it are then not tried).
    """
    if tn.backoff_halvings is None:
        return [chosen]
    grid = tn.values(dict(tn.at(point) if tn.at else point))
    below = [min(grid) / 2 ** k for k in range(1, tn.backoff_halvings + 1)]
    return [chosen, *sorted({a for a in (*grid, *below) if a < chosen}, reverse=True)]


def _walk(bench: Bench, run: CellRunner) -> Iterator[tuple[Point, str, int, dict[str, Any] | None, dict[str, Any],
                                                        list[str], dict[str, Any] | None]]:
    """Yield ``(point, method, seed, result or None, params used, failures, tuning record)`` in run order.

    ``result`` is ``None`` when the cell failed at every value tried; ``failures`` lists why each
    value tried failed.
    """
    tuned_at: dict[tuple[tuple[str, Any], ...], dict[tuple[str, ...], dict[str, Any]]] = {}
    tn = bench.tuning
    for point in bench.points:
        records: dict[tuple[str, ...], dict[str, Any]] = {}
        if tn is not None:
            tkey = _items(dict(tn.at(point) if tn.at else point))
            if tkey not in tuned_at:
                tuned_at[tkey] = _tune(bench, point, run)
            records = tuned_at[tkey]
        if bench.joint:
            joint = {seed: run(Cell(_items(point), JOINT, seed)) for seed in bench.seeds}
            for method in bench.methods_for(point):
                for seed in bench.seeds:
                    res = joint[seed]
                    why = None if res.get("_pending") else bench.failure(res)
                    if why is None:
                        part = bench.share(res, method)
                        why = None if part.get("_pending") else bench.failure(part)
                        if why is None:
                            yield point, method, seed, part, {}, [], None
                            continue
                    yield point, method, seed, None, {}, [why], None
            continue
        for method in bench.methods_for(point):
            rec = records.get((method,))
            params = dict(rec["params"]) if rec else dict(bench.params(point, method)) if bench.params else {}
            if tn is not None and rec is not None and rec.get("all_failed") and params.get(tn.param) is None:
                for seed in bench.seeds:
                    yield point, method, seed, None, params, [f"no eligible {tn.param} on validation"], rec
                continue
            tries = ([{**params, tn.param: v} for v in _candidates(tn, point, params[tn.param])]
                     if tn is not None and rec is not None else [params])
            for seed in bench.seeds:
                result: dict[str, Any] | None = None
                used: dict[str, Any] = {}
                failures: list[str] = []
                for k, p in enumerate(tries):
                    res = run(Cell(_items(point), method, seed, _items(p)))
                    why = None if res.get("_pending") else bench.failure(res)
                    if not why:
                        result, used = res, p
                        break
                    failures.append(why)
                    if res.get(MISSING):  # not in the cache (cache-only): no back-off to values it did not fail at
                        break
                    if k + 1 < len(tries) and not run.dry:
                        logger.warning("%s %s seed %d: %s; backing off to the next smaller %s", bench.name, method,
                                       seed, why, tn.param if tn else "value")
                yield point, method, seed, result, used, failures, rec


def plan(bench: Bench, out: Path | None, cache_folder: Path | None = None) -> tuple[list[Cell], int]:
    """The cells still to run (in order, as far as the cache determines them) and the number cached.

    A dry pass through the same tuning and back-off code, reading only the cache. Where a tuning
    still needs a validation cell, the rest of that point is counted as its initial grid's
    validation cells not yet cached plus its test cells (back-offs and grid extensions are not
    counted). A tuning done per method (not ``shared``, no ``groups``, the same methods at the
    point and at its tuning point) is walked one method at a time, so a method whose cells are all
    cached is counted as cached even where another method's tuning still needs a cell; a point's
    validation cells are listed before its test cells, as they run.
    """
    cache = RunCache(cache_folder or bench.cache_folder(out), create=False)
    pending: list[Cell] = []
    counted: set[str] = set()
    cached = 0
    tn = bench.tuning
    per_method_tuning = tn is not None and not tn.shared and not tn.groups and not bench.joint

    def add(cell: Cell) -> None:
        k = repr(bench.cell_key(cell))
        if k not in counted:
            counted.add(k)
            pending.append(cell)

    def walk(point: Point, tpoint: Point, only: str | None) -> None:
        nonlocal cached

        def methods_at(p: Point) -> list[str]:
            return [m for m in bench.methods_for(p) if m == only]

        single = Bench(**{**bench.__dict__, "points": [point], **({"methods_at": methods_at} if only else {})})
        run = CellRunner(single, cache, dry=True)
        try:
            for _ in _walk(single, run):
                pass
        except NotCached:
            assert tn is not None
            seed = tn.seed if tn.seed is not None else bench.seeds[0]
            for m in single.methods_for(tpoint):
                for v in tn.values(tpoint):
                    c = Cell(_items(tpoint), m, seed, ((tn.param, v),), "val")
                    if not cache.has(bench.cell_key(c)):
                        add(c)
            stand_in = ((tn.param, tn.values(tpoint)[0]),)
            for m in single.methods_for(point):
                for s in bench.seeds:
                    add(Cell(_items(point), m, s, stand_in))
        missing = {repr(bench.cell_key(c)) for c in run.missing}
        for c in run.seen:
            k = repr(bench.cell_key(c))
            if k in missing:
                add(c)
            elif k not in counted:
                counted.add(k)
                cached += 1

    for point in bench.points:
        methods = bench.methods_for(point)
        tpoint = dict(tn.at(point) if tn is not None and tn.at else point)
        per_method = per_method_tuning and bench.methods_for(tpoint) == methods
        start = len(pending)
        for only in methods if per_method else [None]:
            walk(point, tpoint, only)
        cells = pending[start:]
        pending[start:] = [c for c in cells if c.split == "val"] + [c for c in cells if c.split != "val"]
    return pending, cached


def run_bench(bench: Bench, out: Path | None, cache_only: bool = False, cache_folder: Path | None = None) -> Outcome:
    """Run every cell of ``bench`` (through ``<out>/cache`` when ``out`` is given) and aggregate.

    Logs the plan (cells cached / to run) and the estimate of the remaining time (see the module
    docstring); the estimate is returned in :attr:`Outcome.estimate`. With ``cache_only`` nothing
    is computed: a cell not in the cache is a failed cell (:class:`CellRunner`), listed in
    :attr:`Outcome.missing`. ``cache_folder`` names the run cache's folder where it is not
    ``<out>/cache`` (a cache several benchmarks' stages share).
    """
    t_start = time.perf_counter()
    pending, cached = plan(bench, out, cache_folder)
    progress = _Progress(bench, pending)
    progress.estimate = {"cells_cached": cached, "cells_to_run": len(pending), "from": None, "seconds": None}
    if bench.cache == "none":
        progress.estimate["cache"] = "none"
        logger.info("%s: measurement mode: no run cache, every cell is measured in this run", bench.name)
    if bench.seconds is not None:
        total = float(sum(bench.seconds(c) for c in pending))
        progress.estimate.update({"from": "declared cost", "seconds": total})
        logger.info("%s: %d cells cached, %d to run; estimate from the declared cost: about %s",
                    bench.name, cached, len(pending), _duration(total))
    else:
        logger.info("%s: %d cells cached, %d to run; the estimate follows the first computed cell",
                    bench.name, cached, len(pending))
        if not pending:
            progress.estimate.update({"from": "cache", "seconds": 0.0})
    cache = RunCache(cache_folder or bench.cache_folder(out))
    run = CellRunner(bench, cache, dry=False, progress=progress, cache_only=cache_only)
    if cache_only:
        logger.info("%s: cache-only: %d cells not in the cache are reported missing, none is computed",
                    bench.name, len(pending))
    elif bench.workers > 1 and bench.tuning is None and pending:
        _compute_in_pool(bench, pending, run, progress)
    runs: dict[tuple[tuple[tuple[str, Any], ...], str], list[dict[str, Any] | None]] = {}
    used: dict[tuple[tuple[tuple[str, Any], ...], str], list[dict[str, Any]]] = {}
    tuning: dict[tuple[tuple[tuple[str, Any], ...], str], dict[str, Any]] = {}
    failures: dict[tuple[tuple[tuple[str, Any], ...], str], list[str]] = {}
    for point, method, _seed, result, params, why, rec in _walk(bench, run):
        k = (_items(point), method)
        runs.setdefault(k, []).append(result)
        used.setdefault(k, []).append(params)
        failures.setdefault(k, []).extend(why)
        if rec is not None:
            tuning[(_items(rec["point"]), method)] = rec
    gone = {(c.point, c.method, c.seed) for c in run.missing if c.split == "test"}
    results = [_aggregate(bench, point, method, runs[(point, method)], used[(point, method)],
                          failures[(point, method)], tuning,
                          missing=sum(r is None and (point, method, s) in gone
                                      for s, r in zip(bench.seeds, runs[(point, method)])))
               for point, method in runs]
    paired = _pairs(bench, runs)
    tuning_records = _tuning_records(tuning)
    joint = {(_items(p), s): run(Cell(_items(p), JOINT, s)) for p in bench.points for s in bench.seeds} \
        if bench.joint else {}
    progress.estimate.update({"cells_computed": progress.count, "cells_read": len(run.read),
                              **({"cells_missing": len(run.missing)} if cache_only else {})})
    return Outcome(results=results, paired=paired, tuning=tuning_records, estimate=progress.estimate,
                   runs=runs, seconds=time.perf_counter() - t_start, joint=joint, missing=list(run.missing))


def _given(result: dict[str, Any]) -> dict[str, Any]:
    return result


def _timed(run_cell: Callable[[Cell], dict[str, Any]], cell: Cell) -> tuple[dict[str, Any], float]:
    t0 = time.perf_counter()
    return run_cell(cell), time.perf_counter() - t0


def _compute_in_pool(bench: Bench, pending: list[Cell], run: CellRunner, progress: _Progress) -> None:
    """Compute ``pending`` in ``bench.workers`` processes; each result is stored as it arrives."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    logger.info("%s: %d cells on %d worker processes", bench.name, len(pending), bench.workers)
    progress.workers = bench.workers
    with ProcessPoolExecutor(max_workers=bench.workers) as pool:
        futures = {pool.submit(_timed, bench.run_cell, cell): cell for cell in pending}
        for fut in as_completed(futures):
            cell = futures[fut]
            try:
                result, seconds = fut.result()
            except bench.errors as exc:
                logger.warning("%s %s failed: %s", bench.name, cell.label(), exc)
                continue
            key = bench.cell_key(cell)
            run.memo[repr(key)] = run.cache(key, partial(_given, result))
            progress.computed(cell, seconds)


def _aggregate(bench: Bench, point: tuple[tuple[str, Any], ...], method: str, runs: list[dict[str, Any] | None],
               used: list[dict[str, Any]], failures: list[str], tuning: dict[Any, dict[str, Any]],
               missing: int = 0) -> dict[str, Any]:
    """One method at one point over the seeds: metrics, curve, params; ``failed`` counts the seeds
    without a result, ``missing`` those of them that a cache-only report did not find (not run).
    """
    ok = [r for r in runs if r is not None]
    finals = [bench.finals(r) if r is not None else {} for r in runs]
    metrics = {m.name: mean_sd([f.get(m.name) for f in finals if f]) for m in bench.metrics}
    tn = bench.tuning
    params: dict[str, Any] = {}
    if tn is not None:
        tkey = _items(dict(tn.at(dict(point)) if tn.at else dict(point)))
        rec = tuning.get((tkey, method))
        params = dict(rec["params"]) if rec else {}
    skipped = bench.skip(Cell(point, method, bench.seeds[0], _items(params))) if bench.skip is not None else None
    curve = mean_curve([r.get("curve") or [] for r in ok], bench.curve_keys, bench.curve_sd_keys) \
        if bench.curve_keys else []
    return {"point": dict(point), "method": method, "params": params,
            "params_per_seed": [dict(u) if u else None for u in used],
            "seeds": list(bench.seeds), "failed": sum(r is None for r in runs), "missing": missing,
            "failures": failures, "skipped": skipped,
            "metrics": metrics, "curve": curve}


def _pairs(bench: Bench, runs: dict[tuple[tuple[tuple[str, Any], ...], str], list[dict[str, Any] | None]]
           ) -> list[dict[str, Any]]:
    out = []
    points = list(dict.fromkeys(p for p, _ in runs))
    for point in points:
        for a, b in bench.pair_list():
            ra, rb = runs.get((point, a)), runs.get((point, b))
            if ra is None or rb is None:
                continue
            fa = [bench.finals(r) if r is not None else {} for r in ra]
            fb = [bench.finals(r) if r is not None else {} for r in rb]
            out.append({"point": dict(point), "a": a, "b": b,
                        "metrics": {m.name: paired_difference([f.get(m.name) for f in fa], [f.get(m.name) for f in fb],
                                                              m.lower_is_better) for m in bench.metrics if m.paired}})
    return out


def _tuning_records(tuning: dict[Any, dict[str, Any]]) -> list[dict[str, Any]]:
    seen: dict[int, dict[str, Any]] = {}
    out = []
    for rec in tuning.values():
        if id(rec) in seen:
            continue
        seen[id(rec)] = rec
        out.append(rec)
    # a shared search appears once per method: keep one record per (point, methods)
    unique: dict[str, dict[str, Any]] = {}
    for rec in out:
        unique.setdefault(repr((rec["point"], rec["methods"])), rec)
    return list(unique.values())


def run_inprocess(values: Mapping[str, Any], label: str) -> tuple[list[dict[str, Any]] | None, dict[str, Any]]:
    """One graphfl run of the flat configuration ``values`` in this process, for a bench's cell.

    Returns ``(curve, out)`` with ``out = {"wall_seconds": ...}``; a run the round loop stops
    (:class:`~graphfl.server.rounds.RunError`: non-finite uploads at a too large step, no valid
    replies) gives ``(None, {"final": None, "error": ..., "wall_seconds": ...})``, logged as
    ``"<label> diverged"``: a failed setting, not a crash.
    """
    from graphfl.common.config import parse_run_config
    from graphfl.server.inprocess import run_federated_inprocess
    from graphfl.server.rounds import RunError

    t0 = time.perf_counter()
    try:
        doc, _ = run_federated_inprocess(parse_run_config(dict(values)))
    except RunError as exc:
        logger.warning("%s diverged: %s", label, exc)
        return None, {"final": None, "error": str(exc), "wall_seconds": time.perf_counter() - t0}
    return doc["methods"][values["strategy"]]["curve"], {"wall_seconds": time.perf_counter() - t0}
