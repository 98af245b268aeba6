"""Benchmark B2 (ALGORITHMS.md §11, §4.9, §5.9; seed 000 Table 10.1 / Fig. 10.3): multi-center FL.

Part 1 — the paper's synthetic experiment: 50 clients whose 8×8 linear ground truths come from a
mixture of 3 Gaussians, 4-NN client graph, MLP 8-16-16-8 (no bias, sigmoid hidden, linear output).
Two generators (``tasks/synthetic.py``):

* ``mixture`` (``synthetic-multicenter``): client i's weight is its mixture sample ``v_i``;
* ``smooth`` (``synthetic-multicenter-smooth``): the paper's graph model, eq. 10.13 — the weights
  are the rows of ``U = ÂV`` (``Â`` the GCN matrix of the 4-NN graph of the samples ``V``).

Methods: FedAvg, FeSEM (K = 3), BiG-FL, local-only training and DFL (DFL-SGD on the task's 4-NN
graph, Metropolis weights, gossip every ``local-steps`` iterations; the p2p in-process driver).

Fair set-up:

* **One optimiser for all**: plain SGD (momentum 0; the client trainers reset momentum buffers
  every round and the DFL step functions have none), ``local-steps`` = 10, batch 20, a constant
  step per method chosen on the validation split (:mod:`graphfl.tasks.holdout`: 20 % of each
  client's training data; the first seed only; criterion = the mean validation MSE over clients
  after the last round). DFL uses the same constant step per iteration.
* **BiG-FL** (ALGORITHMS.md §0.1 C2; proximal LL ridge): the step for each κ of the form's
  ``bigfl_kappas`` (at λ = 0.1, α = 2e-2; κ bounds how far a round moves, so each κ gets its
  own step) and the best (κ, step) pair, then the form's λ × α grid at that pair on validation
  (α is the length of the normalised UL step); a λ that wins at an edge of its grid is extended
  beyond it, ÷ or × 10 at the best α (:func:`extend_lambda_edge`); then the step is searched
  again at the chosen κ, λ, α (:func:`retune_bigfl_step`: the step the lower level tolerates
  depends on λ). A run whose lower level was not strongly convex in
  some round (``ll_min_curvature <= 0``, C2 c; :func:`bigfl_inadmissible`) is excluded whatever
  its validation score, and the result names it with the round and the curvature. Such a tuning
  run stops after that round (:func:`tuning_stop_rule`, the round loop's early stop): its record
  then ends there, marked ``stopped_early``; evaluation cells always run every round. Rounds whose
  implicit solve stopped above its tolerance (C2 d) are counted per run. Every λ in the grid
  is > 0: with λ = 0, φ leaves the lower level and the run is local training with κ, "BiG-FL
  disabled", never a BiG-FL result (:func:`check_bigfl_grid`). The result keeps ``‖φ − I‖_F`` and
  ``‖ĝ‖`` of every round and seed (``bigfl_phi``), and flags (warning + ``degenerate``) a run whose
  φ ends within :data:`PHI_MOVED` of ``I``.
* **FeSEM**: step first (warm-up = ``local-steps``), then the warm-up length ∈ {10, 50, 200, 1000}
  on validation. Reported: the center's test loss (``test_loss``, its default output) and the
  last local model's (``local_test_loss``). A planted-label start (the diagnostic "perfectly
  clustered FeSEM": the first assignment is the true clusters, through a hook on the server core;
  once with the E-step continuing, once with the assignment frozen) shows what clustering alone
  could give.
* **Test graph** (ALGORITHMS §5.9): a homologous graph of 50 new nodes from the same mixture
  (``…-testgraph``). BiG-FL runs its lower level there with φ frozen at the φ it learned on the
  train graph (α = 0; also with φ = I as a control); the other methods have no graph-level state
  that transfers and are trained on the test graph from scratch with their tuned settings.

Part 2 — digits with planted clusters: scikit-learn digits over 12 clients in 3 groups, group g
relabels every digit with its own permutation; client graph = a ring inside each group. BiG-FL
acts on the last layer (``bigfl.layers = net.2``), the hidden layer is averaged. Metric: mean
local test accuracy (step tuned on validation accuracy).

``run(quick, seed, out)`` writes ``<out>/multicenter.{json,md,png}``.

On the benchmark harness (:mod:`graphfl.bench.harness`), in stages that feed each other: a cell
is one harness :class:`~graphfl.bench.harness.Cell` of B2's declaration (:func:`stage_bench`: the
point names the task, size, training profile and server-core hook, the params are the method's
settings; the run-cache key is :func:`_cell_key`'s). The tuning stages chain: each method's step
is a harness :class:`~graphfl.bench.harness.Tuning` (:func:`tune_lr`; for BiG-FL one per κ, an
inadmissible run a failed cell), then BiG-FL's λ × α grid at the best (κ, step) and FeSEM's
warm-up at its step, whose validation cells go through the harness's
:class:`~graphfl.bench.harness.CellRunner` (:func:`run_any`); each
evaluation stage (train graph, FeSEM's planted start, test graph) is a harness ``Bench`` with the
tuned settings fixed per method, run by :func:`~graphfl.bench.harness.run_bench` (plan, estimate,
cache-only); BiG-FL's φ of each train-graph run is carried into the test-graph runs of the same
seed as single cells; the quick form reuses the settings tuned on one generator on the other.
The result layout is the one docs/results/multicenter-* hold.

Compute: every server-based cell runs on the batched engine (:data:`ENGINE`; a strategy whose
trainer cannot be batched is served client by client by that engine itself), DFL on the p2p
in-process driver. The form logs its estimated time (:func:`estimate`) before it starts. A killed run
continues from ``<out>/cache`` (finished cells are read back, an interrupted cell continues after its
last checkpointed round, kept in ``<hash>.run``).
Several processes may share one cache: ``workers`` processes run BiG-FL's train-graph cells when its
settings are known in advance (``bigfl_settings``), ``--only <method>`` processes run one method's
tuning and evaluation cells, and a cell being computed is claimed (:mod:`graphfl.bench.claims`:
``<hash>.running``, naming the holder's host, pid and start time) so the others wait for it, at most
:func:`claim_wait_limit`, instead of running it twice. A resumed cell's wall time covers only its
last part and is left out of the mean wall time. ``--cache-only`` reports what the cache holds
without running anything: the result is then marked PARTIAL and names every missing cell. Each paper
claim gets a verdict computed from the per-seed paired differences (:func:`claim_verdicts`): a seed
on which the method claimed better has no finite final loss is a loss; a missing seed, or one on
which the other method has none, makes the claim not testable.

FeSEM's ``local_test_loss`` is read from the run's curve rows when the round recorder keeps it;
otherwise the bench evaluates the final models once more through the same client exchange.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from graphfl.common.errors import ConfigError
from graphfl.tasks.holdout import VALIDATION_FRACTION, VALIDATION_SUFFIX, validation_task

from . import claims
from .harness import Bench, Cell, CellRunner, Metric, MissingCell, Tuning, run_bench, tune
from .report import write_report
from .runcache import RunCache
from .stats import first_better_on_every_seed, paired_difference

if TYPE_CHECKING:
    from graphfl.server.rounds import StopRule

logger = logging.getLogger(__name__)

NAME = "multicenter"
GENERATORS = {"mixture": "synthetic-multicenter", "smooth": "synthetic-multicenter-smooth"}
TESTGRAPH_SUFFIX = "-testgraph"
METHODS = ("fedavg", "fesem", "bigfl", "local", "dfl")
REAL_METHODS = ("fedavg", "fesem", "bigfl", "local")
NODES = 50
REAL_TASK, REAL_NODES = "digits-permuted", 12

# Shared local optimiser: plain SGD, momentum 0, 10 steps of batch 20 per round; lr tuned per method.
TRAIN = {"train.momentum": 0.0, "train.local-steps": 10, "train.batch-size": 20}
REAL_TRAIN = {"train.momentum": 0.0, "train.local-steps": 10, "train.batch-size": 20,
              "data.dirichlet-alpha": 100.0}
METHOD_PARAMS: dict[str, dict[str, Any]] = {"fesem": {"fesem.k": 3}}
REAL_PARAMS: dict[str, dict[str, Any]] = {
    "fesem": {"fesem.k": 3},
    "bigfl": {"bigfl.layers": "net.2", "bigfl.others": "fedavg"},
}
BIGFL_DEFAULT = {"bigfl.lam": 0.1, "bigfl.alpha": 2e-2}
PHI_MOVED = 0.05
"""A BiG-FL run whose final ``‖φ − I‖_F`` is below this is reported as degenerate (φ did not move)."""
FESEM_WARMUPS = (10, 50, 200, 1000)
GRID_FACTOR = 3.0
"""An edge step that wins is extended by this factor (÷ below the grid, × above)."""
GRID_EXTENSIONS = 2
"""Most steps tried beyond a method's step grid."""
FROZEN = 10**9  # fesem.recluster-every that never re-runs the E-step
ENGINE = "batched"
"""Engine of every server-based run: the batched engine (the in-process engine with a round's clients
trained as one computation; it serves a client on its own where the strategy's trainer cannot be
batched, and its numbers equal the in-process engine's up to summation order)."""


@dataclass(frozen=True)
class Form:
    """What ``--quick`` and the full form run."""

    rounds: int
    seeds: int
    lr_grid: tuple[float, ...]
    real_rounds: int
    real_lr_grid: tuple[float, ...]
    tune_generators: tuple[str, ...]  # generators tuned on their own validation split
    testgraph: tuple[str, ...]  # generators run on the test graph
    bigfl_lambdas: tuple[float, ...] = (0.01, 0.1, 1.0)  # all > 0 (check_bigfl_grid)
    bigfl_alphas: tuple[float, ...] = (5e-3, 2e-2, 5e-2)  # normalised UL step lengths
    bigfl_lambda_extensions: int = 2  # λ tried past a winning edge of bigfl_lambdas (extend_lambda_edge)
    bigfl_kappa_extensions: int = 1  # κ tried past a winning edge of bigfl_kappas in its second pass
    bigfl_kappas: tuple[float, ...] = (0.3, 1.0, 0.1)  # LL ridge weights (proximal ridge), each with its own step;
    # above the data Hessian's curvature deficit (C2 c), which grows as the models train;
    # the order is only the order of computation
    generators: tuple[str, ...] = ("mixture", "smooth")  # generators run on their train graph
    digits: bool = True  # part 2 (digits with permuted-label groups)
    bigfl_settings: dict[str, Any] | None = None
    """BiG-FL's settings chosen on validation by an earlier result (``bigfl_settings_source``); ``None``:
    tuned in this run. A reduced form that cannot afford BiG-FL's tuning at ``rounds`` names it here."""
    bigfl_settings_source: str = ""
    workers: int = 1
    """Processes that run BiG-FL's train-graph cells (known in advance with ``bigfl_settings``) beside the
    main loop; they fill the run cache the main loop then reads."""


QUICK = Form(rounds=15, seeds=3, lr_grid=(0.3, 1.0, 3.0), real_rounds=10, real_lr_grid=(0.1, 0.3, 1.0),
             tune_generators=("smooth",), testgraph=("smooth",), bigfl_lambdas=(0.01, 0.1, 1.0),
             bigfl_alphas=(2e-2, 5e-2))
FULL = Form(rounds=200, seeds=3, lr_grid=(0.1, 0.3, 1.0, 3.0), real_rounds=50, real_lr_grid=(0.03, 0.1, 0.3, 1.0),
            tune_generators=("mixture", "smooth"), testgraph=("mixture", "smooth"))


def unspecified(form: Form) -> list[str]:
    """Every choice the paper does not give (also in docs/strategies.md)."""
    return [
        "inputs X/60 and targets (X W)/60 (the paper's X in [-60, 60]); MSE in those units",
        "MLP 8-16-16-8 without biases, sigmoid after the first two layers, linear output layer",
        "4-NN graph symmetrised by union; mixture centers ~U[-0.5, 0.5]^64, equal weights",
        "generator 'smooth': U = ÂV with Â = D^-1/2 (A+I) D^-1/2 of the 4-NN graph of the mixture samples V "
        "(our reading of 'outputs follow eq. 10.13'); 'mixture': W_i = v_i",
        "test graph: 50 new nodes from the same mixture (same centers), own 4-NN graph and data",
        "test-graph protocol: BiG-FL phi frozen at the train-graph phi (alpha = 0), lower level run for the "
        "same number of rounds; other methods trained on the test graph from scratch (nothing graph-level "
        "transfers)",
        f"rounds T = {form.rounds}" + (" (the full form uses 200, §5.2)" if form.rounds != 200 else " (§5.2)"),
        "optimiser: plain SGD, momentum 0, 10 local steps per round, batch 20, constant step, the same for "
        "every method; DFL = DFL-SGD gossiping every 10 iterations with the same constant step",
        f"step grid {list(form.lr_grid)}, chosen per method on validation ({VALIDATION_FRACTION:.0%} of each "
        "client's training data, first seed) by the mean validation MSE after the last round; a winning "
        f"edge step is extended by x{GRID_FACTOR:g} (or /{GRID_FACTOR:g}), at most {GRID_EXTENSIONS} extra steps",
        "tuning generators: " + ", ".join(form.tune_generators)
        + ("" if len(form.tune_generators) == len(GENERATORS) else
           " (quick form: the other generator reuses these settings)"),
        "BiG-FL tuned coordinate-wise: the step for each kappa in "
        f"{list(form.bigfl_kappas)} at lambda = 0.1, alpha = 2e-2 (the best step/kappa pair), then the lambda x "
        f"alpha grid {list(form.bigfl_lambdas)} x {list(form.bigfl_alphas)} at that step and kappa (lambda = 0 is "
        f"BiG-FL disabled, not in the grid); a winning lambda edge is extended /10 or x10 at the best alpha, at most "
        f"{form.bigfl_lambda_extensions} extra lambdas; then the step is searched again at the chosen kappa, lambda "
        "and alpha (second pass), then kappa at the chosen step, lambda and alpha (the grid's kappas, a winning "
        f"edge extended /{KAPPA_FACTOR:g} or x{KAPPA_FACTOR:g}, at most {form.bigfl_kappa_extensions}; the step is "
        "not searched again at a new kappa); a run whose LL was not strongly convex in some round (ll_min_curvature "
        "<= 0, ALGORITHMS.md §0.1 C2 c) is excluded from the choice",
        "BiG-FL (ALGORITHMS.md §0.1 C2): UL embedding on centred parameters A(Theta - mean)phi, normalised UL "
        "step of length alpha, one lambda for both levels, proximal LL ridge (kappa/2)||theta_i - theta_i^t||^2 "
        "(kappa tuned), q = 10 (paper), implicit hypergradient "
        "with the clients' data Hessians solved by GMRES (block-Jacobi preconditioned after 25 plain iterations) "
        "to relative residual 1e-6 (at most 300 iterations; rounds that stop above it are counted)",
        "FeSEM K = 3 (paper), squared L2 on all parameters, E-step every round, unweighted M-step, "
        "prox-lambda 0, k-means++ on the warmed-up models; step and warm-up tuned on the center's loss",
        f"seeds: {form.seeds} (mean ± sd); digits: {form.real_rounds} rounds, step grid "
        f"{list(form.real_lr_grid)} tuned on validation accuracy, BiG-FL on the last layer with default "
        "lambda/alpha" + ("" if form.digits else " (not run in this form)"),
        f"engine: {ENGINE} (equal to the in-process engine up to summation order); DFL on the p2p in-process driver",
    ] + reductions(form)


def reductions_of(doc: dict[str, Any]) -> list[str]:
    """The reductions written in a result (the ``REDUCED:`` lines of its unspecified settings)."""
    return [u[len("REDUCED: "):] for u in doc.get("unspecified_settings", []) if u.startswith("REDUCED: ")]


def reductions(form: Form) -> list[str]:
    """What ``form`` leaves out of or changes in :data:`FULL` (each a sentence for the result)."""
    out = []
    if form.rounds != FULL.rounds or form.seeds != FULL.seeds:
        out.append(f"REDUCED: {form.rounds} rounds, {form.seeds} seeds (full form: {FULL.rounds}, {FULL.seeds})")
    if form.lr_grid != FULL.lr_grid:
        out.append(f"REDUCED: step grid {list(form.lr_grid)} (full form: {list(FULL.lr_grid)})")
    gone = [g for g in FULL.generators if g not in form.generators]
    if gone:
        out.append(f"REDUCED: generator(s) {gone} not run (train and test graph)")
    if not form.digits and FULL.digits:
        out.append("REDUCED: part 2 (digits with permuted-label groups) not run")
    if form.bigfl_settings is not None:
        out.append(f"REDUCED: BiG-FL not tuned in this run: its settings {form.bigfl_settings} are the ones an "
                   f"earlier result chose on validation ({form.bigfl_settings_source}; its grid is in that "
                   "result's tuning), at that result's rounds")
    return out


# ---------------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------------

Hook = Callable[[Any], None]


def cell_config(strategy: str, task: str, nodes: int, rounds: int, seed: int,
                overrides: dict[str, Any]) -> Any:
    """The run configuration of one bench cell (engine :data:`ENGINE`)."""
    from graphfl.common.config import parse_run_config

    return parse_run_config({"strategy": strategy, "task": task, "nodes": nodes, "rounds": rounds,
                             "seed": seed, "engine": ENGINE, **overrides})


def run_method(strategy: str, task: str, nodes: int, rounds: int, seed: int,
               overrides: dict[str, Any], hook: Hook | None = None, work_dir: Path | None = None,
               stop_when: StopRule | None = None) -> dict[str, Any]:
    """One run on :data:`ENGINE`: curve, per-round server seconds, final core state of interest.

    ``hook(core)`` is called on the freshly built server core (diagnostics: a planted FeSEM
    assignment, a transferred BiG-FL φ). With ``work_dir`` (no hook: a hooked core need not
    pickle) the run checkpoints every round there (:mod:`graphfl.server.checkpoint`, client state
    in ``client-state``) and continues from that checkpoint when one is there: a cell killed in
    round r resumes after r. The folder is removed once the run has finished.
    ``stop_when`` is the round loop's early-stop rule (:data:`graphfl.server.rounds.StopRule`,
    asked about restored rows on resume too): a run it stops has ``stopped_early`` (the round,
    the last round run, the reason) and its curve ends at that round; a run it does not stop
    has exactly the keys and values of a run without it.
    """
    import shutil

    import torch

    import graphfl.strategies.bigfl
    import graphfl.strategies.fesem  # noqa: F401
    from graphfl.client.state_store import CLIENT_STATE_DIR
    from graphfl.common import registry
    from graphfl.common.envinfo import env_info
    from graphfl.server import checkpoint
    from graphfl.server.batched import BatchedExchange
    from graphfl.server.inprocess import InProcessExchange, server_inputs
    from graphfl.server.rounds import RunRecorder, run_federated

    if work_dir is not None and hook is not None:
        raise ValueError("run_method: a hooked run is not checkpointed (work_dir must be None)")
    resume = work_dir is not None and (checkpoint.checkpoint_dir(work_dir) / checkpoint.META).is_file()
    extra: dict[str, Any] = {} if work_dir is None else {"run-key": work_dir.stem[:64], "resume": resume}
    cfg = cell_config(strategy, task, nodes, rounds, seed, {**overrides, **extra})
    if resume:
        logger.info("B2 %s seed %d on %s: continuing from %s", strategy, seed, task, work_dir)
    torch.set_num_threads(1)
    spec = registry.get(strategy)
    agg_seconds: list[float] = []

    def core_factory(ctx: Any) -> Any:
        core = spec.server_core(ctx)
        if hook is None:
            return core
        hook(core)
        inner = core.aggregate_train

        def aggregate_train(server_round: int, updates: Any) -> Any:
            t0 = time.perf_counter()
            out = inner(server_round, updates)
            agg_seconds.append(time.perf_counter() - t0)
            return out

        core.aggregate_train = aggregate_train  # type: ignore[method-assign]
        return core

    timed_spec = dataclasses.replace(spec, server_core=core_factory)
    state_dir = None if work_dir is None else work_dir / CLIENT_STATE_DIR
    exchange = (BatchedExchange(cfg, state_dir=state_dir) if cfg.engine == "batched"
                else InProcessExchange(cfg, state_dir=state_dir))
    recorder = RunRecorder(cfg, strategy, work_dir, name=f"{NAME}-{strategy}",
                           env={**env_info(), "engine": cfg.engine})
    t0 = time.perf_counter()
    core: Any = run_federated(cfg, timed_spec, exchange, server_inputs(cfg), recorder, stop_when)
    wall = time.perf_counter() - t0
    curve = recorder.document()["methods"][strategy]["curve"]
    if hook is None:  # the round loop's own aggregation seconds (the core is not wrapped: it must pickle)
        agg_seconds = [float(sum(ph.get("server_seconds") or 0.0 for ph in row.get("phases", [])))
                       for row in curve if row.get("round", 0) > 0 and row.get("phases")]
    out: dict[str, Any] = {"curve": curve, "aggregate_seconds": agg_seconds, "wall_seconds": wall,
                           "config": cfg.to_json(), "engine": cfg.engine}
    if isinstance(exchange, BatchedExchange):
        out["batched_clients"] = exchange.batched_clients
    if strategy == "fesem":  # ALGORITHMS.md §4.5: the center's loss and the last local model's
        local = curve[-1].get("local_test_loss")
        out["local_test_loss_source"] = "curve"
        out["local_test_loss"] = local
    if strategy == "bigfl":
        out["phi"] = core.phi.clone()
    if "stopped_early" in recorder.extra:
        out["stopped_early"] = dict(recorder.extra["stopped_early"])
    if work_dir is not None:
        out["resumed"] = resume
        shutil.rmtree(work_dir, ignore_errors=True)
    return out


def run_dfl(task: str, nodes: int, rounds: int, seed: int, lr: float) -> dict[str, Any]:
    """DFL-SGD over the task's client graph (in-process p2p driver), in the shape of run_method.

    One round = ``train.local-steps`` iterations, the first of which gossips (ALGORITHMS §2.4 with
    ``tau = local-steps``); constant step ``lr`` (plain SGD, as the server-based methods).
    """
    from graphfl.p2p.algorithms import registry as p2p_registry
    from graphfl.p2p.driver import run_network_inprocess as run_p2p
    from graphfl.p2p.mixing import mixing_matrix
    from graphfl.p2p.oracles import ProblemSpec, make_oracle
    from graphfl.tasks import registry as task_registry

    tau = int(TRAIN["train.local-steps"])
    adj = task_registry.create(task, seed=seed).client_graph(nodes)
    if adj is None:
        raise ValueError(f"task {task!r} has no client graph; run_dfl gossips over it")
    w = mixing_matrix(adj, "metropolis")
    spec = ProblemSpec(task, num_nodes=nodes, seed=seed, batch_size=int(TRAIN["train.batch-size"]))
    algo = p2p_registry.create("dfl-sgd", tau=tau, alpha0=lr, step_rule="constant")
    t0 = time.perf_counter()
    res = run_p2p(algo, [make_oracle(i, spec) for i in range(nodes)], w, rounds * tau, eval_every=1)
    wall = time.perf_counter() - t0
    curve = [{"round": c["round"], "test_loss": c["test_loss"], "seconds": wall / max(rounds, 1),
              "bytes_up": c.get("bytes")} for c in res.curve if "test_loss" in c]
    return {"curve": curve, "aggregate_seconds": [], "wall_seconds": wall,
            "config": {"algorithm": "dfl-sgd", "tau": tau, "alpha": lr, "step_rule": "constant",
                       "mixing": "metropolis", "graph": f"{task} client graph"}}


_cache = RunCache(None)  # run() points it at <out>/cache
RESUMABLE = True
"""An interrupted run continues in the same ``--out`` (finished runs come from ``<out>/cache``)."""


def _cell_key(method: str, task: str, nodes: int, rounds: int, seed: int, settings: dict[str, Any],
              train: dict[str, Any], params: dict[str, dict[str, Any]] | None = None,
              hook_key: str = "") -> dict[str, Any]:
    """The run-cache key of one cell (everything that determines its result, the engine included)."""
    extra = {k: v for k, v in settings.items() if k != "lr"}
    overrides = {**train, "train.lr": float(settings["lr"]), **(params or METHOD_PARAMS).get(method, {}), **extra}
    return {"bench": NAME, "method": method, "task": task, "nodes": nodes, "rounds": rounds, "seed": seed,
            "overrides": overrides, "hook": hook_key, "engine": "p2p-inprocess" if method == "dfl" else ENGINE}


_PROFILES: dict[str, tuple[dict[str, Any], dict[str, dict[str, Any]]]] = {}
"""A cell's training profile by name: (the shared optimiser settings, the per-method strategy settings)."""
_HOOKS: dict[str, Hook] = {}
"""The server-core hook of a cell by its ``hook`` name (part of the cell's key)."""


def _profile(train: dict[str, Any], params: dict[str, dict[str, Any]] | None) -> str:
    """The name of the profile ``(train, params or METHOD_PARAMS)``, registered on first use."""
    pair = (dict(train), dict(params or METHOD_PARAMS))
    for name, known in _PROFILES.items():
        if known == pair:
            return name
    name = f"profile{len(_PROFILES)}"
    _PROFILES[name] = pair
    return name


def cell_of(method: str, task: str, nodes: int, rounds: int, seed: int, settings: dict[str, Any],
            train: dict[str, Any], params: dict[str, dict[str, Any]] | None = None, hook_key: str = "",
            **axes: Any) -> Cell:
    """The harness cell of one B2 run: the point names the task, size, profile and hook; the params are its settings."""
    point = {"task": task, "nodes": nodes, "rounds": rounds, "profile": _profile(train, params), "hook": hook_key,
             **axes}
    return Cell(tuple(point.items()), method, seed, tuple(settings.items()))


def cell_key(cell: Cell) -> dict[str, Any]:
    """The run-cache key of a harness cell (:func:`_cell_key` of what it names; a point's ``base`` holds
    settings a tuning keeps fixed beside the tuned one).
    """
    p = cell.at
    train, params = _PROFILES[p["profile"]]
    return _cell_key(cell.method, p["task"], p["nodes"], p["rounds"], cell.seed, _settings(cell), train, params,
                     p["hook"])


def _settings(cell: Cell) -> dict[str, Any]:
    return {**dict(cell.at.get("base", ())), **cell.settings}


def _run_cell(cell: Cell) -> dict[str, Any]:
    """Compute one cell: DFL on the p2p driver, the others with :func:`run_method` (checkpointed unless hooked)."""
    p, key = cell.at, cell_key(cell)
    if cell.method == "dfl":
        return run_dfl(p["task"], p["nodes"], p["rounds"], cell.seed, float(_settings(cell)["lr"]))
    hook = _HOOKS[p["hook"]] if p["hook"] else None
    work = None if hook is not None or _cache.folder is None else _cache.work_dir(key)
    rule = tuning_stop_rule(cell.method, p["task"])
    return run_method(cell.method, p["task"], p["nodes"], p["rounds"], cell.seed, key["overrides"], hook, work,
                      **({} if rule is None else {"stop_when": rule}))


def _missing(cell: Cell) -> str:
    """What a cache-only report says of a missing cell (with its last checkpointed round, if any)."""
    note = _note_progress(cell_key(cell))
    return f"{cell.method} seed {cell.seed} on {cell.at['task']} not in the cache" + (f"; {note}" if note else "")


def _final(run: dict[str, Any]) -> dict[str, Any]:
    return {k: final_metric(run, k) for k in ("test_loss", "test_acc")} if run.get("curve") else {}


SETTING_ERRORS = (RuntimeError, ValueError, ArithmeticError)
"""What a cell raises at a setting that fails (diverges): a failed setting, not a crash of the benchmark
(:class:`~graphfl.common.errors.ConfigError`, a refused configuration, is raised all the same)."""


def _cells_bench(name: str = NAME) -> Bench:
    """B2's cell declaration on the harness: its key, its computation, claims between processes, the
    cache-only message; a stage (:func:`stage_bench`) adds its methods, point, seeds and settings.
    """
    return Bench(name=name, title="B2 multi-center FL", methods=list(METHODS), points=[], seeds=[],
                 metrics=[Metric("test_loss", "local test MSE")], run_cell=_run_cell, key=cell_key,
                 final=_final, failed=lambda r: None,
                 claim_wait=lambda c: claim_wait_limit(c.method, int(c.at["rounds"])), missing=_missing,
                 seconds=lambda c: float(c.at["rounds"]) * SECONDS_PER_ROUND.get(c.method, SECONDS_PER_ROUND["bigfl"]))


def stage_bench(task: str, rounds: int, seeds: list[int], settings: dict[str, dict[str, Any]],
                methods: list[str], train: dict[str, Any] = TRAIN, params: dict[str, dict[str, Any]] | None = None,
                nodes: int = NODES, variants: dict[str, dict[str, Any]] | None = None, hook_key: str = "") -> Bench:
    """One evaluation stage as a harness benchmark: ``methods`` on ``task`` over ``seeds``, each method at
    the ``settings`` an earlier stage chose (``variants``: one point per named extra setting, e.g. FeSEM's
    planted diagnostic with the assignment frozen).
    """
    base = dict(cell_of("fedavg", task, nodes, rounds, 0, {"lr": 0.0}, train, params, hook_key).point)
    points = [base] if variants is None else [{**base, "variant": v} for v in variants]

    def fixed(point: Any, method: str) -> dict[str, Any]:
        return {**settings[method], **((variants or {}).get(point.get("variant", ""), {}))}

    return dataclasses.replace(_cells_bench(f"{NAME} {task}"), methods=methods, points=points, seeds=list(seeds),
                               params=fixed)


def _stage(task: str, rounds: int, seeds: list[int], settings: dict[str, dict[str, Any]], methods: list[str],
           **kw: Any) -> dict[tuple[str, str], tuple[list[dict[str, Any] | None], list[str]]]:
    """Run (or, cache-only, read) a stage through the harness: ``(variant, method) -> (per-seed runs, failures)``.

    A run is ``None`` where its cell is missing from a cache-only report; ``failures`` then names it.
    """
    bench = stage_bench(task, rounds, seeds, settings, methods, **kw)
    if not methods or not bench.points:
        return {}
    outcome = run_bench(bench, None, cache_only=_CACHE_ONLY, cache_folder=_cache.folder)
    out = {}
    for r in outcome.results:
        k = (r["point"].get("variant", ""), r["method"])
        out[k] = (outcome.runs[(_items(r["point"]), r["method"])], list(r["failures"]))
    return out


def _items(d: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(d.items())


def run_any(method: str, task: str, nodes: int, rounds: int, seed: int, settings: dict[str, Any],
            train: dict[str, Any], params: dict[str, dict[str, Any]] | None = None,
            hook: Hook | None = None, hook_key: str = "") -> dict[str, Any]:
    """``method`` with its settings (``lr`` and, for some, strategy keys) on ``task``: one harness cell.

    Through the run cache and its claims (:class:`~graphfl.bench.harness.CellRunner`); ``hook_key``
    names what ``hook`` does (part of the cache key). In a cache-only report a cell not in the cache
    raises :class:`MissingCell`.
    """
    if hook is not None:
        if not hook_key:
            raise ValueError(f"run_any: a hooked {method} cell needs a hook_key (it is part of the cache key)")
        _HOOKS[hook_key] = hook
    cell = cell_of(method, task, nodes, rounds, seed, settings, train, params, hook_key)
    return CellRunner(_cells_bench(), _cache, cache_only=_CACHE_ONLY).require(cell)


def final_metric(run: dict[str, Any], key: str) -> float | None:
    v = run["curve"][-1].get(key)
    return None if v is None or not np.isfinite(v) else float(v)


def val_score(run: dict[str, Any], classification: bool) -> float:
    """Lower is better: validation MSE, or minus validation accuracy; failures are +inf."""
    v = final_metric(run, "test_acc" if classification else "test_loss")
    if v is None:
        return float("inf")
    return -v if classification else v


# ---------------------------------------------------------------------------------------------
# tuning (validation only)
# ---------------------------------------------------------------------------------------------


def _try(what: str, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
    """``run_any(*args, **kwargs)``, or None (logged) when the setting fails.

    A configuration error (:class:`~graphfl.common.errors.ConfigError`: a refused setting, a
    checkpoint of another configuration) is raised: it says nothing about the setting's
    quality, and counting it as a failed setting would drop that setting from the tuning.
    """
    from graphfl.common.errors import ConfigError

    try:
        return run_any(*args, **kwargs)
    except ConfigError:
        raise
    except (RuntimeError, ValueError, ArithmeticError) as exc:  # a diverging setting must not stop the benchmark
        logger.warning("%s failed: %s", what, exc)
        return None


def tune_lr(method: str, task: str, nodes: int, rounds: int, seed: int, grid: tuple[float, ...],
            train: dict[str, Any], base: dict[str, Any], classification: bool = False,
            params: dict[str, dict[str, Any]] | None = None,
            inadmissible: Callable[[dict[str, Any]], str | None] | None = None,
            excluded: dict[str, str] | None = None) -> dict[str, Any]:
    """The step of ``method`` by validation score (``task`` is a ``+val`` task), a harness :class:`Tuning`.

    The grid is extended past a winning edge (:func:`~graphfl.bench.tuning.search_grid`, ×3, at
    most :data:`GRID_EXTENSIONS` extra steps), so no method is compared at a mere bound. A cell
    that fails (:data:`SETTING_ERRORS`: a diverging setting; a configuration error is raised) is
    not a candidate; nor is a run for which ``inadmissible(run)`` gives a reason (logged, and the
    reason stored in ``excluded`` under ``"lr=<step>"``). ``base`` holds the method's other settings.
    """
    metric = "test_acc" if classification else "test_loss"
    point: dict[str, Any] = {**dict(cell_of(method, task, nodes, rounds, seed, {}, train, params).point),
                             "base": tuple(base.items())}

    def failed(r: dict[str, Any]) -> str | None:
        if r.get("error"):
            return str(r["error"])
        why = None if inadmissible is None else inadmissible(r)
        if why is not None:
            logger.warning("B2 tuning %s %s on %s: %s", method, base, task, why)
        return why

    def via_run_any(cell: Cell) -> dict[str, Any]:  # the cell through the run cache, its claims, cache-only
        return run_any(method, task, nodes, rounds, cell.seed, _settings(cell), train, params)

    bench = dataclasses.replace(
        _cells_bench(f"{NAME} tuning {method}"), methods=[method], points=[point], seeds=[seed], failed=failed,
        run_cell=via_run_any, errors=SETTING_ERRORS, fatal=(ConfigError,),
        tuning=Tuning(param="lr", grid=grid, metric=metric, lower_is_better=not classification, factor=GRID_FACTOR,
                      max_extensions=GRID_EXTENSIONS, seed=seed, fail_if_all_fail=True))
    runner = CellRunner(bench, RunCache(None))  # the search's own memo; run_any holds B2's cache
    rec = tune(bench, point, runner)[(method,)]
    if excluded is not None:
        excluded.update({f"lr={k}": why for k, why in rec["failed"].items() if why.startswith("excluded")})
    if rec.get("all_failed"):
        raise RuntimeError(f"{method}: every step in {grid} failed on {task}")
    chosen = runner(Cell(tuple(point.items()), method, seed, (("lr", rec["chosen"]),), "val"))
    return {"grid": rec["scores"], "lr": rec["chosen"], "at_grid_edge": rec["at_edge"],
            "extended": rec["extended"], "run": chosen}


def check_bigfl_grid(lambdas: tuple[float, ...]) -> None:
    """Refuse a BiG-FL grid with ``λ <= 0``: that run is local training with κ ("BiG-FL disabled",
    ALGORITHMS.md §0.1 C2 e), and a tuning that picked it would report local training as BiG-FL.
    """
    bad = [lam for lam in lambdas if not lam > 0]
    if bad:
        raise ValueError(f"BiG-FL grid lambda {bad}: lambda = 0 removes phi from the lower level "
                         "(BiG-FL disabled); every lambda in the grid must be > 0")


def bigfl_inadmissible(run: dict[str, Any]) -> str | None:
    """Why a BiG-FL validation run cannot be chosen, or ``None``: its lower level was not strongly
    convex in some checked round (``ll_min_curvature <= 0`` or not finite, or a failed block
    factorisation, ``ll_strongly_convex = 0``; ALGORITHMS.md §0.1 C2 c). There ``Θ*(φ)`` is not
    unique and the implicit hypergradient is not its derivative, so the run is not BiG-FL as
    specified, whatever its validation score. The strategy reports the curvature in round 1, every
    ``bigfl.curvature-every`` rounds and in every round whose preconditioner was factorised; the
    rounds in between are not checked.
    """
    for row in run.get("curve", []):
        raw = (row.get("server") or {}).get("ll_min_curvature")
        curv = None if raw is None else float(raw)
        bad = curv is not None and not (np.isfinite(curv) and curv > 0)
        if bad or _server_metric(row, "ll_strongly_convex") == 0:
            shown = "–" if curv is None else f"{curv:.3g}"
            return f"excluded: LL not strongly convex at round {row.get('round')} (min curvature {shown})"
    return None


def _bigfl_round_inadmissible(row: Mapping[str, Any]) -> str | None:
    """:func:`bigfl_inadmissible` of one round's row (the round loop's early-stop rule)."""
    return bigfl_inadmissible({"curve": [row]})


def tuning_stop_rule(method: str, task: str) -> StopRule | None:
    """The early-stop rule of a B2 cell, or ``None`` (the cell runs every round).

    A BiG-FL tuning cell (on a validation task, ``…+val``) stops after the first round whose row
    makes it inadmissible (:func:`bigfl_inadmissible`: the choice excludes it whatever follows, so
    the rounds after it would only cost time); its record ends at that round, with
    ``stopped_early``, and :func:`bigfl_inadmissible` reads it as excluded at that round, as it
    reads a record that ran every round. Every other cell, the evaluation cells (train and test
    graph) included, runs all its rounds. The rule is not part of the run-cache key: a tuning
    cell it does not stop gives exactly the result it gave without it.
    """
    if method == "bigfl" and task.endswith(VALIDATION_SUFFIX):
        return _bigfl_round_inadmissible
    return None


def implicit_unconverged_rounds(run: dict[str, Any]) -> list[int]:
    """Rounds of a BiG-FL run whose implicit solve stopped above its tolerance
    (``implicit_converged = 0``, ALGORITHMS.md §0.1 C2 d).
    """
    return [int(row["round"]) for row in run.get("curve", [])
            if _server_metric(row, "implicit_converged") == 0]


def _bigfl_grid_cell(task: str, rounds: int, seed: int, lr: float, lam: float, alpha: float,
                     kappa: float | None, excluded: dict[str, str],
                     run: dict[str, Any] | None = None) -> tuple[float | None, float | None]:
    """One BiG-FL validation run of the λ × α stage at step ``lr`` (``run``: already computed, else
    run through the cache): its validation MSE (``None`` when it failed, is not finite or is
    inadmissible — the reason logged and stored in ``excluded`` under ``"lam=…, alpha=…"``) and
    its final ``‖φ − I‖_F``.
    """
    if run is None:
        extra = {} if kappa is None else {"bigfl.kappa": kappa}
        run = _try(f"tuning bigfl lam={lam} alpha={alpha}", "bigfl", task, NODES, rounds,
                   seed, {"lr": lr, "bigfl.lam": lam, "bigfl.alpha": alpha, **extra}, TRAIN)
    if run is None:
        return None, None
    why = bigfl_inadmissible(run)
    if why is not None:
        logger.warning("B2 tuning bigfl lam=%g alpha=%g on %s: %s", lam, alpha, task, why)
        excluded[f"lam={lam:g}, alpha={alpha:g}"] = why
    score = float("inf") if why is not None else val_score(run, False)
    return (score if np.isfinite(score) else None), _server_metric(run["curve"][-1], "phi_minus_identity")


def tune_bigfl_grid(task: str, rounds: int, seed: int, lr: float, form: Form,
                    default_run: dict[str, Any], kappa: float | None = None) -> dict[str, Any]:
    """BiG-FL's λ × α grid on validation at step ``lr`` and ``κ = kappa`` (``None``: the strategy's
    default; ``default_run`` = the run at the default λ and α).

    Returns the grid of validation MSEs and of final ``‖φ − I‖_F`` and the chosen ``lam``/``alpha``.
    """
    check_bigfl_grid(form.bigfl_lambdas)
    lam0, alpha0 = BIGFL_DEFAULT["bigfl.lam"], BIGFL_DEFAULT["bigfl.alpha"]
    grid: dict[str, dict[str, float | None]] = {}
    phi_grid: dict[str, dict[str, float | None]] = {}
    excluded: dict[str, str] = {}
    best = (val_score(default_run, False), lam0, alpha0)
    for lam in form.bigfl_lambdas:
        row: dict[str, float | None] = {}
        prow: dict[str, float | None] = {}
        for alpha in form.bigfl_alphas:
            run = default_run if lam == lam0 and alpha == alpha0 else None
            score, phi = _bigfl_grid_cell(task, rounds, seed, lr, lam, alpha, kappa, excluded, run)
            row[f"alpha={alpha:g}"] = score
            prow[f"alpha={alpha:g}"] = phi
            if score is not None and score < best[0]:
                best = (score, lam, alpha)
        grid[f"lam={lam:g}"] = row
        phi_grid[f"lam={lam:g}"] = prow
    # searched beyond the grid only when its winner is a grid cell (not the default run outside it)
    extension = (extend_lambda_edge(task, rounds, seed, lr, form, best[2], kappa, grid, excluded)
                 if best[1] in form.bigfl_lambdas and best[2] in form.bigfl_alphas else None)
    if extension is not None and extension["lam"] is not None and extension["lam"] != best[1]:
        beyond = extension["val_mse"][f"{extension['lam']:g}"]
        if beyond is not None and beyond < best[0]:
            best = (beyond, extension["lam"], best[2])
    return {"lam_alpha_grid_val_mse": grid, "lam_alpha_grid_phi_minus_identity": phi_grid,
            "grid": {"lam": list(form.bigfl_lambdas), "alpha": list(form.bigfl_alphas)},
            "lam_extension": extension,
            "lam": best[1], "alpha": best[2], "excluded": excluded,
            "note": "lambda = 0 (BiG-FL disabled: local training with kappa) is not a BiG-FL setting and is not in "
                    "the grid; a run whose LL was not strongly convex in some round is excluded"}


LAMBDA_FACTOR = 10.0
"""Ratio between a winning edge of BiG-FL's λ grid and the λ tried beyond it (the grid is in decades)."""


def extend_lambda_edge(task: str, rounds: int, seed: int, lr: float, form: Form, alpha: float,
                       kappa: float | None, grid: Mapping[str, Mapping[str, float | None]],
                       excluded: dict[str, str]) -> dict[str, Any]:
    """BiG-FL's λ past a winning edge of the λ × α grid, at the grid's best α.

    The λ column of ``grid`` at ``alpha`` is searched with :func:`~graphfl.bench.tuning.search_grid`
    (factor :data:`LAMBDA_FACTOR`, at most ``form.bigfl_lambda_extensions`` new λ): while the best λ
    is unbracketed (the smallest or the largest tried), one more λ beyond it is run on validation.
    A λ below the grid moves the method towards local training with κ (λ = 0 is not BiG-FL, §0.1
    C2 e, and is never reached: each extension divides by the factor); the extension says where
    the validation optimum lies rather than stopping at a bound. Inadmissible runs score ``None``.

    Returns the λ column searched (``val_mse``, keys ``:g``), the λ run beyond the grid
    (``extended``), the chosen ``lam`` and ``at_edge`` (still unbracketed when the budget ran out).
    """
    from .tuning import search_grid

    column = {lam: grid[f"lam={lam:g}"][f"alpha={alpha:g}"] for lam in form.bigfl_lambdas}
    phi: dict[str, float | None] = {}
    if all(v is None for v in column.values()):  # the winner is the default run outside the grid
        return {"alpha": alpha, "val_mse": {}, "extended": [], "phi_minus_identity": phi, "lam": None,
                "at_edge": False, "factor": LAMBDA_FACTOR, "max_extensions": form.bigfl_lambda_extensions}

    def score(lam: float) -> float | None:
        if lam in column:
            return column[lam]
        score_, phi[f"{lam:g}"] = _bigfl_grid_cell(task, rounds, seed, lr, lam, alpha, kappa, excluded)
        logger.info("B2 tuning bigfl: lambda %g beyond the grid at alpha %g: val MSE %s", lam, alpha, score_)
        return score_

    found = search_grid(score, form.bigfl_lambdas, factor=LAMBDA_FACTOR, max_extensions=form.bigfl_lambda_extensions)
    in_grid = {lam: v for lam, v in column.items() if v is not None}
    grid_best = min(in_grid, key=lambda lam: in_grid[lam])
    chosen_score = found.scores[found.chosen]
    # a λ beyond the grid replaces the grid's best only when strictly better (a tie keeps the grid's λ)
    lam = found.chosen if chosen_score is not None and chosen_score < in_grid[grid_best] else grid_best
    return {"alpha": alpha, "val_mse": found.grid_scores(), "extended": list(found.extended),
            "phi_minus_identity": phi, "lam": lam, "at_edge": found.at_edge and lam == found.chosen,
            "factor": LAMBDA_FACTOR, "max_extensions": form.bigfl_lambda_extensions}


CONSTANT_LEVEL = 0.97
"""A method whose final test MSE is at least this fraction of the best constant predictor's is flagged
as being at the constant-predictor level (a degenerate result, logged and written in the result)."""


def constant_predictors(task: str, nodes: int, seeds: list[int]) -> dict[str, Any]:
    """Trivial baselines on ``task``'s local test splits: no training, mean over clients, per seed.

    ``own-mean`` predicts each client's own training mean of ``y``; ``pooled-mean`` the mean of
    all clients' training ``y``; ``zero`` predicts 0. The metric is the methods' (MSE over a
    client's test samples and outputs, averaged over clients).
    """
    from graphfl.common.config import DataConfig
    from graphfl.tasks import registry

    per: dict[str, list[float]] = {"own-mean": [], "pooled-mean": [], "zero": []}
    for s in seeds:
        t = registry.create(task, data=DataConfig(), data_dir="", seed=s)
        data = [t.client_data(i, nodes) for i in range(nodes)]
        pooled = np.concatenate([np.asarray(d.y_train, np.float64) for d in data]).mean(axis=0)
        ys = [(np.asarray(d.y_test, np.float64), np.asarray(d.y_train, np.float64)) for d in data]
        per["own-mean"].append(float(np.mean([np.mean((yt - ytr.mean(axis=0)) ** 2) for yt, ytr in ys])))
        per["pooled-mean"].append(float(np.mean([np.mean((yt - pooled) ** 2) for yt, _ in ys])))
        per["zero"].append(float(np.mean([np.mean(yt ** 2) for yt, _ in ys])))
    out: dict[str, Any] = {}
    for name, vals in per.items():
        mean, sd = _stats(list(vals))
        out[name] = {"test_loss": mean, "test_loss_sd": sd, "per_seed": vals}
    return out


def at_constant_level(methods: dict[str, Any], constants: dict[str, Any], where: str) -> list[str]:
    """Methods whose final test MSE is within :data:`CONSTANT_LEVEL` of the best constant predictor (logged)."""
    best = min(float(c["test_loss"]) for c in constants.values())
    flagged = []
    for m, r in methods.items():
        v = r["final"].get("test_loss")
        if v is not None and v >= CONSTANT_LEVEL * best:
            flagged.append(m)
            logger.warning("B2 %s: %s's test MSE %.4f is at the constant-predictor level (best constant %.4f): "
                           "it learned nothing beyond a constant", where, m, v, best)
    return flagged


def _server_metric(row: dict[str, Any], key: str) -> float | None:
    v = (row.get("server") or {}).get(key)
    return None if v is None or not np.isfinite(v) else float(v)


def bigfl_phi_report(runs: list[dict[str, Any]], seeds: list[int], where: str) -> dict[str, Any]:
    """``‖φ − I‖_F`` and ``‖ĝ‖`` per round and seed of BiG-FL runs, and the degeneracy flag.

    A run whose final ``‖φ − I‖_F`` is below :data:`PHI_MOVED` is degenerate (φ stayed at the
    identity: the UL did not act); it is logged as a warning and named in ``degenerate``.
    """
    per_seed: dict[str, Any] = {}
    degenerate: list[int] = []
    for s, r in zip(seeds, runs):
        rows = [row for row in r["curve"] if row.get("server")]
        phi = [_server_metric(row, "phi_minus_identity") for row in rows]
        per_seed[str(s)] = {"round": [row["round"] for row in rows], "phi_minus_identity": phi,
                            "hypergrad_norm": [_server_metric(row, "hypergrad_norm") for row in rows],
                            "implicit_residual": [_server_metric(row, "implicit_residual") for row in rows],
                            "implicit_unconverged_rounds": implicit_unconverged_rounds(r)}
        final = phi[-1] if phi else None
        if final is None or final < PHI_MOVED:
            degenerate.append(s)
    finals = [(v["phi_minus_identity"] or [None])[-1] for v in per_seed.values()]
    mean, sd = _stats(finals)
    if degenerate:
        logger.warning("B2 %s: BiG-FL's phi stayed within %g of I (||phi - I||_F final %s) for seed(s) %s: "
                       "the upper level did not act (degenerate)", where, PHI_MOVED, finals, degenerate)
    return {"per_seed": per_seed, "final_phi_minus_identity": finals, "final_phi_minus_identity_mean": mean,
            "final_phi_minus_identity_sd": sd, "threshold": PHI_MOVED, "degenerate": degenerate}


def retune_bigfl_step(task: str, rounds: int, seed: int, form: Form, chosen: Mapping[str, Any]) -> dict[str, Any]:
    """BiG-FL's step searched again at the chosen κ, λ and α (a second coordinate pass).

    The first pass searches the step at the default λ and α; the lower level tolerates a step
    that depends on λ (a larger λ adds curvature and coupling), so the step chosen there can be
    far from the best at the chosen λ. The same search as every method's step
    (:func:`tune_lr`, grid ``form.lr_grid`` extended past a winning edge), inadmissible runs
    excluded. ``chosen`` holds ``lr`` (the first pass's step), ``bigfl.lam``, ``bigfl.alpha`` and
    ``bigfl.kappa``. When λ and α are the defaults the first pass already searched there and
    its step is kept; when every step fails the first pass's step is kept (logged).

    Returns the step grid's validation MSEs (``grid``), the step (``lr``), the excluded steps and
    whether the search ran.
    """
    base = {k: chosen[k] for k in ("bigfl.lam", "bigfl.alpha", "bigfl.kappa")}
    if (base["bigfl.lam"], base["bigfl.alpha"]) == (BIGFL_DEFAULT["bigfl.lam"], BIGFL_DEFAULT["bigfl.alpha"]):
        return {"ran": False, "lr": chosen["lr"], "grid": {}, "excluded": {}}
    why: dict[str, str] = {}
    try:
        t = tune_lr("bigfl", task, NODES, rounds, seed, form.lr_grid, TRAIN, base, inadmissible=bigfl_inadmissible,
                    excluded=why)
    except RuntimeError as exc:
        logger.warning("B2 tuning bigfl: no admissible step at %s (%s); the first pass's step %g is kept",
                       base, exc, chosen["lr"])
        return {"ran": True, "lr": chosen["lr"], "grid": {}, "excluded": why, "all_failed": str(exc)}
    logger.info("B2 tuning bigfl: step at %s: %g (first pass %g)", base, t["lr"], chosen["lr"])
    return {"ran": True, "lr": t["lr"], "first_pass_lr": chosen["lr"], "grid": t["grid"], "excluded": why,
            "at_grid_edge": t["at_grid_edge"]}


KAPPA_FACTOR = 3.0
"""Ratio between a winning edge of BiG-FL's κ grid and the κ tried beyond it (the grid is about ×3 apart)."""
KAPPA_RTOL = 1e-6
"""Relative margin by which another κ's validation MSE must beat the chosen κ's to replace it (a tie,
up to float noise, keeps the κ the earlier passes were tuned at)."""


def retune_bigfl_kappa(task: str, rounds: int, seed: int, form: Form, chosen: Mapping[str, Any],
                       step_pass: Mapping[str, Any]) -> dict[str, Any]:
    """BiG-FL's κ searched again at the chosen step, λ and α (the coordinate pass after the step's).

    The first pass compares κ at the default λ and α, each κ with its own step; once λ and the
    step have moved, another κ may be better (κ weighs the proximal ridge against the data and the
    coupling in the lower level). Each κ of ``form.bigfl_kappas`` is run on validation at the
    chosen ``lr``, ``bigfl.lam`` and ``bigfl.alpha`` (the chosen κ's run is the step pass's, read
    from the cache); a winning edge is searched beyond by ``form.bigfl_kappa_extensions`` more κ
    (÷ or × :data:`KAPPA_FACTOR`, :func:`~graphfl.bench.tuning.search_grid`). A run whose lower
    level lost strong convexity (:func:`bigfl_inadmissible`) or failed scores ``None``. Another κ
    replaces the chosen one only when better by more than :data:`KAPPA_RTOL` (relative). When
    the step pass did not run (λ and α are the defaults the first pass compared κ at), nothing
    runs. The step is not searched again at a new κ (the result says so).

    Returns the validation MSE per κ (keys ``:g``), the κ run beyond the grid, the excluded κ with
    their reason, the chosen ``kappa`` and whether the pass ran.
    """
    from .tuning import search_grid

    kappa0 = float(chosen["bigfl.kappa"])
    if not step_pass.get("ran"):
        return {"ran": False, "kappa": kappa0, "val_mse": {}, "extended": [], "excluded": {}}
    settings = {k: chosen[k] for k in ("lr", "bigfl.lam", "bigfl.alpha")}
    excluded: dict[str, str] = {}
    phi: dict[str, float | None] = {}

    def score(kappa: float) -> float | None:  # the λ × α stage's validation cell, at this κ
        why: dict[str, str] = {}
        value, phi[f"{kappa:g}"] = _bigfl_grid_cell(task, rounds, seed, settings["lr"], settings["bigfl.lam"],
                                                    settings["bigfl.alpha"], kappa, why)
        excluded.update({f"kappa={kappa:g}": reason for reason in why.values()})
        logger.info("B2 tuning bigfl: kappa %g at %s: val MSE %s", kappa, settings, value)
        return value

    try:
        found = search_grid(score, (*form.bigfl_kappas, kappa0), factor=KAPPA_FACTOR,
                            max_extensions=form.bigfl_kappa_extensions)
    except RuntimeError as exc:
        logger.warning("B2 tuning bigfl: no admissible kappa at %s (%s); kappa %g is kept", settings, exc, kappa0)
        return {"ran": True, "kappa": kappa0, "val_mse": {}, "extended": [], "excluded": excluded,
                "all_failed": str(exc)}
    at_chosen, best_score = found.scores.get(kappa0), found.scores[found.chosen]
    better = best_score is not None and (at_chosen is None or best_score < at_chosen * (1 - KAPPA_RTOL))
    kappa = found.chosen if better else kappa0
    logger.info("B2 tuning bigfl: kappa at %s: %g (before %g)", settings, kappa, kappa0)
    return {"ran": True, "kappa": kappa, "first_pass_kappa": kappa0, "val_mse": found.grid_scores(),
            "extended": list(found.extended), "phi_minus_identity": phi, "excluded": excluded,
            "at_edge": found.at_edge and kappa == found.chosen, "factor": KAPPA_FACTOR,
            "max_extensions": form.bigfl_kappa_extensions,
            "note": "kappa compared at the chosen step, lambda and alpha; the step is not searched again at a new kappa"}


def tune_bigfl_kappas(task: str, rounds: int, seed: int, form: Form, base: dict[str, Any]
                      ) -> tuple[dict[float, dict[str, Any]], dict[str, dict[str, str]]]:
    """BiG-FL's step for each κ of ``form.bigfl_kappas`` on validation, admissible runs only.

    A run whose lower level was not strongly convex in some round (:func:`bigfl_inadmissible`,
    ALGORITHMS.md §0.1 C2 c) is not a candidate; a κ left without an admissible step is excluded.
    Returns the tuning of each admissible κ and, per κ, the excluded steps with their reason.

    Raises
    ------
    RuntimeError
        When no κ of the grid has an admissible run (the grid needs larger κ).
    """
    per_kappa: dict[float, dict[str, Any]] = {}
    excluded: dict[str, dict[str, str]] = {}
    for k in form.bigfl_kappas:
        why: dict[str, str] = {}
        try:
            per_kappa[k] = tune_lr("bigfl", task, NODES, rounds, seed, form.lr_grid, TRAIN, {**base, "bigfl.kappa": k},
                                   inadmissible=bigfl_inadmissible, excluded=why)
        except RuntimeError as exc:
            why.setdefault("all", str(exc))
            logger.warning("B2 tuning bigfl on %s: kappa %g excluded: %s", task, k, why)
        if why:
            excluded[f"kappa={k:g}"] = why
    if not per_kappa:
        raise RuntimeError(f"bigfl: no kappa in {list(form.bigfl_kappas)} gives a strongly convex lower level with a "
                           f"finite validation score on {task} ({excluded}); extend the kappa grid upwards")
    return per_kappa, excluded


def tune_generator(gen: str, form: Form, seed: int, methods: tuple[str, ...] = METHODS) -> dict[str, Any]:
    """The settings of ``methods`` (default: every method) for generator ``gen`` from its validation split."""
    task = validation_task(GENERATORS[gen])
    rounds = form.rounds
    out: dict[str, Any] = {"task": task}
    settings: dict[str, dict[str, Any]] = {}
    for m in methods:
        base = dict(BIGFL_DEFAULT) if m == "bigfl" else {}
        if m == "bigfl" and form.bigfl_settings is not None:
            st = dict(form.bigfl_settings)
            check_bigfl_grid((float(st["bigfl.lam"]),))
            out[m] = {"lr_grid_val_mse": {}, "lr": float(st["lr"]), "lr_at_grid_edge": False, "lr_grid_extended": [],
                      "from_earlier": form.bigfl_settings_source}
            settings[m] = st
            logger.info("B2 BiG-FL settings from an earlier validation tuning (%s): %s",
                        form.bigfl_settings_source, st)
            continue
        try:
            logger.info("B2 tuning %s on %s (%d rounds)", m, task, rounds)
            if m == "bigfl":  # the step for each κ (κ bounds how far a round moves), the best admissible pair
                per_kappa, kappa_excluded = tune_bigfl_kappas(task, rounds, seed, form, base)
                kappa = min(per_kappa, key=lambda k: val_score(per_kappa[k]["run"], False))
                base["bigfl.kappa"] = kappa
                t = per_kappa[kappa]
            else:
                t = tune_lr(m, task, NODES, rounds, seed, form.lr_grid, TRAIN, base)
            out[m] = {"lr_grid_val_mse": t["grid"], "lr": t["lr"], "lr_at_grid_edge": t["at_grid_edge"],
                      "lr_grid_extended": t["extended"]}
            settings[m] = {"lr": t["lr"], **base}
            lr = t["lr"]
            if m == "bigfl":
                grid = tune_bigfl_grid(task, rounds, seed, lr, form, t["run"], kappa=base["bigfl.kappa"])
                out[m].update(grid)
                out[m]["kappa"] = base["bigfl.kappa"]
                out[m]["kappa_step_grid_val_mse"] = {f"kappa={k:g}": {"lr_grid_val_mse": v["grid"], "lr": v["lr"]}
                                                     for k, v in per_kappa.items()}
                out[m]["kappa_excluded"] = kappa_excluded
                out[m]["implicit_unconverged_rounds"] = implicit_unconverged_rounds(t["run"])
                settings[m] = {"lr": t["lr"], "bigfl.lam": grid["lam"], "bigfl.alpha": grid["alpha"],
                               "bigfl.kappa": base["bigfl.kappa"]}
                out[m]["step_second_pass"] = retune_bigfl_step(task, rounds, seed, form, settings[m])
                settings[m]["lr"] = out[m]["step_second_pass"]["lr"]
                out[m]["kappa_second_pass"] = retune_bigfl_kappa(task, rounds, seed, form, settings[m],
                                                                 out[m]["step_second_pass"])
                settings[m]["bigfl.kappa"] = out[m]["kappa_second_pass"]["kappa"]
            if m == "fesem":
                sweep: dict[str, dict[str, float | None]] = {}
                best_w = (val_score(t["run"], False), int(TRAIN["train.local-steps"]))
                for warm in FESEM_WARMUPS:
                    if warm == int(TRAIN["train.local-steps"]):
                        r = t["run"]
                    else:
                        r = _try(f"tuning fesem warm-up {warm}", "fesem", task, NODES, rounds, seed,
                                 {"lr": lr, "fesem.warmup-steps": warm}, TRAIN)
                    s = float("inf") if r is None else val_score(r, False)
                    ari = None if r is None else (r["curve"][-1].get("server") or {}).get("ari")
                    sweep[str(warm)] = {"val_mse": s if np.isfinite(s) else None, "ari": ari,
                                        "val_local_mse": None if r is None else r.get("local_test_loss")}
                    if s < best_w[0]:
                        best_w = (s, warm)
                out[m]["warmup_sweep"] = sweep
                out[m]["warmup_steps"] = best_w[1]
                settings[m] = {"lr": t["lr"], "fesem.warmup-steps": best_w[1]}
        except MissingCell as exc:  # a cache-only report: the method is left out, named
            out[m] = {"unfinished": str(exc)}
            settings.pop(m, None)
    out["settings"] = settings
    return out


# ---------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------


def _stats(values: list[float | None]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None and np.isfinite(v)]
    if not vals:
        return None, None
    return float(np.mean(vals)), float(np.std(vals, ddof=1)) if len(vals) > 1 else None


def _combine(runs: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """Mean ± sd over seeds, round by round, plus the final values per seed."""
    rounds = sorted({row["round"] for r in runs for row in r["curve"]})
    curve = []
    for rd in rounds:
        rows: list[dict[str, Any]] = [next((row for row in r["curve"] if row["round"] == rd), {}) for r in runs]
        mean, sd = _stats([row.get(metric) for row in rows])
        entry: dict[str, Any] = {"round": rd, metric: mean, f"{metric}_sd": sd}
        for key in ("seconds", "bytes_up", "bytes_down", "local_test_loss"):
            m, _ = _stats([row.get(key) for row in rows])
            if m is not None:
                entry[key] = m
        aris = [(row.get("server") or {}).get("ari") for row in rows]
        if any(a is not None for a in aris):
            entry["ari"], entry["ari_sd"] = _stats(aris)
        for key in ("phi_minus_identity", "hypergrad_norm"):  # BiG-FL's UL, every round
            vals = [_server_metric(row, key) for row in rows]
            if any(v is not None for v in vals):
                entry[key], entry[f"{key}_sd"] = _stats(vals)
        curve.append(entry)
    finals = [final_metric(r, metric) for r in runs]
    mean, sd = _stats(finals)
    agg = [s for r in runs for s in r["aggregate_seconds"]]
    walls = [r["wall_seconds"] for r in runs if not r.get("resumed")]  # a resumed run timed only its last part
    final: dict[str, Any] = {metric: mean, f"{metric}_sd": sd, "per_seed": finals,
                             "aggregate_seconds_per_round": float(np.mean(agg)) if agg else None,
                             "wall_seconds": float(np.mean(walls)) if walls else None,
                             "wall_seconds_resumed_excluded": len(runs) - len(walls)}
    if any("local_test_loss" in r for r in runs):
        locs = [r.get("local_test_loss") for r in runs]
        final["local_test_loss"], final["local_test_loss_sd"] = _stats(locs)
        final["local_test_loss_per_seed"] = locs
        final["local_test_loss_source"] = runs[0].get("local_test_loss_source")
    aris = [(r["curve"][-1].get("server") or {}).get("ari") for r in runs]
    if any(a is not None for a in aris):
        final["ari"], final["ari_sd"] = _stats(aris)
        final["ari_per_seed"] = aris
    return {"final": final, "curve": curve}


def _paired(a: dict[str, Any], b: dict[str, Any], expected: int | None = None) -> dict[str, Any]:
    """Per-seed ``a − b`` of the final test loss (negative = ``a`` better), the sign count, and which
    seeds are missing or non-finite (:func:`bench.stats.paired_difference` over ``expected`` seeds).
    """
    return paired_difference(a["final"]["per_seed"], b["final"]["per_seed"], expected=expected)


# ---------------------------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------------------------


def planted_hook(core: Any) -> None:
    """FeSEM diagnostic: form the first centers from the task's TRUE clusters (not k-means).

    Replaces the core's center initialisation after the warm-up round: assignment = planted
    labels, centers = the members' mean. Needs a task with ``cluster_labels``.
    """
    if core.labels is None:
        raise ValueError("planted start needs a task with cluster labels")

    def init() -> None:
        have = core.have
        core.assign[:] = -1
        core.assign[have] = np.asarray(core.labels)[have]
        core.centers = np.zeros((core.params.k, core.dim))
        core._mstep()

    core._initialise_centers = init


_HOOKS["planted"] = planted_hook
PLANTED = {"planted, EM continues": {}, "planted, assignment frozen": {"fesem.recluster-every": FROZEN}}
"""FeSEM's planted-start diagnostic: its two variants and their extra settings."""


SECONDS_PER_ROUND = {"fedavg": 0.2, "fesem": 0.2, "local": 0.03, "dfl": 0.4, "bigfl": 7.0,
                     "bigfl-frozen": 0.5, "digits": 0.05}
"""Wall seconds per round of one 50-client cell (digits: 12 clients) on the batched engine, measured on
the shared 2-core machine under load; :func:`estimate` multiplies them by the form's cells."""


def estimate(form: Form) -> dict[str, Any]:
    """Cells and serial wall time of ``form`` (:data:`SECONDS_PER_ROUND`; step-grid extensions not
    counted; BiG-FL's λ extensions and second step and κ passes counted at their most).
    """
    tune = len(form.tune_generators)
    steps = len(form.lr_grid)
    cells: dict[str, int] = {
        "fedavg": tune * steps + len(form.generators) * form.seeds + len(form.testgraph) * form.seeds,
        "fesem": tune * (steps + len(FESEM_WARMUPS) - 1) + 3 * len(form.generators) * form.seeds
        + len(form.testgraph) * form.seeds,
        "local": tune * steps + len(form.generators) * form.seeds + len(form.testgraph) * form.seeds,
        "dfl": tune * steps + len(form.generators) * form.seeds + len(form.testgraph) * form.seeds,
        "bigfl": (0 if form.bigfl_settings is not None else
                  tune * (len(form.bigfl_kappas) * steps + len(form.bigfl_lambdas) * len(form.bigfl_alphas) - 1
                          + form.bigfl_lambda_extensions + steps
                          + len(form.bigfl_kappas) - 1 + form.bigfl_kappa_extensions))
        + len(form.generators) * form.seeds,
        "bigfl-frozen": 2 * len(form.testgraph) * form.seeds,
    }
    seconds = {m: n * form.rounds * SECONDS_PER_ROUND[m] for m, n in cells.items()}
    if form.digits:
        cells["digits"] = len(REAL_METHODS) * (len(form.real_lr_grid) + form.seeds)
        seconds["digits"] = cells["digits"] * form.real_rounds * SECONDS_PER_ROUND["digits"]
    total = float(sum(seconds.values()))
    parallel = total - seconds["bigfl"] + seconds["bigfl"] / max(1, form.workers) if form.bigfl_settings else total
    text = (f"{sum(cells.values())} cells of {form.rounds} rounds, about {total / 60:.0f} min serial"
            + (f", about {parallel / 60:.0f} min with {form.workers} BiG-FL workers" if parallel != total else "")
            + " (" + ", ".join(f"{m} {seconds[m] / 60:.0f} min" for m in seconds) + ")")
    return {"cells": cells, "seconds": seconds, "serial_seconds": total, "seconds_with_workers": parallel,
            "text": text}


def precompute_method(form: Form, method: str, seed: int = 0) -> None:
    """One method's tuning and evaluation cells (and FeSEM's planted diagnostics) into the run cache.

    Run beside :func:`run` in other processes sharing its ``<out>/cache`` (``--only``), it splits the
    form's cells by method; the cells a process computes are claimed, so no cell runs twice.
    """
    seeds = [seed + k for k in range(form.seeds)]
    tuning = {gen: tune_generator(gen, form, seed, methods=(method,)) for gen in form.tune_generators}
    settings_of = {gen: tuning[gen if gen in tuning else form.tune_generators[0]]["settings"] for gen in GENERATORS}
    precompute_others(form, settings_of, seeds, methods=(method,))


def precompute_others(form: Form, settings_of: dict[str, dict[str, Any]], seeds: list[int],
                      methods: tuple[str, ...] = METHODS) -> None:
    """Every cell that needs no BiG-FL result (the other methods on the train and test graphs, the
    planted FeSEM diagnostics), into the run cache, before the loops that also need BiG-FL's cells:
    an interrupted run then holds complete comparisons of the other methods.
    """
    for gen in form.generators:
        st = settings_of[gen]
        tasks = [GENERATORS[gen]] + ([GENERATORS[gen] + TESTGRAPH_SUFFIX] if gen in form.testgraph else [])
        for task in tasks:
            _stage(task, form.rounds, seeds, st, [m for m in methods if m != "bigfl"])
            if "fesem" in methods and not task.endswith(TESTGRAPH_SUFFIX):
                _stage(task, form.rounds, seeds, st, ["fesem"], variants=PLANTED, hook_key="planted")


CLAIM_POLL_SECONDS = claims.POLL_SECONDS
"""How often a process waits for a cell that another process (a BiG-FL worker) is computing."""
CLAIM_WAIT_FACTOR = 20.0
"""A wait for another process's cell ends in an error after this many times the cell's estimate
(:data:`SECONDS_PER_ROUND` × rounds), and never before :data:`CLAIM_WAIT_MIN_SECONDS`."""
CLAIM_WAIT_MIN_SECONDS = 3600.0


def claim_wait_limit(method: str, rounds: int) -> float:
    """Seconds to wait for another process computing a ``method`` cell of ``rounds`` rounds."""
    per_round = SECONDS_PER_ROUND.get(method, max(SECONDS_PER_ROUND.values()))
    return max(CLAIM_WAIT_MIN_SECONDS, CLAIM_WAIT_FACTOR * per_round * max(int(rounds), 1))


def _claim_file(key: dict[str, Any]) -> Path | None:
    """``<cache>/<key hash>.running``: the identity of the process computing ``key``'s cell."""
    return claims.claim_file(_cache, key)


def claimed(key: dict[str, Any]) -> bool:
    """Whether a live process other than this one has claimed ``key``'s cell (:mod:`graphfl.bench.claims`)."""
    return claims.claimed(_cache, key)


def claim(key: dict[str, Any]) -> contextlib.AbstractContextManager[bool]:
    """Claim ``key``'s cell in B2's cache (:func:`graphfl.bench.claims.claim`)."""
    return claims.claim(_cache, key)


def wait_for_claim(key: dict[str, Any], poll: float = CLAIM_POLL_SECONDS, limit: float | None = None) -> None:
    """Wait while another live process computes ``key``'s cell, at most ``limit`` seconds (default
    :func:`claim_wait_limit` of the cell; :func:`graphfl.bench.claims.wait_for_claim`).
    """
    limit = claim_wait_limit(key["method"], key["rounds"]) if limit is None else limit
    claims.wait_for_claim(_cache, key, limit, f"{key['method']} {key['task']} seed {key['seed']}", poll)


def _prewarm_job(args: tuple[Any, ...]) -> None:
    """One BiG-FL train-graph cell in a worker process, into the shared run cache (not returned)."""
    global _cache
    cache_dir, task, rounds, seed, settings = args
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(message)s")
    _cache = RunCache(Path(cache_dir))
    import os

    logger.info("B2 worker %d: bigfl %s seed %d (%d rounds)", os.getpid(), task, seed, rounds)
    run_any("bigfl", task, NODES, rounds, seed, settings, TRAIN)


def prewarm_bigfl(form: Form, seeds: list[int], cache_dir: Path) -> tuple[Any, list[Any]]:
    """Start BiG-FL's train-graph cells in ``form.workers`` processes when their settings are known
    (``form.bigfl_settings``); returns the pool and the futures (none when ``workers <= 1``).
    """
    if form.bigfl_settings is None or form.workers <= 1:
        return None, []
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(str(cache_dir), GENERATORS[g], form.rounds, s, dict(form.bigfl_settings))
            for g in form.generators for s in seeds]
    jobs = [j for j in jobs if not _cache.has(k := _cell_key("bigfl", j[1], NODES, j[2], j[3], j[4], TRAIN))
            and not claimed(k)]
    if not jobs:
        return None, []
    pool = ProcessPoolExecutor(min(form.workers, len(jobs)))
    return pool, [pool.submit(_prewarm_job, j) for j in jobs]


def phi_key(phi: Any) -> str:
    """Cache-key name of a φ (a hash of its values)."""
    import hashlib

    return "phi:" + hashlib.sha1(np.ascontiguousarray(np.asarray(phi, dtype=np.float64)).tobytes()).hexdigest()[:16]


def phi_hook(phi: Any) -> Hook:
    """BiG-FL test-graph protocol: start (and, with α = 0, stay) at a given φ."""

    def hook(core: Any) -> None:
        core.phi = phi.clone()
        core._refresh()

    return hook


def run(quick: bool = False, seed: int = 0, out: Path | str = Path("runs/bench"),
        form: Form | None = None, cache_only: bool = False, notes: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run B2 (+ the digits planted-cluster study) and write ``<out>/multicenter.*``.

    Parameters
    ----------
    quick
        15 rounds, 3 seeds, a 3-point step grid (extended past a winning edge), tuning and the
        test graph on the ``smooth`` generator only, digits 10 rounds. The full form: T = 200 rounds (§5.2), 3 seeds, a
        4-point grid, both generators tuned and run on their test graphs, digits 50 rounds.
    seed
        First seed (also the tuning seed).
    out
        Output folder.
    form
        Replaces the quick/full form (a cut-down check; written to the result's ``config.form``).
    cache_only
        Report what ``<out>/cache`` holds and run nothing: a cell not there leaves its method out of
        its comparison, named in the result's ``unfinished`` (a PARTIAL result).
    notes
        Lines on how the run went (machine load, where it was stopped), written into the result.
    """
    from graphfl.common.envinfo import env_info

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    form = form or (QUICK if quick else FULL)
    seeds = [seed + k for k in range(form.seeds)]
    t_start = time.perf_counter()
    global _cache, _CACHE_ONLY
    _cache = RunCache(out / "cache")
    _CACHE_ONLY = cache_only
    unfinished: list[str] = []

    logger.info("B2 form %s: %s", "quick" if quick else "full", estimate(form)["text"])
    pool, pending = (None, []) if cache_only else prewarm_bigfl(form, seeds, out / "cache")
    tuning: dict[str, Any] = {}
    for gen in form.tune_generators:
        tuning[gen] = tune_generator(gen, form, seed)
    settings_of = {gen: tuning[gen if gen in tuning else form.tune_generators[0]]["settings"] for gen in GENERATORS}

    if not cache_only:
        precompute_others(form, settings_of, seeds)
    waves = -(-len(pending) // max(form.workers, 1))  # the workers run the cells this many at a time
    deadline = time.monotonic() + waves * claim_wait_limit("bigfl", form.rounds)
    for f in pending:  # the cells are then in the cache; a failed one is computed again below (and fails there)
        try:
            f.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError as exc:
            for proc in list(getattr(pool, "_processes", {}).values()):  # the workers this run started
                proc.terminate()
            raise TimeoutError(f"B2: the BiG-FL train-graph cells in worker processes did not finish within "
                               f"{waves * claim_wait_limit('bigfl', form.rounds):.0f} s ({waves} wave(s) of "
                               f"{claim_wait_limit('bigfl', form.rounds):.0f} s); their progress is checkpointed "
                               "in the run cache, run again to resume") from exc
        except Exception:  # reported again when the main loop runs the cell itself
            logger.exception("B2 BiG-FL cell in a worker failed")
    if pool is not None:
        pool.shutdown()
    results: dict[str, Any] = {}
    phis: dict[tuple[str, int], Any] = {}
    b2_runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for gen in form.generators:
        task = GENERATORS[gen]
        st = settings_of[gen]
        res: dict[str, Any] = {"task": task, "graph": "train", "methods": {}}
        b2_runs[gen] = {}
        stage = _stage(task, form.rounds, seeds, st, [m for m in METHODS if m in st])
        for m in METHODS:
            if m not in st:
                unfinished.append(f"{gen} generator, train graph: {m} (its tuning is unfinished)")
                continue
            found, missing = stage[("", m)]  # every seed is looked at: the report shows each one's progress
            if missing:
                unfinished.append(f"{gen} generator, train graph: {m} ({'; '.join(missing)})")
                continue
            runs = [r for r in found if r is not None]
            if m == "bigfl":
                for s, r in zip(seeds, runs):
                    phis[(gen, s)] = r.pop("phi")
            b2_runs[gen][m] = runs
            res["methods"][m] = {**_combine(runs, "test_loss"), "settings": st[m]}
            if m == "bigfl":
                res["bigfl_phi"] = bigfl_phi_report(runs, seeds, f"{gen} generator, train graph")
        # diagnostic: FeSEM started from the planted clusters (test split; not a tuned method)
        diag: dict[str, Any] = {}
        planted = _stage(task, form.rounds, seeds, st, ["fesem"], variants=PLANTED, hook_key="planted") \
            if "fesem" in st else {}
        for label in PLANTED if planted else ():
            found, missing = planted[(label, "fesem")]
            if missing:
                unfinished.append(f"{gen} generator, train graph: FeSEM diagnostic {label} ({'; '.join(missing)})")
                continue
            diag[label] = _combine([r for r in found if r is not None], "test_loss")
        res["fesem_planted"] = diag
        res["constant_predictors"] = constant_predictors(task, NODES, seeds)
        res["at_constant_level"] = at_constant_level(res["methods"], res["constant_predictors"],
                                                     f"{gen} generator, train graph")
        mm = res["methods"]
        res["paired"] = paired_table(mm, TRAIN_PAIRS, len(seeds))
        results[gen] = res

    testgraph: dict[str, Any] = {}
    for gen in form.testgraph:
        st = settings_of[gen]
        task = GENERATORS[gen] + TESTGRAPH_SUFFIX
        res = {"task": task, "graph": "test", "methods": {}}
        stage = _stage(task, form.rounds, seeds, st, [m for m in METHODS if m != "bigfl" and m in st])
        for m in METHODS:
            if m == "bigfl":
                continue
            if m not in st:
                unfinished.append(f"{gen} generator, test graph: {m} (its tuning is unfinished)")
                continue
            found, missing = stage[("", m)]
            if missing:
                unfinished.append(f"{gen} generator, test graph: {m} ({'; '.join(missing)})")
                continue
            res["methods"][m] = {**_combine([r for r in found if r is not None], "test_loss"), "settings": st[m]}
        if "bigfl" not in st:  # a cache-only report before BiG-FL's tuning finished
            unfinished.append(f"{gen} generator, test graph: bigfl (its tuning is unfinished)")
        frozen = {**st.get("bigfl", {"lr": 0.0}), "bigfl.alpha": 0.0, "bigfl.hypergrad-mode": "first_order"}
        try:
            if "bigfl" not in st:
                raise MissingCell("needs BiG-FL's validation tuning")
            if any((gen, s) not in phis for s in seeds):
                raise MissingCell("needs BiG-FL's train-graph phi of every seed")
            runs = [run_any("bigfl", task, NODES, form.rounds, s, frozen, TRAIN, hook=phi_hook(phis[(gen, s)]),
                            hook_key=phi_key(phis[(gen, s)])) for s in seeds]
            for r in runs:
                r.pop("phi", None)
            res["methods"]["bigfl"] = {**_combine(runs, "test_loss"), "settings": frozen,
                                       "protocol": "phi learned on the train graph (same seed), frozen"}
        except MissingCell as exc:
            unfinished.append(f"{gen} generator, test graph: bigfl, learned phi ({exc})")
        try:
            if "bigfl" not in st:
                raise MissingCell("needs BiG-FL's validation tuning")
            runs = [run_any("bigfl", task, NODES, form.rounds, s, frozen, TRAIN) for s in seeds]
            for r in runs:
                r.pop("phi", None)
            res["methods"]["bigfl (phi = I)"] = {**_combine(runs, "test_loss"), "settings": frozen,
                                                 "protocol": "control: phi = I frozen"}
        except MissingCell as exc:
            unfinished.append(f"{gen} generator, test graph: bigfl, phi = I ({exc})")
        res["constant_predictors"] = constant_predictors(task, NODES, seeds)
        res["at_constant_level"] = at_constant_level(res["methods"], res["constant_predictors"],
                                                     f"{gen} generator, test graph")
        mm = res["methods"]
        res["paired"] = paired_table(mm, TEST_PAIRS, len(seeds))
        testgraph[gen] = res

    # Part 2: digits with permuted-label groups
    real_val = validation_task(REAL_TASK)
    real_tuning: dict[str, Any] = {}
    real: dict[str, Any] = {}
    for m in REAL_METHODS if form.digits else ():
        t = tune_lr(m, real_val, REAL_NODES, form.real_rounds, seed, form.real_lr_grid, REAL_TRAIN, {},
                    classification=True, params=REAL_PARAMS)
        real_tuning[m] = {"lr_grid_val_acc": t["grid"], "lr": t["lr"], "lr_at_grid_edge": t["at_grid_edge"],
                          "lr_grid_extended": t["extended"]}
        runs = [run_any(m, REAL_TASK, REAL_NODES, form.real_rounds, s, {"lr": t["lr"]}, REAL_TRAIN, REAL_PARAMS)
                for s in seeds]
        for r in runs:
            r.pop("phi", None)
        real[m] = {**_combine(runs, "test_acc"), "settings": {"lr": t["lr"], **REAL_PARAMS.get(m, {})}}
        loss = _combine(runs, "test_loss")
        real[m]["final"]["test_loss"] = loss["final"]["test_loss"]
        real[m]["final"]["test_loss_sd"] = loss["final"]["test_loss_sd"]

    timing = timing_table(results.get("smooth", {}).get("methods", {}), b2_runs.get("smooth", {}))
    doc: dict[str, Any] = {
        "name": NAME,
        "config": {
            "quick": quick, "form": dataclasses.asdict(form),
            "seeds": seeds, "tuning_seed": seed, "rounds": form.rounds, "nodes": NODES,
            "generators": GENERATORS, "testgraph_generators": list(form.testgraph),
            "tune_generators": list(form.tune_generators), "lr_grid": list(form.lr_grid),
            "bigfl_grid": {"lam": list(form.bigfl_lambdas), "alpha": list(form.bigfl_alphas),
                           "defaults": BIGFL_DEFAULT, "phi_moved_threshold": PHI_MOVED},
            "fesem_warmups": list(FESEM_WARMUPS), "train": TRAIN, "params": METHOD_PARAMS,
            "validation_fraction": VALIDATION_FRACTION,
            "real": {"task": REAL_TASK, "nodes": REAL_NODES, "rounds": form.real_rounds, **REAL_TRAIN,
                     "params": REAL_PARAMS, "lr_grid": list(form.real_lr_grid)},
        },
        "unspecified_settings": unspecified(form),
        "paper": {"figure": "seed 000 Fig. 10.3 (local testing loss)",
                  "claims": ["consensus methods (FedAvg, DFL) worst", "FeSEM better", "BiG-FL best"],
                  "numbers": None},
        "tuning": tuning,
        "settings": settings_of,
        # DESIGN.md result shape: methods = the main comparison (smooth generator, train graph)
        "methods": results["smooth"]["methods"],
        "results": results,
        "testgraph": testgraph,
        "real_data": {"task": REAL_TASK, "metric": "test_acc", "tuning": real_tuning, "methods": real},
        "timing": timing,
        "estimate": estimate(form),
        "partial": bool(unfinished),
        "unfinished": unfinished,
        "in_progress": list(IN_PROGRESS),
        "notes": list(notes),
        "env": env_info(),
        "wall_seconds": time.perf_counter() - t_start,
    }
    doc["verdict"] = verdict(doc)
    doc["verdicts"] = claim_verdicts(doc)
    write_report(out, doc, markdown=render_markdown(doc))  # B2's own layout (docs/results/multicenter-*)
    try:
        plot(doc, out / f"{NAME}.png")
    except Exception:  # the JSON/MD are already written
        logger.exception("could not draw %s.png", NAME)
    return doc


IN_PROGRESS: list[dict[str, Any]] = []
"""Unfinished cells a cache-only report met that have a checkpoint: their last recorded round."""


def _note_progress(key: dict[str, Any]) -> str:
    """Record the last checkpointed round of ``key``'s unfinished cell in :data:`IN_PROGRESS`, if any."""
    import json

    if _cache.folder is None:
        return ""
    path = _cache._path(key).with_suffix(".run") / f"{NAME}-{key['method']}.json"
    try:
        curve = json.loads(path.read_text())["methods"][key["method"]]["curve"]
    except (OSError, ValueError, KeyError):
        return ""
    rows = [row for row in curve if row.get("test_loss") is not None]
    if not rows:
        return ""
    last = rows[-1]
    best = min(rows, key=lambda row: row["test_loss"])
    curvature = [v for row in curve if (v := _server_metric(row, "ll_min_curvature")) is not None]
    entry = {"method": key["method"], "task": key["task"], "seed": key["seed"], "round": last["round"],
             "rounds": key["rounds"], "test_loss": last["test_loss"],
             "phi_minus_identity": _server_metric(last, "phi_minus_identity"),
             "hypergrad_norm": _server_metric(last, "hypergrad_norm"),
             "best_test_loss": best["test_loss"], "best_round": best["round"],
             "min_ll_curvature": min(curvature) if curvature else None}
    if entry not in IN_PROGRESS:
        IN_PROGRESS.append(entry)
    return f"checkpointed at round {last['round']} of {key['rounds']}"


def in_progress_lines(doc: dict[str, Any]) -> list[str]:
    """Unfinished cells at their last checkpoint beside the finished methods' mean at that round (not results)."""
    rows = doc.get("in_progress") or []
    if not rows:
        return []
    lines = ["## Unfinished cells at their last checkpoint (interim, not results)", "",
             "Each unfinished cell's local test MSE at its last checkpointed round, beside the finished methods' "
             "mean over seeds at the same round of the same task.", "",
             "| cell | round | test MSE | ‖φ − I‖_F | smallest ll_min_curvature | others at that round |",
             "|---|---|---|---|---|---|"]
    for e in rows:
        block = next((res for res in list(doc["results"].values()) + list(doc["testgraph"].values())
                      if res["task"] == e["task"]), None)
        others = []
        for m, r in (block or {}).get("methods", {}).items():
            v = next((row.get("test_loss") for row in r["curve"] if row["round"] == e["round"]), None)
            if v is not None:
                others.append(f"{m} {v:.4f}")
        phi = "–" if e["phi_minus_identity"] is None else f"{e['phi_minus_identity']:.3f}"
        lines.append(f"| {e['method']} seed {e['seed']} on {e['task']} | {e['round']} of {e['rounds']} | "
                     f"{e['test_loss']:.4f} (best {e.get('best_test_loss', e['test_loss']):.4f} at round "
                     f"{e.get('best_round', e['round'])}) | {phi} | "
                     f"{'–' if e.get('min_ll_curvature') is None else format(e['min_ll_curvature'], '.3g')} | "
                     f"{', '.join(others)} |")
    return lines + [""]


_CACHE_ONLY = False
"""Set by ``run(cache_only=True)``: :func:`run_any` raises :class:`MissingCell` instead of computing."""

TRAIN_PAIRS = (("bigfl", "fesem"), ("fesem", "fedavg"), ("fesem", "dfl"), ("bigfl", "fedavg"), ("bigfl", "dfl"),
               ("bigfl", "local"), ("fesem", "local"), ("dfl", "fedavg"))
TEST_PAIRS = (("bigfl", "fesem"), ("bigfl", "fedavg"), ("bigfl", "dfl"), ("bigfl", "bigfl (phi = I)"),
              ("bigfl", "local"), ("fesem", "fedavg"), ("fesem", "dfl"), ("fesem", "local"))


def _pair_name(a: str, b: str) -> str:
    if b == "bigfl (phi = I)":
        return "bigfl_learned_minus_identity"
    return f"{a}_minus_{b}"


def paired_table(methods: dict[str, Any], pairs: tuple[tuple[str, str], ...],
                 expected: int | None = None) -> dict[str, Any]:
    """Per-seed paired differences ``a − b`` (over ``expected`` seeds) for each pair whose two methods have results."""
    return {_pair_name(a, b): _paired(methods[a], methods[b], expected) for a, b in pairs
            if a in methods and b in methods}


def timing_table(methods: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Server seconds per round (aggregation) and round wall seconds of the smooth generator's runs."""
    def agg(m: str) -> float | None:
        return methods.get(m, {}).get("final", {}).get("aggregate_seconds_per_round")

    def wall(m: str) -> float | None:
        return _stats([row.get("seconds") for r in runs.get(m, []) for row in r["curve"][1:]])[0]

    return {"n": NODES, "d": 512, "generator": "smooth",
            "bigfl_server_seconds_per_round": agg("bigfl"), "fedavg_aggregate_seconds_per_round": agg("fedavg"),
            "fesem_server_seconds_per_round": agg("fesem"), "bigfl_round_wall_seconds": wall("bigfl"),
            "fedavg_round_wall_seconds": wall("fedavg")}


def _order(methods: dict[str, Any], names: tuple[str, ...]) -> list[str]:
    have = [m for m in names if methods.get(m, {}).get("final", {}).get("test_loss") is not None]
    return sorted(have, key=lambda m: methods[m]["final"]["test_loss"])


def verdict(doc: dict[str, Any]) -> list[str]:
    """Does the paper's ordering (BiG-FL < FeSEM < FedAvg, DFL) appear? One line per block, with numbers."""
    lines = []
    for where, block in (("train graph", doc["results"]), ("test graph", doc["testgraph"])):
        for gen, res in block.items():
            mm = res["methods"]
            order = _order(mm, tuple(mm))
            fin = {m: mm[m]["final"]["test_loss"] for m in order}
            paper = (fin.get("bigfl", np.inf) < fin.get("fesem", np.inf)
                     < min(fin.get("fedavg", np.inf), fin.get("dfl", np.inf)))
            missing = [m for m in METHODS if m not in fin]
            text = (f"{gen}, {where}: " + " < ".join(f"{m} {fin[m]:.4f}" for m in order)
                    + (f"; paper order BiG-FL < FeSEM < FedAvg/DFL {'holds' if paper else 'does not hold'}"
                       if not missing else f"; no result for {', '.join(missing)}"))
            text += "".join(f"; {k} {_fmt_d(v)}" for k, v in res["paired"].items())
            if "fesem" in mm and mm["fesem"]["final"].get("local_test_loss") is not None:
                f = mm["fesem"]["final"]
                text += (f"; FeSEM last local model {f['local_test_loss']:.4f} (center {f['test_loss']:.4f}), "
                         f"ARI {f.get('ari') if f.get('ari') is None else round(f['ari'], 2)}")
            if res.get("constant_predictors"):
                best = min(res["constant_predictors"].items(), key=lambda kv: kv[1]["test_loss"])
                text += f"; best constant predictor ({best[0]}) {best[1]['test_loss']:.4f}"
                if res.get("at_constant_level"):
                    text += f", at its level: {', '.join(res['at_constant_level'])}"
            lines.append(text)
    return lines


CLAIMS = {
    "fesem-beats-consensus": ("FeSEM (K = 3) has a lower local test loss than the consensus methods FedAvg and DFL "
                              "(seed 000 Fig. 10.3)", (("fesem", "fedavg"), ("fesem", "dfl"))),
    "bigfl-beats-fesem": ("BiG-FL has a lower local test loss than FeSEM (seed 000 Fig. 10.3)", (("bigfl", "fesem"),)),
    "bigfl-beats-consensus": ("BiG-FL has a lower local test loss than FedAvg and DFL (seed 000 Fig. 10.3)",
                              (("bigfl", "fedavg"), ("bigfl", "dfl"))),
}
"""Paper claims of B2: name -> (statement, pairs ``(a, b)`` that must all show ``a`` better on every seed)."""
TRANSFER_CLAIM = ("bigfl-transfers", "the φ BiG-FL learned on the train graph, frozen, gives the homologous test "
                  "graph's clients a lower local test loss than φ = I (seed 000 §10.5: train and test graphs)")


def _holds(p: dict[str, Any] | None) -> bool | None:
    """``a`` better than ``b`` on every expected seed (:func:`bench.stats.first_better_on_every_seed`):
    ``False`` when ``a`` diverged on a seed, ``None`` without a result, with a seed missing or ``b``
    non-finite on a seed.
    """
    return first_better_on_every_seed(p)


def _gap(p: dict[str, Any] | None) -> str:
    """Why a paired difference is not testable: missing seeds, non-finite finals of the second method."""
    if not p:
        return "no result"
    out = []
    if p.get("missing"):
        out.append(f"{p['missing']} of {p.get('expected')} seeds missing")
    if p.get("second_nonfinite"):
        out.append(f"the second method's final is non-finite on seed position(s) {p['second_nonfinite']}")
    return "; ".join(out) or "no seed compared"


def _blocks(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return ([(f"{g}, train graph", r) for g, r in doc["results"].items()]
            + [(f"{g}, test graph", r) for g, r in doc["testgraph"].items()])


def _reasons(name: str, doc: dict[str, Any], where: str, res: dict[str, Any], failed: list[str]) -> list[str]:
    """The most likely reasons a claim fails in one block, read off the block's own numbers."""
    mm, out = res["methods"], []
    fin = {m: r["final"]["test_loss"] for m, r in mm.items() if r["final"].get("test_loss") is not None}
    subject = "fesem" if name.startswith("fesem") else "bigfl"
    if "local" in fin and subject in fin and fin["local"] < fin[subject]:
        out.append(f"{where}: local-only training ({fin['local']:.4f}) beats {subject} ({fin[subject]:.4f}): each "
                   "client's task is learnable from its own data, so pooling with other clients adds bias")
    if subject == "fesem" and "fesem" in mm:
        f = mm["fesem"]["final"]
        if f.get("ari") is not None and f["ari"] < 0.9:
            out.append(f"{where}: FeSEM's clusters do not match the generator's (ARI {f['ari']:.2f})")
        for label, r in res.get("fesem_planted", {}).items():
            v = r["final"].get("test_loss")
            if v is not None:
                out.append(f"{where}: FeSEM started from the true clusters ({label}) reaches {v:.4f}")
    if subject == "bigfl" and "bigfl_phi" in res:
        bp = res["bigfl_phi"]
        if bp["degenerate"]:
            out.append(f"{where}: BiG-FL's φ did not move (‖φ − I‖_F {bp['final_phi_minus_identity']}): a bug, "
                       "not a result")
    if subject in res.get("at_constant_level", []):
        out.append(f"{where}: {subject} is at the constant-predictor level")
    form = doc["config"].get("form", {})
    if subject == "bigfl" and form.get("bigfl_settings") is not None:
        out.append("BiG-FL's settings were chosen on validation by an earlier, shorter run "
                   f"({form.get('bigfl_settings_source')}), not at this form's rounds")
    if not out and failed:
        out.append(f"{where}: the difference is not consistent across seeds")
    return out


def claim_verdicts(doc: dict[str, Any]) -> dict[str, Any]:
    """One verdict per paper claim: ``reproduced`` / ``not reproduced`` / ``not testable``, with evidence.

    A claim ``a < b`` is reproduced when, in every block (generator × train/test graph), ``a``'s final
    local test MSE is lower than ``b``'s on every seed (paired per seed); not reproduced when a block
    contradicts it; not testable when a pair has no result in some block (unfinished cells) and none
    contradicts it, or when the claim is about BiG-FL and its φ stayed at the identity (a degenerate
    run: a bug to fix first).
    """
    out: dict[str, Any] = {}
    for name, (statement, pairs) in CLAIMS.items():
        evidence: list[str] = []
        reasons: list[str] = []
        verdicts: list[bool] = []
        degenerate = []
        missing: list[str] = []
        for where, res in _blocks(doc):
            mm = res["methods"]
            failed = []
            for a, b in pairs:
                p = res["paired"].get(_pair_name(a, b))
                h = _holds(p)
                if h is None or p is None:
                    missing.append(f"{a} − {b} in {where}" + ("" if p is None else f" ({_gap(p)})"))
                    continue
                fa, fb = mm[a]["final"], mm[b]["final"]
                evidence.append(f"{where}: {a} {_pm(fa['test_loss'], fa['test_loss_sd'])} vs {b} "
                                f"{_pm(fb['test_loss'], fb['test_loss_sd'])}; {a} − {b} {_fmt_d(p)}")
                verdicts.append(h)
                if not h:
                    failed.append(f"{a} < {b}")
            if "bigfl" in name and res.get("bigfl_phi", {}).get("degenerate"):
                degenerate.append(where)
            if failed:
                reasons += _reasons(name, doc, where, res, failed)
        if "bigfl" in name:
            for where, res in _blocks(doc):
                if "bigfl_phi" in res:
                    bp = res["bigfl_phi"]
                    evidence.append(f"{where}: BiG-FL final ‖φ − I‖_F per seed "
                                    + ", ".join("–" if v is None else f"{v:.3f}" for v in bp["final_phi_minus_identity"])
                                    + f" (threshold {bp['threshold']:g})")
        interim = [e for e in doc.get("in_progress") or [] if e["method"] == "bigfl"] if "bigfl" in name else []
        for e in interim:
            evidence.append(f"unfinished BiG-FL seed {e['seed']} on {e['task']} at round {e['round']} of {e['rounds']} "
                            f"(interim, not a result): test MSE {e['test_loss']:.4f}, best {e.get('best_test_loss', 0):.4f} "
                            f"at round {e.get('best_round')}, ‖φ − I‖_F "
                            + ("–" if e["phi_minus_identity"] is None else f"{e['phi_minus_identity']:.3f}")
                            + ", smallest LL curvature "
                            + ("–" if e.get("min_ll_curvature") is None else f"{e['min_ll_curvature']:.3g}"))
        unstable = [e for e in interim if (e.get("min_ll_curvature") is not None and e["min_ll_curvature"] < 0
                                           and e["test_loss"] > 1.5 * e.get("best_test_loss", e["test_loss"]))]
        if degenerate:
            v = "not testable"
            reasons = [f"BiG-FL's φ stayed within {PHI_MOVED:g} of I in {', '.join(degenerate)}: the upper level "
                       "did not act, a bug to fix before any BiG-FL verdict"] + reasons
        elif not verdicts:
            v = "not testable"
            reasons = ["no block has results for both methods on every seed (unfinished cells: see 'unfinished')"
                       + (f": {', '.join(missing)}" if missing else "")]
            if unstable:
                reasons.append(f"the unfinished BiG-FL cells of seed(s) {[e['seed'] for e in unstable]} were diverging at "
                               "their last checkpoint: the lower level lost strong convexity (ll_min_curvature < 0, "
                               "below -κ) and the test MSE rose well above its best; the settings chosen on a "
                               "shorter validation run need re-tuning at this form's rounds (a larger κ)")
        elif not all(verdicts):
            v = "not reproduced"  # a contradiction stands whatever else is missing
        elif missing:
            v = "not testable"
            reasons = [f"partial: no result for {', '.join(missing)} (unfinished cells); the pairs measured hold"]
        else:
            v = "reproduced"
        out[name] = {"claim": statement, "verdict": v, "evidence": evidence,
                     "reason": "; ".join(dict.fromkeys(reasons)) if v != "reproduced" else ""}
    name, statement = TRANSFER_CLAIM
    evidence, verdicts, missing = [], [], []
    for where, res in doc["testgraph"].items():
        where = f"{where}, test graph"
        p = res.get("paired", {}).get("bigfl_learned_minus_identity")
        h = _holds(p)
        if h is None:
            missing.append(f"learned φ − φ = I in {where} ({_gap(p)})")
            continue
        evidence.append(f"{where}: learned φ − φ = I {_fmt_d(p)}")
        verdicts.append(h)
    for gen in doc.get("config", {}).get("testgraph_generators", []):
        if gen not in doc["testgraph"]:
            missing.append(f"learned φ − φ = I in {gen}, test graph (no test-graph block)")
    if verdicts and not all(verdicts):
        v, reason = "not reproduced", "the difference is not consistent across seeds or favours φ = I"
    elif missing or not verdicts:
        v = "not testable"
        reason = (f"no result for {', '.join(missing)} (unfinished cells)" if missing
                  else "no test-graph result for both φ (unfinished cells)")
    else:
        v, reason = "reproduced", ""
    out[name] = {"claim": statement, "verdict": v, "evidence": evidence, "reason": reason}
    return out


def verdict_lines(verdicts: dict[str, Any]) -> list[str]:
    """The verdicts as markdown (one bullet per claim, its evidence and reason below)."""
    lines = []
    for name, v in verdicts.items():
        lines.append(f"- **{name}: {v['verdict']}** — {v['claim']}.")
        lines += [f"  - {e}" for e in v["evidence"]]
        if v["reason"]:
            lines.append(f"  - most likely reason: {v['reason']}")
    return lines


def _fmt_d(p: dict[str, Any]) -> str:
    if p.get("mean") is None:
        return "–"
    sd = "" if p.get("sd") is None else f" ± {p['sd']:.3g}"
    return f"{p['mean']:+.4f}{sd} (first better in {p['first_better']}/{p['seeds']})"


def _pm(mean: float | None, sd: float | None, fmt: str = "{:.4f}") -> str:
    if mean is None:
        return "–"
    return fmt.format(mean) + ("" if sd is None else " ± " + fmt.format(sd))


def _edge_note(t: dict[str, Any]) -> str:
    """``" (grid edge)"`` when the chosen step is still at an edge, plus the steps added beyond the grid."""
    ext = t.get("lr_grid_extended") or []
    note = f" (grid extended: {', '.join(f'{x:g}' for x in ext)})" if ext else ""
    return note + (" (grid edge)" if t.get("lr_at_grid_edge") else "")


def _settings_str(s: dict[str, Any]) -> str:
    return ", ".join(f"{k.split('.')[-1]}={v:g}" if isinstance(v, float) else f"{k.split('.')[-1]}={v}"
                     for k, v in s.items())


def _phi_lines(bp: dict[str, Any], curve: list[dict[str, Any]]) -> list[str]:
    """BiG-FL's upper level in the report: ‖φ − I‖_F and ‖ĝ‖ per round (mean over seeds), degeneracy."""
    fin = ", ".join("–" if v is None else f"{v:.3f}" for v in bp["final_phi_minus_identity"])
    out = [f"BiG-FL upper level: final ‖φ − I‖_F per seed {fin}"
           + (f"; **degenerate** (φ within {bp['threshold']:g} of I) for seed(s) {bp['degenerate']}"
              if bp["degenerate"] else f" (all ≥ {bp['threshold']:g}: φ moved)") + ".", ""]
    unconv = {s: v.get("implicit_unconverged_rounds") for s, v in bp["per_seed"].items()}
    if any(unconv.values()):  # C2 d: a capped solve is reported, never silently used
        out += ["Implicit solve above its tolerance (rounds, per seed): "
                + "; ".join(f"seed {s}: {len(v or [])}" + (f" (first {v[:5]})" if v else "") for s, v in unconv.items())
                + ".", ""]
    out += ["| round | ‖φ − I‖_F | ‖ĝ‖ |", "|---|---|---|"]
    for row in curve:
        if row.get("phi_minus_identity") is None:
            continue
        out.append(f"| {row['round']} | {_pm(row['phi_minus_identity'], row.get('phi_minus_identity_sd'))} | "
                   f"{_pm(row.get('hypergrad_norm'), row.get('hypergrad_norm_sd'), '{:.3g}')} |")
    return out + [""]


def render_markdown(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    title = f"# {NAME} (B2, seed 000 Fig. 10.3)" + (" — PARTIAL" if doc.get("partial") else "")
    lines = [title, ""]
    if doc.get("partial"):
        lines += ["**PARTIAL result**: these cells were not finished when the run was stopped, so their methods "
                  "are missing from their comparisons: " + "; ".join(doc["unfinished"]) + ".", ""]
    red = reductions_of(doc)
    if red:
        lines += ["**Reduced form** (what differs from the full form):", ""] + [f"- {r}" for r in red] + [""]
    if "verdicts" in doc:
        lines += ["## Verdicts (one per paper claim)", ""] + verdict_lines(doc["verdicts"]) + [""]
    lines += in_progress_lines(doc)
    if doc.get("notes"):
        lines += ["## Notes on this run", ""] + [f"- {n}" for n in doc["notes"]] + [""]
    if doc.get("estimate"):
        lines += [f"Estimate before the start: {doc['estimate']['text']}.", ""]
    lines += [f"Seeds {cfg['seeds']} (mean ± sd), {cfg['rounds']} rounds, {cfg['nodes']} clients, plain SGD (10 local steps, "
             f"batch 20) with each method's step tuned on validation (seed {cfg['tuning_seed']}). "
             "Local test MSE (lower is better).", ""]
    for where, block in (("train graph", doc["results"]), ("test graph", doc["testgraph"])):
        for gen, res in block.items():
            lines += [f"## {gen} generator ({res['task']}), {where}", "",
                      "| method | settings | final test MSE | per seed | FeSEM local model | ARI | server s/round |",
                      "|---|---|---|---|---|---|---|"]
            for m, r in res["methods"].items():
                f = r["final"]
                per = ", ".join("–" if v is None else f"{v:.4f}" for v in f["per_seed"])
                loc = _pm(f.get("local_test_loss"), f.get("local_test_loss_sd")) if "local_test_loss" in f else ""
                ari = _pm(f.get("ari"), f.get("ari_sd"), "{:.2f}") if "ari" in f else ""
                srv = f.get("aggregate_seconds_per_round")
                lines.append(f"| {m} | {_settings_str(r['settings'])} | {_pm(f['test_loss'], f['test_loss_sd'])} | "
                             f"{per} | {loc} | {ari} | {'' if srv is None else f'{srv:.4f}'} |")
            for label, r in res.get("fesem_planted", {}).items():
                f = r["final"]
                lines.append(f"| FeSEM diagnostic: {label} | as fesem | {_pm(f['test_loss'], f['test_loss_sd'])} | "
                             f"{', '.join('–' if v is None else f'{v:.4f}' for v in f['per_seed'])} | "
                             f"{_pm(f.get('local_test_loss'), f.get('local_test_loss_sd'))} | "
                             f"{_pm(f.get('ari'), f.get('ari_sd'), '{:.2f}')} | |")
            for label, c in res.get("constant_predictors", {}).items():
                lines.append(f"| constant predictor: {label} (no training) | – | {_pm(c['test_loss'], c['test_loss_sd'])} | "
                             f"{', '.join(f'{v:.4f}' for v in c['per_seed'])} | | | |")
            lines += [""]
            if res.get("at_constant_level"):
                lines += [f"**At the constant-predictor level** (final MSE ≥ {CONSTANT_LEVEL:g} × the best constant "
                          f"predictor's): {', '.join(res['at_constant_level'])}.", ""]
            lines += ["Paired per seed (negative = first better): "
                      + "; ".join(f"{k} {_fmt_d(v)}" for k, v in res["paired"].items()), ""]
            if "bigfl_phi" in res:
                lines += _phi_lines(res["bigfl_phi"], res["methods"]["bigfl"]["curve"])
    lines += ["## Tuning on validation (never test)", ""]
    for gen, t in doc["tuning"].items():
        lines += [f"### {gen} generator ({t['task']})", "", "| method | val MSE per step | chosen |", "|---|---|---|"]
        for m in METHODS:
            if "unfinished" in t.get(m, {"unfinished": "not tuned"}):
                lines.append(f"| {m} | unfinished: {t.get(m, {}).get('unfinished', 'not tuned')} | – |")
                continue
            g = t[m]["lr_grid_val_mse"]
            lines.append(f"| {m} | " + ", ".join(f"{k}: {'–' if v is None else f'{v:.4f}'}" for k, v in g.items())
                         + f" | {t[m]['lr']:g}{_edge_note(t[m])}{_second_pass_note(t[m])} |")
        b = t["bigfl"]
        if b.get("from_earlier") is not None:
            lines += ["", f"BiG-FL: settings chosen on validation by an earlier result ({b['from_earlier']}), "
                          "not tuned in this run (see the reductions).", ""]
            lines += _fesem_sweep_lines(t["fesem"])
            continue
        if "unfinished" in b:  # a cache-only report before BiG-FL's tuning finished
            lines += ["", f"BiG-FL: validation tuning unfinished ({b['unfinished']}).", ""]
            lines += _fesem_sweep_lines(t["fesem"])
            continue
        alphas = b["grid"]["alpha"]
        if "kappa_step_grid_val_mse" in b:
            lines += ["", f"BiG-FL κ (proximal ridge) with its own step (val MSE per step; first-pass κ = {b['kappa']:g}"
                      f"{_kappa_pass_note(b)}): "
                      + "; ".join(f"{k}: " + ", ".join(f"{s}: {'–' if v is None else f'{v:.4f}'}"
                                                        for s, v in row["lr_grid_val_mse"].items())
                                  + f" (step {row['lr']:g})" for k, row in b["kappa_step_grid_val_mse"].items())]
        for k, why in (b.get("kappa_excluded") or {}).items():
            lines += [f"- BiG-FL {k}: " + "; ".join(f"{s}: {w}" for s, w in why.items())]
        for cell, why in (b.get("excluded") or {}).items():
            lines += [f"- BiG-FL {cell}: {why}"]
        if b.get("implicit_unconverged_rounds"):
            lines += [f"- BiG-FL chosen (κ, step) run: implicit solve above its tolerance in "
                      f"{len(b['implicit_unconverged_rounds'])} round(s) (first {b['implicit_unconverged_rounds'][:5]})"]
        lines += ["", f"BiG-FL λ × α (val MSE, and final ‖φ − I‖_F, at step {b['lr']:g}; chosen λ = {b['lam']:g}, "
                      f"α = {b['alpha']:g}; {b['note']}):", "",
                  "| λ | " + " | ".join(f"α = {a:g}" for a in alphas) + " |",
                  "|---|" + "---|" * len(alphas)]
        for lam, row in b["lam_alpha_grid_val_mse"].items():
            prow = b["lam_alpha_grid_phi_minus_identity"][lam]
            lines.append(f"| {lam.split('=')[1]} | " + " | ".join(
                ("–" if v is None else f"{v:.4f}") + ("" if pv is None else f" (‖φ − I‖ {pv:.3f})")
                for v, pv in zip(row.values(), prow.values())) + " |")
        lines += _lambda_extension_lines(b.get("lam_extension"))
        lines += _second_pass_lines(b.get("step_second_pass"))
        lines += _kappa_pass_lines(b.get("kappa_second_pass"))
        lines += _fesem_sweep_lines(t["fesem"])
    rd = doc["real_data"]
    if rd["methods"]:
        lines += _digits_lines(doc)
    t = doc["timing"]
    lines += ["", f"## Server time per round (n = {t['n']}, d = {t['d']}, smooth generator, same runs)", "",
              "| quantity | seconds |", "|---|---|"]
    for key in ("bigfl_server_seconds_per_round", "fedavg_aggregate_seconds_per_round",
                "fesem_server_seconds_per_round", "bigfl_round_wall_seconds", "fedavg_round_wall_seconds"):
        v = t.get(key)
        lines.append(f"| {key} | {'–' if v is None else f'{v:.4f}'} |")
    lines += ["", "## Per block (Fig. 10.3: consensus worst, FeSEM better, BiG-FL best)", ""]
    lines += [f"- {v}" for v in doc["verdict"]]
    lines += ["", "## Settings the paper does not give", ""] + [f"- {u}" for u in doc["unspecified_settings"]]
    lines += ["", f"Total wall time: {doc['wall_seconds']:.0f} s. Environment: {doc['env']}", ""]
    return "\n".join(lines)


def _lambda_extension_lines(ext: Mapping[str, Any] | None) -> list[str]:
    """The λ column searched past the grid's winning edge (:func:`extend_lambda_edge`), if any ran."""
    if not ext or not ext.get("extended"):
        return []
    cells = ", ".join(f"λ {lam}: " + ("excluded or failed" if v is None else f"{v:.4f}")
                      + ("" if ext["phi_minus_identity"].get(lam) is None
                         else f" (‖φ − I‖ {ext['phi_minus_identity'][lam]:.3f})")
                      for lam, v in ext["val_mse"].items())
    return ["", f"BiG-FL λ past its grid's winning edge at α = {ext['alpha']:g} (×/÷ {ext['factor']:g}, at most "
                f"{ext['max_extensions']}; val MSE): {cells}; chosen λ = {ext['lam']:g}"
                + (" — still at the edge of what was tried" if ext["at_edge"] else "")]


def _second_pass_note(entry: Mapping[str, Any]) -> str:
    """`` (second pass: <step>)`` when BiG-FL's step was searched again and changed."""
    sp = entry.get("step_second_pass") or {}
    return f" (second pass: {sp['lr']:g})" if sp.get("ran") and sp.get("lr") != entry.get("lr") else ""


def _kappa_pass_note(entry: Mapping[str, Any]) -> str:
    """``, final κ = <κ> (κ pass)`` when BiG-FL's κ was searched again and changed."""
    kp = entry.get("kappa_second_pass") or {}
    return f", final κ = {kp['kappa']:g} (κ pass)" if kp.get("ran") and kp.get("kappa") != entry.get("kappa") else ""


def _second_pass_lines(sp: Mapping[str, Any] | None) -> list[str]:
    """BiG-FL's step searched again at the chosen κ, λ, α (:func:`retune_bigfl_step`), if it ran."""
    if not sp or not sp.get("ran"):
        return []
    cells = ", ".join(f"{s}: " + ("–" if v is None else f"{v:.4f}") for s, v in sp["grid"].items())
    excluded = "; ".join(f"{k}: {w}" for k, w in sp["excluded"].items())
    return ["", f"BiG-FL step searched again at the chosen κ, λ, α (second pass; val MSE): {cells or 'every step failed'}"
                f"; chosen step {sp['lr']:g}" + (f" (excluded: {excluded})" if excluded else "")]


def _kappa_pass_lines(kp: Mapping[str, Any] | None) -> list[str]:
    """BiG-FL's κ searched again at the chosen step, λ, α (:func:`retune_bigfl_kappa`), if it ran."""
    if not kp or not kp.get("ran"):
        return []
    phi = kp.get("phi_minus_identity") or {}
    cells = ", ".join(f"κ {k}: " + ("excluded or failed" if v is None else f"{v:.4f}")
                      + ("" if phi.get(k) is None else f" (‖φ − I‖ {phi[k]:.3f})")
                      for k, v in kp["val_mse"].items())
    excluded = "; ".join(f"{k}: {w}" for k, w in kp["excluded"].items())
    return ["", f"BiG-FL κ searched again at the chosen step, λ, α (val MSE): {cells or 'every κ failed'}; chosen κ "
                f"{kp['kappa']:g}" + (" — still at the edge of what was tried" if kp.get("at_edge") else "")
                + (f" (excluded: {excluded})" if excluded else "")
                + ("" if kp["kappa"] == kp.get("first_pass_kappa", kp["kappa"]) else
                   "; the step was not searched again at this κ")]


def _fesem_sweep_lines(f: dict[str, Any]) -> list[str]:
    if "warmup_sweep" not in f:
        return [""]
    lines = ["", f"FeSEM warm-up sweep (val, step {f['lr']:g}; chosen {f['warmup_steps']}):", "",
             "| warm-up steps | val MSE (center) | val MSE (local model) | ARI |", "|---|---|---|---|"]
    for w, row in f["warmup_sweep"].items():
        lines.append(f"| {w} | {_pm(row['val_mse'], None)} | {_pm(row['val_local_mse'], None)} | "
                     f"{_pm(row['ari'], None, '{:.2f}')} |")
    return lines + [""]


def _digits_lines(doc: dict[str, Any]) -> list[str]:
    rd = doc["real_data"]
    lines = ["## Digits with permuted-label client groups: mean local test accuracy", "",
              "| method | step (val) | final test acc | final test loss | per seed acc | ARI |", "|---|---|---|---|---|---|"]
    for m, res in rd["methods"].items():
        f = res["final"]
        per = ", ".join("–" if v is None else f"{v:.3f}" for v in f["per_seed"])
        ari = _pm(f.get("ari"), f.get("ari_sd"), "{:.2f}") if "ari" in f else ""
        step = f"{rd['tuning'][m]['lr']:g}{_edge_note(rd['tuning'][m])}"
        lines.append(f"| {m} | {step} | {_pm(f['test_acc'], f['test_acc_sd'], '{:.3f}')} | "
                     f"{_pm(f.get('test_loss'), f.get('test_loss_sd'))} | {per} | {ari} |")
    return lines


def plot(doc: dict[str, Any], path: Path) -> None:
    """Mean ± sd over seeds per round: test MSE per generator/graph, and digits accuracy."""
    from graphfl.common.results import plot_panels

    panels: list[dict[str, Any]] = []
    for where, block in (("train graph", doc["results"]), ("test graph", doc["testgraph"])):
        for gen, res in block.items():
            panels.append({"x": "round", "y": "test_loss", "band": "test_loss_sd", "logy": True,
                           "title": f"{gen}, {where}: local test MSE",
                           "series": {m: r["curve"] for m, r in res["methods"].items()}})
    if doc["real_data"]["methods"]:
        panels.append({"x": "round", "y": "test_acc", "band": "test_acc_sd",
                       "title": "digits, permuted-label groups: test accuracy",
                       "series": {m: r["curve"] for m, r in doc["real_data"]["methods"].items()}})
    plot_panels(path, panels)


if __name__ == "__main__":  # pragma: no cover
    import argparse

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ap = argparse.ArgumentParser(description=(__doc__ or NAME).splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/bench"))
    ap.add_argument("--generators", default=None, help="comma-separated train-graph (and test-graph) generators")
    ap.add_argument("--no-digits", action="store_true", help="leave out part 2 (digits)")
    ap.add_argument("--bigfl-from", type=Path, default=None,
                    help="a multicenter-bigfl JSON whose validation-tuned BiG-FL settings are used (not re-tuned)")
    ap.add_argument("--workers", type=int, default=1, help="processes for BiG-FL's train-graph cells")
    ap.add_argument("--note", action="append", default=[], help="a line for the result's notes (repeatable)")
    ap.add_argument("--cache-only", action="store_true",
                    help="report what <out>/cache holds, run nothing (a PARTIAL result names the missing cells)")
    ap.add_argument("--only", choices=[m for m in METHODS if m != "bigfl"], default=None,
                    help="compute one method's cells into <out>/cache (beside a run sharing it) and stop")
    args = ap.parse_args()
    base = QUICK if args.quick else FULL
    changes: dict[str, Any] = {"workers": args.workers, "digits": not args.no_digits}
    if args.generators:
        gens = tuple(g for g in args.generators.split(",") if g)
        changes.update(generators=gens, tune_generators=gens, testgraph=gens)
    if args.bigfl_from is not None:
        import json

        changes.update(bigfl_settings=json.loads(args.bigfl_from.read_text())["tuning"]["settings"],
                       bigfl_settings_source=str(args.bigfl_from))
    chosen = dataclasses.replace(base, **changes)
    if args.only:
        _cache = RunCache(args.out / "cache")
        precompute_method(chosen, args.only, args.seed)
    else:
        run(args.quick, args.seed, args.out, chosen, cache_only=args.cache_only, notes=tuple(args.note))
