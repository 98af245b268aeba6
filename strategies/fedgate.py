"""FedGATE: local SGD with gradient tracking (ALGORITHMS.md §9.2; Haddadpour et al. 2021).

Server half, shared by ``apfl``, ``fedgate`` and ``apflgate`` (they differ on the client).
Round ``t`` (§9.2, §9.3)::

    client i ∈ S:  w_i ← w;  τ_loc steps  w_i ← w_i − η (∇f_i(w_i; ξ) − δ_i);  upload w_i
    server:        u_i = w − w_i;  ū = (1/|S|) Σ_{i∈S} u_i;  w ← w − γ ū;  broadcast ū and w
    client i ∈ S:  δ_i ← δ_i + (u_i − ū) / (η τ)          (on receipt of ū, next round)

``τ`` defaults to the local steps ``R`` the client ran (FedTorch divides by them); a configured
``τ`` must exceed ``R/2``, below which the δ recursion is unstable by construction
(:mod:`graphfl.strategies.apfl_math`, ALGORITHMS.md §0.1 C5): :func:`check_tau` refuses such a
run before it starts, naming the key. ``tau-mode = multiple-of-steps`` reads ``tau`` as a
factor of ``R``.

Clients upload their model ``w_i`` and the server forms ``u_i = w − w_i`` (so the kernel's
upload compression, which codes the change against the payload, codes exactly ``−u_i``,
and ``Q`` acts on the update as in FedCOMGATE). The payload of round ``t+1`` holds ``w``
(model keys), ``ū`` of the last round that had updates (trainable keys under
:data:`U_PREFIX`), that round's number (:data:`ROUND_KEY`) and whether this client's update
was part of it (:data:`ACCEPTED_KEY`); a client applies the δ update only then, so a
rejected or missed upload leaves ``δ_i`` unchanged (§9.2 edge cases). A round without any
valid update changes nothing. Weights are uniform (``1/|S|``, FedTorch), which is what makes
``Σ_i δ_i = 0`` hold with full participation and no compression.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np

from graphfl.common.config import ConfigError, RunConfig
from graphfl.common.core import ServerContext, ServerCore
from graphfl.common.registry import AlgorithmSpec, register
from graphfl.common.types import Arrays, ClientUpdate, MetricValue, Payload
from graphfl.strategies.apfl_math import TAU_MODES, client_update, mean_update, server_step, tau_problem

logger = logging.getLogger(__name__)

U_PREFIX = "gate.u/"
"""Payload keys of the broadcast mean update ``ū`` (one per trainable parameter)."""
ROUND_KEY = "gate.round"
"""Payload config: the round whose ``ū`` the payload carries (0 = none yet)."""
ACCEPTED_KEY = "gate.accepted"
"""Payload config: whether this client's upload of that round is part of ``ū``."""


@dataclass(frozen=True)
class FedGATEParams:
    """FedGATE hyperparameters (§9.2; FedTorch defaults).

    Attributes
    ----------
    gamma
        Server step ``γ`` (FedTorch ``lr_scale_at_sync``, 1.0).
    tau
        ``τ`` of the δ update ``δ_i += (u_i − ū)/(η τ)``; 0 = the number of local steps ``R``
        the client ran (FedTorch), > 0 = seed 004's variance-reduction parameter, which must give
        ``τ > R/2`` (:func:`check_tau`).
    tau_mode
        ``absolute``: ``τ = tau``; ``multiple-of-steps``: ``τ = tau · R``.
    """

    gamma: float = field(default=1.0, metadata={"min": 0.0})
    tau: float = field(default=0.0, metadata={"min": 0.0})
    tau_mode: str = field(default="absolute", metadata={"choices": TAU_MODES})


class GateParams(Protocol):
    """What the shared server reads of APFL's / FedGATE's / APFLGate's hyperparameters."""

    @property
    def gamma(self) -> float: ...


G = TypeVar("G", bound=GateParams)


def check_tau(cfg: RunConfig, initial_arrays: Arrays, param_keys: tuple[str, ...]) -> None:
    """Preflight of ``fedgate`` / ``apflgate``: refuse ``τ ≤ R/2`` with ``R = train.local-steps``.

    Raises :class:`~graphfl.common.config.ConfigError` naming ``<strategy>.tau``, its value, the
    mode, ``R`` and the bound (:func:`~graphfl.strategies.apfl_math.tau_problem`).
    """
    p = cfg.params
    problem = tau_problem(f"{cfg.strategy}.tau", float(p.tau), str(p.tau_mode), cfg.train.local_steps)
    if problem:
        raise ConfigError(problem)


class GateCore(ServerCore[G]):
    """Server of the gate family: ``w ← w − γ ū`` and the broadcast of ``ū`` (module doc).

    ``tracking = False`` (APFL) broadcasts ``w`` only.
    """

    tracking: bool = True

    def __init__(self, ctx: ServerContext[G]) -> None:
        super().__init__(ctx)
        self.w: Arrays = dict(ctx.initial_arrays)
        self.param_keys = tuple(ctx.param_keys) or tuple(self.w)
        self.u_bar: Arrays | None = None
        self.u_round = 0
        self.accepted: frozenset[int] = frozenset()
        self._rebuild()

    def _rebuild(self) -> None:
        arrays = dict(self.w)
        if self.tracking and self.u_bar is not None:
            for k in self.param_keys:
                arrays[U_PREFIX + k] = self.u_bar[k].astype(np.asarray(self.w[k]).dtype)
        self._arrays = arrays
        self._payloads = {
            ok: Payload(arrays, {ROUND_KEY: self.u_round, ACCEPTED_KEY: ok} if self.tracking else {})
            for ok in (False, True)
        }

    def configure_train(self, server_round: int, partition_id: int) -> Payload:
        return self._payloads[partition_id in self.accepted]

    def evaluation_payload(self, partition_id: int) -> Payload:
        return self._payloads[partition_id in self.accepted]

    def aggregate_train(self, server_round: int, updates: Mapping[int, ClientUpdate]) -> dict[str, MetricValue]:
        if not updates:
            logger.warning("round %d: no valid client update; w and ū are unchanged", server_round)
            return {"clients_aggregated": 0}
        pids = sorted(updates)
        u = [client_update(self.w, updates[p].arrays) for p in pids]
        u_bar = mean_update(u)
        self.w = server_step(self.w, u_bar, self.params.gamma)
        self.u_bar = u_bar
        self.u_round = server_round
        self.accepted = frozenset(pids)
        self._rebuild()
        norm = float(np.sqrt(sum(float(np.sum(u_bar[k] ** 2)) for k in self.param_keys)))
        return {"clients_aggregated": len(pids), "update_norm": norm}

    def final_arrays(self) -> Arrays:
        return self.w


register(AlgorithmSpec(
    "fedgate", FedGATEParams, GateCore[FedGATEParams],
    "FedGATE: local SGD with gradient-tracking correction delta_i, server step gamma (uploads compressible)",
    preflight=check_tau,
))
