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
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from graphfl.common.ports import free_ports
from graphfl.p2p import codec
from graphfl.p2p.grpc_transport import GrpcTransport, Identity
from graphfl.p2p.socket_data import MAGIC, PREAMBLE, read_ack, write_record
from graphfl.p2p.topology import make_topology

GRAPHFL = str(Path(sys.executable).with_name("graphfl"))


# -- 1. a p2p peer whose final result file cannot be written ------------------------------------------


def _limit_file_size(limit: int):
    def apply() -> None:  # pragma: no cover - runs in the child before exec
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def _tmp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if ".tmp" in p.name)


def _network(tmp_path: Path, rounds: int) -> Path:
    from graphfl.deploy.p2p_launch import prepare_network

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
    from graphfl.deploy.p2p_launch import collect

    summary = collect(out, net)
    assert summary["peers"]["0"]["outcome"] == "write-failed" and "EFBIG" in summary["peers"]["0"]["error"]

    resumed = subprocess.run(_peer_argv(net, 0, out, "--resume", "--set", "connect-timeout=1"), capture_output=True,
                             text=True, timeout=300, stdin=subprocess.DEVNULL, env=env)
    assert resumed.returncode in (0, 5), resumed.stdout + resumed.stderr  # 5: alone (peer 1 is gone), no round left
    doc = json.loads((out / "peer-0.json").read_text())
    assert doc["resumed_from"]["round"] == rounds and doc["outcome"] in ("done", "isolated"), doc
    assert _tmp_files(out) == []



@pytest.mark.e2e
def test_a_peer_whose_round_record_does_not_fit_stops_write_failed_and_resume_continues(tmp_path: Path) -> None:
    """A lower limit: a round's line of rounds.jsonl stops fitting mid-run. The peer stops at once with
    outcome write-failed (exit EXIT_WRITE), the error names rounds.jsonl, every line written is whole,
    no temporary file is left, and --resume continues from the checkpoint of the last round."""
    from graphfl.p2p.peer import EXIT_WRITE

    rounds = 20
    net = _network(tmp_path, rounds)
    out = tmp_path / "out"
    env = {**os.environ, "COLUMNS": "1000", "GRAPHFL_LOG": "INFO"}
    with (tmp_path / "peer-1.log").open("w") as log1:
        other = subprocess.Popen(_peer_argv(net, 1, out), stdout=log1, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env)
        try:
            limited = subprocess.run(_peer_argv(net, 0, out), preexec_fn=_limit_file_size(5_000), capture_output=True,
                                     text=True, timeout=300, stdin=subprocess.DEVNULL, env=env)
        finally:
            other.kill()
            other.wait(timeout=60)
    text = limited.stdout + limited.stderr
    assert "Traceback" not in text and limited.returncode == EXIT_WRITE, text
    first = " ".join(text[text.index(" ERROR "):].split())
    assert str(out / "peer-0.rounds.jsonl") in first and "EFBIG" in first and "--resume" in first, first
    assert _tmp_files(out) == []
    lines = (out / "peer-0.rounds.jsonl").read_text().splitlines()
    done = [json.loads(x)["round"] for x in lines]
    assert 1 <= len(done) < rounds and done == list(range(1, len(done) + 1))
    at = json.loads((out / "peer-0.ckpt.json").read_text())["round"]
    assert at in (len(done), len(done) + 1)  # the checkpoint of the round whose line did not fit may be written
    doc = json.loads((out / "peer-0.json").read_text())
    assert doc["outcome"] == "write-failed", doc  # compact or whole, the reason is the round's line
    assert any("peer-0.rounds.jsonl: File too large" in (doc.get(k) or "") for k in ("error", "run_error")), doc

    resumed = subprocess.run(_peer_argv(net, 0, out, "--resume", "--set", "connect-timeout=1", "--set",
                                        "round-timeout=0.2"), capture_output=True, text=True, timeout=300,
                             stdin=subprocess.DEVNULL, env=env)
    assert resumed.returncode in (0, 5), resumed.stdout + resumed.stderr  # 5: alone, peer 1 is gone
    doc = json.loads((out / "peer-0.json").read_text())
    assert doc["resumed_from"]["round"] == at and doc["final_t"] > 0 and _tmp_files(out) == []

# -- 2. a restarted peer's stale data connections do not lock it out -----------------------------------

DIM = 8


def _transport(topo, i: int) -> GrpcTransport:
    t = GrpcTransport(Identity(i, "dfl-gt", "abc", topo.fingerprint), topo, None, data_path="socket")
    t.mailbox.expect("params", {"theta": ("float32", (DIM,))})
    t.serve()
    return t


def _raw(target: GrpcTransport, claimed: int, token: bytes) -> tuple[socket.socket, bool, str]:
    """A hand-made data connection to ``target``: preamble, then the callee's Ack (accepted, reason)."""
    s = socket.create_connection(("127.0.0.1", target.data_server.port), timeout=10.0)
    s.sendall(PREAMBLE.pack(MAGIC, claimed, token))
    ack = read_ack(s)
    return s, ack.accepted, ack.reason


def _message(s: socket.socket, round_: int) -> tuple[bool, str]:
    for frame in codec.encode(0, round_, "params", {"theta": np.full(DIM, float(round_), np.float32)}):
        write_record(s, frame.SerializeToString())
    ack = read_ack(s)
    return ack.accepted, ack.reason


def _closed_by_callee(s: socket.socket, seconds: float) -> bool:
    """Whether the callee closes ``s`` within ``seconds`` (it sends nothing else on an idle connection)."""
    s.settimeout(seconds)
    try:
        return s.recv(1 << 16) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _live(t: GrpcTransport) -> int:
    """Authenticated data connections ``t`` serves (in the test below, all of them peer 0's)."""
    assert t.data_server is not None
    with t.data_server._lock:
        return len(t.data_server._live)


def test_a_restarted_peer_replaces_its_half_open_data_connections_and_strangers_replace_none() -> None:
    """Peer 0's first incarnation leaves its 2 data connections to peer 1 open and silent (a partition:
    no FIN/RST reaches peer 1); the restarted peer 0 handshakes again and its authenticated connections
    take their slots at once (before: refused until the 10-minute idle limit); a connection with an
    invalid token is still refused and closes none of peer 0's connections; connections in the middle
    of a message are never replaced."""
    topo = make_topology("ring", 4, ports=free_ports(4))
    b = _transport(topo, 1)
    old_a = _transport(topo, 0)
    stale: list[socket.socket] = []
    a = None
    try:
        old_a.handshake(1, 5.0)
        token = b.data_tokens[0]
        for r in (0, 1):  # the first incarnation's connections: used once each, then silent forever
            s, ok, why = _raw(b, 0, token)
            assert ok, why
            assert _message(s, r) == (True, "")
            stale.append(s)
        old_a.close()  # the process is gone; its connections are not (nothing reached peer 1)
        assert _live(b) == 2

        a = _transport(topo, 0)  # the restarted peer 0: handshakes again, then sends over a new connection
        a.handshake(1, 5.0)
        assert a.data_contacts[1][1] == b.data_tokens[0]  # the callee's token for peer 0 (kept across handshakes)
        sent = a.send(1, 2, "params", {"theta": np.full(DIM, 2.0, np.float32)}, timeout=10.0)
        assert sent.ok, sent.reason
        assert _closed_by_callee(stale[0], 5.0)  # the least recently used stale connection made room
        assert not _closed_by_callee(stale[1], 0.3)
        fresh, ok, why = _raw(b, 0, token)  # a second new connection: takes the other stale one's slot
        assert ok, why
        assert _closed_by_callee(stale[1], 5.0)
        assert _message(fresh, 3) == (True, "")
        got = b.receive(3, ["params"], [0], timeout=10.0)
        assert sorted(r for r in range(4) if 0 in b.receive(r, ["params"], [0], timeout=2.0)) == [0, 1, 2, 3]
        np.testing.assert_array_equal(got[0]["params"].arrays["theta"], np.full(DIM, 3.0, np.float32))

        # a connection claiming peer 0 with a wrong token is refused and replaces nothing
        bad, ok, why = _raw(b, 0, bytes(16))
        bad.close()
        assert not ok and why.startswith("unknown-peer"), why
        assert _live(b) == 2
        assert _message(fresh, 4) == (True, "")
        again = a.send(1, 5, "params", {"theta": np.full(DIM, 5.0, np.float32)}, timeout=10.0)
        assert again.ok, again.reason
        assert _live(b) == 2  # the restarted peer's connection was not replaced either

        # both of peer 0's connections in the middle of a message: a third one is refused, not let in
        a.close()
        a = None
        end = time.monotonic() + 10.0
        while _live(b) > 1 and time.monotonic() < end:  # a's own connection closes with it
            time.sleep(0.05)
        second, ok, why = _raw(b, 0, token)
        assert ok, why
        big = list(codec.encode(0, 6, "params", {"theta": np.ones(DIM, np.float32)}))
        header = big[0].SerializeToString()
        for s in (fresh, second):  # the header only: the callee waits for the message's data frames
            write_record(s, header)
        time.sleep(0.5)
        third, ok, why = _raw(b, 0, token)
        third.close()
        assert not ok and "middle of a message" in why, why
        for s in (fresh, second):
            s.close()
    finally:
        for s in stale:
            s.close()
        for t in (a, old_a, b):
            if t is not None:
                t.close()


# -- 3. the final numbers of a diverged run are its last round's, not an older finite one -------------


def _devices(root: Path, scale_y: dict[int, float], n: int = 2, rows: int = 12) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for d in range(n):
        rng = np.random.default_rng(d)
        x = rng.normal(size=(rows, 2))
        y = rng.normal(size=rows) * scale_y.get(d, 1.0)
        lines = ["a,b,y", *(f"{a!r},{b!r},{v!r}" for (a, b), v in zip(x.tolist(), y.tolist()))]
        (root / f"device-{d}.csv").write_text("\n".join(lines) + "\n")
    return root


def _strict(text: str):
    def refuse(name: str):
        raise AssertionError(f"run.json holds {name}: not strict JSON")

    return json.loads(text, parse_constant=refuse)


def _final_table(md: str) -> str:
    return md.split("## Final metrics", 1)[1].split("\n## ", 1)[0]


def test_the_final_numbers_of_a_diverged_run_are_its_last_rounds(tmp_path: Path) -> None:
    """Device 1's targets of 1e30 (float32 holds them, their squares overflow): the test loss becomes
    infinite. ``final`` is the last round's evaluation: ``inf`` in the document, ``null`` plus a
    ``non_finite`` note naming metric, round and clients in run.json (strict JSON), ``inf`` in run.md;
    before, ``final`` showed round 0's finite mean (which had skipped the infinite client)."""
    from graphfl.common.config import parse_run_config
    from graphfl.server.inprocess import run_federated_inprocess

    rounds = 2
    values = {"strategy": "fedavg", "task": "csv", "nodes": 2, "rounds": rounds, "engine": "inprocess",
              "data-dir": str(_devices(tmp_path / "data", {1: 1e30})), "train.local-steps": 3}
    out = tmp_path / "out"
    with np.errstate(over="ignore", invalid="ignore"):
        doc, _ = run_federated_inprocess(parse_run_config(values), out_dir=out)
    assert doc["status"] == "diverged"
    curve = doc["methods"]["fedavg"]["curve"]
    stale = [row["test_loss"] for row in curve if row.get("test_loss") is not None]
    assert stale, "the test needs an earlier round with a finite mean test loss"
    final = doc["methods"]["fedavg"]["final"]
    assert final["eval_round"] == rounds and final["test_loss"] == float("inf"), final
    assert "test_loss is inf in round 2 on client(s) 0, 1" in final["non_finite"], final

    saved = _strict((out / "run.json").read_text())
    sfinal = saved["methods"]["fedavg"]["final"]
    assert saved["status"] == "diverged" and sfinal["test_loss"] is None and sfinal["eval_round"] == rounds
    assert sfinal["non_finite"] == final["non_finite"]
    table = _final_table((out / "run.md").read_text())
    assert "| inf |" in table and "non_finite" in table, table
    assert all(f"{v:.4f}" not in table for v in stale), table

    # a finite run of the same shape: final is its last round's finite mean, with no note
    doc, _ = run_federated_inprocess(parse_run_config({**values, "data-dir": str(_devices(tmp_path / "fine", {}))}),
                                     out_dir=tmp_path / "fine-out")
    final = doc["methods"]["fedavg"]["final"]
    assert doc["status"] == "completed" and "non_finite" not in final and final["eval_round"] == rounds
    assert final["test_loss"] == pytest.approx(doc["methods"]["fedavg"]["curve"][-1]["test_loss"], rel=1e-9)


APPEND = """
import resource, sys
from pathlib import Path
from graphfl.common.results import ResultsWriteError
from graphfl.p2p.peer import append_line
path = Path(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (150, 150))
try:
    append_line(path, "x" * 200)
except ResultsWriteError as exc:
    print("refused:", exc)
"""


def test_a_round_line_that_does_not_fit_leaves_rounds_jsonl_as_it_was(tmp_path: Path) -> None:
    """The kernel writes what fits under the limit (50 of 201 bytes) before EFBIG: the part is cut off."""
    path = tmp_path / "peer-0.rounds.jsonl"
    path.write_text('{"round": 1}\n' * 7 + "{}\n")  # 100 bytes
    before = path.read_bytes()
    proc = subprocess.run([sys.executable, "-c", APPEND, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"refused: cannot write {path}: File too large (EFBIG)" in proc.stdout, proc.stdout
    assert path.read_bytes() == before
