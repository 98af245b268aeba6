"""graphfl dashboard without a browser: folder snapshots of real run / p2p / bench folders and the
HTTP server's endpoints, token, bounds and bad input (a real server on 127.0.0.1, plain sockets)."""

from __future__ import annotations

import json
import shutil
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from graphfl.common.config import parse_run_config
from graphfl.dashboard.readers import SnapshotCache, snapshot
from graphfl.dashboard.server import is_loopback, make_server, serve_in_thread
from graphfl.tests.cli_runner import graphfl_cli

REPO = Path(__file__).resolve().parents[1]


def _run(out: Path, **extra: object) -> Path:
    from graphfl.deploy.run import run_experiment

    values = {"engine": "inprocess", "rounds": 2, "nodes": 3, "train.local-steps": 5, "out-dir": str(out), **extra}
    return run_experiment(parse_run_config(values))


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    """A real, completed in-process run: fedavg on digits, 3 clients, 2 rounds."""
    return _run(tmp_path_factory.mktemp("dash") / "run")


@pytest.fixture(scope="module")
def failed_folder(tmp_path_factory) -> Path:
    """A real run that fails in round 1: a learning rate that turns every client's model to NaN."""
    from graphfl.server.rounds import RunError

    out = tmp_path_factory.mktemp("dash") / "failed"
    with pytest.raises(RunError):
        _run(out, **{"train.lr": 1e12})
    return out


@pytest.fixture()
def served(request):
    """Start a dashboard on the given folders; yields its base URL and server; always shut down."""
    servers = []

    def start(*folders: Path, **kw):
        srv = make_server(list(folders), **kw)
        serve_in_thread(srv)
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}", srv

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _state(base: str) -> dict:
    code, body = _get(base + "/api/state")
    assert code == 200, body
    return json.loads(body)


# -- snapshots -------------------------------------------------------------------------------------

def test_run_snapshot_has_curves_table_and_last_round(run_folder):
    snap = snapshot(run_folder)
    assert snap["kind"] == "run" and snap["status"] == "completed" and snap["error"] is None
    assert snap["last_round"] == 2 and snap["rounds"] == 2
    loss = next(p for p in snap["panels"] if p["title"] == "loss")
    test_loss = next(s for s in loss["series"] if s["name"] == "test_loss")
    doc = json.loads((run_folder / "run.json").read_text())
    want = [[float(r["round"]), r["test_loss"]] for r in doc["methods"]["fedavg"]["curve"]]
    assert [p[0] for p in test_loss["points"]] == [w[0] for w in want]
    assert [p[1] for p in test_loss["points"]] == pytest.approx([w[1] for w in want], rel=1e-6)
    assert {p["title"] for p in snap["panels"]} >= {"loss", "accuracy / task metric", "seconds per round",
                                                   "bytes per round"}
    rows = snap["table"]["rows"]
    assert [r["id"] for r in rows] == ["0", "1", "2"]
    assert all(r["status"] == "ok" and r["last_round"] == 2 and r["rounds"] == 2 for r in rows)


def test_failed_run_shows_its_error_and_the_clients_it_names(failed_folder):
    snap = snapshot(failed_folder)
    assert snap["status"] == "failed"
    assert "0 valid replies of 3" in snap["error"]
    assert {r["id"]: r["status"] for r in snap["table"]["rows"]} == {"0": "failed", "1": "failed", "2": "failed"}
    assert all("NaN or Inf" in r["error"] for r in snap["table"]["rows"])


def test_not_a_graphfl_folder_and_a_missing_one_say_so(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "other.json").write_text('{"a": 1}')
    snap = snapshot(tmp_path)
    assert snap["kind"] == "unknown"
    assert any("is not a graphfl output folder" in m and str(tmp_path) in m for m in snap["messages"])
    gone = snapshot(tmp_path / "nope")
    assert gone["kind"] == "missing" and any("no such folder" in m for m in gone["messages"])


def test_half_written_run_json_keeps_the_last_complete_version(run_folder, tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    text = (run_folder / "run.json").read_text()
    cache = SnapshotCache()
    (folder / "run.json").write_text(text[: len(text) // 2])
    first = snapshot(folder, cache)
    assert first["kind"] == "run" and first["panels"] == []
    assert any("run.json: not complete JSON" in m for m in first["messages"])
    (folder / "run.json").write_text(text)
    good = snapshot(folder, cache)
    assert good["last_round"] == 2 and not good["messages"]
    time.sleep(0.01)
    (folder / "run.json").write_text(text[:100])
    torn = snapshot(folder, cache)
    assert torn["last_round"] == 2, "a torn rewrite must not blank what was already shown"
    assert any("showing its last complete version" in m for m in torn["messages"])


def test_binary_and_non_object_files_are_messages_not_crashes(tmp_path):
    (tmp_path / "run.json").write_bytes(b"\xff\xfe\x00garbage")
    snap = snapshot(tmp_path)
    assert any("run.json: not UTF-8" in m for m in snap["messages"])
    (tmp_path / "run.json").write_text("[1, 2]")
    assert any("a JSON list, not an object" in m for m in snapshot(tmp_path)["messages"])
    p2p = tmp_path / "p2p"
    p2p.mkdir()
    (p2p / "network.toml").write_text("peers = [ {")
    assert any("network.toml: not valid TOML" in m for m in snapshot(p2p)["messages"])


def test_bench_folder_lists_methods_with_mean_sd_and_verdicts():
    snap = snapshot(REPO / "docs" / "results" / "dfl-quick")
    assert snap["kind"] == "bench"
    doc = json.loads((REPO / "docs" / "results" / "dfl-quick" / "dfl.json").read_text())
    (bench,) = snap["bench"]
    assert [r["method"] for r in bench["rows"]] == list(doc["methods"])
    first = next(iter(doc["methods"].values()))["final"]
    cell = bench["rows"][0]["cells"]["test_loss"]
    mean, sd = (float(x) for x in cell.split(" ± "))
    assert mean == pytest.approx(first["test_loss"], rel=1e-3) and sd == pytest.approx(first["test_loss_sd"], rel=1e-3)
    assert bench["rows"][0]["seeds"] == len(next(iter(doc["methods"].values()))["alpha0_used_per_seed"])
    assert bench["verdicts"], "dfl.json has a verdict"


def test_jgesr_graph_and_fesem_clusters_from_server_metrics(tmp_path, run_folder):
    doc = json.loads((run_folder / "run.json").read_text())
    curve = doc["methods"]["fedavg"]["curve"]
    curve[-1]["server"] = {"graph": [[0, 0.5, 0], [0.5, 0, 0.25], [0, 0.25, 0]], "assignment": [1, 0, 1],
                           "phi_minus_identity": 0.125}
    (tmp_path / "run.json").write_text(json.dumps(doc))
    snap = snapshot(tmp_path)
    learning = next(p for p in snap["panels"] if p["title"] == "graph learning (server)")
    assert learning["series"] == [{"name": "server.phi_minus_identity", "points": [[2.0, 0.125]]}]
    graph = snap["graph"]
    assert len(graph["nodes"]) == 3
    assert sorted(map(tuple, graph["edges"])) == [(0, 1, 0.5), (1, 2, 0.25)]
    assert [n["group"] for n in graph["nodes"]] == [1, 0, 1]


@pytest.mark.e2e
def test_p2p_snapshot_of_a_real_network(tmp_path):
    out = tmp_path / "p2p"
    res = graphfl_cli("p2p", "--peers", "3", "--rounds", "4", "--out", str(out), "--quiet", "--insecure",
                      timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    snap = snapshot(out)
    assert snap["kind"] == "p2p" and snap["status"] == "completed" and snap["last_round"] == 4
    assert len(snap["graph"]["nodes"]) == 3 and len(snap["graph"]["edges"]) == 3  # a ring of 3
    rows = snap["table"]["rows"]
    assert [r["id"] for r in rows] == ["0", "1", "2"]
    summary = json.loads((out / "p2p.json").read_text())
    for r in rows:
        assert r["status"] == "done" and r["rounds"] == 4
        assert r["bytes_sent"] == summary["peers"][r["id"]]["bytes_sent"]
    # bytes per link: each peer's links add up to its totals, and each ring edge carries them
    for i in range(3):
        peer = json.loads((out / f"peer-{i}.json").read_text())
        assert set(peer["links"]) == {str((i + 1) % 3), str((i - 1) % 3)}
        assert sum(v["bytes_sent"] for v in peer["links"].values()) == peer["stats"]["bytes_sent"]
        assert sum(v["bytes_received"] for v in peer["links"].values()) == peer["stats"]["bytes_received"]
        for j, v in peer["links"].items():
            other = json.loads((out / f"peer-{j}.json").read_text())["links"][str(i)]
            assert 0 < other["bytes_received"] <= v["bytes_sent"], "a late message counts as sent, not received"
    for (a, b, _), (ab, ba) in zip(snap["graph"]["edges"], snap["graph"]["edge_bytes"], strict=True):
        links = json.loads((out / f"peer-{a}.json").read_text())["links"][str(b)]
        assert [ab, ba] == [links["bytes_sent"], links["bytes_received"]]
    # while the network runs only the peers' own files exist: the mean curve comes from them
    (out / "p2p.json").unlink()
    live = snapshot(out)
    assert live["status"] == "running" and live["last_round"] == 4
    mean_loss = next(s for s in live["panels"][0]["series"] if s["name"] == "test_loss")["points"][-1][1]
    last = [json.loads((out / f"peer-{i}.rounds.jsonl").read_text().splitlines()[-1])["test_loss"] for i in range(3)]
    assert mean_loss == pytest.approx(sum(last) / 3, rel=1e-6)
    for panel in live["panels"]:  # the live curve follows p2p.json's rules: same numbers once it is written
        for series in panel["series"]:
            want = [[float(r["round"]), r[series["name"]]] for r in summary["methods"]["dfl-gt"]["curve"]]
            assert [p[0] for p in series["points"]] == [w[0] for w in want], series["name"]
            assert [p[1] for p in series["points"]] == pytest.approx([w[1] for w in want], rel=1e-6, abs=1e-12)


def test_admm_edge_selection_marks_kept_and_dropped_edges(tmp_path):
    network = """peers = [{ id = 0, address = "127.0.0.1:1" }, { id = 1, address = "127.0.0.1:2" },
    { id = 2, address = "127.0.0.1:3" }]
[network]
name = "complete-3"
[[edges]]
nodes = [0, 1]
weight = 1.0
[[edges]]
nodes = [0, 2]
weight = 1.0
[[edges]]
nodes = [1, 2]
weight = 1.0
[run]
algorithm = "admm"
rounds = 3
"""
    (tmp_path / "network.toml").write_text(network)
    from graphfl.deploy.p2p_launch import edge_selection_summary

    peers = {"0": {"report": {"selection": [
        {"edge": [0, 1], "decided_by": 0, "kept": True, "w2": 9.5, "df": 2, "p_value": 0.0087},
        {"edge": [0, 2], "decided_by": 0, "kept": False, "w2": 0.3, "df": 2, "p_value": 0.86}]}}}
    selection = edge_selection_summary(3, [(0, 1), (0, 2), (1, 2)], peers)
    (tmp_path / "p2p.json").write_text(json.dumps({"name": "p2p", "ok": True, "edge_selection": selection}))
    graph = snapshot(tmp_path)["graph"]
    assert [e[:2] for e in graph["edges"]] == [[0, 1], [0, 2], [1, 2]]
    assert graph["edge_state"] == ["kept", "dropped", "unknown"]
    assert "p_value 0.86" in graph["edge_note"][1] and "w2 0.3" in graph["edge_note"][1]


def _rounds_seen_through_dashboard(log: Path, *args: str) -> list[int]:
    """Run ``graphfl *args`` (with ``--dashboard``), follow its printed dashboard's ``/api/state``
    every 0.2 s until the process ends, and return the distinct last rounds it showed."""
    import os
    import re
    import subprocess
    import sys

    with log.open("w") as fh:
        proc = subprocess.Popen([str(Path(sys.executable).with_name("graphfl")), *args], stdout=fh,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "250"})
        seen: list[int] = []
        base = None
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and proc.poll() is None:
                base = base or re.search(r"dashboard\W+(http://127\.0\.0\.1:\d+)/", log.read_text())
                if base:
                    try:
                        folder = _state(base.group(1))["folders"][0]
                    except (urllib.error.URLError, ConnectionError):
                        break  # the run ended and took its dashboard with it
                    if folder["last_round"] is not None and folder["last_round"] not in seen:
                        seen.append(folder["last_round"])
                time.sleep(0.2)
            assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert base is not None, f"no dashboard address printed: {log.read_text()[-3000:]}"
    return seen


@pytest.mark.e2e
def test_run_with_dashboard_serves_the_run_while_it_runs(tmp_path):
    seen = _rounds_seen_through_dashboard(tmp_path / "run.log", "run", "--engine", "inprocess", "--rounds", "3",
                                          "--nodes", "3", "--out", str(tmp_path / "run"), "--dashboard")
    assert seen and seen[-1] == 3, f"rounds seen through the dashboard: {seen}"


@pytest.mark.e2e
def test_p2p_with_dashboard_serves_the_network_while_it_runs(tmp_path):
    seen = _rounds_seen_through_dashboard(tmp_path / "p2p.log", "p2p", "--peers", "3", "--rounds", "6", "--quiet",
                                          "--insecure", "--set", "min-round-seconds=0.3", "--out",
                                          str(tmp_path / "p2p"), "--dashboard")
    assert seen and seen[-1] == 6, f"rounds seen through the dashboard: {seen}"
    assert len(seen) >= 2, f"only the end was seen: {seen}"


# -- the server ------------------------------------------------------------------------------------

def test_page_assets_and_state_endpoint(served, run_folder, tmp_path):
    base, _ = served(run_folder, tmp_path / "missing")
    code, page = _get(base + "/")
    assert code == 200 and b'src="static/app.js"' in page
    for name in ("app.js", "style.css"):
        code, body = _get(f"{base}/static/{name}")
        assert code == 200 and body
    code, js = _get(base + "/static/app.js")
    assert b"http://" not in js.replace(b"http://www.w3.org/2000/svg", b""), "no asset from another host"
    state = _state(base)
    assert [f["kind"] for f in state["folders"]] == ["run", "missing"]
    assert state["folders"][0]["last_round"] == 2


def test_only_the_shipped_files_are_served_and_nothing_is_written(served, run_folder):
    base, _ = served(run_folder)
    before = {p: p.stat().st_mtime_ns for p in run_folder.rglob("*") if p.is_file()}
    for path in ("/static/../readers.py", "/static/%2e%2e/server.py", "/run.json", "/static/index.htm",
                 "/../../etc/passwd"):
        code, _ = _get(base + path)
        assert code == 404, path
    req = urllib.request.Request(base + "/api/state", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 405
    assert {p: p.stat().st_mtime_ns for p in run_folder.rglob("*") if p.is_file()} == before


def test_token_is_checked_on_every_request(served, run_folder):
    base, srv = served(run_folder, token="s3cret-token")
    assert srv.url().endswith("/?token=s3cret-token")
    for path in ("/", "/static/app.js", "/api/state"):
        assert _get(base + path)[0] == 403, path
        assert _get(base + path + "?token=wrong")[0] == 403, path
        assert _get(base + path + "?token=s3cret-token")[0] == 200, path
    assert _get(base + "/api/state", {"X-Graphfl-Token": "s3cret-token"})[0] == 200


def test_a_non_loopback_host_gets_a_token():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")
    srv = make_server([Path(".")], host="0.0.0.0")
    try:
        assert srv.dashboard.token and len(srv.dashboard.token) >= 20
        assert f"token={srv.dashboard.token}" in srv.url()
    finally:
        srv.server_close()
    local = make_server([Path(".")])
    try:
        assert local.dashboard.token is None and local.server_address[0] == "127.0.0.1"
    finally:
        local.server_close()


def test_requests_over_the_bound_get_503_and_the_server_recovers(run_folder):
    srv = make_server([run_folder])
    srv._slots = __import__("threading").BoundedSemaphore(1)
    serve_in_thread(srv)
    port = srv.server_address[1]
    try:
        idle = socket.create_connection(("127.0.0.1", port), timeout=10)  # holds the one slot, sends nothing
        time.sleep(0.3)
        code, _ = _get(f"http://127.0.0.1:{port}/api/state")
        assert code == 503
        idle.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            code, _ = _get(f"http://127.0.0.1:{port}/api/state")
            if code == 200:
                break
            time.sleep(0.2)
        assert code == 200
    finally:
        srv.shutdown()
        srv.server_close()


def test_bad_folders_never_stop_the_server(served, run_folder, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "run.json").write_text('{"status": "running", "methods": {"x": {"curve": [{"round": "two"}, 5]}}}')
    weird = tmp_path / "weird"
    weird.mkdir()
    (weird / "progress.jsonl").write_text('{"event": "round", "round": 1, "rounds": 3, "test_loss": 1.5}\n[1]\n{"ev')
    base, _ = served(bad, weird, tmp_path / "unknown-yet", run_folder)
    state = _state(base)
    kinds = [f["kind"] for f in state["folders"]]
    assert kinds == ["run", "run", "missing", "run"]
    assert state["folders"][1]["last_round"] == 1
    assert any("1 line(s) that are not JSON objects" in m for m in state["folders"][1]["messages"])
    assert state["folders"][3]["last_round"] == 2
    shutil.copytree(run_folder, tmp_path / "unknown-yet")
    assert _state(base)["folders"][2]["last_round"] == 2, "a folder that appears later is picked up"


def test_cli_dashboard_refuses_a_bad_port():
    res = graphfl_cli("dashboard", ".", "--port", "70000", timeout=120)
    assert res.returncode == 2 and "--port must be 0..65535" in res.stderr


def test_every_static_file_ships_in_the_wheel():
    import fnmatch
    import tomllib

    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "graphfl.dashboard"]
    files = sorted(p.relative_to(REPO / "dashboard").as_posix() for p in (REPO / "dashboard" / "static").iterdir())
    assert files and all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files), (files, globs)
    from graphfl.dashboard.server import STATIC_FILES

    assert sorted(f"static/{n}" for n in STATIC_FILES) == files
