"""The harness's tuning groups, a failed tuning that fails its test cells, and the measurement mode
(``Bench.cache = "none"``), on toy benchmarks of plain numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from graphfl.bench.harness import Bench, Cell, Metric, Tuning, run_bench

LR_BEST = {"a": 0.1, "b": 0.3, "c": 0.3, "d": 0.1}
"""The validation-best lr of each method alone (a and b together: the mean is lowest at 0.1 or 0.3)."""


def tuned_toy(calls: list[Cell]) -> Bench:
    def run_cell(cell: Cell) -> dict[str, Any]:
        calls.append(cell)
        if cell.method == "d":
            return {"diverged": "d always diverges"}
        lr = cell.settings["lr"]
        weight = {"a": 3.0, "b": 1.0, "c": 1.0}[cell.method]  # a dominates the mean of a and b
        return {"final": {"loss": weight * abs(lr - LR_BEST[cell.method]) + cell.seed}}

    return Bench(name="tuned", title="Tuned", methods=("a", "b", "c", "d"), points=[{"size": 1}], seeds=(0, 1),
                 metrics=(Metric("loss"),), run_cell=run_cell,
                 tuning=Tuning(param="lr", grid=(0.1, 0.3), metric="loss", groups=[("a", "b")], max_extensions=0,
                               fail_if_all_fail=True))


def test_a_group_shares_one_value_the_others_are_tuned_alone_and_an_all_failed_tuning_fails_its_cells() -> None:
    calls: list[Cell] = []
    out = run_bench(tuned_toy(calls), None)
    chosen = {r["method"]: r["params"]["lr"] for r in out.results}
    assert chosen["a"] == chosen["b"] == 0.1  # the group's mean: a's weight wins, b alone would take 0.3
    assert chosen["c"] == 0.3 and chosen["d"] is None
    d = next(r for r in out.results if r["method"] == "d")
    assert d["failed"] == 2 and d["failures"] == ["no eligible lr on validation"] * 2
    assert not [c for c in calls if c.method == "d" and c.split == "test"], "d's test cells are not run"
    records = {tuple(t["methods"]): t for t in out.tuning}
    assert set(records) == {("a", "b"), ("c",), ("d",)} and records[("d",)]["all_failed"]
