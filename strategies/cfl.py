"""CFL: clustered federated learning (Sattler, Müller, Samek, IEEE TNNLS 2021; ALGORITHMS.md §10).

Round, after client ``i`` trained from the model ``θ_i^{sent}`` it received and uploaded ``θ_i``:

* ``Δθ_i = θ_i − θ_i^{sent}`` (trainable parameters);
* per cluster ``c``: split test ``‖Σ_{i∈c} ω_i Δθ_i‖ < ε1`` and ``max_{i∈c} ‖Δθ_i‖ > ε2`` (past
  ``warmup_rounds``, ``|c| >= min_cluster_size``); a cluster that passes is bipartitioned by
  the cosine similarity of the updates (:func:`~graphfl.strategies.graph_baselines_math.cfl_step`);
* every member ``i`` of (new) cluster ``c`` receives ``θ_i^{sent} + Σ_{j∈c} ω_j Δθ_j``
  (``ω`` normalised over the cluster's clients that replied; uniform as in the authors'
  notebook, sample-weighted with ``weighted``).

Only the clients that replied enter the split test and the averages (``cfl_step`` on the
sub-federation of repliers); a member that did not reply still receives its cluster's average
update, and when its cluster splits it stays with the part holding the cluster's smallest
replying id (reconstructed; the official code has full participation). The local update is
plain SGD (client half in :mod:`graphfl.client.graph_trainers`). Per-round metrics: cluster
assignment, the split tests' norms.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from graphfl.common.core import ServerContext, ServerCore
from graphfl.common.registry import AlgorithmSpec, register
from graphfl.common.types import ClientUpdate, MetricValue, Payload
from graphfl.strategies import graph_baselines_math as gb
from graphfl.strategies.model_table import ModelTable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CFLConfig:
    """CFL hyperparameters (``[cfl]``; defaults of the authors' notebook, see ``graph_baselines_math``)."""

    eps1: float = field(default=0.4, metadata={"min": 0.0})
    eps2: float = field(default=1.6, metadata={"min": 0.0})
    min_cluster_size: int = field(default=3, metadata={"min": 2})
    warmup_rounds: int = field(default=20, metadata={"min": 0})
    linkage: str = field(default="complete", metadata={"choices": gb.LINKAGES})
    weighted: bool = False


class CFLCore(ServerCore[CFLConfig]):
    """Server half of CFL (module docstring): one model per client, shared inside a cluster."""

    def __init__(self, ctx: ServerContext[CFLConfig]) -> None:
        super().__init__(ctx)
        self.table = ModelTable(ctx.initial_arrays, ctx.param_keys, ctx.num_clients)
        n = self.table.n
        init = self.table.flatten(ctx.initial_arrays)
        self.models = np.tile(init, (n, 1))          # θ_i^{sent}, float32
        self.clusters: tuple[tuple[int, ...], ...] = (tuple(range(n)),)
        self.rounds = 0
        self.prm = gb.CFLParams(self.params.eps1, self.params.eps2, self.params.min_cluster_size,
                                self.params.warmup_rounds, self.params.linkage)  # type: ignore[arg-type]
        self._payloads = [Payload(dict(ctx.initial_arrays))] * n

    def configure_train(self, server_round: int, partition_id: int) -> Payload:
        return self._payloads[partition_id]

    def evaluation_payload(self, partition_id: int) -> Payload:
        return self._payloads[partition_id]

    def aggregate_train(self, server_round: int, updates: Mapping[int, ClientUpdate]) -> dict[str, MetricValue]:
        accepted = self.table.ingest(updates)
        metrics: dict[str, MetricValue] = {"clients_aggregated": len(accepted)}
        if not accepted:
            return metrics
        self.rounds += 1
        acc = np.asarray(accepted, dtype=np.int64)
        pos = {int(p): j for j, p in enumerate(acc)}
        du = self.table.rows[acc].astype(np.float64) - self.models[acc]
        sub = tuple(tuple(pos[i] for i in c if i in pos) for c in self.clusters)
        sub_nonempty = tuple(c for c in sub if c)
        weights = self.table.weights[acc] if self.params.weighted else None
        res = gb.cfl_step(du, gb.CFLState(sub_nonempty, self.rounds - 1), weights, self.prm)
        new_clusters: list[tuple[int, ...]] = []
        checks = iter(res.checks)
        for members, part in zip(self.clusters, sub):
            if not part:
                new_clusters.append(members)  # nobody of this cluster replied: unchanged
                continue
            check = next(checks)
            groups = [[int(acc[j]) for j in g] for g in check.parts]
            replied = {int(acc[j]) for j in part}
            groups[0].extend(i for i in members if i not in replied)
            for g in groups:
                new_clusters.append(tuple(sorted(g)))
            for g, p in zip(groups, check.parts):
                upd = res.updates[p[0]]  # the part's average update (every row of the part holds it)
                self.models[g] = (self.models[g].astype(np.float64) + upd).astype(np.float32)
        self.clusters = tuple(new_clusters)
        self._payloads = [Payload(self.table.unflatten(self.models[i])) for i in range(self.table.n)]
        assign = np.zeros(self.table.n, dtype=np.int64)
        for k, c in enumerate(self.clusters):
            assign[list(c)] = k
        metrics.update(assignment=assign.tolist(), num_clusters=len(self.clusters),
                       mean_norm=[c.mean_norm for c in res.checks], max_norm=[c.max_norm for c in res.checks],
                       split=int(any(c.split for c in res.checks)))
        return metrics


register(AlgorithmSpec("cfl", CFLConfig, CFLCore,
                       "CFL: FedAvg in clusters, bipartitioned by update cosine similarity (Sattler et al.)"))
