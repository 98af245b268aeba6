"""The one graph module: edge-list files, adjacency validation, symmetrisation, client graphs.

Used by every layer that needs a graph: tasks (k-NN client graphs), strategies (BiG-FL's
GCN propagation, a client's neighbourhood), the round loop (resolving the run's client graph)
and the p2p layer (topologies from edge-list files). One parser, one validator, one
duplicate-edge policy (a duplicate is an error naming both lines), one error type.

Edge-list format: one edge per line, ``i j [weight]`` (whitespace or comma separated), ids
are non-negative integers (partition ids / peer ids), ``#`` starts a comment. The graph is
undirected: ``i j`` and ``j i`` are the same edge. Weights are positive and finite (default 1).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphfl.common.config import ConfigError
from graphfl.common.types import Neighbourhood

logger = logging.getLogger(__name__)

Edge = tuple[int, int, float]

MISSING_GRAPH_POLICIES = ("complete", "isolated", "error")


class GraphError(ConfigError):
    """A graph file or adjacency matrix is unusable; the message names the file/line or the source."""


@dataclass(frozen=True)
class EdgeList:
    """Undirected edges ``(i, j, w)`` with ``i < j``, sorted; ``num_nodes`` = largest id + 1."""

    num_nodes: int
    edges: tuple[Edge, ...]


def read_edge_list(path: str | Path, num_nodes: int | None = None) -> EdgeList:
    """Parse an edge-list file (see the module docstring).

    Parameters
    ----------
    path
        The file.
    num_nodes
        When given, ids must lie in ``0..num_nodes-1`` and the result has ``num_nodes`` nodes.

    Raises
    ------
    GraphError
        Missing file; a malformed line, negative or out-of-range id, self-loop, non-positive or
        non-finite weight, or an edge listed twice (naming the file and the line).
    """
    p = Path(path)
    if not p.is_file():
        raise GraphError(f"graph file not found: {p}")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise GraphError(f"graph file {p} cannot be read: {exc}") from None
    edges: dict[tuple[int, int], float] = {}
    first_line: dict[tuple[int, int], int] = {}
    largest = -1
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].replace(",", " ").strip()
        if not line:
            continue
        parts = line.split()
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            i, j = int(parts[0]), int(parts[1])
            w = float(parts[2]) if len(parts) == 3 else 1.0
        except ValueError:
            raise GraphError(f"{p}:{lineno}: expected 'i j [weight]', got {raw!r}") from None
        for node in (i, j):
            if node < 0:
                raise GraphError(f"{p}:{lineno}: node id {node} is negative")
            if num_nodes is not None and node >= num_nodes:
                raise GraphError(f"{p}:{lineno}: node id {node} is outside 0..{num_nodes - 1}")
        if i == j:
            raise GraphError(f"{p}:{lineno}: self-loop {i}-{j} is not allowed")
        if not (np.isfinite(w) and w > 0):
            raise GraphError(f"{p}:{lineno}: weight must be positive and finite, got {w}")
        key = (min(i, j), max(i, j))
        if key in edges:
            raise GraphError(f"{p}:{lineno}: edge {key} is listed twice (first on line {first_line[key]})")
        edges[key] = w
        first_line[key] = lineno
        largest = max(largest, i, j)
    n = num_nodes if num_nodes is not None else largest + 1
    return EdgeList(n, tuple((i, j, w) for (i, j), w in sorted(edges.items())))


def adjacency_from_edges(num_nodes: int, edges: tuple[Edge, ...] | list[Edge]) -> np.ndarray:
    """Symmetric weighted adjacency ``A[i, j] = A[j, i] = w`` (float64, zero diagonal)."""
    adj = np.zeros((num_nodes, num_nodes))
    for i, j, w in edges:
        adj[i, j] = adj[j, i] = w
    return adj


def load_adjacency(path: str | Path, num_nodes: int) -> np.ndarray:
    """:func:`read_edge_list` with ids checked against ``num_nodes``, as an adjacency matrix."""
    return adjacency_from_edges(num_nodes, read_edge_list(path, num_nodes).edges)


def validate_adjacency(adj: np.ndarray, num_nodes: int, source: str = "client graph") -> np.ndarray:
    """Check shape, symmetry, nonnegativity, finiteness and zero diagonal; return a float copy."""
    a = np.array(adj, dtype=np.float64)
    if a.shape != (num_nodes, num_nodes):
        raise GraphError(f"{source} has shape {a.shape} but the federation has {num_nodes} clients")
    if not np.all(np.isfinite(a)) or np.any(a < 0):
        raise GraphError(f"{source} has negative or non-finite weights")
    if not np.array_equal(a, a.T) and not np.allclose(a, a.T):
        raise GraphError(f"{source} is not symmetric (the graph must be undirected)")
    if np.any(np.diag(a) != 0):
        raise GraphError(f"{source} has self-loops; the diagonal must be zero")
    return a


def symmetrise(adj: np.ndarray) -> np.ndarray:
    """Union symmetrisation ``max(A, Aᵀ)`` with the diagonal cleared."""
    a = np.maximum(np.asarray(adj, dtype=np.float64), np.asarray(adj, dtype=np.float64).T)
    np.fill_diagonal(a, 0.0)
    return a


def knn_graph(points: np.ndarray, k: int) -> np.ndarray:
    """Symmetric 0/1 adjacency: i ~ j if j is among i's k nearest neighbours or vice versa.

    Euclidean distances ``Σ_d (p_i − p_j)_d²``; union symmetrisation as in ALGORITHMS.md §5.9;
    zero diagonal. Ties are broken by the lower index (the first ``k`` of a stable sort of each
    row's distances).

    Cost: one matrix product finds, per row, the candidates whose distance through
    ``‖p_i‖² + ‖p_j‖² − 2⟨p_i, p_j⟩`` lies within a margin of the row's ``k``-th smallest (the
    margin, ``r (‖p_i‖² + max_j ‖p_j‖²)`` with ``r = max(1e-8, 16 · dim · eps)`` of the points'
    dtype, is orders of magnitude above the rounding error of either formula, so every true
    neighbour is a candidate); only the candidates' distances are
    then computed by the difference formula and sorted stably. Blocks of rows of about 32 MB: no
    ``n × n`` distance matrix is held.
    """
    n = len(points)
    if n < 2:
        return np.zeros((n, n))
    k = min(k, n - 1)
    pts = np.asarray(points)
    p64 = pts.astype(np.float64).reshape(n, -1)
    sq = (p64**2).sum(1)
    reach = sq.max() if np.all(np.isfinite(sq)) else np.inf
    eps = float(np.finfo(pts.dtype).eps) if np.issubdtype(pts.dtype, np.floating) else 0.0
    rel = max(1e-8, 16.0 * p64.shape[1] * eps)
    rows = max(1, (1 << 22) // n)
    adj = np.zeros((n, n))
    for lo in range(0, n, rows):
        block = np.arange(lo, min(lo + rows, n))
        approx = sq[block, None] + sq[None, :] - 2.0 * (p64[block] @ p64.T)
        approx[np.arange(len(block)), block] = np.inf
        kth = np.partition(approx, k - 1, axis=1)[:, k - 1]
        bound = kth + rel * (sq[block] + reach) + 1e-300
        for r, i in enumerate(block):
            cand = np.flatnonzero(approx[r] <= bound[r]) if np.isfinite(bound[r]) else np.arange(n)
            cand = cand[cand != i]
            exact = ((pts[i][None, :] - pts[cand]) ** 2).sum(-1)
            adj[i, cand[np.argsort(exact, kind="stable")[:k]]] = 1.0
    return symmetrise(adj)


def gcn_propagation(adj: np.ndarray) -> np.ndarray:
    """``Â = D̃^{-1/2} (A + I) D̃^{-1/2}`` with ``D̃ = diag((A + I) 1)`` (ALGORITHMS.md §1.1)."""
    a = np.asarray(adj, dtype=np.float64) + np.eye(len(adj))
    inv_sqrt = 1.0 / np.sqrt(a.sum(1))
    out: np.ndarray = inv_sqrt[:, None] * a * inv_sqrt[None, :]
    return out


def resolve_client_graph(
    num_clients: int, task_graph: np.ndarray | None, graph_file: str = "", task_name: str = "the task"
) -> tuple[np.ndarray | None, str]:
    """The run's client graph and where it came from: ``graph_file`` if set, else the task's.

    Returns ``(None, "")`` when there is neither. Raises :class:`GraphError` when the graph
    does not fit ``num_clients`` or is malformed.
    """
    if graph_file:
        adj = load_adjacency(graph_file, num_clients)
        return validate_adjacency(adj, num_clients, f"graph file {graph_file}"), f"file {graph_file}"
    if task_graph is not None:
        return validate_adjacency(task_graph, num_clients, f"{task_name}'s client graph"), "task"
    return None, ""


def fallback_graph(num_clients: int, policy: str, who: str) -> tuple[np.ndarray, str]:
    """The graph an algorithm that needs one uses when the run has none.

    ``policy``: ``"complete"`` (every pair linked), ``"isolated"`` (no edges) or ``"error"``
    (raise a :class:`GraphError` telling the user how to give a graph).
    """
    if policy not in MISSING_GRAPH_POLICIES:
        raise GraphError(f"missing-graph policy {policy!r} is not valid; choose one of {list(MISSING_GRAPH_POLICIES)}")
    if policy == "error":
        raise GraphError(
            f"{who} needs a client graph: the task has none and graph-file is not set "
            f"(give graph-file = 'edges.txt' with lines 'i j [weight]', or set "
            f"{who}.missing-graph = complete|isolated)"
        )
    logger.warning("%s: no client graph (task has none, graph-file not set); using the %s graph on %d clients",
                   who, policy, num_clients)
    if policy == "complete":
        return np.ones((num_clients, num_clients)) - np.eye(num_clients), "complete (fallback)"
    return np.zeros((num_clients, num_clients)), "isolated (fallback)"


def neighbourhood(adj: np.ndarray | None, node: int) -> Neighbourhood:
    """Neighbours of ``node`` (ascending ids) and their edge weights; empty without a graph."""
    if adj is None:
        return Neighbourhood()
    row = np.asarray(adj)[node]
    ids = tuple(int(j) for j in np.flatnonzero(row > 0) if j != node)
    return Neighbourhood(ids, tuple(float(row[j]) for j in ids))
