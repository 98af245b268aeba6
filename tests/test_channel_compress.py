"""Compressed uploads through the noisy, lossy uplink (the codec and the channel together).

* in-process: with ``compress.kind = quant`` and ``channel.missing = 0.3`` every entry JGESR
  receives is either the client's true quantised value or flagged missing in the mask that
  reaches the core; an array whose side information the channel lost is missing as a whole and
  counted in the round's server metrics;
* the channel on an encoded upload (quant and top-k): masks over the model's entries, lost
  headers, noise snapped to the quantiser's grid, the checksum that catches a corrupted header;
* the noise scale comes from the common initial model θ⁰ (the server's reference), not from
  the upload's magnitude;
* one small run on a real 2-SuperNode TLS deployment equals the in-process run.
"""

from __future__ import annotations

import numpy as np
import pytest

from graphfl.common.config import parse_run_config
from graphfl.server.inprocess import run_federated_inprocess
from graphfl.strategies.jgesr import JGESRCore

BASE = {"strategy": "jgesr", "task": "digits", "nodes": 3, "rounds": 1, "engine": "inprocess",
        "train.local-steps": 2, "compress.kind": "quant", "compress.bits": 4}


def _run_capturing_updates(monkeypatch, values):
    """Run in-process; return (result document, the updates JGESR's core received per round)."""
    seen = {}
    real = JGESRCore.aggregate_train

    def spy(self, server_round, updates):
        seen[server_round] = dict(updates)
        return real(self, server_round, updates)

    monkeypatch.setattr(JGESRCore, "aggregate_train", spy)
    doc, _ = run_federated_inprocess(parse_run_config(values))
    return doc, seen


def _payload(key, like):
    """Round 1's payload of JGESR: the common initial model."""
    from graphfl.server.inprocess import server_inputs

    return server_inputs(parse_run_config(BASE)).initial_arrays[key].astype(like.dtype)


def test_quantised_uploads_through_a_lossy_channel_are_true_values_or_flagged_missing(monkeypatch):
    _, clean = _run_capturing_updates(monkeypatch, BASE)
    doc, lossy = _run_capturing_updates(monkeypatch, {**BASE, "channel.missing": 0.3})
    truth, got = clean[1], lossy[1]
    assert sorted(got) == sorted(truth) == [0, 1, 2]
    received = total = lost_arrays = intact_received = intact_total = 0
    for pid, up in got.items():
        assert up.mask is not None, f"client {pid}: the channel's mask did not reach the core"
        for key, want in truth[pid].arrays.items():
            if want.dtype.kind != "f":
                continue
            mask = up.mask[key]
            assert mask.shape == want.shape and mask.dtype == np.bool_
            # a received entry is exactly what the client's quantiser produced
            np.testing.assert_allclose(up.arrays[key][mask], want[mask], rtol=1e-6, atol=0)
            received += int(mask.sum())
            total += mask.size
            if not mask.any():  # side information lost: missing as a whole, decoded as the payload
                lost_arrays += 1
                np.testing.assert_array_equal(up.arrays[key], np.zeros_like(want) + _payload(key, want))
            else:
                intact_received += int(mask.sum())
                intact_total += mask.size
                if mask.size > 8:  # not a constant (garbage) array where the truth varies
                    assert np.ptp(up.arrays[key][mask]) > 0 or np.ptp(want) == 0
    assert lost_arrays >= 1                                  # this seed exercises the lost header
    assert 0.25 < 1 - intact_received / intact_total < 0.35  # entries lost one by one at rate 0.3
    server = doc["methods"]["jgesr"]["curve"][1]["server"]
    assert server["channel_arrays_lost"] == lost_arrays
    assert server["channel_missing_fraction"] == pytest.approx(1 - received / total, rel=1e-6)
    assert server["missing_fraction"] == pytest.approx(1 - received / total, rel=1e-6)  # JGESR used the mask


# ---------------------------------------------------------------------------------------
# the channel on an encoded upload, and the decoder that reads it
# ---------------------------------------------------------------------------------------

def _encoded(kind="quant", scale=1.0, **cfg):
    from graphfl.common.compress import encode
    from graphfl.common.config import CompressConfig

    rng = np.random.default_rng(3)
    up = {"w": (scale * rng.standard_normal((40, 50))).astype(np.float32),
          "b": (scale * rng.standard_normal(7)).astype(np.float32), "n": np.array(4)}
    ref = {"w": np.full((40, 50), 0.5, np.float32), "b": np.zeros(7, np.float32), "n": np.array(3)}
    enc = encode(up, ref, CompressConfig(kind=kind, **cfg), np.random.default_rng(1), {})
    return up, ref, enc


def test_quant_channel_masks_model_entries_and_loses_whole_arrays_with_their_header():
    from graphfl.client.noisy_channel import transmit_upload
    from graphfl.common.compress import decode_received

    up, ref, enc = _encoded(bits=6)
    lost_headers = entries = flagged = 0
    for seed in range(40):
        sent, mask = transmit_upload(enc.wire_arrays, 0.0, 0.3, seed, 1, 2, "fit", ref_mean_abs=0.7)
        assert mask is not None and set(mask) == {"w", "b"}             # model keys, not codec parts
        assert mask["w"].shape == (40, 50) and sent["graphfl.z/w/q"].nbytes == enc.wire_arrays["graphfl.z/w/q"].nbytes
        got = decode_received(sent, ref, up, mask)
        for key in ("w", "b"):
            m = got.mask[key]
            header_lost = np.isnan(sent[f"graphfl.z/{key}/lo"])
            assert (key in got.lost) == bool(header_lost) == (not m.any())
            if header_lost:
                lost_headers += 1
                np.testing.assert_array_equal(got.arrays[key], ref[key])   # the reference, not NaN or garbage
            else:
                np.testing.assert_allclose(got.arrays[key][m], enc.decoded[key][m], rtol=1e-6)
                entries += m.size
                flagged += m.size - int(m.sum())
        assert got.arrays["n"] == 4                                       # integer arrays untouched
    assert 0.2 < lost_headers / 80 < 0.4                                  # one symbol per array, rate r
    assert flagged / entries == pytest.approx(0.3, abs=0.01)


def test_noise_is_snapped_to_the_quantisers_grid_and_keeps_codes_in_range():
    from graphfl.client.noisy_channel import transmit_upload
    from graphfl.common.compress import decode_received, unpack_codes

    up, ref, enc = _encoded(bits=4)
    step = float(enc.wire_arrays["graphfl.z/w/step"])
    lo = float(enc.wire_arrays["graphfl.z/w/lo"])
    for ref_scale, changed in ((0.01 * step, False), (3 * step, True)):   # σ = 1·ref_scale
        sent, mask = transmit_upload(enc.wire_arrays, 1.0, 0.0, 0, 0, 1, "fit", ref_mean_abs=ref_scale)
        codes = unpack_codes(sent["graphfl.z/w/q"], 4, 2000)
        assert codes.min() >= 0 and codes.max() <= 15
        got = decode_received(sent, ref, up, mask).arrays["w"]
        err = (got.astype(np.float64) - enc.decoded["w"]).ravel()
        if not changed:                      # noise far below half a step vanishes
            np.testing.assert_allclose(got, enc.decoded["w"], rtol=1e-6)
            continue
        levels = (got.astype(np.float64) - ref["w"] - lo) / step   # still on the grid
        np.testing.assert_allclose(levels, np.rint(levels), atol=1e-3)
        assert 1.5 * step < err.std() < 4 * step and abs(err.mean()) < step


def test_a_corrupted_header_is_detected_by_its_checksum():
    from graphfl.common.compress import decode, decode_received

    up, ref, enc = _encoded(bits=4)
    bad = dict(enc.wire_arrays)
    bad["graphfl.z/w/step"] = bad["graphfl.z/w/step"] + 1e-9              # a noised side information scalar
    with pytest.raises(ValueError, match="'w'.*checksum"):
        decode(bad, ref, up)                                              # no channel: refused, key named
    mask = {"w": np.ones((40, 50), bool), "b": np.ones(7, bool)}
    got = decode_received(bad, ref, up, mask)
    assert got.lost == ["w"] and not got.mask["w"].any() and got.mask["b"].all()
    assert mask["w"].all()                                                # the caller's mask is not modified
    np.testing.assert_array_equal(got.arrays["w"], ref["w"])
    bad["graphfl.z/w/lo"] = np.asarray(np.nan)
    with pytest.raises(ValueError, match="'w'.*lost or corrupted"):
        decode(bad, ref, up)


def test_topk_channel_loses_only_the_values_that_were_sent():
    from graphfl.client.noisy_channel import transmit_upload
    from graphfl.common.compress import decode_received

    up, ref, enc = _encoded("topk", k=0.1)
    idx = enc.wire_arrays["graphfl.z/w/idx"]
    sent, mask = transmit_upload(enc.wire_arrays, 0.0, 0.5, 4, 0, 1, "fit", ref_mean_abs=1.0)
    assert mask is not None and mask["w"].shape == (40, 50)
    lost = np.flatnonzero(~mask["w"])
    assert set(lost) <= set(idx.tolist()) and 0.35 < lost.size / idx.size < 0.65
    got = decode_received(sent, ref, up, mask)
    m = got.mask["w"]
    np.testing.assert_allclose(got.arrays["w"][m], enc.decoded["w"][m], rtol=1e-6)
    np.testing.assert_array_equal(got.arrays["w"].ravel()[lost], ref["w"].ravel()[lost])  # 0 change + 0 noise


def test_fedavg_run_through_quant_and_a_noisy_lossy_channel_counts_what_was_lost():
    """Every reply stays valid (a lost array decodes as the reference, never NaN) and run.json says what was lost."""
    doc, _ = run_federated_inprocess(parse_run_config({**BASE, "strategy": "fedavg", "channel.missing": 0.3,
                                                       "channel.noise": 0.5, "rounds": 2}))
    rows = doc["methods"]["fedavg"]["curve"]
    assert all(r["clients_ok"] == 3 for r in rows[1:])
    assert rows[1]["server"]["channel_arrays_lost"] >= 1
    assert 0.3 < rows[1]["server"]["channel_missing_fraction"] < 0.9


# ---------------------------------------------------------------------------------------
# the noise reference: the common initial model θ⁰
# ---------------------------------------------------------------------------------------

def test_noise_scale_does_not_grow_with_the_uploads_magnitude():
    from graphfl.client.noisy_channel import transmit_upload

    theta = np.random.default_rng(0).standard_normal(20000)
    stds = []
    for scale in (1.0, 10.0):
        got, _ = transmit_upload({"w": scale * theta}, 0.5, 0.0, 1, 0, 3, "fit", ref_mean_abs=0.2)
        stds.append(float((got["w"] - scale * theta).std()))
    assert stds[0] == pytest.approx(0.1, rel=0.03) and stds[1] == pytest.approx(0.1, rel=0.03)
    # the same holds for a quantised upload: σ in model units, from the reference
    up, ref, enc = _encoded(bits=12, scale=10.0)
    sent, mask = transmit_upload(enc.wire_arrays, 0.5, 0.0, 1, 0, 3, "fit", ref_mean_abs=0.2)
    from graphfl.common.compress import decode_received
    err = decode_received(sent, ref, up, mask).arrays["w"] - enc.decoded["w"]
    assert float(err.std()) == pytest.approx(0.1, rel=0.1)
    with pytest.raises(ValueError, match="graphfl.channel-ref"):
        transmit_upload(enc.wire_arrays, 0.5, 0.0, 1, 0, 3, "fit")      # no reference for a compressed upload


def test_the_server_sends_the_initial_models_mean_as_the_noise_reference(monkeypatch):
    import graphfl.server.inprocess as inprocess
    from graphfl.client.noisy_channel import reference_scale

    seen = []
    real = inprocess.transmit_upload

    def spy(*args, **kwargs):
        seen.append(args[7])
        return real(*args, **kwargs)

    monkeypatch.setattr(inprocess, "transmit_upload", spy)
    cfg = parse_run_config({**BASE, "compress.kind": "none", "strategy": "fedavg", "rounds": 2, "channel.noise": 0.3})
    run_federated_inprocess(cfg)
    inputs = inprocess.server_inputs(cfg)
    want = reference_scale(inputs.initial_arrays, inputs.param_keys)
    assert want > 0 and len(seen) == 6 and all(r == want for r in seen)  # every round: θ⁰'s, not the upload's


def test_channel_mod_reads_the_reference_from_the_request():
    import time

    from flwr.app import ConfigRecord, Context, Message, MessageType, Metadata, RecordDict

    from graphfl.client.noisy_channel import CHANNEL_REF, noisy_channel_mod
    from graphfl.common import wire
    from graphfl.common.records import arrays_to_record, get_arrays

    theta = {"w": np.random.default_rng(0).standard_normal(20000) * 10}
    config = ConfigRecord({wire.ROUND: 2, wire.PHASE: "fit", CHANNEL_REF: 0.2})
    meta = Metadata(run_id=1, message_id="m", src_node_id=1, dst_node_id=5, reply_to_message_id="", group_id="2",
                    created_at=time.time(), ttl=60.0, message_type=MessageType.TRAIN)
    msg = Message(content=RecordDict({wire.CONFIG: config}), metadata=meta)
    ctx = Context(run_id=1, node_id=5, node_config={wire.NODE_PARTITION_ID: 0}, state=RecordDict(),
                  run_config={wire.CHANNEL_NOISE: 0.5, wire.RUN_SEED: 0})
    reply = noisy_channel_mod(msg, ctx, lambda m, c: Message(RecordDict({wire.ARRAYS: arrays_to_record(theta)}),
                                                             reply_to=m))
    got = get_arrays(reply.content, wire.ARRAYS)
    assert got is not None and float((got["w"] - theta["w"]).std()) == pytest.approx(0.1, rel=0.03)


# ---------------------------------------------------------------------------------------
# the same through a real Flower deployment (the ClientApp's mod, TLS, 2 SuperNodes)
# ---------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_quantised_uploads_through_the_channel_mod_in_a_real_deployment_equal_inprocess(tmp_path):
    import json

    from graphfl.deploy.run import run_experiment

    values = {**BASE, "nodes": 2, "rounds": 2, "channel.missing": 0.3, "channel.noise": 0.2,
              "connect-timeout": 90, "round-timeout": 120}
    out = run_experiment(parse_run_config({**values, "engine": "local-deployment", "out-dir": str(tmp_path)}))
    doc = json.loads((out / "run.json").read_text())
    assert doc["status"] == "completed", doc.get("error")
    got = doc["methods"]["jgesr"]["curve"]
    want = run_federated_inprocess(parse_run_config(values))[0]["methods"]["jgesr"]["curve"]
    assert [r["round"] for r in got] == [0, 1, 2]
    for g, w in zip(got[1:], want[1:]):
        assert g["clients_ok"] == 2 and "failed" not in g
        server = g["server"]
        # the masks crossed the wire, survived decoding and reached JGESR; lost headers were counted
        assert server["missing_fraction"] == pytest.approx(server["channel_missing_fraction"], rel=1e-6)
        assert server["channel_missing_fraction"] > 0.25
        for key in ("channel_arrays_lost", "channel_missing_fraction", "missing_fraction"):
            assert server[key] == pytest.approx(w["server"][key], rel=1e-6)
        assert g["test_loss"] == pytest.approx(w["test_loss"], rel=1e-5)
        assert g["bytes_up"] < 0.3 * g["bytes_up_decoded"]                # still compressed on the wire
    assert sum(g["server"]["channel_arrays_lost"] for g in got[1:]) >= 1  # this seed loses a header on the way


@pytest.mark.parametrize("kind", ["quant", "topk"])
def test_scalar_arrays_pass_the_channel_with_a_scalar_mask(kind):
    from graphfl.client.noisy_channel import transmit_upload
    from graphfl.common.compress import decode_received, encode
    from graphfl.common.config import CompressConfig

    up = {"s": np.asarray(1.5, dtype=np.float32)}
    enc = encode(up, {}, CompressConfig(kind=kind, bits=4, k=1.0), np.random.default_rng(0), {})
    masks = []
    for seed in range(12):
        sent, mask = transmit_upload(enc.wire_arrays, 0.3, 0.5, seed, 0, 1, "fit", ref_mean_abs=1.0)
        got = decode_received(sent, {}, up, mask)
        assert got.mask is not None and got.mask["s"].shape == () and np.isfinite(got.arrays["s"])
        masks.append(bool(got.mask["s"]))
    assert 0 < sum(masks) < 12
