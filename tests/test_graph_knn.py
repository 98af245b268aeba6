"""``knn_graph`` selects exactly the neighbours of a stable sort of the difference-formula distances.

The candidates come from the matrix-product formula of the squared distance, whose rounding differs
from the difference formula's; the margin must make every true neighbour a candidate, and ties
(repeated points) must go to the lower index, so the graph is the one a full stable sort gives.
"""

from __future__ import annotations

import numpy as np
import pytest

from graphfl.common.graph import GraphError, knn_graph, symmetrise, validate_adjacency


def reference_knn(points: np.ndarray, k: int) -> np.ndarray:
    """Every pairwise distance by the difference formula, then the first k of a stable sort."""
    n = len(points)
    k = min(k, n - 1)
    pts = np.asarray(points)
    d2 = ((pts[:, None, :] - pts[None, :, :]) ** 2).sum(-1)
    np.fill_diagonal(d2, np.inf)
    nearest = np.argsort(d2, axis=1, kind="stable")[:, :k]
    adj = np.zeros((n, n))
    adj[np.repeat(np.arange(n), k), nearest.ravel()] = 1.0
    return symmetrise(adj)


def _points(kind: str, rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    if kind == "ties":          # few distinct values: many equal distances
        return rng.integers(0, 3, size=(n, d)).astype(float)
    if kind == "scaled":
        return rng.normal(size=(n, d)) * 10.0 ** int(rng.integers(-3, 4))
    if kind == "float32":
        return rng.normal(size=(n, d)).astype(np.float32)
    return rng.normal(size=(n, d)) + 1e7       # far from the origin: the product formula cancels badly


@pytest.mark.parametrize("kind", ["ties", "scaled", "float32", "offset"])
def test_knn_graph_equals_a_stable_sort_of_all_distances(kind):
    rng = np.random.default_rng(7)
    for _ in range(25):
        n, d, k = int(rng.integers(2, 90)), int(rng.integers(1, 9)), int(rng.integers(1, 14))
        pts = _points(kind, rng, n, d)
        np.testing.assert_array_equal(knn_graph(pts, k), reference_knn(pts, k), err_msg=f"{kind} n={n} d={d} k={k}")


def test_knn_graph_is_symmetric_without_self_loops_and_has_every_nearest_neighbour():
    rng = np.random.default_rng(3)
    pts = rng.normal(size=(300, 16))
    adj = knn_graph(pts, 4)
    assert np.array_equal(adj, adj.T) and not np.any(np.diag(adj))
    assert np.all(adj.sum(1) >= 4)
    validate_adjacency(adj, 300)


def test_validate_adjacency_still_refuses_an_asymmetric_graph():
    adj = np.zeros((3, 3))
    adj[0, 1] = 1.0
    with pytest.raises(GraphError, match="not symmetric"):
        validate_adjacency(adj, 3)
    adj[1, 0] = 1.0 + 1e-12       # equal within allclose's tolerance: accepted as before
    validate_adjacency(adj, 3)


def test_float32_near_ties_rank_as_the_float32_distances_do():
    """float32 points whose two nearest candidates differ by less than float32's rounding: the
    candidate margin must cover the input dtype's error, not only float64's.
    """
    rng = np.random.default_rng(11)
    for _ in range(100):
        a = rng.normal(size=64)
        b = a[rng.permutation(64)].copy()
        b[0] += 1e-6
        pts = np.stack([np.zeros(64), a, b, 1.01 * a, 1.01 * b]).astype(np.float32)
        np.testing.assert_array_equal(knn_graph(pts, 1), reference_knn(pts, 1))
