"""Result files: ``<out>/<name>.json`` (machine), ``.md`` (a table a person reads), ``.png``.

Schema (DESIGN.md "Result files")::

    {"name": ..., "config": {...}, "methods": {method: {"final": {...}, "curve": [{"round": r, ...}]}},
     "env": {...}}

Writes are atomic (temp file + rename), so a crash never leaves a truncated file, and a
run writes its JSON after every round: data already written is never lost. A write that fails
(a full disk, a quota, a file-size limit, a read-only file system) removes its temporary file
and raises :class:`ResultsWriteError`, which names the file and the errno, and leaves the
previous version of the file in place.

This is the one report writer of graphfl: Flower runs, p2p runs and every benchmark write
their JSON with :func:`write_json`, their tables with :func:`markdown_table` and their plots
with :func:`plot_panels` (or :func:`plot_curves` for the standard document shape).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

logger = logging.getLogger(__name__)

CURVE_KEYS = ("test_loss", "test_acc")
SERVER_CURVE_KEYS = ("shrink_ratio", "graph_cv")
"""Per-round server metrics drawn as curves in run.png when a method logs them (JGESR's collapse
diagnostics: docs/jgesr.md)."""


def clean_json(value: Any) -> Any:
    """JSON-safe copy: NaN/Inf -> None, numpy scalars -> Python (strict JSON, no ``Infinity``)."""
    if isinstance(value, Mapping):
        return {str(k): clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            value = value.item()
        except (ValueError, TypeError):
            return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO, errno.EACCES,
                            errno.EPERM, errno.ENOTDIR, errno.EISDIR})
"""Errnos of a write that failed because of where it writes (space, quota, size limit, read-only,
permissions, a path that is not a folder), not because of what graphfl does."""


class ResultsWriteError(OSError):
    """A result file could not be written; ``str()`` names the file, the errno's text and name.

    ``path`` is the file that was being written, ``errno`` / ``strerror`` those of the cause.
    """

    def __init__(self, path: Path, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.path = Path(path)
        self.filename = str(path)

    def __str__(self) -> str:
        name = errno.errorcode.get(self.errno or 0)
        return f"cannot write {self.path}: {self.strerror}{f' ({name})' if name else ''}"


def how_to_fix(exc: OSError, folder: Path | str) -> str:
    """What a person does about a failed write into ``folder`` (one sentence, by errno)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"free space on the file system that holds {folder} (or raise its quota)"
    if exc.errno == errno.EFBIG:
        return "raise the file-size limit of the process (ulimit -f) or of the file system"
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"make {folder} writable"
    return f"fix what stops writing into {folder}"


FULL_DISK_BYTES = 1 << 20
"""Below this many free bytes a file system counts as full (:func:`full_disk`)."""


def full_disk(folder: Path | str) -> str | None:
    """``"the file system of FOLDER is full (N bytes free)"`` when it has under :data:`FULL_DISK_BYTES`
    free for this user, else ``None`` (also when ``folder`` cannot be examined).

    A failure that a full disk caused somewhere else (a client's state file, a progress line)
    reaches the run as that component's error; this names the cause.
    """
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    return f"the file system of {folder} is full ({free} bytes free)" if free < FULL_DISK_BYTES else None


def _write_failed(path: Path, tmp: str, exc: BaseException) -> None:
    """Remove the temporary file of a failed atomic write; an OSError becomes a :class:`ResultsWriteError`."""
    Path(tmp).unlink(missing_ok=True)
    if isinstance(exc, OSError) and not isinstance(exc, ResultsWriteError):
        raise ResultsWriteError(path, exc) from exc


def _temp_file(path: Path) -> tuple[int, str]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise ResultsWriteError(path, exc) from exc


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (never half-written).

    Raises
    ------
    ResultsWriteError
        The write failed; the temporary file is removed and ``path`` keeps its previous content.
    """
    fd, tmp = _temp_file(path)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException as exc:
        _write_failed(path, tmp, exc)
        raise


def atomic_write_bytes(path: Path, write: Callable[[BinaryIO], Any]) -> Path:
    """Write ``path`` durably: ``write(fh)`` fills a temporary file in the same folder, which is
    flushed, fsync-ed and renamed over ``path`` (a crash leaves the old file or the new one, never
    half of one; the temporary file is removed on any error).

    Raises
    ------
    ResultsWriteError
        The write failed (``path`` keeps its previous content).
    """
    fd, tmp = _temp_file(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        _write_failed(path, tmp, exc)
        raise
    return path


def write_json(path: Path, doc: Any) -> Path:
    """Atomic JSON write; NaN/Inf become ``null`` (strict JSON), numpy scalars plain numbers."""
    atomic_write_text(path, json.dumps(clean_json(doc), indent=2, sort_keys=False, allow_nan=False) + "\n")
    return path


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


def markdown_table(rows: Iterable[Mapping[str, Any] | Sequence[Any]], columns: Sequence[str]) -> str:
    """A Markdown table; each row is a mapping (looked up by column) or a sequence (in column order)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [row.get(c) for c in columns] if isinstance(row, Mapping) else list(row)
        lines.append("| " + " | ".join(_fmt(v) for v in cells) + " |")
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
        out += ["## Configuration", "", "```json", json.dumps(clean_json(cfg), indent=2), "```", ""]
    env = doc.get("env")
    if env:
        out += ["## Environment", "", markdown_table([env], list(env)), ""]
    return "\n".join(out)


def plot_panels(path: Path, panels: Sequence[Mapping[str, Any]], title: str = "") -> bool:
    """Draw one subplot per panel and save ``path`` atomically; returns whether anything was drawn.

    A panel is ``{"x": key, "y": key, "series": {label: curve}, "xlabel", "ylabel", "title",
    "logy", "logx", "band": key of a ± band (e.g. the sd over seeds), "style": {label: kwargs}}``;
    a curve is a list of dicts and points whose ``y`` is missing are skipped. A panel with a
    ``"matrix"`` (2-D list, e.g. a learned client graph) is drawn as a heat map instead.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = False
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5.5 * max(1, len(panels)), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if "matrix" in panel:
            image = ax.imshow(panel["matrix"], cmap="viridis")
            fig.colorbar(image, ax=ax, fraction=0.046)
            ax.set_title(panel.get("title", ""))
            ax.set_xlabel(panel.get("xlabel", "client"))
            ax.set_ylabel(panel.get("ylabel", "client"))
            drawn = True
            continue
        x_key, y_key, band = panel["x"], panel["y"], panel.get("band")
        for label, curve in panel["series"].items():
            pts = [(r[x_key], r[y_key], (r.get(band) or 0.0) if band else 0.0)
                   for r in curve if r.get(y_key) is not None and r.get(x_key) is not None]
            if not pts:
                continue
            xs, ys, sds = (list(v) for v in zip(*pts))
            style = dict(panel.get("style", {}).get(label, {}))
            style.setdefault("marker", "o" if len(xs) < 30 else None)
            ax.plot(xs, ys, label=label, **style)
            if band:
                ax.fill_between(xs, [y - e for y, e in zip(ys, sds)], [y + e for y, e in zip(ys, sds)], alpha=0.2)
            drawn = True
        ax.set_xlabel(panel.get("xlabel", x_key))
        ax.set_ylabel(panel.get("ylabel", y_key))
        if panel.get("title"):
            ax.set_title(panel["title"])
        if panel.get("logy"):
            ax.set_yscale("log")
        if panel.get("logx"):
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        if 0 < len(panel["series"]) <= 12:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    try:
        atomic_write_bytes(path, lambda fh: fig.savefig(fh, format="png", dpi=110))
    finally:
        plt.close(fig)
    return drawn


def plot_curves(doc: Mapping[str, Any], path: Path, keys: tuple[str, ...] = CURVE_KEYS,
                x_key: str = "round") -> bool:
    """One panel per metric in ``keys`` that any method reports, one line per method."""
    methods: Mapping[str, Any] = doc.get("methods", {})
    curves = {m: res.get("curve", []) for m, res in methods.items()}
    present = [k for k in keys if any(p.get(k) is not None for c in curves.values() for p in c)]
    if not present:
        return False
    panels: list[dict[str, Any]] = []
    for key in present:
        positive = all(p.get(key) is None or p[key] > 0 for c in curves.values() for p in c)
        panels.append({"x": x_key, "y": key, "series": curves, "logy": key.endswith("loss") and positive})
    for key in SERVER_CURVE_KEYS:  # server diagnostics, e.g. JGESR's shrink ratio and graph CV
        series = {m: [{x_key: r.get(x_key), key: r["server"][key]} for r in c
                      if isinstance(r.get("server"), Mapping) and isinstance(r["server"].get(key), (int, float))]
                  for m, c in curves.items()}
        series = {m: s for m, s in series.items() if s}
        if series:
            panels.append({"x": x_key, "y": key, "series": series, "title": f"server: {key}"})
    for method, curve in curves.items():  # a learned client graph (JGESR, pFedGraph): its last one
        graphs = [(row["round"], row["server"]["graph"]) for row in curve
                  if isinstance(row.get("server"), Mapping) and row["server"].get("graph")]
        if graphs:
            r, graph = graphs[-1]
            panels.append({"matrix": graph, "title": f"{method}: learned graph W, round {r}"})
    return plot_panels(path, panels, str(doc.get("name", "")))


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
        except OSError as exc:  # a full disk: the json and md above are what counts
            logger.warning("could not write %s.png: %s", name, exc)
        except Exception:
            logger.exception("could not draw %s.png", name)
    return paths
