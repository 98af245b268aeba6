"""One result layout for every benchmark on the harness: ``<out>/<name>.json``, ``.md`` and ``.png``.

The JSON holds, in this order: ``name``, ``title``, ``quick``, ``config`` (the benchmark's own
settings plus the grid — its axes and points —, methods, seeds, metrics, reference and tuning
rule), ``results`` (one entry per (point, method): tuned params, the params each seed used,
failed seeds and why, each metric's mean ± sd with its per-seed values, the mean curve),
``paired`` (per point and pair ``a − b``: each metric's per-seed differences, mean ± sd and the
seeds on which ``a`` is better), ``tuning`` (every validation search: scores per value, chosen,
at the grid's edge, extensions), then what the benchmark adds (verdicts, settings the paper does
not give …), ``estimate`` (cells cached / run and the time estimated before the run),
``seconds`` (wall time) and ``env``. ``config.cache`` is the benchmark's cache mode; a result of
the measurement mode (``none``) also carries ``config.measurement``, the sentence saying that every
cell was measured in this run.

The Markdown has the same parts as tables (results, paired, tuning), the benchmark's own
sections, and a run line comparing the wall time with the estimate. The plot draws the panels
the benchmark gives (:func:`curve_panels`, :func:`metric_panels` build the usual ones).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from graphfl.common.envinfo import env_info
from graphfl.common.results import atomic_write_text, markdown_table, plot_panels, write_json

from .harness import Bench, Outcome
from .stats import fmt_pm

__all__ = ["build_doc", "write_report", "render_markdown", "curve_panels", "metric_panels", "result",
           "pair", "format_value"]


MEASUREMENT = ("measurement mode: no run cache; every cell of this result was measured in this run, one after "
               "the other in one process, so the ratios between cells are within one run (one machine load)")
"""What a result of the harness's measurement mode (``Bench(cache="none")``) says about itself."""


def build_doc(bench: Bench, outcome: Outcome, quick: bool, config: Mapping[str, Any],
              extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The result document (layout in the module docstring)."""
    axes = list(dict.fromkeys(k for p in bench.points for k in p))
    grid = {a: list(dict.fromkeys(p.get(a) for p in bench.points if a in p)) for a in axes}
    tn = bench.tuning
    cfg: dict[str, Any] = {**config, "grid": grid, "points": [dict(p) for p in bench.points],
                           "methods": list(bench.methods), "seeds": list(bench.seeds),
                           "metrics": [{"name": m.name, "label": m.title, "lower_is_better": m.lower_is_better,
                                        "format": m.fmt, "scale": m.scale} for m in bench.metrics],
                           "reference": bench.reference, "pairs": [list(p) for p in bench.pair_list()],
                           "cache": bench.cache}
    if bench.cache == "none":
        cfg["measurement"] = MEASUREMENT
    if tn is not None:
        cfg["tuning"] = {"param": tn.param, "metric": tn.metric, "lower_is_better": tn.lower_is_better,
                         "shared_by_methods": tn.shared, "grid_factor": tn.factor,
                         "max_extensions": tn.max_extensions, "seed": tn.seed if tn.seed is not None
                         else bench.seeds[0], "split": "validation",
                         "backoff_halvings": tn.backoff_halvings}
    doc: dict[str, Any] = {"name": bench.name, "title": bench.title, "quick": quick, "config": cfg,
                           "results": outcome.results, "paired": outcome.paired, "tuning": outcome.tuning}
    doc.update(extra or {})
    doc.update({"estimate": outcome.estimate, "seconds": outcome.seconds, "env": env_info()})
    return doc


def result(doc: Mapping[str, Any], method: str, **point: Any) -> dict[str, Any]:
    """The ``results`` entry of ``method`` at ``point`` (``KeyError`` naming both when absent)."""
    for r in doc["results"]:
        if r["method"] == method and all(r["point"].get(k) == v for k, v in point.items()):
            found: dict[str, Any] = r
            return found
    raise KeyError(f"{doc.get('name')}: no result for {method} at {point}")


def pair(doc: Mapping[str, Any], a: str, b: str, **point: Any) -> dict[str, Any]:
    """The ``paired`` entry ``a − b`` at ``point`` (``KeyError`` naming it when absent)."""
    for p in doc["paired"]:
        if p["a"] == a and p["b"] == b and all(p["point"].get(k) == v for k, v in point.items()):
            found: dict[str, Any] = p
            return found
    raise KeyError(f"{doc.get('name')}: no pair {a} − {b} at {point}")


def format_value(value: float | None, fmt: str = "auto") -> str:
    """``fmt`` = a format spec, or ``auto``: ``.3e`` below 1e-3 (not 0), else ``.4f``."""
    if value is None:
        return "–"
    if fmt == "auto":
        fmt = ".3e" if value != 0 and abs(value) < 1e-3 else ".4f"
    return format(value, fmt)


def _stat(stat: Mapping[str, Any] | None, fmt: str, scale: float = 1.0, signed: bool = False) -> str:
    if not stat or stat.get("mean") is None:
        return "–"
    if fmt == "auto":
        m = abs(stat["mean"] * scale)
        fmt = ".3e" if m != 0 and m < 1e-3 else (".4g" if signed else ".4f")
    return fmt_pm(dict(stat), fmt, signed=signed, scale=scale)


def _axis(value: Any) -> Any:
    """A grid coordinate as written in a table (floats with ``:g``)."""
    return f"{value:g}" if isinstance(value, float) else value


def _params(r: Mapping[str, Any]) -> str:
    if not r["params"]:
        return ""
    text = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["params"].items())
    used = r.get("params_per_seed") or []
    if any(u != r["params"] for u in used):
        text += " (used " + "; ".join("–" if not u else ", ".join(
            f"{v:g}" if isinstance(v, float) else str(v) for v in u.values()) for u in used) + ")"
    return text


def render_markdown(doc: Mapping[str, Any], intro: Sequence[str] = (), sections: Sequence[str] = (),
                    metric_formats: Mapping[str, str] | None = None) -> str:
    """The Markdown report: title, ``intro``, results, paired, tuning, ``sections``, run line."""
    cfg = doc["config"]
    metrics = cfg["metrics"]
    formats = dict(metric_formats or {})
    axes = list(cfg["grid"])
    lines = [f"# {doc['title']}", ""]
    if intro:
        lines += [*intro, ""]
    tuned = any(r["params"] for r in doc["results"])
    rows = []
    for r in doc["results"]:
        row = [_axis(r["point"].get(a, "")) for a in axes] + [r["method"]]
        skipped = r.get("skipped")
        if tuned:
            row.append(_params({**r, "params_per_seed": []} if skipped else r))
        if skipped:
            row += ["skipped"] * len(metrics) + ["–"]
        else:
            row += [_stat(r["metrics"].get(m["name"]), formats.get(m["name"], m.get("format", "auto")),
                          m.get("scale", 1.0)) for m in metrics]
            gone = int(r.get("missing") or 0)
            row.append(f"{r['failed'] - gone} (+{gone} not in the cache)" if gone else r["failed"])
        rows.append(row)
    cols = axes + ["method"] + (["tuned"] if tuned else []) + [m["label"] for m in metrics] + ["failed seeds"]
    over = f"repeats {cfg['seeds']}" if cfg.get("cache") == "none" else f"seeds {cfg['seeds']}"
    lines += [f"## Results (test, mean ± sd over {over})", "", markdown_table(rows, cols), ""]
    if doc["paired"]:
        paired_metrics = [m for m in metrics if m["name"] in doc["paired"][0]["metrics"]]
        prow = []
        for p in doc["paired"]:
            cells = []
            for m in paired_metrics:
                d = p["metrics"].get(m["name"]) or {}
                cells.append("–" if d.get("mean") is None else
                             f"{_stat(d, formats.get(m['name'], m.get('format', 'auto')), m.get('scale', 1.0), True)} "
                             f"({d['first_better']}/{d['seeds']})")
            prow.append([_axis(p["point"].get(a, "")) for a in axes] + [f"{p['a']} − {p['b']}"] + cells)
        unit = "repeat" if cfg.get("cache") == "none" else "seed"
        lines += [f"## Paired per {unit} (a − b; (k/n) = {unit}s on which a is better)", "",
                  markdown_table(prow, axes + ["pair"] + [m["label"] for m in paired_metrics]), ""]
    if doc["tuning"]:
        tn = cfg.get("tuning", {})
        values = sorted({float(v) for t in doc["tuning"] for v in t["scores"]})
        t_axes = list(dict.fromkeys(k for t in doc["tuning"] for k in t["point"]))
        trow = []
        for t in doc["tuning"]:
            trow.append([_axis(t["point"].get(a, "")) for a in t_axes] + [", ".join(t["methods"])]
                        + [format_value(t["scores"].get(f"{v:g}")) if f"{v:g}" in t["scores"] else ""
                           for v in values]
                        + [_axis(t["chosen"]), "yes" if t.get("at_edge") else "",
                           ", ".join(f"{x:g}" for x in t.get("extended", []))])
        lines += [f"## Tuning on validation ({tn.get('metric')} per {tn.get('param')}, seed {tn.get('seed')}; "
                  "– = failed)", "",
                  markdown_table(trow, t_axes + ["methods"] + [f"{v:g}" for v in values]
                                 + ["chosen", "edge", "extended"]), ""]
    for s in sections:
        lines.append(s)
    est = doc.get("estimate") or {}
    est_text = "no estimate" if est.get("seconds") is None else \
        f"estimated {est['seconds']:.0f} s ({est.get('from')})"
    if cfg.get("cache") == "none":
        lines += ["", f"Wall time {doc['seconds']:.0f} s; {est.get('cells_computed', est.get('cells_to_run', 0))} "
                  "cells measured in this run "
                  f"({cfg.get('measurement', MEASUREMENT)}); {est_text}.", ""]
    elif "cells_computed" in est:
        missing = f", {est['cells_missing']} not in the cache (reported missing)" if "cells_missing" in est else ""
        lines += ["", f"Wall time {doc['seconds']:.0f} s; {est['cells_computed']} cells computed in this run, "
                  f"{est.get('cells_read', 0)} read from the cache{missing} (planned at the start: "
                  f"{est.get('cells_to_run', 0)} to run, {est.get('cells_cached', 0)} cached); {est_text}.", ""]
    else:
        lines += ["", f"Wall time {doc['seconds']:.0f} s; {est.get('cells_to_run', 0)} cells run, "
                  f"{est.get('cells_cached', 0)} from the cache; {est_text}.", ""]
    return "\n".join(lines)


def curve_panels(doc: Mapping[str, Any], y: str, *, x: str = "round", panel_axis: str | None = None,
                 series_axes: Sequence[str] = (), ylabel: str | None = None, xlabel: str | None = None,
                 logy: bool = False, band: str | None = None, title: str = "",
                 style: Any = None) -> list[dict[str, Any]]:
    """One panel per value of ``panel_axis`` (or one panel); a series per method (+ ``series_axes``).

    ``style(label, result) -> dict`` gives matplotlib keyword arguments of a series.
    """
    values = doc["config"]["grid"].get(panel_axis, [None]) if panel_axis else [None]
    panels = []
    for v in values:
        series: dict[str, list[dict[str, Any]]] = {}
        styles: dict[str, dict[str, Any]] = {}
        for r in doc["results"]:
            if panel_axis and r["point"].get(panel_axis) != v or not r["curve"]:
                continue
            label = " ".join([r["method"]] + [f"{a}={r['point'].get(a)}" for a in series_axes])
            series[label] = r["curve"]
            if style is not None:
                styles[label] = style(label, r)
        panels.append({"x": x, "y": y, "series": series, "xlabel": xlabel or x, "ylabel": ylabel or y,
                       "logy": logy, "band": band, "style": styles,
                       "title": (f"{v}: " if v is not None else "") + title})
    return panels


def metric_panels(doc: Mapping[str, Any], metric: str, x_axis: str, *, panel_axis: str | None = None,
                  ylabel: str | None = None, xlabel: str | None = None, scale: float = 1.0,
                  logx: bool = False, title: str = "", where: Mapping[str, Any] | None = None
                  ) -> list[dict[str, Any]]:
    """``metric`` (mean ± sd band) against grid axis ``x_axis``, a series per method.

    ``where`` keeps only the points with these axis values.
    """
    values = doc["config"]["grid"].get(panel_axis, [None]) if panel_axis else [None]
    panels = []
    for v in values:
        series: dict[str, list[dict[str, Any]]] = {}
        for r in doc["results"]:
            if panel_axis and r["point"].get(panel_axis) != v or x_axis not in r["point"]:
                continue
            if where and any(r["point"].get(k) != w for k, w in where.items()):
                continue
            st = r["metrics"].get(metric) or {}
            if st.get("mean") is None:
                continue
            series.setdefault(r["method"], []).append(
                {x_axis: r["point"][x_axis], metric: st["mean"] * scale, "sd": (st.get("sd") or 0.0) * scale})
        for pts in series.values():
            pts.sort(key=lambda p: p[x_axis])
        panels.append({"x": x_axis, "y": metric, "band": "sd", "series": series, "xlabel": xlabel or x_axis,
                       "ylabel": ylabel or metric, "logx": logx,
                       "title": (f"{v}: " if v is not None else "") + title})
    return panels


def write_report(out: Path, doc: Mapping[str, Any], *, intro: Sequence[str] = (), sections: Sequence[str] = (),
                 panels: Sequence[Mapping[str, Any]] = (), plot_title: str = "",
                 metric_formats: Mapping[str, str] | None = None, markdown: str | None = None) -> dict[str, Path]:
    """Write ``<out>/<name>.json``, ``.md`` and (with ``panels``) ``.png``; returns the paths written.

    ``markdown`` replaces the common Markdown (:func:`render_markdown`) for a result that keeps a
    layout of its own; the JSON and Markdown are written before the plot is drawn.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    name = doc["name"]
    paths = {"json": write_json(out / f"{name}.json", doc)}
    md = out / f"{name}.md"
    atomic_write_text(md, render_markdown(doc, intro, sections, metric_formats) if markdown is None else markdown)
    paths["md"] = md
    if panels:
        png = out / f"{name}.png"
        plot_panels(png, panels, title=plot_title or str(doc.get("title", "")))
        paths["png"] = png
    return paths
