"""Uplink noisy channel of seed 002 (ALGORITHMS.md §8.2; Fukuhara et al. 2025, eq. 10).

Observation model of one client's upload::

    y = m ⊙ θ + n,     m_c ~ Bernoulli(1 − r) i.i.d. per entry,     n ~ N(0, σ² I),
    σ = c · mean(|θ⁰|)

* ``c`` (``noise_coef``) is the paper's scaling factor, ``r`` (``missing_rate``) the missing
  rate of the random binary masks; only the uplink is noisy (the downlink is clean).
* **σ is one scalar per run, from the mean absolute value over the whole parameter vector of
  the common initial model θ⁰** — every entry of every float parameter array, i.e.
  ``Σ_a Σ|θ⁰_a| / Σ_a size(θ⁰_a)`` (arrays weighted by their size), not one σ per array and
  not the upload's own magnitude (ALGORITHMS.md §0.1 C4). Reasons: the seed defines the noise
  level as proportional to "the average absolute value of the initial model parameters", a
  single number for the model, constant over rounds (a model's magnitude grows while it
  trains, so a σ taken from each upload would make the channel noisier round after round);
  the channel adds white noise to the transmitted vector as a whole (AWGN has one power per
  transmission); and per-array σ would give small, near-zero arrays (biases) a tiny σ and
  large weight matrices a large one, i.e. a different noise model.
* Where θ⁰ comes from: graphfl's round loop computes ``mean|θ⁰|`` once from the run's initial
  model and sends it with every train request as the control key :data:`CHANNEL_REF` (one
  float); the mod reads it from the message, the in-process driver from the payload, so both
  engines use the same σ, after a SuperNode restart or a ``--resume`` too.
  :func:`apply_uplink_channel` takes it as ``ref_mean_abs``. Only a request without the key
  (a ServerApp other than graphfl's) falls back to the mean over the upload itself (before
  masking), for raw uploads only.
* The mask is returned (``True`` = received): the server needs it for the fidelity term. With
  ``fill_missing`` (e.g. ``nan``) the missing entries are set to that value instead of
  ``0 + noise``; JGESR treats NaN as missing, so the mask need not travel separately.

Compressed uploads: the channel acts on what is transmitted
-----------------------------------------------------------
The channel is the link, so it acts on the upload as it travels — after the ``[compress]``
codec (:mod:`graphfl.common.compress`), on the codec's parts — and every loss is reported in
the mask over the *model's* entries (key and shape of the model array), which the server's
decoder passes on to the core. Per compressed array:

* ``quant``: each entry's b-bit code is one symbol carrying the value ``v_j = lo + s·q_j`` of
  the change ``d`` (the codec codes ``upload − payload``); the channel gives it ``m_j·v_j + n_j``
  (the same ``m``, ``n``, σ as above) and the receiver, which knows the quantiser's grid,
  decides the nearest level: ``q̃_j = clip(round((m_j·v_j + n_j − lo)/s), 0, 2^b − 1)``. A b-bit
  code stays a b-bit code (the bytes on the wire do not change); noise below half a step
  vanishes, and a one-level grid (a constant array, ``s = 0``) is received exactly. The
  array's side information ``(bits, lo, s, shape)`` is a digital header with a checksum: it is
  not noised, but it is one more symbol and is lost with probability ``r`` — then ``lo = s =
  NaN`` on the wire and the whole array's mask is ``False``. The server's decoder treats a
  lost header, or one that fails its checksum (a corrupted one), as a missing array: decoded
  as the reference (zero change), never as ``lo + NaN·q`` or a constant array.
* ``topk``: the ``k`` transmitted values are the symbols; each gets ``m·v + n`` and a lost one
  is flagged at its index. Entries the codec did not send are not transmitted, so the channel
  cannot lose them: the measured missing fraction is ``r·k/numel``, not ``r``. Indices and
  shape are framing and arrive intact.

Raw float arrays of a compressed upload (empty ones) pass the raw channel; integer arrays
pass unchanged, as without compression.

Wiring (one function, two carriers)
-----------------------------------
:func:`transmit_upload` is the channel of one training reply: raw float arrays pass
:func:`apply_uplink_channel` and compressed arrays :func:`transmit_encoded`, all with the
generator :func:`channel_rng` ``(seed, partition id, round, phase)``; other arrays (integer
buffers) pass unchanged. It is applied by

* :func:`noisy_channel_mod`, a Flower client mod (``ClientApp(mods=[noisy_channel_mod])``;
  graphfl's own ClientApp has it), which works with *any* ClientApp: it reads
  ``channel.noise`` / ``channel.missing`` / ``seed`` from the run config (absent = off), the
  partition id from the node config (else the node id), and round / phase / :data:`CHANNEL_REF`
  from graphfl's control keys (else the message's group id / "" / the upload's mean). Every
  ArrayRecord ``name`` of a reply to a train message is corrupted and the mask travels beside
  it as the ArrayRecord ``wire.MASK_PREFIX + name`` (bool, ``True`` = received), so the server
  knows what is missing;
* the in-process driver (:mod:`graphfl.server.inprocess`), with the same arguments, so an
  in-process run and a deployment see bit-identical uploads.

With the channel off (both 0, the default) the mod returns the reply untouched (no mask
record) and the driver does not call it: un-noised runs are bit-identical to runs without it.
The missing entries carry ``0 + n`` on the wire (finite: the reply passes the round loop's
NaN check); a method that ignores the mask (FedAvg, ...) aggregates them as they are, as in
the seed's experiments.

Determinism: the raw float arrays are processed in sorted name order, then the compressed
arrays in sorted key order. For a raw array the mask is drawn (``rng.random``, only if
``r > 0``) and then the noise (``rng.standard_normal`` in the array's dtype for
float32/float64, in float64 then cast otherwise; only if ``c > 0``); for a quantised array
the header's loss (one ``rng.random()``), the mask, then the noise (float64), only if ``r > 0``
resp. ``c > 0``; for a top-k array the mask of its ``k`` values, then their noise. The same
generator state and inputs therefore give bit-identical outputs, independent of the dict's
insertion order. With ``c = 0`` and ``r = 0`` nothing is drawn and the outputs are exact
copies of the inputs (no ``+ 0.0``, which would turn ``-0.0`` into ``0.0``).
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from graphfl.common import wire
from graphfl.common.compress import QUANT_PARTS, TOPK_PARTS, pack_codes, split_encoded, unpack_codes

if TYPE_CHECKING:  # pragma: no cover
    from flwr.app import Context, Message
    from flwr.clientapp.typing import ClientAppCallable

logger = logging.getLogger(__name__)

CHANNEL_STREAM = 7
"""Stream id of the channel's generator (distinct from the clients' training streams)."""
CHANNEL_REF = "graphfl.channel-ref"
"""Control key of a train request's config: ``mean|θ⁰|`` of the run's common initial model (float),
the reference of the noise scale ``σ = c·mean|θ⁰|`` (module docstring)."""

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


def reference_scale(initial: Mapping[str, np.ndarray], param_keys: Sequence[str] = ()) -> float:
    """``mean|θ⁰|`` of an initial model: over its float ``param_keys`` (all its float arrays when
    ``param_keys`` is empty), the reference of the noise scale (module docstring).
    """
    keys = [k for k in (param_keys or initial) if k in initial]
    return mean_abs({k: initial[k] for k in keys if np.issubdtype(np.asarray(initial[k]).dtype, np.floating)})


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
        ``c >= 0``; ``σ = c · mean|θ⁰|``.
    missing_rate
        ``r ∈ [0, 1]``; each entry is lost independently with probability ``r``.
    rng
        Source of all randomness.
    ref_mean_abs
        ``mean|θ⁰|`` of the common initial model (seed 002); ``None``: of this upload.
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
    ref_mean_abs: float | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """One training reply through the channel: ``(received arrays, masks)`` (module docstring).

    Raw float arrays get ``m ⊙ θ + n``, compressed arrays (:mod:`graphfl.common.compress`) pass
    :func:`transmit_encoded`, both with ``σ = noise · ref_mean_abs`` (``mean|θ⁰|``; ``None``: the
    mean over the raw float arrays, refused for a compressed upload, whose arrays are changes);
    the others are passed on unchanged and have no mask. The masks are keyed by the model's
    keys (a compressed array's mask has the model array's shape). Keys keep their order. With
    ``noise = missing = 0`` the input mapping's arrays are returned as they are and the mask is
    ``None``.
    """
    if not (noise > 0 or missing > 0):
        return dict(arrays), None
    raw, coded = split_encoded(arrays)
    floats = {k: v for k, v in raw.items() if np.issubdtype(np.asarray(v).dtype, np.floating)}
    if ref_mean_abs is None and coded:
        raise ValueError(f"a compressed upload ({len(coded)} arrays) needs the noise reference mean|θ⁰| "
                         f"(control key {CHANNEL_REF!r}, which graphfl's server sends with every train request)")
    rng = channel_rng(seed, partition_id, server_round, phase)
    result = apply_uplink_channel(floats, noise, missing, rng, ref_mean_abs=ref_mean_abs)
    masks: dict[str, np.ndarray] = dict(result.masks)
    sent: dict[str, np.ndarray] = {}
    for key in sorted(coded):
        parts, masks[key] = transmit_encoded(key, coded[key], result.sigma, missing, rng)
        sent.update({f"{wire.COMPRESSED_PREFIX}{key}/{part}": arr for part, arr in parts.items()})
    out = {k: (result.arrays[k] if k in floats else sent.get(k, v)) for k, v in arrays.items()}
    return out, masks


def transmit_encoded(
    key: str, parts: Mapping[str, np.ndarray], sigma: float, missing_rate: float, rng: np.random.Generator,
) -> tuple[dict[str, np.ndarray], BoolArray]:
    """One compressed array through the channel: ``(its parts as received, mask over the model array)``.

    ``parts`` are the codec's parts of ``key`` (``q``, ``bits``, ``lo``, ``step``, ``shape``,
    ``crc`` for quant; ``idx``, ``val``, ``shape`` for top-k); the rules (grid decision, lost
    header, lost top-k values) are in the module docstring. Raises ``ValueError`` naming the key
    when the parts are neither layout.
    """
    got = {p: np.asarray(a) for p, a in parts.items()}
    shape = tuple(int(s) for s in np.asarray(got.get("shape", ())).ravel())
    out = dict(got)
    if QUANT_PARTS <= set(got):
        bits, lo, step = int(got["bits"]), float(got["lo"]), float(got["step"])
        count = int(np.prod(shape)) if shape else 1
        header_lost = missing_rate > 0 and bool(rng.random() < missing_rate)
        mask = np.asarray(rng.random(shape) >= missing_rate) if missing_rate > 0 else np.ones(shape, dtype=bool)
        codes = unpack_codes(got["q"], bits, count).reshape(shape)
        value = np.array(lo + step * codes.astype(np.float64), dtype=np.float64)  # an array also for shape ()
        if missing_rate > 0:
            value[~mask] = 0.0
        if sigma > 0:
            value += sigma * rng.standard_normal(shape)
        levels = (1 << bits) - 1
        with np.errstate(invalid="ignore", divide="ignore"):
            received = np.clip(np.rint((value - lo) / step), 0, levels) if step > 0 else np.zeros(shape)
        out["q"] = pack_codes(received.astype(np.int64), bits)
        if header_lost:
            out["lo"] = np.asarray(np.nan, dtype=np.float64)
            out["step"] = np.asarray(np.nan, dtype=np.float64)
            mask = np.zeros(shape, dtype=bool)
        return out, mask
    if TOPK_PARTS <= set(got):
        idx = got["idx"].astype(np.int64)
        sent_ok = rng.random(idx.size) >= missing_rate if missing_rate > 0 else np.ones(idx.size, dtype=bool)
        val = got["val"].astype(np.float64)
        val[~sent_ok] = 0.0
        if sigma > 0:
            val += sigma * rng.standard_normal(idx.size)
        out["val"] = val.astype(got["val"].dtype)
        mask = np.ones(shape, dtype=bool)
        mask.reshape(-1)[idx[~sent_ok]] = False
        return out, mask
    raise ValueError(f"compressed array {key!r} has parts {sorted(got)}; expected quant or topk parts")


def _config_number(config: Mapping[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"run config {key!r} = {value!r} is not a number")
    return float(value)


def noisy_channel_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower client mod: the reply to a train message passes the noisy uplink (module docstring).

    Reads ``channel.noise`` (``c >= 0``) and ``channel.missing`` (``r ∈ [0, 1]``) and ``seed``
    from ``context.run_config`` and the noise reference :data:`CHANNEL_REF` from the request's
    config; adds the ArrayRecord ``wire.MASK_PREFIX + name`` of masks beside every corrupted
    ArrayRecord ``name``.
    """
    from flwr.app import MessageType

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
    ref: float | None = None
    config = msg.content.config_records.get(wire.CONFIG)
    if config is not None and wire.ROUND in config:
        server_round = int(_config_number(config, wire.ROUND, 0))
        phase = str(config.get(wire.PHASE, "") or "")
    elif msg.metadata.group_id.isdigit():
        server_round = int(msg.metadata.group_id)
    if config is not None and CHANNEL_REF in config:
        ref = _config_number(config, CHANNEL_REF, 0.0)
    content = reply.content
    for name in [n for n in array_record_names(content) if not n.startswith(wire.MASK_PREFIX)]:
        arrays, masks = transmit_upload(get_arrays(content, name) or {}, noise, missing, seed, pid,
                                        server_round, phase, ref_mean_abs=ref)
        content[name] = arrays_record(arrays)
        if masks is not None:
            content[wire.MASK_PREFIX + name] = arrays_record(masks)
    return reply
