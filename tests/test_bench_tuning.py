"""search_grid: grid search on validation that extends past a winning edge (bench/tuning.py)."""

from __future__ import annotations

import pytest

from graphfl.bench.tuning import search_grid


def recorder(f):
    calls: list[float] = []

    def score(s: float) -> float | None:
        calls.append(s)
        return f(s)

    return score, calls


def test_interior_optimum_needs_no_extension() -> None:
    score, calls = recorder(lambda s: (s - 1.0) ** 2)
    out = search_grid(score, [0.3, 1.0, 3.0], factor=3.0)
    assert out.chosen == 1.0 and not out.at_edge and out.extended == []
    assert calls == [0.3, 1.0, 3.0]


def test_upper_edge_winner_is_extended_until_bracketed() -> None:
    score, calls = recorder(lambda s: (s - 9.0) ** 2)  # optimum at 9 = 1 * 3 * 3
    out = search_grid(score, [0.3, 1.0], factor=3.0, max_extensions=3)
    assert out.extended == pytest.approx([3.0, 9.0, 27.0])
    assert out.chosen == pytest.approx(9.0) and not out.at_edge
    assert calls[:2] == [0.3, 1.0]


def test_lower_edge_is_extended_downwards() -> None:
    score, _ = recorder(lambda s: s)  # smaller is always better
    out = search_grid(score, [0.1, 0.2], factor=2.0, max_extensions=2)
    assert out.extended == pytest.approx([0.05, 0.025])
    assert out.chosen == pytest.approx(0.025) and out.at_edge  # budget ran out, still at the edge


def test_far_failed_neighbour_leaves_room_between() -> None:
    # 15 diverges; 0.4 is best of the grid, but 0.8 (between 0.4 and 15) must be tried.
    score, calls = recorder(lambda s: None if s > 5 else (s - 0.8) ** 2)
    out = search_grid(score, [0.1, 0.2, 0.4, 15.0], factor=2.0, max_extensions=2)
    assert 0.8 in calls and out.chosen == pytest.approx(0.8)
    assert out.extended == pytest.approx([0.8, 1.6])
    assert not out.at_edge  # 1.6 scored worse: bracketed


def test_near_failed_neighbour_brackets() -> None:
    score, calls = recorder(lambda s: None if s > 0.5 else -s)
    out = search_grid(score, [0.2, 0.4, 0.6], factor=2.0)
    assert out.chosen == 0.4 and not out.at_edge and out.extended == []


def test_ties_go_to_the_smaller_step_and_failures_never_win() -> None:
    out = search_grid(lambda s: None if s == 1.0 else 0.5, [0.5, 1.0, 2.0], max_extensions=0)
    assert out.chosen == 0.5 and out.scores[1.0] is None
    assert out.grid_scores() == {"0.5": 0.5, "1": None, "2": 0.5}


def test_every_step_failing_and_bad_grids_are_errors() -> None:
    with pytest.raises(RuntimeError, match="every step"):
        search_grid(lambda s: None, [0.1, 1.0], max_extensions=1)
    with pytest.raises(ValueError, match="positive"):
        search_grid(lambda s: 0.0, [])
    with pytest.raises(ValueError, match="positive"):
        search_grid(lambda s: 0.0, [0.0, 1.0])
    with pytest.raises(ValueError, match="factor"):
        search_grid(lambda s: 0.0, [1.0], factor=1.0)


def test_a_failed_step_one_rounded_factor_below_brackets() -> None:
    # 0.1 / 3 is tried as 0.0333333 (six significant digits); its failure brackets 0.1 from below
    score, calls = recorder(lambda s: None if s < 0.05 else s)
    out = search_grid(score, [0.1, 0.3], factor=3.0, max_extensions=3)
    assert out.extended == [0.0333333] and calls == [0.1, 0.3, 0.0333333]
    assert out.chosen == 0.1 and not out.at_edge


def test_every_step_failing_tries_below_the_grid_when_asked() -> None:
    # steps above 0.05 diverge: the search goes below the grid, then brackets the first finite step
    score, calls = recorder(lambda s: None if s > 0.05 else abs(s - 0.02))
    out = search_grid(score, [0.1, 0.3, 1.0], factor=3.0, max_extensions=3, below_if_all_fail=True)
    assert calls == [0.1, 0.3, 1.0, 0.0333333, 0.0111111, 0.0037037]
    assert out.extended == [0.0333333, 0.0111111, 0.0037037] and out.chosen == 0.0111111 and not out.at_edge
    # within the extension budget only; then every step failing is an error as before
    with pytest.raises(RuntimeError, match="every step"):
        search_grid(lambda s: None, [0.1, 1.0], max_extensions=2, below_if_all_fail=True)
    # off (the default): no step below the grid is tried
    score, calls = recorder(lambda s: None if s > 0.05 else 1.0)
    with pytest.raises(RuntimeError, match="every step"):
        search_grid(score, [0.1, 0.3], max_extensions=2)
    assert calls == [0.1, 0.3]


def test_steps_below_a_failed_grid_use_the_same_extension_budget() -> None:
    # one extension in all: spent going below the failed grid, so the winner stays at its open edge
    score, calls = recorder(lambda s: None if s > 0.05 else abs(s - 0.001))
    out = search_grid(score, [0.1, 0.3], factor=3.0, max_extensions=1, below_if_all_fail=True)
    assert calls == [0.1, 0.3, 0.0333333] and out.extended == [0.0333333]
    assert out.chosen == 0.0333333 and out.at_edge
