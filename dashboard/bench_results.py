"""Benchmark result documents for the dashboard: one comparison view (methods with ``mean ± sd``
and their seeds, paired differences, verdicts) from any layout graphfl's benches write.

A document is a graphfl result when it has a ``name`` (or ``bench``) and one of these method
layouts, tried in this order:

* ``results`` as a list of ``{point, method, seeds, failed, metrics: {m: {mean, sd, per_seed, n}}}``
  (``bench/report.py``'s ``build_doc``, written by every ``bench/harness.py`` bench), with its
  ``paired`` list ``{point, a, b, metrics: {m: {mean, sd, first_better, seeds}}}``;
* ``results`` as a mapping of settings, each holding ``methods`` or method entries directly,
  and ``paired`` as ``{<a>_minus_<b>: stat}`` (``bench/multicenter.py``);
* ``cells`` as a list of ``{cell, results: {method: entry}, <a>_minus_<b>: {m: stat}}``
  (``bench/dfl_regime.py``'s per-entry rows; its results also have the harness layout, read first);
* ``methods`` as a mapping of method entries (the benches written before the harness), unless
  none of them has a number and the document has ``rows``;
* ``table`` as a mapping of method -> ``{column: stat}`` (``bench/jgesr.py``);
* ``rows`` as a list of flat records (engine and faults results written before those benches ran on the harness).

A method entry's numbers come from ``metrics`` (stat objects), else ``final`` (a key ``k`` beside
``k_sd``), else the entry itself. A stat object is a mapping with a finite ``mean`` (and ``sd``,
``n``, ``per_seed`` or ``runs``). Verdicts come from ``verdicts`` / ``claims`` (a mapping of
``{claim, verdict, evidence}``, the status being ``reproduced``, ``not reproduced`` or
``not testable``) and from ``verdict`` / ``summary`` text.

The view is bounded (:data:`MAX_ROWS`, :data:`MAX_PAIRED`, :data:`MAX_COLUMNS`,
:data:`MAX_VERDICTS`); ``caps`` says what a bound left out.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

MAX_ROWS = 120
"""Method rows kept per document (the first ones, in the document's order)."""
MAX_PAIRED = 60
"""Paired-difference rows kept per document."""
MAX_COLUMNS = 12
"""Metric columns kept per table (the first ones met)."""
MAX_VERDICTS = 50
"""Verdict / summary lines kept per document."""
MAX_EVIDENCE = 3
"""Evidence lines kept per verdict."""

STATUSES = ("reproduced", "not reproduced", "not testable")
"""The verdict statuses graphfl's benches write; any other status is shown as it is."""

_MINUS = re.compile(r"^(.+)_minus_(.+)$")
_METHOD_KEYS = ("method", "engine", "strategy", "name")
_NOT_METHODS = ("paired", "earlier", "previous")
"""Keys of a setting that hold differences or an earlier run's numbers, not this run's methods."""


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _dict(value: Any) -> dict[str, Any]:
    """``value`` when it is a JSON object, else an empty one (a file's shape is never trusted)."""
    return value if isinstance(value, dict) else {}


def fmt(value: Any) -> str:
    """A number with 4 significant digits, ``""`` for ``None``, anything else as text."""
    v = _finite(value)
    if v is None:
        return "" if value is None else str(value)
    return f"{v:.4g}"


def short(value: Any, limit: int = 300) -> str:
    """``value`` as text of at most ``limit`` characters (an ellipsis marks a cut)."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _stat(value: Any) -> dict[str, Any] | None:
    """``{mean, sd, n}`` of a stat object (a mapping with a finite ``mean``), else ``None``."""
    if not isinstance(value, dict) or _finite(value.get("mean")) is None:
        return None
    n = _finite(value.get("n"))
    if n is None:
        runs = value.get("per_seed", value.get("runs"))
        n = len(runs) if isinstance(runs, list) else None
    return {"mean": value["mean"], "sd": _finite(value.get("sd")), "n": None if n is None else int(n)}


def _cell(mean: Any, sd: Any) -> str:
    return fmt(mean) + (f" ± {fmt(sd)}" if _finite(sd) is not None else "")


def _label(point: Any) -> str:
    """``k=v, …`` of a grid point (a mapping), its text otherwise."""
    if isinstance(point, dict):
        return ", ".join(f"{k}={short(v, 40) if not isinstance(v, str) else v}" for k, v in point.items())
    return "" if point is None else short(point, 80)


def _entry(body: Mapping[str, Any]) -> tuple[dict[str, str], int | None]:
    """Cells (``mean ± sd`` per metric) and number of seeds of one method entry."""
    cells: dict[str, str] = {}
    seeds: int | None = None
    metrics = _dict(body.get("metrics"))
    source = metrics or _dict(body.get("final")) or body
    for key, value in source.items():
        st = _stat(value)
        if st is not None:
            cells[str(key)] = _cell(st["mean"], st["sd"])
            seeds = seeds if seeds is not None else st["n"]
        elif not str(key).endswith("_sd") and _finite(value) is not None:
            cells[str(key)] = _cell(value, source.get(f"{key}_sd"))
    listed = body.get("seeds")
    if isinstance(listed, list):
        seeds = len(listed)
    elif isinstance(listed, int) and not isinstance(listed, bool):
        seeds = listed
    if seeds is None:
        for holder in (body, source):
            per_seed = next((v for k, v in holder.items() if str(k).endswith("per_seed") and isinstance(v, list)),
                            None)
            if per_seed is not None:
                seeds = len(per_seed)
                break
    return cells, seeds


def _row(point: str, method: str, body: Mapping[str, Any]) -> dict[str, Any]:
    cells, seeds = _entry(body)
    failed = _finite(body.get("failed"))
    failures = body.get("failures")
    row: dict[str, Any] = {"point": point, "method": method, "seeds": seeds, "cells": cells,
                           "failed": int(failed) if failed else 0, "error": None}
    if row["failed"] or body.get("skipped"):
        text = failures if failures else body.get("skipped")
        row["error"] = short(text, 200)
    return row


def _method_map(value: Any) -> dict[str, dict[str, Any]]:
    """The method entries of a mapping: values that hold ``metrics``, ``final`` or stat objects."""
    out = {}
    for name, body in _dict(value).items():
        if isinstance(body, dict) and ("metrics" in body or "final" in body
                                       or any(_stat(v) is not None for v in body.values())):
            out[str(name)] = body
    return out


def _paired_row(point: str, a: str, b: str, metrics: Mapping[str, Any], note: str = "") -> dict[str, Any] | None:
    cells = {}
    for key, value in metrics.items():
        st = _stat(value)
        if st is None:
            continue
        text = _cell(st["mean"], st["sd"])
        better, seeds = _finite(value.get("first_better")), _finite(value.get("seeds", value.get("n")))
        if better is not None and seeds is not None:
            text += f" ({a} better on {int(better)}/{int(seeds)})"
        cells[str(key)] = text
    return {"point": point, "pair": f"{a} − {b}", "cells": cells, "note": note} if cells else None


def _rows_and_pairs(doc: Mapping[str, Any]) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]] | None:
    """``(layout, method rows, paired rows)`` of a result document, ``None`` when it has no method
    layout (see the module docstring for the order).
    """
    results = doc.get("results")
    if isinstance(results, list) and any(isinstance(r, dict) and "method" in r for r in results):
        rows = [_row(_label(r.get("point")), str(r["method"]), r) for r in results
                if isinstance(r, dict) and "method" in r]
        pairs = [p for p in (_paired_row(_label(q.get("point")), str(q.get("a")), str(q.get("b")),
                                         _dict(q.get("metrics")))
                             for q in doc.get("paired") or [] if isinstance(q, dict)) if p is not None]
        return "harness", rows, pairs
    if isinstance(results, dict):
        rows, pairs = [], []
        for setting, body in results.items():
            body = _dict(body)
            methods = _method_map(body.get("methods")) or _method_map(
                {k: v for k, v in body.items() if k not in _NOT_METHODS})
            point = str(setting) + (f" ({body['graph']} graph)" if isinstance(body.get("graph"), str) else "")
            rows.extend(_row(point, m, e) for m, e in methods.items())
            for key, value in _dict(body.get("paired")).items():
                match = _MINUS.match(str(key))
                p = _paired_row(point, match.group(1), match.group(2), {"difference": value}) if match else None
                if p is not None:
                    pairs.append(p)
        if rows:
            return "settings", rows, pairs
    cells = doc.get("cells")
    if isinstance(cells, list) and any(isinstance(c, dict) and isinstance(c.get("results"), dict) for c in cells):
        rows, pairs = [], []
        for c in cells:
            if not isinstance(c, dict):
                continue
            point = _label(c.get("cell"))
            rows.extend(_row(point, m, e) for m, e in _method_map(c.get("results")).items())
            note = "; ".join(f"{k}: {v}" for k, v in c.items() if k.startswith("verdict") and isinstance(v, str))
            for key, value in c.items():
                match = _MINUS.match(str(key))
                if match and isinstance(value, dict):
                    p = _paired_row(point, match.group(1), match.group(2), value, note)
                    if p is not None:
                        pairs.append(p)
        return "cells", rows, pairs
    if isinstance(doc.get("methods"), dict):
        rows = [_row("", str(m), e) for m, e in doc["methods"].items() if isinstance(e, dict)]
        if rows and (any(r["cells"] for r in rows) or not isinstance(doc.get("rows"), list)):
            return "methods", rows, []
    table = doc.get("table")
    if isinstance(table, dict):
        return "table", [_row("", str(m), e) for m, e in table.items() if isinstance(e, dict)], []
    records = doc.get("rows")
    if isinstance(records, list) and any(isinstance(r, dict) for r in records):
        rows = []
        for r in records:
            if not isinstance(r, dict):
                continue
            mkey = next((k for k in _METHOD_KEYS if isinstance(r.get(k), str)), None)
            point = ", ".join(f"{label}={short(v, 40)}" for label, v in r.items()
                              if label != mkey and (isinstance(v, str) or isinstance(v, bool)))
            rows.append(_row(short(point, 120), str(r[mkey]) if mkey else "", r))
        return "rows", rows, []
    return None


def is_result(doc: Mapping[str, Any]) -> bool:
    """Whether ``doc`` is a graphfl benchmark result (a name and a method layout)."""
    return ("name" in doc or "bench" in doc) and _rows_and_pairs(doc) is not None


def _verdicts(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for key in ("verdicts", "claims", "verdict", "summary"):
        value = doc.get(key)
        if isinstance(value, dict):
            for name, v in value.items():
                if isinstance(v, dict) and isinstance(v.get("verdict"), str):
                    evidence = v.get("evidence")
                    out.append({"name": str(name), "status": v["verdict"],
                                "text": short(v.get("claim", ""), 300),
                                "evidence": [short(e, 300) for e in (evidence if isinstance(evidence, list)
                                                                     else [evidence] if evidence else [])
                                             ][:MAX_EVIDENCE]})
                else:
                    out.append({"name": str(name), "status": None, "text": short(v), "evidence": []})
        elif isinstance(value, list):
            out.extend({"name": "", "status": None, "text": short(v), "evidence": []} for v in value)
        elif value is not None and key != "summary":
            out.append({"name": "", "status": None, "text": short(value), "evidence": []})
    return out


def _columns(rows: list[dict[str, Any]]) -> tuple[list[str], int]:
    cols: list[str] = []
    for r in rows:
        for c in r["cells"]:
            if c not in cols:
                cols.append(c)
    return cols[:MAX_COLUMNS], len(cols)


def view(file: str, doc: Mapping[str, Any]) -> dict[str, Any]:
    """The comparison view of one result document: ``rows`` (point, method, seeds, failed, error,
    ``mean ± sd`` cells), ``paired`` differences, ``verdicts`` (name, status, claim text,
    evidence), ``methods`` (the number of distinct methods) and ``caps`` (what a bound left out).
    """
    found = _rows_and_pairs(doc)
    layout, rows, pairs = found if found is not None else ("none", [], [])
    caps: list[str] = []
    columns, ncols = _columns(rows)
    pcolumns, npcols = _columns(pairs)
    verdicts = _verdicts(doc)
    if len(rows) > MAX_ROWS:
        caps.append(f"showing the first {MAX_ROWS} of {len(rows)} method rows")
    if ncols > MAX_COLUMNS:
        caps.append(f"showing {MAX_COLUMNS} of {ncols} metrics")
    if len(pairs) > MAX_PAIRED:
        caps.append(f"showing the first {MAX_PAIRED} of {len(pairs)} paired differences")
    if npcols > MAX_COLUMNS:
        caps.append(f"showing {MAX_COLUMNS} of {npcols} paired metrics")
    if len(verdicts) > MAX_VERDICTS:
        caps.append(f"showing the first {MAX_VERDICTS} of {len(verdicts)} verdict lines")
    if caps:
        caps.append(f"the whole result is in {file}")
    keep = set(columns)
    pkeep = set(pcolumns)
    return {"file": file, "name": str(doc.get("name", doc.get("bench", file))), "layout": layout,
            "columns": columns, "methods": len({r["method"] for r in rows}),
            "rows": [{**r, "cells": {k: v for k, v in r["cells"].items() if k in keep}} for r in rows[:MAX_ROWS]],
            "paired": {"columns": pcolumns,
                       "rows": [{**p, "cells": {k: v for k, v in p["cells"].items() if k in pkeep}}
                                for p in pairs[:MAX_PAIRED]]} if pairs else None,
            "verdicts": verdicts[:MAX_VERDICTS], "caps": caps}
