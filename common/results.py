"""Result files: ``<out>/<name>.json`` (machine), ``.md`` (a table a person reads), ``.png``.

Schema (DESIGN.md "Result files")::

    {"name": ..., "config": {...}, "methods": {method: {"final": {...}, "curve": [{"round": r, ...}]}},
     "env": {...}}

Writes are atomic (temp file + rename), so a crash never leaves a truncated file, and a
run writes its JSON after every round: data already written is never lost.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CURVE_KEYS = ("test_loss", "test_acc")


def _clean(value: Any) -> Any:
    """JSON-safe copy: NaN/Inf -> None, numpy scalars -> Python."""
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            value = value.item()
        except (ValueError, TypeError):
            return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, doc: Mapping[str, Any]) -> None:
    atomic_write_text(path, json.dumps(_clean(doc), indent=2, sort_keys=False) + "\n")


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


def markdown_table(rows: Iterable[Mapping[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def render_markdown(doc: Mapping[str, Any]) -> str:
    """Summary table (final metrics per method) plus one per-round table per method."""
    name = doc.get("name", "run")
    out = [f"# {name}", ""]
    methods: Mapping[str, Any] = doc.get("methods", {})
    finals = []
    for method, res in methods.items():
        row = {"method": method, **(res.get("final") or {})}
        finals.append(row)
    final_cols = ["method"] + sorted({k for r in finals for k in r if k != "method"})
    out += ["## Final metrics", "", markdown_table(finals, final_cols), ""]
    for method, res in methods.items():
        curve = res.get("curve") or []
        if not curve:
            continue
        scalar_keys = [k for k in curve[-1] if not isinstance(curve[-1][k], (dict, list))]
        cols = ["round"] + [k for k in scalar_keys if k != "round"]
        out += [f"## {method}: per round", "", markdown_table(curve, cols), ""]
    cfg = doc.get("config")
    if cfg:
        out += ["## Configuration", "", "```json", json.dumps(_clean(cfg), indent=2), "```", ""]
    env = doc.get("env")
    if env:
        out += ["## Environment", "", markdown_table([env], list(env)), ""]
    return "\n".join(out)


def plot_curves(doc: Mapping[str, Any], path: Path, keys: tuple[str, ...] = CURVE_KEYS,
                x_key: str = "round") -> bool:
    """One panel per metric in ``keys`` that any method reports, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods: Mapping[str, Any] = doc.get("methods", {})
    present = [k for k in keys if any(p.get(k) is not None for m in methods.values() for p in m.get("curve", []))]
    if not present:
        return False
    fig, axes = plt.subplots(1, len(present), figsize=(5.5 * len(present), 4), squeeze=False)
    for ax, key in zip(axes[0], present):
        for method, res in methods.items():
            pts = [(p[x_key], p[key]) for p in res.get("curve", []) if p.get(key) is not None and p.get(x_key) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=method)
        ax.set_xlabel(x_key)
        ax.set_ylabel(key)
        if key.endswith("loss") and all(
            p.get(key) is None or p[key] > 0 for m in methods.values() for p in m.get("curve", [])
        ):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(str(doc.get("name", "")))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return True


def write_results(out_dir: str | Path, doc: Mapping[str, Any], plot: bool = True) -> dict[str, Path]:
    """Write ``<out>/<name>.json``, ``.md`` and (if ``plot``) ``.png``; return their paths."""
    out = Path(out_dir)
    name = str(doc.get("name", "run"))
    paths = {"json": out / f"{name}.json", "md": out / f"{name}.md"}
    write_json(paths["json"], doc)
    atomic_write_text(paths["md"], render_markdown(doc))
    if plot:
        try:
            if plot_curves(doc, out / f"{name}.png"):
                paths["png"] = out / f"{name}.png"
        except Exception:  # a plotting problem must not lose the JSON/MD already written
            logger.exception("could not draw %s.png", name)
    return paths
