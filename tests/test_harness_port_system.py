"""The system benchmarks deploy, deploy-perhop and network on the harness's measurement mode: how each
assembles its joint cells (one per repetition, case × repeat, profile × seed) into the common layout
and its own tables. Their measurements (real federations, peers, traces, emulated links) are tested
in test_bench_deploy.py, test_deploy_perhop.py and test_bench_network.py; here they are replaced by
fixed numbers, so these tests take seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from graphfl.bench.report import pair, result
from graphfl.dashboard import bench_results


def _saved(folder: Path, name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((folder / f"{name}.json").read_text())
    view = bench_results.view(f"{name}.json", doc)
    assert bench_results.is_result(doc) and view["layout"] == "harness"
    assert "measured in this run" in (folder / f"{name}.md").read_text()
    return doc


def test_deploy_one_joint_cell_per_repetition_rotates_the_variants(tmp_path: Path, monkeypatch) -> None:
    from graphfl.bench import deploy

    order: list[tuple[str, int]] = []
    per_round = {"graphfl-warm": 1.0, "graphfl-cold": 3.0, "vanilla-flower": 4.0}

    def graphfl(variant: str, out: Path, seed: int, rounds: int) -> dict[str, Any]:
        k = int(out.name.rsplit("-", 1)[1])
        order.append((variant, k))
        x = per_round[variant] + k / 10
        return {"variant": variant, "rounds": [x] * rounds, "join": 0.5, "final_eval": 0.2, "test_acc": 0.9,
                "boot": [0.1] * rounds, "handler": [0.3] * rounds, "federation_start": 5.0, "wall": 9.0}

    def vanilla(out: Path, seed: int, rounds: int) -> dict[str, Any]:
        k = int(out.name.rsplit("-", 1)[1])
        order.append(("vanilla-flower", k))
        x = per_round["vanilla-flower"] + k / 10
        return {"variant": "vanilla-flower", "rounds": [x] * rounds, "train_exchange": [x / 2] * rounds,
                "eval_exchange": [x / 2] * rounds, "first_round": 7.0, "test_acc": 0.9, "federation_start": 4.0}

    monkeypatch.setattr(deploy, "run_graphfl", graphfl)
    monkeypatch.setattr(deploy, "run_vanilla", vanilla)
    monkeypatch.setattr(deploy, "probe_worker_models", lambda messages: {})
    variants = ("graphfl-warm", "graphfl-cold", "vanilla-flower")
    doc = deploy.run(quick=True, seed=0, out=tmp_path, variants=variants, repetitions=3, rounds=2)
    # repetition k starts with variant k: load falls on every variant alike
    assert [v for v, k in order if k == 1] == ["graphfl-cold", "vanilla-flower", "graphfl-warm"]
    assert [v for v, k in order if k == 2] == ["vanilla-flower", "graphfl-warm", "graphfl-cold"]
    assert doc["config"]["cache"] == "none" and doc["estimate"]["cells_to_run"] == 3
    cold = result(doc, "graphfl-cold")
    assert cold["metrics"]["round_s"]["mean"] == pytest.approx(3.1) and cold["metrics"]["round_s"]["n"] == 3
    assert cold["metrics"]["transport_s"]["mean"] == pytest.approx(2.7)
    assert cold["metrics"]["round_over_warm"]["per_seed"] == pytest.approx([3.0, 3.1 / 1.1, 3.2 / 1.2])
    assert result(doc, "vanilla-flower")["metrics"]["train_exchange_s"]["mean"] == pytest.approx(2.05)
    assert pair(doc, "graphfl-cold", "graphfl-warm")["metrics"]["round_s"]["mean"] == pytest.approx(2.0)
    assert doc["ratios_vs_warm"]["graphfl-cold"]["per_rep"] == cold["metrics"]["round_over_warm"]["per_seed"]
    assert [r["repetition"] for r in doc["repetitions"]["graphfl-warm"]] == [0, 1, 2]
    assert doc["summary"]["graphfl-warm"]["rounds"]["mean"] == pytest.approx(1.1)
    saved = _saved(tmp_path, "deploy")
    assert result(saved, "graphfl-warm")["curve"][0]["seconds"] == pytest.approx(1.1)
    text = (tmp_path / "deploy.md").read_text()
    assert "## Ratio of round times to graphfl-warm (same repetition)" in text and "repeats [0, 1, 2]" in text
    assert (tmp_path / "deploy.png").stat().st_size > 0
