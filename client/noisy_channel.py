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

Wiring (one function, two carriers)
-----------------------------------
:func:`transmit_upload` is the channel of one training reply: float arrays pass
:func:`apply_uplink_channel` with the generator :func:`channel_rng` ``(seed, partition id,
round, phase)``; other arrays (integer buffers) pass unchanged. It is applied by

* :func:`noisy_channel_mod`, a Flower client mod (``ClientApp(mods=[noisy_channel_mod])``;
  graphfl's own ClientApp has it), which works with *any* ClientApp: it reads
  ``channel.noise`` / ``channel.missing`` / ``seed`` from the run config (absent = off), the
  partition id from the node config (else the node id), and round / phase from graphfl's
  control keys (else the message's group id / ""). Every ArrayRecord ``name`` of a reply to
  a train message is corrupted and the mask travels beside it as the ArrayRecord
  ``wire.MASK_PREFIX + name`` (bool, ``True`` = received), so the server knows what is missing;
* the in-process driver (:mod:`graphfl.server.inprocess`), with the same arguments, so an
  in-process run and a deployment see bit-identical uploads.

With the channel off (both 0, the default) the mod returns the reply untouched (no mask
record) and the driver does not call it: un-noised runs are bit-identical to runs without it.
The missing entries carry ``0 + n`` on the wire (finite: the reply passes the round loop's
NaN check); a method that ignores the mask (FedAvg, ...) aggregates them as they are, as in
the seed's experiments.

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
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:  # pragma: no cover
    from flwr.app import Context, Message
    from flwr.clientapp.typing import ClientAppCallable

logger = logging.getLogger(__name__)

CHANNEL_STREAM = 7
"""Stream id of the channel's generator (distinct from the clients' training streams)."""

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


# ---------------------------------------------------------------------------------------
# one training reply through the channel (shared by the Flower mod and the in-process driver)
# ---------------------------------------------------------------------------------------


def channel_rng(seed: int, partition_id: int, server_round: int, phase: str) -> np.random.Generator:
    """The channel's generator for one upload: ``(seed, 7, partition id, round, crc32(phase))``."""
    entropy = [int(seed) & 0xFFFFFFFF, CHANNEL_STREAM, int(partition_id) & 0xFFFFFFFF, int(server_round) & 0xFFFFFFFF,
               zlib.crc32(phase.encode())]
    return np.random.default_rng(entropy)


def transmit_upload(
    arrays: Mapping[str, np.ndarray],
    noise: float,
    missing: float,
    seed: int,
    partition_id: int,
    server_round: int,
    phase: str,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """One training reply through the channel: ``(received arrays, masks)`` (module docstring).

    Float arrays get ``m ⊙ θ + n`` (``σ = noise · mean|θ|`` over all float arrays); the others
    are passed on unchanged and have no mask. Keys keep their order. With ``noise = missing =
    0`` the input mapping's arrays are returned as they are and the mask is ``None``.
    """
    if not (noise > 0 or missing > 0):
        return dict(arrays), None
    floats = {k: v for k, v in arrays.items() if np.issubdtype(np.asarray(v).dtype, np.floating)}
    result = apply_uplink_channel(floats, noise, missing, channel_rng(seed, partition_id, server_round, phase))
    out = {k: (result.arrays[k] if k in floats else v) for k, v in arrays.items()}
    masks = {k: result.masks[k] for k in arrays if k in floats}
    return out, masks


def _config_number(config: Mapping[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"run config {key!r} = {value!r} is not a number")
    return float(value)


def noisy_channel_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower client mod: the reply to a train message passes the noisy uplink (module docstring).

    Reads ``channel.noise`` (``c >= 0``) and ``channel.missing`` (``r ∈ [0, 1]``) and ``seed``
    from ``context.run_config``; adds the ArrayRecord ``wire.MASK_PREFIX + name`` of masks
    beside every corrupted ArrayRecord ``name``.
    """
    from flwr.app import MessageType

    from graphfl.common import wire
    from graphfl.common.records import array_record_names, arrays_record, get_arrays

    reply = call_next(msg, context)
    run = context.run_config
    noise = _config_number(run, wire.CHANNEL_NOISE, 0.0)
    missing = _config_number(run, wire.CHANNEL_MISSING, 0.0)
    if not (noise > 0 or missing > 0) or reply.has_error() or msg.metadata.message_type != MessageType.TRAIN:
        return reply
    seed = int(_config_number(run, wire.RUN_SEED, 0))
    node = context.node_config
    pid = int(node[wire.NODE_PARTITION_ID]) if wire.NODE_PARTITION_ID in node else int(context.node_id)
    server_round, phase = 0, ""
    config = msg.content.config_records.get(wire.CONFIG)
    if config is not None and wire.ROUND in config:
        server_round = int(_config_number(config, wire.ROUND, 0))
        phase = str(config.get(wire.PHASE, "") or "")
    elif msg.metadata.group_id.isdigit():
        server_round = int(msg.metadata.group_id)
    content = reply.content
    for name in [n for n in array_record_names(content) if not n.startswith(wire.MASK_PREFIX)]:
        arrays, masks = transmit_upload(get_arrays(content, name) or {}, noise, missing, seed, pid,
                                        server_round, phase)
        content[name] = arrays_record(arrays)
        if masks is not None:
            content[wire.MASK_PREFIX + name] = arrays_record(masks)
    return reply
