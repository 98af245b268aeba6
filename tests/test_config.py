import dataclasses
import tomllib
from pathlib import Path

import pytest

from graphfl.common.config import (
    ConfigError,
    RunConfig,
    all_defaults_flat,
    flatten,
    load_toml,
    parse_assignment,
    parse_run_config,
)

REPO = Path(__file__).resolve().parent.parent


def test_defaults_parse_to_frozen_config():
    cfg = parse_run_config({})
    assert cfg.strategy == "fedavg" and cfg.task == "digits" and cfg.nodes == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rounds = 3  # type: ignore[misc]  # frozen
    assert cfg.params.weighted is True


def test_sections_dashes_and_underscores():
    cfg = parse_run_config({"strategy": "fedprox", "train": {"local_steps": 3}, "fedprox.mu": 0.5,
                            "data.dirichlet-alpha": 2})
    assert cfg.train.local_steps == 3 and cfg.params.mu == 0.5 and cfg.data.dirichlet_alpha == 2.0


def test_devices_auto_cpu_cuda_and_cuda_n_are_accepted():
    assert [parse_run_config({"device": d}).device for d in ("auto", "cpu", "cuda", "cuda:1")] == \
        ["auto", "cpu", "cuda", "cuda:1"]


@pytest.mark.parametrize("values, message", [
    ({"strategy": "fedmagic"}, "valid strategies"),
    ({"task": "imagenet"}, "valid tasks"),
    ({"roundz": 3}, "valid top-level keys"),
    ({"train.lr2": 0.1}, "valid keys"),
    ({"rounds": 0}, "must be >= 1"),
    ({"rounds": "many"}, "expected an integer"),
    ({"engine": "cloud"}, "choose one of"),
    ({"train.lr": float("nan")}, "finite"),
    ({"nosuchstrategy.mu": 1}, "unknown section"),
    ({"device": "gpu"}, "cuda:N"),
    ({"device": "cuda:first"}, "cuda:N"),
])
def test_bad_values_name_the_problem(values, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config(values)


def test_other_strategy_sections_are_ignored_only_for_flower_defaults():
    values = {"strategy": "fedavg", "fedprox.mu": 0.1}
    assert parse_run_config(values).strategy == "fedavg"
    with pytest.raises(ConfigError, match="configures strategy 'fedprox'"):
        parse_run_config(values, ignore_other_strategies=False)


def test_toml_file_and_assignments(tmp_path):
    f = tmp_path / "exp.toml"
    f.write_text('strategy = "fedprox"\nrounds = 7\n[train]\nlr = 0.2\n[fedprox]\nmu = 0.01\n')
    cfg = parse_run_config(flatten(load_toml(f)))
    assert (cfg.rounds, cfg.train.lr, cfg.params.mu) == (7, 0.2, 0.01)
    assert parse_assignment("train.lr=0.5") == ("train.lr", 0.5)
    assert parse_assignment("task=digits") == ("task", "digits")
    with pytest.raises(ConfigError, match="not found"):
        load_toml(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("rounds = = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(tmp_path / "bad.toml")


def test_round_trip_through_flat_form():
    cfg = parse_run_config({"strategy": "fedprox", "fedprox.mu": 0.3, "rounds": 2})
    assert parse_run_config(cfg.to_flat()) == cfg


def test_pyproject_flower_config_matches_the_code():
    """`flwr run .` only accepts keys listed in [tool.flwr.app.config]: keep it in sync."""
    with (REPO / "pyproject.toml").open("rb") as fh:
        section = tomllib.load(fh)["tool"]["flwr"]["app"]["config"]
    assert flatten(section) == all_defaults_flat()


def test_generated_app_matches_pyproject():
    from graphfl.server.flower_app import app_pyproject

    generated = tomllib.loads(app_pyproject())["tool"]["flwr"]["app"]
    with (REPO / "pyproject.toml").open("rb") as fh:
        repo = tomllib.load(fh)["tool"]["flwr"]["app"]
    assert generated["components"] == repo["components"]
    assert flatten(generated["config"]) == flatten(repo["config"])


def test_runconfig_json_has_params():
    doc = parse_run_config({"strategy": "fedprox"}).to_json()
    assert doc["params"] == {"mu": 0.002, "weighted": True} and doc["train"]["local_steps"] == RunConfig().train.local_steps


def test_repository_builds_as_a_flower_app_bundle():
    """`flwr run .` from a checkout: the FAB builds, carries the components, excludes .venv."""
    import io
    import zipfile

    from flwr.cli.build import FAB_MAX_SIZE, build_fab_from_disk

    fab = build_fab_from_disk(REPO)
    names = zipfile.ZipFile(io.BytesIO(fab)).namelist()
    assert len(fab) < FAB_MAX_SIZE
    assert "pyproject.toml" in names and "server/app.py" in names and "client/app.py" in names
    assert not [n for n in names if n.startswith((".venv", "runs/"))]
    with zipfile.ZipFile(io.BytesIO(fab)) as z:
        meta = tomllib.loads(z.read("pyproject.toml").decode())
    assert meta["tool"]["flwr"]["app"]["components"]["serverapp"] == "graphfl.server.app:app"


def test_auto_device_keeps_tiny_models_on_the_cpu():
    from graphfl.common.devices import AUTO_GPU_MIN_PARAMS, resolve_auto

    assert resolve_auto(False, 10**9) == "cpu"  # no GPU visible
    assert resolve_auto(True, 4_810) == "cpu"  # the digits MLP: slower on a GPU (measured)
    assert resolve_auto(True, AUTO_GPU_MIN_PARAMS) == "cuda" and resolve_auto(True, 1_663_370) == "cuda"
    assert resolve_auto(True, None) == "cuda"  # size unknown: a visible GPU is used


def test_cli_nodes_default_to_the_tasks_own_count(tmp_path):
    """`graphfl run` without --nodes (and no `nodes` in --config/--set) uses the task's default_nodes."""
    from graphfl.cli import build_config

    assert build_config(None, [], {"task": None}).nodes == 4                        # digits, the default run
    assert build_config(None, [], {"task": "bbbp"}).nodes == 16                     # seed 004: 16 clients
    assert build_config(None, [], {"task": "ciao"}).nodes == 28                     # one per item category
    assert build_config(None, ["task=ciao"], {}).nodes == 28
    assert build_config(None, [], {"task": "bbbp", "nodes": 3}).nodes == 3          # an explicit flag wins
    assert build_config(None, ["nodes=5"], {"task": "bbbp"}).nodes == 5             # so does --set
    cfg = tmp_path / "exp.toml"
    cfg.write_text('task = "ciao"\n')
    assert build_config(cfg, [], {}).nodes == 28
    cfg.write_text('task = "ciao"\nnodes = 7\n')
    assert build_config(cfg, [], {}).nodes == 7                                     # a config file's nodes wins
    with pytest.raises(ConfigError, match="valid tasks"):
        build_config(None, [], {"task": "nope"})
