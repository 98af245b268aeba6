"""FedADMM as a p2p algorithm (ALGORITHMS §6): equal to the reference loop, edge selection as a
protocol phase, simulated and real inaccessible devices, λ by cross-validation, settings.

Real peer processes (TLS, a killed peer, checkpoints) are covered by ``tests/test_p2p_contract.py``
(admm is registered) and ``tests/test_p2p_csv.py``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from graphfl.common.config import ConfigError
from graphfl.deploy.p2p_launch import prepare_network
from graphfl.p2p.algorithms import NodeContext, registry
from graphfl.p2p.algorithms import admm_math as am
from graphfl.p2p.algorithms.admm import ADMM, ADMMParams, choose_lambda, selected_edges
from graphfl.p2p.config import load_network_file, parse_p2p_config
from graphfl.p2p.driver import run_network_inprocess, run_node
from graphfl.p2p.exchange import FailurePolicy, NeighbourExchange
from graphfl.p2p.oracles import ProblemSpec, make_oracle
from graphfl.p2p.topology import Topology, make_topology

N, T = 5, 25


def network(kind: str = "erdos-renyi", n: int = N) -> Topology:
    return make_topology(kind, n, seed=1)


def problems(name: str = "clusters", n: int = N, samples: int = 40):
    spec = ProblemSpec(name, num_nodes=n, dim=4, samples=samples, batch_size=6, seed=3)
    return [make_oracle(i, spec) for i in range(n)]


def run(algo: ADMM, topo: Topology, oracles, iterations: int = T):
    return run_network_inprocess(algo, oracles, topo.mixing_matrix(), iterations, adjacency=topo.adjacency())


def edges_of(topo: Topology) -> list[tuple[int, int]]:
    return [(i, j) for i, j, _ in topo.edges]


CASES = {
    "l1-minibatch": ({"lam": "0.05", "step": "decay", "step-c": 0.5, "step-t0": 5.0}, {}),
    "l2-full-batch": ({"lam": "0.2", "penalty": "l2", "rho": 2.0, "step": "constant", "step-c": 0.1, "full-batch": True},
                      {"phi": "l2", "rho": 2.0}),
    "availability-known": ({"lam": "0.05", "step": "decay", "step-c": 0.5, "step-t0": 5.0,
                            "availability": "0.6,0.9,0.5,1,0.8"}, {"ipw": "known"}),
    "availability-estimated": ({"lam": "0.05", "step": "decay", "step-c": 0.5, "step-t0": 5.0, "availability": "0.7",
                                "ipw": "estimated"}, {"ipw": "estimated"}),
    "logistic-projected": ({"lam": "0.02", "loss": "logistic", "step": "decay", "step-c": 2.0, "step-t0": 2.0,
                            "radius": 3.0}, {"radius": 3.0}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_inprocess_run_equals_the_reference_loop(case):
    """θ(T), θ̄ and the edge halves of every node == run_admm_reference (same seed and data) to 1e-8."""
    keys, ref_kw = CASES[case]
    algo = registry.create("admm", **keys)
    p: ADMMParams = algo.params
    topo = network()
    oracles = problems("clusters-logistic" if p.loss == "logistic" else "clusters")
    res = run(algo, topo, oracles)
    data = [(o.x_train, o.y_train) for o in oracles]
    common = {"lam": p.lam_value, "step": p.schedule(), "seed": 3, "batch_size": None if p.full_batch else 6,
              "availability": p.availability_for(N), **ref_kw, "rho": p.rho, "phi": p.phi}
    ref = am.run_admm_reference(p.loss_fn(), data, edges_of(topo), n_iter=T, **common)
    before = am.run_admm_reference(p.loss_fn(), data, edges_of(topo), n_iter=T - 1, **common)
    for i, s in enumerate(res.states):
        np.testing.assert_allclose(s.theta, ref.theta[i], rtol=0, atol=1e-8)
        np.testing.assert_allclose(ADMM.estimate(s), ref.theta_avg[i], rtol=0, atol=1e-8)
        assert sorted(s.edges) == topo.neighbours(i)
        for j, e in s.edges.items():  # halves one edge step behind: the reference's after T − 1 iterations
            np.testing.assert_allclose(e["beta"], before.halves[(i, j)].beta, rtol=0, atol=1e-8)
            np.testing.assert_allclose(e["alpha"], before.halves[(i, j)].alpha, rtol=0, atol=1e-8)
            if j < i:  # the owner's mirror of the other half
                np.testing.assert_allclose(e["beta_ji"], before.halves[(j, i)].beta, rtol=0, atol=1e-8)
    assert np.all(np.isfinite([r["test_loss"] for r in res.curve]))


def test_auto_step_uses_each_nodes_own_hessian():
    oracles = problems()
    topo = network()
    res = run(registry.create("admm", lam="0.05"), topo, oracles, 2)
    for o, s in zip(oracles, res.states):
        want = am.default_step_schedule([am.LeastSquaresLoss().hessian(np.zeros(4), o.x_train, o.y_train)])
        assert tuple(s.aux["step"]) == (want.c, want.t0)


@pytest.mark.parametrize("mode", ["given", "complete"])
def test_edge_selection_phase_equals_select_edges_and_then_runs_on_the_kept_graph(mode):
    """Two clusters (nodes 0–3 and 4–7): the protocol keeps exactly select_edges' edges (Bonferroni over
    the tested edges), both endpoints agree, and ADMM then equals the reference on the kept graph."""
    n = 8
    topo = network("complete" if mode == "complete" else "erdos-renyi", n)
    oracles = problems(n=n, samples=80)
    algo = registry.create("admm", lam="0.05", step="constant", **{"step-c": 0.2, "edge-selection": mode})
    res = run(algo, topo, oracles, 12)
    st = [am.local_statistics(am.LeastSquaresLoss(), o.x_train, o.y_train) for o in oracles]
    tested = am.complete_graph_edges(n) if mode == "complete" else edges_of(topo)
    sel = am.select_edges(st, tested, alpha=0.05)
    kept = sorted((j, i) for i, j in sel.kept)
    assert kept == selected_edges(algo.params, oracles, edges_of(topo))[0]
    assert 0 < len(kept) < len(tested)
    assert all((i < n / 2) == (j < n / 2) for i, j in kept)  # no edge across the clusters survives
    if mode == "complete":  # Local-ES recovers the two cliques
        assert kept == [(i, j) for c in (range(4), range(4, 8)) for i in c for j in c if i < j]
    for i, s in enumerate(res.states):
        assert sorted(s.edges) == sorted({j for e in kept for j in e if i in e} - {i})
        rows = s.aux["selection"]
        assert sorted(int(r[0]) for r in rows) == topo.neighbours(i)
        for j, keep, w2, df, pv in rows:
            e = (max(i, int(j)), min(i, int(j)))
            k = sel.edges.index(e)
            assert keep == float(e in sel.kept)
            np.testing.assert_allclose([w2, df, pv], [sel.statistics[k], sel.dfs[k], sel.pvalues[k]], rtol=1e-12)
    ref = am.run_admm_reference(am.LeastSquaresLoss(), [(o.x_train, o.y_train) for o in oracles], kept, lam=0.05,
                                n_iter=12, step=am.StepSchedule(0.2, rule="constant"), batch_size=6, seed=3)
    np.testing.assert_allclose(np.stack([s.theta for s in res.states]), ref.theta, rtol=0, atol=1e-8)
    assert algo.active_phases(res.states[0]) == (algo.phases[2], algo.phases[3])  # selection happened once


def test_local_es_needs_the_complete_graph():
    algo = registry.create("admm", **{"edge-selection": "complete"})
    with pytest.raises(ConfigError, match=r"missing pairs: \[\(0, 2\)"):
        algo.check_graph([(0, 1), (1, 2), (2, 3), (0, 3)], 4)
    assert algo.graph_for([(0, 1)], 3) == [(0, 1), (0, 2), (1, 2)]
    assert algo.needs_every_neighbour_at_start()
    assert not registry.create("admm", **{"edge-selection": "given"}).needs_every_neighbour_at_start()


def test_a_peer_restarted_without_resume_after_the_selection_is_refused():
    algo = registry.create("admm", **{"edge-selection": "given"})
    topo = network()
    o = problems()[1]
    ctx = NodeContext.from_matrix(topo.mixing_matrix(), 1, topo.adjacency())
    state = algo.init(o, ctx)
    state.t = 7  # a fresh state placed at a later round (a rejoin)
    with pytest.raises(ConfigError, match="--resume"):
        algo.outgoing(state, algo.phases[2], {}, ctx)


def _threaded(algo, topo, oracles, iterations, down=()):
    from graphfl.p2p.transport import InProcessHub

    n = topo.n
    w, adj = topo.mixing_matrix(), topo.adjacency()
    ctxs = [NodeContext.from_matrix(w, i, adj) for i in range(n)]
    states = [algo.init(o, c) for o, c in zip(oracles, ctxs)]
    hub = InProcessHub()
    trs = [hub.transport(i, topo.neighbours(i)) for i in range(n)]
    for tr, st, c in zip(trs, states, ctxs):
        for ch, specs in algo.channels(st, c).items():
            tr.mailbox.expect(ch, specs)
    hub.down.update(down)
    runs = {}

    def go(i):
        ex = NeighbourExchange(trs[i], ctxs[i].row, FailurePolicy(round_timeout=5, send_timeout=2))
        runs[i] = run_node(algo, oracles[i], ex, iterations, ctx=ctxs[i], state=states[i])

    ths = [threading.Thread(target=go, args=(i,)) for i in range(n) if i not in down]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    for tr in trs:
        tr.close()
    return runs, states


def test_a_dead_neighbour_the_owner_carries_the_edge_on_the_other_endpoint_freezes_its_half():
    """Ring 0-1-2-3-0 with peer 2 dead from the start: peer 3 owns {3, 2} and keeps running its edge
    step with the last θ_2 it has (θ_2(0) = 0); peer 1's half of {2, 1} (owned by 2) never changes."""
    topo = make_topology("ring", 4)
    oracles = problems(n=4)
    algo = registry.create("admm", lam="0.05", step="constant", **{"step-c": 0.1})
    runs, init = _threaded(algo, topo, oracles, 6, down={2})
    assert sorted(runs) == [0, 1, 3]
    assert all(2 in r["missing"] for r in runs[1].records[1:]) and all(2 in r["missing"] for r in runs[3].records[1:])
    e12 = runs[1].state.edges[2]
    np.testing.assert_array_equal(e12["beta"], init[1].edges[2]["beta"])
    np.testing.assert_array_equal(e12["alpha"], init[1].edges[2]["alpha"])
    e32 = runs[3].state.edges[2]
    np.testing.assert_array_equal(e32["theta_j"], np.zeros(4))
    assert np.any(e32["beta_ji"] != 0) and np.any(e32["alpha"] != 0)  # the owner's edge steps moved the edge
    assert np.all(np.isfinite(runs[3].state.theta)) and runs[3].state.t == 6


def test_lambda_by_cross_validation_before_the_run(tmp_path):
    """lam = "cv": graphfl p2p resolves it in its own process (admm_cv_lambda on the selected graph)
    and writes the chosen number into the network file; the peers never see "cv"."""
    overrides = {"algorithm": "admm", "problem": "clusters", "dim": 3, "samples": 30, "rounds": 8, "seed": 3,
                 "lam": "cv", "cv-folds": 2, "cv-grid": "0.001,0.1,10", "step": "constant", "step-c": 0.2,
                 "full-batch": True}
    path = prepare_network(tmp_path, "ring", 4, overrides, insecure=True)
    net = load_network_file(path)
    spec = ProblemSpec("clusters", num_nodes=4, dim=3, samples=30, seed=3)
    want = choose_lambda(parse_p2p_config(overrides).params, [make_oracle(i, spec) for i in range(4)],
                         [(0, 1), (1, 2), (2, 3), (0, 3)], 8)
    assert net.run.params.lam_value == want.best_lambda and want.best_lambda in (0.001, 0.1, 10.0)
    assert (tmp_path / "prepare.json").is_file() and '"chosen"' in (tmp_path / "prepare.json").read_text()
    with pytest.raises(ConfigError, match="cv"):
        registry.create("admm", lam="cv").init(make_oracle(0, spec), NodeContext(0, (1,), {0: 0.5, 1: 0.5}, {1: 1.0}, 2))


def test_settings_are_checked():
    assert parse_p2p_config({"algorithm": "admm", "lam": 0.3}).params.lam_value == 0.3
    assert parse_p2p_config({"algorithm": "admm", "lam": "cv"}).params.lam_value is None
    for bad, match in [({"lam": "-1"}, ">= 0"), ({"lam": "x"}, "number"), ({"rho": 0}, "rho"),
                       ({"availability": "0"}, r"\(0, 1\]"), ({"ipw": "sometimes"}, "ipw"),
                       ({"edge-selection": "all"}, "edge-selection"), ({"loss": "hinge"}, "loss"),
                       ({"es-alpha": 1.5}, "es-alpha"),
                       ({"es-covariance": "hc0"}, r"es-covariance = 'hc0' is not valid; choose one of \[.*'sandwich-hc3'")]:
        with pytest.raises(ConfigError, match=match):
            parse_p2p_config({"algorithm": "admm", **bad})
    with pytest.raises(ConfigError, match="3 values for 4 nodes"):
        ADMMParams(availability="0.5,0.5,0.5").availability_for(4)
    with pytest.raises(ConfigError, match="tabular"):
        registry.create("admm").init(make_oracle(0, ProblemSpec("vector", num_nodes=2)),
                                     NodeContext(0, (1,), {0: 0.5, 1: 0.5}, {1: 1.0}, 2))


def test_local_es_runs_on_the_complete_graph_and_names_the_pairs_that_cannot_connect(tmp_path):
    """graphfl p2p writes the complete graph for Local-ES (whatever --topology says); a peer that cannot
    reach every other one stops before training (exit 5) naming the pairs, even under on-missing = skip."""
    import json

    from graphfl.p2p.peer import EXIT_UNREACHABLE, run_peer

    path = prepare_network(tmp_path, "ring", 4, {"algorithm": "admm", "problem": "clusters", "dim": 2, "samples": 20,
                                                 "rounds": 2, "edge-selection": "complete", "connect-timeout": 1},
                           insecure=True)
    net = load_network_file(path)
    assert [(i, j) for i, j, _ in net.topology.edges] == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    assert net.run.on_missing == "skip"
    assert run_peer(path, 1, tmp_path) == EXIT_UNREACHABLE  # nobody else was started
    res = json.loads((tmp_path / "peer-1.json").read_text())
    assert "(0, 1)" in res["error"] and "(1, 2)" in res["error"] and "(1, 3)" in res["error"]
    assert "every pair of peers" in res["error"]
