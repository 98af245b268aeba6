"""Operations on named arrays shared by server cores, trainers and the round loop.

``validate_update`` is the one check every reply passes before a core sees it;
``weighted_average`` is FedAvg's aggregation; ``flatten_params``/``unflatten_params`` map a
model's named arrays to θ (ALGORITHMS.md §1.1) and back; ``select_keys`` resolves the
layer selections of FeSEM and BiG-FL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from graphfl.common.config import ConfigError
from graphfl.common.types import Arrays


def validate_update(arrays: Arrays | None, template: Arrays) -> str | None:
    """Why a training reply is unusable (wrong keys/shapes/dtype, NaN or Inf), or ``None``."""
    if arrays is None:
        return "reply carries no arrays"
    missing = [k for k in template if k not in arrays]
    extra = [k for k in arrays if k not in template]
    if missing or extra:
        return f"array keys differ from the model: missing {missing[:5]}, unexpected {extra[:5]}"
    for key, ref in template.items():
        arr = arrays[key]
        if arr.shape != ref.shape:
            return f"array {key!r} has shape {arr.shape}, expected {ref.shape}"
        if arr.dtype.kind not in "fiub":
            return f"array {key!r} has unsupported dtype {arr.dtype}"
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
            return f"array {key!r} contains NaN or Inf"
    return None


def read_only_views(arrays: Mapping[str, np.ndarray], memo: dict[int, np.ndarray] | None = None) -> Arrays:
    """Read-only views of ``arrays`` in a new dict: no data copied, the owner's arrays untouched.

    What a receiver gets in a deployment (views into the message's blob, writing raises
    ``ValueError``), for an engine that hands arrays over in memory. Only the views' flag is
    cleared: the owner keeps writing its own arrays, and the views see those writes.
    ``memo`` (``id`` of an owner's array -> its view) gives an array that several dicts hold one
    view, so a broadcast model stays one object per key for every receiver; the owners' arrays
    must outlive it.
    """
    out: Arrays = {}
    for key, arr in arrays.items():
        view = memo.get(id(arr)) if memo is not None else None
        if view is None:
            view = np.asarray(arr).view()
            view.flags.writeable = False
            if memo is not None:
                memo[id(arr)] = view
        out[key] = view
    return out


def weighted_average(arrays: Sequence[Arrays], weights: Sequence[float]) -> Arrays:
    """``Σ_k w_k a_k / Σ_k w_k`` key by key, in float64, cast back to each array's dtype.

    Terms are added in the order given (fixed summation order: reproducible results).
    """
    if not arrays:
        raise ValueError("weighted_average of no arrays")
    w = np.asarray(weights, dtype=np.float64)
    if np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be nonnegative with a positive sum, got {list(weights)}")
    w = w / w.sum()
    out: Arrays = {}
    for key, ref in arrays[0].items():
        acc = np.zeros(ref.shape, dtype=np.float64)
        for a, wk in zip(arrays, w):
            acc += wk * a[key]
        out[key] = acc.astype(ref.dtype, copy=False)
    return out


def flatten_params(arrays: Arrays, keys: Sequence[str]) -> np.ndarray:
    """θ = concatenation of ``arrays[k].ravel()`` for k in ``keys`` (float64)."""
    if not keys:
        return np.zeros(0)
    return np.concatenate([np.asarray(arrays[k], dtype=np.float64).ravel() for k in keys])


def unflatten_params(theta: np.ndarray, template: Arrays, keys: Sequence[str]) -> Arrays:
    """Inverse of :func:`flatten_params`; keys not in ``keys`` are copied from ``template``."""
    out = dict(template)
    offset = 0
    for k in keys:
        ref = template[k]
        size = int(ref.size)
        if offset + size > theta.size:
            raise ValueError(f"theta has {theta.size} entries, too few for key {k!r}")
        out[k] = theta[offset : offset + size].reshape(ref.shape).astype(ref.dtype)
        offset += size
    if offset != theta.size:
        raise ValueError(f"theta has {theta.size} entries, the keys use {offset}")
    return out


def select_keys(param_keys: Sequence[str], spec: str) -> tuple[str, ...]:
    """Parameter keys named by ``spec`` (comma-separated exact keys or prefixes).

    An empty ``spec`` selects all of ``param_keys``. A name that matches nothing is a
    :class:`ConfigError` listing the valid keys. The result keeps registration order.
    """
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        return tuple(param_keys)
    chosen: list[str] = []
    for name in names:
        hits = [k for k in param_keys if k == name or k.startswith(name + ".")]
        if not hits:
            raise ConfigError(
                f"layer {name!r} matches no trainable parameter; valid keys: {list(param_keys)}"
            )
        chosen.extend(h for h in hits if h not in chosen)
    return tuple(k for k in param_keys if k in chosen)
