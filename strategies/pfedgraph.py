"""pFedGraph: personalised FL with an inferred collaboration graph (Ye et al., ICML 2023; ALGORITHMS.md §10).

Server, after the uploads ``θ_j`` (the latest of every client that has uploaded), following the
official code (``MediaBrain-SJTU/pFedGraph``; :mod:`graphfl.strategies.graph_baselines_math`):

* ``v_j = θ_j − θ^0``; per client ``i`` the collaboration weights
  ``a_i = Proj_Δ(p + cos_i / (2α))`` (the closed form of the official QP; cosines above 0.9 set
  to 1; ``p`` the data-size proportions);
* client ``i`` receives ``θ̃_i = Σ_j a_ij θ_j`` and the cluster model ``c_i = Σ_j a_ij θ_j/‖θ_j‖``
  (arrays ``pfedgraph/c/<key>`` beside the model's);
* the client trains from ``θ̃_i`` on ``F_i(θ) − λ ⟨c_i, θ⟩/‖θ‖`` (``lam`` = λ; the paper's
  similarity regulariser, i.e. ``−λ‖c_i‖ cos(θ, c_i)``; client half in
  :mod:`graphfl.client.graph_trainers`).

A client without an upload receives the sample-weighted mean model (no cluster model; the
initial model before any upload). Per-round metrics: the graph ``A`` (rows of the clients
with an upload, ``n x n``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from graphfl.common.core import ServerContext
from graphfl.common.registry import AlgorithmSpec, register
from graphfl.common.types import Arrays, ClientUpdate, MetricValue
from graphfl.strategies import graph_baselines_math as gb
from graphfl.strategies.model_table import PersonalModelsCore

CLUSTER_PREFIX = "pfedgraph/c/"
"""Payload arrays ``CLUSTER_PREFIX + key``: the cluster model ``c_i`` of the regulariser."""


@dataclass(frozen=True)
class PFedGraphConfig:
    """pFedGraph hyperparameters (``[pfedgraph]``; official code defaults).

    Attributes
    ----------
    alpha
        ``α`` of the graph QP (0.8).
    clip_above
        Cosines above this count as 1 (0.9; 1.0 disables).
    lam
        ``λ`` of the client's similarity regulariser (0.01).
    """

    alpha: float = field(default=0.8, metadata={"min": 1e-12})
    clip_above: float = field(default=0.9, metadata={"min": -1.0, "max": 1.0})
    lam: float = field(default=0.01, metadata={"min": 0.0})


class PFedGraphCore(PersonalModelsCore[PFedGraphConfig]):
    """Server half of pFedGraph (module docstring)."""

    def __init__(self, ctx: ServerContext[PFedGraphConfig]) -> None:
        super().__init__(ctx)
        self.graph: np.ndarray | None = None

    def _cluster_arrays(self, c: np.ndarray) -> Arrays:
        model = self.table.unflatten(c)
        return {CLUSTER_PREFIX + k: model[k] for k in self.table.keys}

    def aggregate_train(self, server_round: int, updates: Mapping[int, ClientUpdate]) -> dict[str, MetricValue]:
        accepted = self.table.ingest(updates)
        metrics: dict[str, MetricValue] = {"clients_aggregated": len(accepted)}
        if not accepted:
            return metrics
        idx = self.table.present()
        models = self.table.rows[idx]
        p = self.params
        clip = None if p.clip_above >= 1.0 else p.clip_above
        self.graph = gb.pfedgraph_graph(models.astype(np.float64) - self.init, self.table.weights[idx], p.alpha, clip)
        personal, cluster = gb.pfedgraph_aggregate(models, self.graph)
        self.payloads.update(personal, idx, lambda j: self._cluster_arrays(cluster[j]))
        full = np.zeros((self.table.n, self.table.n))
        full[np.ix_(idx, idx)] = self.graph
        metrics["graph"] = full.round(6).tolist()
        return metrics


register(AlgorithmSpec("pfedgraph", PFedGraphConfig, PFedGraphCore,
                       "pFedGraph: per-client aggregation on a similarity-learned collaboration graph (Ye et al.)"))
