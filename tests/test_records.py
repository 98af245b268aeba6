"""The Flower wire form of named arrays (common/records.py): packed round trip, plain records
still read, Flower's own serialisation of the packed Array, and every malformed header refused."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from graphfl.common import wire
from graphfl.common.records import (
    PACKED_STYPE,
    array_record_names,
    arrays_record,
    arrays_to_record,
    get_arrays,
    pack_arrays,
    record_to_arrays,
    unpack_arrays,
)


def _model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "fc1.weight": rng.normal(size=(32, 64)).astype(np.float32),
        "fc1.bias": rng.normal(size=(32,)).astype(np.float32),
        "fc2.weight": rng.normal(size=(10, 32)).astype(np.float64),
        "bn.num_batches_tracked": np.asarray(7, np.int64),  # 0-d stays 0-d
        "mask": np.array([True, False, True]),
        "odd": np.arange(3, dtype=np.int16),  # 6 bytes: the next offset is padded to 8
        "empty": np.zeros((0, 4), np.float32),
    }


def test_packed_round_trip_is_exact_and_keeps_order_dtype_shape() -> None:
    arrays = _model()
    rec = arrays_to_record(arrays)
    assert list(rec) == [wire.PACKED] and rec[wire.PACKED].stype == PACKED_STYPE
    back = record_to_arrays(rec)
    assert list(back) == list(arrays)
    for k, v in arrays.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and np.array_equal(back[k], v)
        assert back[k].flags.writeable  # a copy, not a view of the message bytes
    # non-contiguous input is packed in C order
    t = np.arange(12, dtype=np.float32).reshape(3, 4).T
    assert np.array_equal(record_to_arrays(arrays_to_record({"t": t}))["t"], t)


def test_plain_records_still_read() -> None:
    """Vanilla Flower apps and pack=False send one Array per tensor: read as before."""
    arrays = _model()
    rec = arrays_to_record(arrays, pack=False)
    assert list(rec) == list(arrays)
    back = record_to_arrays(rec)
    assert all(np.array_equal(back[k], v) and back[k].shape == v.shape for k, v in arrays.items())


def test_packed_message_has_fewer_flower_objects() -> None:
    """The point of packing: one Array + one chunk instead of one of each per tensor."""
    arrays = _model()

    def objects(pack: bool) -> int:
        content = RecordDict({wire.ARRAYS: arrays_to_record(arrays, pack=pack)})
        return len(get_all_nested_objects(content))

    plain, packed = objects(False), objects(True)
    assert packed == 4  # RecordDict, ArrayRecord, Array, ArrayChunk
    assert plain == 2 + 2 * len(arrays)  # an Array and a chunk per tensor


def test_packed_record_survives_flower_deflate_inflate() -> None:
    rec = arrays_to_record(_model())
    arr = rec[wire.PACKED]
    chunks = arr.children
    again = Array.inflate(arr.deflate(), children=chunks)
    assert again.stype == PACKED_STYPE
    back = record_to_arrays(ArrayRecord({wire.PACKED: again}))
    assert np.array_equal(back["fc1.weight"], _model()["fc1.weight"])


def _blob(entries: object, data: bytes = b"\0" * 64) -> bytes:
    header = json.dumps(entries).encode()
    head = b"GFLPACK1" + struct.pack("<I", len(header)) + header
    head += b"\0" * (-len(head) % 8)
    return head + data


@pytest.mark.parametrize(("blob", "words"), [
    (b"not a packed record", "magic"),
    (b"GFLPACK1" + struct.pack("<I", 10**6) + b"[]", "header length"),
    (b"GFLPACK1" + struct.pack("<I", 3) + b"{x}", "not JSON"),
    (_blob({"a": 1}), "not a list"),
    (_blob([["a", "<f4", [2]]]), "entry 0"),
    (_blob([["a", "<f4", [2], 0], ["a", "<f4", [2], 8]]), "repeated name"),
    (_blob([["a", "|O", [2], 0]]), "unsupported dtype"),
    (_blob([["a", "nonsense", [2], 0]]), "unsupported dtype"),
    (_blob([["a", "<f4", [-1], 0]]), "invalid shape"),
    (_blob([["a", "<f4", [True], 0]]), "invalid shape"),
    (_blob([["a", "<f4", [10**12], 0]]), "outside"),  # declares 4 TB in a 64-byte blob: refused, not allocated
    (_blob([["a", "<f4", [2], 3]]), "outside"),  # unaligned offset
    (_blob([["a", "<f4", [4], 0], ["b", "<f4", [2], 8]]), "overlaps"),
])
def test_malformed_packed_blobs_are_refused_by_name(blob: bytes, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        unpack_arrays(blob)


def test_packed_key_mixed_with_others_is_refused() -> None:
    rec = arrays_to_record({"w": np.ones(3, np.float32)})
    rec["extra"] = Array(np.ones(2))
    with pytest.raises(ValueError, match="besides"):
        record_to_arrays(rec)


def test_object_arrays_are_not_packed() -> None:
    with pytest.raises(TypeError, match="dtype object"):
        pack_arrays({"x": np.array([object()])})


# ---------------------------------------------------------------------------------------------
# inline records: small payloads as one ConfigRecord object
# ---------------------------------------------------------------------------------------------
def test_small_payloads_travel_inline_as_one_object_and_large_ones_as_packed_array_records() -> None:
    arrays = _model()
    small = arrays_record(arrays)
    assert isinstance(small, ConfigRecord) and list(small) == [wire.PACKED]
    large = arrays_record(arrays, inline_max=len(pack_arrays(arrays)) - 1)
    assert isinstance(large, ArrayRecord) and large[wire.PACKED].stype == PACKED_STYPE
    for rec in (small, large):
        back = get_arrays(RecordDict({wire.ARRAYS: rec}), wire.ARRAYS)
        assert back is not None and list(back) == list(arrays)
        assert all(back[k].dtype == v.dtype and back[k].shape == v.shape and np.array_equal(back[k], v)
                   for k, v in arrays.items())
    # the point: RecordDict + ConfigRecord (2 objects) instead of RecordDict, ArrayRecord, Array, chunk
    assert len(get_all_nested_objects(RecordDict({wire.ARRAYS: small}))) == 2
    assert len(get_all_nested_objects(RecordDict({wire.ARRAYS: large}))) == 4


def test_inline_record_survives_a_flower_message_round_trip() -> None:
    """Deflate every object of a message's content and inflate it again, as each hop does."""
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

    content = RecordDict({wire.ARRAYS: arrays_record(_model()), wire.CONFIG: ConfigRecord({"round": 3})})
    objects = {oid: obj.deflate() for oid, obj in get_all_nested_objects(content).items()}
    again = inflate_object_from_contents(content.object_id, objects)
    assert isinstance(again, RecordDict)
    back = get_arrays(again, wire.ARRAYS)
    assert back is not None and np.array_equal(back["fc2.weight"], _model()["fc2.weight"])
    assert array_record_names(again) == [wire.ARRAYS]


def test_get_arrays_reads_every_form_and_refuses_a_malformed_inline_record() -> None:
    arrays = {"w": np.arange(4, dtype=np.float32)}
    for rec in (arrays_record(arrays), arrays_to_record(arrays), arrays_to_record(arrays, pack=False)):
        back = get_arrays(RecordDict({"a": rec}), "a")
        assert back is not None and np.array_equal(back["w"], arrays["w"])
    assert get_arrays(RecordDict({}), "a") is None
    for bad in (ConfigRecord({wire.PACKED: "text"}), ConfigRecord({wire.PACKED: pack_arrays(arrays), "x": 1}),
                ConfigRecord({"other": b"123"})):
        with pytest.raises(ValueError, match="inline arrays 'a'"):
            get_arrays(RecordDict({"a": bad}), "a")
    with pytest.raises(ValueError, match="magic"):
        get_arrays(RecordDict({"a": ConfigRecord({wire.PACKED: b"not packed"})}), "a")
    # a config record without the packed key is not an array record
    assert array_record_names(RecordDict({"c": ConfigRecord({"x": 1}), "a": arrays_record(arrays)})) == ["a"]
