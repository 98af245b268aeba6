"""BiG-FL: bilevel-optimisation enhanced graph-aided FL (ALGORITHMS.md §5 with §0.1 C2; seed 000 §10.4).

The server holds the upper-level (UL) parameter ``φ ∈ R^{d×d}`` (initialised to ``I``), the
client graph's GCN propagation matrix ``Â`` and the latest client models ``Θ ∈ R^{n×d}``.
Round t (seed 000, Algorithm 4; math in :mod:`graphfl.strategies.bigfl_math`):

1. server → client i: its own model ``θ_i^t``, the message ``m_i = Σ_{j≠i} Â_ij θ_j φ``,
   ``φ`` and ``â_i = Â_ii``;
2. client i: ``train.local-steps`` SGD steps (eq. 10.19) on its LL loss (eq. 10.17)
   ``data_i(θ) + (λ/2)‖m_i + â_i θ φ − θ‖² + (κ/2)‖θ − c_i‖²`` with ``m_i, φ, c_i`` frozen; uploads
   ``θ_i^{t+1}`` (and, in ``implicit`` mode, its data-loss Hessian at ``θ_i^{t+1}``);
3. server: ``H = Â(Θ − 1θ̄ᵀ)φ`` (centred parameters); ``q`` fresh negatives per node;
   hypergradient ``ĝ`` (eq. 10.20; its implicit term ``J_Θᵀ v = ∇_Θ f`` solved by block-Jacobi
   preconditioned GMRES or a Neumann series to a residual tolerance, §5.4 and C2 d); normalised step
   ``φ ← φ − α ĝ/‖ĝ‖_F`` (C2 b); new messages.

One ``λ`` weighs both levels' regularisers, as in the paper (eqs. 10.14 and 10.17); ``λ = 0``
is refused: it removes φ from the lower level, so the run would be local training with
``κ``, not BiG-FL (C2 e). ``κ`` defaults to 0.3, chosen above the data Hessians' curvature
deficit on the synthetic MLP (C2 c; the deficit grows as the models train, so a κ tuned on a
short run must be checked against a long run's ``ll_min_curvature``); when the clients upload Hessians the server
reports ``ll_min_curvature = min_i λ_min(∇²data_i + λ B_i B_iᵀ) + κ`` (``B_i = â_i φ − I``, the
curvature of ``g_i`` in ``θ_i``) in round 1 and every ``curvature_every``
rounds, and warns when it is not positive (the LL is then not strongly convex and the
implicit term is not the derivative of a unique ``Θ*(φ)``). A round whose GMRES solve needs
the block-Jacobi preconditioner (:func:`graphfl.strategies.bigfl_math.hypergradient`) checks
it too, at no extra cost: the Cholesky factorisation of client i's block
``∇²data_i + κI + λ B_i B_iᵀ`` fails exactly when its LL is not strongly convex. Such a round
logs ``ll_strongly_convex`` (1/0) and ``ll_not_strongly_convex_clients``, and when a
factorisation failed it also computes (and logs) that round's ``ll_min_curvature``.

Ridge centre (``ridge``). The paper's ridge is ``(κ/2)‖θ_i‖²`` (``c_i = 0``, ``ridge =
"origin"``), there "for stabilizing the LL learning process" and for strong convexity (seed 000
l.205, l.245). Its minimiser moves with the scale of the data term: on the paper's data (X in
[−60, 60], targets of order 100) the squared-error term dwarfs ``κ‖θ‖²``, but on 1/60-scaled
inputs and targets the sigmoid MLP fits a linear map only with a large ``‖θ‖``, and every κ
from 0.01 up makes the zero model the LL minimiser, so the converged lower level is the zero
predictor whatever φ is. The default ``ridge = "proximal"`` centres the ridge on the model the
round starts from, ``c_i = θ_i^t``: each round's LL keeps the curvature ``κI`` (the same
``J_Θ``, so the hypergradient is unchanged), but a fixed point of the rounds
(``θ_i^{t+1} = θ_i^t``) is an equilibrium of ``data_i + (λ/2)R_i`` without the ridge's pull to
0 (a proximal-point iteration of the LL game). κ then bounds how far a round moves
(about ``‖∇data_i‖/κ``) instead of where the models end.

The data loss is the task's loss (mean over the batch, e.g. ``MSELoss``), so ``λ`` and ``κ``
are relative to it. Local steps, batch size and learning rate (the spec's ``τ, m, β``) come
from ``[train]`` like every other strategy.

Server metrics every round: ``phi_minus_identity`` (``‖φ − I‖_F``), ``hypergrad_norm``
(``‖ĝ‖_F`` before normalisation), ``phi_step`` (the step's length, ``α`` or 0),
``implicit_residual`` / ``implicit_iterations`` / ``implicit_converged`` of the linear solve, and
φ itself in a bounded size: ``phi_dim`` (``d``) and ``phi_edges``, the :data:`PHI_LOGGED_EDGES`
off-diagonal entries of largest ``|φ_ij|`` as ``[i, j, φ_ij]`` (:func:`phi_edges`; the dashboard
draws them as the learned graph over parameter indices).

Client graph: the task's (``ctx.client_graph``), else ``graph_file`` (an edge list ``i j
[w]`` keyed by partition id), else ``missing_graph`` decides (``complete`` with a warning by
default, ``isolated``, or ``error``). A graph of the wrong size is an error naming both sizes.
An isolated client has ``â_i = 1``, ``m_i = 0`` (its regulariser is ``‖θ_i(φ − I)‖²``) and
only negative pairs in the UL loss.

Large models (ALGORITHMS.md §5.7: ``φ`` is ``d×d``): ``layers`` restricts BiG-FL to the named
parameters (``θ`` = their concatenation); the remaining parameters are averaged as in FedAvg
(``others = "fedavg"``) or never leave the client (``others = "local"``). Messages per client
and round: down ``d² + 2d`` floats (``φ`` in ``phi_dtype``), up ``d`` floats plus ``d²`` for the
Hessian in ``implicit`` mode (skipped, i.e. ``reg_only``, when ``d > max_hessian_dim``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from graphfl.common.arrays import (
    flatten_params,
    select_keys,
    unflatten_params,
    validate_update,
    weighted_average,
)
from graphfl.common.config import ConfigError, RunConfig
from graphfl.common.core import ServerContext, ServerCore
from graphfl.common.graph import fallback_graph, gcn_propagation
from graphfl.common.registry import AlgorithmSpec, register
from graphfl.common.types import Arrays, ClientUpdate, MetricValue, Payload
from graphfl.strategies import bigfl_math as bm

logger = logging.getLogger(__name__)

M_KEY = "bigfl/m"
PHI_KEY = "bigfl/phi"
HESS_KEY = "bigfl/hessian"
A_II_KEY = "bigfl.a-ii"
WANT_HESS_KEY = "bigfl.hessian"
RESERVED_PREFIX = "bigfl/"
PHI_LOGGED_EDGES = 64
"""Off-diagonal entries of φ written to the round's server metrics (``phi_edges``): the largest
``|φ_ij|``, so a round's record stays a few kB whatever ``d`` is."""
RIDGE_CENTRES = ("proximal", "origin")
"""Values of ``bigfl.ridge``: the centre of the LL ridge ``(κ/2)‖θ_i − c_i‖²``."""


def _positive_lambda(value: float) -> str:
    if value > 0:
        return ""
    return ("lambda must be > 0: with lambda = 0 phi leaves the lower level and the run is local training "
            "with kappa (BiG-FL disabled); use --strategy local for that")


@dataclass(frozen=True)
class BiGFLParams:
    """BiG-FL hyperparameters (ALGORITHMS.md §5.2 as corrected by §0.1 C2; only ``q`` is the paper's).

    Attributes
    ----------
    alpha
        UL step length: ``φ ← φ − alpha · ĝ/‖ĝ‖_F`` (normalised step, C2 b).
    kappa
        ``κ`` of the LL ridge ``(κ/2)‖θ_i − c_i‖²``; must exceed the data loss's curvature
        deficit ``−λ_min(∇²data_i)`` for a strongly convex LL (C2 c; see ``ll_min_curvature``).
    ridge
        The ridge centre ``c_i``: ``proximal`` (default) = client i's model at the start of the
        round, ``θ_i^t``; ``origin`` = 0, the paper's literal ``(κ/2)‖θ_i‖²`` (module
        docstring, "Ridge centre").
    lam
        ``λ``: one weight for the LL graph regulariser ``(λ/2)R_i`` and the UL term
        ``(λ/2)‖φ − I‖²`` (seed 000 eqs. 10.14, 10.17); must be > 0.
    q
        Negative samples per head node (seed 000: 10).
    hypergrad_mode
        ``implicit`` (full ``J_Θ``; clients upload their data-loss Hessian), ``reg_only``
        (the server-side regulariser curvature and ``κ`` only) or ``first_order`` (``v = 0``).
    solver
        Linear solver of the implicit term: ``gmres`` or ``neumann``.
    solver_tol, solver_max_iter
        Relative residual tolerance and iteration cap (Neumann: terms ``K``) of the solve.
    neumann_c
        Neumann step ``c``; 0 = ``1/ρ̂`` with ``ρ̂`` a power-iteration estimate of ``‖J_Θ‖``.
    curvature_every
        Rounds between the LL strong-convexity checks (needs the clients' Hessians; 0 = never).
    layers
        Comma-separated parameter keys or prefixes BiG-FL acts on; empty = all parameters.
    others
        What happens to parameters outside ``layers``: ``fedavg`` (averaged every round) or
        ``local`` (kept on the client).
    missing_graph
        When neither the task nor ``graph_file`` gives a client graph: ``complete`` (with a
        warning), ``isolated`` (no edges: BiG-FL degenerates to regularised local training)
        or ``error``.
    max_hessian_dim
        In ``implicit`` mode clients upload a ``d×d`` Hessian only if ``d`` is at most this;
        above it the round uses ``reg_only`` (logged once).
    hessian_samples
        Training samples used for the client Hessian (0 = the whole local training split).
    phi_dtype
        Wire dtype of ``φ`` (``float16`` halves the downlink; the server keeps float64).
    """

    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "lambda-ll": "bigfl.lam (one lambda for both levels, as in the paper)",
        "lambda-ul": "bigfl.lam (one lambda for both levels, as in the paper)",
        "lambda": "bigfl.lam",
        "neumann-k": "bigfl.solver-max-iter (with bigfl.solver = 'neumann')",
    }
    """Keys that no longer exist and the key that replaced each (read by common.config)."""

    alpha: float = field(default=2e-2, metadata={"min": 0.0})
    kappa: float = field(default=0.3, metadata={"min": 0.0})
    ridge: str = field(default="proximal", metadata={"choices": RIDGE_CENTRES})
    lam: float = field(default=0.1, metadata={"check": _positive_lambda})
    q: int = field(default=10, metadata={"min": 0})
    hypergrad_mode: str = field(default="implicit", metadata={"choices": bm.HYPERGRAD_MODES})
    solver: str = field(default="gmres", metadata={"choices": bm.SOLVERS})
    solver_tol: float = field(default=1e-6, metadata={"min": 1e-14, "max": 1.0})
    solver_max_iter: int = field(default=300, metadata={"min": 1})
    neumann_c: float = field(default=0.0, metadata={"min": 0.0})
    curvature_every: int = field(default=10, metadata={"min": 0})
    layers: str = ""
    others: str = field(default="fedavg", metadata={"choices": ("fedavg", "local")})
    missing_graph: str = field(default="complete",
                               metadata={"choices": ("complete", "isolated", "error")})
    max_hessian_dim: int = field(default=2048, metadata={"min": 0})
    hessian_samples: int = field(default=0, metadata={"min": 0})
    phi_dtype: str = field(default="float32", metadata={"choices": ("float32", "float16")})


class BiGFLCore(ServerCore[BiGFLParams]):
    """Server half of BiG-FL (see the module docstring).

    One phase per round (the default plan): the clients' Hessians, when the ``implicit``
    hypergradient needs them, come back in the same reply as ``θ_i``.
    """

    _curvature_round: int = 0
    """The last round whose ``ll_min_curvature`` was computed (a class default, so a core pickled
    before this attribute existed resumes)."""

    def __init__(self, ctx: ServerContext[BiGFLParams]) -> None:
        super().__init__(ctx)
        p = self.params
        self.n = int(ctx.num_clients)
        self.template: Arrays = dict(ctx.initial_arrays)
        self.param_keys = tuple(ctx.param_keys) or tuple(self.template)
        try:
            self.keys = select_keys(self.param_keys, p.layers)
        except ConfigError as exc:
            raise ConfigError(f"bigfl.layers: {exc}") from None
        self.other_keys = tuple(k for k in self.template if k not in self.keys)
        self.dim = int(sum(np.asarray(self.template[k]).size for k in self.keys))

        if ctx.client_graph is not None:
            adj, self.graph_source = ctx.client_graph, ctx.graph_source
        else:
            adj, self.graph_source = fallback_graph(self.n, p.missing_graph, "bigfl")
        self.adj = adj
        self.a_hat = torch.as_tensor(gcn_propagation(adj), dtype=torch.float64)
        self.a_diag = np.diag(gcn_propagation(adj)).copy()
        degree = (adj > 0).sum(1)
        isolated = np.flatnonzero(degree == 0).tolist()
        if isolated and len(isolated) < self.n:
            logger.info("bigfl: client(s) %s have no neighbour: no positive pairs, m_i = 0, "
                        "regulariser ||theta_i (phi - I)||^2", isolated)
        self.pos = torch.as_tensor(bm.positive_pairs(adj))
        if self.n > 1 and int((adj > 0).sum()) == self.n * (self.n - 1):
            logger.warning("bigfl: the client graph is complete: Â = 11ᵀ/n maps the centred parameters to H = 0, "
                           "so the upper level has no signal and phi stays I (give the task's graph or graph_file)")

        theta0 = flatten_params(self.template, self.keys)
        self.theta = torch.as_tensor(np.tile(theta0, (self.n, 1)), dtype=torch.float64)
        self.phi = torch.eye(self.dim, dtype=torch.float64)
        self.want_hessian = p.hypergrad_mode == "implicit" and self.dim <= p.max_hessian_dim
        if p.hypergrad_mode == "implicit" and not self.want_hessian:
            logger.warning("bigfl: d = %d > max_hessian_dim = %d; clients upload no Hessian and "
                           "the hypergradient uses reg_only", self.dim, p.max_hessian_dim)
        self.hessians = (torch.zeros((self.n, self.dim, self.dim), dtype=torch.float32)
                         if self.want_hessian else None)
        self.shared: Arrays = {k: self.template[k] for k in self.other_keys}
        self.rng = np.random.default_rng([int(ctx.seed), 5, 1])
        self.neumann_c = p.neumann_c
        self.min_curvature: float | None = None
        self._curvature_round = 0
        if self.dim * self.dim * self.n > 5e8:
            logger.warning("bigfl: phi is %d x %d (%.1f GB as float64); consider bigfl.layers",
                           self.dim, self.dim, self.dim**2 * 8 / 1e9)
        self._refresh()

    # -- protocol --------------------------------------------------------------------

    def configure_train(self, server_round: int, partition_id: int) -> Payload:
        i = self._check(partition_id)
        arrays = self._model_arrays(i)
        arrays[M_KEY] = self._messages[i]
        arrays[PHI_KEY] = self._phi_wire
        return Payload(arrays, {A_II_KEY: float(self.a_diag[i]), WANT_HESS_KEY: self.want_hessian})

    def evaluation_payload(self, partition_id: int) -> Payload:
        return Payload(self._model_arrays(self._check(partition_id)))

    def update_template(self, partition_id: int) -> Arrays:
        keys = self.keys + (self.other_keys if self.params.others == "fedavg" else ())
        out = {k: self.template[k] for k in self.template if k in keys}
        if self.want_hessian:
            out[HESS_KEY] = np.zeros((self.dim, self.dim), dtype=np.float32)
        return out

    def final_arrays(self) -> Arrays | None:
        return None

    def aggregate_train(
        self, server_round: int, updates: Mapping[int, ClientUpdate]
    ) -> dict[str, MetricValue]:
        t0 = time.perf_counter()
        good: dict[int, ClientUpdate] = {}
        excluded = 0
        template = self.update_template(0)
        for pid, up in updates.items():
            why = validate_update(up.arrays, template) if 0 <= int(pid) < self.n else "unknown partition id"
            if why is not None:
                logger.warning("bigfl round %d: excluding the update of client %s: %s",
                               server_round, pid, why)
                excluded += 1
                continue
            good[int(pid)] = up
        for pid, up in good.items():
            self.theta[pid] = torch.as_tensor(flatten_params(up.arrays, self.keys))
            if self.hessians is not None:
                self.hessians[pid] = torch.tensor(np.asarray(up.arrays[HESS_KEY], dtype=np.float32))  # own copy
        if self.other_keys and self.params.others == "fedavg" and good:
            ups = list(good.values())
            self.shared = weighted_average(
                [{k: u.arrays[k] for k in self.other_keys} for u in ups],
                [max(u.num_examples, 0) or 1 for u in ups],
            )
        metrics: dict[str, MetricValue] = {
            "clients_aggregated": len(good), "clients_excluded": excluded,
        }
        if not good:
            logger.warning("bigfl round %d: no valid update; phi and the models are unchanged",
                           server_round)
            metrics.update(phi_minus_identity=self.phi_distance(), hypergrad_norm=0.0, phi_step=0.0)
            metrics["server_seconds"] = time.perf_counter() - t0
            return metrics

        p = self.params
        if self.hessians is not None and p.curvature_every and (
                self.min_curvature is None or server_round % p.curvature_every == 0):
            self._check_curvature(server_round)
        neg = torch.as_tensor(bm.sample_negatives(self.adj, p.q, self.rng))
        grad, info = bm.hypergradient(
            self.a_hat, self.theta, self.phi, self.pos, neg,
            q=max(p.q, 1), lam=p.lam, kappa=p.kappa, mode=p.hypergrad_mode,
            hessians=self.hessians, solver=p.solver, tol=p.solver_tol, max_iter=p.solver_max_iter,
            neumann_c=self.neumann_c, max_halvings=20, a_diag=torch.as_tensor(self.a_diag),
        )
        convexity_checked = info.preconditioned and self.hessians is not None and info.mode == "implicit"
        if convexity_checked and info.not_strongly_convex and self._curvature_round != server_round:
            self._check_curvature(server_round)  # the value of this round's deficit, logged
        if info.neumann_halvings:
            # remember the safe step for the following rounds
            self.neumann_c = info.neumann_c
        if not info.converged and info.mode != "first_order":
            logger.warning("bigfl round %d: the implicit term's %s solve stopped at relative residual "
                           "%.2e after %d iterations (tolerance %.1e)", server_round, info.solver,
                           info.residual, info.iterations, p.solver_tol)
        self.phi, step = bm.normalised_step(self.phi, grad, p.alpha)
        self._refresh()
        metrics.update(
            ul_loss=info.ul_loss,
            hypergrad_norm=float(grad.norm()),
            hypergrad_direct_norm=info.grad_phi_direct_norm,
            hypergrad_correction_norm=info.correction_norm,
            phi_minus_identity=self.phi_distance(),
            phi_step=step,
            phi_dim=self.dim,
            phi_edges=phi_edges(self.phi, PHI_LOGGED_EDGES),
            implicit_residual=info.residual,
            implicit_iterations=info.iterations,
            implicit_converged=int(info.converged),
            hypergrad_fallback=int(info.fell_back),
        )
        if info.solver == "neumann":
            metrics.update(neumann_c=info.neumann_c, neumann_halvings=info.neumann_halvings)
        if self.min_curvature is not None:
            metrics["ll_min_curvature"] = self.min_curvature
        if convexity_checked:
            metrics["ll_strongly_convex"] = int(not info.not_strongly_convex)
            metrics["ll_not_strongly_convex_clients"] = len(info.not_strongly_convex)
        metrics["server_seconds"] = time.perf_counter() - t0
        return metrics

    def phi_distance(self) -> float:
        """``‖φ − I‖_F``."""
        eye = torch.eye(self.dim, dtype=torch.float64)
        return float((self.phi - eye).norm())

    def _check_curvature(self, server_round: int) -> None:
        """``ll_min_curvature`` from the uploaded Hessians; warn when the LL is not strongly convex."""
        assert self.hessians is not None
        self._curvature_round = server_round
        self.min_curvature = bm.min_curvature(self.hessians, self.params.kappa, self.params.lam,
                                              torch.as_tensor(self.a_diag), self.phi)
        if self.min_curvature <= 0:
            logger.warning(
                "bigfl round %d: the lower level is not strongly convex: min_i lambda_min(data Hessian_i + "
                "lam B_i B_i^T) + kappa = %.3g <= 0; raise bigfl.kappa above %.3g", server_round, self.min_curvature,
                self.params.kappa - self.min_curvature)

    # -- helpers ---------------------------------------------------------------------

    def ul_loss_now(self) -> float:
        """UL loss at the current ``(φ, Θ)`` with freshly sampled negatives (diagnostics)."""
        neg = torch.as_tensor(bm.sample_negatives(self.adj, self.params.q, self.rng))
        return float(bm.ul_loss(self.a_hat, self.theta, self.phi, self.pos, neg,
                                max(self.params.q, 1), self.params.lam))

    def _check(self, partition_id: int) -> int:
        if not 0 <= int(partition_id) < self.n:
            raise ValueError(f"partition id {partition_id} outside 0..{self.n - 1}")
        return int(partition_id)

    def _refresh(self) -> None:
        """Recompute per-client messages and the wire copy of φ after Θ or φ changed."""
        msgs = bm.messages(self.a_hat, self.theta, self.phi).numpy().astype(np.float32)
        self._messages = list(msgs)
        self._phi_wire = self.phi.numpy().astype(self.params.phi_dtype)
        self._own = unflatten_params_many(self.theta.numpy(), self.template, self.keys)

    def _model_arrays(self, i: int) -> Arrays:
        out = dict(self._own[i])
        if self.params.others == "fedavg":
            out.update(self.shared)
        return out


def phi_edges(phi: torch.Tensor, count: int) -> list[list[float]]:
    """The ``count`` off-diagonal entries of ``phi`` of largest magnitude as ``[i, j, φ_ij]``
    (row-major order, values rounded to 6 decimals as JGESR's logged graph; zeros left out).
    """
    m = phi.detach().cpu().numpy().astype(np.float64, copy=True)
    np.fill_diagonal(m, 0.0)
    flat = np.abs(m).ravel()
    k = min(int(count), int(np.count_nonzero(flat)))
    if k <= 0:
        return []
    top = np.sort(np.argpartition(-flat, k - 1)[:k])
    rows, cols = np.divmod(top, m.shape[1])
    return [[int(i), int(j), round(float(m[i, j]), 6)] for i, j in zip(rows, cols, strict=True)]


def unflatten_params_many(theta: np.ndarray, template: Arrays, keys: tuple[str, ...]) -> list[Arrays]:
    """Row-wise :func:`unflatten_params`, keeping only ``keys`` (template dtypes)."""
    sub = {k: template[k] for k in keys}
    return [unflatten_params(row, sub, keys) for row in theta]


PHI_MEMORY_BUDGET = 4 << 30
"""Bytes BiG-FL's server may spend on φ (d×d float64) and the two d×d buffers of its update."""


def check_memory(cfg: RunConfig, initial: Arrays, param_keys: tuple[str, ...]) -> None:
    """Refuse, before anything starts, a BiG-FL run whose φ cannot fit (e.g. all of a CNN).

    φ is ``d×d`` over the parameters named by ``bigfl.layers`` (all of them by default); on the
    2-conv CNN of mnist that is 1.66M² float64 (22 TB). The error names ``bigfl.layers`` and a
    feasible choice (the last layer).
    """
    p = cfg.params
    assert isinstance(p, BiGFLParams)
    keys = select_keys(param_keys, p.layers)
    d = sum(int(initial[k].size) for k in keys)
    need = 3 * 8 * d * d
    if need <= PHI_MEMORY_BUDGET:
        return
    last = param_keys[-1].rsplit(".", 1)[0]
    d_last = sum(int(initial[k].size) for k in select_keys(param_keys, last))
    raise ConfigError(
        f"bigfl: phi over {len(keys)} parameter tensors is {d} x {d} ({need / 2**30:,.0f} GiB with its update "
        f"buffers, budget {PHI_MEMORY_BUDGET / 2**30:.0f} GiB); set bigfl.layers to a few layers, "
        f"e.g. bigfl.layers = '{last}' ({d_last} parameters)"
    )


register(AlgorithmSpec(
    "bigfl", BiGFLParams, BiGFLCore,
    "BiG-FL: bilevel graph-aided FL (GCN phi on the client graph, cosine link-prediction UL)",
    min_clients=2, preflight=check_memory,
))
