"""`graphfl bench deploy`: the pure parts (trace split, summary, ratios, report) on hand-made inputs.

The bench itself starts real federations (minutes); its variants' federations are the ones the
e2e tests start, so here only what it computes from their files is checked, by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graphfl.bench import deploy
from graphfl.deploy.federation import SUPERLINK_MIDDLEWARE
from graphfl.server.flower_adapter import EXCHANGE_TRACE


def _lines(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_warm_split_takes_each_rounds_task_and_the_servers_pull(tmp_path: Path) -> None:
    # node 0: join task, round-1 task, final evaluation; the server pushed round 1 at 100.2 and
    # pulled node 0's reply at 101.0, node 1's at 101.3
    _lines(tmp_path / "logs" / "warm-0.jsonl", [
        {"created_at": 90.0, "times": {"acquired": 90.5, "handler": 90.8, "output": 90.9}},
        {"created_at": 100.1, "times": {"acquired": 100.4, "handler": 100.6, "output": 100.7}},
        {"created_at": 102.0, "times": {"acquired": 102.2, "handler": 102.3, "output": 102.4}},
    ])
    _lines(tmp_path / "logs" / "warm-1.jsonl", [
        {"created_at": 90.0, "times": {"acquired": 90.6}},
        {"created_at": 100.1, "times": {"acquired": 100.7, "handler": 100.8, "output": 101.0}},
    ])
    _lines(tmp_path / "logs" / EXCHANGE_TRACE, [
        {"kind": "evaluate", "start": 89.0, "pushed": 89.5, "pulled": {}},
        {"kind": "train", "start": 100.0, "pushed": 100.2, "pulled": {"0": 101.0, "1": 101.3}},
    ])
    split = deploy._warm_split(tmp_path, nodes=2, rounds=1)
    assert split["server_push"] == pytest.approx([0.2])
    assert split["pickup"] == pytest.approx([(0.3 + 0.6) / 2])     # median of two = their mean
    assert split["reply_push"] == pytest.approx([(0.1 + 0.2) / 2])
    assert split["reply_to_server"] == pytest.approx([(0.3 + 0.3) / 2])


def test_summary_and_ratios_are_per_repetition_medians_then_mean_and_sd() -> None:
    reps = {
        "graphfl-warm": [{"rounds": [1.0, 3.0, 2.0], "join": 1.0}, {"rounds": [2.0, 2.0, 4.0], "join": 3.0}],
        "graphfl-warm-stocklink": [{"rounds": [3.0, 3.0, 3.0], "join": 2.0}, {"rounds": [5.0, 1.0, 3.0], "join": 2.0}],
    }
    summary = deploy.summarize(reps)
    assert summary["graphfl-warm"]["rounds"] == {"mean": 2.0, "sd": 0.0, "n": 2}   # medians 2 and 2
    assert summary["graphfl-warm"]["join"]["mean"] == 2.0
    assert summary["graphfl-warm"]["join"]["sd"] == pytest.approx(2 ** 0.5)
    ratios = deploy.ratios(reps)
    assert ratios["graphfl-warm-stocklink"]["per_rep"] == pytest.approx([1.5, 1.5])
    assert "graphfl-warm" not in ratios
    doc = {"summary": summary, "config": {"quick": True, "strategy": "fedavg", "task": "digits", "nodes": 4,
                                          "rounds": 3, "repetitions": 2},
           "ratios_vs_warm": ratios, "worker_models": {}, "env": {"python": "3.11"}, "seconds": 1.0}
    text = deploy.render(doc)
    assert "| graphfl-warm-stocklink | 3.00 ± 0.00 |" in text
    assert "| graphfl-warm-stocklink | 1.50 ± 0.00 | 1.5, 1.5 |" in text


def test_every_graphfl_variant_names_valid_modes_and_the_stocklink_one_differs_only_in_the_superlink() -> None:
    for variant, (mode, polls, middleware) in deploy.GRAPHFL_VARIANTS.items():
        assert mode in ("warm", "cold") and polls in (None, "fast", "stock"), variant
        assert middleware in SUPERLINK_MIDDLEWARE, variant
    warm, stocklink = deploy.GRAPHFL_VARIANTS["graphfl-warm"], deploy.GRAPHFL_VARIANTS["graphfl-warm-stocklink"]
    assert warm[:2] == stocklink[:2] and (warm[2], stocklink[2]) == ("gated", "stock")
    assert set(deploy.VARIANTS_QUICK) - {"vanilla-flower"} <= set(deploy.GRAPHFL_VARIANTS)
