"""graphfl's algorithms as Flower ``Strategy`` classes for a user's own ServerApp.

Each class is :class:`~graphfl.flower.adapter.GraphflStrategy` over one pure core of
``graphfl.strategies`` (the maths is not copied): keyword arguments are the algorithm's
hyperparameters with graphfl's defaults (checked as in a run config), plus the common ones of
:class:`~graphfl.flower.adapter.GraphflStrategy` (``fraction_train``, ``num_clients``,
``partition_of``, ``seed``, ...). Use them as Flower's own strategies::

    strategy = FeSEM(k=3)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=20)

A stock ClientApp (``msg.content["arrays"]`` in; ``"arrays"`` and ``"metrics"`` with
``"num-examples"`` out) serves FedAvg, FeSEM (``prox_lambda = 0``), JGESR, CFL, FedAMP
(``prox_mu = 0``) and pFedGraph (``lam = 0``). With the client term on (FedProx, FedAMP's
``prox_mu``, FeSEM's ``prox_lambda``, pFedGraph's ``lam``; FedGATE, BiG-FL) the ClientApp needs
:func:`graphfl.flower.client.graphfl_mod` and :func:`graphfl.flower.client.regulariser`;
APFL and APFLGate need the mod, :class:`graphfl.flower.client.Personal` in the train loop and
:func:`graphfl.flower.client.personal_model` in evaluation (APFLGate: ``regulariser`` too);
local-only training (:class:`Local`) needs the mod.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from graphfl.common.config import TrainConfig
from graphfl.common.types import Arrays
from graphfl.flower import keys
from graphfl.flower.adapter import ClientReply, CooperationError, GraphflStrategy, record_to_numpy
from graphfl.strategies.apfl import APFLParams
from graphfl.strategies.apfl_math import effective_tau
from graphfl.strategies.apflgate import APFLGateParams
from graphfl.strategies.bigfl import HESS_KEY, M_KEY, PHI_KEY, BiGFLParams
from graphfl.strategies.cfl import CFLConfig
from graphfl.strategies.fedamp import FedAMPConfig
from graphfl.strategies.fedavg import FedAvgParams, FedProxParams
from graphfl.strategies.fedgate import U_PREFIX, FedGATEParams
from graphfl.strategies.fesem import FeSEMParams
from graphfl.strategies.jgesr import JGESRConfig
from graphfl.strategies.local import LocalParams
from graphfl.strategies.pfedgraph import CLUSTER_PREFIX, PFedGraphConfig


class FedAvg(GraphflStrategy):
    """FedAvg (ALGORITHMS.md §10): ``θ ← Σ_i n_i θ_i / Σ_i n_i`` over the replies.

    Parameters
    ----------
    weighted
        Weight clients by ``num-examples`` (else uniformly).
    **kwargs
        Common arguments of :class:`~graphfl.flower.adapter.GraphflStrategy`.

    One global model: Flower's wrappers (``DifferentialPrivacyServerSideFixedClipping``, ...)
    compose with it as with Flower's ``FedAvg``; ``Result.arrays`` is the final global model.
    """

    algorithm = "fedavg"
    global_model = True

    def __init__(self, weighted: bool = True, **kwargs: Any) -> None:
        super().__init__(self.make_params(FedAvgParams, self.algorithm, weighted=weighted), **kwargs)


class FedProx(GraphflStrategy):
    """FedProx (Li et al. 2020): FedAvg; each client minimises ``F_i(θ) + μ/2 ‖θ − θ_global‖²``.

    Parameters
    ----------
    mu
        ``μ`` of the proximal term (0.002, FedTorch's default). ``mu > 0`` needs the client term
        (:func:`graphfl.flower.client.regulariser` and ``graphfl_mod`` in the ClientApp).
    weighted
        Weight clients by ``num-examples``.
    **kwargs
        Common arguments of :class:`~graphfl.flower.adapter.GraphflStrategy`.
    """

    algorithm = "fedprox"
    global_model = True

    def __init__(self, mu: float = 0.002, weighted: bool = True, **kwargs: Any) -> None:
        super().__init__(self.make_params(FedProxParams, self.algorithm, mu=mu, weighted=weighted), **kwargs)

    def regulariser(self) -> tuple[str, dict[str, float]] | None:
        return (keys.PROXIMAL, {keys.MU: self.params.mu}) if self.params.mu > 0 else None

    def off_hint(self) -> str:
        return "mu=0, which is FedAvg"


class FeSEM(GraphflStrategy):
    """FeSEM (ALGORITHMS.md §4; seed 000 §10.3): K centers by federated EM; each client gets its center.

    Round 1 is the warm-up (every client trains from the initial model); the server then forms
    the centers (k-means++ on the warmed-up models). Each later round: E-step (nearest center),
    M-step (mean of the members), each client receives its center as ``"arrays"``.

    Parameters
    ----------
    k
        Number of centers.
    dist_layers
        Comma-separated parameter keys or prefixes for the E-step distance ("" = all).
    prox_lambda
        ``λ`` of the client loss ``F_i(θ) + λ‖θ − θ̄‖²`` (eq. 10.10); > 0 needs the client term.
    recluster_every, weighted_mstep, warmup_steps, center_init, init_iters, init_restarts, empty_cluster
        As ``[fesem]`` in docs/strategies.md. ``warmup_steps`` travels as the config key
        ``fesem.steps`` of the warm-up round; a stock ClientApp trains its usual steps.
    **kwargs
        Common arguments of :class:`~graphfl.flower.adapter.GraphflStrategy`.
    """

    algorithm = "fesem"

    def __init__(self, k: int = 3, dist_layers: str = "", prox_lambda: float = 0.0, recluster_every: int = 1,
                 weighted_mstep: bool = False, warmup_steps: int = 0, center_init: str = "kmeans++",
                 init_iters: int = 5, init_restarts: int = 10, empty_cluster: str = "keep", **kwargs: Any) -> None:
        params = self.make_params(
            FeSEMParams, self.algorithm, k=k, dist_layers=dist_layers, prox_lambda=prox_lambda,
            recluster_every=recluster_every, weighted_mstep=weighted_mstep, warmup_steps=warmup_steps,
            center_init=center_init, init_iters=init_iters, init_restarts=init_restarts, empty_cluster=empty_cluster)
        super().__init__(params, **kwargs)

    def regulariser(self) -> tuple[str, dict[str, float]] | None:
        # eq. 10.10's λ‖θ − θ̄‖² is the proximal term μ/2‖θ − θ̄‖² with μ = 2λ
        lam = self.params.prox_lambda
        return (keys.PROXIMAL, {keys.MU: 2.0 * lam}) if lam > 0 else None

    def off_hint(self) -> str:
        return "prox_lambda=0: plain local training from the center, as in the authors' code"

    def assignment(self) -> list[int]:
        """Cluster of every client (-1 = none yet)."""
        if self.core is None:
            return []
        return [int(a) for a in self.core.assign]  # type: ignore[attr-defined]


class JGESR(GraphflStrategy):
    """JGESR (ALGORITHMS.md §8; seed 002): joint graph learning and restoration of the uploads.

    Each round the server learns a client graph ``W`` and restored models ``Ψ`` from the uploads
    and sends client ``k`` its own ``ψ_k``. The client trains as in FedAvg (a stock ClientApp).

    Parameters
    ----------
    solver, lam, alpha, beta, max_outer, max_inner, tol, max_impute, impute_tol, work_dtype,
    warm_start, use_mask, log_graph, fixed_scale
        As ``[jgesr]`` in docs/jgesr.md (``lam`` λ smoothness, ``alpha`` log-degree barrier,
        ``beta`` edge ridge; ``solver`` ``pdca`` or ``two-step``).
    **kwargs
        Common arguments of :class:`~graphfl.flower.adapter.GraphflStrategy`.

    Not wrappable by Flower's DP wrappers: it restores the raw uploads into per-client models.
    """

    algorithm = "jgesr"

    def __init__(self, solver: str = "pdca", lam: float = 1.0, alpha: float = 1.0, beta: float = 0.1,
                 max_outer: int = 1000, max_inner: int = 1, tol: float = 1e-4, max_impute: int = 10,
                 impute_tol: float = 1e-4, work_dtype: str = "auto", warm_start: bool = True, use_mask: bool = True,
                 log_graph: bool = True, fixed_scale: bool = True, **kwargs: Any) -> None:
        params = self.make_params(
            JGESRConfig, self.algorithm, solver=solver, lam=lam, alpha=alpha, beta=beta, max_outer=max_outer,
            max_inner=max_inner, tol=tol, max_impute=max_impute, impute_tol=impute_tol, work_dtype=work_dtype,
            warm_start=warm_start, use_mask=use_mask, log_graph=log_graph, fixed_scale=fixed_scale)
        super().__init__(params, **kwargs)


class CFL(GraphflStrategy):
    """CFL (Sattler et al., IEEE TNNLS 2021): FedAvg inside clusters, bipartitioned by update similarity.

    Parameters
    ----------
    eps1, eps2, min_cluster_size, warmup_rounds, linkage, weighted
        As ``[cfl]`` in docs/jgesr.md (split when ``‖mean update‖ < eps1`` and
        ``max ‖update‖ > eps2`` after ``warmup_rounds``).
    **kwargs
        Common arguments of :class:`~graphfl.flower.adapter.GraphflStrategy`.
    """

    algorithm = "cfl"

    def __init__(self, eps1: float = 0.4, eps2: float = 1.6, min_cluster_size: int = 3, warmup_rounds: int = 20,
                 linkage: str = "complete", weighted: bool = False, **kwargs: Any) -> None:
        params = self.make_params(CFLConfig, self.algorithm, eps1=eps1, eps2=eps2, min_cluster_size=min_cluster_size,
                                  warmup_rounds=warmup_rounds, linkage=linkage, weighted=weighted)
        super().__init__(params, **kwargs)


class FedAMP(GraphflStrategy):
    """FedAMP (Huang et al., AAAI 2021): each client gets its attention-weighted cloud model ``u_i``.

    Parameters
    ----------
    attention, self_weight, scale, alpha_k, sigma
        As ``[fedamp]`` in docs/jgesr.md.
    prox_mu
        ``μ`` of the client loss ``F_i(θ) + μ/2 ‖θ − u_i‖²``; > 0 (the default, 0.1) needs the
        client term; 0 runs with a stock ClientApp.
    **kwargs
        Common arguments of :class:`~graphfl.flower.adapter.GraphflStrategy`.
    """

    algorithm = "fedamp"

    def __init__(self, attention: str = "heuristic", self_weight: float = 0.3, scale: float = 10.0,
                 alpha_k: float = 0.1, sigma: float = 1.0, prox_mu: float = 0.1, **kwargs: Any) -> None:
        params = self.make_params(FedAMPConfig, self.algorithm, attention=attention, self_weight=self_weight,
                                  scale=scale, alpha_k=alpha_k, sigma=sigma, prox_mu=prox_mu)
        super().__init__(params, **kwargs)

    def regulariser(self) -> tuple[str, dict[str, float]] | None:
        mu = self.params.prox_mu
        return (keys.PROXIMAL, {keys.MU: mu}) if mu > 0 else None

    def off_hint(self) -> str:
        return "prox_mu=0: local training from u_i without the proximal pull"


class PFedGraph(GraphflStrategy):
    """pFedGraph (Ye et al., ICML 2023): per-client aggregation on a learned collaboration graph.

    Client ``i`` receives ``θ̃_i = Σ_j a_ij θ_j`` as ``"arrays"`` and, with ``lam > 0``, its cluster
    model ``c_i`` as the ArrayRecord ``"graphfl.anchor"`` for the term ``−λ ⟨c_i, θ⟩/‖θ‖``.

    Parameters
    ----------
    alpha, clip_above
        ``α`` of the graph QP and the cosine clip (official code defaults 0.8, 0.9).
    lam
        ``λ`` of the client's similarity term; > 0 (the default, 0.01) needs the client term;
        0 runs with a stock ClientApp.
    **kwargs
        Common arguments of :class:`~graphfl.flower.adapter.GraphflStrategy`.
    """

    algorithm = "pfedgraph"

    def __init__(self, alpha: float = 0.8, clip_above: float = 0.9, lam: float = 0.01, **kwargs: Any) -> None:
        params = self.make_params(PFedGraphConfig, self.algorithm, alpha=alpha, clip_above=clip_above, lam=lam)
        super().__init__(params, **kwargs)

    def regulariser(self) -> tuple[str, dict[str, float]] | None:
        lam = self.params.lam
        return (keys.COSINE, {keys.LAM: lam}) if lam > 0 else None

    def anchor_arrays(self, extra: Arrays) -> Arrays:
        return {k[len(CLUSTER_PREFIX):]: v for k, v in extra.items() if k.startswith(CLUSTER_PREFIX)}

    def off_hint(self) -> str:
        return "lam=0: local training from the aggregated model without the similarity term"


class FedGATE(GraphflStrategy):
    """FedGATE (ALGORITHMS.md §9.2; Haddadpour et al. 2021): local SGD with gradient tracking.

    Server: ``u_i = w − w_i``, ``ū = mean_i u_i``, ``w ← w − γ ū``; every client receives ``w`` as
    ``"arrays"`` and ``ū`` (with the round it belongs to and whether its own upload is in it) as
    ``"graphfl.anchor"``. Client: ``δ_i ← δ_i + (u_i − ū)/(η τ)`` when its last upload is in ``ū``,
    then local steps ``w_i ← w_i − η(∇ℓ − δ_i)``. :func:`graphfl.flower.client.graphfl_mod` keeps
    ``δ_i`` and ``u_i`` in the ClientApp's ``context.state`` and does the δ update;
    :func:`graphfl.flower.client.regulariser` adds ``−⟨δ_i, θ⟩`` to the loss (its gradient is
    ``−δ_i``). ``Result.arrays`` is the final ``w``.

    Parameters
    ----------
    gamma
        Server step ``γ`` (1.0: ``w`` is the plain average of the uploads).
    tau, tau_mode
        ``τ`` of the δ update: 0 = ``local_steps`` (FedTorch); otherwise ``tau`` (``absolute``) or
        ``tau · local_steps`` (``multiple-of-steps``); ``τ ≤ local_steps/2`` is refused (unstable).
    client_lr, local_steps
        The ClientApp's SGD step ``η`` and its local steps per round, which the δ update divides by
        (sent to the clients as ``graphfl.eta`` / ``graphfl.tau``); they must be the ClientApp's own.
    **kwargs
        Common arguments of :class:`~graphfl.flower.adapter.GraphflStrategy`.
    """

    algorithm = "fedgate"

    def __init__(self, gamma: float = 1.0, tau: float = 0.0, tau_mode: str = "absolute", client_lr: float = 0.1,
                 local_steps: int = 50, **kwargs: Any) -> None:
        params = self.make_params(FedGATEParams, self.algorithm, gamma=gamma, tau=tau, tau_mode=tau_mode)
        super().__init__(params, **kwargs)
        self.train = self.make_params(TrainConfig, "train", lr=client_lr, local_steps=local_steps)

    def train_settings(self) -> TrainConfig:
        return self.train

    def regulariser(self) -> tuple[str, dict[str, float]] | None:
        tau = effective_tau(self.params.tau, self.params.tau_mode, self.train.local_steps)
        return (keys.GATE, {keys.ETA: self.train.lr, keys.TAU: tau})

    def anchor_arrays(self, extra: Arrays) -> Arrays:
        return {k[len(U_PREFIX):]: v for k, v in extra.items() if k.startswith(U_PREFIX)}

    def off_hint(self) -> str:
        return "FedGATE has no stock form; FedAvg is FedGATE without tracking"


class Local(GraphflStrategy):
    """Local-only training: round 1 sends the initial model, later rounds nothing; no aggregation.

    The baseline personalised methods must beat. Each client trains and is evaluated on its own
    model, which :func:`graphfl.flower.client.graphfl_mod` keeps in the ClientApp's
    ``context.state`` and hands to the train / evaluate function as ``"arrays"`` (the server
    sends an empty ``"arrays"`` after round 1): the ClientApp needs the mod, not ``regulariser``.

    Parameters
    ----------
    **kwargs
        Common arguments of :class:`~graphfl.flower.adapter.GraphflStrategy`.
    """

    algorithm = "local"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(LocalParams(), **kwargs)

    def regulariser(self) -> tuple[str, dict[str, float]] | None:
        return (keys.OWN_MODEL, {})

    def off_hint(self) -> str:
        return "local-only training has no stock form; use FedAvg for a stock ClientApp"

    def client_arrays(self, partition_id: int) -> Arrays:
        raise RuntimeError("Local: the clients' models never leave the clients (their context.state)")


class BiGFL(GraphflStrategy):
    """BiG-FL (ALGORITHMS.md §5 with §0.1 C2; seed 000 §10.4): bilevel graph-aided FL.

    The server learns the GCN map ``φ`` (``d×d``, from ``I``) on the client graph by the
    hypergradient of its link-prediction upper level, and sends client ``i`` its own model
    ``θ_i`` as ``"arrays"``, its message ``m_i = Σ_{j≠i} Â_ij θ_j φ`` and ``φ`` in
    ``"graphfl.anchor"`` (``bigfl/m``, ``bigfl/phi``) and ``â_i`` (config ``bigfl.a-ii``). The
    client trains on its data loss plus the lower-level term
    ``(λ/2)‖m_i + â_i θ φ − θ‖² + (κ/2)‖θ − c_i‖²`` (eq. 10.17), which
    :func:`graphfl.flower.client.regulariser` adds (with ``graphfl_mod`` in the ClientApp): BiG-FL has
    no stock form, its lower level is what couples the clients.

    Parameters
    ----------
    client_graph
        ``n×n`` adjacency over partition ids (the clients' ``partition-id``; pass ``partition_of``
        or let the mod report them). ``None``: ``missing_graph`` decides (``complete`` carries no
        upper-level signal, the core warns).
    alpha, kappa, ridge, lam, q, solver, solver_tol, solver_max_iter, neumann_c, layers, missing_graph, phi_dtype
        As ``[bigfl]`` in docs/strategies.md (``lam`` > 0 weighs both levels; ``ridge``
        ``proximal`` centres the ridge on the received model, ``origin`` on 0).
    hypergrad_mode
        ``implicit`` (default, the full hypergradient: each client also returns its data loss's
        ``d×d`` Hessian at the trained model, :func:`graphfl.flower.client.bigfl_hessian`, as the
        ArrayRecord ``"graphfl.hessian"``; above ``max_hessian_dim`` the core uses ``reg_only``),
        ``reg_only`` (the regulariser's curvature and ``κ``) or ``first_order``.
    max_hessian_dim, hessian_samples, curvature_every
        As ``[bigfl]`` (``hessian_samples`` must be 0 here: the client helper uses all the
        training data it is given).
    **kwargs
        Common arguments of :class:`~graphfl.flower.adapter.GraphflStrategy`.

    Parameters outside ``layers`` are averaged as in FedAvg (``others = fedavg``). Not wrappable
    by Flower's DP wrappers (a model per client).
    """

    algorithm = "bigfl"

    def __init__(self, client_graph: np.ndarray | Sequence[Sequence[float]] | None = None, alpha: float = 2e-2,
                 kappa: float = 0.3, ridge: str = "proximal", lam: float = 0.1, q: int = 10,
                 hypergrad_mode: str = "implicit", solver: str = "gmres", solver_tol: float = 1e-6,
                 solver_max_iter: int = 300, neumann_c: float = 0.0, curvature_every: int = 10, layers: str = "",
                 missing_graph: str = "complete", max_hessian_dim: int = 2048, phi_dtype: str = "float32",
                 **kwargs: Any) -> None:
        params = self.make_params(
            BiGFLParams, self.algorithm, alpha=alpha, kappa=kappa, ridge=ridge, lam=lam, q=q,
            hypergrad_mode=hypergrad_mode, solver=solver, solver_tol=solver_tol, solver_max_iter=solver_max_iter,
            neumann_c=neumann_c, curvature_every=curvature_every, layers=layers, others="fedavg",
            missing_graph=missing_graph, max_hessian_dim=max_hessian_dim, hessian_samples=0, phi_dtype=phi_dtype)
        super().__init__(params, **kwargs)
        self.graph = None if client_graph is None else np.asarray(client_graph, dtype=np.float64)
        if self.graph is not None and (self.graph.ndim != 2 or self.graph.shape[0] != self.graph.shape[1]):
            raise ValueError(f"client_graph must be a square adjacency matrix, got shape {self.graph.shape}")

    def client_graph(self) -> tuple[np.ndarray, str] | None:
        return None if self.graph is None else (self.graph, "client_graph")

    def regulariser(self) -> tuple[str, dict[str, Any]] | None:
        p = self.params
        theta_keys = list(self.core.keys) if self.core is not None else []  # type: ignore[attr-defined]
        return (keys.BIGFL, {keys.LAM: p.lam, keys.KAPPA: p.kappa, keys.RIDGE: p.ridge, keys.THETA_KEYS: theta_keys})

    def anchor_arrays(self, extra: Arrays) -> Arrays:
        return {k: extra[k] for k in (M_KEY, PHI_KEY)}

    def reply_arrays(self, reply: ClientReply, content: Any) -> Arrays:
        """The trained model plus, when the core asked for it, the Hessian of ``"graphfl.hessian"``;
        a reply without the Hessian asked for stops the run (:class:`CooperationError`).
        """
        arrays = super().reply_arrays(reply, content)
        if self.core is None or not self.core.want_hessian:  # type: ignore[attr-defined]
            return arrays
        record = content.array_records.get(keys.HESSIAN)
        if record is None or HESS_KEY not in record:
            raise CooperationError(
                f"BiGFL (hypergrad_mode='implicit') needs each client's data-loss Hessian, but the reply of node "
                f"{reply.node_id} has no ArrayRecord {keys.HESSIAN!r}. Add to the train function, after training: "
                "`content['graphfl.hessian'] = graphfl.flower.client.bigfl_hessian(msg, model, loss_fn, x, y)` "
                "(it is None when not asked for); or run hypergrad_mode='reg_only'.")
        arrays[HESS_KEY] = record_to_numpy(record)[HESS_KEY]
        return arrays

    def off_hint(self) -> str:
        return "BiG-FL has no stock form: its lower-level term is what couples the clients"

    def phi(self) -> np.ndarray:
        """The current ``φ`` (``d×d``, float64)."""
        if self.core is None:
            raise RuntimeError("BiGFL: no round has run yet")
        return self.core.phi.numpy().copy()  # type: ignore[attr-defined]


PERSONAL_STEPS = ("`app = ClientApp(mods=[graphfl.flower.client.graphfl_mod])`; in the train function "
                  "`pers = graphfl.flower.client.Personal(msg, context, model)` after loading msg.content['arrays'] "
                  "and `pers.step(model, x, y, loss_fn)` after every optimizer step; in the evaluate function "
                  "`model = graphfl.flower.client.personal_model(msg, context, model)`")


class APFL(GraphflStrategy):
    """APFL (ALGORITHMS.md §9.1, §0.1 C6; Deng, Kamani, Mahdavi 2020): personal models mixed at the output.

    Server: ``w ← mean_i w_i`` (uniform weights, FedTorch), every client receives ``w`` as
    ``"arrays"``; ``Result.arrays`` is the final ``w``. Client: each local step trains its copy
    ``w_i`` by plain SGD and its personal model ``v_i`` on the mixed output
    ``α_i h(v_i; x) + (1 − α_i) h(w_i; x)`` (``h(w_i)`` detached); ``v_i``, ``α_i`` and the trained
    ``w_i`` stay in the ClientApp's ``context.state``. A loss term cannot express training on a
    mixed output, so the ClientApp calls :class:`graphfl.flower.client.Personal` in its train loop
    and evaluates :func:`graphfl.flower.client.personal_model` (with ``graphfl_mod``); a ClientApp
    without them stops the run with a :class:`~graphfl.flower.adapter.CooperationError`.

    Parameters
    ----------
    alpha
        Initial (or fixed) mixing weight ``α_i`` (0.5).
    adaptive_alpha, alpha_lr
        Update ``α_i ← clip_[0,1](α_i − η_α ∂ℓ/∂α)`` every local step, ``η_α = alpha_lr`` (0 =
        ``client_lr``).
    personal_output
        ``local-copy`` (default, C6): evaluate ``α_i h(v_i) + (1 − α_i) h(w_i)`` with the client's
        locally trained ``w_i``; ``aggregated``: with the received ``w``.
    client_lr
        The step ``η`` of the personal model's SGD (sent as ``graphfl.eta``); the ClientApp's own step.
    **kwargs
        Common arguments of :class:`~graphfl.flower.adapter.GraphflStrategy`.
    """

    algorithm = "apfl"

    def __init__(self, alpha: float = 0.5, adaptive_alpha: bool = False, alpha_lr: float = 0.0,
                 personal_output: str = "local-copy", client_lr: float = 0.1, **kwargs: Any) -> None:
        params = self.make_params(APFLParams, self.algorithm, alpha=alpha, adaptive_alpha=adaptive_alpha,
                                  alpha_lr=alpha_lr, personal_output=personal_output)
        super().__init__(params, **kwargs)
        self.train = self.make_params(TrainConfig, "train", lr=client_lr)

    def personal_values(self) -> dict[str, Any]:
        p = self.params
        return {keys.ETA: self.train.lr, keys.ALPHA: p.alpha, keys.ADAPTIVE_ALPHA: bool(p.adaptive_alpha),
                keys.ALPHA_LR: p.alpha_lr or self.train.lr, keys.PERSONAL_OUTPUT: p.personal_output}

    def train_settings(self) -> TrainConfig:
        return self.train

    def regulariser(self) -> tuple[str, dict[str, Any]] | None:
        return (keys.PERSONAL, self.personal_values())

    def evaluate_term(self) -> tuple[str, dict[str, Any]] | None:
        return (keys.PERSONAL, {keys.ALPHA: self.params.alpha, keys.PERSONAL_OUTPUT: self.params.personal_output})

    def cooperation_steps(self) -> str:
        return PERSONAL_STEPS

    def off_hint(self) -> str:
        return "APFL has no stock form; FedAvg is APFL without the personal model"


class APFLGate(APFL):
    """APFLGate (ALGORITHMS.md §9.3, §0.1 C5/C6; seed 004): APFL's personal model with FedGATE's tracking.

    Server: FedGATE's (``u_i = w − w_i``, ``ū = mean_i u_i``, ``w ← w − γ ū``; ``ū`` sent in
    ``"graphfl.anchor"``). Client: each local step ``w_i ← w_i − η(∇ℓ − δ_i)`` (the δ term of
    :func:`graphfl.flower.client.regulariser`, ``δ_i`` kept and updated by ``graphfl_mod``) and
    APFL's personal step on ``v_i`` (:class:`graphfl.flower.client.Personal`); the ClientApp needs
    the mod, ``regulariser``, ``Personal`` and ``personal_model``.

    Parameters
    ----------
    alpha, adaptive_alpha, alpha_lr, personal_output
        As in :class:`APFL`.
    tau, tau_mode
        ``τ`` of the δ update ``δ_i += (u_i − ū)/(η τ)``: 0 (default) = ``local_steps`` (FedTorch);
        otherwise ``tau`` (``absolute``) or ``tau · local_steps`` (``multiple-of-steps``);
        ``τ ≤ local_steps/2`` is refused by name (unstable by construction, C5).
    gamma
        Server step ``γ``.
    client_lr, local_steps
        The ClientApp's SGD step ``η`` and local steps per round (sent as ``graphfl.eta`` /
        ``graphfl.tau``); they must be the ClientApp's own.
    **kwargs
        Common arguments of :class:`~graphfl.flower.adapter.GraphflStrategy`.
    """

    algorithm = "apflgate"

    def __init__(self, alpha: float = 0.5, tau: float = 0.0, tau_mode: str = "absolute", gamma: float = 1.0,
                 adaptive_alpha: bool = False, alpha_lr: float = 0.0, personal_output: str = "local-copy",
                 client_lr: float = 0.1, local_steps: int = 50, **kwargs: Any) -> None:
        params = self.make_params(APFLGateParams, self.algorithm, alpha=alpha, tau=tau, tau_mode=tau_mode,
                                  gamma=gamma, adaptive_alpha=adaptive_alpha, alpha_lr=alpha_lr,
                                  personal_output=personal_output)
        GraphflStrategy.__init__(self, params, **kwargs)
        self.train = self.make_params(TrainConfig, "train", lr=client_lr, local_steps=local_steps)

    def regulariser(self) -> tuple[str, dict[str, Any]] | None:
        tau = effective_tau(self.params.tau, self.params.tau_mode, self.train.local_steps)
        return (keys.GATE + keys.TERM_SEP + keys.PERSONAL, {**self.personal_values(), keys.TAU: tau})

    def anchor_arrays(self, extra: Arrays) -> Arrays:
        return {k[len(U_PREFIX):]: v for k, v in extra.items() if k.startswith(U_PREFIX)}

    def cooperation_steps(self) -> str:
        return PERSONAL_STEPS + "; and `loss = loss + graphfl.flower.client.regulariser(msg)(model)` in the train loss"

    def off_hint(self) -> str:
        return "APFLGate has no stock form; APFL is APFLGate without tracking"


__all__ = ["APFL", "CFL", "JGESR", "APFLGate", "BiGFL", "FeSEM", "FedAMP", "FedAvg", "FedGATE", "FedProx", "Local",
           "PFedGraph"]
