"""Fuzzing the parsers that take bytes from other machines (issue: reliability and security).

Whatever arrives — random frames, valid messages with bytes flipped, truncated or reordered
frames — the p2p decoder either returns a message that matches its header or raises
``WireError``; the Flower reply parser either returns a usable reply or one marked failed.
Nothing else may escape (an escaping exception would kill a receive thread or the round loop).
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphfl.common import wire
from graphfl.common.records import arrays_to_record
from graphfl.p2p import codec
from graphfl.p2p.codec import WireError
from graphfl.p2p.proto import graphfl_p2p_pb2 as pb
from graphfl.server.flower_adapter import reply_from_message
from graphfl.tests.flower_messages import message_in_a_run

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

dtypes = st.sampled_from(["float32", "float64", "int64", "uint8", "float16", "complex64", "object", ""])
shapes = st.lists(st.integers(min_value=-3, max_value=40), max_size=4)
tensor_specs = st.builds(
    lambda name, dtype, shape, nbytes: pb.TensorSpec(name=name, dtype=dtype, shape=[abs(d) for d in shape], nbytes=nbytes),
    st.text(max_size=6), dtypes, shapes, st.integers(min_value=0, max_value=10_000),
)
headers = st.builds(
    lambda sender, rnd, channel, specs: pb.Frame(sender=sender, round=rnd, channel=channel,
                                                 header=pb.Header(tensors=specs)),
    st.integers(min_value=0, max_value=2**31 - 1), st.integers(min_value=-5, max_value=2**31 - 1),
    st.text(max_size=8), st.lists(tensor_specs, max_size=4),
)
datas = st.builds(lambda sender, rnd, channel, blob: pb.Frame(sender=sender, round=rnd, channel=channel, data=blob),
                  st.integers(min_value=0, max_value=3), st.integers(min_value=0, max_value=3), st.text(max_size=8),
                  st.binary(max_size=300))


def _decode_or_wire_error(frames: list[pb.Frame]) -> codec.Message | None:
    try:
        msg = codec.decode(frames, max_bytes=1 << 20)
    except WireError:
        return None
    for name, arr in msg.arrays.items():  # what decoded is what the header declared
        assert isinstance(arr, np.ndarray) and name
    return msg


def test_a_tensor_without_a_name_is_refused() -> None:
    """Found by the fuzz test below: an empty tensor name decoded into a message."""
    frame = pb.Frame(sender=1, round=0, channel="params",
                     header=pb.Header(tensors=[pb.TensorSpec(name="", dtype="float32", shape=[0], nbytes=0)]))
    assert _decode_or_wire_error([frame]) is None


@FUZZ
@given(st.lists(st.one_of(headers, datas), max_size=6))
def test_random_frames_decode_or_raise_wire_error(frames: list[pb.Frame]) -> None:
    _decode_or_wire_error(frames)


def _valid_frames(seed: int) -> list[pb.Frame]:
    rng = np.random.default_rng(seed)
    arrays = {"theta": rng.standard_normal(int(rng.integers(1, 50))).astype(np.float32),
              "tracker": rng.standard_normal((3, 4)).astype(np.float64)}
    return list(codec.encode(1, int(rng.integers(0, 9)), "params", arrays, chunk_bytes=64))


@FUZZ
@given(st.integers(min_value=0, max_value=10_000), st.data())
def test_mutated_valid_messages_decode_or_raise_wire_error(seed: int, data: st.DataObject) -> None:
    frames = _valid_frames(seed)
    raw = [bytearray(f.SerializeToString()) for f in frames]
    for _ in range(data.draw(st.integers(min_value=1, max_value=6))):
        i = data.draw(st.integers(min_value=0, max_value=len(raw) - 1))
        if not raw[i]:
            continue
        j = data.draw(st.integers(min_value=0, max_value=len(raw[i]) - 1))
        raw[i][j] = data.draw(st.integers(min_value=0, max_value=255))
    mutated: list[pb.Frame] = []
    for blob in raw:
        frame = pb.Frame()
        try:
            frame.ParseFromString(bytes(blob))
        except Exception:  # noqa: BLE001  protobuf's DecodeError: gRPC would refuse such bytes itself
            return
        mutated.append(frame)
    cut = data.draw(st.integers(min_value=0, max_value=len(mutated)))
    order = data.draw(st.permutations(range(cut)))
    _decode_or_wire_error([mutated[k] for k in order])


# -- Flower replies -----------------------------------------------------------------------

metric_values = st.one_of(st.integers(min_value=-2**40, max_value=2**40), st.floats(allow_nan=True),
                          st.lists(st.integers(min_value=0, max_value=9), max_size=3))


@FUZZ
@given(
    st.dictionaries(st.sampled_from([wire.PARTITION_ID, wire.NUM_EXAMPLES, "eval.test_loss", "train_loss", "x"]),
                    metric_values, max_size=5),
    st.one_of(st.none(), st.dictionaries(st.text(min_size=1, max_size=5),
                                         st.sampled_from(["f32", "f64", "i8", "empty", "0d"]), max_size=3)),
    st.booleans(),
)
def test_any_flower_reply_parses_to_a_reply_or_a_failed_one(metrics: dict, arrays: dict | None, extra_record: bool) -> None:
    make = {"f32": lambda: np.ones(3, np.float32), "f64": lambda: np.full((2, 2), np.inf),
            "i8": lambda: np.arange(4, dtype=np.int8), "empty": lambda: np.zeros(0, np.float32),
            "0d": lambda: np.asarray(1.5)}
    content = RecordDict({wire.METRICS: MetricRecord(metrics)})
    if arrays is not None:
        content[wire.ARRAYS] = arrays_to_record({k: make[v]() for k, v in arrays.items()})
    if extra_record:
        content["unexpected"] = ConfigRecord({"a": 1})
        content["other-arrays"] = ArrayRecord()
    reply = reply_from_message(message_in_a_run(content), partition_id=2)
    assert reply.error is not None or reply.partition_id is not None
    if reply.error is None and reply.arrays is not None:
        assert set(reply.arrays) == set(arrays or {})
