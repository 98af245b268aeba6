"""The harness's back-off of a failed test cell: the value chosen on validation is always tried
first, and a back-off only ever goes to smaller values."""

from __future__ import annotations

from graphfl.bench.harness import Bench, Metric, Tuning, _candidates, run_bench


def test_the_chosen_value_comes_first_even_below_the_grid():
    tn = Tuning(param="lr", grid=(0.1, 0.3, 1.0), metric="loss", backoff_halvings=2)
    assert _candidates(tn, {}, 0.3) == [0.3, 0.1, 0.05, 0.025]
    # a grid extension chose 0.033 < min(grid): 0.05 (a halving of 0.1) is above it, never tried
    assert _candidates(tn, {}, 0.033) == [0.033, 0.025]
    assert _candidates(Tuning(param="lr", grid=(0.1, 1.0), metric="loss"), {}, 0.033) == [0.033]


def test_a_test_cell_runs_at_the_value_chosen_below_the_grid(tmp_path):
    """Validation prefers ever smaller steps, so the search extends below the grid and chooses
    0.1 / 3 / 3; the test cells must run at that value, not at a halving of the grid's minimum."""
    ran: list[tuple[str, float]] = []

    def run_cell(cell):
        lr = cell.settings["lr"]
        ran.append((cell.split, lr))
        return {"final": lr}                                  # lower lr, lower validation loss

    bench = Bench(name="backoff", title="t", methods=("m",), points=[{}], seeds=[0],
                  metrics=(Metric("loss"),), run_cell=run_cell, key=lambda cell: {"lr": cell.settings["lr"],
                                                                                  "split": cell.split},
                  final=lambda r: {"loss": r["final"]},
                  tuning=Tuning(param="lr", grid=(0.1, 0.3), metric="loss", max_extensions=2, backoff_halvings=2))
    run_bench(bench, tmp_path)
    chosen = min(lr for split, lr in ran if split != "test")
    assert chosen < 0.05                                     # the extension went below 0.1 / 2
    assert [lr for split, lr in ran if split == "test"] == [chosen]


def test_a_cache_only_pass_does_not_back_off_past_a_missing_test_cell(tmp_path):
    """Cache-only: the test cell at the chosen value is missing; a cached test cell at a smaller
    value (it would have been tried only had the chosen one failed) is not reported in its place."""
    def run_cell(cell):
        return {"final": abs(cell.settings["lr"] - 0.3)}       # validation chooses 0.3

    def bench(run):
        return Bench(name="backoff", title="t", methods=("m",), points=[{}], seeds=[0], metrics=(Metric("loss"),),
                     run_cell=run, key=lambda cell: {"lr": cell.settings["lr"], "split": cell.split},
                     final=lambda r: {"loss": r["final"]},
                     tuning=Tuning(param="lr", grid=(0.1, 0.3, 1.0), metric="loss", max_extensions=0,
                                   backoff_halvings=1))

    from graphfl.bench.harness import Cell, CellRunner
    from graphfl.bench.runcache import RunCache

    full = bench(run_cell)
    cache = RunCache(tmp_path / "cache")
    runner = CellRunner(full, cache)
    for lr in (0.1, 0.3, 1.0):
        runner(Cell((), "m", 0, (("lr", lr),), split="val"))
    runner(Cell((), "m", 0, (("lr", 0.1),)))                  # only the smaller value's test cell is cached

    def no_compute(cell):
        raise AssertionError(f"cache-only computed {cell.label()}")

    outcome = run_bench(bench(no_compute), tmp_path, cache_only=True)
    assert [c.settings["lr"] for c in outcome.missing] == [0.3]
    assert outcome.runs[((), "m")] == [None]                 # failed (missing), not the lr = 0.1 result
