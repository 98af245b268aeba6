"""The parallel floor of ``graphfl bench p2p-throughput``: real processes over real sockets (plain
and TLS) that must end with exactly the vectors of the ring mixing they claim to time."""

from __future__ import annotations

import platform

import numpy as np
import pytest

from graphfl.bench.p2p_throughput import parallel_floor
from graphfl.bench.ring_floor import initial_theta, ring_weights
from graphfl.common.certs import generate_tls
from graphfl.p2p.mixing import mix


def ring_after(n: int, d: int, rounds: int) -> list[np.ndarray]:
    """``rounds`` synchronous steps ``θ_i ← Σ_j W_ij θ_j`` on a ring, computed in one process."""
    thetas = [initial_theta(i, d) for i in range(n)]
    for _ in range(rounds):
        thetas = [mix(ring_weights(i, n), {j: thetas[j] for j in ring_weights(i, n)}) for i in range(n)]
    return thetas


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_parallel_floor_does_the_ring_mixing_it_times(tmp_path, tls):
    cert_dir = tmp_path / "certs" if tls else None
    if cert_dir is not None:
        generate_tls(cert_dir)
    n, d, rounds = 3, 1000, 3
    res = parallel_floor(d, n, rounds=rounds, timeout=120, cert_dir=cert_dir)
    want = ring_after(n, d, rounds)
    assert want[0][:4].tolist() != initial_theta(0, d)[:4].tolist()          # the mixing moved the vectors
    for got, w in zip(res["peers"], want, strict=True):
        assert got["theta_head"] == w[:4].tolist()                            # same float32 sums, same order
        assert got["theta_sum"] == pytest.approx(float(w.astype(np.float64).sum()), rel=1e-6)
    assert len(res["round_s"]) == rounds and res["median_round_s"] > 0
    assert (res["tls_cipher"] is not None) is tls                           # TLS really negotiated, or not used
    # the floor keeps freed memory as the peers do (glibc), so it pays no page faults they do not
    assert res["malloc"] == (["retain"] if platform.libc_ver()[0] == "glibc" else ["unsupported"])
