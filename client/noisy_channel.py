"""Uplink noisy channel of seed 002 (ALGORITHMS.md §8.2; Fukuhara et al. 2025, eq. 10).

Observation model of one client's upload::

    y = m ⊙ θ + n,     m_c ~ Bernoulli(1 − r) i.i.d. per entry,     n ~ N(0, σ² I),
    σ = c · mean(|θ_ref|)

* ``c`` (``noise_coef``) is the paper's scaling factor, ``r`` (``missing_rate``) the missing
  rate of the random binary masks; only the uplink is noisy (the downlink is clean).
* **σ is one scalar per upload, from the mean absolute value over the whole parameter
  vector** — every entry of every array, i.e. ``Σ_a Σ|θ_a| / Σ_a size(θ_a)`` (arrays weighted
  by their size), not one σ per array. Reasons: the seed defines the noise level as
  proportional to "the average absolute value of the initial model parameters", a single
  number for the model; the channel adds white noise to the transmitted vector as a whole
  (AWGN has one power per transmission); and per-array σ would give small, near-zero arrays
  (biases) a tiny σ and large weight matrices a large one, i.e. a different noise model.
* The seed takes the mean over the *common initial model* ``θ^0`` (so σ is constant over
  rounds): pass ``ref_mean_abs = mean_abs(θ^0)`` for that. Without it the mean is taken over
  the upload itself (before masking).
* The mask is returned (``True`` = received): the server needs it for the fidelity term. With
  ``fill_missing`` (e.g. ``nan``) the missing entries are set to that value instead of
  ``0 + noise``; JGESR treats NaN as missing, so the mask need not travel separately.

Determinism: the arrays are processed in sorted name order; for each, the mask is drawn
(``rng.random``, only if ``r > 0``) and then the noise (``rng.standard_normal`` in the array's
dtype for float32/float64, in float64 then cast otherwise; only if ``c > 0``). The same
generator state and inputs therefore give bit-identical outputs, independent of the dict's
insertion order. With ``c = 0`` and ``r = 0`` nothing is drawn and the outputs are exact
copies of the inputs (no ``+ 0.0``, which would turn ``-0.0`` into ``0.0``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

logger = logging.getLogger(__name__)

BoolArray = NDArray[np.bool_]
AnyFloatArray = NDArray[np.floating[Any]]


class UplinkResult(NamedTuple):
    """Output of :func:`apply_uplink_channel` (unpacks as ``arrays, masks, sigma``)."""

    arrays: dict[str, AnyFloatArray]
    """Received arrays ``m ⊙ θ + n`` (same names, shapes and dtypes as the input)."""
    masks: dict[str, BoolArray]
    """``True`` where the entry was received."""
    sigma: float
    """Noise standard deviation used for this upload."""


def _check_arrays(arrays: Mapping[str, Any]) -> dict[str, AnyFloatArray]:
    out: dict[str, AnyFloatArray] = {}
    for name in sorted(arrays):
        arr = np.asarray(arrays[name])
        if not np.issubdtype(arr.dtype, np.floating):
            raise ValueError(f"array {name!r} must have a floating dtype, got {arr.dtype} with shape {arr.shape}")
        out[name] = arr
    return out


def mean_abs(arrays: Mapping[str, Any]) -> float:
    """``Σ_a Σ|θ_a| / Σ_a size(θ_a)`` over all arrays (float64 accumulation; 0 if empty).

    Non-finite entries are ignored.
    """
    total = 0.0
    count = 0
    for arr in _check_arrays(arrays).values():
        a = np.abs(np.asarray(arr, dtype=np.float64))
        finite = np.isfinite(a)
        total += float(a[finite].sum())
        count += int(finite.sum())
    return total / count if count else 0.0


def apply_uplink_channel(
    arrays: Mapping[str, Any],
    noise_coef: float,
    missing_rate: float,
    rng: np.random.Generator,
    *,
    ref_mean_abs: float | None = None,
    fill_missing: float | None = None,
) -> UplinkResult:
    """Pass one upload through the noisy, lossy uplink ``y = m ⊙ θ + n`` (module docstring).

    Parameters
    ----------
    arrays
        Named float arrays of one client's upload (not modified).
    noise_coef
        ``c >= 0``; ``σ = c · mean|θ|``.
    missing_rate
        ``r ∈ [0, 1]``; each entry is lost independently with probability ``r``.
    rng
        Source of all randomness.
    ref_mean_abs
        ``mean|θ^0|`` of the common initial model (seed 002); default: of this upload.
    fill_missing
        If given, lost entries are set to this value (e.g. ``nan``) instead of ``0 + n``.

    Returns
    -------
    UplinkResult
        ``(arrays, masks, sigma)``.
    """
    if not (math.isfinite(noise_coef) and noise_coef >= 0):
        raise ValueError(f"noise_coef must be finite and >= 0, got {noise_coef!r}")
    if not (0.0 <= missing_rate <= 1.0):
        raise ValueError(f"missing_rate must be in [0, 1], got {missing_rate!r}")
    if ref_mean_abs is not None and not (math.isfinite(ref_mean_abs) and ref_mean_abs >= 0):
        raise ValueError(f"ref_mean_abs must be finite and >= 0, got {ref_mean_abs!r}")
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    checked = _check_arrays(arrays)
    scale = ref_mean_abs if ref_mean_abs is not None else mean_abs(checked)
    sigma = noise_coef * scale
    out: dict[str, AnyFloatArray] = {}
    masks: dict[str, BoolArray] = {}
    for name, arr in checked.items():
        out[name], masks[name] = _transmit(arr, sigma, missing_rate, rng, fill_missing)
    logger.debug("uplink channel: %d arrays, sigma=%.6g, missing_rate=%.3g", len(out), sigma, missing_rate)
    return UplinkResult(out, masks, sigma)


def _transmit(
    arr: AnyFloatArray,
    sigma: float,
    missing_rate: float,
    rng: np.random.Generator,
    fill_missing: float | None,
) -> tuple[AnyFloatArray, BoolArray]:
    """One array: draw the mask, then the noise; ``y = m ⊙ θ + n`` (or ``fill`` where lost)."""
    y = np.array(arr, copy=True)
    if missing_rate > 0:
        mask = rng.random(arr.shape) >= missing_rate
    else:
        mask = np.ones(arr.shape, dtype=bool)
    lost = ~mask
    if missing_rate > 0:
        y[lost] = 0
    if sigma > 0:
        if arr.dtype in (np.float32, np.float64):
            noise = rng.standard_normal(arr.shape, dtype=arr.dtype)
        else:
            noise = rng.standard_normal(arr.shape).astype(arr.dtype)
        y += (sigma * noise).astype(arr.dtype, copy=False)
    if fill_missing is not None and missing_rate > 0:
        y[lost] = fill_missing
    return y, mask
