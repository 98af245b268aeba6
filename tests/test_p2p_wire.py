"""Wire format: tensor round trips over every dtype, >4 MB messages, malformed input, generated code."""

from __future__ import annotations

import numpy as np
import pytest

from graphfl.p2p import codec
from graphfl.p2p.codec import SUPPORTED_DTYPES, WireError
from graphfl.p2p.proto import graphfl_p2p_pb2 as pb
from graphfl.p2p.transport import Mailbox


def sample(dtype: str, shape=(3, 4)) -> np.ndarray:
    rng = np.random.default_rng(0)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return rng.normal(size=shape).astype(dtype)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_roundtrip_every_dtype(dtype):
    arrays = {"a": sample(dtype), "scalar": sample(dtype, ()), "empty": sample(dtype, (0, 5))}
    msg = codec.decode(codec.encode(3, 7, "params", arrays, {"loss": 0.5}, chunk_bytes=5))
    assert (msg.sender, msg.round, msg.channel, msg.scalars) == (3, 7, "params", {"loss": 0.5})
    for k, a in arrays.items():
        assert msg.arrays[k].dtype == a.dtype and msg.arrays[k].shape == a.shape
        np.testing.assert_array_equal(msg.arrays[k], a)


def test_big_endian_and_noncontiguous_inputs():
    a = np.arange(12, dtype=">f8").reshape(3, 4).T
    msg = codec.decode(codec.encode(0, 0, "params", {"x": a}))
    np.testing.assert_array_equal(msg.arrays["x"], a)
    assert msg.arrays["x"].dtype.isnative


def test_large_tensor_is_chunked_below_the_frame_limit():
    a = np.random.default_rng(1).normal(size=(3_000_000,)).astype(np.float32)  # 12 MB
    frames = list(codec.encode(1, 2, "params", {"theta": a}))
    assert max(f.ByteSize() for f in frames) < codec.DEFAULT_CHUNK_BYTES + 64  # what a receiver accepts: + 1 MiB
    assert len(frames) == 1 + -(-a.nbytes // codec.DEFAULT_CHUNK_BYTES) == 1 + 3
    small = list(codec.encode(1, 2, "params", {"theta": a}, chunk_bytes=1 << 20))
    assert max(f.ByteSize() for f in small) < 4 * 1024 * 1024 and len(small) == 1 + 12  # under gRPC's default
    msg = codec.decode(frames)
    np.testing.assert_array_equal(msg.arrays["theta"], a)
    assert msg.wire_bytes == codec.wire_size(frames) > a.nbytes


@pytest.mark.parametrize(("sender", "round_", "chunk"), [(0, 0, 5), (3, 7, 1 << 20), (127, 2**40, 300), (2**31 - 1, 1, 128)])
def test_serialized_frames_are_byte_identical_to_protobuf(sender, round_, chunk):
    """encode_serialized (one copy) writes exactly what protobuf writes for encode's frames."""
    arrays = {"w": sample("float32", (40, 30)), "b": sample("int64", (7,)), "s": sample("float64", ()),
              "e": sample("uint8", (0, 3)), "big-endian": np.arange(9, dtype=">f8")}
    want = [f.SerializeToString() for f in codec.encode(sender, round_, "tracker", arrays, {"loss": 0.25}, chunk)]
    got = codec.encode_serialized(sender, round_, "tracker", arrays, {"loss": 0.25}, chunk)
    assert got == want
    msg = codec.decode(pb.Frame.FromString(f) for f in got)
    for k, a in arrays.items():
        np.testing.assert_array_equal(msg.arrays[k], a)


def test_unsupported_dtype_refused():
    with pytest.raises(WireError, match="complex128"):
        list(codec.encode(0, 0, "params", {"z": np.zeros(2, complex)}))
    with pytest.raises(WireError, match="not supported"):
        list(codec.encode(0, 0, "params", {"o": np.array([object()])}))


def header(**spec) -> pb.Frame:
    return pb.Frame(sender=1, round=0, channel="params", header=pb.Header(tensors=[pb.TensorSpec(**spec)]))


@pytest.mark.parametrize(
    "frames,match",
    [
        ([], "empty message"),
        ([pb.Frame(sender=1, round=0, channel="params", data=b"xx")], "first frame"),
        ([header(name="t", dtype="object", shape=[1], nbytes=8)], "not supported"),
        ([header(name="t", dtype="float32", shape=[4], nbytes=8)], "needs 16"),
        ([header(name="t", dtype="float32", shape=[-1], nbytes=0)], "invalid shape"),
        ([header(name="t", dtype="float32", shape=[2], nbytes=8)], "ended early"),
        (
            [header(name="t", dtype="float32", shape=[1], nbytes=4),
             pb.Frame(sender=1, round=0, channel="params", data=b"12345")],
            "more bytes",
        ),
        (
            [header(name="t", dtype="float32", shape=[1], nbytes=4),
             pb.Frame(sender=2, round=0, channel="params", data=b"1234")],
            "inside a message",
        ),
        ([pb.Frame(sender=1, round=0, channel="", header=pb.Header())], "empty channel"),
    ],
)
def test_malformed_frames(frames, match):
    with pytest.raises(WireError, match=match):
        codec.decode(frames)


def test_size_limit_checked_before_allocation():
    with pytest.raises(WireError, match="limit"):
        codec.decode([header(name="t", dtype="float64", shape=[1 << 40], nbytes=8 << 40)])


def msg(sender=1, round_=0, channel="params", arr=None):
    arr = np.zeros(3, np.float32) if arr is None else arr
    return codec.decode(codec.encode(sender, round_, channel, {"theta": arr}))


def test_mailbox_validates_and_buffers_early_messages():
    box = Mailbox(0, [1, 3], horizon=4)
    box.expect("params", {"theta": ("float32", (3,))})
    assert box.put(msg(sender=2)) == (False, "peer 2 is not a neighbour of peer 0")
    ok, reason = box.put(msg(arr=np.zeros(4, np.float32)))
    assert not ok and "expected float32[3]" in reason
    ok, reason = box.put(msg(arr=np.array([0, np.nan, 0], np.float32)))
    assert not ok and "NaN" in reason
    ok, reason = box.put(msg(channel="admm"))
    assert not ok and "unknown channel" in reason
    assert box.put(msg(round_=2))[0]  # early: buffered
    assert not box.put(msg(round_=2))[0]  # duplicate
    assert not box.put(msg(round_=9))[0]  # beyond the horizon
    assert box.wait(0, ["params"], [1], timeout=0.05) == {}
    box.advance(2)
    got = box.wait(2, ["params"], [1, 3], timeout=0.05)
    assert list(got) == [1]
    assert box.put(msg(round_=1)) == (True, "late (round already finished); dropped")
    assert box.stats.snapshot()["messages_rejected"] == 6


def test_generated_code_is_up_to_date(tmp_path):
    """The committed graphfl_p2p_pb2.py describes exactly graphfl_p2p.proto (protoc-version independent)."""
    pytest.importorskip("grpc_tools")
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    from graphfl.p2p.proto.generate import HERE

    out = tmp_path / "set.pb"
    assert protoc.main(["protoc", f"-I{HERE}", f"--descriptor_set_out={out}", str(HERE / "graphfl_p2p.proto")]) == 0
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    committed = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(committed)

    def strip_json_names(messages):  # descriptor sets carry json_name, runtime descriptors do not
        for m in messages:
            for f in m.field:
                f.ClearField("json_name")
            strip_json_names(m.nested_type)

    strip_json_names(fresh.message_type)
    assert committed == fresh, "stale generated code: run python -m graphfl.p2p.proto.generate"


def test_committed_type_stub_matches_the_messages():
    """graphfl_p2p_pb2.pyi (generated with protoc --pyi_out, for mypy) declares every message and field."""
    from graphfl.p2p.proto.generate import HERE

    stub = (HERE / "graphfl_p2p_pb2.pyi").read_text()
    for message in pb.DESCRIPTOR.message_types_by_name.values():
        assert f"class {message.name}(_message.Message):" in stub, message.name
        for f in message.fields:
            assert f"    {f.name}: " in stub, f"{message.name}.{f.name}: stale stub, run python -m graphfl.p2p.proto.generate"


def _view(frame):
    """What a receiver reads of a frame, from a pb.Frame or a codec.DataFrame."""
    body = frame.WhichOneof("body")
    data = bytes(frame.data) if body == "data" else None
    return body, frame.sender, frame.round, frame.channel, data, frame.ByteSize()


def _same_as_protobuf(raw: bytes) -> None:
    from google.protobuf.message import DecodeError

    try:
        want = pb.Frame.FromString(raw)
    except DecodeError:
        with pytest.raises(DecodeError):
            codec.parse_frame(raw)
        return
    got = codec.parse_frame(raw)
    assert _view(got) == _view(want)


def test_parse_frame_reads_data_frames_without_copy_and_agrees_with_protobuf():
    arrays = {"w": sample("float32", (50, 40)), "e": sample("int8", (0,))}
    frames = codec.encode_serialized(-3, 2**40, "params", arrays, {"x": 1.0}, chunk_bytes=1000)
    parsed = [codec.parse_frame(f) for f in frames]
    assert isinstance(parsed[0], pb.Frame)  # the header goes through protobuf
    assert all(isinstance(p, codec.DataFrame) for p in parsed[1:])
    assert all(isinstance(p.data, memoryview) and p.data.obj is f for p, f in zip(parsed[1:], frames[1:]))
    for f in frames:
        _same_as_protobuf(f)
    msg = codec.decode(parsed)
    np.testing.assert_array_equal(msg.arrays["w"], arrays["w"])
    assert msg.wire_bytes == sum(len(f) for f in frames)


def test_data_prefix_from_the_first_bytes_only():
    """The socket reader parses a data frame from its first bytes and receives the rest in place."""
    frames = codec.encode_serialized(7, 300, "tracker", {"t": sample("float32", (1000,))}, None, chunk_bytes=1024)
    for f in frames[1:]:
        sender, round_, channel, start = codec.data_prefix(f[:64], len(f))
        want = pb.Frame.FromString(f)
        assert (sender, round_, channel) == (want.sender, want.round, want.channel) and f[start:] == want.data
    assert codec.data_prefix(frames[0][:64], len(frames[0])) is None  # a header frame: protobuf's
    assert codec.data_prefix(frames[1][:3], len(frames[1])) is None  # too few bytes for the fields
    assert codec.data_prefix(frames[1][:64], len(frames[1]) + 1) is None  # data not running to the end


def test_assembler_receives_in_place_across_frames_and_tensors():
    arrays = {"w": sample("float32", (600,)), "e": sample("int8", (0,)), "b": sample("float64", (5,))}
    frames = codec.encode_serialized(2, 4, "params", arrays, None, chunk_bytes=1000)  # w: 3 frames, b: 1
    # and a frame that straddles two tensors (another encoder may pack them): the tail of w and all of b
    raw_w, raw_b = arrays["w"].tobytes(), arrays["b"].tobytes()
    frames = frames[:3] + [pb.Frame(sender=2, round=4, channel="params", data=raw_w[2000:] + raw_b).SerializeToString()]
    asm = codec.Assembler()
    asm.header(pb.Frame.FromString(frames[0]))
    in_place = 0
    for f in frames[1:]:
        sender, round_, channel, start = codec.data_prefix(f, len(f))
        dest = asm.target(sender, round_, channel, len(f) - start)
        if dest is None:  # straddles two tensors: through data()
            asm.data(codec.parse_frame(f))
        else:
            dest[:] = f[start:]
            asm.commit(len(f) - start, len(f))
            in_place += 1
    assert in_place == 2 and asm.complete
    msg = asm.finish()
    for name, a in arrays.items():
        np.testing.assert_array_equal(msg.arrays[name], a)
        assert not msg.arrays[name].flags.writeable  # every received tensor is read-only
    assert msg.wire_bytes == sum(len(f) for f in frames)
    asm = codec.Assembler()
    asm.header(pb.Frame.FromString(frames[0]))
    with pytest.raises(WireError, match="inside a message"):
        asm.target(3, 4, "params", 10)
    assert asm.target(2, 4, "params", 2401) is None  # more than the current tensor: not in place


@pytest.mark.parametrize("raw", [
    b"",                                        # empty frame: all defaults, no body
    b"\x2a\x03abc",                             # data only
    b"\x10\x05\x08\x01\x2a\x01z",               # fields out of order -> protobuf
    b"\x08\x01\x08\x02\x2a\x01z",               # repeated field -> protobuf (last wins)
    b"\x08\x01\x2a\x01z\x08\x07",               # a field after data -> protobuf
    b"\x08\x01\x2a\x05ab",                      # data runs past the end
    b"\x08\x01\x2a\x01zz",                      # trailing byte
    b"\x1a\x02\xff\xfe\x2a\x01z",               # channel not UTF-8
    b"\x1a\x09ab\x2a\x01z",                     # channel runs past the end
    b"\x08" + b"\xff" * 11 + b"\x01\x2a\x01z",  # over-long varint
    b"\x38\x01\x2a\x01z",                       # unknown field 7
    b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01\x10\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01\x2a\x00",  # -1, -1
])
def test_parse_frame_edge_cases_match_protobuf(raw):
    _same_as_protobuf(raw)


def test_parse_frame_fuzz_matches_protobuf():
    rng = np.random.default_rng(7)
    base = codec.encode_serialized(5, 9, "tracker", {"t": sample("float64", (20,))}, None, chunk_bytes=64)
    for _ in range(3000):
        raw = bytearray(base[1 + int(rng.integers(len(base) - 1))])
        for _ in range(int(rng.integers(1, 4))):
            op = rng.integers(3)
            i = int(rng.integers(len(raw) + 1))
            if op == 0 and raw:
                raw[min(i, len(raw) - 1)] = int(rng.integers(256))
            elif op == 1:
                raw[i:i] = bytes([int(rng.integers(256))])
            elif raw:
                del raw[min(i, len(raw) - 1)]
        _same_as_protobuf(bytes(raw))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, "middle", -1])
def test_validate_refuses_nan_and_inf_anywhere(dtype, bad, where):
    """validate() checks finiteness with one max and one min (no temporaries): NaN propagates
    through both and an Inf is its own extreme, at any position."""
    a = np.random.default_rng(2).normal(size=1001).astype(dtype)
    codec.validate(codec.Message(1, 0, "params", {"theta": a}), None)
    a[len(a) // 2 if where == "middle" else where] = bad
    with pytest.raises(WireError, match="NaN/Inf"):
        codec.validate(codec.Message(1, 0, "params", {"theta": a}), None)
    huge = np.array([1.0, -0.5 * np.finfo(dtype).max], dtype)
    with pytest.raises(WireError, match="above"):
        codec.validate(codec.Message(1, 0, "params", {"theta": huge}), None)
