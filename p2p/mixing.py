"""Mixing (gossip) matrices for decentralized averaging (ALGORITHMS.md §1.2, seed 000 §10.2).

A mixing matrix ``W`` for an undirected graph satisfies ``W_ij > 0`` only on edges and the
diagonal, ``W 1 = 1`` and ``1ᵀ W = 1ᵀ`` (doubly stochastic), and here also ``W = Wᵀ`` and
``W >= 0``. Three rules are provided:

* ``metropolis`` (default): ``W_ij = 1 / (1 + max(d_i, d_j))`` on edges,
  ``W_ii = 1 - Σ_j W_ij`` (Xiao, Boyd, Lall 2006).
* ``max-degree``: ``W = I - L / (d_max + 1)`` (variant ``"dmax+1"``, default), or the
  variants ``"dmax"`` (``1/d_max``, non-convergent on regular bipartite graphs) and ``"n"``
  (``1/n``).
* ``laplacian``: ``W = I - ε L_w`` with the *weighted* Laplacian ``L_w`` of the edge weights;
  ``ε`` defaults to ``1 / (max weighted degree + 1)`` (nonnegative by construction);
  ``epsilon="best"`` uses ``2 / (λ_2 + λ_max)``, which may produce negative entries and is
  rejected by validation then.

``metropolis`` and ``max-degree`` use only the edge pattern (weights > 0); ``laplacian``
uses the weights.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from graphfl.common.config import ConfigError

logger = logging.getLogger(__name__)

RULES = ("metropolis", "max-degree", "laplacian")
MAX_DEGREE_VARIANTS = ("dmax+1", "dmax", "n")
TOL = 1e-12


def _check_adjacency(adj: np.ndarray) -> np.ndarray:
    a = np.asarray(adj, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ConfigError(f"adjacency must be a square matrix, got shape {a.shape}")
    if not np.all(np.isfinite(a)) or np.any(a < 0):
        raise ConfigError("adjacency must be finite and nonnegative")
    if not np.allclose(a, a.T, atol=0.0):
        raise ConfigError("adjacency must be symmetric (edges are undirected)")
    if np.any(np.diag(a) != 0):
        raise ConfigError("adjacency must have a zero diagonal (no self loops)")
    return a


def mixing_matrix(
    adj: np.ndarray,
    rule: str = "metropolis",
    *,
    variant: str = "dmax+1",
    epsilon: float | str | None = None,
) -> np.ndarray:
    """Build and validate the mixing matrix of an undirected (weighted) graph.

    Parameters
    ----------
    adj
        Symmetric nonnegative ``n x n`` adjacency (weights), zero diagonal.
    rule
        ``metropolis`` | ``max-degree`` | ``laplacian``.
    variant
        For ``max-degree``: ``dmax+1`` (default), ``dmax`` or ``n``.
    epsilon
        For ``laplacian``: a number, ``"best"``, or ``None`` (= ``1/(max weighted degree+1)``).

    Returns
    -------
    numpy.ndarray
        ``W`` (float64), validated by :func:`validate_mixing`. Isolated nodes get ``W_ii = 1``.
    """
    a = _check_adjacency(adj)
    n = a.shape[0]
    pattern = (a > 0).astype(np.float64)
    deg = pattern.sum(axis=1)
    if rule == "metropolis":
        w = np.zeros((n, n))
        ii, jj = np.nonzero(pattern)
        w[ii, jj] = 1.0 / (1.0 + np.maximum(deg[ii], deg[jj]))
    elif rule == "max-degree":
        if variant not in MAX_DEGREE_VARIANTS:
            raise ConfigError(
                f"max-degree variant {variant!r} is not valid; choose one of {list(MAX_DEGREE_VARIANTS)}"
            )
        dmax = float(deg.max()) if n else 0.0
        denom = {"dmax+1": dmax + 1.0, "dmax": max(dmax, 1.0), "n": float(n)}[variant]
        w = pattern / denom
    elif rule == "laplacian":
        wdeg = a.sum(axis=1)
        lap = np.diag(wdeg) - a
        if epsilon is None:
            eps = 1.0 / (float(wdeg.max()) + 1.0) if n else 1.0
        elif epsilon == "best":
            ev = np.sort(np.linalg.eigvalsh(lap))
            if n < 2 or ev[-1] <= 0:
                eps = 0.0
            else:
                eps = 2.0 / (ev[1] + ev[-1])
        else:
            eps = float(epsilon)
            if not eps > 0:
                raise ConfigError(f"laplacian epsilon must be > 0, got {epsilon!r}")
        w = eps * a
    else:
        raise ConfigError(f"unknown mixing rule {rule!r}; choose one of {list(RULES)}")
    np.fill_diagonal(w, 0.0)
    np.fill_diagonal(w, 1.0 - w.sum(axis=1))
    validate_mixing(w, adj=a)
    return w


def validate_mixing(w: np.ndarray, adj: np.ndarray | None = None, tol: float = TOL) -> None:
    """Check ``W``: square, symmetric, nonnegative, rows and columns summing to 1 within ``tol``.

    If ``adj`` is given, off-diagonal nonzeros must lie on edges. A disconnected graph only
    warns (consensus then holds inside each component).

    Raises
    ------
    ConfigError
        Naming the first violated property and where.
    """
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] != w.shape[1]:
        raise ConfigError(f"mixing matrix must be square, got shape {w.shape}")
    if not np.all(np.isfinite(w)):
        raise ConfigError("mixing matrix has non-finite entries")
    asym = np.abs(w - w.T)
    if asym.max(initial=0.0) > tol:
        i, j = (int(x) for x in np.unravel_index(np.argmax(asym), asym.shape))
        raise ConfigError(f"mixing matrix is not symmetric: W[{i},{j}]={float(w[i, j])!r} != W[{j},{i}]={float(w[j, i])!r}")
    if w.min(initial=0.0) < -tol:
        i, j = (int(x) for x in np.unravel_index(np.argmin(w), w.shape))
        raise ConfigError(f"mixing matrix has a negative entry W[{i},{j}]={float(w[i, j])!r}")
    rows = np.abs(w.sum(axis=1) - 1.0)
    if rows.max(initial=0.0) > tol:
        i = int(np.argmax(rows))
        raise ConfigError(f"mixing matrix row {i} sums to {float(w[i].sum())!r}, not 1")
    cols = np.abs(w.sum(axis=0) - 1.0)
    if cols.max(initial=0.0) > tol:
        j = int(np.argmax(cols))
        raise ConfigError(f"mixing matrix column {j} sums to {float(w[:, j].sum())!r}, not 1")
    n = w.shape[0]
    if adj is not None:
        off = (np.abs(w) > 0) & ~(np.asarray(adj) > 0) & ~np.eye(n, dtype=bool)
        if off.any():
            i, j = map(int, np.argwhere(off)[0])
            raise ConfigError(f"mixing matrix W[{i},{j}] is nonzero but ({i},{j}) is not an edge")
    if n > 1:
        comps = connected_components((np.abs(w) > 0) & ~np.eye(n, dtype=bool))
        if len(comps) > 1:
            logger.warning(
                "graph is disconnected (%d components: %s); consensus only inside components",
                len(comps),
                comps,
            )


def connected_components(pattern: np.ndarray) -> list[list[int]]:
    """Connected components (sorted node lists, by smallest node) of the graph with adjacency ``pattern != 0``."""
    a = np.asarray(pattern) != 0
    n = a.shape[0]
    label = [-1] * n
    comps: list[list[int]] = []
    for s in range(n):
        if label[s] >= 0:
            continue
        label[s] = len(comps)
        stack, comp = [s], [s]
        while stack:
            u = stack.pop()
            for v in np.nonzero(a[u] | a[:, u])[0]:
                if label[int(v)] < 0:
                    label[int(v)] = label[s]
                    stack.append(int(v))
                    comp.append(int(v))
        comps.append(sorted(comp))
    return comps


def mixing_row(w: np.ndarray, i: int) -> dict[int, float]:
    """Nonzero weights of row ``i`` (including ``i`` itself) as ``{j: W_ij}``."""
    return {int(j): float(w[i, j]) for j in np.nonzero(w[i])[0]}


def reweight(row: dict[int, float], own: int, present: set[int], mode: str = "self") -> dict[int, float]:
    """Weights for one round when some neighbours' messages are missing.

    Parameters
    ----------
    row
        ``{j: W_ij}`` including ``own``.
    present
        Neighbours whose messages arrived (``own`` is always present).
    mode
        ``"self"`` (default): the missing neighbours' weight moves to ``W_ii``. When the failure
        is symmetric (a dead peer, a cut link) the effective matrix stays symmetric and doubly
        stochastic, so the network average of the live nodes is preserved.
        ``"proportional"``: divide the present weights by their sum (row-stochastic only).

    Returns
    -------
    dict
        Weights over ``present ∪ {own}`` summing to 1.
    """
    kept = {j: wj for j, wj in row.items() if j == own or j in present}
    missing = sum(wj for j, wj in row.items() if j != own and j not in present)
    if missing == 0.0:
        return dict(kept)
    if mode == "self":
        kept[own] = kept.get(own, 0.0) + missing
        return kept
    if mode == "proportional":
        s = sum(kept.values())
        if s <= 0:
            return {own: 1.0}
        return {j: wj / s for j, wj in kept.items()}
    raise ConfigError(f"unknown reweight mode {mode!r}; choose 'self' or 'proportional'")


def accumulator_dtype(dtype: np.dtype[Any] | type) -> np.dtype[Any]:
    """The dtype :func:`mix` sums in: the parameters' own float dtype (float32 stays float32,
    float64 stays float64); float16 sums in float32, integers in float64.
    """
    return np.result_type(dtype, np.float32)


def mix(weights: dict[int, float], arrays: dict[int, np.ndarray]) -> np.ndarray:
    """``Σ_j w_j x_j`` summed in ascending ``j`` in the parameters' dtype, in place, cast to the dtype of the inputs.

    The accumulator has the dtype of :func:`accumulator_dtype` (float32 parameters are summed in
    float32, float64 parameters in float64); each weight is rounded to that dtype once, every
    term is written into one reused buffer (no copy per term), and the terms are added in
    ascending ``j``. A node's combination has ``1 + d_i`` terms with weights in ``[0, 1]``
    summing to 1, so float32 accumulation adds at most ``~(1 + d_i) · 2⁻²⁴`` relative error —
    the size of the rounding the result gets anyway when it is stored as float32 (its cost
    against float64 accumulation: docs/p2p.md).

    Both the in-process driver and the gRPC runtime call this function (and
    :class:`graphfl.p2p.vectorised.MixingSlots` does the same operations on rows), so for the
    same inputs they produce bit-identical results.
    """
    keys = sorted(weights)
    ref = arrays[keys[0]]
    acc_dtype = accumulator_dtype(ref.dtype)
    acc = np.empty(ref.shape, dtype=acc_dtype)
    np.multiply(arrays[keys[0]], acc_dtype.type(weights[keys[0]]), out=acc, casting="same_kind")
    if len(keys) > 1:
        term = np.empty_like(acc)
        for j in keys[1:]:
            np.multiply(arrays[j], acc_dtype.type(weights[j]), out=term, casting="same_kind")
            acc += term
    return acc.astype(ref.dtype, copy=False)
