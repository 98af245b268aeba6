"""Task ``ciao``: rating prediction on the Ciao user–item graph, one client per item category (seed 004).

Data: ``<data>/ciao/rating.mat`` (variable ``rating``, rows ``userid, productid, categoryid,
rating, helpfulness``, 1-based ids; Tang et al. 2012). Zero ratings ("no rating", 34 rows) are
dropped, and a (user, product) pair repeated within a category keeps its first row.

Clients: category ``c`` (1..28) belongs to client ``(c − 1) mod N``, so ``N = 28`` gives one
client per category (the split of seed 004 / FederatedScope-GNN); a smaller ``N`` groups
categories. Each client splits its ratings at random into train / test (``data.test-fraction``).
The client's graph has its own users (those in its train or test ratings; their embeddings are
rows of one user table over all 7,375 users, shared by all clients) and its own products as
nodes and its *training* ratings as undirected edges; test ratings are predicted from it, never
added. Users who rated nothing in the client's categories would be isolated nodes that touch no
prediction, so they are left out (same outputs and gradients, a fraction of the cost).
Model: :class:`~graphfl.tasks.gnn_models.BipartiteGCN`, MSE loss, metric ``test_mae``.
``data.max-samples`` keeps a random subset of the ratings (quick runs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.tasks.base import ClientData, DataError, Task, TaskSpec
from graphfl.tasks.partition import client_rng, train_test_split

logger = logging.getLogger(__name__)

NUM_USERS = 7375
"""Users in the Ciao release (ids 1..7375): the size of the shared user table, known without the data."""
NUM_CATEGORIES = 28


@dataclass(frozen=True)
class Ratings:
    """Cleaned ratings: 0-based ``user``, 1-based ``item`` and ``category``, float ``rating``."""

    user: np.ndarray
    item: np.ndarray
    category: np.ndarray
    rating: np.ndarray
    dropped_zero: int
    dropped_duplicate: int


def read_ratings(path: Path, num_users: int = NUM_USERS) -> Ratings:
    """Load ``rating.mat`` and clean it (see the module docstring).

    Raises
    ------
    DataError
        Missing or unreadable file, no ``rating`` variable, fewer than 4 columns, a user id outside
        ``1..num_users``, a category outside ``1..28`` or a rating outside ``0..5``.
    """
    if not path.is_file():
        raise DataError(f"ciao: missing file {path}. Put rating.mat under <data-dir>/ciao/ (see docs/data.md); "
                        "graphfl never downloads data at run time.")
    from scipy.io import loadmat

    try:
        mat = loadmat(str(path), variable_names=["rating"])
    except (OSError, ValueError, TypeError) as exc:
        raise DataError(f"{path} is not a readable MATLAB file ({type(exc).__name__}: {exc})") from None
    if "rating" not in mat:
        raise DataError(f"{path}: no variable 'rating' (found {sorted(k for k in mat if not k.startswith('__'))})")
    r = np.asarray(mat["rating"])
    if r.ndim != 2 or r.shape[1] < 4:
        raise DataError(f"{path}: 'rating' has shape {r.shape}; expected rows of userid, productid, categoryid, rating")
    r = r.astype(np.int64)
    for col, name, lo, hi in ((0, "userid", 1, num_users), (2, "categoryid", 1, NUM_CATEGORIES), (3, "rating", 0, 5)):
        bad = np.flatnonzero((r[:, col] < lo) | (r[:, col] > hi))
        if len(bad):
            raise DataError(f"{path}: row {int(bad[0]) + 1} has {name} = {int(r[bad[0], col])}, outside {lo}..{hi}")
    nonzero = r[:, 3] > 0
    dropped_zero = int((~nonzero).sum())
    r = r[nonzero]
    _, first = np.unique(r[:, [0, 1, 2]], axis=0, return_index=True)
    first = np.sort(first)
    dropped_dup = len(r) - len(first)
    r = r[first]
    return Ratings(r[:, 0] - 1, r[:, 1], r[:, 2], r[:, 3].astype(np.float32), dropped_zero, dropped_dup)


@lru_cache(maxsize=2)
def _load(path: str, mtime_ns: int, size: int) -> Ratings:
    return read_ratings(Path(path))


def client_graph_collate(user_ids: np.ndarray, num_items: int, users: np.ndarray, items: np.ndarray,
                         ratings: np.ndarray) -> Any:
    """``collate(pairs)`` for one client: its training graph plus the batch's (user, item-node) pairs.

    ``user_ids`` are the sorted global (0-based) ids of the client's users — every user of its
    train and test pairs; ``users`` (global ids), ``items`` (local item ids in
    ``0..num_items-1``, covering the client's train and test items) and ``ratings`` are the
    client's training edges. The graph's nodes are the client's users (local ids
    ``0..len(user_ids)-1``, in ``user_ids`` order) and items (``len(user_ids)..``): a user who
    rated nothing in this client's categories has no edge, so leaving it out changes no
    prediction and no gradient, only the cost (a GCN over all 7,375 users for a category with a
    few hundred of them). Item features: (mean training rating − 4, log(1 + degree)); items
    without training ratings get the client's mean rating. The graph is stored normalised with
    self loops (``gcn_norm_edges``), once per client. ``pairs`` given to ``collate`` hold
    global user ids and local item ids. Returns a PyG ``Data`` (moves with ``.to``) whose
    ``user_ids`` select the rows of the shared user table.
    """
    import torch
    from torch_geometric.data import Data

    user_ids = np.asarray(user_ids, np.int64)
    num_users = len(user_ids)
    deg = np.bincount(items, minlength=num_items).astype(np.float32)
    sums = np.bincount(items, weights=ratings, minlength=num_items).astype(np.float32)
    fill = float(ratings.mean()) if len(ratings) else 4.0
    mean = np.where(deg > 0, sums / np.maximum(deg, 1), fill).astype(np.float32)
    item_feat = torch.as_tensor(np.stack([mean - 4.0, np.log1p(deg)], axis=1))
    u = torch.as_tensor(_local_users(user_ids, users), dtype=torch.long)
    v = torch.as_tensor(items, dtype=torch.long) + num_users
    from graphfl.tasks.gnn_models import gcn_norm_edges

    num_nodes = num_users + num_items
    edge_index, edge_weight = gcn_norm_edges(torch.stack([torch.cat([u, v]), torch.cat([v, u])]), num_nodes)
    user_index = torch.as_tensor(user_ids)

    def collate(pairs: np.ndarray) -> Any:
        p = np.asarray(pairs, np.int64)
        local = np.stack([_local_users(user_ids, p[:, 0]), p[:, 1] + num_users], axis=1)
        return Data(edge_index=edge_index, edge_weight=edge_weight, item_feat=item_feat, user_ids=user_index,
                    pairs=torch.as_tensor(local), num_nodes=num_nodes)

    return collate


def _local_users(user_ids: np.ndarray, users: np.ndarray) -> np.ndarray:
    """Positions of the global ids ``users`` in the sorted ``user_ids``; an id not there is a ValueError."""
    pos = np.searchsorted(user_ids, users)
    ok = (pos < len(user_ids)) & (user_ids[np.minimum(pos, len(user_ids) - 1)] == users)
    if not ok.all():
        raise ValueError(f"user id {int(np.asarray(users)[~ok][0])} is not one of this client's users")
    return pos


class Ciao(Task):
    """Ciao ratings (284,086 rows, 28 categories): one client per category, GCN recommender, MAE.

    Keyword options (Python API): ``hidden`` (32), ``layers`` (2).
    """

    spec = TaskSpec("ciao", "regression", default_nodes=NUM_CATEGORIES, needs_data_dir=True,
                    summary="Ciao ratings (rating.mat), one client per item category, GCN on user-item graph, MAE")

    def __init__(self, *args: Any, hidden: int = 32, layers: int = 2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hidden, self.layers = int(hidden), int(layers)

    def mat_path(self) -> Path:
        from graphfl.tasks.labeled import default_data_dir

        root = Path(self.data_dir) if self.data_dir else default_data_dir()
        return root / "ciao" / "rating.mat"

    def ratings(self) -> Ratings:
        """The cleaned ratings (cached per process until the file changes)."""
        path = self.mat_path()
        if not path.is_file():
            read_ratings(path)  # raises the DataError naming the file
        st = path.stat()
        return _load(str(path), st.st_mtime_ns, st.st_size)

    def _kept(self) -> np.ndarray:
        n = len(self.ratings().rating)
        if self.data.max_samples and self.data.max_samples < n:
            return np.sort(client_rng(self.seed, 1).choice(n, self.data.max_samples, replace=False))
        return np.arange(n)

    def client_data(self, partition_id: int, num_partitions: int) -> ClientData:
        self.check_num_partitions(num_partitions)
        if num_partitions > NUM_CATEGORIES:
            raise DataError(f"task ciao has {NUM_CATEGORIES} item categories, so at most {NUM_CATEGORIES} clients; "
                            f"got nodes = {num_partitions}")
        if not 0 <= partition_id < num_partitions:
            raise ValueError(f"partition id {partition_id} outside 0..{num_partitions - 1}")
        r = self.ratings()
        keep = self._kept()
        mine = keep[(r.category[keep] - 1) % num_partitions == partition_id]
        if len(mine) == 0:
            raise DataError(f"task ciao: client {partition_id} of {num_partitions} has no ratings "
                            f"(data.max-samples = {self.data.max_samples} is too small)")
        _, local_item = np.unique(r.item[mine], return_inverse=True)
        tr, te = train_test_split(np.arange(len(mine)), self.data.test_fraction, client_rng(self.seed, 2, partition_id))
        pairs = np.stack([r.user[mine], local_item.astype(np.int64)], axis=1)
        y = r.rating[mine]
        return self.holdout_view(ClientData(pairs[tr], y[tr], pairs[te], y[te]))

    def holdout_view(self, data: ClientData) -> ClientData:
        """``data`` with its graph built from ``data.x_train`` only (its users: those of train and test)."""
        both = np.concatenate([data.x_train, data.x_test])
        collate = client_graph_collate(np.unique(both[:, 0]), int(both[:, 1].max()) + 1, data.x_train[:, 0],
                                       data.x_train[:, 1], data.y_train)
        return ClientData(data.x_train, data.y_train, data.x_test, data.y_test, collate=collate)

    def build_model(self) -> Any:
        from graphfl.tasks.gnn_models import BipartiteGCN
        from graphfl.tasks.models import seeded

        return seeded(self.seed, BipartiteGCN, NUM_USERS, self.hidden, self.layers)

    def metrics(self, outputs: np.ndarray, targets: np.ndarray) -> dict[str, float]:
        t = np.asarray(targets, np.float64).reshape(-1)
        if len(t) == 0:
            return {"test_mae": float("nan")}
        return {"test_mae": float(np.mean(np.abs(np.asarray(outputs, np.float64).reshape(-1) - t)))}

    def describe(self) -> dict[str, Any]:
        r = self.ratings()
        keep = self._kept()
        return {"name": self.name, "file": str(self.mat_path()), "ratings": int(len(r.rating)),
                "used": int(len(keep)), "dropped_zero_ratings": r.dropped_zero,
                "dropped_duplicate_pairs": r.dropped_duplicate, "users": NUM_USERS,
                "items": int(len(np.unique(r.item[keep]))), "model": f"gcn-{self.layers}x{self.hidden}"}
