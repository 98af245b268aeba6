"""Dirichlet label partition and local train/test split (ALGORITHMS.md §1.3)."""

from __future__ import annotations

import numpy as np


def dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 10,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Split sample indices among clients with class proportions ``q_c ~ Dir(alpha · 1_n)``.

    For each class c: draw ``q_c``, shuffle the class-c indices and cut them among the
    clients in proportions ``q_c``. The whole partition is redrawn until every client has at
    least ``min_size`` samples (ALGORITHMS.md §1.3).

    Returns
    -------
    list of sorted index arrays, one per client; together they cover every index once.

    Raises
    ------
    ValueError
        If ``len(labels) < num_clients * min_size`` or no valid draw within ``max_tries``.
    """
    labels = np.asarray(labels)
    n = len(labels)
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if alpha <= 0:
        raise ValueError(f"dirichlet alpha must be > 0, got {alpha}")
    if n < num_clients * min_size:
        raise ValueError(
            f"cannot give {num_clients} clients at least {min_size} samples each from {n} samples"
        )
    classes = np.unique(labels)
    by_class = [np.flatnonzero(labels == c) for c in classes]
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx in by_class:
            idx = rng.permutation(idx)
            q = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(q)[:-1] * len(idx)).astype(int)
            for client, chunk in enumerate(np.split(idx, cuts)):
                parts[client].append(chunk)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in out) >= min_size:
            return out
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) partition of {n} samples into {num_clients} clients "
        f"with >= {min_size} samples each after {max_tries} draws; raise alpha or lower min_size"
    )


def train_test_split(
    indices: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle a client's indices and split off ``test_fraction`` (at least one of each if possible)."""
    idx = rng.permutation(indices)
    n_test = int(round(len(idx) * test_fraction))
    if test_fraction > 0 and len(idx) >= 2:
        n_test = min(max(n_test, 1), len(idx) - 1)
    return np.sort(idx[n_test:]), np.sort(idx[:n_test])


def client_rng(seed: int, *keys: int) -> np.random.Generator:
    """A generator determined by (seed, keys...), independent across keys."""
    return np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, *map(int, keys)]))
