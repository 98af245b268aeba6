"""Results never lie; bad input never corrupts: a p2p peer that cannot write its results, stale
data connections of a restarted peer, and the ``final`` numbers of a diverged run.

Real processes and sockets where the defect lives there: peer processes under a file-size limit
(``RLIMIT_FSIZE``: EFBIG, portable, no privileges), a real data listener with half-open
connections of a peer's previous incarnation, the in-process engine on a CSV of huge values.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

GRAPHFL = str(Path(sys.executable).with_name("graphfl"))


# -- 1. a p2p peer whose final result file cannot be written ------------------------------------------


def _limit_file_size(limit: int):
    def apply() -> None:  # pragma: no cover - runs in the child before exec
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def _tmp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if ".tmp" in p.name)


def _network(tmp_path: Path, rounds: int) -> Path:
    from graphfl.p2p.launcher import prepare_network

    return prepare_network(tmp_path / "net", "ring", 2,
                           {"algorithm": "dfl-gt", "problem": "linreg", "rounds": rounds, "checkpoint-every": 1,
                            "connect-timeout": 60, "round-timeout": 30}, insecure=True)


def _peer_argv(net: Path, peer_id: int, out: Path, *extra: str) -> list[str]:
    return [GRAPHFL, "peer", "--topology", str(net), "--id", str(peer_id), "--out", str(out), "--insecure", *extra]


@pytest.mark.e2e
def test_a_peer_that_cannot_write_its_result_file_says_so_in_one_line_and_resume_finishes(tmp_path: Path) -> None:
    """Peer 0 runs under a file-size limit that its rounds.jsonl, checkpoint and status file fit in but its
    final peer-0.json (every record, indented) does not: no traceback, one error line naming the file and
    the errno, exit code EXIT_WRITE, outcome write-failed where it can still be written, no temporary
    file, the rounds and checkpoint intact, and ``graphfl peer --resume`` writes the result."""
    from graphfl.p2p.peer import EXIT_WRITE

    rounds = 20
    net = _network(tmp_path, rounds)
    out = tmp_path / "out"
    env = {**os.environ, "COLUMNS": "1000", "GRAPHFL_LOG": "INFO"}
    with (tmp_path / "peer-1.log").open("w") as log1:
        other = subprocess.Popen(_peer_argv(net, 1, out), stdout=log1, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env)
        try:
            limited = subprocess.run(_peer_argv(net, 0, out), preexec_fn=_limit_file_size(9_500), capture_output=True,
                                     text=True, timeout=300, stdin=subprocess.DEVNULL, env=env)
            assert other.wait(timeout=300) == 0, (tmp_path / "peer-1.log").read_text()
        finally:
            if other.poll() is None:
                other.kill()
    text = limited.stdout + limited.stderr
    assert "Traceback" not in text, text
    assert text.count(" ERROR ") == 1, text  # one error record (the console may wrap it over lines)
    line = " ".join(text[text.index(" ERROR "):].split())
    assert str(out / "peer-0.json") in line and "File too large" in line and "EFBIG" in line, line
    assert "--resume" in line and f"round {rounds}" in line, line
    assert limited.returncode == EXIT_WRITE, text
    assert _tmp_files(out) == []
    # what could still be written says how the peer ended: a compact peer-0.json and the status file
    doc = json.loads((out / "peer-0.json").read_text())
    assert doc["outcome"] == "write-failed" and "EFBIG" in doc["error"] and doc["run_outcome"] == "done", doc
    assert "records" not in doc and doc["rounds_completed"] == rounds
    status = json.loads((out / "peer-0.status.json").read_text())
    assert status["state"] == "write-failed" and "EFBIG" in status["error"]
    # the records already written are intact: every round, each line valid JSON
    lines = (out / "peer-0.rounds.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == list(range(1, rounds + 1))
    assert json.loads((out / "peer-0.ckpt.json").read_text())["round"] == rounds
    # the launcher's summary reads it as not done, with the reason
    from graphfl.p2p.launcher import collect

    summary = collect(out, net)
    assert summary["peers"]["0"]["outcome"] == "write-failed" and "EFBIG" in summary["peers"]["0"]["error"]

    resumed = subprocess.run(_peer_argv(net, 0, out, "--resume", "--set", "connect-timeout=1"), capture_output=True,
                             text=True, timeout=300, stdin=subprocess.DEVNULL, env=env)
    assert resumed.returncode in (0, 5), resumed.stdout + resumed.stderr  # 5: alone (peer 1 is gone), no round left
    doc = json.loads((out / "peer-0.json").read_text())
    assert doc["resumed_from"]["round"] == rounds and doc["outcome"] in ("done", "isolated"), doc
    assert _tmp_files(out) == []
