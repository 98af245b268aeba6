"""Folder snapshots for the dashboard: one JSON-ready dict per watched folder, read from the files
graphfl already writes, never written back.

A folder is recognised by its files, in this order:

* ``run.json`` or ``progress.jsonl`` -> ``kind = "run"`` (``graphfl run``, any engine);
* ``p2p.json``, ``network.toml`` or ``peer-<id>.json`` / ``.status.json`` / ``.rounds.jsonl`` -> ``"p2p"``;
* any other ``*.json`` that is a graphfl benchmark result (a ``name`` and one of the layouts
  :mod:`.bench_results` reads: the harness's ``results`` list, ``methods``, ``cells``, ``table``,
  ``rows``) -> ``"bench"``;
* nothing of these -> ``"unknown"`` with a message naming the folder, the files looked for and
  any JSON in it that is not a graphfl result.

Rules: reading never raises (a folder that vanished, a file that is not JSON, a half-written line
are reported in ``messages``); a document that fails to parse keeps the last complete version
read from it (:class:`SnapshotCache`), so a file caught mid-write never blanks the page.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import bench_results
from .bench_results import _dict, _finite

logger = logging.getLogger(__name__)

MAX_FILE_BYTES = 64 * 1024 * 1024
"""Larger result files are not read (a message says so)."""

RUN_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", ("test_loss", "train_loss", "local_test_loss")),
    ("accuracy / task metric", ("test_acc", "local_test_acc", "test_auc", "test_mae")),
    ("seconds per round", ("seconds", "client_seconds")),
    ("bytes per round", ("bytes_up", "bytes_down")),
    ("graph learning (server)", ("server.phi_minus_identity", "server.shrink_ratio", "server.graph_cv",
                                 "server.ari")),
)
P2P_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss (mean over peers)", ("test_loss", "train_loss")),
    ("disagreement", ("local_disagreement", "consensus")),
    ("seconds since the start (slowest peer)", ("seconds",)),
    ("comm / compute seconds per round (mean)", ("comm_s", "compute_s")),
    ("bytes per round (all peers)", ("bytes_up", "bytes_down")),
)
_PEER_FILE = re.compile(r"^peer-(\d+)\.(json|status\.json|rounds\.jsonl)$")


class ReadError(Exception):
    """A result file that could not be read as a document (the message names the file)."""


def _read_text(path: Path) -> str:
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ReadError(f"{path.name}: {size} bytes, over the dashboard's {MAX_FILE_BYTES} byte limit")
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ReadError(f"{path.name}: not UTF-8 text ({exc.reason})") from exc
    except OSError as exc:
        raise ReadError(f"{path.name}: {exc.strerror or exc}") from exc


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; :class:`ReadError` naming the file when it is not one."""
    text = _read_text(path)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        what = "empty" if not text.strip() else f"not complete JSON ({exc.msg} at line {exc.lineno})"
        raise ReadError(f"{path.name}: {what}") from exc
    if not isinstance(doc, dict):
        raise ReadError(f"{path.name}: a JSON {type(doc).__name__}, not an object")
    return doc


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The complete JSON-object lines of ``path`` and a note on a torn last line or bad lines.

    A last line without its newline is a line still being written: it is left out silently
    unless it is the only content.
    """
    text = _read_text(path)
    lines = text.split("\n")
    tail = lines.pop() if lines else ""
    rows: list[dict[str, Any]] = []
    bad = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    note = f"{path.name}: {bad} line(s) that are not JSON objects were skipped" if bad else None
    if tail.strip() and not rows:
        note = f"{path.name}: its only line is not complete yet"
    return rows, note


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML document in ``path``; :class:`ReadError` naming the file when it is not one."""
    try:
        return tomllib.loads(_read_text(path))
    except tomllib.TOMLDecodeError as exc:
        raise ReadError(f"{path.name}: not valid TOML ({exc})") from exc


DERIVED_KEEP = 64
"""Names kept by :meth:`SnapshotCache.derived`, one view each (the oldest name is dropped first)."""


class SnapshotCache:
    """The last complete parse of each document, so that a file caught mid-write is replaced by
    its previous version (and a message) instead of nothing. Thread-safe.
    """

    def __init__(self) -> None:
        self._docs: dict[Path, tuple[float, Any]] = {}
        self._derived: dict[str, tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    def json(self, path: Path, messages: list[str]) -> dict[str, Any] | None:
        """``path``'s JSON object, its last complete version when the current one does not parse
        (with a message), or ``None`` (with a message) when there never was one.
        """
        try:
            mtime = path.stat().st_mtime
        except OSError as exc:
            messages.append(f"{path.name}: {exc.strerror or exc}")
            return self._last(path)
        with self._lock:
            hit = self._docs.get(path)
        if hit is not None and hit[0] == mtime:
            return hit[1]
        try:
            doc = read_json(path)
        except ReadError as exc:
            last = self._last(path)
            messages.append(f"{exc}" + ("; showing its last complete version" if last is not None else ""))
            return last
        with self._lock:
            self._docs[path] = (mtime, doc)
        return doc

    def derived(self, doc: Mapping[str, Any], name: str, compute: Callable[[], Any]) -> Any:
        """``compute()`` for the document ``doc`` (an object :meth:`json` returned), computed once
        while that document is the current one: a view that costs time on a large ``run.json`` is
        redone when the file changes, not on every poll.

        One entry per ``name`` (the document it was computed from and the view): a newer document
        replaces it, so a ``run.json`` rewritten on every poll holds one document here, not many.
        At most :data:`DERIVED_KEEP` names are kept.
        """
        with self._lock:
            hit = self._derived.get(name)
        if hit is not None and hit[0] is doc:
            return hit[1]
        value = compute()
        with self._lock:
            self._derived.pop(name, None)
            self._derived[name] = (doc, value)
            while len(self._derived) > DERIVED_KEEP:
                self._derived.pop(next(iter(self._derived)))
        return value

    def _last(self, path: Path) -> dict[str, Any] | None:
        with self._lock:
            hit = self._docs.get(path)
        return None if hit is None else hit[1]


def _series(rows: Iterable[Mapping[str, Any]], key: str, x: str = "round") -> list[list[float]]:
    pts = []
    for row in rows:
        xv, yv = _finite(row.get(x)), _finite(row.get(key))
        if xv is not None and yv is not None:
            pts.append([xv, yv])
    return pts


def _panels(rows: Sequence[Mapping[str, Any]], spec: tuple[tuple[str, tuple[str, ...]], ...]) -> list[dict[str, Any]]:
    panels = []
    for title, keys in spec:
        series = [{"name": k, "points": pts} for k in keys if (pts := _series(rows, k))]
        if series:
            panels.append({"title": title, "series": series})
    return panels


def _matrix_edges(matrix: Any) -> list[list[float]] | None:
    """Undirected weighted edges ``[i, j, w]`` (``i < j``, ``w != 0``) of a square matrix, or ``None``.

    ``w`` is the mean of ``m_ij`` and ``m_ji``; an entry that is not a finite number counts as 0.
    """
    if not isinstance(matrix, list) or not matrix or not all(isinstance(r, list) and len(r) == len(matrix)
                                                               for r in matrix):
        return None
    n = len(matrix)
    try:
        m = np.array(matrix, dtype=np.float64)
    except (TypeError, ValueError):  # entries that are not numbers: read one by one
        m = np.array([[_finite(v) or 0.0 for v in r] for r in matrix], dtype=np.float64)
    m[~np.isfinite(m)] = 0.0
    iu, ju = np.triu_indices(n, 1)
    w = (m[iu, ju] + m[ju, iu]) / 2
    nz = np.flatnonzero(w)
    return [[int(iu[k]), int(ju[k]), float(w[k])] for k in nz]


def _age(path: Path, now: float) -> float | None:
    try:
        return max(0.0, now - path.stat().st_mtime)
    except OSError:
        return None


def classify(folder: Path) -> str:
    """``run``, ``p2p``, ``bench``, ``unknown`` or ``missing`` (see the module docstring)."""
    if not folder.is_dir():
        return "missing"
    if (folder / "run.json").exists() or (folder / "progress.jsonl").exists():
        return "run"
    if (folder / "p2p.json").exists() or (folder / "network.toml").exists():
        return "p2p"
    try:
        names = os.listdir(folder)
    except OSError:
        return "unknown"
    if any(_PEER_FILE.match(n) for n in names):
        return "p2p"
    if _bench_files(folder, names):
        return "bench"
    return "unknown"


def _bench_files(folder: Path, names: Iterable[str]) -> list[Path]:
    out = []
    for name in sorted(names):
        if not name.endswith(".json") or name in ("run.json", "p2p.json", "config.json") or _PEER_FILE.match(name):
            continue
        path = folder / name
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            doc = read_json(path)
        except (OSError, ReadError):
            continue
        if bench_results.is_result(doc):
            out.append(path)
    return out


def _other_json(folder: Path) -> list[str]:
    """Names of the ``*.json`` in ``folder`` (at most 5) that are not graphfl results."""
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    except OSError:
        return []
    return names[:5]


def snapshot(folder: Path, cache: SnapshotCache | None = None) -> dict[str, Any]:
    """The dashboard's view of one folder; never raises (an unexpected error becomes a message)."""
    cache = cache if cache is not None else SnapshotCache()
    base: dict[str, Any] = {"path": str(folder), "title": folder.name or str(folder), "kind": "unknown",
                            "status": None, "error": None, "messages": [], "panels": [], "table": None,
                            "graph": None, "bench": None, "last_round": None, "rounds": None,
                            "read_at": time.time()}
    try:
        kind = classify(folder)
        base["kind"] = kind
        if kind == "missing":
            base["messages"].append(f"{folder}: no such folder (yet): waiting for it to appear")
        elif kind == "unknown":
            base["messages"].append(
                f"{folder} is not a graphfl output folder: it has no run.json, progress.jsonl, p2p.json, "
                "network.toml, peer-<id>.json or benchmark JSON")
            others = _other_json(folder)
            if others:
                base["messages"].append(
                    f"{', '.join(others)}: not a graphfl benchmark result (a result has a name and the "
                    "method results of bench/report.py: results, methods, cells, table or rows)")
        elif kind == "run":
            _run_snapshot(folder, cache, base)
        elif kind == "p2p":
            _p2p_snapshot(folder, cache, base)
        else:
            _bench_snapshot(folder, cache, base)
    except Exception as exc:  # the page must show any folder, whatever it holds
        logger.exception("dashboard: reading %s failed", folder)
        base["messages"].append(f"{folder}: could not be read: {type(exc).__name__}: {exc}")
    return base


# -- graphfl run ---------------------------------------------------------------------------------

def _run_snapshot(folder: Path, cache: SnapshotCache, out: dict[str, Any]) -> None:
    msgs: list[str] = out["messages"]
    doc = cache.json(folder / "run.json", msgs) if (folder / "run.json").exists() else None
    events: list[dict[str, Any]] = []
    if (folder / "progress.jsonl").exists():
        try:
            events, note = read_jsonl(folder / "progress.jsonl")
            if note:
                msgs.append(note)
        except ReadError as exc:
            msgs.append(str(exc))
    if doc is None:
        out["status"] = "starting" if not events else "running"
        rows = [e for e in events if e.get("event") in ("round", "done")]
        out["panels"] = _panels(rows, RUN_PANELS)
        if rows:
            out["last_round"] = rows[-1].get("round")
            out["rounds"] = rows[-1].get("rounds")
        if not (folder / "run.json").exists():
            msgs.append("run.json not written yet: showing progress.jsonl" if rows else "run.json not written yet")
    else:
        _run_document(doc, out, cache)
    errors = [e.get("error") for e in events if e.get("event") == "error" and e.get("error")]
    if errors and not out["error"]:
        out["error"] = str(errors[-1])
        out["status"] = out["status"] if out["status"] in ("failed", "diverged") else "failed"


def _run_document(doc: Mapping[str, Any], out: dict[str, Any], cache: SnapshotCache | None = None) -> None:
    cfg = _dict(doc.get("config"))
    out["status"] = str(doc.get("status", "unknown"))
    if doc.get("error"):
        out["error"] = str(doc["error"])
    methods = _dict(doc.get("methods"))
    method, body = next(iter(methods.items()), ("", {}))
    curve = [r for r in (body.get("curve") or []) if isinstance(r, dict)] if isinstance(body, dict) else []
    out["title"] = f"{method or cfg.get('strategy', 'run')} on {cfg.get('task', '?')} ({cfg.get('engine', '?')})"
    out["rounds"] = cfg.get("rounds")
    trained = [r for r in curve if "seconds" in r and _finite(r.get("round")) and r.get("round", 0) > 0]
    out["last_round"] = max((int(r["round"]) for r in trained), default=0)
    flat = [{**r, **{f"server.{k}": v for k, v in _dict(r.get("server")).items()}} for r in curve]
    out["panels"] = _panels(flat, RUN_PANELS)
    env = _dict(doc.get("env"))
    out["facts"] = {k: v for k, v in (("strategy", method), ("task", cfg.get("task")), ("engine", cfg.get("engine")),
                                      ("nodes", cfg.get("nodes")), ("device", env.get("device")),
                                      ("config hash", doc.get("config_hash"))) if v not in (None, "")}
    out["table"] = _client_table(curve, env)
    if out["error"] and out["status"] != "completed":
        _mark_named_clients(out["table"], out["error"])
    out["graph"] = (cache or SnapshotCache()).derived(doc, f"graph {out['path']}",
                                                           lambda: _run_graph(curve, cfg))


def _client_table(curve: Sequence[Mapping[str, Any]], env: Mapping[str, Any]) -> dict[str, Any]:
    clients: dict[str, dict[str, Any]] = {}

    def client(pid: str) -> dict[str, Any]:
        return clients.setdefault(pid, {"failures": 0, "last_round": None, "error": None,
                                        "restored": None, "test_loss": None, "test_acc": None})

    for row in curve:
        r = row.get("round")
        for key in ("test_loss", "test_acc"):
            per = row.get(f"{key}_per_client")
            if isinstance(per, dict):
                for pid, v in per.items():
                    c = client(str(pid))
                    c[key] = _finite(v)
                    c["last_round"] = r
        failed = _dict(row.get("failed"))
        for pid, why in failed.items():
            c = client(str(pid))
            c["failures"] += 1
            c["error"] = f"round {r}: {why}"
        restored = _dict(row.get("state_restored"))
        for pid, rr in restored.items():
            client(str(pid))["restored"] = f"round {rr}"
    evaluated_rounds = {str(p): 0 for p in clients}
    for row in curve:
        per = row.get("test_loss_per_client")
        if isinstance(per, dict) and isinstance(row.get("round"), int) and row["round"] > 0:
            for pid in per:
                evaluated_rounds[str(pid)] = evaluated_rounds.get(str(pid), 0) + 1
    device = env.get("device") or ""
    rows = []
    for pid in sorted(clients, key=lambda p: (len(p), p)):
        c = clients[pid]
        last_failed = c["error"] is not None and c["last_round"] is not None and c["error"].startswith(
            f"round {c['last_round']}:")
        status = "failed" if (c["error"] and (c["last_round"] is None or last_failed)) else "ok"
        rows.append({"id": pid, "status": status, "last_round": c["last_round"],
                     "rounds": evaluated_rounds.get(pid, 0), "failures": c["failures"], "device": device,
                     "test_loss": c["test_loss"], "test_acc": c["test_acc"], "restored": c["restored"],
                     "error": c["error"]})
    return {"kind": "client", "columns": ["id", "status", "last_round", "rounds", "failures", "device",
                                          "test_loss", "test_acc", "restored", "error"], "rows": rows}


_CLIENT_ERROR = re.compile(r"client (\d+): ([^;()]+)")


def _mark_named_clients(table: dict[str, Any], error: str) -> None:
    """Mark the clients a run's error names (``client <id>: <why>``, the round loop's wording for
    the replies it refused) failed, with that text.
    """
    rows = {r["id"]: r for r in table["rows"]}
    for pid, why in _CLIENT_ERROR.findall(error):
        row = rows.get(pid)
        if row is not None:
            row["status"] = "failed"
            row["error"] = row["error"] or why.strip()


def _run_graph(curve: Sequence[Mapping[str, Any]], cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """The learned graph over rounds and FeSEM's cluster ``assignment`` (newest round) as node groups.

    A round's learned graph is its ``server.graph`` (JGESR, pFedGraph), a square ``server.W`` or
    ``server.phi``, or BiG-FL's ``server.phi_edges`` (the strongest off-diagonal entries of ``φ``).
    ``rounds`` holds at most :data:`MAX_GRAPH_ROUNDS` of the rounds that logged one (evenly spaced,
    the first and the newest always kept), each with at most :data:`MAX_GRAPH_EDGES` edges (the
    largest ``|w|``); ``cap`` says what was left out. The top-level ``edges`` are the newest round's.
    """
    logged = [row for row in curve if _graph_key(_dict(row.get("server"))) is not None]
    groups, g_round = None, None
    for row in curve:
        server = _dict(row.get("server"))
        if isinstance(server.get("assignment"), list):
            groups, g_round = server["assignment"], row.get("round")
    rounds = [g for g in (_round_graph(row) for row in _subsample(logged, MAX_GRAPH_ROUNDS)) if g is not None]
    if not rounds and groups is None:
        return None
    count = len(groups) if groups is not None else 0
    for g in rounds:
        if "nodes" not in g:
            count = max(count, int(g["n"]))
    nodes = [{"id": i, "group": groups[i] if groups is not None and i < len(groups) else None}
             for i in range(count)]
    if not rounds:
        return {"title": f"clusters after round {g_round}", "nodes": nodes, "edges": [], "directed": False}
    newest = rounds[-1]
    notes = []
    if len(logged) > len(rounds):
        notes.append(f"{len(rounds)} of the {len(logged)} rounds that logged a graph are shown (evenly spaced, "
                     f"the first and the newest kept; at most {MAX_GRAPH_ROUNDS})")
    if any(g["total_edges"] > len(g["edges"]) for g in rounds):
        notes.append(f"at most the {MAX_GRAPH_EDGES} strongest edges (largest |w|) of each round are drawn")
    graph: dict[str, Any] = {"title": newest["title"], "nodes": newest.get("nodes"), "edges": newest["edges"],
                             "directed": False, "rounds": rounds, "rounds_logged": len(logged),
                             "cap": "; ".join(notes)}
    if "edge_note" in newest:
        graph["edge_note"] = newest["edge_note"]
    for g in rounds:
        g.pop("n", None)
        g.setdefault("nodes", None)  # None: the top-level nodes (the clients, with FeSEM's groups)
    if newest["nodes"] is None:
        graph["nodes"] = nodes
    return graph


MAX_GRAPH_ROUNDS = 40
"""Rounds of a learned graph sent to the page (evenly spaced over those that logged one)."""
MAX_GRAPH_EDGES = 200
"""Edges per round sent to the page: the strongest (largest ``|w|``)."""
_MATRIX_KEYS = ("graph", "W", "phi")


def _graph_key(server: Mapping[str, Any]) -> str | None:
    for key in _MATRIX_KEYS:
        m = server.get(key)
        if isinstance(m, list) and m and isinstance(m[0], list) and len(m[0]) == len(m):
            return key
    if isinstance(server.get("phi_edges"), list):
        return "phi_edges"
    return None


def _subsample(rows: Sequence[Any], cap: int) -> list[Any]:
    """At most ``cap`` of ``rows``, evenly spaced, the first and the last always kept."""
    if len(rows) <= cap:
        return list(rows)
    idx = sorted({round(k * (len(rows) - 1) / (cap - 1)) for k in range(cap)})
    return [rows[i] for i in idx]


def _round_graph(row: Mapping[str, Any]) -> dict[str, Any] | None:
    """One round's learned graph for the page: ``round``, ``title``, ``edges`` (capped),
    ``total_edges``, and for BiG-FL's ``φ`` its own ``nodes`` (parameter indices) and ``edge_note``.
    """
    server = _dict(row.get("server"))
    key = _graph_key(server)
    r = row.get("round")
    if key == "phi_edges":
        return _phi_graph(server, r)
    if key is None:
        return None
    edges = _matrix_edges(server[key])
    if edges is None:
        return None
    total = len(edges)
    what = "BiG-FL φ (nodes are parameter indices)" if key == "phi" else "learned client graph"
    dist = _finite(server.get("phi_minus_identity"))
    tail = f", ‖φ − I‖_F = {_fmt(dist)}" if key == "phi" and dist is not None else ""
    return {"round": r, "title": f"{what} after round {r}{tail}", "edges": _strongest(edges, MAX_GRAPH_EDGES),
            "total_edges": total, "n": len(server[key])}


def _strongest(edges: list[list[float]], cap: int) -> list[list[float]]:
    if len(edges) <= cap:
        return edges
    keep = sorted(range(len(edges)), key=lambda k: -abs(edges[k][2]))[:cap]
    return [edges[k] for k in sorted(keep)]


def _phi_graph(server: Mapping[str, Any], r: Any) -> dict[str, Any] | None:
    """BiG-FL's logged ``phi_edges`` (``[i, j, φ_ij]``, directed) as an undirected graph over the
    parameter indices they touch: an edge's weight is the larger-``|.|`` of ``φ_ij`` and ``φ_ji``,
    its note both entries.
    """
    pairs: dict[tuple[int, int], dict[tuple[int, int], float]] = {}
    for e in server["phi_edges"]:
        if not (isinstance(e, list) and len(e) == 3):
            continue
        i, j, v = _finite(e[0]), _finite(e[1]), _finite(e[2])
        if i is None or j is None or v is None or i == j:
            continue
        a, b = int(i), int(j)
        pairs.setdefault((min(a, b), max(a, b)), {})[(a, b)] = v
    edges, notes = [], []
    for (a, b), entries in sorted(pairs.items()):
        w = max(entries.values(), key=abs)
        edges.append([a, b, w])
        notes.append("; ".join(f"φ[{i},{j}] = {_fmt(v)}" for (i, j), v in sorted(entries.items())))
    if len(edges) > MAX_GRAPH_EDGES:
        keep = set(map(tuple, (e[:2] for e in _strongest(edges, MAX_GRAPH_EDGES))))
        notes = [n for e, n in zip(edges, notes, strict=True) if (e[0], e[1]) in keep]
        edges = [e for e in edges if (e[0], e[1]) in keep]
    d = _finite(server.get("phi_dim"))
    dist = _finite(server.get("phi_minus_identity"))
    of = f" of {int(d) * (int(d) - 1)}" if d is not None else ""
    title = (f"BiG-FL φ after round {r}: the {len(server['phi_edges'])} strongest{of} off-diagonal entries "
             f"(nodes are parameter indices)" + (f", ‖φ − I‖_F = {_fmt(dist)}" if dist is not None else ""))
    ids = sorted({e[0] for e in edges} | {e[1] for e in edges})
    return {"round": r, "title": title, "edges": edges, "edge_note": notes, "total_edges": len(edges),
            "nodes": [{"id": i, "group": None} for i in ids]}


# -- graphfl p2p -----------------------------------------------------------------------------------

def _p2p_snapshot(folder: Path, cache: SnapshotCache, out: dict[str, Any]) -> None:
    msgs: list[str] = out["messages"]
    now = time.time()
    network: dict[str, Any] = {}
    if (folder / "network.toml").exists():
        try:
            network = read_toml(folder / "network.toml")
        except ReadError as exc:
            msgs.append(str(exc))
    summary = cache.json(folder / "p2p.json", msgs) if (folder / "p2p.json").exists() else None
    run = _dict(network.get("run"))
    net = _dict(network.get("network"))
    out["rounds"] = run.get("rounds")
    out["title"] = f"p2p {run.get('algorithm', '')} on {net.get('name', folder.name)}".replace("  ", " ")
    peers_cfg = {int(p["id"]): p for p in network.get("peers", []) if isinstance(p, dict) and "id" in p}
    ids: set[int] = set(peers_cfg)
    try:
        for name in os.listdir(folder):
            m = _PEER_FILE.match(name)
            if m:
                ids.add(int(m.group(1)))
    except OSError as exc:
        msgs.append(f"{folder}: {exc.strerror or exc}")
    peer_rows: dict[int, list[dict[str, Any]]] = {}
    links: dict[int, dict[str, Any]] = {}
    table = []
    final_peers = _dict(summary.get("peers")) if summary else {}
    for pid in sorted(ids):
        recs: list[dict[str, Any]] = []
        rounds_file = folder / f"peer-{pid}.rounds.jsonl"
        if rounds_file.exists():
            try:
                recs, note = read_jsonl(rounds_file)
                if note:
                    msgs.append(note)
            except ReadError as exc:
                msgs.append(str(exc))
        peer_doc = cache.json(folder / f"peer-{pid}.json", msgs) if (folder / f"peer-{pid}.json").exists() else None
        if peer_doc and not recs and isinstance(peer_doc.get("records"), list):
            recs = [r for r in peer_doc["records"] if isinstance(r, dict)]
        peer_rows[pid] = recs
        status = cache.json(folder / f"peer-{pid}.status.json", msgs) \
            if (folder / f"peer-{pid}.status.json").exists() else None
        link = _dict((peer_doc or {}).get("links")) or _dict((status or {}).get("links"))
        if link:
            links[pid] = link
        fin = _dict(final_peers.get(str(pid)))
        state = (fin.get("outcome") or (peer_doc or {}).get("outcome") or (status or {}).get("state")
                 or ("running" if recs else "starting"))
        error = fin.get("error") or (peer_doc or {}).get("error") or (status or {}).get("error")
        last = recs[-1] if recs else {}
        ages = [a for a in (_age(folder / f"peer-{pid}.status.json", now), _age(rounds_file, now)) if a is not None]
        skips = sum(1 for r in recs if r.get("missing") or r.get("skips"))
        table.append({
            "id": str(pid), "status": "failed" if error or state in ("failed", "error", "crashed") else str(state),
            "last_round": last.get("round", (status or {}).get("round")),
            "last_seen_s": min(ages) if ages else None,
            "rounds": len(recs), "failures": skips,
            "device": (peer_doc or {}).get("device") or peers_cfg.get(pid, {}).get("device", ""),
            "bytes_sent": sum(int(r.get("bytes_sent", 0) or 0) for r in recs),
            "bytes_received": sum(int(r.get("bytes_received", 0) or 0) for r in recs),
            "test_loss": _finite(last.get("test_loss")),
            "error": str(error) if error else None,
        })
    out["table"] = {"kind": "peer", "columns": ["id", "status", "last_round", "last_seen_s", "rounds", "failures",
                                                "device", "bytes_sent", "bytes_received", "test_loss", "error"],
                    "rows": table}
    # curves: the summary's mean curve when the network is done, else the mean over the peers' records
    curve: list[dict[str, Any]] = []
    if summary and isinstance(summary.get("methods"), dict) and summary["methods"]:
        body = next(iter(summary["methods"].values()))
        curve = [r for r in body.get("curve", []) if isinstance(r, dict)] if isinstance(body, dict) else []
    if not curve:
        curve = _mean_by_round(peer_rows)
    out["panels"] = _panels(curve, P2P_PANELS)
    out["last_round"] = max((int(r["round"]) for r in curve if _finite(r.get("round")) is not None), default=0)
    if summary is not None:
        out["status"] = "completed" if summary.get("ok") else "failed"
        if not summary.get("ok") and not out["error"]:
            errs = [f"peer {r['id']}: {r['error']}" for r in table if r["error"]]
            out["error"] = "; ".join(errs) or str(summary.get("error") or "the network did not finish")
    else:
        out["status"] = "failed" if any(r["status"] == "failed" for r in table) else "running"
        if out["status"] == "failed":
            out["error"] = "; ".join(f"peer {r['id']}: {r['error']}" for r in table if r["error"])
    out["facts"] = {k: v for k, v in (("algorithm", run.get("algorithm")), ("network", net.get("name")),
                                      ("peers", len(ids)), ("mixing", net.get("mixing"))) if v not in (None, "")}
    out["graph"] = _p2p_graph(network, summary, ids)
    if out["graph"] is not None and links:
        _edge_bytes(out["graph"], links)


def _mean_by_round(peer_rows: Mapping[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The network's curve from the peers' round records, by the rules of ``p2p.json``'s curve:
    losses, disagreement, comm / compute seconds are means over the peers that ran the round,
    ``bytes_up`` / ``bytes_down`` sums of their bytes sent / received, ``seconds`` (a peer's
    time since its start) the slowest peer's.
    """
    by_round: dict[int, dict[str, list[float]]] = {}
    for recs in peer_rows.values():
        for rec in recs:
            r = rec.get("round")
            if not isinstance(r, int):
                continue
            acc = by_round.setdefault(r, {})
            for key in ("test_loss", "train_loss", "local_disagreement", "seconds", "comm_s", "compute_s",
                        "bytes_sent", "bytes_received"):
                v = _finite(rec.get(key))
                if v is not None:
                    acc.setdefault(key, []).append(v)
    rows = []
    for r in sorted(by_round):
        row: dict[str, Any] = {"round": r}
        for key, vals in by_round[r].items():
            if key in ("bytes_sent", "bytes_received"):
                row["bytes_up" if key == "bytes_sent" else "bytes_down"] = sum(vals)
            elif key == "seconds":
                row[key] = max(vals)
            else:
                row[key] = sum(vals) / len(vals)
        rows.append(row)
    return rows


def _p2p_graph(network: Mapping[str, Any], summary: Mapping[str, Any] | None, ids: set[int]) -> dict[str, Any] | None:
    edges: list[list[float]] = []
    for e in network.get("edges", []) if isinstance(network.get("edges"), list) else []:
        nodes = e.get("nodes") if isinstance(e, dict) else None
        if isinstance(nodes, list) and len(nodes) == 2:
            edges.append([int(nodes[0]), int(nodes[1]), float(e.get("weight", 1.0))])
    if not edges and summary and isinstance(summary.get("config"), dict):
        for e in summary["config"].get("edges", []) or []:
            if isinstance(e, list) and len(e) >= 2:
                edges.append([int(e[0]), int(e[1]), float(e[2]) if len(e) > 2 else 1.0])
    if not edges and not ids:
        return None
    nodes = sorted(ids | {int(e[0]) for e in edges} | {int(e[1]) for e in edges})
    graph: dict[str, Any] = {"title": "p2p topology (edge weight)", "nodes": [{"id": i, "group": None} for i in nodes],
                             "edges": edges, "directed": False}
    selection = _dict(summary.get("edge_selection")) if summary else {}
    if selection:
        _edge_states(graph, selection)
    return graph


def _link_bytes(links: Mapping[int, Mapping[str, Any]], a: int, b: int) -> int | None:
    """Bytes ``a`` sent to ``b``: ``a``'s own count, else what ``b`` counted as received from ``a``."""
    sent = _finite(_dict(_dict(links.get(a)).get(str(b))).get("bytes_sent"))
    if sent is None:
        sent = _finite(_dict(_dict(links.get(b)).get(str(a))).get("bytes_received"))
    return None if sent is None else int(sent)


def _edge_bytes(graph: dict[str, Any], links: Mapping[int, Mapping[str, Any]]) -> None:
    """``edge_bytes``: ``[bytes i → j, bytes j → i]`` per edge ``[i, j, w]`` from the peers'
    ``links`` (``peer-<id>.json``, else their status file while they run). A direction no peer
    of the link reported is ``None`` (not 0 bytes), and so is an edge with neither direction.
    """
    out: list[list[int | None] | None] = []
    for e in graph["edges"]:
        a, b = int(e[0]), int(e[1])
        ab, ba = _link_bytes(links, a, b), _link_bytes(links, b, a)
        out.append(None if ab is None and ba is None else [ab, ba])
    graph["edge_bytes"] = out
    if any(x is not None for x in out):
        graph["title"] = graph["title"].replace("p2p topology (edge weight)",
                                                "p2p topology (width: edge weight; label and colour: bytes sent both ways)")


def _edge_states(graph: dict[str, Any], selection: Mapping[str, Any]) -> None:
    """``edge_state`` (``kept``, ``dropped`` or ``unknown`` per edge) and ``edge_note`` (the edge's
    test statistics) from ``p2p.json``'s ``edge_selection`` (decentralized ADMM's edge tests).
    """
    state: dict[tuple[int, int], str] = {}
    for name in ("kept", "dropped", "unknown"):
        for e in selection.get(name) or []:
            if isinstance(e, list) and len(e) == 2:
                state[(min(int(e[0]), int(e[1])), max(int(e[0]), int(e[1])))] = name
    notes: dict[tuple[int, int], str] = {}
    for t in selection.get("tests") or []:
        e = t.get("edge") if isinstance(t, dict) else None
        if isinstance(e, list) and len(e) == 2:
            stats = ", ".join(f"{k} {_fmt(v)}" for k, v in t.items() if k not in ("edge", "kept", "decided_by")
                              and _finite(v) is not None)
            notes[(min(int(e[0]), int(e[1])), max(int(e[0]), int(e[1])))] = stats
    keys = [(min(int(e[0]), int(e[1])), max(int(e[0]), int(e[1]))) for e in graph["edges"]]
    graph["edge_state"] = [state.get(k, "unknown") for k in keys]
    graph["edge_note"] = [notes.get(k, "") for k in keys]
    kept = sum(1 for s in graph["edge_state"] if s == "kept")
    graph["title"] = f"p2p topology, edge tests: {kept} kept, {len(keys) - kept} dropped or unknown (dashed)"


# -- benchmark results -----------------------------------------------------------------------------

def _bench_snapshot(folder: Path, cache: SnapshotCache, out: dict[str, Any]) -> None:
    msgs: list[str] = out["messages"]
    docs = []
    try:
        names = os.listdir(folder)
    except OSError as exc:
        msgs.append(f"{folder}: {exc.strerror or exc}")
        return
    for path in _bench_files(folder, names):
        doc = cache.json(path, msgs)
        if doc is not None:
            docs.append(cache.derived(doc, f"bench {path}", functools.partial(bench_results.view, path.name, doc)))
    out["bench"] = docs
    out["status"] = "results"
    out["title"] = ", ".join(d["name"] for d in docs) or folder.name


def _fmt(value: Any) -> str:
    v = _finite(value)
    if v is None:
        return "" if value is None else str(value)
    return f"{v:.4g}"
