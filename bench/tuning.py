"""Step-size search on validation data that does not stop at the edge of its grid.

A grid search whose winner is the largest (or smallest) step tried has not found the best step,
only a bound; comparing methods at such steps favours whichever method's optimum happens to lie
inside the grid; each method gets its own tuned step. :func:`search_grid` therefore
evaluates the grid, and while the best finite step is not *bracketed* it evaluates one more step
beside it (``best · factor`` above, ``best / factor`` below), at most ``max_extensions`` times in
total. A side is bracketed by a neighbour that scored worse, or by a failed (diverged) neighbour
within ``factor`` of the best; a failed neighbour further away (the grid 0.4, 15 where 15
diverges) leaves room for a better step in between, so the step ``best · factor`` is tried. The
result lists every step tried and whether the winner is still unbracketed when the budget runs
out (``at_edge``).

Ties are broken towards the smaller step (the more conservative choice). A step whose score is
``None`` (failed or diverged) never wins.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["GridSearch", "search_grid"]


@dataclass
class GridSearch:
    """What :func:`search_grid` tried and chose."""

    scores: dict[float, float | None] = field(default_factory=dict)
    """Every step tried -> its validation score (lower is better), ``None`` when it failed."""
    chosen: float = float("nan")
    initial_grid: tuple[float, ...] = ()
    extended: list[float] = field(default_factory=list)
    """Steps tried beyond the initial grid, in the order tried."""
    at_edge: bool = False
    """The winner is still unbracketed on one side (the extension budget ran out)."""

    def grid_scores(self) -> dict[str, float | None]:
        """``{"<step>": score}`` in increasing step order, keys formatted with ``:g`` (for JSON)."""
        return {f"{s:g}": self.scores[s] for s in sorted(self.scores)}


class EveryStepFailed(RuntimeError):
    """No step of a search gave a finite score; ``extended`` lists the steps tried beyond its grid."""

    def __init__(self, message: str, extended: Sequence[float]) -> None:
        super().__init__(message)
        self.extended = list(extended)


def search_grid(score: Callable[[float], float | None], grid: Sequence[float], factor: float = 3.0,
                max_extensions: int = 2, below_if_all_fail: bool = False) -> GridSearch:
    """Minimise ``score`` over ``grid``, extending the grid past an edge that wins.

    Parameters
    ----------
    score
        Step -> validation score (lower is better), or ``None`` when the run failed/diverged.
        Called once per step.
    grid
        The initial steps (positive, any order).
    factor
        Ratio between an edge and the step tried beyond it (> 1).
    max_extensions
        Most steps tried beyond ``grid`` in total (0 = a plain grid search).
    below_if_all_fail
        While every step tried so far failed, try ``smallest / factor`` next (within
        ``max_extensions``): for a step size, failure at every step of a grid is most often
        divergence, which a smaller step avoids. Off: every step failing raises at once.

    Raises
    ------
    ValueError
        ``grid`` is empty or has a non-positive step, or ``factor <= 1``.
    EveryStepFailed
        No step of the (extended) grid gave a finite score (a :class:`RuntimeError`).
    """
    steps = sorted(set(float(s) for s in grid))
    if not steps or steps[0] <= 0:
        raise ValueError(f"step grid must be non-empty and positive, got {list(grid)}")
    if factor <= 1:
        raise ValueError(f"factor must be > 1, got {factor}")
    out = GridSearch(initial_grid=tuple(steps))
    for s in steps:
        out.scores[s] = score(s)
    while True:
        finite = {s: v for s, v in out.scores.items() if v is not None}
        if not finite:
            if below_if_all_fail and len(out.extended) < max_extensions:
                nxt = float(f"{min(out.scores) / factor:.6g}")
                out.extended.append(nxt)
                out.scores[nxt] = score(nxt)
                continue
            raise EveryStepFailed(f"every step in {sorted(out.scores)} failed", out.extended)
        best = min(finite, key=lambda s: (finite[s], s))
        up, down = _open_sides(out.scores, best, factor)
        out.chosen, out.at_edge = best, up or down
        if not out.at_edge or len(out.extended) >= max_extensions:
            return out
        nxt = float(f"{(best * factor if up else best / factor):.6g}")  # 0.3·3 -> 0.9, not 0.8999…
        out.extended.append(nxt)
        out.scores[nxt] = score(nxt)


def _open_sides(scores: dict[float, float | None], best: float, factor: float) -> tuple[bool, bool]:
    """Whether ``best`` is unbracketed above / below.

    A side is bracketed by a neighbour that was tried and scored worse, or by a *failed* neighbour
    within ``factor`` of ``best``; a failed neighbour further away leaves room for a better step
    in between (e.g. the grid 0.4, 15 where 15 diverges).
    """
    above = [s for s in scores if s > best]
    below = [s for s in scores if s < best]
    tol = 1 + 1e-4  # a step beyond an edge is rounded to six significant digits (0.1 / 3 -> 0.0333333)
    up = not above or (scores[min(above)] is None and min(above) > best * factor * tol)
    down = not below or (scores[max(below)] is None and max(below) < best / factor / tol)
    return up, down
