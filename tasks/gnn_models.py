"""Graph neural networks of the GNN tasks (torch-geometric): a molecule classifier and a GCN recommender.

Both are plain ``torch.nn.Module`` s: their ``state_dict`` is a set of named tensors (no
graph-dependent shapes), so it travels over the wire like any other model. PyG is imported
here only, so the other tasks never pay for it (about 2.5 s and 100 MB, docs/data.md).

* :class:`MoleculeNet` — ``AtomEncoder`` (sum of one embedding per categorical atom feature of
  ``torch_geometric.utils.from_smiles``) → ``L`` GIN or GCN layers with ReLU → global mean pool →
  linear head with 2 logits (Xu et al. 2019; Hu et al. 2020, *Strategies for pre-training GNNs*).
* :class:`BipartiteGCN` — user embeddings (shared by every client) and item inputs computed from
  the client's ratings (mean rating, log degree) → ``L`` GCN layers (Kipf & Welling 2017,
  ``H' = D̂^{-1/2} Â D̂^{-1/2} H W``) on the user–item graph → MLP on ``[h_u, h_i, h_u ⊙ h_i]`` →
  predicted rating ``3 + 2 tanh(·)`` in the rating range (1, 5).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch_geometric.nn import GCNConv, GINConv, global_mean_pool
from torch_geometric.utils.smiles import x_map

ATOM_FEATURE_SIZES = tuple(len(v) for v in x_map.values())
"""Vocabulary size of each of the 9 integer atom features that ``from_smiles`` writes in ``x``."""


class AtomEncoder(nn.Module):
    """``h_v = Σ_k E_k[x_{v,k}]``: one embedding table per categorical atom feature, summed."""

    def __init__(self, dim: int, sizes: tuple[int, ...] = ATOM_FEATURE_SIZES) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(n, dim) for n in sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((t(x[:, k]) for k, t in enumerate(self.tables)), torch.zeros((), device=x.device))


class MoleculeNet(nn.Module):
    """Graph classifier: atom encoder → ``layers`` × (GIN | GCN, ReLU) → mean pool → 2 logits.

    ``forward`` takes a PyG ``Batch`` (``x``, ``edge_index``, ``batch``) and returns (graphs, 2).
    """

    def __init__(self, hidden: int = 64, layers: int = 3, encoder: str = "gin", num_classes: int = 2) -> None:
        super().__init__()
        if encoder not in ("gin", "gcn"):
            raise ValueError(f"encoder must be 'gin' or 'gcn', got {encoder!r}")
        self.atoms = AtomEncoder(hidden)
        convs: list[nn.Module] = []
        for _ in range(layers):
            if encoder == "gin":
                mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
                convs.append(GINConv(mlp, train_eps=True))
            else:
                convs.append(GCNConv(hidden, hidden))
        self.convs = nn.ModuleList(convs)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, batch: Any) -> torch.Tensor:
        h = self.atoms(batch.x)
        for conv in self.convs:
            h = torch.relu(conv(h, batch.edge_index))
        return self.head(global_mean_pool(h, batch.batch, size=batch.num_graphs))


def gcn_norm_edges(edge_index: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(edge_index, weight)`` of ``D̂^{-1/2} (A + I) D̂^{-1/2}`` (Kipf & Welling 2017, eq. 2), self loops added."""
    from torch_geometric.nn.conv.gcn_conv import gcn_norm

    ei, w = gcn_norm(edge_index, None, num_nodes, add_self_loops=True)
    assert w is not None
    return ei, w


class BipartiteGCN(nn.Module):
    """Rating predictor on a client's user–item graph.

    Node inputs: users ``E[u]`` (a table over all users, shared through the server); items
    ``W_i f_i + b`` with ``f_i = (mean train rating − 4, log(1 + degree))`` so that
    no per-item table is averaged across clients that never see the item. Then ``layers`` GCN
    layers on the symmetric graph (users and items as nodes, each training rating an undirected
    edge, self loops added by ``GCNConv``), ReLU between layers, and
    ``r̂ = center + half_range · tanh(MLP([h_u, h_i, h_u ⊙ h_i]))``, i.e. inside the rating range
    (1, 5). The bounded output keeps the MSE gradient bounded: with an unbounded head, FedAvg at
    the default lr 0.1 sent one Ciao client to NaN in round 3.

    ``forward`` takes a ``Data`` with ``edge_index`` / ``edge_weight`` (the normalised graph with
    self loops from :func:`gcn_norm_edges`; local node ids: users ``0..U-1``, items ``U..``),
    ``item_feat`` (items × 2), ``pairs`` (batch × 2 of local user / item node ids) and
    optionally ``user_ids`` (the U rows of the user table that are the graph's users; without
    it, all ``num_users`` rows in order).
    """

    def __init__(self, num_users: int, hidden: int = 32, layers: int = 2, center: float = 3.0,
                 half_range: float = 2.0) -> None:
        super().__init__()
        self.num_users = int(num_users)
        self.center, self.half_range = float(center), float(half_range)
        self.users = nn.Embedding(self.num_users, hidden)
        nn.init.normal_(self.users.weight, std=0.1)
        self.items = nn.Linear(2, hidden)
        # normalize=False: the batch carries D̂^{-1/2} Â D̂^{-1/2} as (edge_index, edge_weight), computed
        # once per client graph (gcn_norm_edges) instead of twice per step
        self.convs = nn.ModuleList(GCNConv(hidden, hidden, normalize=False) for _ in range(layers))
        self.head = nn.Sequential(nn.Linear(3 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, batch: Any) -> torch.Tensor:
        ids = getattr(batch, "user_ids", None)
        users = self.users.weight if ids is None else self.users(ids)
        h = torch.cat([users, self.items(batch.item_feat)], dim=0)
        for k, conv in enumerate(self.convs):
            h = conv(h, batch.edge_index, batch.edge_weight)
            if k < len(self.convs) - 1:
                h = torch.relu(h)
        hu, hi = h[batch.pairs[:, 0]], h[batch.pairs[:, 1]]
        z = self.head(torch.cat([hu, hi, hu * hi], dim=1)).squeeze(1)
        return self.center + self.half_range * torch.tanh(z)
