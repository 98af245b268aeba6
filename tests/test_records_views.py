"""Read-only views into a received packed blob (``unpack_arrays(copy=False)``) and their callers."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from graphfl.client.objective import _tensor
from graphfl.client.training import set_arrays
from graphfl.common import wire
from graphfl.common.arrays import weighted_average
from graphfl.common.records import arrays_record, get_arrays, pack_arrays, record_to_arrays, unpack_arrays
from graphfl.server.flower_adapter import reply_from_message
from graphfl.tests.flower_messages import message_in_a_run


def _arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((5, 3)).astype(np.float32), "b": rng.standard_normal(3),
            "n": np.arange(7, dtype=np.int64), "flag": np.array([True, False]), "s": np.float32(2.5)}


def _blob_array(blob: bytes | bytearray) -> np.ndarray:
    return np.frombuffer(blob, dtype=np.uint8)


def test_views_equal_the_copies_and_are_read_only() -> None:
    blob = pack_arrays(_arrays())
    copies, views = unpack_arrays(blob), unpack_arrays(blob, copy=False)
    assert list(views) == list(copies)
    for key, view in views.items():
        np.testing.assert_array_equal(view, copies[key])
        assert view.dtype == copies[key].dtype and view.shape == copies[key].shape
        assert not view.flags.writeable
        assert np.shares_memory(view, _blob_array(blob))  # no copy of the tensor bytes
        with pytest.raises(ValueError, match="read-only"):
            view[...] = 0
        assert copies[key].flags.writeable
        assert not np.shares_memory(copies[key], _blob_array(blob))


def test_views_of_a_writable_blob_are_read_only_and_copies_are_independent() -> None:
    blob = bytearray(pack_arrays(_arrays()))
    views = unpack_arrays(blob, copy=False)
    with pytest.raises(ValueError, match="read-only"):
        views["w"][0, 0] = 1.0
    copies = unpack_arrays(blob)
    before = bytes(blob)
    copies["w"][...] = 0.0  # a caller that writes gets its own copy: the blob is untouched
    assert bytes(blob) == before
    np.testing.assert_array_equal(unpack_arrays(blob)["w"], _arrays()["w"])


def test_malformed_blob_is_rejected_in_view_mode_too() -> None:
    blob = bytearray(pack_arrays(_arrays()))
    blob[12] = ord("{")  # the header is no longer a JSON list
    with pytest.raises(ValueError, match="packed arrays"):
        unpack_arrays(bytes(blob), copy=False)


@pytest.mark.parametrize("inline_max", [2**20, 0], ids=["inline", "array-record"])
def test_get_arrays_views_in_both_wire_forms(inline_max: int) -> None:
    content = RecordDict({wire.ARRAYS: arrays_record(_arrays(), inline_max=inline_max)})
    views = get_arrays(content, wire.ARRAYS, copy=False)
    copies = get_arrays(content, wire.ARRAYS)
    assert views is not None and copies is not None
    for key, view in views.items():
        np.testing.assert_array_equal(view, copies[key])
        assert not view.flags.writeable and copies[key].flags.writeable


def test_record_to_arrays_default_is_a_writable_copy() -> None:
    """The client's state is read with the default and written by the trainers."""
    rec = arrays_record(_arrays(), inline_max=0)
    state = record_to_arrays(rec)
    state["w"] += 1.0
    np.testing.assert_array_equal(record_to_arrays(rec)["w"], _arrays()["w"])


def _reply(arrays: dict[str, np.ndarray], pid: int) -> Message:
    content = RecordDict({wire.ARRAYS: arrays_record(arrays, inline_max=0),
                          wire.METRICS: MetricRecord({wire.PARTITION_ID: pid, wire.NUM_EXAMPLES: 10 + pid}),
                          "cfg": ConfigRecord({"x": 1})})
    return message_in_a_run(content)


def test_server_reads_replies_as_views_and_aggregates_them() -> None:
    ups = [_arrays(seed) for seed in range(3)]
    replies = [reply_from_message(_reply(a, pid)) for pid, a in enumerate(ups)]
    floats = ("w", "b")
    for rep, sent in zip(replies, ups):
        assert rep.error is None and rep.arrays is not None
        for key in floats:
            assert not rep.arrays[key].flags.writeable
            np.testing.assert_array_equal(rep.arrays[key], sent[key])
    got = weighted_average([{k: r.arrays[k] for k in floats} for r in replies if r.arrays is not None], [1, 2, 3])
    want = weighted_average([{k: a[k].copy() for k in floats} for a in ups], [1, 2, 3])
    for key in floats:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6)
        assert got[key].flags.writeable  # the aggregate is the server's own array


def test_worker_loads_views_into_torch_without_sharing_them() -> None:
    model = torch.nn.Linear(3, 2)
    sent = {"weight": np.full((2, 3), 0.5, dtype=np.float32), "bias": np.array([1.0, -1.0], dtype=np.float32)}
    blob = pack_arrays(sent)
    views = unpack_arrays(blob, copy=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not writable" warning escapes set_arrays
        set_arrays(model, views)
    before = bytes(blob)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # an optimiser step writes the model, never the received message
    assert bytes(blob) == before
    np.testing.assert_allclose(model.weight.detach().numpy(), sent["weight"] + 1.0, rtol=1e-6)
    anchor = _tensor(views["weight"])  # proximal anchors are torch's own copies
    anchor.add_(1.0)
    assert bytes(blob) == before
