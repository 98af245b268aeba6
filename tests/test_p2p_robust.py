"""Robust combine rules (p2p/algorithms/robust.py): hand-computed steps, bounds, config errors, a hostile node."""

import numpy as np
import pytest

from graphfl.common.config import ConfigError
from graphfl.p2p.algorithms import registry
from graphfl.p2p.algorithms.base import Inbox, mix_inbox
from graphfl.p2p.algorithms.robust import RobustRule, clipped_combine, robust_combine, trimmed_combine, with_robust_combine


def _inbox(own, heard, weights):
    return Inbox(round=0, phase="mix", own={"params": {"theta": own}},
                 messages={j: {"params": {"theta": x}} for j, x in heard.items()}, weights=weights)


def test_trimmed_mean_drops_the_extremes_per_coordinate():
    own = np.array([1.0, 10.0])
    heard = {1: np.array([2.0, -50.0]), 2: np.array([100.0, 11.0]), 3: np.array([3.0, 12.0]),
             4: np.array([-7.0, 13.0])}
    out = trimmed_combine(0, {"theta": own}, {j: {"theta": x} for j, x in heard.items()}, trim=1)
    # coordinate 0: sorted [-7, 1, 2, 3, 100] -> mean(1, 2, 3) = 2; coordinate 1: [-50, 10, 11, 12, 13] -> 11
    np.testing.assert_allclose(out["theta"], [2.0, 11.0])


def test_trimmed_mean_keeps_one_value_when_neighbours_are_missing():
    out = trimmed_combine(0, {"theta": np.array([4.0])}, {1: {"theta": np.array([8.0])}}, trim=3)
    np.testing.assert_allclose(out["theta"], [6.0])  # m = 2 -> b = 0: the plain mean
    out = trimmed_combine(0, {"theta": np.array([4.0])}, {1: {"theta": np.array([8.0])}, 2: {"theta": np.array([1e9])}},
                          trim=3)
    np.testing.assert_allclose(out["theta"], [8.0])  # m = 3 -> b = 1: the median


def test_clipping_with_a_large_radius_is_the_weighted_mean():
    own, heard = np.array([1.0, 2.0], np.float32), {1: np.array([3.0, 0.0], np.float32), 2: np.array([-1.0, 4.0], np.float32)}
    weights = {0: 0.5, 1: 0.25, 2: 0.25}
    inbox = _inbox(own, heard, weights)
    np.testing.assert_allclose(robust_combine(RobustRule("clipped", clip=1e6), 0, inbox)["params"]["theta"],
                               mix_inbox(0, inbox)["params"]["theta"], rtol=1e-6)


def test_clipping_bounds_a_hostile_neighbour_by_its_weight_times_tau():
    own = np.zeros(3)
    heard = {1: {"theta": np.array([1e12, -1e12, 1e12])}, 2: {"theta": np.array([0.3, 0.4, 0.0])}}
    weights = {0: 0.5, 1: 0.25, 2: 0.25}
    out = clipped_combine(0, {"theta": own}, heard, weights, clip=1.0)["theta"]
    # neighbour 2 is inside the radius (distance 0.5): it counts in full; neighbour 1 moves x by at most 0.25 * 1
    honest = 0.25 * np.array([0.3, 0.4, 0.0])
    assert np.linalg.norm(out - honest) <= 0.25 * 1.0 + 1e-12
    # adaptive radius (clip = 0): tau = median distance of the two neighbours, still finite and bounded
    adaptive = clipped_combine(0, {"theta": own}, heard, weights, clip=0.0)["theta"]
    assert np.all(np.isfinite(adaptive)) and np.linalg.norm(adaptive) < 1e12


def test_rules_and_algorithms_that_do_not_fit_are_refused_by_name():
    with pytest.raises(ConfigError, match="choose one of"):
        RobustRule("median")
    with pytest.raises(ConfigError, match="combine-clip"):
        RobustRule("clipped", clip=-1.0)
    with pytest.raises(ConfigError, match="admm.*per-neighbour|use combine = 'mix'"):
        with_robust_combine(registry.create("admm"), RobustRule("trimmed"))
    algo = registry.create("dfl-sgd")
    assert with_robust_combine(algo, RobustRule("mix")) is algo


def test_a_hostile_node_derails_plain_mixing_but_not_the_trimmed_mean():
    """A complete graph of 5 DFL-SGD nodes; node 4 broadcasts 1e6 each round (a faulty or dishonest peer)."""
    from graphfl.p2p.driver import run_network_inprocess
    from graphfl.p2p.oracles import ProblemSpec, make_oracle

    n, iters = 5, 30
    w = np.full((n, n), 1.0 / n)
    oracles = [make_oracle(i, ProblemSpec("linreg", num_nodes=n, dim=3)) for i in range(n)]

    def hostile(algo):
        inner = algo.outgoing

        def outgoing(state, phase, combined, ctx):
            out = inner(state, phase, combined, ctx)
            if ctx.node == 4:
                for arrays in (out.own or {}).values():
                    for name in arrays:
                        arrays[name] = np.full_like(arrays[name], 1e6)
            return out
        algo.outgoing = outgoing
        return algo

    plain = run_network_inprocess(hostile(registry.create("dfl-sgd", alpha0=0.02)), oracles, w, iters)
    robust = run_network_inprocess(hostile(with_robust_combine(registry.create("dfl-sgd", alpha0=0.02),
                                                               RobustRule("trimmed", trim=1))), oracles, w, iters)
    far = max(np.abs(plain.states[i].theta).max() for i in range(4))
    near = max(np.abs(robust.states[i].theta).max() for i in range(4))
    assert far > 1e4  # the plain weighted mean follows the hostile node
    assert near < 100  # the trimmed mean keeps the honest nodes where their data put them
