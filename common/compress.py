"""Compression of client uploads (FedCOMGATE style), as an option of every strategy.

ALGORITHMS.md §9.2 (compressor ``Q``; Haddadpour et al., AISTATS 2021, §3 "FedCOMGATE").
The codec is part of the kernel, not of an algorithm: the client's request handler encodes
the arrays a trainer uploads and the server's round loop decodes them before validation, so
a :class:`~graphfl.common.core.ServerCore` only ever sees ordinary (decoded) arrays. With
``compress.kind = none`` nothing is encoded and the path is bit-identical to no codec.

What is compressed is the *change* against what the client received: for an upload key that
the client's payload also holds (same shape, floating point), ``d = upload − payload``; for
other float keys ``d = upload`` (the reference is 0). The server holds the very payload it
sent, so it adds the same reference back. Non-float arrays (e.g. BatchNorm's
``num_batches_tracked``) travel raw.

Compressors
-----------
``quant`` — unbiased b-bit stochastic quantisation (per array). With ``lo = min d``,
``s = (max d − min d)/(2^b − 1)``: ``q = ⌊(d − lo)/s + U⌋``, ``U ~ U[0, 1)`` i.i.d., and
``Q(d) = lo + s q``. Then ``E[Q(d)] = d`` and ``|Q(d) − d| ≤ s`` entrywise (the
"range/(2^b − 1)" bound). No memory is needed (the compressor is unbiased).

``topk`` — top-k sparsification with error memory (error feedback; FedTorch keeps the same
per-client memory tensor): with memory ``e`` (persistent client state, 0 initially),
``c = d + e``; keep the ``k = max(1, round(ratio·numel))`` entries of largest ``|c|``
(ties: lower flat index first), ``Q(d) = topk(c)``; ``e ← c − topk(c)``.

Wire layout (one ArrayRecord, keys under :data:`graphfl.common.wire.COMPRESSED_PREFIX`):
``<P><key>/q`` the codes bit-packed, ``b`` bits each (uint8, ``⌈numel·b/8⌉`` bytes),
``<P><key>/bits`` (uint8 scalar), ``<P><key>/lo`` and ``<P><key>/step`` (float64 scalars),
``<P><key>/shape`` (int64) and ``<P><key>/crc`` (int64 scalar: CRC-32 of the header, see
:func:`header_crc`) for ``quant``; ``<P><key>/idx`` (int32 flat indices),
``<P><key>/val`` (values in the array's dtype) and ``<P><key>/shape`` (int64) for ``topk``.

Side information and the noisy uplink
-------------------------------------
A quantised array's codes mean nothing without its *header* ``(bits, lo, step, shape)``: a
wrong ``step`` turns every entry into one constant, a wrong ``lo`` shifts them all. The header
therefore carries a checksum, and the uplink channel (:mod:`graphfl.client.noisy_channel`),
which acts on what is transmitted, erases a header as one symbol (``lo = step = NaN``).
:func:`decode_received` checks every header (finite ``lo``, finite ``step >= 0``, the
checksum): for an upload that passed the channel (it carries a mask) an array with a bad header
is *missing as a whole* — decoded as the reference (a zero change), its mask all ``False``, its
key listed in :attr:`Received.lost` — while an upload without a mask, whose header cannot have
been lost on the way, is refused (``ValueError`` naming the key). Entries lost one by one keep
the codes the channel wrote for them and are flagged by the mask, which decoding passes on.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from graphfl.common import wire
from graphfl.common.config import COMPRESS_KINDS, CompressConfig
from graphfl.common.types import Arrays, ClientState

MEMORY_PREFIX = "compress.err/"
"""Client-state keys of the top-k error memory (one array per compressed key)."""


def quantize(x: np.ndarray, bits: int, rng: np.random.Generator) -> tuple[np.ndarray, float, float]:
    """Unbiased b-bit stochastic quantisation of ``x`` (see the module doc).

    Returns ``(codes, lo, step)`` with ``x ≈ lo + step·codes``; ``step = 0`` for a constant
    array (then every code is 0 and the round trip is exact).
    """
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must be in 1..16, got {bits}")
    xf = np.asarray(x, dtype=np.float64)
    levels = (1 << bits) - 1
    dtype = np.uint8 if bits <= 8 else np.uint16
    if xf.size == 0:
        return np.zeros(xf.shape, dtype=dtype), 0.0, 0.0
    lo, hi = float(xf.min()), float(xf.max())
    step = (hi - lo) / levels
    if step <= 0.0 or not np.isfinite(step):
        return np.zeros(xf.shape, dtype=dtype), lo, 0.0
    y = (xf - lo) / step
    q = np.floor(y + rng.random(xf.shape))
    return np.clip(q, 0, levels).astype(dtype), lo, step


def dequantize(codes: np.ndarray, lo: float, step: float) -> np.ndarray:
    """``lo + step·codes`` in float64."""
    return lo + step * np.asarray(codes, dtype=np.float64)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes (< 2^bits) as a uint8 bit stream, ``bits`` bits per code, most significant first."""
    flat = np.asarray(codes, dtype=np.uint32).ravel()
    shifts = np.arange(bits - 1, -1, -1, dtype=np.uint32)
    planes = ((flat[:, None] >> shifts) & 1).astype(np.uint8)
    packed: np.ndarray = np.packbits(planes.ravel())
    return packed


def unpack_codes(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`: ``count`` codes as int64."""
    planes = np.unpackbits(np.asarray(packed, dtype=np.uint8), count=count * bits).reshape(count, bits)
    weights = (1 << np.arange(bits - 1, -1, -1)).astype(np.int64)
    out: np.ndarray = planes.astype(np.int64) @ weights
    return out


def topk_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Flat indices of the ``k`` entries of largest ``|x|``, ascending (ties: lower index first)."""
    flat = np.abs(np.asarray(x, dtype=np.float64)).ravel()
    k = int(min(max(k, 0), flat.size))
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((np.arange(flat.size), -flat))  # by |x| descending, then index ascending
    return np.sort(order[:k])


def topk_count(numel: int, ratio: float) -> int:
    """``k = max(1, round(ratio·numel))``, at most ``numel`` (0 for an empty array)."""
    if numel == 0:
        return 0
    return int(min(numel, max(1, round(ratio * numel))))


def header_crc(bits: int, lo: float, step: float, shape: tuple[int, ...]) -> int:
    """CRC-32 of a quantised array's header: ``bits`` (uint8), ``lo`` and ``step`` (float64),
    ``shape`` (int64 each), in that order (NaN and a flipped bit both change it).
    """
    blob = (np.asarray(bits, dtype=np.uint8).tobytes() + np.asarray(lo, dtype=np.float64).tobytes()
            + np.asarray(step, dtype=np.float64).tobytes() + np.asarray(shape, dtype=np.int64).tobytes())
    return zlib.crc32(blob)


def _reference(key: str, up: np.ndarray, reference: Mapping[str, np.ndarray]) -> np.ndarray | None:
    ref = reference.get(key)
    if ref is None or ref.shape != up.shape or ref.dtype.kind != "f":
        return None
    return ref


@dataclass(frozen=True)
class Encoded:
    """The result of :func:`encode`: what goes on the wire and what the server will decode."""

    wire_arrays: Arrays
    decoded: Arrays


def encode(
    arrays: Arrays, reference: Mapping[str, np.ndarray], cfg: CompressConfig,
    rng: np.random.Generator, state: ClientState,
) -> Encoded:
    """Encode an upload (client side); updates the top-k error memory in ``state`` in place.

    ``decoded`` equals what :func:`decode` returns on the server for ``wire_arrays`` and the
    same ``reference`` (a trainer may need ``Q(Δ_i)``, e.g. FedGATE's δ update).
    """
    if cfg.kind == "none":
        return Encoded(arrays, arrays)
    out: Arrays = {}
    decoded: Arrays = {}
    for key, up in arrays.items():
        up = np.asarray(up)
        if up.dtype.kind != "f" or up.size == 0:
            out[key] = up
            decoded[key] = up
            continue
        ref = _reference(key, up, reference)
        d = up.astype(np.float64) - (0.0 if ref is None else ref.astype(np.float64))
        p = wire.COMPRESSED_PREFIX + key
        if cfg.kind == "quant":
            codes, lo, step = quantize(d, cfg.bits, rng)
            out[p + "/q"] = pack_codes(codes, cfg.bits)
            out[p + "/bits"] = np.asarray(cfg.bits, dtype=np.uint8)
            out[p + "/lo"] = np.asarray(lo, dtype=np.float64)
            out[p + "/step"] = np.asarray(step, dtype=np.float64)
            out[p + "/shape"] = np.asarray(up.shape, dtype=np.int64)
            out[p + "/crc"] = np.asarray(header_crc(cfg.bits, lo, step, up.shape), dtype=np.int64)
            qd = dequantize(codes, lo, step)
        elif cfg.kind == "topk":
            mkey = MEMORY_PREFIX + key
            mem = state.get(mkey)
            c = d + (np.asarray(mem, dtype=np.float64) if mem is not None and mem.shape == d.shape else 0.0)
            idx = topk_indices(c, topk_count(c.size, cfg.k))
            vals = c.ravel()[idx].astype(up.dtype)
            out[p + "/idx"] = idx.astype(np.int32)
            out[p + "/val"] = vals
            out[p + "/shape"] = np.asarray(up.shape, dtype=np.int64)
            qd = np.zeros(c.size)
            qd[idx] = vals.astype(np.float64)
            qd = qd.reshape(up.shape)
            state[mkey] = (c - qd).astype(up.dtype)
        else:  # pragma: no cover - CompressConfig validates the choices
            raise ValueError(f"compress.kind = {cfg.kind!r} is not one of {list(COMPRESS_KINDS)}")
        decoded[key] = _add_reference(qd, ref, up.dtype)
    return Encoded(out, decoded)


def _add_reference(d: np.ndarray, ref: np.ndarray | None, dtype: np.dtype) -> np.ndarray:
    return (d if ref is None else ref.astype(np.float64) + d).astype(dtype)


def is_encoded(arrays: Mapping[str, np.ndarray] | None) -> bool:
    """Whether an upload carries compressed arrays."""
    return bool(arrays) and any(k.startswith(wire.COMPRESSED_PREFIX) for k in arrays or {})


QUANT_PARTS = frozenset({"q", "bits", "lo", "step", "shape", "crc"})
TOPK_PARTS = frozenset({"idx", "val", "shape"})


def split_encoded(arrays: Mapping[str, np.ndarray]) -> tuple[Arrays, dict[str, dict[str, np.ndarray]]]:
    """``(raw arrays, {key: {part: array}})``: an upload's plain arrays and its compressed parts
    grouped by the model key they encode (keys keep the upload's order).
    """
    raw: Arrays = {}
    parts: dict[str, dict[str, np.ndarray]] = {}
    for key, arr in arrays.items():
        if key.startswith(wire.COMPRESSED_PREFIX):
            base, _, part = key[len(wire.COMPRESSED_PREFIX):].rpartition("/")
            parts.setdefault(base, {})[part] = np.asarray(arr)
        else:
            raw[key] = arr
    return raw, parts


def header_problem(got: Mapping[str, np.ndarray], shape: tuple[int, ...]) -> str | None:
    """Why a quantised array's header is unusable (lost, corrupted, or not this array's), or ``None``."""
    try:
        bits, lo, step = int(got["bits"]), float(got["lo"]), float(got["step"])
        crc = int(got["crc"])
    except (TypeError, ValueError) as exc:
        return f"header is not scalars ({exc})"
    if not (math.isfinite(lo) and math.isfinite(step) and step >= 0):
        return f"header lo = {lo!r}, step = {step!r} (lost or corrupted)"
    if crc != header_crc(bits, lo, step, shape):
        return "header fails its checksum (corrupted on the way)"
    return None


@dataclass
class Received:
    """The result of :func:`decode_received`."""

    arrays: Arrays
    """Every key decoded (a lost array as its reference)."""
    mask: Arrays | None
    """The channel's mask with the lost arrays all ``False`` (``None`` when there was none)."""
    lost: list[str] = field(default_factory=list)
    """Keys whose side information was lost or corrupted (missing as a whole)."""


def decode(arrays: Arrays, reference: Mapping[str, np.ndarray], template: Mapping[str, np.ndarray]) -> Arrays:
    """Decode an upload (server side) given the payload the client received.

    ``template`` (the phase's reply template) gives each key's dtype and shape. Raises
    ``ValueError`` naming the key when the encoded parts are missing or inconsistent, or a
    quantised array's header is unusable (an upload without a channel mask cannot have lost it).
    """
    return decode_received(arrays, reference, template, None).arrays


def decode_received(
    arrays: Arrays, reference: Mapping[str, np.ndarray], template: Mapping[str, np.ndarray], mask: Arrays | None,
) -> Received:
    """Decode an upload that may have passed the noisy uplink (module docstring).

    ``mask`` is the channel's received-entry mask of the upload (model keys), or ``None``. A
    quantised array with an unusable header is missing as a whole when ``mask`` covers its key
    (decoded as its reference, mask all ``False``), else a ``ValueError`` naming the key. The
    returned mask is a new dict; ``mask`` is not modified.
    """
    out, parts = split_encoded(arrays)
    new_mask = dict(mask) if mask is not None else None
    lost: list[str] = []
    for key, got in parts.items():
        ref_t = template.get(key)
        if ref_t is None:
            raise ValueError(f"compressed array {key!r} is not part of the model")
        dtype, shape = np.asarray(ref_t).dtype, np.asarray(ref_t).shape
        ref = reference.get(key)
        use_ref = ref is not None and np.asarray(ref).shape == shape and np.asarray(ref).dtype.kind == "f"
        if QUANT_PARTS <= set(got):
            d = _dequantized(key, got, shape)
            why = header_problem(got, shape)
            if why is not None:
                if new_mask is None or key not in new_mask:
                    raise ValueError(f"compressed array {key!r}: {why}")
                new_mask[key] = np.zeros(shape, dtype=bool)
                lost.append(key)
                d = np.zeros(shape)
        elif TOPK_PARTS <= set(got):
            d = _sparse(key, got)
        else:
            raise ValueError(f"compressed array {key!r} has parts {sorted(got)}; expected {sorted(QUANT_PARTS)} "
                             f"(quant) or {sorted(TOPK_PARTS)} (topk)")
        if d.shape != shape:
            raise ValueError(f"compressed array {key!r} has shape {d.shape}, the model's is {shape}")
        out[key] = _add_reference(d, np.asarray(ref) if use_ref else None, dtype)
    return Received(out, new_mask, lost)


def _dequantized(key: str, got: Mapping[str, np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """``lo + step·codes`` of a quantised array (checks the codes and the declared shape)."""
    if got["q"].dtype != np.uint8:
        raise ValueError(f"compressed array {key!r}: codes have dtype {got['q'].dtype}, expected uint8")
    declared = tuple(int(s) for s in np.asarray(got["shape"]).ravel())
    if declared != shape:
        raise ValueError(f"compressed array {key!r} declares shape {declared}, the model's is {shape}")
    bits = int(got["bits"])
    count = int(np.prod(shape)) if shape else 1
    if not 1 <= bits <= 16 or got["q"].size * 8 < count * bits:
        raise ValueError(f"compressed array {key!r}: {got['q'].size} bytes cannot hold {count} "
                         f"codes of {bits} bits")
    codes = unpack_codes(got["q"], bits, count).reshape(shape)
    with np.errstate(invalid="ignore"):  # a lost header (NaN) is reported by header_problem
        return dequantize(codes, float(got["lo"]), float(got["step"]))


def _sparse(key: str, got: Mapping[str, np.ndarray]) -> np.ndarray:
    """The dense change of a top-k array (checks the indices against the declared shape)."""
    shape = tuple(int(s) for s in got["shape"])
    size = int(np.prod(shape)) if shape else 1
    if got["idx"].dtype.kind not in "iu":
        raise ValueError(f"compressed array {key!r}: indices have dtype {got['idx'].dtype}")
    idx = got["idx"].astype(np.int64)
    if idx.size != got["val"].size or (idx.size and (idx.min() < 0 or idx.max() >= size)):
        raise ValueError(f"compressed array {key!r}: indices do not fit shape {shape}")
    flat = np.zeros(size)
    flat[idx] = got["val"].astype(np.float64)
    return flat.reshape(shape)
