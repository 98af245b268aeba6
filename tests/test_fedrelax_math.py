"""FedRelax pure math (p2p/algorithms/fedrelax_math.py, ALGORITHMS.md §7): the weighted ERM of eq. 10, the
closed form of eq. 12, weighted resampling for estimators without sample_weight, and the loop."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.linear_model import LinearRegression, Ridge
from sklearn.neighbors import KNeighborsRegressor
from sklearn.tree import DecisionTreeClassifier, DecisionTreeRegressor

from graphfl.p2p.algorithms import fedrelax_math as fr

XS = np.linspace(0.0, 0.9, 10)[:, None]  # the reference code's D' (§7.3)


def two_clusters(rng, per=4, m=20, noise=0.1):
    """§7.7 stand-in: cluster 1 y = sin(2πx), cluster 2 y = 1 − 2x; complete graphs inside clusters."""
    data = []
    for i in range(2 * per):
        x = rng.uniform(size=(m, 1))
        f = np.sin(2 * np.pi * x[:, 0]) if i < per else 1 - 2 * x[:, 0]
        data.append((x, f + noise * rng.normal(size=m)))
    a = np.zeros((2 * per, 2 * per))
    for i in range(2 * per):
        for j in range(2 * per):
            if i != j and (i < per) == (j < per):
                a[i, j] = 1.0
    return data, a


class MeanRegressor:
    """Predicts the mean label; its fit has no sample_weight (forces the resampling path)."""

    def __init__(self):
        self.mean_ = 0.0

    def get_params(self, deep=True):
        return {}

    def set_params(self, **params):
        return self

    def fit(self, X, y):
        self.mean_ = float(np.mean(y))
        return self

    def predict(self, X):
        return np.full(len(X), self.mean_)


def test_augmented_dataset_hand_computed_weights():
    x = np.arange(4.0)[:, None]
    y = np.array([1.0, 2.0, 3.0, 4.0])
    xs = np.array([[10.0], [20.0]])
    xa, ya, wa = fr.augmented_dataset(x, y, xs, [np.array([7.0, 8.0]), np.array([9.0, 9.5])], [1.0, 3.0], 0.5)
    # w = λ A m_i / m' = 0.5 · 1 · 4/2 = 1 and 0.5 · 3 · 4/2 = 3
    np.testing.assert_array_equal(wa, [1, 1, 1, 1, 1, 1, 3, 3])
    np.testing.assert_array_equal(ya, [1, 2, 3, 4, 7, 8, 9, 9.5])
    np.testing.assert_array_equal(xa[:, 0], [0, 1, 2, 3, 10, 20, 10, 20])
    # λ = 0 (or A = 0): exactly the local data
    xa, ya, wa = fr.augmented_dataset(x, y, xs, [np.array([7.0, 8.0])], [1.0], 0.0)
    assert xa.shape == (4, 1) and np.all(wa == 1)
    with pytest.raises(ValueError, match=r"neighbour_predictions\[0\] must have shape \(2,\)"):
        fr.augmented_dataset(x, y, xs, [np.zeros(3)], [1.0], 0.5)
    with pytest.raises(ValueError, match="one edge weight per neighbour"):
        fr.augmented_dataset(x, y, xs, [np.zeros(2)], [], 0.5)


def test_lambda_zero_equals_local_fits():
    rng = np.random.default_rng(0)
    data, a = two_clusters(rng)
    tree = DecisionTreeRegressor(max_depth=4, random_state=0)
    res = fr.run_fedrelax_reference(tree, data, XS, a, lam=0.0, max_iter=3, tol=None)
    for i, (x, y) in enumerate(data):
        local = DecisionTreeRegressor(max_depth=4, random_state=0).fit(x, y)
        np.testing.assert_array_equal(res.predictions[i], local.predict(XS))
    # and with λ > 0 the fits change
    res = fr.run_fedrelax_reference(tree, data, XS, a, lam=1.0, max_iter=3, tol=None)
    local0 = DecisionTreeRegressor(max_depth=4, random_state=0).fit(*data[0]).predict(XS)
    assert np.abs(res.predictions[0] - local0).max() > 1e-3


@pytest.mark.parametrize("ridge", [0.0, 0.3])
def test_closed_form_equals_generic_weighted_fit_for_a_linear_model(ridge):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(12, 3))
    y = x @ [1.0, -2.0, 0.5] + 0.3 + 0.1 * rng.normal(size=12)
    xs = rng.normal(size=(7, 3))
    preds = [rng.normal(size=7), rng.normal(size=7)]
    est = LinearRegression() if ridge == 0 else Ridge(alpha=ridge)
    generic = fr.node_update(est, x, y, xs, preds, [0.7, 2.0], 0.4)
    closed = fr.linear_closed_form(x, y, xs, preds, [0.7, 2.0], 0.4, ridge=ridge)
    np.testing.assert_allclose(closed.coef, generic.coef_, atol=1e-10)
    assert closed.intercept == pytest.approx(generic.intercept_, abs=1e-10)
    # the closed form minimises m_i·[L_i + (λ/m') Σ A Σ_r (h − ĥ)²] + ridge‖w‖²: zero gradient there
    w, b = closed.coef, closed.intercept
    xa, ya, wa = fr.augmented_dataset(x, y, xs, preds, [0.7, 2.0], 0.4)
    r = ya - xa @ w - b
    np.testing.assert_allclose(-2 * xa.T @ (wa * r) + 2 * ridge * w, 0.0, atol=1e-9)
    assert abs(-2 * np.sum(wa * r)) < 1e-9


def test_both_solvers_give_the_same_iterates():
    rng = np.random.default_rng(2)
    data, a = two_clusters(rng, per=3)
    a[2, 3] = a[3, 2] = 0.5  # one weak cross-cluster edge
    gen = fr.run_fedrelax_reference(LinearRegression(), data, XS, a, lam=0.5, max_iter=8, tol=None)
    lin = fr.run_fedrelax_reference(None, data, XS, a, lam=0.5, max_iter=8, tol=None, solver="linear")
    assert len(gen.history) == len(lin.history) == 9
    for h_gen, h_lin in zip(gen.history, lin.history):
        np.testing.assert_allclose(h_gen, h_lin, atol=1e-10)


def test_jacobi_sweep_hand_computed():
    """h(x) = w·x, one point per node: node 0 (1, 1), node 1 (1, 3); D' = {1}; λ = A = 1.

    Local init w = (1, 3). Sweep 1 (Jacobi, both read iteration 0): node 0 minimises
    (w − 1)² + 1·(w − 3)² -> 2, node 1 minimises (w − 3)² + (w − 1)² -> 2. (Gauss–Seidel would give
    node 1 (3 + 2)/2 = 2.5.)
    """
    data = [(np.array([[1.0]]), np.array([1.0])), (np.array([[1.0]]), np.array([3.0]))]
    a = np.array([[0.0, 1.0], [1.0, 0.0]])
    res = fr.run_fedrelax_reference(None, data, np.array([[1.0]]), a, lam=1.0, max_iter=1, tol=None,
                                    solver="linear", fit_intercept=False)
    np.testing.assert_allclose(res.history[0][:, 0], [1.0, 3.0])
    np.testing.assert_allclose(res.predictions[:, 0], [2.0, 2.0])
    # seed-eq.-12 scaling: λ_seed = 2 λ_here; with λ = 2 each pseudo-label weighs 2: (1 + 2·3)/3
    res = fr.run_fedrelax_reference(None, data, np.array([[1.0]]), a, lam=2.0, max_iter=1, tol=None,
                                    solver="linear", fit_intercept=False)
    assert res.predictions[0, 0] == pytest.approx(7.0 / 3.0)


def test_weighted_resampling_for_an_estimator_without_sample_weight():
    rng = np.random.default_rng(3)
    y = np.array([0.0, 1.0, 10.0])
    x = np.zeros((3, 1))
    w = np.array([1.0, 1.0, 2.0])
    # weighted minimiser of Σ w (y − c)² is the weighted mean 21/4 = 5.25; the resampled mean is an
    # unbiased estimate with sd = sqrt(Var_w(y) / size)
    size = 4000
    model = fr.fit_weighted(MeanRegressor(), x, y, w, rng=rng, resample_size=size)
    target = float(w @ y / w.sum())
    sd = math.sqrt(float(w @ (y - target) ** 2 / w.sum()) / size)
    assert abs(model.mean_ - target) < 4.5 * sd
    assert abs(model.mean_ - y.mean()) > 4.5 * sd  # an unweighted fit would be detected
    # seeded: same generator state, same fit
    m1 = fr.fit_weighted(MeanRegressor(), x, y, w, rng=np.random.default_rng(9))
    m2 = fr.fit_weighted(MeanRegressor(), x, y, w, rng=np.random.default_rng(9))
    assert m1.mean_ == m2.mean_
    # zero-weight rows are never drawn
    m0 = fr.fit_weighted(MeanRegressor(), x, y, np.array([0.0, 1.0, 0.0]), rng=rng)
    assert m0.mean_ == 1.0
    with pytest.raises(ValueError, match="needs a seeded rng"):
        fr.fit_weighted(MeanRegressor(), x, y, w)
    # all weights 1: plain fit, no rng needed
    assert fr.fit_weighted(MeanRegressor(), x, y, np.ones(3)).mean_ == pytest.approx(11.0 / 3.0)


def test_knn_without_sample_weight_runs_and_is_reproducible():
    rng = np.random.default_rng(4)
    data, a = two_clusters(rng, per=3)
    knn = KNeighborsRegressor(n_neighbors=3)
    r1 = fr.run_fedrelax_reference(knn, data, XS, a, lam=0.5, max_iter=3, tol=None, seed=7)
    r2 = fr.run_fedrelax_reference(knn, data, XS, a, lam=0.5, max_iter=3, tol=None, seed=7)
    np.testing.assert_array_equal(r1.predictions, r2.predictions)
    r0 = fr.run_fedrelax_reference(knn, data, XS, a, lam=0.0, max_iter=1, tol=None, seed=7)
    for i, (x, y) in enumerate(data):  # λ = 0: all weights 1, a plain (non-resampled) local fit
        np.testing.assert_array_equal(r0.predictions[i], KNeighborsRegressor(n_neighbors=3).fit(x, y).predict(XS))


def test_large_lambda_makes_connected_nodes_agree_and_isolated_nodes_stay_local():
    rng = np.random.default_rng(5)
    data, a6 = two_clusters(rng, per=3)
    data.append((rng.uniform(size=(20, 1)), rng.normal(size=20)))  # node 6, isolated
    a = np.zeros((7, 7))
    a[:6, :6] = a6
    small = fr.run_fedrelax_reference(None, data, XS, a, lam=0.0, max_iter=1, tol=None, solver="linear")
    big = fr.run_fedrelax_reference(None, data, XS, a, lam=20.0, max_iter=100, solver="linear")
    assert big.converged and big.iterations < 100
    assert fr.squared_gtv(big.predictions, a) < 1e-3 * fr.squared_gtv(small.predictions, a)
    np.testing.assert_allclose(big.predictions[6], small.predictions[6], atol=1e-12)
    # the two clusters are not linked: they do not agree with each other
    assert np.abs(big.predictions[0] - big.predictions[3]).max() > 0.1


def test_squared_gtv_hand_computed():
    preds = np.array([[0.0, 0.0], [1.0, 3.0], [0.0, 0.0]])
    a = np.array([[0.0, 2.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # only edge {0,1}: A (2/m') Σ (diff)² = 2 · (2/2) · (1 + 9) = 20
    assert fr.squared_gtv(preds, a) == 20.0
    with pytest.raises(ValueError, match="symmetric"):
        fr.squared_gtv(preds, np.triu(np.ones((3, 3)), 1))


def test_classifier_pseudo_labels():
    rng = np.random.default_rng(6)
    data = []
    for i in range(4):
        x = rng.uniform(size=(20, 1))
        data.append((x, (x[:, 0] > (0.3 if i < 2 else 0.7)).astype(int)))
    a = np.ones((4, 4)) - np.eye(4)
    clf = DecisionTreeClassifier(max_depth=2, random_state=0)
    r0 = fr.run_fedrelax_reference(clf, data, XS, a, lam=0.0, max_iter=1, tol=None)
    for i, (x, y) in enumerate(data):
        local = DecisionTreeClassifier(max_depth=2, random_state=0).fit(x, y)
        np.testing.assert_array_equal(r0.predictions[i], local.predict(XS))
    r = fr.run_fedrelax_reference(clf, data, XS, a, lam=5.0, max_iter=3, tol=None)
    assert r.predictions.shape == (4, 10) and set(np.unique(r.predictions)) <= {0, 1}
    assert np.any(r.predictions != r0.predictions)
    # one update with a heavy neighbour block: the node reproduces the neighbour's labels on D'
    labels = (XS[:, 0] > 0.45).astype(int)
    model = fr.node_update(clf, *data[0], XS, [labels], [1.0], 100.0)
    np.testing.assert_array_equal(model.predict(XS), labels)


def test_zero_init_and_validation():
    rng = np.random.default_rng(7)
    data, a = two_clusters(rng, per=2)
    res = fr.run_fedrelax_reference(None, data, XS, a, lam=0.1, max_iter=2, tol=None, init="zero", solver="linear")
    assert not np.any(res.history[0]) and len(res.history) == 3
    with pytest.raises(ValueError, match=r"adjacency must have shape \(4, 4\)"):
        fr.run_fedrelax_reference(None, data, XS, np.zeros((3, 3)), solver="linear")
    with pytest.raises(ValueError, match="lam must be finite and >= 0"):
        fr.run_fedrelax_reference(None, data, XS, a, lam=-1.0, solver="linear")
