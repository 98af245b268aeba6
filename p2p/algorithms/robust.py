"""Robust combine rules for untrusted neighbours: self-centred clipping and trimmed mean.

The default ``combine`` of the mixing algorithms (DFL-SGD, DFL-GT, gossip) is the weighted mean
``x̃_i = Σ_j W_ij x_j`` (:func:`graphfl.p2p.algorithms.base.mix_inbox`): one neighbour that sends
huge values moves ``x̃_i`` as far as it likes. For networks whose peers are not all trusted,
``[run] combine`` replaces it by one of two rules, applied per channel of the node's own
broadcast message (the same rule on every node, part of the config hash):

``clipped`` — self-centred clipping (ClippedGossip; He, Karimireddy & Jaggi, "Byzantine-robust
decentralized learning via ClippedGossip", 2022, eq. 3)::

    x̃_i = Σ_j W_ij (x_i + clip(x_j − x_i, τ)),   clip(z, τ) = z · min(1, τ / ‖z‖₂)

``‖z‖₂`` is the norm over all tensors of the channel together. ``τ`` is ``combine-clip``; with
``combine-clip = 0`` it is chosen each round as the median of the heard neighbours' distances
``‖x_j − x_i‖₂`` (a neighbour farther than most is pulled in to that radius). A neighbour then
moves ``x̃_i`` by at most ``W_ij τ``, whatever it sends.

``trimmed`` — coordinate-wise trimmed mean (Yin et al., "Byzantine-robust distributed learning",
ICML 2018, adapted to a neighbourhood as in Fang et al. 2022)::

    x̃_i[k] = mean of {x_j[k] : j ∈ {i} ∪ heard} without its b largest and b smallest values

``b`` is ``combine-trim``; it is lowered to ``(m − 1) // 2`` when only ``m`` values are there this
round (a missing neighbour), so at least one value is kept. The mixing weights are not used: each
kept value counts the same. Up to ``b`` hostile neighbours cannot move a coordinate outside the
range of the honest values.

Both rules are pure functions of the inbox, summed in ascending neighbour id in float64 (the same
bits in every runtime). Neither keeps DFL-GT's tracking invariant ``Σ_i y_i = Σ_i g_i`` exact; they
trade it for a bounded influence of any one neighbour.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphfl.common.config import ConfigError
from graphfl.p2p.algorithms.base import Channels, Inbox, NodeContext, NodeState, P2PAlgorithm

logger = logging.getLogger(__name__)

COMBINE_RULES = ("mix", "clipped", "trimmed")


@dataclass(frozen=True)
class RobustRule:
    """Which robust combine to use (``[run] combine``, ``combine-clip``, ``combine-trim``)."""

    kind: str = "mix"
    clip: float = 0.0
    trim: int = 1

    def __post_init__(self) -> None:
        if self.kind not in COMBINE_RULES:
            raise ConfigError(f"combine = {self.kind!r} is not valid; choose one of {list(COMBINE_RULES)}")
        if not (np.isfinite(self.clip) and self.clip >= 0):
            raise ConfigError(f"combine-clip = {self.clip!r} must be >= 0 (0 = the median neighbour distance)")
        if self.trim < 0:
            raise ConfigError(f"combine-trim = {self.trim!r} must be >= 0")


def _norm(tensors: Mapping[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.sum(np.square(np.asarray(a, dtype=np.float64)))) for a in tensors.values())))


def clipped_combine(own_id: int, own: Mapping[str, np.ndarray], heard: Mapping[int, Mapping[str, np.ndarray]],
                    weights: Mapping[int, float], clip: float) -> dict[str, np.ndarray]:
    """``x̃_i = Σ_j W_ij (x_i + clip(x_j − x_i, τ))`` over one channel's tensors (module docstring).

    ``heard`` maps neighbour ids to their tensors of this channel; ``weights`` holds ``W_i·``
    over ``{own_id} ∪ heard``. ``clip = 0``: ``τ`` = the median of the distances ``‖x_j − x_i‖``.
    """
    diffs = {j: {name: np.asarray(heard[j][name], dtype=np.float64) - np.asarray(a, dtype=np.float64)
                 for name, a in own.items()} for j in sorted(heard)}
    dist = {j: _norm(d) for j, d in diffs.items()}
    tau = clip if clip > 0 else (float(np.median(list(dist.values()))) if dist else 0.0)
    out: dict[str, np.ndarray] = {}
    for name, a in own.items():
        base = np.asarray(a, dtype=np.float64)
        acc = weights[own_id] * base
        for j in sorted(heard):  # fixed order: the same bits in every runtime
            scale = 1.0 if dist[j] <= tau else (tau / dist[j] if dist[j] > 0 else 0.0)
            acc = acc + weights[j] * (base + scale * diffs[j][name])
        out[name] = acc.astype(np.asarray(a).dtype, copy=False)
    return out


def trimmed_combine(own_id: int, own: Mapping[str, np.ndarray], heard: Mapping[int, Mapping[str, np.ndarray]],
                    trim: int) -> dict[str, np.ndarray]:
    """Coordinate-wise mean of ``{x_i} ∪ {x_j}`` without the ``b`` largest and ``b`` smallest values.

    ``b = min(trim, (m − 1) // 2)`` for the ``m`` values present, so at least one value is kept.
    """
    ids = [own_id, *sorted(heard)]
    m = len(ids)
    b = min(trim, (m - 1) // 2)
    out: dict[str, np.ndarray] = {}
    for name, a in own.items():
        stack = np.stack([np.asarray(a if j == own_id else heard[j][name], dtype=np.float64) for j in ids])
        kept = np.sort(stack, axis=0)[b:m - b]
        out[name] = kept.mean(axis=0).astype(np.asarray(a).dtype, copy=False)
    return out


def robust_combine(rule: RobustRule, node: int, inbox: Inbox) -> Channels:
    """Apply ``rule`` to every channel of ``inbox`` (the replacement of ``mix_inbox``)."""
    if inbox.own is None:
        raise ValueError(f"node {node}: phase {inbox.phase!r} has no own broadcast message; a robust combine "
                         "needs it (algorithms with per-neighbour messages keep their own combine)")
    mixed: Channels = {}
    for ch, arrays in inbox.own.items():
        heard = {j: msg[ch] for j, msg in inbox.messages.items()}
        if rule.kind == "clipped":
            mixed[ch] = clipped_combine(node, arrays, heard, inbox.weights, rule.clip)
        else:
            mixed[ch] = trimmed_combine(node, arrays, heard, rule.trim)
    return mixed


def with_robust_combine(algo: P2PAlgorithm[Any, Any], rule: RobustRule) -> P2PAlgorithm[Any, Any]:
    """``algo`` with its ``combine`` replaced by ``rule`` (``mix``: ``algo`` unchanged).

    Raises
    ------
    ConfigError
        When ``algo`` has a combine of its own (per-neighbour messages: ADMM, FedRelax), which a
        mean-replacing rule does not fit.
    """
    if rule.kind == "mix":
        return algo
    if type(algo).combine is not P2PAlgorithm.combine:
        raise ConfigError(f"combine = {rule.kind!r} needs an algorithm that mixes its neighbours' broadcast "
                          f"messages (dfl-sgd, dfl-gt, gossip); {algo.name!r} combines per-neighbour messages "
                          "in its own way: use combine = 'mix'")

    def combine(self: P2PAlgorithm[Any, Any], state: NodeState, inbox: Inbox, ctx: NodeContext) -> Channels:
        return robust_combine(rule, ctx.node, inbox)

    setattr(algo, "combine", types.MethodType(combine, algo))  # noqa: B010 - an instance override
    return algo
