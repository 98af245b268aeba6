"""FedAMP: attentive message passing (Huang et al., AAAI 2021; ALGORITHMS.md §10).

Server, after the uploads ``w_j`` (the latest of every client that has uploaded):

* attention weights ``ξ`` over those clients (:mod:`graphfl.strategies.graph_baselines_math`):
  ``attention = "heuristic"`` (HeurFedAMP, the form used for deep nets and in the pFedGraph
  repository): ``ξ_ii = s``, ``ξ_ij = (1 − s) softmax_j(κ cos(v_i, v_j))`` with ``v = w − θ^0``;
  ``"exp"`` (the paper's eq. 8): ``ξ_ij = α_k exp(−‖w_i − w_j‖²/σ)/σ``, ``ξ_ii = 1 − Σ_{j≠i} ξ_ij``;
* each client ``i`` receives its personalised cloud model ``u_i = Σ_j ξ_ij w_j``;
* the client minimises ``F_i(θ) + (μ/2)‖θ − u_i‖²`` from ``u_i`` (``prox_mu`` = μ, the paper's
  ``λ/α_k``; client half in :mod:`graphfl.client.graph_trainers`).

A client without an upload receives the sample-weighted mean of the cloud models (the initial
model before any upload). Per-round metrics: the self weights ``ξ_ii``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from graphfl.common.core import ServerContext
from graphfl.common.registry import AlgorithmSpec, register
from graphfl.common.types import ClientUpdate, MetricValue
from graphfl.strategies import graph_baselines_math as gb
from graphfl.strategies.model_table import PersonalModelsCore

ATTENTIONS = ("heuristic", "exp")


@dataclass(frozen=True)
class FedAMPConfig:
    """FedAMP hyperparameters (``[fedamp]``).

    Attributes
    ----------
    attention
        ``heuristic`` (HeurFedAMP) or ``exp`` (eq. 8).
    self_weight, scale
        ``s`` and ``κ`` of the heuristic (0.3, 10 as in the pFedGraph repository).
    alpha_k, sigma
        ``α_k`` and ``σ`` of eq. 8 (σ in units of squared model distance; keep ``α_k <= σ/(n−1)``).
    prox_mu
        ``μ`` of the client's proximal term towards ``u_i``.
    """

    attention: str = field(default="heuristic", metadata={"choices": ATTENTIONS})
    self_weight: float = field(default=0.3, metadata={"min": 0.0, "max": 1.0})
    scale: float = field(default=10.0, metadata={"min": 0.0})
    alpha_k: float = field(default=0.1, metadata={"min": 1e-12})
    sigma: float = field(default=1.0, metadata={"min": 1e-12})
    prox_mu: float = field(default=0.1, metadata={"min": 0.0})


class FedAMPCore(PersonalModelsCore[FedAMPConfig]):
    """Server half of FedAMP (module docstring): one cloud model per client."""

    def __init__(self, ctx: ServerContext[FedAMPConfig]) -> None:
        super().__init__(ctx)
        self.xi: np.ndarray | None = None

    def attention(self, models: np.ndarray) -> np.ndarray:
        """``ξ`` over the rows of ``models`` (float32 uploads)."""
        p = self.params
        if p.attention == "exp":
            return gb.fedamp_weights(models, p.alpha_k, p.sigma)
        return gb.fedamp_heuristic_weights(models.astype(np.float64) - self.init, p.self_weight, p.scale)

    def aggregate_train(self, server_round: int, updates: Mapping[int, ClientUpdate]) -> dict[str, MetricValue]:
        accepted = self.table.ingest(updates)
        metrics: dict[str, MetricValue] = {"clients_aggregated": len(accepted)}
        if not accepted:
            return metrics
        idx = self.table.present()
        models = self.table.rows[idx]
        self.xi = self.attention(models)
        cloud = gb.fedamp_aggregate(models, self.xi)
        self.payloads.update(cloud, idx)
        metrics["self_weight"] = np.diag(self.xi).round(6).tolist()
        return metrics


register(AlgorithmSpec("fedamp", FedAMPConfig, FedAMPCore,
                       "FedAMP: personalised cloud models by attentive message passing (Huang et al.)"))
