"""FedRelax: model-agnostic FL over networks, one node (ALGORITHMS §7; seed 003).

The mathematics is :mod:`graphfl.p2p.algorithms.fedrelax_math` (the weighted ERM of eq. 10 /
:func:`~graphfl.p2p.algorithms.fedrelax_math.node_update`, and the closed form of Algorithm 2 for linear
models, :func:`~graphfl.p2p.algorithms.fedrelax_math.linear_closed_form`); this module places it on the
p2p contract.

Every node holds any local model that can be fitted with sample weights — a scikit-learn
estimator named in the config, or the built-in linear closed form — and the shared unlabelled
set ``D'`` (``DataProblem.shared``). Models never leave the node: one phase per iteration, channel
``predictions`` (tensor ``yhat``, ``m'`` floats): node ``i`` sends ``ĥ_k^(i)(D')`` to every
neighbour; ``step`` refits on the local data augmented with ``D'`` pseudo-labelled by each
neighbour ``i'`` with weight ``λ · A_ii' · m_i / m'`` (§7.2, the reference-code scaling: seed
eq. 12's λ is twice this λ) — a Jacobi sweep, as :func:`~graphfl.p2p.algorithms.fedrelax_math.run_fedrelax_reference`.

State: ``theta`` = the node's predictions on ``D'`` (what it sends; ``θ`` is not a parameter
vector here, so the drivers do not average it); ``edges[j]`` = ``yhat`` (the last predictions
heard from ``j``) and ``heard`` (1 once heard); ``rng`` = the node's resampling RNG
(``SeedSequence(seed).spawn(n)[i]``, used only by estimators whose ``fit`` has no
``sample_weight``). The fitted model is kept in memory; a restored node refits it from the
stored pseudo-labels when it is needed before the next step (exact for estimators with
``sample_weight`` and for the linear form; a resampling estimator draws afresh).

A neighbour not heard in a round counts with the last predictions heard from it (a node never
heard is left out of the augmented set). The early-stopping rule of the reference
(``tol``) is a global decision and is not used: a p2p run does ``rounds`` sweeps.

Naming a model safely (never unpickled, never arbitrary code)
------------------------------------------------------------
``model = "sklearn.tree.DecisionTreeRegressor"`` — a dotted name ``package.module.Class`` whose
package is ``sklearn`` (or a package listed in ``$GRAPHFL_FEDRELAX_MODULES``, comma separated,
for estimators of your own on the peers' ``PYTHONPATH``); the class must be a scikit-learn
``BaseEstimator`` with ``fit`` and ``predict``. ``model-args`` is a TOML table of constructor
arguments (``fedrelax.model-args = {max_depth = 3}``): strings, numbers, booleans and lists of
them only. ``random_state``, when the estimator has one and it is not given, is fixed per node
from ``(seed, node)``. ``model = "linear"`` is the closed form of Algorithm 2 (``ridge``,
``fit-intercept``).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import threading
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from graphfl.common.config import ConfigError
from graphfl.p2p.algorithms.base import (
    Array,
    Channels,
    ChannelSpecs,
    Inbox,
    NodeContext,
    NodeState,
    Outgoing,
    P2PAlgorithm,
    Phase,
)
from graphfl.p2p.algorithms.registry import P2PAlgorithmSpec, register
from graphfl.p2p.oracles import DATA_PROBLEMS, is_data_problem

logger = logging.getLogger(__name__)

PREDICTIONS = "predictions"
PHASE = Phase("predictions", (PREDICTIONS,))
INITS = ("local", "zero")
LINEAR = "linear"
MODULES_ENV = "GRAPHFL_FEDRELAX_MODULES"
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def _allowed_packages() -> tuple[str, ...]:
    extra = [m.strip() for m in os.environ.get(MODULES_ENV, "").split(",") if m.strip()]
    return ("sklearn", *extra)


def estimator_class(name: str) -> type:
    """The estimator class a config names (module docstring); a :class:`ConfigError` otherwise."""
    if not _NAME_RE.match(name):
        raise ConfigError(f"model = {name!r}: name an estimator class as package.module.Class "
                          f"(e.g. 'sklearn.tree.DecisionTreeRegressor'), or 'linear'")
    module, _, cls_name = name.rpartition(".")
    allowed = _allowed_packages()
    if module.split(".")[0] not in allowed:
        raise ConfigError(f"model = {name!r}: only estimators of the packages {list(allowed)} can be named "
                          f"(add a package of your own to ${MODULES_ENV})")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"model = {name!r}: module {module!r} cannot be imported: {exc}") from None
    cls = getattr(mod, cls_name, None)
    from sklearn.base import BaseEstimator  # scikit-learn: loaded on first use

    if not (isinstance(cls, type) and issubclass(cls, BaseEstimator) and hasattr(cls, "fit") and hasattr(cls, "predict")):
        raise ConfigError(f"model = {name!r} is not a scikit-learn estimator class with fit() and predict()")
    return cls


def _check_arg(key: str, value: Any) -> None:
    if isinstance(value, list):
        for v in value:
            _check_arg(key, v)
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise ConfigError(f"model-args.{key} = {value!r}: only strings, numbers, booleans and lists of them")


def model_args(text: str) -> dict[str, Any]:
    """The ``model-args`` table (stored as JSON text) as a dict of plain values."""
    try:
        args = json.loads(text) if text.strip() else {}
    except ValueError as exc:
        raise ConfigError(f"model-args = {text!r} is not a table of constructor arguments: {exc}") from None
    if not isinstance(args, dict):
        raise ConfigError(f"model-args must be a table (e.g. {{max_depth = 3}}), got {text!r}")
    for k, v in args.items():
        _check_arg(k, v)
    return args


@dataclass(frozen=True)
class FedRelaxParams:
    """Hyperparameters of FedRelax (ALGORITHMS §7.3); each field is a ``[run]`` key (also as
    ``fedrelax.<key>``).

    Attributes
    ----------
    lam
        ``λ >= 0`` (reference-code scaling; default 0.1). ``0`` gives the local fits.
    model
        A scikit-learn estimator class by dotted name (default
        ``sklearn.tree.DecisionTreeRegressor``), or ``linear`` (closed form, Algorithm 2).
    model_args
        Its constructor arguments, a TOML table (default ``{max_depth = 4}``, the reference code's).
    init
        ``local`` (``ĥ_0`` = the local fit, default) | ``zero`` (``ĥ_0 ≡ 0``, seed Algorithm 1).
    fit_intercept, ridge
        ``model = "linear"`` only: intercept and ridge penalty of the closed form.
    resample_size
        Estimators without ``sample_weight``: rows of the weighted resample (0 = as many as rows).
    """

    lam: float = field(default=0.1, metadata={"min": 0.0})
    model: str = "sklearn.tree.DecisionTreeRegressor"
    model_args: str = field(default='{"max_depth": 4}', metadata={"table": True})
    init: str = field(default="local", metadata={"choices": INITS})
    fit_intercept: bool = True
    ridge: float = field(default=0.0, metadata={"min": 0.0})
    resample_size: int = field(default=0, metadata={"min": 0})

    def __post_init__(self) -> None:
        if not self.lam >= 0:
            raise ConfigError(f"lam = {self.lam!r} must be >= 0")
        if self.init not in INITS:
            raise ConfigError(f"init = {self.init!r} is not valid; choose one of {list(INITS)}")
        args = model_args(self.model_args)
        if self.model != LINEAR:
            cls = estimator_class(self.model)
            try:
                cls(**args)
            except TypeError as exc:
                raise ConfigError(f"model-args {args} do not fit {self.model}: {exc}") from None
        elif args and args != {"max_depth": 4}:
            raise ConfigError(f"model = 'linear' takes no model-args (use ridge, fit-intercept), got {args}")


def make_estimator(params: FedRelaxParams, seed: int, node: int) -> Any:
    """Node ``node``'s unfitted estimator (``None`` for ``model = "linear"``); ``random_state`` fixed per node."""
    if params.model == LINEAR:
        return None
    args = model_args(params.model_args)
    est = estimator_class(params.model)(**args)
    if "random_state" in est.get_params() and "random_state" not in args:
        est.set_params(random_state=int(np.random.SeedSequence([seed, node]).generate_state(1)[0]))
    return est


def _is_classifier(est: Any) -> bool:
    from sklearn.base import is_classifier  # scikit-learn: loaded on first use

    return est is not None and bool(is_classifier(est))


class FedRelax(P2PAlgorithm[FedRelaxParams, Any]):
    """FedRelax on one node (module docstring)."""

    name = "fedrelax"
    phases = (PHASE,)
    theta_is_model = False

    def __init__(self, params: FedRelaxParams) -> None:
        super().__init__(params)
        # the fitted models, in memory only (never checkpointed): id(problem) -> (problem, t, model);
        # the problem is held so that its id stays unique
        self._models: dict[int, tuple[Any, int, Any]] = {}
        self._lock = threading.Lock()

    # -- local fits ----------------------------------------------------------------------------
    def _fit(self, oracle: Any, node: int, preds: list[Array], weights: list[float], lam: float,
             rng: np.random.Generator | None) -> Any:
        from graphfl.p2p.algorithms import fedrelax_math as fm  # scikit-learn: loaded on first use

        xs = oracle.shared()
        if self.params.model == LINEAR:
            return fm.linear_closed_form(oracle.x_train, oracle.y_train, xs, preds, weights, lam,
                                         fit_intercept=self.params.fit_intercept, ridge=self.params.ridge)
        est = make_estimator(self.params, int(oracle.seed), node)
        return fm.node_update(est, oracle.x_train, oracle.y_train, xs, preds, weights, lam, rng=rng,
                              resample_size=self.params.resample_size or None)

    def _remember(self, oracle: Any, t: int, model: Any) -> None:
        with self._lock:
            self._models[id(oracle)] = (oracle, t, model)

    def model(self, state: NodeState, oracle: Any) -> Any:
        """The node's fitted model at ``state.t`` (``None`` for ``init = "zero"`` at ``t = 0``).

        From memory, or refitted from the state (the pseudo-labels stored per edge) after a restore.
        """
        with self._lock:
            hit = self._models.get(id(oracle))
        if hit is not None and hit[0] is oracle and hit[1] == state.t:
            return hit[2]
        if state.t == 0 and self.params.init == "zero":
            return None
        node = int(state.aux["node"][0])
        heard = [j for j in sorted(state.edges) if state.edges[j]["heard"][0] == 1.0] if state.t else []
        rng = None
        if state.rng is not None:  # a copy: refitting must not move the node's RNG
            rng = np.random.Generator(type(state.rng.bit_generator)())
            rng.bit_generator.state = state.rng.bit_generator.state
        model = self._fit(oracle, node, [state.edges[j]["yhat"] for j in heard],
                          [float(state.edges[j]["weight"][0]) for j in heard], self.params.lam if state.t else 0.0, rng)
        self._remember(oracle, state.t, model)
        return model

    # -- the node ------------------------------------------------------------------------------
    def channels(self, state: NodeState, ctx: NodeContext) -> ChannelSpecs:
        return {PREDICTIONS: {"yhat": ("float64", (int(state.theta.shape[0]),))}}

    def init(self, oracle: Any, ctx: NodeContext) -> NodeState:
        if not is_data_problem(oracle):
            raise ConfigError(f"node {ctx.node}: fedrelax needs tabular data and a shared set D' (problem one of "
                              f"{list(DATA_PROBLEMS)}), got {type(oracle).__name__}")
        xs = np.asarray(oracle.shared(), np.float64)
        if xs.ndim != 2 or xs.shape[1] != np.asarray(oracle.x_train).shape[1]:
            raise ConfigError(f"node {ctx.node}: the shared set D' has shape {xs.shape}; it needs "
                              f"{np.asarray(oracle.x_train).shape[1]} feature columns like the local data")
        rng = np.random.default_rng(np.random.SeedSequence(int(oracle.seed)).spawn(ctx.num_nodes)[ctx.node])
        m = xs.shape[0]
        if self.params.init == "local":
            model = self._fit(oracle, ctx.node, [], [], 0.0, rng)
            preds = np.asarray(model.predict(xs), dtype=np.float64)
        else:
            model, preds = None, np.zeros(m)
        self._remember(oracle, 0, model)
        edges = {j: {"yhat": np.zeros(m), "heard": np.zeros(1), "weight": np.array([float(ctx.edge_weights.get(j, 1.0))])}
                 for j in ctx.neighbours}
        return NodeState(t=0, theta=preds, aux={"node": np.array([ctx.node])}, edges=edges, rng=rng,
                         loss=self._train_loss(model, oracle))

    def outgoing(self, state: NodeState, phase: Phase, combined: Channels, ctx: NodeContext) -> Outgoing:
        return Outgoing.to_all({PREDICTIONS: {"yhat": state.theta}})

    def combine(self, state: NodeState, inbox: Inbox, ctx: NodeContext) -> Channels:
        return {f"pred/{j}": {"yhat": np.array(msg[PREDICTIONS]["yhat"], np.float64)} for j, msg in inbox.messages.items()}

    def step(self, state: NodeState, combined: Channels | None, oracle: Any, ctx: NodeContext) -> NodeState:
        combined = combined or {}
        edges = {}
        for j, e in state.edges.items():
            got = combined.get(f"pred/{j}")
            edges[j] = {**e, "yhat": got["yhat"], "heard": np.ones(1)} if got is not None else e
        heard = [j for j in sorted(edges) if edges[j]["heard"][0] == 1.0]
        weights = [float(edges[j]["weight"][0]) for j in heard]
        model = self._fit(oracle, ctx.node, [edges[j]["yhat"] for j in heard], weights, self.params.lam, state.rng)
        self._remember(oracle, state.t + 1, model)
        preds = np.asarray(model.predict(oracle.shared()), dtype=np.float64)
        return replace(state, t=state.t + 1, theta=preds, edges=edges, loss=self._train_loss(model, oracle))

    # -- results -------------------------------------------------------------------------------
    def _predict(self, model: Any, x: Array) -> Array:
        if model is None:
            return np.zeros(len(x))
        out: Array = np.asarray(model.predict(x), dtype=np.float64)
        return out

    def _classifier(self) -> bool:
        return self.params.model != LINEAR and _is_classifier(make_estimator(self.params, 0, 0))

    def _error(self, model: Any, x: Array, y: Array) -> float:
        """MSE (regression) or error rate (classifiers) of ``model`` on ``(x, y)``; NaN without rows."""
        if len(y) == 0:
            return float("nan")
        pred = self._predict(model, np.asarray(x, np.float64))
        if self._classifier():
            return float(np.mean(pred != np.asarray(y)))
        return float(np.mean((np.asarray(y, np.float64) - pred) ** 2))

    def _train_loss(self, model: Any, oracle: Any) -> float:
        return self._error(model, oracle.x_train, oracle.y_train)

    def evaluate(self, state: NodeState, oracle: Any) -> float:
        """Test MSE (regressors) or test error rate (classifiers) of the node's current model."""
        return self._error(self.model(state, oracle), oracle.x_test, oracle.y_test)

    def output(self, state: NodeState, oracle: Any) -> dict[str, Array]:
        return {"theta": state.theta}

    def report(self, state: NodeState, oracle: Any, ctx: NodeContext) -> dict[str, Any]:
        model = self.model(state, oracle)
        classifier = self._classifier()
        key = "error" if classifier else "mse"
        metrics: dict[str, float | None] = {}
        for split, x, y in (("train", oracle.x_train, oracle.y_train), ("test", oracle.x_test, oracle.y_test)):
            v = self._error(model, x, y)
            metrics[f"{split}_{key}"] = None if np.isnan(v) else v
            if classifier:
                metrics[f"{split}_acc"] = None if np.isnan(v) else 1.0 - v
        return {"model": self.params.model, "metrics": metrics, "lam": self.params.lam,
                "neighbours_heard": sorted(int(j) for j, e in state.edges.items() if e["heard"][0] == 1.0),
                "predictions_on_shared": state.theta.tolist() if state.theta.size <= 10_000 else None}


SPEC = register(P2PAlgorithmSpec(
    FedRelax.name, FedRelaxParams, FedRelax,
    summary="FedRelax: model-agnostic FL, any scikit-learn estimator, predictions on a shared set (ALGORITHMS §7)",
    example={"problem": "linreg", "lam": 0.5, "model-args": '{"max_depth": 3}'},
    problems=DATA_PROBLEMS,
))

__all__ = ["FedRelax", "FedRelaxParams", "SPEC", "estimator_class", "make_estimator", "model_args"]
