"""Tensors <-> protobuf frames: dtype + shape + raw little-endian bytes, never pickle.

A *message* is (sender, round, channel, named arrays, scalars). On the wire it is a stream of
:class:`Frame` s: one ``header`` frame (tensor specs and scalars) followed by ``data`` frames of
at most ``chunk_bytes`` bytes each, so a message of any size passes gRPC's 4 MB limit. Every
frame repeats sender, round and channel.

Decoding checks everything it can before allocating: a known dtype, sane shapes, declared
sizes that match ``prod(shape) * itemsize``, a total under ``max_bytes``, frames that agree
on sender/round/channel, and exactly the declared number of bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from graphfl.p2p.proto import graphfl_p2p_pb2 as pb

SUPPORTED_DTYPES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
)
DEFAULT_CHUNK_BYTES = 4 << 20
"""Tensor bytes per data frame. 4 MiB: a 1M-parameter float32 tensor is one frame; fewer, larger
frames cost gRPC less per byte (a 4-peer ring of 1M parameters: 6 % less CPU per round than with
1 MiB frames, docs/p2p.md "Third look: CPU per round"). Receivers accept frames of ``chunk-bytes`` +
1 MiB (gRPC's own default limit is 4 MB)."""
DEFAULT_MAX_BYTES = 1 << 34
MAX_NDIM = 32


class WireError(ValueError):
    """A message is malformed; the text says what is wrong (and the peer keeps running)."""


@dataclass
class Message:
    """A decoded message."""

    sender: int
    round: int
    channel: str
    arrays: dict[str, np.ndarray]
    scalars: dict[str, float] = field(default_factory=dict)
    wire_bytes: int = 0

    @property
    def payload_bytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays.values()))


def _le(arr: np.ndarray) -> np.ndarray:
    a = np.asarray(arr)
    if a.dtype.name not in SUPPORTED_DTYPES:
        raise WireError(f"dtype {a.dtype} is not supported on the wire; supported: {list(SUPPORTED_DTYPES)}")
    return a.astype(a.dtype.newbyteorder("<"), order="C", copy=False)  # keeps 0-d arrays 0-d


def check_encodable(channel: str, arrays: Mapping[str, np.ndarray]) -> None:
    """Raise :class:`WireError` (naming the tensor) if a tensor of ``arrays`` cannot go on the wire."""
    if not channel:
        raise WireError("a message needs a non-empty channel name")
    for name, a in arrays.items():
        dt = np.asarray(a).dtype
        if dt.name not in SUPPORTED_DTYPES:
            raise WireError(f"channel {channel!r}: tensor {name!r} has dtype {dt}, which the wire cannot carry; "
                            f"supported: {list(SUPPORTED_DTYPES)}")


def _header_frame(sender: int, round_: int, channel: str, prepared: list[tuple[str, np.ndarray]],
                  scalars: Mapping[str, float] | None) -> pb.Frame:
    header = pb.Header(
        tensors=[pb.TensorSpec(name=name, dtype=a.dtype.name, shape=list(a.shape), nbytes=a.nbytes)
                 for name, a in prepared],
        scalars={k: float(v) for k, v in (scalars or {}).items()},
    )
    return pb.Frame(sender=sender, round=round_, channel=channel, header=header)


def _prepare(arrays: Mapping[str, np.ndarray], chunk_bytes: int) -> list[tuple[str, np.ndarray]]:
    """``(name, little-endian contiguous array)`` in message order; checks ``chunk_bytes``."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    return [(name, _le(a)) for name, a in arrays.items()]


def _chunks(prepared: list[tuple[str, np.ndarray]], chunk_bytes: int) -> Iterator[memoryview]:
    """The data chunks of a message: each array's bytes in order, ``<= chunk_bytes`` each, as views."""
    for _, a in prepared:
        view = a.reshape(-1).view(np.uint8).data
        for start in range(0, a.nbytes, chunk_bytes):
            yield view[start: start + chunk_bytes]


def encode(
    sender: int,
    round_: int,
    channel: str,
    arrays: Mapping[str, np.ndarray],
    scalars: Mapping[str, float] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[pb.Frame]:
    """Frames of one message: a header frame, then data frames of ``<= chunk_bytes`` bytes."""
    prepared = _prepare(arrays, chunk_bytes)
    yield _header_frame(sender, round_, channel, prepared, scalars)
    for chunk in _chunks(prepared, chunk_bytes):
        yield pb.Frame(sender=sender, round=round_, channel=channel, data=bytes(chunk))


_DATA_TAG = bytes([(5 << 3) | 2])
"""Protobuf key of ``Frame.data`` (field 5, length-delimited)."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_serialized(
    sender: int,
    round_: int,
    channel: str,
    arrays: Mapping[str, np.ndarray],
    scalars: Mapping[str, float] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> list[bytes]:
    """The frames of :func:`encode`, serialised, with one copy of the tensor bytes.

    ``pb.Frame(..., data=chunk).SerializeToString()`` copies every chunk three times (slice to
    ``bytes``, into the message, out to the wire string). Protobuf writes fields in field-number
    order, and ``data`` (field 5) is the last one set, so a data frame is exactly
    ``Frame(sender, round, channel)`` serialised, then the key of field 5, the chunk's length as a
    varint, and the chunk: built here with one ``bytes.join``. The result is byte-for-byte what
    :func:`encode` + ``SerializeToString`` gives (tested), so the wire format is unchanged.
    """
    prepared = _prepare(arrays, chunk_bytes)
    out = [_header_frame(sender, round_, channel, prepared, scalars).SerializeToString()]
    prefix = pb.Frame(sender=sender, round=round_, channel=channel).SerializeToString() + _DATA_TAG
    out += [b"".join((prefix, _varint(len(chunk)), chunk)) for chunk in _chunks(prepared, chunk_bytes)]
    return out


def _read_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """(value, next position) of the varint at ``pos``; ``ValueError`` past 10 bytes or the end."""
    value = shift = 0
    for i in range(pos, min(pos + 10, len(buf))):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i + 1
        shift += 7
    raise ValueError("truncated or over-long varint")


@dataclass(frozen=True)
class DataFrame:
    """A ``Frame`` carrying ``data``, parsed without copying the chunk (see :func:`parse_frame`).

    Offers the part of ``pb.Frame`` the :class:`Assembler` reads: ``sender``, ``round``,
    ``channel``, ``data`` (a ``memoryview`` into the received bytes), ``WhichOneof("body")`` and
    ``ByteSize()``.
    """

    sender: int
    round: int
    channel: str
    data: memoryview
    size: int

    def WhichOneof(self, name: str) -> str | None:
        return "data" if name == "body" else None

    def ByteSize(self) -> int:
        return self.size


def data_prefix(head: bytes | memoryview, frame_len: int) -> tuple[int, int, str, int] | None:
    """``(sender, round, channel, offset of the data)`` of a data frame whose first bytes are ``head``.

    ``frame_len`` is the whole frame's length (``head`` may be only its start, as long as it
    holds the fields before the data). ``None`` unless the frame is one :func:`encode_serialized`
    writes: fields 1, 2, 3 each at most once and in order, then field 5 running exactly to
    ``frame_len``. Everything else (a header frame, another field order, unknown fields, invalid
    UTF-8 in ``channel``, a prefix longer than ``head``) is left to protobuf.
    """
    try:
        pos, end = 0, len(head)
        sender = round_ = 0
        channel = ""
        if pos < end and head[pos] == 0x08:
            value, pos = _read_varint(head, pos + 1)
            sender = ((value & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000  # int32: the low 32 bits, signed
        if pos < end and head[pos] == 0x10:
            value, pos = _read_varint(head, pos + 1)
            round_ = ((value & 0xFFFFFFFFFFFFFFFF) ^ (1 << 63)) - (1 << 63)  # int64, signed
        if pos < end and head[pos] == 0x1A:
            length, pos = _read_varint(head, pos + 1)
            if pos + length > end:
                return None
            channel = bytes(head[pos:pos + length]).decode("utf-8")
            pos += length
        if pos < end and head[pos] == _DATA_TAG[0]:
            length, start = _read_varint(head, pos + 1)
            if start <= end and start + length == frame_len:
                return sender, round_, channel, start
    except (ValueError, UnicodeDecodeError, IndexError):
        pass
    return None


def parse_frame(raw: bytes) -> pb.Frame | DataFrame:
    """Deserialiser of ``Push`` frames: a data frame as a zero-copy :class:`DataFrame`, any other
    frame through protobuf.

    ``pb.Frame.FromString`` copies a chunk into its arena, reading ``.data`` copies it again into
    a ``bytes``, and the :class:`Assembler` copies it into the message buffer: three copies of
    every byte received. A data frame as :func:`encode_serialized` writes it (fields 1, 2, 3 each
    at most once and in order, then field 5 running exactly to the end) is read here directly and
    only the :class:`Assembler` copies it. Anything else — a header, fields in another order,
    unknown fields, a repeated field, invalid UTF-8 in ``channel`` — goes to protobuf, so what is
    accepted and what is refused is protobuf's (tested against it).
    """
    prefix = data_prefix(raw, len(raw))
    if prefix is not None:
        sender, round_, channel, start = prefix
        return DataFrame(sender, round_, channel, memoryview(raw)[start:], len(raw))
    return pb.Frame.FromString(raw)


class Assembler:
    """Incremental decoder: feed frames in order, then :meth:`finish`.

    A tensor that arrives in one frame (with the default 4 MiB frames, every tensor up to 1M
    float32 parameters) is returned as a view of that frame's bytes: no copy. A tensor spread
    over several frames is copied into one buffer, or received into it in place (:meth:`target`).
    Every returned array is **read-only** (mixing and every algorithm build new arrays).

    Parameters
    ----------
    max_bytes
        Largest total payload accepted (checked on the header, before allocating).
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.sender: int | None = None
        self.round: int | None = None
        self.channel: str | None = None
        self.scalars: dict[str, float] = {}
        self._specs: list[tuple[str, np.dtype, tuple[int, ...], int]] = []
        self._bufs: list[np.ndarray | None] = []
        self._idx = 0
        self._off = 0
        self.wire_bytes = 0

    def header(self, frame: pb.Frame | DataFrame) -> None:
        if isinstance(frame, DataFrame) or frame.WhichOneof("body") != "header":
            raise WireError("the first frame of a message must be a header")
        self.sender, self.round, self.channel = int(frame.sender), int(frame.round), str(frame.channel)
        if self.round < 0:
            raise WireError(f"round must be >= 0, got {self.round}")
        if not self.channel:
            raise WireError("message has an empty channel")
        total = 0
        names = set()
        for spec in frame.header.tensors:
            if spec.dtype not in SUPPORTED_DTYPES:
                raise WireError(f"tensor {spec.name!r}: dtype {spec.dtype!r} not supported")
            if not spec.name:
                raise WireError("a tensor without a name")
            if spec.name in names:
                raise WireError(f"tensor {spec.name!r} appears twice")
            names.add(spec.name)
            if len(spec.shape) > MAX_NDIM or any(d < 0 for d in spec.shape):
                raise WireError(f"tensor {spec.name!r}: invalid shape {list(spec.shape)}")
            dt = np.dtype(spec.dtype).newbyteorder("<")
            expect = math.prod(spec.shape) * dt.itemsize
            if spec.nbytes != expect:
                raise WireError(
                    f"tensor {spec.name!r}: declares {spec.nbytes} bytes but shape {list(spec.shape)} "
                    f"of {spec.dtype} needs {expect}"
                )
            total += expect
            if total > self.max_bytes:
                raise WireError(f"message payload exceeds the limit of {self.max_bytes} bytes")
            self._specs.append((spec.name, dt, tuple(int(d) for d in spec.shape), expect))
        for k, v in frame.header.scalars.items():
            self.scalars[str(k)] = float(v)
        self.wire_bytes += frame.ByteSize()

    @property
    def declared(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The tensors the header declares: ``{name: (dtype name, shape)}`` (nothing allocated yet)."""
        return {name: (dt.newbyteorder("=").name, shape) for name, dt, shape, _ in self._specs}

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data the header declares."""
        return sum(nb for *_, nb in self._specs)

    @property
    def allocated(self) -> bool:
        """Whether the receive buffers exist (they are made only by :meth:`allocate`)."""
        return len(self._bufs) == len(self._specs) and (bool(self._bufs) or not self._specs)

    def allocate(self) -> None:
        """Allocate the receive buffers the header declared.

        Receivers call this only after checking who sent the header and that the declared
        tensors are the ones the algorithm expects, so a crafted header costs no memory.
        """
        if self.sender is None:
            raise WireError("allocate() before the header frame")
        if not self._bufs:
            # made per tensor on its first frame (data()): a view of that frame when it holds the
            # whole tensor, else uninitialised memory (no calloc pass over the model) that finish()
            # returns only once every byte has been written from the wire
            self._bufs = [np.empty(0, dtype=np.uint8) if nb == 0 else None for *_, nb in self._specs]
            self._skip_empty()

    @property
    def complete(self) -> bool:
        """Whether every byte the header declared has arrived (a stream-less reader's end of message)."""
        return self.sender is not None and self.allocated and self._idx >= len(self._specs)

    def _skip_empty(self) -> None:
        while self._idx < len(self._specs) and self._off == self._specs[self._idx][3]:
            self._idx += 1
            self._off = 0

    def data(self, frame: pb.Frame | DataFrame) -> None:
        if self.sender is None:
            self.header(frame)
            return
        if frame.WhichOneof("body") != "data":
            raise WireError("a second header frame inside one message")
        if (frame.sender, frame.round, frame.channel) != (self.sender, self.round, self.channel):
            raise WireError(
                f"frame of (sender {frame.sender}, round {frame.round}, channel {frame.channel!r}) inside a message "
                f"of (sender {self.sender}, round {self.round}, channel {self.channel!r})"
            )
        if not self.allocated:
            self.allocate()
        chunk = memoryview(frame.data)
        self.wire_bytes += frame.ByteSize()
        while len(chunk):
            if self._idx >= len(self._specs):
                raise WireError("message carries more bytes than its header declares")
            need = self._specs[self._idx][3] - self._off
            take = min(need, len(chunk))
            part = np.frombuffer(chunk[:take], dtype=np.uint8)
            buf = self._bufs[self._idx]
            if buf is None and take == need:  # the whole tensor in this frame: a read-only view, no copy
                self._bufs[self._idx] = part
            else:
                if buf is None:
                    buf = self._bufs[self._idx] = np.empty(need, dtype=np.uint8)
                buf[self._off : self._off + take] = part
            self._off += take
            chunk = chunk[take:]
            self._skip_empty()

    feed = data

    def target(self, sender: int, round_: int, channel: str, nbytes: int) -> memoryview | None:
        """Where the next ``nbytes`` data bytes go, for a reader that receives them in place.

        A reader with the socket (:mod:`graphfl.p2p.socket_data`) asks before reading a data
        frame's payload, receives it into the returned view and then calls :meth:`commit`, so a
        tensor spread over several frames costs no copy from frame to tensor. ``None`` when the
        bytes do not fall inside one tensor (or are empty): feed that frame to :meth:`data`.

        Raises
        ------
        WireError
            As :meth:`data`: a frame of another message, or more bytes than the header declares.
        """
        if self.sender is None:
            raise WireError("the first frame of a message must be a header")
        if (sender, round_, channel) != (self.sender, self.round, self.channel):
            raise WireError(
                f"frame of (sender {sender}, round {round_}, channel {channel!r}) inside a message "
                f"of (sender {self.sender}, round {self.round}, channel {self.channel!r})"
            )
        if not self.allocated:
            self.allocate()
        if self._idx >= len(self._specs):
            raise WireError("message carries more bytes than its header declares")
        size = self._specs[self._idx][3]
        if nbytes <= 0 or nbytes > size - self._off:
            return None
        buf = self._bufs[self._idx]
        if buf is None:
            buf = self._bufs[self._idx] = np.empty(size, dtype=np.uint8)
        return buf.data[self._off:self._off + nbytes]

    def commit(self, nbytes: int, frame_size: int) -> None:
        """Count ``nbytes`` written into the view :meth:`target` returned (a frame of ``frame_size`` wire bytes)."""
        self._off += nbytes
        self.wire_bytes += frame_size
        self._skip_empty()

    def finish(self) -> Message:
        if self.sender is None:
            raise WireError("empty message (no header frame)")
        if not self.allocated:
            self.allocate()
        if self._idx < len(self._specs):
            name, _, _, nb = self._specs[self._idx]
            raise WireError(f"message ended early: tensor {name!r} has {self._off} of {nb} bytes")
        arrays: dict[str, np.ndarray] = {}
        for (name, dt, shape, _), buf in zip(self._specs, self._bufs):
            assert buf is not None  # every tensor is complete here
            arr = buf.view(dt).reshape(shape).astype(dt.newbyteorder("="), copy=False)
            arr.flags.writeable = False  # every received tensor is read-only, however its frames came
            arrays[name] = arr
        assert self.round is not None  # set together with sender by header()
        return Message(self.sender, self.round, str(self.channel), arrays, dict(self.scalars), self.wire_bytes)


def decode(frames: Iterable[pb.Frame], max_bytes: int = DEFAULT_MAX_BYTES) -> Message:
    """Decode a whole frame stream (raises :class:`WireError` on anything malformed)."""
    asm = Assembler(max_bytes)
    for f in frames:
        asm.feed(f)
    return asm.finish()


def wire_size(frames: Iterable[pb.Frame]) -> int:
    """Serialized protobuf bytes of a frame stream (without HTTP/2 and TLS framing)."""
    return int(sum(f.ByteSize() for f in frames))


TensorSpecs = Mapping[str, tuple[str, tuple[int, ...]]]
"""Expected ``{tensor name: (dtype name, shape)}`` of one channel."""


def validate(msg: Message, expected: TensorSpecs | None, require_finite: bool = True) -> None:
    """Check a decoded message against the expected tensors of its channel and for NaN/Inf.

    Raises
    ------
    WireError
        Naming the tensor and the problem (wrong names, dtype, shape; non-finite values).
    """
    if expected is not None:
        if set(msg.arrays) != set(expected):
            raise WireError(
                f"channel {msg.channel!r} from peer {msg.sender}: tensors {sorted(msg.arrays)}, "
                f"expected {sorted(expected)}"
            )
        for name, (dtype, shape) in expected.items():
            a = msg.arrays[name]
            if a.dtype.name != dtype or tuple(a.shape) != tuple(shape):
                raise WireError(
                    f"channel {msg.channel!r} from peer {msg.sender}: tensor {name!r} is {a.dtype.name}{list(a.shape)}, "
                    f"expected {dtype}{list(shape)}"
                )
    if require_finite:
        for name, a in msg.arrays.items():
            if a.dtype.kind != "f" or a.size == 0:
                continue
            # two reductions, no temporaries: max and min propagate NaN, and an Inf is its own extreme
            # (isfinite + abs + max would be three passes and two model-sized temporaries per message)
            hi, lo = float(np.max(a)), float(np.min(a))
            if not (np.isfinite(hi) and np.isfinite(lo)):
                raise WireError(f"channel {msg.channel!r} from peer {msg.sender}: tensor {name!r} has NaN/Inf values")
            peak = max(hi, -lo)
            if peak > magnitude_bound(a.dtype):
                raise WireError(
                    f"channel {msg.channel!r} from peer {msg.sender}: tensor {name!r} has |value| {peak:.3g} above "
                    f"{magnitude_bound(a.dtype):.3g}; mixing it could overflow {a.dtype.name} (faulty or dishonest sender)"
                )


def magnitude_bound(dtype: np.dtype) -> float:
    """Largest |value| a received float tensor may hold: ``sqrt(finfo(dtype).max)``.

    A finite value such as 3e38 in float32 is valid IEEE but overflows as soon as it is mixed
    or stepped; no honest model parameter, tracker or prediction is anywhere near the bound
    (1.8e19 for float32, 1.3e154 for float64, 256 for float16), so such a message is refused on
    arrival and the peer's model stays finite.
    """
    return float(np.sqrt(np.finfo(dtype).max))
