"""FeSEM: federated stochastic EM for multi-center FL (ALGORITHMS.md §4; seed 000 §10.3).

Problem (seed 000, eq. 10.7)::

    min_{θ_i, θ̄_k, r_ik} (1/n) Σ_i E F_i(θ_i; ξ) + (λ/n) Σ_k Σ_i r_ik ‖θ_i − θ̄_k‖²

Round (seed 000, Algorithms 2 and 3), on the server, after the clients' uploads ``θ_i``:

* E-step (eq. 10.8): ``d_ik = ‖θ_i − θ̄_k‖²`` (on all parameters, or on the layers named in
  ``dist_layers``); ``r_i = argmin_k d_ik``, ties → the smallest ``k``.
* M-step (eq. 10.9): ``θ̄_k = mean_{i: r_i = k} θ_i`` (sample-weighted with
  ``weighted_mstep``); an empty cluster keeps its previous center (``empty_cluster = "keep"``)
  or is re-seeded with the client farthest from its own center (``"reseed"``).
* Broadcast: client i receives ``θ̄_{r_i}`` and runs ``train.local-steps`` SGD steps on
  ``F_i(θ) + λ ‖θ − θ̄_{r_i}‖²`` (eq. 10.10; ``prox_lambda = λ``, gradient ``2λ(θ − θ̄)``).

Initialisation (§4.4): a common initial model would put every client at the same distance
from every center, so round 1 is a *warm-up*: every client trains ``warmup_steps`` local steps
from the common initial model and uploads; the server then seeds ``K`` centers from these
warmed-up models (k-means++ by default), runs ``init_iters`` Lloyd iterations, and keeps the
best of ``init_restarts`` such seedings (smallest within-cluster sum of squares). A client
whose warm-up upload is missing gets the warm-up payload again until it has uploaded once.

Clients that did not reply in a round keep their last upload in the E- and M-steps; uploads
with NaN/Inf or wrong shapes are excluded (logged). All center statistics are over the full
``state_dict`` (parameters and buffers); distances only over trainable parameters.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from graphfl.common.arrays import flatten_params, select_keys, unflatten_params
from graphfl.common.core import ServerContext, ServerCore
from graphfl.common.registry import AlgorithmSpec, register
from graphfl.common.types import Arrays, ClientUpdate, MetricValue, Payload

logger = logging.getLogger(__name__)

CENTER_INITS = ("kmeans++", "random-clients")
EMPTY_POLICIES = ("keep", "reseed")
WARMUP_KEY = "fesem.warmup"
STEPS_KEY = "fesem.steps"
CLUSTER_KEY = "fesem.cluster"


@dataclass(frozen=True)
class FeSEMParams:
    """FeSEM hyperparameters (ALGORITHMS.md §4.2; local SGD settings come from ``[train]``).

    Attributes
    ----------
    k
        Number of centers ``K`` (3 in the seed's synthetic run).
    dist_layers
        Comma-separated parameter keys (or key prefixes such as ``net.4``) used for the E-step
        distance; empty = all trainable parameters (the FeSEM default, squared L2).
    prox_lambda
        ``λ`` of eq. 10.10: local loss ``F_i(θ) + λ‖θ − θ̄_{r_i}‖²``. 0 = plain local SGD from
        the center (the authors' code).
    recluster_every
        Rounds between E-steps after initialisation (1 = every round, seed Alg. 2; the
        authors' fork uses 10). In other rounds only the M-step runs.
    weighted_mstep
        Weight the M-step mean by client sample counts (authors' fork) instead of eq. 10.9's
        plain mean.
    warmup_steps
        Local steps of the warm-up round before the first E-step; 0 = ``train.local-steps``.
    center_init
        ``kmeans++`` (D²-sampling on the warmed-up client models; reconstructed) or
        ``random-clients`` (K distinct random clients' models).
    init_iters
        Lloyd (E+M) iterations on the warmed-up models when the centers are first formed
        (the authors' fork runs 5); at least one is always run.
    init_restarts
        Independent seedings of that initial clustering; the one with the smallest
        within-cluster sum of squares is kept (standard k-means practice; reconstructed).
    empty_cluster
        ``keep`` the previous center of an empty cluster (spec default) or ``reseed`` it with
        the client farthest from its own center.
    """

    k: int = field(default=3, metadata={"min": 1})
    dist_layers: str = ""
    prox_lambda: float = field(default=0.0, metadata={"min": 0.0})
    recluster_every: int = field(default=1, metadata={"min": 1})
    weighted_mstep: bool = False
    warmup_steps: int = field(default=0, metadata={"min": 0})
    center_init: str = field(default="kmeans++", metadata={"choices": CENTER_INITS})
    init_iters: int = field(default=5, metadata={"min": 0})
    init_restarts: int = field(default=10, metadata={"min": 1})
    empty_cluster: str = field(default="keep", metadata={"choices": EMPTY_POLICIES})


# ---------------------------------------------------------------------------------------
# pure math
# ---------------------------------------------------------------------------------------



def squared_distances(points: np.ndarray, centers: np.ndarray) -> np.ndarray:
    """``D_ik = ‖x_i − c_k‖²`` (n×K), computed by differences (exact ties stay ties)."""
    points = np.asarray(points, dtype=np.float64)
    centers = np.asarray(centers, dtype=np.float64)
    out = np.empty((points.shape[0], centers.shape[0]))
    for k in range(centers.shape[0]):
        diff = points - centers[k]
        out[:, k] = np.einsum("ij,ij->i", diff, diff)
    return out


def e_step(dist: np.ndarray) -> np.ndarray:
    """Assignment ``r_i = argmin_k d_ik`` (eq. 10.8); ties go to the smallest ``k``."""
    assign: np.ndarray = np.argmin(np.asarray(dist), axis=1).astype(np.int64)
    return assign


def m_step(
    points: np.ndarray,
    assign: np.ndarray,
    prev_centers: np.ndarray,
    weights: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Centers ``θ̄_k = Σ_{i∈C_k} w_i θ_i / Σ_{i∈C_k} w_i`` (eq. 10.9 with ``w = 1``).

    Rows of ``points`` with ``assign < 0`` are ignored. An empty cluster keeps its row of
    ``prev_centers``. Returns ``(centers, sizes)``.
    """
    k_num = prev_centers.shape[0]
    centers = np.array(prev_centers, dtype=np.float64, copy=True)
    sizes = np.zeros(k_num, dtype=np.int64)
    w_all = np.ones(len(points)) if weights is None else np.asarray(weights, dtype=np.float64)
    for k in range(k_num):
        members = np.flatnonzero(assign == k)
        sizes[k] = members.size
        if members.size == 0:
            continue
        w = w_all[members]
        if w.sum() <= 0:
            w = np.ones_like(w)
        centers[k] = (w[:, None] * points[members]).sum(0) / w.sum()
    return centers, sizes


def kmeanspp_seeds(points: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of ``k`` seeds by k-means++ D²-sampling (Arthur & Vassilvitskii 2007).

    If fewer than ``k`` distinct points exist, the remaining seeds repeat points (their
    clusters then stay empty because ties go to the smaller index).
    """
    n = points.shape[0]
    idx = [int(rng.integers(n))]
    d2 = squared_distances(points, points[idx[0]][None])[:, 0]
    for _ in range(1, k):
        total = d2.sum()
        if total <= 0:
            j = int(rng.integers(n))
        else:
            j = int(rng.choice(n, p=d2 / total))
        idx.append(j)
        d2 = np.minimum(d2, squared_distances(points, points[j][None])[:, 0])
    return np.asarray(idx, dtype=np.int64)


def reseed_empty(
    points: np.ndarray, assign: np.ndarray, dist: np.ndarray, centers: np.ndarray
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Re-seed empty clusters with the client farthest from its own center (§4.8).

    Only clients in clusters with more than one member are moved. Returns the new
    ``(assign, centers, moved_clients)``.
    """
    assign = assign.copy()
    centers = centers.copy()
    moved: list[int] = []
    k_num = centers.shape[0]
    for k in range(k_num):
        if np.any(assign == k):
            continue
        sizes = np.bincount(assign[assign >= 0], minlength=k_num)
        cand = np.flatnonzero((assign >= 0) & (sizes[np.maximum(assign, 0)] > 1))
        if cand.size == 0:
            break
        own = dist[cand, assign[cand]]
        i = int(cand[np.argmax(own)])
        assign[i] = k
        centers[k] = points[i]
        moved.append(i)
    return assign, centers, moved


def adjusted_rand(labels_true: np.ndarray, labels_pred: np.ndarray) -> float:
    """Adjusted Rand index (sklearn) between true and found clusters."""
    from sklearn.metrics import adjusted_rand_score

    return float(adjusted_rand_score(labels_true, labels_pred))


# ---------------------------------------------------------------------------------------
# server core
# ---------------------------------------------------------------------------------------


class FeSEMCore(ServerCore[FeSEMParams]):
    """Server half of FeSEM: K centers, E/M-steps, one center per client (see module doc).

    One phase per round (the default plan): ``configure_train`` hands out the centers (the
    warm-up payload before the client has a cluster), ``aggregate_train`` runs the E/M-steps.
    """

    def __init__(self, ctx: ServerContext[FeSEMParams]) -> None:
        super().__init__(ctx)
        p = self.params
        self.n = int(ctx.num_clients)
        self.template: Arrays = dict(ctx.initial_arrays)
        self.keys = tuple(self.template)  # full state_dict order
        self.param_keys = tuple(ctx.param_keys) or self.keys
        dist_keys = select_keys(self.param_keys, p.dist_layers)
        offsets: dict[str, tuple[int, int]] = {}
        pos = 0
        for key in self.keys:
            size = int(np.asarray(self.template[key]).size)
            offsets[key] = (pos, pos + size)
            pos += size
        self.dim = pos
        self.dist_idx = np.concatenate(
            [np.arange(*offsets[k]) for k in dist_keys] or [np.zeros(0, dtype=np.int64)]
        )
        if p.k > self.n:
            logger.warning("FeSEM: K=%d centers for only %d clients; %d cluster(s) will stay empty",
                           p.k, self.n, p.k - self.n)
        self.models = np.zeros((self.n, self.dim))
        self.have = np.zeros(self.n, dtype=bool)
        self.weights = np.ones(self.n)
        for pid, count in ctx.num_examples.items():
            if 0 <= int(pid) < self.n:
                self.weights[int(pid)] = max(float(count), 0.0)
        self.assign = np.full(self.n, -1, dtype=np.int64)
        self.centers: np.ndarray | None = None
        self.rounds_since_init = 0
        self.rng = np.random.default_rng([int(ctx.seed), 4, 1])
        self.labels: np.ndarray | None = None
        if ctx.cluster_labels is not None:
            labels = np.asarray(ctx.cluster_labels)
            if labels.shape != (self.n,):
                logger.warning("FeSEM: cluster_labels has shape %s, expected (%d,); ARI disabled",
                               labels.shape, self.n)
            else:
                self.labels = labels
        steps = p.warmup_steps or ctx.config.train.local_steps
        self._warmup = Payload(self.template, {WARMUP_KEY: True, STEPS_KEY: int(steps)})
        self._initial = Payload(self.template)
        self._center_payloads: list[Payload] = []

    # -- protocol --------------------------------------------------------------------

    def configure_train(self, server_round: int, partition_id: int) -> Payload:
        k = self._cluster_of(partition_id)
        if k < 0:
            return self._warmup
        return self._center_payloads[k]

    def evaluation_payload(self, partition_id: int) -> Payload:
        k = self._cluster_of(partition_id)
        return self._initial if k < 0 else self._center_payloads[k]

    def aggregate_train(
        self, server_round: int, updates: Mapping[int, ClientUpdate]
    ) -> dict[str, MetricValue]:
        accepted, excluded = self._ingest(server_round, updates)
        metrics: dict[str, MetricValue] = {
            "clients_aggregated": accepted, "clients_excluded": excluded,
        }
        if not self.have.any():
            logger.warning("FeSEM round %d: no client model yet; centers not formed", server_round)
            metrics.update(assignment=self.assign.tolist(), cluster_sizes=[0] * self.params.k)
            return metrics
        prev = self.assign.copy()
        pts = self.models
        if self.centers is None:
            self._initialise_centers()
            reclustered = True
        else:
            self.rounds_since_init += 1
            reclustered = self.rounds_since_init % self.params.recluster_every == 0
            todo = self.have if reclustered else (self.have & (self.assign < 0))
            if todo.any():
                dist = squared_distances(pts[todo][:, self.dist_idx], self.centers[:, self.dist_idx])
                self.assign[todo] = e_step(dist)
            self._mstep()
        self._rebuild_payloads()
        sizes = np.bincount(self.assign[self.assign >= 0], minlength=self.params.k)
        changed = int(np.sum((prev >= 0) & (prev != self.assign)))
        metrics.update(
            assignment=self.assign.tolist(),
            cluster_sizes=sizes.tolist(),
            reclustered=int(reclustered),
            num_changed=changed,
        )
        ari = self.ari()
        if ari is not None:
            metrics["ari"] = ari
        logger.info("FeSEM round %d: cluster sizes %s%s, %d changed", server_round, sizes.tolist(),
                    "" if ari is None else f", ARI {ari:.3f}", changed)
        return metrics

    # -- helpers ---------------------------------------------------------------------

    def ari(self) -> float | None:
        """ARI of the current assignment vs ``ctx.cluster_labels`` (assigned clients only)."""
        if self.labels is None:
            return None
        mask = self.assign >= 0
        if mask.sum() < 2:
            return None
        return adjusted_rand(self.labels[mask], self.assign[mask])

    def center_arrays(self, k: int) -> Arrays:
        assert self.centers is not None
        return unflatten_params(self.centers[k], self.template, self.keys)

    def _cluster_of(self, partition_id: int) -> int:
        if not 0 <= partition_id < self.n:
            raise ValueError(f"partition id {partition_id} outside 0..{self.n - 1}")
        if self.centers is None:
            return -1
        return int(self.assign[partition_id])

    def _ingest(self, server_round: int, updates: Mapping[int, ClientUpdate]) -> tuple[int, int]:
        accepted = excluded = 0
        for pid, up in updates.items():
            reason = None
            if not 0 <= int(pid) < self.n:
                reason = f"partition id {pid} outside 0..{self.n - 1}"
            else:
                missing = [k for k in self.keys if k not in up.arrays]
                bad = [k for k in self.keys if k in up.arrays
                       and np.asarray(up.arrays[k]).shape != np.asarray(self.template[k]).shape]
                if missing or bad:
                    reason = f"missing arrays {missing} / wrong shapes {bad}"
            if reason is None:
                vec = flatten_params(up.arrays, self.keys)
                if not np.all(np.isfinite(vec)):
                    reason = "non-finite values (NaN/Inf)"
            if reason is not None:
                logger.warning("FeSEM round %d: excluding the update of client %s: %s",
                               server_round, pid, reason)
                excluded += 1
                continue
            self.models[pid] = vec
            self.have[pid] = True
            self.weights[pid] = max(float(up.num_examples), 0.0)
            accepted += 1
        return accepted, excluded

    def _initialise_centers(self) -> None:
        p = self.params
        idx = np.flatnonzero(self.have)
        pts = self.models[idx]
        sub = pts[:, self.dist_idx]
        weights = self.weights[idx] if p.weighted_mstep else None
        best: tuple[float, np.ndarray] | None = None
        for _ in range(p.init_restarts):
            if p.center_init == "kmeans++":
                seeds = kmeanspp_seeds(sub, p.k, self.rng)
            else:
                seeds = self.rng.choice(idx.size, size=p.k, replace=idx.size < p.k)
            centers = pts[seeds].copy()
            for _ in range(max(1, p.init_iters)):
                dist = squared_distances(sub, centers[:, self.dist_idx])
                assign = e_step(dist)
                centers, _ = m_step(pts, assign, centers, weights)
            dist = squared_distances(sub, centers[:, self.dist_idx])
            assign = e_step(dist)
            inertia = float(dist[np.arange(idx.size), assign].sum())
            if best is None or inertia < best[0]:
                best = (inertia, centers)
        assert best is not None
        self.centers = best[1]
        self.assign[idx] = e_step(squared_distances(sub, self.centers[:, self.dist_idx]))
        self._mstep()
        logger.info("FeSEM: centers formed from %d warmed-up clients (%s, %d restart(s) x %d Lloyd "
                    "iterations, inertia %.4g)", idx.size, p.center_init, p.init_restarts,
                    max(1, p.init_iters), best[0])

    def _mstep(self) -> None:
        assert self.centers is not None
        use = self.have & (self.assign >= 0)
        assign = np.where(use, self.assign, -1)
        if self.params.empty_cluster == "reseed":
            dist = squared_distances(self.models[:, self.dist_idx], self.centers[:, self.dist_idx])
            assign, self.centers, moved = reseed_empty(self.models, assign, dist, self.centers)
            if moved:
                logger.info("FeSEM: re-seeded empty cluster(s) with client(s) %s", moved)
                self.assign[use] = assign[use]
        weights = self.weights if self.params.weighted_mstep else None
        self.centers, sizes = m_step(self.models, assign, self.centers, weights)
        empty = np.flatnonzero(sizes == 0)
        if empty.size:
            logger.info("FeSEM: cluster(s) %s empty; keeping their previous centers", empty.tolist())

    def _rebuild_payloads(self) -> None:
        self._center_payloads = [
            Payload(self.center_arrays(k), {CLUSTER_KEY: k}) for k in range(self.params.k)
        ]


register(AlgorithmSpec(
    "fesem", FeSEMParams, FeSEMCore,
    "FeSEM: multi-center FL by federated stochastic EM (K centers, nearest-center assignment)",
))
