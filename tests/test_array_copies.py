"""Fast path ``array-fewer-copies`` (graphfl.flowerx.array_copies): Flower's bytes, ids and data, fewer copies."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.app.message import array as array_mod
from flwr.app.message.arraychunk import ArrayChunk
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

from graphfl.flowerx import array_copies, policy
from graphfl.tests.flower_messages import message_in_a_run


@pytest.fixture
def fresh(monkeypatch):
    """No decision, no installation, no environment override; put Flower's methods back afterwards."""
    monkeypatch.delenv(policy.VERSION_ENV, raising=False)
    monkeypatch.delenv(policy.OFF_ENV, raising=False)
    array_copies.uninstall()
    policy.forget()
    yield monkeypatch
    array_copies.uninstall()
    policy.forget()


def _message(chunk_size: int, monkeypatch: pytest.MonkeyPatch) -> Message:
    """A message whose arrays span several chunks (one repeated), plus a tiny array and a config."""
    monkeypatch.setattr(array_mod, "FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE", chunk_size)
    rng = np.random.default_rng(0)
    big = rng.standard_normal(5000).astype(np.float32)
    big[:2000] = 0.0  # the first chunks are identical: Flower keeps one child, the metadata repeats it
    content = RecordDict({"arrays": ArrayRecord({"big": Array(big), "small": Array(np.arange(3.0)),
                                                 "raw": Array(dtype="uint8", shape=(7,), stype="x",
                                                              data=b"graphfl")}),
                          "cfg": ConfigRecord({"k": 1})})
    return message_in_a_run(content)


def _contents(msg: Message) -> dict[str, bytes]:
    return {oid: obj.deflate() for oid, obj in get_all_nested_objects(msg).items()}


def _inflated(msg_id: str, contents: dict[str, bytes]) -> Message:
    return inflate_object_from_contents(msg_id, dict(contents), keep_object_contents=False)  # type: ignore[return-value]


def test_on_here_and_off_on_an_unverified_flower(fresh) -> None:
    assert array_copies.check() is None
    fresh.setenv(policy.VERSION_ENV, "1.99.0")
    assert array_copies.install() is False
    assert ArrayChunk.deflate is array_copies.stock_methods()[0]  # Flower's method, untouched


def test_same_object_contents_and_ids_as_flower(fresh) -> None:
    msg = _message(1024, fresh)
    stock = _contents(msg)
    assert sum(1 for c in stock.values() if c.startswith(b"ArrayChunk ")) >= 10
    assert array_copies.install()
    fast = _contents(msg)  # the same objects deflated again, now by the fast path
    assert fast == stock  # every id and every content, byte for byte
    fresh_msg = _message(1024, fresh)  # a new message, built and deflated with the fast path on
    records = {oid: c for oid, c in _contents(fresh_msg).items() if oid != fresh_msg.object_id}
    assert records == {oid: c for oid, c in stock.items() if oid != msg.object_id}


def test_inflated_message_equals_flowers(fresh) -> None:
    msg = _message(1024, fresh)
    contents = _contents(msg)
    stock = _inflated(msg.object_id, contents)
    assert array_copies.install()
    fast = _inflated(msg.object_id, contents)
    for name in ("big", "small", "raw"):
        got, want = fast.content["arrays"][name], stock.content["arrays"][name]
        assert type(got.data) is bytes
        assert (got.data, got.dtype, got.shape, got.stype) == (want.data, want.dtype, want.shape, want.stype)
    np.testing.assert_array_equal(fast.content["arrays"]["big"].numpy(), msg.content["arrays"]["big"].numpy())
    assert fast.object_id == stock.object_id == msg.object_id
    assert _contents(fast) == contents  # re-deflated (as a SuperNode-bound reply would be): same bytes


def test_a_received_chunk_shares_its_content_and_keeps_flowers_checks(fresh) -> None:
    assert array_copies.install()
    content = ArrayChunk(memoryview(b"abcdef")).deflate()
    chunk = ArrayChunk.inflate(content)
    assert bytes(chunk.data) == b"abcdef" and chunk.data.obj is content  # a view, not a copy
    with pytest.raises(ValueError, match="do not have children"):
        ArrayChunk.inflate(content, {"x": chunk})
    array_content = Array(np.arange(3.0)).deflate()
    with pytest.raises(ValueError, match="do not match"):
        ArrayChunk.inflate(array_content)
    mutable = bytearray(content)  # content a caller could change goes to Flower's method (a copy)
    assert bytes(ArrayChunk.inflate(mutable).data) == b"abcdef"  # type: ignore[arg-type]


def test_a_self_test_that_disagrees_with_flower_switches_it_off(fresh, caplog) -> None:
    fresh.setattr(array_copies, "deflate_chunk", lambda self: b"not flower's bytes")
    with caplog.at_level("WARNING", logger="graphfl.flowerx"):
        assert array_copies.install() is False
    assert "array-fewer-copies" in caplog.text and "differs from Flower's" in caplog.text
    assert ArrayChunk.deflate is array_copies.stock_methods()[0]
