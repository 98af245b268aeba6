"""Result files ``<out>/<name>.{json,md,png}`` (DESIGN.md "Result files") for p2p runs and benchmarks."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from graphfl.common.envinfo import env_info  # noqa: F401  (re-exported for p2p callers)
from graphfl.common.results import write_json as _write_json

logger = logging.getLogger(__name__)


def write_json(path: Path, obj: Any) -> Path:
    """Atomic JSON write (NaN/Inf become null); see :func:`graphfl.common.results.write_json`."""
    _write_json(path, obj)
    return path


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def plot_curves(path: Path, panels: Sequence[dict[str, Any]], title: str = "") -> Path | None:
    """One subplot per panel: ``{"x": key, "y": key, "xlabel", "ylabel", "series": {label: curve}, "logy": bool}``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        logger.warning("matplotlib missing; no plot written")
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for label, curve in panel["series"].items():
            pts = [(r[panel["x"]], r[panel["y"]]) for r in curve if r.get(panel["y"]) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, label=label, **panel.get("style", {}).get(label, {}))
        ax.set_xlabel(panel.get("xlabel", panel["x"]))
        ax.set_ylabel(panel.get("ylabel", panel["y"]))
        if panel.get("logy"):
            ax.set_yscale("log")
        if panel.get("logx"):
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        if len(panel["series"]) <= 12:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
