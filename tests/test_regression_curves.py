"""FeSEM and BiG-FL give the same numbers as before the round-plan refactor.

``tests/data/regression_curves.json`` was recorded in-process at commit f01e231 (before
``ServerCore`` rounds became plans of phases) by ``python -m graphfl.tests.test_regression_curves
--record FILE``. Each case re-runs the same config and must reproduce every recorded number:
curves (test/train loss, accuracy, per-client losses, bytes), the cores' server metrics
(assignments, ARI, UL loss, hypergradient norms) and a digest of the final server state, to
``RTOL = 1e-6`` relative (``ATOL = 1e-9`` absolute for values near 0). The runs pass through torch
and BLAS, whose kernels differ between CPUs (AVX2 against AVX-512 moved a loss in its 8th digit):
on one machine they are bit-identical, across machines only close. Integers (assignments, client
counts, bytes) must be equal.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

DATA = Path(__file__).with_name("data") / "regression_curves.json"
RTOL = 1e-6
ATOL = 1e-9

CASES: dict[str, dict[str, Any]] = {
    "fesem-synthetic": {"strategy": "fesem", "task": "synthetic-multicenter", "nodes": 6, "rounds": 3,
                        "train.local-steps": 5, "fesem.k": 2},
    "fesem-digits": {"strategy": "fesem", "task": "digits-permuted", "nodes": 6, "rounds": 3,
                     "train.local-steps": 5, "fesem.k": 3},
    "bigfl-synthetic": {"strategy": "bigfl", "task": "synthetic-multicenter", "nodes": 6, "rounds": 3,
                        "train.local-steps": 3, "bigfl.alpha": 0.5},
    "bigfl-digits": {"strategy": "bigfl", "task": "digits-permuted", "nodes": 6, "rounds": 3,
                     "train.local-steps": 5, "bigfl.layers": "net.2", "bigfl.alpha": 0.5},
}
KEEP = ("round", "test_loss", "test_acc", "train_loss", "test_loss_per_client", "test_acc_per_client",
        "clients_ok", "bytes_up", "bytes_down", "server")
VOLATILE = ("server_seconds",)
# Server metrics that the cores gained after the recording; derived from state the cases check
# (BiG-FL's phi_edges are entries of φ, whose sum is in the state digest), so left out here.
ADDED_AFTER_RECORDING = ("phi_dim", "phi_edges")


def run_case(values: dict[str, Any]) -> dict[str, Any]:
    """Run one case in-process; return its curve (deterministic keys only) and state digest."""
    from graphfl.common.config import parse_run_config
    from graphfl.server.inprocess import run_federated_inprocess

    doc, core = run_federated_inprocess(parse_run_config({**values, "engine": "inprocess", "seed": 0}))
    rows = [{k: row[k] for k in KEEP if k in row} for row in doc["methods"][values["strategy"]]["curve"]]
    for row in rows:
        if "server" in row:
            row["server"] = {k: v for k, v in row["server"].items()
                             if k not in VOLATILE and k not in ADDED_AFTER_RECORDING}
    if values["strategy"] == "fesem":
        state = {"centers_sum": float(np.sum(core.centers)), "centers_abs": float(np.abs(core.centers).sum())}
    else:
        state = {"phi_sum": float(core.phi.sum()), "theta_sum": float(core.theta.sum())}
    return {"config": values, "curve": rows, "state": state}


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Equal structure; floats within ``RTOL`` (relative) or ``ATOL`` (absolute); everything else equal."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got} != {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(want, bool):
        assert isinstance(got, (int, float)), f"{where}: {got!r} is not a number"
        assert math.isclose(got, want, rel_tol=RTOL, abs_tol=ATOL) or got == want, f"{where}: {got!r} != {want!r}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_curves_match_the_recording_made_before_round_plans(name):
    recorded = json.loads(DATA.read_text())[name]
    assert recorded["config"] == CASES[name]
    assert_same(run_case(CASES[name]), recorded, name)


def record(path: str) -> None:
    """Write the reference numbers for every case to ``path``."""
    out = {}
    for name, values in CASES.items():
        t0 = time.perf_counter()
        out[name] = run_case(values)
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--record":
        raise SystemExit("usage: python -m graphfl.tests.test_regression_curves --record FILE")
    record(sys.argv[2])
