"""JGESR: joint graph estimation and signal restoration (ALGORITHMS.md §8; seed 002).

Each round, after the clients' (possibly noisy, partly missing) uploads ``y_k = m_k ⊙ θ_k + n_k``
(:mod:`graphfl.client.noisy_channel`), the server solves (§8.3 with the graph scale of §0.1 C4,
scaled as §8.4)::

    min_{Ψ, w ∈ C}  Σ_k p_k ‖m_k ⊙ (ψ_k − y_k)‖² + λ tr(Ψᵀ L(W) Ψ) − α 1ᵀ log(W 1) + β ‖w‖²
    C = {w >= 0, Σ_{i<j} w_ij = n}

by PDCA (§8.5, ``jgesr.solver = "pdca"``) or the alternating Two-step (§8.6, ``"two-step"``)
— the pure solvers :func:`~graphfl.strategies.jgesr_math.solve_pdca` /
:func:`~graphfl.strategies.jgesr_math.solve_two_step` — and sends **each client its own
restored model** ``ψ_k`` (one payload per client).

* ``p_k`` ∝ the client's training samples; ``m_k`` is the mask that travelled with the upload
  (``use_mask``); a reply without a mask is fully observed.
* Initial graph: cosine similarity of the uploads (§8.5) in the first solve and whenever the
  set of clients with an upload changed; otherwise **warm start** (``warm_start``) from the
  previous round's ``W`` and ``Ψ`` (the previous ``ψ_k`` also fills ``y_k``'s missing entries).
* A client that did not reply keeps its previous upload (and mask); a client that never
  uploaded receives the sample-weighted mean of the restored models (no graph row yet);
  before any upload everyone receives the initial model. A round with no valid update
  changes nothing.
* Only trainable parameters enter Ψ; buffers are averaged (FedAvg) over the round's uploads.
* Logged per round (run.json ``server``): the learned graph ``W`` (``graph``, ``n x n``
  rows, clients without an upload as zero rows; dimensionless, of the scaled problem),
  objective, iterations, convergence, MM steps, scale, the missing fraction and solve time, and
  the two collapse diagnostics of §0.1 C4 (drawn in run.png): ``shrink_ratio`` =
  ``‖Ψ − ȳ‖/‖Y − ȳ‖`` (:func:`~graphfl.strategies.jgesr_math.shrink_ratio`; 0 = every client
  gets the mean, i.e. FedAvg) and ``graph_cv`` = the coefficient of variation of the
  off-diagonal weights (0 = uniform graph). ``collapse`` is 1 in a round where
  ``shrink_ratio < SHRINK_COLLAPSE`` or ``graph_cv < CV_COLLAPSE`` for ``CV_COLLAPSE_ROUNDS``
  rounds in a row; such a round also logs a warning naming the metric (JGESR then behaves
  like FedAvg: tune λ, α, β).

The local update is plain SGD from ``ψ_k`` (``train.*``), as FedAvg's (client half in
:mod:`graphfl.client.graph_trainers`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from graphfl.common.core import ServerContext
from graphfl.common.registry import AlgorithmSpec, register
from graphfl.common.types import ClientUpdate, MetricValue
from graphfl.strategies import jgesr_math as jm
from graphfl.strategies.model_table import PersonalModelsCore

logger = logging.getLogger(__name__)

SOLVERS = ("pdca", "two-step")
WORK_DTYPES = ("auto", "float32", "float64")
SHRINK_COLLAPSE = 0.2
"""A round whose ``shrink_ratio`` is below this has (nearly) collapsed to the mean (FedAvg)."""
CV_COLLAPSE = 0.05
"""A ``graph_cv`` below this is a (nearly) uniform graph ..."""
CV_COLLAPSE_ROUNDS = 3
"""... and that many rounds in a row of it count as a collapse."""


@dataclass(frozen=True)
class JGESRConfig:
    """JGESR hyperparameters (``[jgesr]``; solver settings as :class:`jgesr_math.JGESRParams`).

    Attributes
    ----------
    solver
        ``pdca`` (§8.5) or ``two-step`` (§8.6).
    lam, alpha, beta
        ``λ`` smoothness, ``α`` log-degree barrier, ``β`` edge ridge (scaled problem, mean-1 weights).
    max_outer, max_inner, tol
        Outer iterations, inner projected-gradient steps, relative stopping tolerance (``jgesr_math``
        docstring items 6–7; the tolerance is the documented early stop).
    max_impute, impute_tol
        Majorisation–minimisation steps for missing entries and their stopping tolerance (item 4).
    work_dtype
        dtype of the ``n x d`` work arrays (``auto``: float32 above 4M entries).
    warm_start
        Start each round's solve at the previous ``W`` and ``Ψ`` when the same clients are in it.
    use_mask
        Use the channel's mask (else every received entry, ``0 + noise`` included, is data).
    log_graph
        Write the learned ``W`` into the per-round server metrics.
    fixed_scale
        The graph scale constraint ``Σ_{i<j} w_ij = n`` (§0.1 C4). ``false`` is §8.3's free
        scale, whose minimum is consensus (kept only to show that defect).
    """

    solver: str = field(default="pdca", metadata={"choices": SOLVERS})
    lam: float = field(default=1.0, metadata={"min": 0.0})
    alpha: float = field(default=1.0, metadata={"min": 1e-12})
    beta: float = field(default=0.1, metadata={"min": 1e-12})
    max_outer: int = field(default=1000, metadata={"min": 1})
    max_inner: int = field(default=1, metadata={"min": 1})
    tol: float = field(default=1e-4, metadata={"min": 1e-15})
    max_impute: int = field(default=10, metadata={"min": 1})
    impute_tol: float = field(default=1e-4, metadata={"min": 1e-15})
    work_dtype: str = field(default="auto", metadata={"choices": WORK_DTYPES})
    warm_start: bool = True
    use_mask: bool = True
    log_graph: bool = True
    fixed_scale: bool = True

    def solver_params(self) -> jm.JGESRParams:
        """The pure solver's parameters."""
        return jm.JGESRParams(lam=self.lam, alpha=self.alpha, beta=self.beta, max_outer=self.max_outer,
                              max_inner=self.max_inner, tol=self.tol, max_impute=self.max_impute,
                              impute_tol=self.impute_tol, work_dtype=self.work_dtype,  # type: ignore[arg-type]
                              fixed_scale=self.fixed_scale)


class JGESRCore(PersonalModelsCore[JGESRConfig]):
    """Server half of JGESR: restores every client's model on a learned graph (module docstring)."""

    def __init__(self, ctx: ServerContext[JGESRConfig]) -> None:
        super().__init__(ctx)
        for pid, count in ctx.num_examples.items():
            if 0 <= int(pid) < self.table.n:
                self.table.weights[int(pid)] = max(float(count), 1.0)
        self.solve = jm.solve_pdca if self.params.solver == "pdca" else jm.solve_two_step
        self.solver_params = self.params.solver_params()
        self.psi: np.ndarray | None = None        # restored rows of the clients in `solved`
        self.graph: np.ndarray | None = None      # their learned W
        self.solved = np.zeros(0, dtype=np.int64)  # ids in the last solve
        self.uniform_rounds = 0                    # rounds in a row with graph_cv < CV_COLLAPSE

    # -- protocol --------------------------------------------------------------------

    def aggregate_train(self, server_round: int, updates: Mapping[int, ClientUpdate]) -> dict[str, MetricValue]:
        accepted = self.table.ingest(updates)
        metrics: dict[str, MetricValue] = {"clients_aggregated": len(accepted)}
        if not accepted:
            logger.warning("JGESR round %d: no valid update; the restored models are unchanged", server_round)
            return metrics
        idx = self.table.present()
        y = self.table.rows[idx]
        mask = None
        if self.params.use_mask and self.table.observed is not None:
            mask = self.table.observed[idx]
        warm = self.params.warm_start and self.psi is not None and np.array_equal(idx, self.solved)
        t0 = time.perf_counter()
        result = self.solve(y, mask, self.table.weights[idx], self.solver_params,
                            graph_init=self.graph if warm else None, psi_init=self.psi if warm else None)
        seconds = time.perf_counter() - t0
        self.psi = np.asarray(result.psi, dtype=np.float32)
        self.graph = np.asarray(result.graph, dtype=np.float64)
        self.solved = idx
        self._rebuild(idx)
        metrics.update(
            objective=float(result.objective[-1]), iterations=int(result.iterations),
            converged=int(result.converged), impute_steps=int(result.impute_steps), scale=float(result.scale),
            warm_start=int(warm), solve_seconds=seconds,
            missing_fraction=0.0 if mask is None else float(1.0 - mask.mean()),
            shrink_ratio=float(result.shrink_ratio), graph_cv=float(result.graph_cv),
            collapse=int(self._collapse(server_round, float(result.shrink_ratio), float(result.graph_cv), idx.size)),
        )
        if self.params.log_graph:
            metrics["graph"] = self.full_graph().round(6).tolist()
        logger.info("JGESR round %d (%s): %d clients, %d iterations, F=%.6g, shrink_ratio %.3f, graph_cv %.3f, "
                    "%.3f s%s", server_round, self.params.solver, idx.size, result.iterations, result.objective[-1],
                    result.shrink_ratio, result.graph_cv, seconds, " (warm)" if warm else "")
        return metrics

    # -- helpers ---------------------------------------------------------------------

    def _collapse(self, server_round: int, shrink: float, cv: float, n: int) -> bool:
        """Collapse diagnostic of §0.1 C4 (module docstring); warns when it fires."""
        if n < 3:  # one weight (or none): a CV says nothing
            self.uniform_rounds = 0
            return False
        self.uniform_rounds = self.uniform_rounds + 1 if cv < CV_COLLAPSE else 0
        reasons = []
        if shrink < SHRINK_COLLAPSE:
            reasons.append(f"shrink_ratio {shrink:.3f} < {SHRINK_COLLAPSE} (every client gets nearly the mean)")
        if self.uniform_rounds >= CV_COLLAPSE_ROUNDS:
            reasons.append(f"graph_cv {cv:.3f} < {CV_COLLAPSE} for {self.uniform_rounds} rounds (uniform graph)")
        if reasons:
            logger.warning("JGESR round %d collapsed to FedAvg: %s; tune jgesr.lam, jgesr.alpha, jgesr.beta",
                           server_round, "; ".join(reasons))
        return bool(reasons)

    def full_graph(self) -> np.ndarray:
        """The learned ``W`` as an ``n x n`` matrix (zeros for clients not in the last solve)."""
        out = np.zeros((self.table.n, self.table.n))
        if self.graph is not None:
            out[np.ix_(self.solved, self.solved)] = self.graph
        return out

    def _rebuild(self, idx: np.ndarray) -> None:
        assert self.psi is not None
        self.payloads.update(self.psi, idx)


register(AlgorithmSpec(
    "jgesr", JGESRConfig, JGESRCore,
    "JGESR: joint graph learning + restoration of noisy/missing uploads (PDCA or two-step); a model per client",
))
