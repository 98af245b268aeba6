"""Client graphs: k-NN construction, edge-list files, validation, GCN normalisation."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def knn_graph(points: np.ndarray, k: int) -> np.ndarray:
    """Symmetric 0/1 adjacency: i ~ j if j is among i's k nearest neighbours or vice versa
    (Euclidean; union symmetrisation as in ALGORITHMS.md §5.9). Zero diagonal."""
    n = len(points)
    if n < 2:
        return np.zeros((n, n))
    k = min(k, n - 1)
    d2 = ((points[:, None, :] - points[None, :, :]) ** 2).sum(-1)
    np.fill_diagonal(d2, np.inf)
    nearest = np.argsort(d2, axis=1, kind="stable")[:, :k]
    adj = np.zeros((n, n))
    rows = np.repeat(np.arange(n), k)
    adj[rows, nearest.ravel()] = 1.0
    return np.maximum(adj, adj.T)


def validate_adjacency(adj: np.ndarray, num_clients: int, source: str = "client graph") -> np.ndarray:
    """Check shape, symmetry, nonnegativity and zero diagonal; return a float copy."""
    a = np.asarray(adj, dtype=np.float64)
    if a.shape != (num_clients, num_clients):
        raise ValueError(
            f"{source} has shape {a.shape} but the federation has {num_clients} clients"
        )
    if not np.all(np.isfinite(a)) or np.any(a < 0):
        raise ValueError(f"{source} has negative or non-finite weights")
    if not np.allclose(a, a.T):
        raise ValueError(f"{source} is not symmetric (the graph must be undirected)")
    if np.any(np.diag(a) != 0):
        raise ValueError(f"{source} has self-loops; the diagonal must be zero")
    return a


def load_edge_list(path: str | Path, num_clients: int) -> np.ndarray:
    """Read ``i j [weight]`` lines (partition ids; ``#`` comments) into a symmetric adjacency.

    Raises ``ValueError`` naming the file and line for ids outside ``0..num_clients-1``.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"graph file not found: {p}")
    adj = np.zeros((num_clients, num_clients))
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        text = line.split("#", 1)[0].replace(",", " ").strip()
        if not text:
            continue
        parts = text.split()
        if len(parts) not in (2, 3):
            raise ValueError(f"{p}:{lineno}: expected 'i j [weight]', got {line!r}")
        try:
            i, j = int(parts[0]), int(parts[1])
            w = float(parts[2]) if len(parts) == 3 else 1.0
        except ValueError:
            raise ValueError(f"{p}:{lineno}: expected 'i j [weight]', got {line!r}") from None
        for node in (i, j):
            if not 0 <= node < num_clients:
                raise ValueError(
                    f"{p}:{lineno}: client id {node} is outside 0..{num_clients - 1}"
                )
        if i == j:
            raise ValueError(f"{p}:{lineno}: self-loop {i}-{j} is not allowed")
        if w <= 0 or not np.isfinite(w):
            raise ValueError(f"{p}:{lineno}: weight must be positive and finite, got {w}")
        adj[i, j] = adj[j, i] = w
    return adj


def gcn_propagation(adj: np.ndarray) -> np.ndarray:
    """``Â = D̃^{-1/2} (A + I) D̃^{-1/2}`` with ``D̃ = diag((A + I) 1)`` (ALGORITHMS.md §1.1)."""
    a = np.asarray(adj, dtype=np.float64) + np.eye(len(adj))
    d = a.sum(1)
    inv_sqrt = 1.0 / np.sqrt(d)
    return inv_sqrt[:, None] * a * inv_sqrt[None, :]
