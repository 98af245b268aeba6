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


def test_deploy_perhop_one_joint_cell_per_case_and_repeat_keeps_cases_and_summary(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    from graphfl.bench import deploy_perhop as dp

    seen: list[tuple[str, Path]] = []
    written: list[int] = []

    def flower(out: Path, d: int, n: int, rounds: int, timeout: float) -> dict[str, Any]:
        seen.append(("flower", out))
        hops = {h: 0.1 for h in dp.HOPS}
        return {"ok": True, "roles": list(dp.ROLES), "hook_errors": [], "memory": {},
                "rounds": [{"round": r, "window_s": 0.8 * r, "recorder_round_s": 0.85 * r, "hops": hops,
                            "activities": {}, "activities_cpu": {}, "rpc": {}} for r in range(1, rounds + 1)]}

    def ring(out: Path, d: int, n: int, rounds: int, insecure: bool, timeout: float) -> dict[str, Any]:
        return {"ok": True, "median_round_s": 0.4, "round_s": [0.4] * rounds}

    def floor(d: int, n: int, rounds: int = 5, cert_dir: Path | None = None) -> dict[str, Any]:
        return {"median_round_s": 0.03 if cert_dir else 0.02}

    monkeypatch.setattr(dp, "profile_flower", flower)
    monkeypatch.setattr(dp, "measure_ring", ring)
    monkeypatch.setattr(dp, "parallel_floor", floor)
    monkeypatch.setattr("graphfl.common.certs.generate_tls", lambda folder: None)
    real_write = dp._write
    monkeypatch.setattr(dp, "_write", lambda out, cases, *a: written.append(sum(len(c["repeats"]) for c in cases))
                        or real_write(out, cases, *a))
    doc = dp.run(True, 0, tmp_path, sizes=(1000, 2000), nodes=2, repeats=2, rounds=3)
    assert written == [1, 2, 3, 4], "each repeat is on disk as soon as it is measured"
    assert [p.parts[-3:] for _, p in seen] == [("1000-2", "rep0", "flower"), ("1000-2", "rep1", "flower"),
                                              ("2000-2", "rep0", "flower"), ("2000-2", "rep1", "flower")]
    assert doc["config"]["cache"] == "none" and doc["estimate"]["cells_to_run"] == 4
    fl = result(doc, "flower", params=2000)
    assert fl["metrics"]["round_s"]["mean"] == pytest.approx(2.0)  # median of rounds 2.. (1.6, 2.4)
    assert fl["metrics"]["flower_over_p2p"]["mean"] == pytest.approx(5.0)
    assert pair(doc, "floor-tls", "floor-plain", params=1000)["metrics"]["round_s"]["mean"] == pytest.approx(0.01)
    assert [len(c["repeats"]) for c in doc["cases"]] == [2, 2]
    assert doc["summary"][1]["flower_over_p2p"]["median"] == pytest.approx(5.0)
    saved = _saved(tmp_path, "deploy_perhop")
    assert saved["cases"] == json.loads(json.dumps(doc["cases"]))
    text = (tmp_path / "deploy_perhop.md").read_text()
    assert "| serverapp_push |" in text and "Flower / p2p" in text and "repeats [0, 1]" in text
    again = dp.reanalyse(tmp_path)  # the traces are gone here: the splits stay, the harness layout too
    assert again["results"] == saved["results"] and "| serverapp_push |" in (tmp_path / "deploy_perhop.md").read_text()


def test_network_one_joint_cell_per_profile_and_seed_time_to_target_from_the_lan_cell(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    from graphfl.bench import network

    order: list[tuple[str, int]] = []
    slow = {"lan": 1.0, "wan": 3.0}

    def flower(profile, out: Path, seed: int, rounds: int, strategies, nodes: int, lab=None) -> list[dict[str, Any]]:
        order.append((profile.name, seed))
        return [{"runtime": "flower", "strategy": s, "profile": profile.name, "seed": seed, "error": None,
                 "rounds": [slow[profile.name]] * rounds, "losses": [3.0, 1.0 + seed, 1.0 + seed][:rounds],
                 "rounds_completed": rounds, "payload_bytes": 10**6, "failed_rounds": 0, "missing_replies": 0,
                 "final_loss": 1.0 + seed, "final_acc": 0.8, "link": {"bytes_up": 2e6, "bytes_down": 1e6}}
                for s in strategies]

    def p2p(profile, out: Path, seed: int, rounds: int, nodes: int, lab=None) -> dict[str, Any]:
        done = 0 if profile.name == "wan" and seed == 1 else rounds  # this ring never finished a round
        return {"runtime": "p2p", "strategy": "dfl-gt", "profile": profile.name, "seed": seed,
                "error": None if done else "peers did not finish within 9 s", "status": "incomplete",
                "rounds": [0.5 * slow[profile.name]] * done, "losses": [1.5] * done, "rounds_completed": done,
                "payload_bytes": 5 * 10**5, "failed_rounds": 0, "missing_replies": 0, "final_loss": 1.5 if done else None,
                "final_acc": None, "peers_done": 3, "link": {"bytes_up": 1e6, "bytes_down": 0.0, "resets": 2.0}}

    monkeypatch.setattr(network, "flower_runs", flower)
    monkeypatch.setattr(network, "p2p_run", p2p)
    monkeypatch.setattr(network, "detect_netem", lambda: {"root": False, "netns": False, "netem": False,
                                                          "detail": "not root: test"})
    plan = network.Plan(profiles=("lan", "wan"), flower_rounds=3, p2p_rounds=4, seeds=(0, 1),
                        strategies=("fedavg", "pfedgraph"), nodes=3)
    doc = network.run(out=tmp_path, plan=plan)
    assert order == [("lan", 0), ("lan", 1), ("wan", 0), ("wan", 1)]
    assert doc["config"]["cache"] == "none" and doc["estimate"]["cells_to_run"] == 4
    assert doc["config"]["methods"] == ["flower-fedavg", "flower-pfedgraph", "p2p-dfl-gt"]
    wan = result(doc, "flower-fedavg", profile="wan")
    # target = 1.05 x the lan run's final loss of the same seed: reached at round 2 (6 s) with either seed
    assert wan["metrics"]["time_to_target_s"]["per_seed"] == pytest.approx([6.0, 6.0])
    assert wan["metrics"]["wire_MB"]["mean"] == pytest.approx(3.0)
    ring = result(doc, "p2p-dfl-gt", profile="wan")
    assert ring["failed"] == 1 and "did not finish" in ring["failures"][0]
    assert ring["metrics"]["link_resets"]["mean"] == pytest.approx(2.0)
    assert pair(doc, "p2p-dfl-gt", "flower-fedavg", profile="lan")["metrics"]["s_per_round"]["mean"] == \
        pytest.approx(-0.5)
    rows = {(r["runtime"], r["profile"]): r for r in doc["summary"] if r["strategy"] in ("fedavg", "dfl-gt")}
    assert rows[("flower", "wan")]["time_to_target_s"] == pytest.approx(6.0)
    assert "peers did not finish" in rows[("p2p", "wan")]["errors"]
    assert len(doc["runs"]) == 12 and doc["emulation"]["method"] == "user-space"
    saved = _saved(tmp_path, "network")
    assert saved["emulation"]["why"] and "## Link profiles" in (tmp_path / "network.md").read_text()
    assert (tmp_path / "network.png").stat().st_size > 0


def test_faults_rows_are_methods_and_their_checks_the_cells_outcome(tmp_path: Path, monkeypatch) -> None:
    from graphfl.bench import faults

    def green(out: Path, scale: faults.Scale, seed: int) -> faults.Row:
        row = faults.Row("green", "p2p", "a fault that is handled", recover_s=1.5, bound_s=6.0)
        row.check("recovered within the bound", True, 1.5)
        return row

    def red(out: Path, scale: faults.Scale, seed: int) -> faults.Row:
        row = faults.Row("red", "p2p", "a fault that is not", recover_s=9.0, bound_s=6.0)
        row.check("every peer finished", True)
        row.check("recovered within the bound", False, 9.0)
        return row

    def absent(out: Path, scale: faults.Scale, seed: int) -> faults.Row:
        return faults.Row("absent", "flower", "needs an option", outcome="not available: no --resume")

    written: list[int] = []
    real_write = faults.write_report
    monkeypatch.setattr(faults, "write_report", lambda out, doc: written.append(len(doc["rows"])) or
                        real_write(out, doc))
    for name, fn in (("green", green), ("red", red), ("absent", absent)):
        monkeypatch.setitem(faults.ROWS, name, fn)
    doc = faults.run(quick=True, seed=0, out=tmp_path, rows=["green", "red", "absent"])
    assert written == [1, 2, 3], "the rows measured so far are on disk after every row"
    assert doc["config"]["cache"] == "none" and doc["config"]["methods"] == ["green", "red", "absent"]
    ok = result(doc, "green")
    assert ok["failed"] == 0 and ok["metrics"]["recover_over_bound"]["mean"] == pytest.approx(0.25)
    assert result(doc, "red")["failures"] == ["red: recovered within the bound"]
    assert result(doc, "absent")["failures"] == ["not available: no --resume"]
    assert doc["summary"] == {**doc["summary"], "green": 1, "red": 1, "not_available": 1}
    saved = _saved(tmp_path, "faults")
    assert [r["name"] for r in saved["rows"]] == ["green", "red", "absent"]
    text = (tmp_path / "faults.md").read_text()
    assert "| red | p2p |" in text and "- [ ] recovered within the bound" in text
    assert (tmp_path / "faults.png").stat().st_size > 0
