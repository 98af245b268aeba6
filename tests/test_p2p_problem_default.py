"""Algorithms that need tabular data get a problem they can run on, or a refusal before any peer starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from graphfl.common.config import ConfigError
from graphfl.p2p.config import parse_p2p_config
from graphfl.p2p.oracles import DATA_PROBLEMS


@pytest.mark.parametrize("algorithm", ["admm", "fedrelax"])
def test_a_tabular_algorithm_defaults_to_a_data_problem(algorithm: str) -> None:
    cfg = parse_p2p_config({"algorithm": algorithm})
    assert cfg.problem == DATA_PROBLEMS[0] == "linreg"
    assert parse_p2p_config({"algorithm": algorithm, "problem": "clusters"}).problem == "clusters"


def test_a_torch_problem_is_refused_for_admm_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"admm.*tabular.*\['linreg', 'clusters', 'clusters-logistic', 'csv'\].*"
                                          r"synthetic-dfl"):
        parse_p2p_config({"algorithm": "admm", "problem": "synthetic-dfl"})


def test_other_algorithms_keep_their_default_problem() -> None:
    assert parse_p2p_config({"algorithm": "dfl-gt"}).problem == "synthetic-dfl"
    # switching a dfl-gt config to admm drops the task problem it cannot run on
    base = parse_p2p_config({"algorithm": "dfl-gt"})
    assert parse_p2p_config({"algorithm": "admm"}, base=base).problem == "linreg"


def test_cli_refuses_before_starting_peers(tmp_path) -> None:
    out = tmp_path / "net"
    res = subprocess.run([sys.executable, "-m", "graphfl.cli", "p2p", "--algorithm", "admm", "--topology", "ring",
                          "--peers", "3", "--rounds", "2", "--problem", "synthetic-dfl", "--out", str(out), "--quiet"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    assert "tabular" in res.stderr and "linreg" in res.stderr
    assert not (out / "logs").exists()  # no peer process was started


def test_cli_default_problem_runs_admm_in_process(tmp_path) -> None:
    out = tmp_path / "net"
    res = subprocess.run([sys.executable, "-m", "graphfl.cli", "p2p", "--algorithm", "admm", "--topology", "ring",
                          "--peers", "4", "--rounds", "5", "--engine", "inprocess", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr + res.stdout
    assert (out / "p2p.json").exists()
