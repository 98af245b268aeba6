"""Uplink noisy channel of seed 002 (ALGORITHMS.md §8.2): y = m ⊙ θ + n, σ = c·mean|θ|."""

from __future__ import annotations

import numpy as np
import pytest

from graphfl.client.noisy_channel import UplinkResult, apply_uplink_channel, mean_abs


def _upload(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "conv.weight": rng.standard_normal((4, 3, 3)).astype(np.float32),
        "conv.bias": np.array([-0.0, 0.0, 1.5, -2.0], dtype=np.float32),
        "fc.weight": rng.standard_normal((5, 6)),
    }


def test_identity_at_zero_noise_and_zero_missing_rate():
    up = _upload()
    before = {k: v.copy() for k, v in up.items()}
    out = apply_uplink_channel(up, 0.0, 0.0, np.random.default_rng(1))
    assert isinstance(out, UplinkResult) and out.sigma == 0.0
    for name, arr in up.items():
        got = out.arrays[name]
        assert got.dtype == arr.dtype and got.shape == arr.shape
        assert got.tobytes() == arr.tobytes()  # bit-identical, -0.0 included
        assert got is not arr  # a copy: the caller's arrays are not aliased
        assert out.masks[name].all()
        np.testing.assert_array_equal(up[name], before[name])
    assert np.signbit(out.arrays["conv.bias"][0])


def test_deterministic_for_a_seed_and_independent_of_dict_order():
    up = _upload()
    a = apply_uplink_channel(up, 0.3, 0.2, np.random.default_rng(42))
    b = apply_uplink_channel(dict(reversed(list(up.items()))), 0.3, 0.2, np.random.default_rng(42))
    c = apply_uplink_channel(up, 0.3, 0.2, np.random.default_rng(43))
    for name in up:
        assert a.arrays[name].tobytes() == b.arrays[name].tobytes()
        np.testing.assert_array_equal(a.masks[name], b.masks[name])
    assert any(a.arrays[k].tobytes() != c.arrays[k].tobytes() for k in up)


def test_sigma_is_one_scalar_over_the_whole_upload():
    up = {"big": np.full(20000, 10.0), "small": np.full(60000, 0.1)}
    # mean|θ| over all 80 000 entries: (200 000 + 6 000) / 80 000 = 2.575
    assert mean_abs(up) == pytest.approx(2.575)
    out = apply_uplink_channel(up, 0.5, 0.0, np.random.default_rng(0))
    assert out.sigma == pytest.approx(0.5 * 2.575)
    for name in up:  # the same σ in both arrays, not one per array
        noise = out.arrays[name] - up[name]
        assert noise.std() == pytest.approx(out.sigma, rel=0.02)
        assert abs(noise.mean()) < 0.03
    ref = apply_uplink_channel(up, 0.5, 0.0, np.random.default_rng(0), ref_mean_abs=0.2)
    assert ref.sigma == pytest.approx(0.1)  # σ from the common initial model θ^0


def test_missing_entries_follow_the_rate_and_the_model():
    theta = {"w": np.arange(1.0, 50001.0)}
    out = apply_uplink_channel(theta, 0.0, 0.3, np.random.default_rng(5))
    mask = out.masks["w"]
    assert mask.dtype == np.bool_
    assert mask.mean() == pytest.approx(0.7, abs=0.01)
    np.testing.assert_array_equal(out.arrays["w"], np.where(mask, theta["w"], 0.0))  # m ⊙ θ
    noisy = apply_uplink_channel(theta, 0.1, 0.3, np.random.default_rng(5))
    np.testing.assert_array_equal(noisy.masks["w"], mask)  # mask drawn before the noise
    lost = ~mask
    assert np.all(noisy.arrays["w"][lost] != 0.0)  # lost entries carry pure noise
    filled = apply_uplink_channel(theta, 0.1, 0.3, np.random.default_rng(5), fill_missing=np.nan)
    assert np.all(np.isnan(filled.arrays["w"][lost])) and np.all(np.isfinite(filled.arrays["w"][mask]))
    all_lost = apply_uplink_channel(theta, 0.0, 1.0, np.random.default_rng(0))
    assert not all_lost.masks["w"].any()


def test_other_float_dtypes_are_kept():
    up = {"h": np.linspace(-1, 1, 11).astype(np.float16)}
    out = apply_uplink_channel(up, 0.2, 0.1, np.random.default_rng(0))
    assert out.arrays["h"].dtype == np.float16


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((-0.1, 0.0), {}, "noise_coef must be finite and >= 0"),
        ((0.1, 1.5), {}, r"missing_rate must be in \[0, 1\]"),
        ((0.1, 0.0), {"ref_mean_abs": float("nan")}, "ref_mean_abs must be finite"),
    ],
)
def test_invalid_arguments_raise(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        apply_uplink_channel(_upload(), *args, np.random.default_rng(0), **kwargs)


def test_non_float_arrays_and_bad_rng_raise():
    with pytest.raises(ValueError, match="array 'steps' must have a floating dtype, got int64"):
        apply_uplink_channel({"steps": np.arange(3)}, 0.1, 0.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="rng must be a numpy.random.Generator"):
        apply_uplink_channel(_upload(), 0.1, 0.0, np.random.RandomState(0))  # type: ignore[arg-type]
