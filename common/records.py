"""Conversion between graphfl's named numpy arrays and Flower's ``ArrayRecord``.

Used by both halves of the Flower runtime (the ServerApp's strategy adapter and the
ClientApp), so it lives in the kernel; it imports only ``flwr.app`` (no server code).

Packed wire layout
------------------
Flower 1.41 moves every ``Array`` of a message as its own object, plus one ``ArrayChunk``
object per 5 MB of it, and each object is one request on every hop (ServerApp -> SuperLink
-> SuperNode -> ClientApp and back). A 2-layer MLP's four tensors are therefore 8 of the 12
objects of a message. :func:`arrays_to_record` (``pack=True``, the default) puts all tensors
of a record into **one** ``Array`` under the key :data:`graphfl.common.wire.PACKED`:

``stype = "graphfl.packed.v1"``, ``dtype = "uint8"``, ``shape = (len(data),)`` and ``data`` =

==========  ==========================================================================
bytes       content
==========  ==========================================================================
0..7        magic ``b"GFLPACK1"``
8..11       header length ``h`` (little-endian uint32)
12..12+h    UTF-8 JSON list of ``[name, dtype.str, shape, offset]``, one per tensor, in
            the record's order (``dtype.str`` is numpy's, e.g. ``"<f4"``)
...         zero padding to a multiple of 8, then each tensor's C-order bytes at its
            ``offset`` (relative to the start of this region, each a multiple of 8)
==========  ==========================================================================

:func:`record_to_arrays` reads both this layout and plain records (one ``Array`` per tensor,
what vanilla Flower apps and ``pack=False`` send), and checks every field of a packed header
(dtype kind, shape, bounds, overlap) before it touches the data: a malformed or hostile blob
raises ``ValueError`` naming the problem, never allocates more than the blob's own size.

Inline payloads
---------------
Even packed, a record is three objects on the wire (``ArrayRecord`` -> ``Array`` ->
``ArrayChunk``), each one request per hop. :func:`arrays_record` carries a packed blob of at most
:data:`INLINE_MAX_BYTES` as the single ``bytes`` value :data:`graphfl.common.wire.PACKED` of a
``ConfigRecord`` (one object), stored under the record's usual name; larger ones keep the ``ArrayRecord`` form,
whose 5 MB chunks Flower streams. :func:`get_arrays` reads either form (and plain records).
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from graphfl.common import wire
from graphfl.common.types import Arrays

PACKED_STYPE = "graphfl.packed.v1"
"""``Array.stype`` of a packed record (see the module docstring)."""
_MAGIC = b"GFLPACK1"
_ALIGN = 8
INLINE_MAX_BYTES = 4 * 2**20
"""Largest packed blob sent inline in a ``ConfigRecord`` (below Flower's 5 MB ``ArrayChunk``: a
larger blob would be several chunks, which Flower moves in parallel)."""
_ALLOWED_KINDS = frozenset("biufc")
"""numpy dtype kinds a packed tensor may have: bool, signed/unsigned int, float, complex."""


def _pad(n: int) -> int:
    return -n % _ALIGN


def pack_arrays(arrays: Arrays) -> bytes:
    """Named arrays -> one packed blob (layout in the module docstring); one copy of the data."""
    entries: list[list[object]] = []
    parts: list[np.ndarray] = []
    offset = 0
    for key, value in arrays.items():
        raw = np.asarray(value)
        arr = np.ascontiguousarray(raw).reshape(raw.shape)  # ascontiguousarray makes 0-d arrays 1-d
        if arr.dtype.kind not in _ALLOWED_KINDS:
            raise TypeError(f"array {key!r} has dtype {arr.dtype} (kind {arr.dtype.kind!r}); only numeric "
                            f"and bool arrays cross the wire")
        entries.append([str(key), arr.dtype.str, list(arr.shape), offset])
        parts.append(arr)
        offset += arr.nbytes + _pad(arr.nbytes)
    header = json.dumps(entries, separators=(",", ":")).encode()
    head = _MAGIC + struct.pack("<I", len(header)) + header
    pieces: list[bytes | memoryview] = [head, b"\0" * _pad(len(head))]
    for arr in parts:
        pieces.append(arr.reshape(-1).view(np.uint8).data)
        pieces.append(b"\0" * _pad(arr.nbytes))
    return b"".join(pieces)  # the one copy of the data


def unpack_arrays(data: bytes | bytearray | memoryview, copy: bool = True) -> Arrays:
    """One packed blob -> named arrays (record order kept).

    Parameters
    ----------
    data
        The packed blob (layout in the module docstring).
    copy
        ``True`` (default): each array is a writable copy, independent of ``data``. ``False``:
        each array is a **read-only view** into ``data`` (no copy of the tensor bytes; writing to
        it raises ``ValueError``), for a caller that only reads the arrays. A view keeps the whole
        blob alive as long as any of its arrays lives, and ``torch.as_tensor`` of a view would
        share (and let torch write) the blob's memory: copy before handing a view to code that
        keeps or writes it.

    Raises
    ------
    ValueError
        If the blob is not a packed record or any header field is invalid (names the field).
    """
    view = memoryview(data).cast("B")
    if not copy:
        view = view.toreadonly()  # a bytearray's or writable memoryview's views are read-only too
    total = len(view)
    if total < 12 or bytes(view[:8]) != _MAGIC:
        raise ValueError("packed arrays: missing the GFLPACK1 magic")
    (hlen,) = struct.unpack("<I", view[8:12])
    if 12 + hlen > total:
        raise ValueError(f"packed arrays: header length {hlen} exceeds the blob ({total} bytes)")
    try:
        entries = json.loads(bytes(view[12:12 + hlen]).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"packed arrays: header is not JSON ({exc})") from None
    if not isinstance(entries, list):
        raise ValueError("packed arrays: header is not a list")
    base = 12 + hlen + _pad(12 + hlen)
    region = total - base
    out: Arrays = {}
    end_prev = 0
    for i, entry in enumerate(entries):
        if not (isinstance(entry, list) and len(entry) == 4):
            raise ValueError(f"packed arrays: header entry {i} is not [name, dtype, shape, offset]")
        name, dtype_str, shape, offset = entry
        if not isinstance(name, str) or name in out:
            raise ValueError(f"packed arrays: entry {i} has a missing or repeated name {name!r}")
        try:
            dtype = np.dtype(dtype_str) if isinstance(dtype_str, str) else None
        except (TypeError, ValueError):
            dtype = None
        if dtype is None or dtype.kind not in _ALLOWED_KINDS or dtype.hasobject:
            raise ValueError(f"packed arrays: array {name!r} has an unsupported dtype {dtype_str!r}")
        if not (isinstance(shape, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                for s in shape)):
            raise ValueError(f"packed arrays: array {name!r} has an invalid shape {shape!r}")
        nbytes = math.prod(shape) * dtype.itemsize
        if not (isinstance(offset, int) and offset >= end_prev and offset % _ALIGN == 0
                and offset + nbytes <= region):
            raise ValueError(f"packed arrays: array {name!r} ({nbytes} bytes at offset {offset!r}) lies outside "
                             f"the {region}-byte data region or overlaps the previous array")
        start = base + offset
        arr = np.frombuffer(view[start:start + nbytes], dtype=dtype).reshape(shape)
        out[name] = arr.copy() if copy else arr
        end_prev = offset + nbytes
    return out


def arrays_to_record(arrays: Arrays, pack: bool = True) -> ArrayRecord:
    """Named numpy arrays -> ``ArrayRecord``.

    With ``pack`` (default) all arrays travel as one ``Array`` (module docstring); without it,
    one ``Array`` per tensor (order kept; arrays made contiguous; 0-d arrays stay 0-d), the form
    to hand to code that reads the record itself (e.g. a Flower ``Result``).
    """
    if pack:
        return _packed_array_record(pack_arrays(arrays))
    rec = ArrayRecord()
    for key, value in arrays.items():
        arr = np.asarray(value)
        rec[key] = Array(np.ascontiguousarray(arr).reshape(arr.shape))  # keeps 0-d arrays 0-d
    return rec


def record_to_arrays(record: ArrayRecord, copy: bool = True) -> Arrays:
    """``ArrayRecord`` (packed or one ``Array`` per tensor) -> numpy dict (order kept).

    ``copy=False`` gives read-only views into a packed record's blob (:func:`unpack_arrays`);
    a plain record's arrays are always new arrays (``Array.numpy`` deserialises each).

    Raises
    ------
    ValueError
        A malformed packed record, or a packed ``Array`` mixed with other keys.
    TypeError
        An ``Array`` of a serialisation type numpy cannot read.
    """
    packed = record.get(wire.PACKED)
    if packed is not None and packed.stype == PACKED_STYPE:
        if len(record) != 1:
            raise ValueError(f"packed arrays: the record holds {sorted(record)} besides {wire.PACKED!r}")
        return unpack_arrays(packed.data, copy=copy)
    return {key: arr.numpy() for key, arr in record.items()}


def _packed_array_record(blob: bytes) -> ArrayRecord:
    rec = ArrayRecord()
    rec[wire.PACKED] = Array(dtype="uint8", shape=(len(blob),), stype=PACKED_STYPE, data=blob)
    return rec


def arrays_record(arrays: Arrays, inline_max: int = INLINE_MAX_BYTES) -> ConfigRecord | ArrayRecord:
    """The record that carries ``arrays`` on the wire: inline (a ``ConfigRecord`` whose one value
    :data:`graphfl.common.wire.PACKED` is the packed blob, one Flower object) when the blob has at
    most ``inline_max`` bytes, else a packed ``ArrayRecord`` (module docstring). Store it in a
    message's ``RecordDict`` under any name; :func:`get_arrays` reads it back.
    """
    blob = pack_arrays(arrays)
    if len(blob) <= inline_max:
        return ConfigRecord({wire.PACKED: blob})
    return _packed_array_record(blob)


def get_arrays(content: RecordDict, name: str, copy: bool = True) -> Arrays | None:
    """The arrays stored under ``name`` by :func:`arrays_record` (either form) or as a plain
    ``ArrayRecord``; ``None`` when ``content`` has no record of that name.

    ``copy=False``: read-only views into the packed blob where there is one (:func:`unpack_arrays`
    says what a view costs and forbids).

    Raises
    ------
    ValueError
        A malformed packed blob, an inline record that is not exactly one ``bytes`` value under
        :data:`graphfl.common.wire.PACKED`, or a packed ``Array`` mixed with other keys.
    TypeError
        An ``Array`` of a serialisation type numpy cannot read.
    """
    if name in content.array_records:
        return record_to_arrays(content.array_records[name], copy=copy)
    if name in content.config_records:
        rec = content.config_records[name]
        blob = rec.get(wire.PACKED)
        if len(rec) != 1 or not isinstance(blob, bytes):
            raise ValueError(f"inline arrays {name!r}: expected one bytes value under {wire.PACKED!r}, "
                             f"got keys {sorted(rec)}")
        return unpack_arrays(blob, copy=copy)
    return None


def array_record_names(content: RecordDict) -> list[str]:
    """Names in ``content`` that hold arrays: ``ArrayRecord``s and inline records (:func:`arrays_record`)."""
    return [name for name, rec in content.items()
            if isinstance(rec, ArrayRecord) or (isinstance(rec, ConfigRecord) and wire.PACKED in rec)]
