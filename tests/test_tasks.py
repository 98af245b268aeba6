import numpy as np
import pytest
import torch

from graphfl.common.config import ConfigError, DataConfig
from graphfl.common.graph import gcn_propagation, knn_graph, load_adjacency, validate_adjacency
from graphfl.tasks import registry


def test_registry_lists_tasks_and_rejects_unknown():
    assert {"digits", "mnist", "cifar10", "synthetic-dfl", "synthetic-multicenter"} <= set(registry.names())
    with pytest.raises(ConfigError, match="valid tasks"):
        registry.get("imagenet")


def test_synthetic_dfl_shapes_intervals_and_determinism():
    task = registry.create("synthetic-dfl", seed=3)
    d1 = task.client_data(1, 5)
    assert d1.x_train.shape == (1000, 10) and d1.y_train.shape == (1000, 1)
    assert d1.x_test.shape == (200, 10)
    assert d1.x_train.min() >= 40 and d1.x_train.max() <= 100          # node 1 interval [40, 100]
    d2 = task.client_data(2, 5)
    assert d2.x_train.min() >= -55 and d2.x_train.max() <= -50
    again = registry.create("synthetic-dfl", seed=3).client_data(1, 5)
    assert np.array_equal(d1.x_train, again.x_train) and np.array_equal(d1.y_train, again.y_train)
    sig = 1 / (1 + np.exp(-1.0 * 0))  # sigmoid node: targets in (0, 1) up to noise
    assert sig == 0.5 and np.all(d1.y_train > -0.1) and np.all(d1.y_train < 1.1)
    model = task.build_model()
    assert model(torch.as_tensor(d1.x_train[:4])).shape == (4, 1)


def test_multicenter_has_planted_clusters_and_a_knn_graph():
    task = registry.create("synthetic-multicenter", seed=0)
    labels = task.cluster_labels(50)
    assert labels.shape == (50,) and set(labels) <= {0, 1, 2} and len(set(labels)) == 3
    w = task.ground_truth(50).reshape(50, -1)
    # Spec (§5.9): centers ~U[-0.5, 0.5]^64, std 0.5 -> overlapping pairwise distances, but each
    # client's weights are closest to its own cluster's mean.
    means = np.stack([w[labels == k].mean(0) for k in range(3)])
    nearest = ((w[:, None] - means[None]) ** 2).sum(-1).argmin(1)
    assert np.mean(nearest == labels) >= 0.95
    adj = task.client_graph(50)
    validate_adjacency(adj, 50)
    assert adj.sum(1).min() >= 4                                        # 4-NN, union-symmetrised
    data = task.client_data(7, 50)
    assert data.x_train.shape == (100, 8) and data.y_train.shape == (100, 8)
    np.testing.assert_allclose(data.y_train, data.x_train @ task.ground_truth(50)[7], rtol=1e-4, atol=1e-4)
    model = task.build_model()
    assert sum(p.numel() for p in model.parameters()) == 512            # 8x16 + 16x16 + 16x8, no bias


def test_digits_partition_is_deterministic_and_disjoint():
    task = registry.create("digits", data=DataConfig(dirichlet_alpha=0.5), seed=1)
    parts = [task.client_data(i, 4) for i in range(4)]
    total = sum(p.num_train + p.num_test for p in parts)
    assert total == 1797
    again = registry.create("digits", data=DataConfig(dirichlet_alpha=0.5), seed=1).client_data(2, 4)
    assert np.array_equal(parts[2].y_train, again.y_train)
    hist = task.label_histogram(4)
    assert hist.shape == (4, 10) and hist.sum() == 1797


def test_graph_utilities(tmp_path):
    pts = np.array([[0.0], [1.0], [2.0], [10.0]])
    adj = knn_graph(pts, 1)
    assert adj[0, 1] == 1 and adj[3, 2] == 1 and adj[0, 3] == 0 and np.allclose(adj, adj.T)
    a_hat = gcn_propagation(np.array([[0, 1], [1, 0]]))
    np.testing.assert_allclose(a_hat, np.full((2, 2), 0.5))
    f = tmp_path / "g.txt"
    f.write_text("# ring\n0 1\n1 2 2.5\n")
    g = load_adjacency(f, 3)
    assert g[1, 2] == 2.5 and g[2, 1] == 2.5 and g[0, 2] == 0
    f.write_text("0 5\n")
    with pytest.raises(ValueError, match="g.txt:1: node id 5"):
        load_adjacency(f, 3)
    with pytest.raises(ValueError, match="shape"):
        validate_adjacency(np.zeros((2, 2)), 3)
