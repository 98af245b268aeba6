import numpy as np
import pytest

from graphfl.tasks.partition import client_rng, dirichlet_partition, train_test_split


def test_partition_covers_every_index_once_and_respects_min_size():
    labels = np.repeat(np.arange(10), 100)
    parts = dirichlet_partition(labels, 8, 0.5, np.random.default_rng(0), min_size=20)
    allidx = np.concatenate(parts)
    assert len(parts) == 8
    assert sorted(allidx.tolist()) == list(range(1000))
    assert min(len(p) for p in parts) >= 20


def test_partition_is_deterministic_in_the_seed():
    labels = np.repeat(np.arange(5), 50)
    a = dirichlet_partition(labels, 4, 0.3, np.random.default_rng(7))
    b = dirichlet_partition(labels, 4, 0.3, np.random.default_rng(7))
    c = dirichlet_partition(labels, 4, 0.3, np.random.default_rng(8))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_small_alpha_is_more_skewed_than_large_alpha():
    labels = np.repeat(np.arange(10), 200)

    def skew(alpha):
        parts = dirichlet_partition(labels, 10, alpha, np.random.default_rng(1), min_size=5)
        hist = np.stack([np.bincount(labels[p], minlength=10) / len(p) for p in parts])
        return float(hist.max(1).mean())  # mean share of each client's dominant class

    assert skew(0.1) > skew(100.0) + 0.3
    assert skew(100.0) < 0.2


def test_partition_rejects_impossible_requests():
    with pytest.raises(ValueError, match="at least 10"):
        dirichlet_partition(np.zeros(50), 10, 1.0, np.random.default_rng(0), min_size=10)
    with pytest.raises(ValueError, match="alpha"):
        dirichlet_partition(np.zeros(50), 2, 0.0, np.random.default_rng(0))


def test_train_test_split_is_disjoint_and_sized():
    tr, te = train_test_split(np.arange(100), 0.2, client_rng(0, 1))
    assert len(te) == 20 and len(tr) == 80
    assert not set(tr) & set(te)
    tr2, te2 = train_test_split(np.arange(3), 0.2, client_rng(0, 1))
    assert len(te2) == 1 and len(tr2) == 2
