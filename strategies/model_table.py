"""The latest upload of every client as one row of an ``n x d`` matrix (shared by the graph cores).

JGESR, CFL, FedAMP and pFedGraph all aggregate on ``Θ ∈ R^{n x d}``, row ``i`` = client ``i``'s
trainable parameters flattened in registration order (ALGORITHMS.md §1.1). This table keeps

* ``rows`` (float32; the uploads are float32 and the cores accumulate in float64),
* ``observed``: which entries arrived (the noisy channel's mask, :class:`ClientUpdate.mask`;
  all ``True`` for an upload that came without one), only materialised once a mask is seen,
* ``have``: which clients have uploaded at least once, ``weights``: their sample counts,
* ``buffers``: the non-trainable arrays (e.g. BatchNorm statistics), averaged over the
  accepted uploads of the latest round with an update, sample-weighted (FedAvg); they never
  enter the graph math.

A client that does not reply keeps its previous row (stale upload), as FeSEM does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from graphfl.common.arrays import weighted_average
from graphfl.common.core import P, ServerContext, ServerCore
from graphfl.common.types import Arrays, ClientUpdate, Payload

logger = logging.getLogger(__name__)


class ModelTable:
    """Rows of the latest uploads, their masks, and the averaged buffers (module docstring)."""

    def __init__(self, template: Arrays, param_keys: Sequence[str], n: int) -> None:
        self.template: Arrays = dict(template)
        self.keys: tuple[str, ...] = tuple(k for k in param_keys if k in template) or tuple(template)
        self.buffer_keys: tuple[str, ...] = tuple(k for k in template if k not in self.keys)
        self.sizes = [int(np.asarray(template[k]).size) for k in self.keys]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.dim = int(self.offsets[-1])
        self.n = int(n)
        self.rows = np.zeros((self.n, self.dim), dtype=np.float32)
        self.observed: np.ndarray | None = None
        self.have = np.zeros(self.n, dtype=bool)
        self.weights = np.ones(self.n)
        self.buffers: Arrays = {k: template[k] for k in self.buffer_keys}

    def flatten(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        """θ of ``arrays`` over the trainable keys (float32)."""
        if not self.keys:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate([np.asarray(arrays[k], dtype=np.float32).ravel() for k in self.keys])

    def unflatten(self, theta: np.ndarray) -> Arrays:
        """Named arrays of ``θ`` (template dtypes) plus the current buffers, in template order."""
        out: Arrays = {}
        for j, k in enumerate(self.keys):
            ref = self.template[k]
            out[k] = np.asarray(theta[self.offsets[j]:self.offsets[j + 1]]).reshape(ref.shape).astype(ref.dtype)
        out.update(self.buffers)
        return {k: out[k] for k in self.template}

    def mask_of(self, update: ClientUpdate) -> np.ndarray | None:
        """The update's received-entry mask over θ (``None`` when everything arrived)."""
        if update.mask is None:
            return None
        parts = [np.asarray(update.mask[k], dtype=bool).ravel() if k in update.mask else np.ones(size, dtype=bool)
                 for k, size in zip(self.keys, self.sizes)]
        vec = np.concatenate(parts) if parts else np.zeros(0, dtype=bool)
        return None if vec.all() else vec

    def ingest(self, updates: Mapping[int, ClientUpdate]) -> list[int]:
        """Store the valid updates (already shape- and NaN-checked by the round loop); returns their ids."""
        accepted: list[int] = []
        for pid, up in sorted(updates.items()):
            if not 0 <= int(pid) < self.n:
                logger.warning("ignoring the update of partition id %s outside 0..%d", pid, self.n - 1)
                continue
            self.rows[pid] = self.flatten(up.arrays)
            mask = self.mask_of(up)
            if mask is not None and self.observed is None:
                self.observed = np.ones((self.n, self.dim), dtype=bool)
            if self.observed is not None:
                self.observed[pid] = True if mask is None else mask
            self.have[pid] = True
            self.weights[pid] = max(float(up.num_examples), 1.0)
            accepted.append(int(pid))
        if accepted and self.buffer_keys:
            self.buffers = weighted_average([{k: updates[p].arrays[k] for k in self.buffer_keys} for p in accepted],
                                            [self.weights[p] for p in accepted])
        return accepted

    def present(self) -> np.ndarray:
        """Ids of the clients with an upload, ascending."""
        idx: np.ndarray = np.flatnonzero(self.have)
        return idx

    def mean_row(self, rows: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """Sample-weighted mean of ``rows`` (one per id in ``idx``), float32: what a client without an
        upload of its own receives.
        """
        w = self.weights[idx] / self.weights[idx].sum()
        out: np.ndarray = (w @ np.asarray(rows, dtype=np.float64)).astype(np.float32)
        return out


class PersonalPayloads:
    """What each client receives from a core that aggregates one model per client.

    A client in the last aggregation gets its own row (plus any extra arrays); a client that was
    not in it (never uploaded, or joined late) gets the sample-weighted mean of those rows
    (:meth:`ModelTable.mean_row`); before any aggregation every client gets the initial model.
    Shared by the JGESR, FedAMP and pFedGraph cores.
    """

    def __init__(self, table: ModelTable, initial: Arrays) -> None:
        self.table = table
        self._by_client: dict[int, Payload] = {}
        self._fallback = Payload(dict(initial))

    def get(self, partition_id: int) -> Payload:
        """The payload of ``partition_id`` (a ``ValueError`` naming the range if it is outside)."""
        if not 0 <= partition_id < self.table.n:
            raise ValueError(f"partition id {partition_id} outside 0..{self.table.n - 1}")
        return self._by_client.get(partition_id, self._fallback)

    def update(self, rows: np.ndarray, idx: np.ndarray, extra: Callable[[int], Arrays] | None = None) -> None:
        """Client ``idx[j]`` gets ``rows[j]`` (and ``extra(j)``); the others the weighted mean of ``rows``."""
        self._by_client = {int(pid): Payload({**self.table.unflatten(rows[j]), **(extra(j) if extra else {})})
                           for j, pid in enumerate(idx)}
        self._fallback = Payload(self.table.unflatten(self.table.mean_row(rows, idx)))


class PersonalModelsCore(ServerCore[P]):
    """Base of the cores that keep every client's latest upload and send each client its own model.

    Holds the :class:`ModelTable` (``table``), the flattened initial model (``init``, float64: the
    reference the similarity-based cores measure updates from) and the :class:`PersonalPayloads`
    every training and evaluation message carries. Subclasses implement ``aggregate_train`` and
    call ``self.payloads.update(...)``.
    """

    def __init__(self, ctx: ServerContext[P]) -> None:
        super().__init__(ctx)
        self.table = ModelTable(ctx.initial_arrays, ctx.param_keys, ctx.num_clients)
        self.init = self.table.flatten(ctx.initial_arrays).astype(np.float64)
        self.payloads = PersonalPayloads(self.table, ctx.initial_arrays)

    def configure_train(self, server_round: int, partition_id: int) -> Payload:
        return self.payloads.get(partition_id)

    def evaluation_payload(self, partition_id: int) -> Payload:
        return self.payloads.get(partition_id)
