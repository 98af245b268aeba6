"""FedRelax as a p2p algorithm (ALGORITHMS §7): equal to the reference loop for any estimator,
λ = 0 gives the local fits, a silent neighbour counts with its last predictions, estimators are
named safely, and the model-args table parses from TOML and --set.

Real peer processes are covered by ``tests/test_p2p_contract.py`` (fedrelax is registered).
"""

from __future__ import annotations

import numpy as np
import pytest

from graphfl.common.config import ConfigError, load_toml, parse_assignment
from graphfl.p2p.algorithms import NodeContext, registry
from graphfl.p2p.algorithms.fedrelax import FedRelax, FedRelaxParams, make_estimator
from graphfl.p2p.algorithms.fedrelax_math import run_fedrelax_reference
from graphfl.p2p.config import parse_p2p_config
from graphfl.p2p.driver import run_network_inprocess
from graphfl.p2p.oracles import ProblemSpec, make_oracle
from graphfl.p2p.topology import make_topology

N, T = 4, 5
MODELS = {
    "tree": ("sklearn.tree.DecisionTreeRegressor", '{"max_depth": 3}'),
    "knn-resampled": ("sklearn.neighbors.KNeighborsRegressor", '{"n_neighbors": 3}'),  # no sample_weight
    "linear": ("linear", "{}"),
}


def setup(n=N):
    topo = make_topology("knn", n, seed=1)  # weighted edges A_ii'
    spec = ProblemSpec("clusters", num_nodes=n, dim=2, samples=30, seed=3, shared_samples=20)
    return topo, [make_oracle(i, spec) for i in range(n)]


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_inprocess_run_equals_the_reference_loop(kind):
    model, args = MODELS[kind]
    topo, oracles = setup()
    algo = registry.create("fedrelax", lam=0.5, model=model, model_args=args)
    res = run_network_inprocess(algo, oracles, topo.mixing_matrix(), T, adjacency=topo.adjacency())
    ests = None if model == "linear" else [make_estimator(algo.params, 3, i) for i in range(N)]
    ref = run_fedrelax_reference(ests, [(o.x_train, o.y_train) for o in oracles], oracles[0].shared(), topo.adjacency(),
                                 lam=0.5, max_iter=T, tol=None, solver="linear" if model == "linear" else "generic",
                                 seed=3)
    np.testing.assert_allclose(np.stack([s.theta for s in res.states]), ref.predictions, rtol=0, atol=1e-12)
    for o, s, m in zip(oracles, res.states, ref.models):  # the node's model is the reference's model
        np.testing.assert_allclose(algo.model(s, o).predict(o.x_test), m.predict(o.x_test), rtol=0, atol=1e-12)
    assert "avg_model_test_loss" not in res.curve[-1]  # θ are predictions, not parameters


def test_lambda_zero_gives_the_local_fits():
    topo, oracles = setup()
    algo = registry.create("fedrelax", lam=0.0)
    res = run_network_inprocess(algo, oracles, topo.mixing_matrix(), 3, adjacency=topo.adjacency())
    for i, (o, s) in enumerate(zip(oracles, res.states)):
        local = make_estimator(algo.params, 3, i).fit(o.x_train, o.y_train)
        np.testing.assert_array_equal(s.theta, local.predict(o.shared()))
        np.testing.assert_array_equal(algo.model(s, o).predict(o.x_test), local.predict(o.x_test))
        assert algo.evaluate(s, o) == pytest.approx(float(np.mean((o.y_test - local.predict(o.x_test)) ** 2)))


def test_a_restored_node_refits_the_same_model_and_a_silent_neighbour_counts_with_its_last_predictions():
    topo, oracles = setup()
    algo = registry.create("fedrelax", lam=0.5)
    w, adj = topo.mixing_matrix(), topo.adjacency()
    res = run_network_inprocess(algo, oracles, w, 3, adjacency=adj)
    o, s = oracles[1], res.states[1]
    fresh = FedRelax(algo.params)  # nothing in memory: refit from the state
    np.testing.assert_array_equal(fresh.model(s, o).predict(o.shared()), s.theta)
    ctx = NodeContext.from_matrix(w, 1, adj)
    silent = ctx.neighbours[0]
    heard = {f"pred/{j}": {"yhat": res.states[j].theta} for j in ctx.neighbours if j != silent}
    nxt = algo.step(s, heard, o, ctx)
    np.testing.assert_array_equal(nxt.edges[silent]["yhat"], s.edges[silent]["yhat"])  # the last one heard
    everyone = {**heard, f"pred/{silent}": {"yhat": s.edges[silent]["yhat"]}}
    np.testing.assert_array_equal(algo.step(s, everyone, o, ctx).theta, nxt.theta)


def test_estimators_are_named_safely():
    for bad, match in [("os.system", "only estimators of the packages"), ("builtins.eval", "only estimators"),
                       ("sklearn.tree.export_text", "not a scikit-learn estimator class"),
                       ("sklearn.base.clone", "not a scikit-learn estimator class"),
                       ("sklearn.tree.NoSuchTree", "not a scikit-learn estimator"),
                       ("DecisionTreeRegressor", "package.module.Class"), ("sklearn.tree.__import__('os')", "Class")]:
        with pytest.raises(ConfigError, match=match):
            FedRelaxParams(model=bad, model_args="{}")
    with pytest.raises(ConfigError, match="only strings, numbers"):
        FedRelaxParams(model_args='{"max_depth": {"a": 1}}')
    with pytest.raises(ConfigError, match="do not fit"):
        FedRelaxParams(model_args='{"depth": 3}')
    est = make_estimator(FedRelaxParams(), seed=5, node=2)
    assert est.get_params()["max_depth"] == 4 and est.get_params()["random_state"] == make_estimator(
        FedRelaxParams(), seed=5, node=2).get_params()["random_state"] != make_estimator(
        FedRelaxParams(), seed=5, node=3).get_params()["random_state"]


def test_model_args_as_a_toml_table_and_on_the_command_line(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[run]\nalgorithm = "fedrelax"\nfedrelax.model = "sklearn.tree.DecisionTreeRegressor"\n'
                 'fedrelax.model-args = {max_depth = 3, min_samples_leaf = 2}\nfedrelax.lam = 0.2\n')
    cfg = parse_p2p_config(load_toml(f)["run"])
    assert cfg.params == FedRelaxParams(lam=0.2, model_args='{"max_depth": 3, "min_samples_leaf": 2}')
    key, value = parse_assignment("fedrelax.model-args={max_depth=2}")
    again = parse_p2p_config({key: value}, base=cfg)
    assert again.params.model_args == '{"max_depth": 2}' and again.params.lam == 0.2
    assert parse_p2p_config(again.to_flat()) == again  # the network file round trip
    with pytest.raises(ConfigError, match="both"):
        parse_p2p_config({"algorithm": "fedrelax", "lam": 0.1, "fedrelax.lam": 0.2})
