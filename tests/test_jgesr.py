"""JGESR as a strategy and the noisy channel as a Flower client mod (issue 11).

* the mod corrupts a train reply's arrays exactly as :func:`transmit_upload` (the in-process
  driver's call) does, puts the mask beside them, is deterministic under the seed, and leaves
  replies untouched when the channel is off;
* the masks travel to the core (reply -> ClientUpdate), and the JGESR core uses them: on a
  planted two-cluster toy its restored ψ_k are closer to the true models than the raw uploads,
  the learned graph separates the clusters, and ignoring the mask is worse;
* warm starts across rounds; both solvers; in-process runs deterministic under the seed.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, Metadata, RecordDict

from graphfl.client.noisy_channel import noisy_channel_mod, transmit_upload
from graphfl.common import wire
from graphfl.common.config import RunConfig, parse_run_config
from graphfl.common.core import ServerContext
from graphfl.common.records import arrays_to_record, get_arrays, record_to_arrays
from graphfl.common.types import ClientUpdate
from graphfl.server.flower_adapter import reply_from_message
from graphfl.server.inprocess import run_federated_inprocess
from graphfl.strategies.jgesr import JGESRConfig, JGESRCore

UPLOAD = {"w": np.linspace(-1, 1, 300, dtype=np.float32).reshape(30, 10), "b": np.arange(5, dtype=np.float32),
          "count": np.array(7, dtype=np.int64)}


def _train_message(server_round: int = 3, phase: str = "fit", mtype: str = MessageType.TRAIN) -> Message:
    """A message as a ClientApp receives it (metadata set, as the SuperLink does)."""
    config = ConfigRecord({wire.ROUND: server_round, wire.PHASE: phase, wire.KIND: wire.TRAIN})
    meta = Metadata(run_id=1, message_id="m1", src_node_id=1, dst_node_id=11, reply_to_message_id="",
                    group_id=str(server_round), created_at=time.time(), ttl=3600.0, message_type=mtype)
    return Message(content=RecordDict({wire.CONFIG: config}), metadata=meta)


def _context(run_config: dict, pid: int = 2) -> Context:
    return Context(run_id=1, node_id=11, node_config={wire.NODE_PARTITION_ID: pid, wire.NODE_NUM_PARTITIONS: 4},
                   state=RecordDict(), run_config=run_config)


def _client(msg: Message, ctx: Context) -> Message:
    return Message(RecordDict({wire.ARRAYS: arrays_to_record(UPLOAD)}), reply_to=msg)


def test_channel_mod_corrupts_train_replies_as_the_inprocess_driver_does():
    run = {wire.CHANNEL_NOISE: 0.3, wire.CHANNEL_MISSING: 0.25, wire.RUN_SEED: 5}
    reply = noisy_channel_mod(_train_message(), _context(run), _client)
    got = get_arrays(reply.content, wire.ARRAYS)
    mask = get_arrays(reply.content, wire.MASK_PREFIX + wire.ARRAYS)
    assert got is not None and mask is not None
    want, want_mask = transmit_upload(UPLOAD, 0.3, 0.25, seed=5, partition_id=2, server_round=3, phase="fit")
    assert want_mask is not None and set(mask) == {"w", "b"}          # float arrays only
    for k in UPLOAD:
        assert got[k].tobytes() == want[k].tobytes() and got[k].dtype == UPLOAD[k].dtype
    for k in mask:
        np.testing.assert_array_equal(mask[k], want_mask[k])
    assert got["count"] == 7                                            # integer buffer untouched
    lost = ~mask["w"]
    assert 0.15 < lost.mean() < 0.35
    # missing entries carry 0 + noise of σ = 0.3·mean|θ| (not the model's value)
    sigma = 0.3 * float(np.mean(np.abs(np.concatenate([UPLOAD["w"].ravel(), UPLOAD["b"]]))))
    assert np.std(got["w"][lost]) == pytest.approx(sigma, rel=0.35)
    # the server side reads the mask into the Reply
    rep = reply_from_message(reply, 2)
    assert rep.mask is not None and np.array_equal(rep.mask["w"], mask["w"])


def test_channel_mod_is_deterministic_under_the_seed_and_depends_on_it():
    def send(seed, server_round=3, pid=2):
        run = {wire.CHANNEL_NOISE: 0.1, wire.CHANNEL_MISSING: 0.1, wire.RUN_SEED: seed}
        reply = noisy_channel_mod(_train_message(server_round), _context(run, pid), _client)
        return get_arrays(reply.content, wire.ARRAYS)["w"]  # type: ignore[index]

    assert send(1).tobytes() == send(1).tobytes()
    assert not np.array_equal(send(1), send(2))
    assert not np.array_equal(send(1), send(1, server_round=4))        # a fresh draw per round ...
    assert not np.array_equal(send(1), send(1, pid=3))                 # ... and per client


@pytest.mark.parametrize("run", [{}, {wire.CHANNEL_NOISE: 0.0, wire.CHANNEL_MISSING: 0.0, wire.RUN_SEED: 3}])
def test_channel_off_returns_the_reply_untouched(run):
    seen = {}

    def client(msg, ctx):
        seen["reply"] = _client(msg, ctx)
        return seen["reply"]

    reply = noisy_channel_mod(_train_message(), _context(run), client)
    assert reply is seen["reply"]
    assert list(reply.content.array_records) == [wire.ARRAYS]
    got = record_to_arrays(reply.content.array_records[wire.ARRAYS])
    assert all(got[k].tobytes() == UPLOAD[k].tobytes() for k in UPLOAD)
    arrays, mask = transmit_upload(UPLOAD, 0.0, 0.0, 0, 0, 1, "fit")
    assert mask is None and all(arrays[k] is UPLOAD[k] for k in UPLOAD)


def test_channel_mod_leaves_evaluate_replies_alone_and_rejects_bad_config():
    run = {wire.CHANNEL_NOISE: 0.5, wire.RUN_SEED: 0}
    msg = _train_message(mtype=MessageType.EVALUATE)
    reply = noisy_channel_mod(msg, _context(run), _client)
    assert wire.MASK_PREFIX + wire.ARRAYS not in reply.content
    with pytest.raises(ValueError, match="channel.noise"):
        noisy_channel_mod(_train_message(), _context({wire.CHANNEL_NOISE: "loud"}), _client)


def test_channel_config_keys_are_validated():
    cfg = parse_run_config({"channel.noise": 0.2, "channel.missing": 0.1})
    assert cfg.channel.noise == 0.2 and cfg.channel.active
    assert not RunConfig().channel.active
    with pytest.raises(ValueError, match="channel.missing"):
        parse_run_config({"channel.missing": 1.5})
    with pytest.raises(ValueError, match="valid keys"):
        parse_run_config({"channel.snr": 3})


# ---------------------------------------------------------------------------------------
# the core, on a planted two-cluster toy
# ---------------------------------------------------------------------------------------

N_PER, D = 4, 400


def _core(**params) -> JGESRCore:
    cfg = JGESRConfig(**params)
    template = {"w": np.zeros(D, dtype=np.float32)}
    ctx = ServerContext(config=RunConfig(strategy="jgesr", params=cfg), params=cfg, num_clients=2 * N_PER,
                        initial_arrays=template, param_keys=("w",), num_examples={i: 100 for i in range(2 * N_PER)})
    return JGESRCore(ctx)


def _planted(noise=0.5, missing=0.3, seed=0):
    rng = np.random.default_rng(seed)
    truth = np.repeat(rng.standard_normal((2, D)), N_PER, axis=0).astype(np.float32)
    updates = {}
    for pid in range(2 * N_PER):
        arrays, mask = transmit_upload({"w": truth[pid]}, noise, missing, seed, pid, 1, "fit")
        updates[pid] = ClientUpdate(pid, arrays, 100, mask=mask)
    return truth, updates


def _restored(core: JGESRCore) -> np.ndarray:
    return np.stack([core.configure_train(2, pid).arrays["w"] for pid in range(2 * N_PER)])


@pytest.mark.parametrize("solver", ["pdca", "two-step"])
def test_core_restores_a_planted_toy_better_than_the_raw_uploads(solver):
    truth, updates = _planted()
    core = _core(solver=solver)
    metrics = core.aggregate_train(1, updates)
    raw = np.stack([u.arrays["w"] for u in updates.values()])
    mask = np.stack([u.mask["w"] for u in updates.values()])
    psi = _restored(core)
    raw_mse = float(np.mean((raw - truth) ** 2))                    # missing entries: 0 + noise
    mse = float(np.mean((psi - truth) ** 2))
    assert mse < 0.5 * raw_mse, (mse, raw_mse)
    assert metrics["missing_fraction"] == pytest.approx(1 - mask.mean())
    graph = np.asarray(metrics["graph"])
    group = np.arange(2 * N_PER) // N_PER
    within = graph[(group[:, None] == group[None, :]) & ~np.eye(2 * N_PER, dtype=bool)].mean()
    across = graph[group[:, None] != group[None, :]].mean()
    assert within > 10 * across, (within, across)
    # ignoring the mask (the zeros of lost entries taken as data) restores worse
    blind = _core(solver=solver, use_mask=False)
    blind.aggregate_train(1, updates)
    assert mse < float(np.mean((_restored(blind) - truth) ** 2))


def test_core_treats_nan_like_the_mask_and_warm_starts_across_rounds():
    truth, updates = _planted(noise=0.3, missing=0.2, seed=1)
    as_nan = {pid: ClientUpdate(pid, {"w": np.where(u.mask["w"], u.arrays["w"], np.nan)}, 100)
              for pid, u in updates.items()}
    a, b = _core(), _core()
    first = a.aggregate_train(1, updates)
    b.aggregate_train(1, as_nan)
    np.testing.assert_allclose(_restored(a), _restored(b), atol=1e-6)
    assert first["warm_start"] == 0
    second = a.aggregate_train(2, updates)                          # same clients: warm start
    assert second["warm_start"] == 1 and second["iterations"] < first["iterations"]
    assert a.aggregate_train(3, {}) == {"clients_aggregated": 0}   # nothing new: nothing moves
    np.testing.assert_array_equal(_restored(a), np.stack([a.evaluation_payload(p).arrays["w"] for p in range(8)]))


def test_client_without_upload_gets_the_mean_and_others_their_own_model():
    truth, updates = _planted(noise=0.1, missing=0.0)
    core = _core()
    assert core.configure_train(1, 0).arrays["w"].tobytes() == np.zeros(D, np.float32).tobytes()
    core.aggregate_train(1, {p: u for p, u in updates.items() if p != 0})
    psi = _restored(core)
    np.testing.assert_allclose(psi[0], psi[1:].mean(axis=0), atol=1e-6)   # equal sample counts
    assert not np.allclose(psi[1], psi[N_PER])                              # per-client payloads
    with pytest.raises(ValueError, match="partition id"):
        core.configure_train(1, 99)


def test_noisy_inprocess_runs_are_deterministic_and_channel_off_equals_no_channel(tmp_path):
    base = {"strategy": "jgesr", "task": "digits", "nodes": 3, "rounds": 2, "engine": "inprocess",
            "train.local-steps": 2}
    noisy = {**base, "channel.noise": 0.2, "channel.missing": 0.2}

    def curve(values):
        doc, _ = run_federated_inprocess(parse_run_config(values))
        return [(r["test_loss"], r.get("server", {}).get("graph")) for r in doc["methods"]["jgesr"]["curve"]]

    assert curve(noisy) == curve(noisy)
    assert curve(noisy) != curve({**noisy, "seed": 1})
    off = curve({**base, "channel.noise": 0.0, "channel.missing": 0.0})
    assert off == curve(base)
    assert off != curve(noisy)


def test_the_last_learned_graph_is_drawn_in_the_run_plot(tmp_path, monkeypatch):
    from graphfl.common import results

    graphs = [[[0, 1], [1, 0]], [[0, 2], [2, 0]]]
    curve = [{"round": 0, "test_loss": 1.0}] + [{"round": r, "test_loss": 1.0 / (r + 1), "server": {"graph": g}}
                                                 for r, g in enumerate(graphs, start=1)]
    seen = []
    real = results.plot_panels
    monkeypatch.setattr(results, "plot_panels", lambda path, panels, title="": seen.extend(panels) or real(path, panels))
    assert results.plot_curves({"name": "run", "methods": {"jgesr": {"curve": curve}}}, tmp_path / "run.png")
    matrices = [p for p in seen if "matrix" in p]
    assert len(matrices) == 1 and matrices[0]["matrix"] == graphs[-1] and "round 2" in matrices[0]["title"]
    assert (tmp_path / "run.png").stat().st_size > 0
