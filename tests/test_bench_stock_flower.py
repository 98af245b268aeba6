"""Stock Flower Apps of the benches (graphfl.bench.stock_flower): the writer, the parsing, one real run."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from graphfl.bench import deploy, stock_flower


def test_write_app_names_the_package_components_and_run_config(tmp_path: Path) -> None:
    app = stock_flower.write_app(tmp_path / "app", "vanillavec",
                                 {"server_app": stock_flower.VECTOR_SERVER, "client_app": stock_flower.VECTOR_CLIENT},
                                 {"num-server-rounds": 3, "nodes": 2, "dim": 10, "lr": 0.5, "out-file": ""})
    meta = tomllib.loads((app / "pyproject.toml").read_text())
    flwr_app = meta["tool"]["flwr"]["app"]
    assert meta["project"]["name"] == "vanillavec"
    assert flwr_app["components"] == {"serverapp": "vanillavec.server_app:app", "clientapp": "vanillavec.client_app:app"}
    assert flwr_app["config"] == {"num-server-rounds": 3, "nodes": 2, "dim": 10, "lr": 0.5, "out-file": ""}
    assert sorted(p.name for p in (app / "vanillavec").iterdir()) == ["__init__.py", "client_app.py", "server_app.py"]
    for source in (stock_flower.VECTOR_SERVER, stock_flower.VECTOR_CLIENT, deploy.VANILLA_SERVER):
        compile(source, "app", "exec")  # the pasted TimedFedAvg keeps each ServerApp valid Python
    assert "fraction_evaluate=0.0" in stock_flower.VECTOR_SERVER  # training only: the same 2n messages
    with pytest.raises(ValueError, match="client_app"):
        stock_flower.write_app(tmp_path / "bad", "x", {"server_app": ""}, {})


def test_deploy_still_writes_its_digits_app(tmp_path: Path) -> None:
    app = deploy.write_vanilla_app(tmp_path, {"rounds": 3, "nodes": 4, "seed": 0, "local-steps": 50,
                                              "batch-size": 32, "lr": 0.05})
    cfg = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert cfg == {"num-server-rounds": 3, "nodes": 4, "seed": 0, "local-steps": 50, "batch-size": 32, "lr": 0.05,
                   "out-file": ""}
    assert sorted(p.name for p in (app / "vanillafl").iterdir()) == ["__init__.py", "client_app.py", "server_app.py",
                                                                     "task.py"]
    assert "class TimedFedAvg(FedAvg)" in (app / "vanillafl" / "server_app.py").read_text()


def test_vector_round_seconds_is_training_start_to_aggregated_per_round_in_order() -> None:
    doc = {"times": {"2": {"train_start": 20.0, "train_replies": 22.5, "train_done": 23.0},
                     "1": {"train_start": 10.0, "train_replies": 11.0, "train_done": 11.25},
                     "10": {"train_start": 100.0, "train_replies": 100.5, "train_done": 101.0}}}
    assert stock_flower.vector_round_seconds(doc) == pytest.approx([1.25, 3.0, 1.0])


@pytest.mark.e2e
def test_vanilla_vector_app_runs_on_stock_processes_and_averages(tmp_path: Path) -> None:
    """2 stock SuperNodes, 2 rounds, TLS: clients step to their targets 1 and 2 with lr 0.5, FedAvg
    averages: θ_r = 1.5 (1 − 0.5^r), so θ_2 = 1.125 in every entry."""
    d, n = 1000, 2
    res = stock_flower.run_vector_app(tmp_path / "vanilla", d, n, rounds=2, tls=True, timeout=300)
    assert res["ok"], res
    assert len(res["round_s"]) == 2 and res["median_round_s"] == res["round_s"][1] > 0
    assert res["final"]["size"] == d and res["final"]["dtype"] == "float32"
    assert res["final"]["mean"] == pytest.approx(1.125, rel=1e-6)
    assert res["final"]["head"] == pytest.approx([1.125] * 3, rel=1e-6)


def test_p2p_throughput_skips_vanilla_flower_when_memory_is_short(tmp_path: Path, monkeypatch) -> None:
    from graphfl.bench import p2p_throughput as pt

    started: list[int] = []
    monkeypatch.setattr(pt, "measure_vanilla", lambda *a, **k: started.append(1) or {"ok": True})
    monkeypatch.setattr(pt, "_mem_available_mb", lambda: 100.0)
    got = pt.measure_vanilla_case(tmp_path, 10_000_000, 4, 5, True, {"median_round_s": 0.3})
    assert not started and got["vanilla"]["ok"] is None
    assert "vanilla Flower, 10000000 params x 4 nodes: needs ~" in got["vanilla"]["skipped"]
    assert "100 MB available; not run" in got["vanilla"]["skipped"]
    # enough memory: measured, and the ratios are vanilla over graphfl's Flower round and over the ring's
    monkeypatch.setattr(pt, "_mem_available_mb", lambda: 1e9)
    monkeypatch.setattr(pt, "measure_vanilla", lambda *a, **k: {"ok": True, "median_round_s": 12.0})
    got = pt.measure_vanilla_case(tmp_path, 1000, 4, 5, True, {"median_round_s": 0.5, "flower": {"median_round_s": 2.0}})
    assert got["vanilla_over_flower"] == pytest.approx(6.0) and got["vanilla_over_p2p"] == pytest.approx(24.0)


def test_p2p_throughput_form_four_nodes_is_the_full_forms_four_node_cases(tmp_path: Path) -> None:
    from graphfl.bench import p2p_throughput as pt

    assert sorted(pt.FORMS["4-nodes"]) == sorted((d, 4, insecure) for d in pt.FULL_SIZES for insecure in (True, False))
    with pytest.raises(ValueError, match="unknown p2p-throughput form 'bogus'"):
        pt.run(quick=False, seed=0, out=tmp_path, form="bogus")
    with pytest.raises(ValueError, match="exclude each other"):
        pt.run(quick=True, seed=0, out=tmp_path, form="4-nodes")
    assert not list(tmp_path.iterdir())  # refused before any work
