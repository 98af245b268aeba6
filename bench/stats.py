"""Summary statistics over seeds shared by the benchmarks: mean ± sd, paired differences, mean curves.

Every figure a benchmark reports over seeds comes from here, so all benchmarks state it the same
way: the mean and the sample standard deviation (``ddof = 1``; ``None`` for a single value) of
the finite per-seed values, the values themselves, and, for a paired difference ``a − b``, the
number of seeds on which ``a`` is better.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["mean_sd", "paired_difference", "first_better_on_every_seed", "mean_curve", "fmt_pm"]


def _finite(v: Any) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(float(v))


def mean_sd(values: Sequence[float | None]) -> dict[str, Any]:
    """``{"mean", "sd", "per_seed", "n"}`` over the finite values (sample sd, ``None`` below two values).

    ``per_seed`` keeps only the values the mean is taken over; ``n`` counts them.
    """
    vals = [float(v) for v in values if _finite(v)]  # type: ignore[arg-type]
    if not vals:
        return {"mean": None, "sd": None, "per_seed": [], "n": 0}
    return {"mean": float(np.mean(vals)), "sd": float(np.std(vals, ddof=1)) if len(vals) > 1 else None,
            "per_seed": vals, "n": len(vals)}


def paired_difference(a: Sequence[float | None], b: Sequence[float | None],
                      lower_is_better: bool = True, expected: int | None = None) -> dict[str, Any]:
    """Per-seed ``a − b`` over the seeds where both are finite: :func:`mean_sd` plus the sign count.

    ``a[k]`` and ``b[k]`` are the values of the same seed (``None`` or non-finite: the run gave no
    finite final value). ``first_better`` counts the seeds on which ``a`` is better (``a < b`` when
    lower is better, ``a > b`` otherwise); ``seeds`` the seeds compared. ``expected`` (default: the
    longer list's length) is how many seeds the comparison should have: ``missing`` counts the seeds
    absent from either list, ``first_nonfinite`` / ``second_nonfinite`` list the positions where
    ``a`` / ``b`` is not finite. A list longer than ``expected`` is an error.
    """
    n = max(len(a), len(b)) if expected is None else int(expected)
    if len(a) > n or len(b) > n:
        raise ValueError(f"paired_difference: {len(a)} and {len(b)} values for {n} expected seeds")
    pairs = list(zip(a, b))
    diffs = [float(x) - float(y) for x, y in pairs if _finite(x) and _finite(y)]  # type: ignore[arg-type]
    out = mean_sd(diffs)
    out["first_better"] = int(sum((d < 0) if lower_is_better else (d > 0) for d in diffs))
    out["seeds"] = len(diffs)
    out["expected"] = n
    out["missing"] = n - len(pairs)
    out["first_nonfinite"] = [k for k, (x, _) in enumerate(pairs) if not _finite(x)]
    out["second_nonfinite"] = [k for k, (_, y) in enumerate(pairs) if not _finite(y)]
    return out


def first_better_on_every_seed(p: dict[str, Any] | None) -> bool | None:
    """Whether a claim "``a`` beats ``b``" holds on a :func:`paired_difference`: the rule every verdict uses.

    ``False`` when ``a`` has no finite value on some seed (the method claimed better diverged or
    failed there: a loss, whatever the other seeds say); ``None`` (not testable) when there is no
    result, a seed is missing, or ``b`` has no finite value on some seed; otherwise whether ``a`` is
    better on every expected seed.
    """
    if not p:
        return None
    if p.get("first_nonfinite"):
        return False
    if p.get("missing") or p.get("second_nonfinite") or p.get("mean") is None or not p.get("seeds"):
        return None
    return bool(p["first_better"] == p["seeds"] == p.get("expected", p["seeds"]))


def mean_curve(curves: Sequence[Sequence[dict[str, Any]]], keys: Sequence[str],
               sd_keys: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The point-wise mean of equally long curves (rows are dicts) for ``keys``; ``<key>_sd`` for ``sd_keys``.

    The other entries of a row are those of the first curve; a key missing (``None``) in any
    curve at a point keeps the first curve's value there. Curves are cut to the shortest.
    """
    curves = [c for c in curves if c]
    if not curves:
        return []
    width = min(len(c) for c in curves)
    out = []
    for k in range(width):
        row = dict(curves[0][k])
        for key in keys:
            vals = [c[k].get(key) for c in curves]
            if all(v is not None for v in vals):
                nums = [float(v) for v in vals if v is not None]
                row[key] = float(np.mean(nums))
                if key in sd_keys:
                    row[f"{key}_sd"] = float(np.std(nums, ddof=1)) if len(nums) > 1 else 0.0
        out.append(row)
    return out


def fmt_pm(stat: dict[str, Any] | None, fmt: str = ".4g", signed: bool = False, scale: float = 1.0) -> str:
    """``"mean ± sd"`` of a :func:`mean_sd` dict (``–`` without a mean), values times ``scale``."""
    if not stat or stat.get("mean") is None:
        return "–"
    spec = ("+" if signed else "") + fmt
    text = format(stat["mean"] * scale, spec)
    if stat.get("sd") is not None:
        text += " ± " + format(stat["sd"] * scale, fmt)
    return text
