"""APFL / FedGATE / APFLGate cores and the upload codec: hand-computed steps and invariants.

ALGORITHMS.md §9. Pure-math checks run in milliseconds; the in-process runs (digits, 4
clients, 2–3 rounds of a few steps) take a few seconds each.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphfl.common import registry
from graphfl.common.compress import decode, dequantize, encode, quantize, topk_count, topk_indices
from graphfl.common.config import CompressConfig, ConfigError, parse_run_config
from graphfl.server.inprocess import InProcessExchange, server_inputs
from graphfl.server.recorder import RunRecorder
from graphfl.server.rounds import run_federated
from graphfl.strategies.apfl_math import (
    alpha_gradient,
    alpha_step,
    client_update,
    delta_contraction,
    delta_update,
    effective_tau,
    mean_update,
    mix_outputs,
    server_step,
    tau_problem,
)

# ---------------------------------------------------------------------------------------
# pure rules
# ---------------------------------------------------------------------------------------


def test_server_step_and_delta_update_by_hand():
    w = {"a": np.array([1.0, 2.0], dtype=np.float32)}
    w_i = [{"a": np.array([0.0, 2.0], dtype=np.float32)}, {"a": np.array([1.0, 0.0], dtype=np.float32)}]
    u = [client_update(w, x) for x in w_i]
    np.testing.assert_array_equal(u[0]["a"], [1.0, 0.0])
    u_bar = mean_update(u)
    np.testing.assert_array_equal(u_bar["a"], [0.5, 1.0])
    new = server_step(w, u_bar, gamma=0.5)
    assert new["a"].dtype == np.float32
    np.testing.assert_array_equal(new["a"], [0.75, 1.5])
    d = delta_update({"a": np.array([0.1, 0.0])}, u[0], u_bar, eta=0.1, tau=5.0)
    np.testing.assert_allclose(d["a"], [0.1 + 0.5 / 0.5, 0.0 - 1.0 / 0.5])
    with pytest.raises(ValueError, match="η·τ > 0"):
        delta_update(d, u[0], u_bar, eta=0.1, tau=0.0)


def _quadratic_fedgate(tau: float, steps: int = 10, rounds: int = 150) -> tuple[float, float]:
    """FedGATE on f_i(w) = a_i/2 ‖w − c_i‖² (4 clients) through the pure rules; (‖w − w*‖, max |δ|)."""
    rng = np.random.default_rng(0)
    a, c, eta = np.array([0.5, 1.0, 2.0, 4.0]), rng.normal(size=(4, 3)) * 3.0, 0.02
    w_star = (a[:, None] * c).sum(0) / a.sum()              # minimiser of Σ_i f_i
    w = {"w": np.zeros(3)}
    delta = [{"w": np.zeros(3)} for _ in a]
    with np.errstate(over="ignore", invalid="ignore"):
        for _ in range(rounds):
            ups = []
            for i in range(4):
                w_i = w["w"].copy()
                for _ in range(steps):
                    w_i = w_i - eta * (a[i] * (w_i - c[i]) - delta[i]["w"])
                ups.append(client_update(w, {"w": w_i}))
            u_bar = mean_update(ups)
            w = server_step(w, u_bar, 1.0)
            delta = [delta_update(delta[i], ups[i], u_bar, eta, tau) for i in range(4)]
    err = float(np.linalg.norm(w["w"] - w_star))
    return (err if np.isfinite(err) else np.inf), max(float(np.abs(d["w"]).max()) for d in delta)


def test_delta_recursion_stability_boundary_is_tau_half_the_local_steps():
    """C5: δ ← (1 − R/τ)δ + (R/τ)(g_i − ḡ): τ = 0.4R diverges, 0.6R and R converge to w*; the
    rule refuses exactly the unstable side."""
    R = 10
    err, size = _quadratic_fedgate(0.4 * R, R)
    assert not err < 1e3 and not size < 1e6                 # diverged (or overflowed to inf/nan)
    for factor in (0.6, 1.0):
        err, size = _quadratic_fedgate(factor * R, R)
        assert err < 1e-8 and size < 100, factor              # converged to the minimiser of Σ f_i
    assert delta_contraction(0.4 * R, R) == pytest.approx(-1.5) and delta_contraction(0.6 * R, R) == pytest.approx(-2 / 3)
    assert tau_problem("fedgate.tau", 0.4 * R, "absolute", R) is not None
    assert tau_problem("fedgate.tau", 0.5 * R, "absolute", R) is not None           # |1 − R/τ| = 1: no contraction
    assert tau_problem("fedgate.tau", 0.6 * R, "absolute", R) is None
    assert tau_problem("fedgate.tau", 0.4, "multiple-of-steps", R) is not None
    assert tau_problem("fedgate.tau", 0.6, "multiple-of-steps", R) is None
    assert tau_problem("fedgate.tau", 0.0, "absolute", R) is None                   # 0 = R


def test_tau_defaults_to_the_local_steps_and_reads_multiples_of_them():
    assert effective_tau(0.0, "absolute", 7) == 7.0 and effective_tau(0.0, "multiple-of-steps", 7) == 7.0
    assert effective_tau(10.0, "absolute", 7) == 10.0
    assert effective_tau(10.0, "multiple-of-steps", 7) == 70.0
    assert effective_tau(0.1, "multiple-of-steps", 4) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="choose one of"):
        effective_tau(1.0, "relative", 7)
    for name in ("fedgate", "apflgate"):
        params = parse_run_config({"strategy": name}).params
        assert params.tau == 0.0 and params.tau_mode == "absolute"


def test_mixing_and_alpha_step_clip():
    np.testing.assert_allclose(mix_outputs(np.array([1.0]), np.array([3.0]), 0.25), [2.5])
    assert alpha_gradient(np.array([2.0, -1.0]), np.array([1.0, 1.0]), np.array([0.0, 3.0])) == 2.0 + 2.0
    assert alpha_step(0.5, 4.0, 0.1) == pytest.approx(0.1)
    assert alpha_step(0.5, 10.0, 0.1) == 0.0 and alpha_step(0.5, -10.0, 0.1) == 1.0


def test_personal_step_and_adaptive_alpha_match_a_hand_computed_step():
    """One APFL personal step on a linear model with MSE, against numpy by hand (§9.1)."""
    from graphfl.client.gate_trainer import personal_step

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    W0 = model.weight.detach().numpy().astype(np.float64).copy()
    b0 = model.bias.detach().numpy().astype(np.float64).copy()
    x = np.array([[1.0, 0.0, 2.0], [0.5, -1.0, 1.0]])
    y = np.array([[1.0], [-2.0]])
    h_w = np.array([[0.3], [0.1]])
    alpha, lr, alpha_lr = 0.4, 0.05, 0.2
    loss, new_alpha = personal_step(model, torch.tensor(h_w, dtype=torch.float32), torch.tensor(x, dtype=torch.float32),
                                    torch.tensor(y, dtype=torch.float32), alpha, torch.nn.MSELoss(), lr, [None, None],
                                    adaptive=True, alpha_lr=alpha_lr)
    h_v = x @ W0.T + b0
    y_hat = mix_outputs(h_v, h_w, alpha)
    g_yhat = 2.0 * (y_hat - y) / y.size                      # ∂ mean((ŷ−y)²) / ∂ŷ
    assert loss == pytest.approx(float(np.mean((y_hat - y) ** 2)), rel=1e-5)
    g_w = alpha * g_yhat.T @ x
    g_b = alpha * g_yhat.sum(0)
    np.testing.assert_allclose(model.weight.detach().numpy(), W0 - lr * g_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.bias.detach().numpy(), b0 - lr * g_b, rtol=1e-5, atol=1e-6)
    expect_alpha = alpha_step(alpha, alpha_gradient(g_yhat, h_v, h_w), alpha_lr)
    assert new_alpha == pytest.approx(expect_alpha, abs=1e-6)
    assert new_alpha != alpha


# ---------------------------------------------------------------------------------------
# codec
# ---------------------------------------------------------------------------------------


def test_quantisation_error_bound_and_unbiasedness():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40,)) * 3.0
    for bits in (1, 2, 4, 8, 12):
        codes, lo, step = quantize(x, bits, np.random.default_rng(bits))
        assert step == pytest.approx((x.max() - x.min()) / (2 ** bits - 1))
        err = np.abs(dequantize(codes, lo, step) - x)
        assert err.max() <= step * (1 + 1e-12)
        assert codes.dtype == (np.uint8 if bits <= 8 else np.uint16)
    # E[Q(x)] = x: the mean over 4000 seeds is within 5 standard errors of x (step²/4 bounds the variance)
    bits, trials = 2, 4000
    draws = np.stack([dequantize(*quantize(x, bits, np.random.default_rng(s))) for s in range(trials)])
    step = (x.max() - x.min()) / (2 ** bits - 1)
    assert np.all(np.abs(draws.mean(0) - x) <= 5 * (step / 2) / np.sqrt(trials))
    # a constant array round-trips exactly
    codes, lo, step = quantize(np.full(5, 2.5), 4, rng)
    np.testing.assert_array_equal(dequantize(codes, lo, step), np.full(5, 2.5))


def test_bit_packing_round_trips_and_takes_b_bits_per_code():
    from graphfl.common.compress import pack_codes, unpack_codes

    rng = np.random.default_rng(5)
    for bits in (1, 3, 4, 8, 11, 16):
        codes = rng.integers(0, 2 ** bits, size=37)
        packed = pack_codes(codes, bits)
        assert packed.dtype == np.uint8 and packed.size == -(-37 * bits // 8)
        np.testing.assert_array_equal(unpack_codes(packed, bits, 37), codes)


def test_topk_keeps_exactly_the_k_largest():
    x = np.array([0.1, -5.0, 3.0, 0.0, -3.0, 2.0, 7.0])
    idx = topk_indices(x, 3)
    assert idx.tolist() == [1, 2, 6]                      # tie |3| = |−3|: lower index first
    assert topk_count(7, 0.5) == 4 and topk_count(7, 1e-6) == 1 and topk_count(0, 0.5) == 0
    assert topk_indices(x, 99).tolist() == list(range(7))


def test_topk_error_memory_accumulates_the_residual():
    cfg = CompressConfig(kind="topk", k=0.25)
    state: dict[str, np.ndarray] = {}
    ref = {"w": np.zeros(8, dtype=np.float32)}
    ups = [np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.float32), np.array([8, 0, 0, 0, 0, 0, 0, -1], dtype=np.float32)]
    sent = np.zeros(8)
    for t, up in enumerate(ups):
        enc = encode({"w": up}, ref, cfg, np.random.default_rng(t), state)
        assert enc.wire_arrays["graphfl.z/w/idx"].size == 2
        dec = decode(enc.wire_arrays, ref, {"w": up})
        np.testing.assert_array_equal(dec["w"], enc.decoded["w"])   # server sees what the client kept
        sent += dec["w"]
    mem = state["compress.err/w"]
    # round 1 sends 7, 8 (memory keeps 1..6); round 2: c = (9,2,3,4,5,6,0,-1) → sends 9 and 6
    np.testing.assert_array_equal(sent, [9, 0, 0, 0, 0, 6, 7, 8])
    np.testing.assert_array_equal(mem, [0, 2, 3, 4, 5, 0, 0, -1])
    np.testing.assert_allclose(sent + mem, ups[0] + ups[1])           # nothing is lost, only delayed


def test_codec_codes_the_change_against_the_payload_and_passes_int_arrays_raw():
    ref = {"w": np.array([10.0, 10.0, 10.0, 10.0], dtype=np.float32), "n": np.array(3)}
    up = {"w": np.array([10.5, 9.0, 10.0, 12.0], dtype=np.float32), "n": np.array(4), "extra": np.ones(2, np.float32)}
    enc = encode(up, ref, CompressConfig(kind="quant", bits=8), np.random.default_rng(1), {})
    assert "n" in enc.wire_arrays and "graphfl.z/w/q" in enc.wire_arrays
    assert float(enc.wire_arrays["graphfl.z/w/lo"]) == pytest.approx(-1.0)        # min of up − ref
    dec = decode(enc.wire_arrays, ref, {k: v for k, v in up.items()})
    step = 3.0 / 255
    assert np.abs(dec["w"] - up["w"]).max() <= step + 1e-6
    assert dec["n"] == 4 and dec["extra"].dtype == np.float32
    with pytest.raises(ValueError, match="not part of the model"):
        decode(enc.wire_arrays, ref, {"n": up["n"]})
    bad = dict(enc.wire_arrays)
    bad["graphfl.z/w/q"] = bad["graphfl.z/w/q"] * np.nan                  # a corrupted upload is refused
    with pytest.raises(ValueError, match="expected uint8"):
        decode(bad, ref, up)
    bad["graphfl.z/w/q"] = enc.wire_arrays["graphfl.z/w/q"][:1]
    with pytest.raises(ValueError, match="cannot hold"):
        decode(bad, ref, up)


def test_compress_config_errors_name_the_key_and_choices():
    with pytest.raises(ConfigError, match=r"compress.kind = 'zip' is not valid; choose one of \['none', 'quant', 'topk'\]"):
        parse_run_config({"compress.kind": "zip"})
    with pytest.raises(ConfigError, match="compress.bits = 0 must be >= 1"):
        parse_run_config({"compress.bits": 0})
    with pytest.raises(ConfigError, match="compress.k"):
        parse_run_config({"compress.k": 2.0})


# ---------------------------------------------------------------------------------------
# in-process runs: persistent state, the FedGATE invariant, compression on the wire
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["fedgate", "apflgate"])
def test_a_tau_below_half_the_local_steps_is_refused_naming_the_key(strategy):
    with pytest.raises(ConfigError, match=rf"{strategy}\.tau = 1 \(absolute\) gives τ = 1 with R = "
                                          r"train\.local-steps = 3, but τ must exceed R/2 = 1\.5"):
        _run(strategy, **{f"{strategy}.tau": 1.0})
    with pytest.raises(ConfigError, match=rf"{strategy}\.tau = 0\.1 \(multiple-of-steps\) gives τ = 0\.1 × R = 0\.3"):
        _run(strategy, **{f"{strategy}.tau": 0.1, f"{strategy}.tau-mode": "multiple-of-steps"})
    with pytest.raises(ConfigError, match=rf"{strategy}\.tau-mode = 'relative' is not valid; choose one of "
                                          r"\['absolute', 'multiple-of-steps'\]"):
        parse_run_config({"strategy": strategy, f"{strategy}.tau-mode": "relative"})
    from graphfl.strategies.fedgate import check_tau

    spec = registry.get(strategy)
    assert spec.preflight is check_tau                       # deployments refuse it before any process starts
    ok = parse_run_config({"strategy": strategy, "train.local-steps": 3, f"{strategy}.tau": 0.6,
                           f"{strategy}.tau-mode": "multiple-of-steps"})
    check_tau(ok, {}, ())


@pytest.mark.parametrize("strategy", ["fedgate", "apflgate"])
def test_delta_update_divides_by_the_local_steps_run_by_default(strategy):
    """With the default τ, the δ a client applies in round 2 is (u_i − ū)/(η R), R = 3 steps run."""
    exchange, _, core = _run(strategy, rounds=1)
    pid = 1
    state = dict(exchange.states[pid])
    assert int(state["gate.up-steps"]) == 3
    u_i = {k[len("gate.up/"):]: v for k, v in state.items() if k.startswith("gate.up/")}
    trainer = exchange.runtime(pid).trainer
    trainer.fit(2, core.configure_train(2, pid), state)
    for k, u in u_i.items():
        expect = (u.astype(np.float64) - core.u_bar[k].astype(np.float64)) / (0.05 * 3)
        np.testing.assert_allclose(state["gate.delta/" + k], expect, rtol=1e-5, atol=1e-6, err_msg=k)
    assert max(float(np.abs(state["gate.delta/" + k]).max()) for k in u_i) > 1e-3


@pytest.mark.parametrize("strategy", ["apfl", "apflgate"])
def test_personal_output_mixes_with_the_locally_trained_copy(strategy):
    """C6: ŷ = α h(v_i) + (1 − α) h(w_i) with w_i the copy after this round's local steps (the fit
    result, before aggregation); ``personal-output = aggregated`` mixes with the server's w."""
    from graphfl.client.gate_trainer import OutputMixture
    from graphfl.client.training import evaluate_client, set_arrays

    exchange, curve, core = _run(strategy, rounds=2)
    pid = 2
    runtime = exchange.runtime(pid)
    trainer, task, data = runtime.trainer, runtime.ctx.task, runtime.ctx.data
    state = dict(exchange.states[pid])
    fit = trainer.fit(3, core.configure_train(3, pid), state)           # the locally trained w_i of round 3
    core.aggregate_train(3, {p: _update(p, exchange, core, 3) if p != pid else _fitted(pid, fit) for p in range(4)})
    payload = core.evaluation_payload(pid)
    got = trainer.evaluate(payload, state)

    def mixture(w_arrays):
        v, w = task.build_model(), task.build_model()
        set_arrays(v, {k[len("model."):]: a for k, a in state.items() if k.startswith("model.")})
        set_arrays(w, w_arrays)
        return evaluate_client(OutputMixture(v, w, float(state["apfl.alpha"])), task, data, trainer.loss_fn)

    local, aggregated = mixture(fit.arrays), mixture(trainer.model_arrays(payload))
    assert abs(local["test_loss"] - aggregated["test_loss"]) > 1e-4          # the two forms differ here
    assert got["test_loss"] == pytest.approx(local["test_loss"], rel=1e-6)
    assert got["mix_local_test_loss"] == pytest.approx(local["test_loss"], rel=1e-6)
    assert got["mix_aggregated_test_loss"] == pytest.approx(aggregated["test_loss"], rel=1e-6)
    # the curve carries both forms; the main numbers are the configured one
    assert curve[2]["test_acc"] == pytest.approx(curve[2]["mix_local_test_acc"], rel=1e-9)
    assert curve[2]["mix_aggregated_test_acc"] is not None and curve[2]["global_test_acc"] is not None
    _, agg_curve, _ = _run(strategy, rounds=2, **{f"{strategy}.personal-output": "aggregated"})
    assert agg_curve[2]["test_acc"] == pytest.approx(agg_curve[2]["mix_aggregated_test_acc"], rel=1e-9)
    assert agg_curve[2]["mix_local_test_loss"] == pytest.approx(curve[2]["mix_local_test_loss"], rel=1e-6)
    with pytest.raises(ConfigError, match=rf"{strategy}\.personal-output = 'global' is not valid; choose one of "
                                          r"\['aggregated', 'local-copy'\]"):
        parse_run_config({"strategy": strategy, f"{strategy}.personal-output": "global"})


def _fitted(pid, fit):
    from graphfl.common.types import ClientUpdate

    return ClientUpdate(pid, fit.arrays, fit.num_examples, fit.metrics)


def _update(pid, exchange, core, server_round):
    state = dict(exchange.states[pid])
    return _fitted(pid, exchange.runtime(pid).trainer.fit(server_round, core.configure_train(server_round, pid), state))


def _run(strategy: str, rounds: int = 3, **extra):
    values = {"strategy": strategy, "task": "digits", "nodes": 4, "rounds": rounds, "engine": "inprocess",
              "train.local-steps": 3, "train.lr": 0.05, "data.max-samples": 600, **extra}
    cfg = parse_run_config(values)
    exchange = InProcessExchange(cfg)
    recorder = RunRecorder(cfg, strategy, None)
    core = run_federated(cfg, registry.get(strategy), exchange, server_inputs(cfg), recorder)
    return exchange, recorder.document()["methods"][strategy]["curve"], core


def _delta_sum(exchange) -> tuple[float, float]:
    keys = [k for k in exchange.states[0] if k.startswith("gate.delta/")]
    assert keys, "no δ in client state"
    total = sum(float(np.abs(sum(exchange.states[p][k] for p in range(4))).max()) for k in keys)
    size = max(float(np.abs(exchange.states[p][k]).max()) for p in range(4) for k in keys)
    return total, size


@pytest.mark.parametrize("strategy,extra", [("fedgate", {}), ("apflgate", {"apflgate.tau": 2.0}),
                                            ("fedgate", {"compress.kind": "topk", "compress.k": 0.05})])
def test_fedgate_invariant_sum_of_deltas_is_zero_with_full_participation(strategy, extra):
    exchange, curve, _ = _run(strategy, **extra)
    total, size = _delta_sum(exchange)
    assert size > 1e-3                     # δ really moved
    assert total <= 1e-5 * size            # Σ_i δ_i = 0 (float32 ū on the wire: tiny rounding)
    # δ moved in rounds 2 and 3 on every client (the round-1 and round-2 ū included each of them)
    assert all(exchange.states[p].get("gate.up-round") == 3 for p in range(4))


def test_apfl_client_state_persists_and_alpha_adapts():
    exchange, curve, core = _run("apfl", **{"apfl.adaptive-alpha": True, "apfl.alpha-lr": 0.5})
    alphas = [float(exchange.states[p]["apfl.alpha"]) for p in range(4)]
    assert all(0.0 <= a <= 1.0 for a in alphas) and any(abs(a - 0.5) > 1e-4 for a in alphas)
    v = {k[len("model."):]: a for k, a in exchange.states[0].items() if k.startswith("model.")}
    assert v.keys() == core.w.keys()
    assert any(not np.array_equal(v[k], core.w[k]) for k in v)      # the personal model is its own
    assert not any(k.startswith("gate.") for k in exchange.states[0])


def test_compression_reports_bytes_and_off_means_untouched_uploads():
    _, raw, core_raw = _run("fedgate", rounds=2)
    _, off, core_off = _run("fedgate", rounds=2, **{"compress.kind": "none"})
    for k in core_raw.w:
        np.testing.assert_array_equal(core_raw.w[k], core_off.w[k])
    assert off[1]["bytes_up"] == raw[1]["bytes_up"] and "bytes_up_decoded" not in off[1]
    model_bytes = sum(a.nbytes for a in core_raw.w.values())
    assert raw[1]["bytes_up"] == 4 * model_bytes
    _, q, _ = _run("fedgate", rounds=2, **{"compress.kind": "quant", "compress.bits": 8})
    assert q[1]["bytes_up_decoded"] == 4 * model_bytes
    assert q[1]["bytes_up"] < 0.3 * model_bytes * 4                 # 8-bit codes + a few scalars per array
    assert q[2]["clients_ok"] == 4 and np.isfinite(q[2]["test_loss"])
    _, q4, core_q4 = _run("fedgate", rounds=2, **{"compress.kind": "quant", "compress.bits": 4})
    assert q4[1]["bytes_up"] < 0.6 * q[1]["bytes_up"]                # 4-bit codes are packed two per byte
    moved = [float(np.abs(core_q4.w[k].astype(np.float64) - core_raw.w[k]).max()) for k in core_raw.w]
    assert 0 < max(moved) < 0.5                                      # the server used the decoded Q(update)


@pytest.mark.parametrize("kind", ["quant", "topk"])
def test_compressed_upload_survives_the_flower_record_round_trip(kind):
    """What the ClientApp puts in its reply's ArrayRecord decodes to the same arrays on the server."""
    from graphfl.common.records import arrays_to_record, record_to_arrays

    rng = np.random.default_rng(3)
    ref = {"w": rng.normal(size=(4, 5)).astype(np.float32), "b": np.zeros(5, np.float32)}
    up = {k: (v + rng.normal(size=v.shape)).astype(np.float32) for k, v in ref.items()}
    enc = encode(up, ref, CompressConfig(kind=kind, bits=4, k=0.2), rng, {})
    back = record_to_arrays(arrays_to_record(enc.wire_arrays))
    dec = decode(back, ref, up)
    for k in up:
        np.testing.assert_array_equal(dec[k], enc.decoded[k])
