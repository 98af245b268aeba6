"""Whether a run's final numbers are numbers: the rule behind the ``diverged`` status.

A run (Flower: ``run.json`` ``status``; p2p: a peer's ``outcome``) whose final model or losses are
not finite has no result to report, so it ends ``diverged`` with the reason, never
``completed`` / ``done``. Rules:

* a model (parameter vector) with a NaN or infinite entry has diverged;
* a loss of ``+inf`` / ``-inf`` has diverged (a value overflowed: data or model values too large
  for the arithmetic, e.g. squares of 1e200 in float64 or of 1e30 in float32);
* a NaN loss alone is *undefined*, not diverged: graphfl reports NaN for a loss with no rows to
  measure it on (a client without test rows), and the recorder skips it in means.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np


def all_finite(values: Any) -> bool:
    """Whether every entry of an array (numpy, torch or a sequence of numbers) is finite."""
    isfinite = getattr(values, "isfinite", None)
    if callable(isfinite) and not isinstance(values, np.ndarray):  # a torch tensor, wherever it lives
        return bool(isfinite().all())
    return bool(np.all(np.isfinite(np.asarray(values, dtype=np.float64))))


def _infinite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isinf(value)


def node_divergence(theta: Any, test_loss: float | None, train_loss: float | None) -> str | None:
    """Why a p2p node's final result is not a result (module rules), or ``None`` when it is one."""
    if not all_finite(theta):
        return "non-finite model after the last round"
    for name, value in (("test loss", test_loss), ("train loss", train_loss)):
        if _infinite(value):
            return (f"{name} is {value} after the last round (a value overflowed: the data's or the "
                    f"model's values are too large)")
    return None


def final_losses(records: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """``(test_loss, train_loss)`` of a p2p node's last round record (``None`` without records)."""
    last = records[-1] if records else {}
    return last.get("test_loss"), last.get("train_loss")


def round_divergence(row: Mapping[str, Any]) -> str | None:
    """Why a Flower run's final round row (``run.json`` curve) holds no result, or ``None``.

    Looks at every per-client loss of the row (``test_loss_per_client``,
    ``local_test_loss_per_client``, ...): an infinite value is a divergence (module rules); the
    message names the metric and the clients. (The row's means skip non-finite values, so they
    cannot show it.)
    """
    for key in sorted(row):
        if key.endswith("loss_per_client") and isinstance(row[key], Mapping):
            bad = {str(c): v for c, v in row[key].items() if _infinite(v)}
            if bad:
                metric = key[: -len("_per_client")]
                return (f"round {row.get('round')}: {metric} is infinite on client(s) {sorted(bad, key=int)} "
                        f"(a value overflowed: the data's or the model's values are too large)")
    return None
