"""A node's local problem: gradient oracles and tabular data behind small protocols.

* ``linreg`` — heterogeneous least squares in numpy (fast; tests and examples):
  node ``i`` has ``A_i ~ N(μ_i, 1)`` (``m x d``), ``b_i = A_i w_i + noise`` with node-specific
  ``w_i``; ``f_i(θ) = ‖A_i θ − b_i‖² / (2m)``.
* ``clusters`` / ``clusters-logistic`` — the FedADMM simulation (ALGORITHMS §6.12, two clusters
  instead of five): node ``i`` belongs to cluster ``0`` if ``i < n/2`` else ``1``; every cluster
  has its own ``ϑ^(k) ~ N(0, I_d)``; ``x ~ N(0, I_d)``; ``y = xᵀϑ + N(0, 1)`` (regression) or
  ``y ~ Bernoulli(σ(xᵀϑ))`` (0/1 classes). ``samples`` training rows and ``samples // 4 + 1``
  test rows per node.
* ``csv`` — the users' own data: one CSV file per device (docs/data.md, "Your own data"),
  read by :func:`load_device` (the same rules as :func:`graphfl.tasks.tabular.load_tabular`, for
  one device file, so that a device needs only its own file); a linear model.
* ``vector`` — a random vector per node and no gradient (plain gossip, throughput benchmark).
* any task of :mod:`graphfl.tasks` (e.g. ``synthetic-dfl``) — a torch model, loss and the
  node's data partition; θ is the flattened parameter vector (ALGORITHMS §1.1).

The numpy problems (``linreg``, ``clusters*``, ``csv``) are also :class:`DataProblem` s: they
expose the node's arrays (``x_train``, ``y_train``, ``x_test``, ``y_test``), the shared unlabelled
set ``D'`` (:meth:`DataProblem.shared`) and the run ``seed``, which is what FedADMM and
FedRelax work on. As gradient oracles they are linear least squares (DFL-SGD / DFL-GT on CSV
data: a linear model).

Every oracle draws minibatches from its own RNG seeded by ``(seed, node)``, so a node
produces the same gradients in any process.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from graphfl.common.config import ConfigError, DataConfig
from graphfl.common.devices import resolve_auto

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]

DATA_PROBLEMS = ("linreg", "clusters", "clusters-logistic", "csv")
"""Built-in problems that are :class:`DataProblem` s (FedADMM and FedRelax run on these)."""
BUILTIN_PROBLEMS = (*DATA_PROBLEMS, "vector")


@dataclass(frozen=True)
class ProblemSpec:
    """What to build a node's oracle from (all peers of a network share it except ``node``)."""

    problem: str = "linreg"
    num_nodes: int = 4
    seed: int = 0
    batch_size: int = 32
    dim: int = 10
    samples: int = 200
    standardize: bool = False
    """Standardise each node's inputs with that node's own training mean/sd."""
    pooled_standardize: bool = False
    """Standardise every node's inputs with the mean/sd of all ``num_nodes`` nodes' training
    inputs pooled: one transform shared by all nodes (a simulation setting: a real network
    cannot pool its raw data). Excludes ``standardize``."""
    input_scale: float = 1.0
    device: str = "cpu"
    data_dir: str = ""
    """``csv``: the folder of ``device-<id>.csv`` files (a peer's own ``data`` overrides it)."""
    data_path: str = ""
    """``csv``: this peer's own data — a folder holding ``device-<id>.csv`` or one CSV file."""
    features: str = ""
    """``csv``: the feature columns in order, comma separated ("" = the device file's order)."""
    shared_samples: int = 50
    """``m'``: rows of the generated shared set ``D'`` of the built-in problems (FedRelax)."""


class DataProblem(Protocol):
    """A node's tabular data (FedADMM, FedRelax): training and test arrays, ``D'`` and the seed.

    ``x_*`` are ``(rows, p)`` float64, ``y_*`` ``(rows,)`` float64 (0/1 for classification);
    the test split may have no rows. :meth:`shared` is the shared unlabelled set ``D'`` in this
    node's feature coordinates (every node holds the same points; a ``csv`` device maps them
    with its own standardisation). ``seed`` is the run's seed (``[run] seed``).
    """

    x_train: FloatArray
    y_train: FloatArray
    x_test: FloatArray
    y_test: FloatArray
    seed: int
    name: str
    batch_size: int

    def shared(self) -> FloatArray: ...

    def initial_theta(self) -> Any: ...

    def test_loss(self, theta: Any) -> float: ...


def is_data_problem(obj: Any) -> bool:
    """Whether ``obj`` carries the :class:`DataProblem` arrays."""
    return all(hasattr(obj, k) for k in ("x_train", "y_train", "x_test", "y_test", "seed", "shared"))


class LinRegOracle:
    """Heterogeneous least squares; see the module docstring."""

    name = "linreg"

    def __init__(self, node: int, spec: ProblemSpec) -> None:
        d, m = spec.dim, spec.samples
        self.seed = spec.seed
        self._shared_spec = (spec.seed, spec.num_nodes, spec.shared_samples)
        data_rng = np.random.default_rng([spec.seed, 1, node])
        self.a = data_rng.normal(loc=0.5 * node, scale=1.0, size=(m, d))
        w_true = np.random.default_rng([spec.seed, 2]).normal(size=d) + 0.3 * data_rng.normal(size=d)
        self.b = self.a @ w_true + 0.1 * data_rng.normal(size=m)
        self.a_test = data_rng.normal(loc=0.5 * node, scale=1.0, size=(m // 4 + 1, d))
        self.b_test = self.a_test @ w_true
        self.dim = d
        self.batch_size = spec.batch_size
        self.rng = np.random.default_rng([spec.seed, 3, node])
        self._theta0 = np.random.default_rng([spec.seed, 4]).normal(scale=0.1, size=d)

    def initial_theta(self) -> np.ndarray:
        return self._theta0.copy()

    def sample(self) -> np.ndarray:
        return self.rng.integers(0, len(self.b), size=self.batch_size)

    def grad(self, theta: np.ndarray, batch: np.ndarray) -> tuple[np.ndarray, float]:
        a, b = self.a[batch], self.b[batch]
        r = a @ theta - b
        return a.T @ r / len(batch), float(0.5 * np.mean(r * r))

    def full_grad(self, theta: np.ndarray) -> np.ndarray:
        """``∇f_i(θ) = A_iᵀ(A_i θ − b_i)/m`` on all local samples."""
        g: np.ndarray = self.a.T @ (self.a @ theta - self.b) / len(self.b)
        return g

    def test_loss(self, theta: np.ndarray) -> float:
        r = self.a_test @ theta - self.b_test
        return float(0.5 * np.mean(r * r))

    # DataProblem view of the same arrays
    @property
    def x_train(self) -> FloatArray:
        return self.a

    @property
    def y_train(self) -> FloatArray:
        return self.b

    @property
    def x_test(self) -> FloatArray:
        return self.a_test

    @property
    def y_test(self) -> FloatArray:
        return self.b_test

    def shared(self) -> FloatArray:
        """``D'``: ``shared-samples`` points ``N(μ̄, (1 + μ̄)²)`` per feature, ``μ̄ = 0.25 (n − 1)``
        (the middle of the nodes' input means), the same on every node.
        """
        seed, n, m = self._shared_spec
        mid = 0.25 * (n - 1)
        out: FloatArray = np.random.default_rng([seed, 6]).normal(mid, 1.0 + mid, size=(m, self.dim))
        return out


class TabularOracle:
    """A node's tabular data with a linear model: :class:`DataProblem` and, for DFL-SGD / DFL-GT,
    a least-squares gradient oracle.

    ``f_i(θ) = ‖X θ − y‖² / (2 m)`` (θ float64, no separate intercept: add a column of ones,
    ``intercept = true`` in ``dataset.toml``); minibatches of ``batch_size`` rows drawn with
    replacement from ``default_rng([seed, 3, node])``; ``test_loss`` is ``½ mean (y − xᵀθ)²``
    on the test rows (NaN without test rows). ``classes``: the response is 0/1.
    """

    def __init__(self, node: int, name: str, x_train: FloatArray, y_train: FloatArray, x_test: FloatArray,
                 y_test: FloatArray, *, seed: int, batch_size: int, shared: FloatArray | None = None,
                 shared_error: str = "", features: Sequence[str] = ()) -> None:
        self.node = node
        self.name = name
        self.x_train, self.y_train = np.asarray(x_train, np.float64), np.asarray(y_train, np.float64)
        self.x_test, self.y_test = np.asarray(x_test, np.float64), np.asarray(y_test, np.float64)
        if self.x_train.ndim != 2 or self.x_train.shape[0] == 0:
            raise ConfigError(f"node {node}: {name} has no training rows (X shape {self.x_train.shape})")
        self.dim = int(self.x_train.shape[1])
        self.seed = seed
        self.batch_size = batch_size
        self.features = tuple(features)
        self._shared = shared
        self._shared_error = shared_error
        self.rng = np.random.default_rng([seed, 3, node])

    def shared(self) -> FloatArray:
        if self._shared is None:
            raise ConfigError(self._shared_error or f"node {self.node}: problem {self.name!r} has no shared set D'")
        return self._shared

    def initial_theta(self) -> FloatArray:
        return np.zeros(self.dim)

    def sample(self) -> npt.NDArray[np.int64]:
        return self.rng.integers(0, len(self.y_train), size=self.batch_size)

    def grad(self, theta: FloatArray, batch: npt.NDArray[np.int64]) -> tuple[FloatArray, float]:
        a, b = self.x_train[batch], self.y_train[batch]
        r = a @ theta - b
        g: FloatArray = a.T @ r / len(batch)
        return g, float(0.5 * np.mean(r * r))

    def test_loss(self, theta: FloatArray) -> float:
        if self.x_test.shape[0] == 0:
            return float("nan")
        r = self.x_test @ np.asarray(theta, np.float64) - self.y_test
        return float(0.5 * np.mean(r * r))


def clusters_problem(node: int, spec: ProblemSpec, logistic: bool = False) -> TabularOracle:
    """``clusters`` / ``clusters-logistic`` (module docstring): two clusters, first and second half of the nodes."""
    d, m = spec.dim, spec.samples
    cluster = 0 if node < spec.num_nodes / 2 else 1
    truth = np.random.default_rng([spec.seed, 7, cluster]).normal(size=d)
    rng = np.random.default_rng([spec.seed, 8, node])
    x = rng.normal(size=(m + m // 4 + 1, d))
    z = x @ truth
    y = (rng.random(len(z)) < 1.0 / (1.0 + np.exp(-z))).astype(np.float64) if logistic else z + rng.normal(size=len(z))
    shared = np.random.default_rng([spec.seed, 6]).normal(size=(spec.shared_samples, d))
    name = "clusters-logistic" if logistic else "clusters"
    return TabularOracle(node, name, x[:m], y[:m], x[m:], y[m:], seed=spec.seed, batch_size=spec.batch_size,
                         shared=shared)


# ---------------------------------------------------------------------------------------------
# users' own data: one CSV file per device
# ---------------------------------------------------------------------------------------------


def device_file(path: str | Path, device: int) -> Path:
    """The CSV of ``device``: ``path`` itself if it is a file, else ``path/device-<device>.csv``."""
    from graphfl.tasks.tabular import device_path  # the tasks layer: loaded only for problem csv (peer start-up)

    return device_path(path, device)


def feature_columns(path: str | Path, device: int = 0, response: str | None = None) -> tuple[str, ...]:
    """The feature columns of a device file, in file order (every column except the response; header only)."""
    from graphfl.tasks.base import DataError  # loaded only for problem csv (peer start-up)
    from graphfl.tasks.tabular import read_header, resolve_settings

    f = device_file(path, device)
    settings = resolve_settings(f.parent, response=response)
    header = read_header(f)
    if settings.response not in header:
        raise DataError(f"{f}: no response column {settings.response!r} in the header {list(header)} "
                        f"(set 'response' in dataset.toml)")
    return tuple(c for c in header if c != settings.response)


def load_device(path: str | Path, device: int, *, features: Sequence[str] = (),
                split_seed: int = 0) -> tuple[Any, FloatArray | None, tuple[str, ...]]:
    """One device's data from its own CSV (:func:`graphfl.tasks.tabular.load_device`, docs/data.md).

    ``path`` is the device's file or the folder holding ``device-<device>.csv``; the settings
    (``dataset.toml``) and ``shared.csv`` are read from the file's folder, no other device's file
    is opened. ``features`` fixes the feature columns and their order (every device of a network
    must use the same; ``()`` = ``dataset.toml``'s ``features``, else the sorted columns). The
    split uses ``split_seed`` unless ``dataset.toml`` sets ``split-seed``. Returns ``(DeviceData,
    D' in raw units or None, feature names)``; the same arrays as
    :func:`graphfl.tasks.tabular.load_tabular` gives for that device.
    """
    from graphfl.tasks.tabular import load_device as load_own  # loaded only for problem csv (peer start-up)

    return load_own(path, device, features=tuple(features), base={"split_seed": split_seed})


def csv_problem(node: int, spec: ProblemSpec, partition: int | None = None) -> TabularOracle:
    """Problem ``csv``: device ``partition`` (default ``node``) from the peer's ``data`` or ``data-dir``."""
    device = node if partition is None else partition
    where = spec.data_path or spec.data_dir
    if not where:
        raise ConfigError("problem 'csv' needs the devices' data: --data-dir DIR ([run] data-dir), or a 'data' "
                          "path in the peer's [[peers]] table (see docs/p2p.md, 'Your own data')")
    features = tuple(c.strip() for c in spec.features.split(",") if c.strip())
    dev, shared_raw, names = load_device(where, device, features=features, split_seed=spec.seed)
    shared = None if shared_raw is None else dev.transform(shared_raw)
    return TabularOracle(node, "csv", dev.x_train, dev.y_train, dev.x_test, dev.y_test, seed=spec.seed,
                         batch_size=spec.batch_size, shared=shared, features=names,
                         shared_error=f"{dev.path.parent / 'shared.csv'} not found: FedRelax needs the shared "
                                      "unlabelled set D' (feature columns only) next to the device files")


class VectorOracle:
    """A random float32 vector per node (different on each node); no gradients."""

    def __init__(self, node: int, spec: ProblemSpec) -> None:
        self.dim = spec.dim
        self._theta0 = np.random.default_rng([spec.seed, 5, node]).standard_normal(spec.dim, dtype=np.float32)

    def initial_theta(self) -> np.ndarray:
        return self._theta0.copy()

    def sample(self) -> None:
        return None

    def grad(self, theta: np.ndarray, batch: Any) -> tuple[np.ndarray, float]:
        raise ConfigError("problem 'vector' has no gradient; use it with algorithm 'gossip'")

    def test_loss(self, theta: np.ndarray) -> float:
        return float("nan")


class TorchTaskOracle:
    """A :mod:`graphfl.tasks` task on one node: its model, loss and data partition ``node``.

    θ is the float32 concatenation of ``model.parameters()`` (buffers stay local).

    Input handling (the targets are the task's, built from its raw inputs, and never change):
    with ``standardize`` each node's inputs are standardised with that node's own *training*
    mean/std; with ``pooled_standardize`` every node uses the mean/std of the pooled training
    inputs of all ``num_nodes`` nodes (one shared affine transform, so the nodes keep their
    different input ranges: ALGORITHMS.md §0.1 C1); the statistics come from training splits
    only, so a validation or test split never leaks into them. With ``input_scale`` the inputs
    are multiplied by that constant on every node after the targets were built.
    """

    def __init__(self, node: int, spec: ProblemSpec, partition: int | None = None) -> None:
        import torch  # torch: only a torch task's peer loads it
        from torch.nn.utils import parameters_to_vector

        from graphfl.tasks import registry  # the task registry: loaded only for a task problem (peer start-up)

        self.torch = torch
        task = registry.create(spec.problem, data=DataConfig(), data_dir="", seed=spec.seed)
        pid = node if partition is None else partition
        data = task.client_data(pid, spec.num_nodes)
        dev = spec.device
        if dev == "auto":  # a tiny model is slower on a GPU (graphfl.common.devices)
            dev = resolve_auto(torch.cuda.is_available(), sum(p.numel() for p in task.build_model().parameters()))
        self.device = torch.device(dev)
        x_train, x_test = data.x_train.astype(np.float32), data.x_test.astype(np.float32)
        if spec.standardize and spec.pooled_standardize:
            raise ConfigError("standardize (per node) and pooled_standardize exclude each other; choose one")
        if spec.standardize:
            mu, sd = x_train.mean(axis=0), x_train.std(axis=0) + 1e-8
            x_train, x_test = (x_train - mu) / sd, (x_test - mu) / sd
        elif spec.pooled_standardize:
            mu, sd = pooled_input_stats(spec.problem, spec.num_nodes, spec.seed)
            x_train, x_test = (x_train - mu) / sd, (x_test - mu) / sd
        if spec.input_scale != 1.0:
            x_train, x_test = x_train * np.float32(spec.input_scale), x_test * np.float32(spec.input_scale)
        self.model = task.build_model().to(self.device)
        self.loss_fn = task.loss_fn()
        self.classification = task.kind == "classification"
        self.params = [p for p in self.model.parameters()]
        self.dim = int(sum(p.numel() for p in self.params))
        self._theta0 = parameters_to_vector(self.params).detach().cpu().numpy().astype(np.float32).copy()
        self.x = torch.from_numpy(np.ascontiguousarray(x_train)).to(self.device)
        self.y = self._target(data.y_train)
        self.x_test = torch.from_numpy(np.ascontiguousarray(x_test)).to(self.device)
        self.y_test = self._target(data.y_test)
        self.batch_size = spec.batch_size
        self.rng = np.random.default_rng([spec.seed, 3, node])

    def _target(self, y: np.ndarray) -> Any:
        t = self.torch.from_numpy(np.ascontiguousarray(y))
        if self.classification:
            return t.long().to(self.device)
        return t.float().reshape(len(y), -1).to(self.device)

    def initial_theta(self) -> np.ndarray:
        return self._theta0.copy()

    def sample(self) -> np.ndarray:
        return self.rng.integers(0, len(self.x), size=self.batch_size)

    def _load(self, theta: np.ndarray) -> None:
        from torch.nn.utils import vector_to_parameters

        with self.torch.no_grad():
            vector_to_parameters(self.torch.from_numpy(np.ascontiguousarray(theta, np.float32)).to(self.device), self.params)

    def grad(self, theta: np.ndarray, batch: np.ndarray) -> tuple[np.ndarray, float]:
        torch = self.torch
        self._load(theta)
        idx = torch.from_numpy(batch).to(self.device)
        for p in self.params:
            p.grad = None
        loss = self.loss_fn(self.model(self.x[idx]), self.y[idx])
        loss.backward()
        grads = [p.grad for p in self.params]
        if any(gr is None for gr in grads):
            raise RuntimeError(f"{type(self.model).__name__}: a parameter received no gradient")
        g = torch.cat([gr.reshape(-1) for gr in grads if gr is not None]).detach().cpu().numpy()
        return g.astype(np.float32, copy=False), float(loss.item())

    def full_grad(self, theta: np.ndarray) -> np.ndarray:
        """``∇f_i(θ)`` of the mean loss over the node's whole training split (full batch).

        ``f_i`` is the same loss the minibatch gradients estimate; benchmarks use this for the
        stationarity measure ``‖(1/n) Σ_i ∇f_i(θ̄)‖²`` (ALGORITHMS §2.7).
        """
        g, _ = self.grad(theta, np.arange(len(self.x)))
        return g

    def test_loss(self, theta: np.ndarray) -> float:
        self._load(theta)
        with self.torch.no_grad():
            return float(self.loss_fn(self.model(self.x_test), self.y_test).item())


@functools.lru_cache(maxsize=8)
def pooled_input_stats(problem: str, num_nodes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature mean and sd of the training inputs of all ``num_nodes`` partitions pooled.

    Every partition's training rows count once (a larger partition weighs more); float64
    sums, returned as float32 ``(mean, sd + 1e-8)``.
    """
    from graphfl.tasks import registry  # loaded only for a task problem (peer start-up)

    task = registry.create(problem, data=DataConfig(), data_dir="", seed=seed)
    xs = [np.asarray(task.client_data(pid, num_nodes).x_train, np.float64) for pid in range(num_nodes)]
    pooled = np.concatenate(xs, axis=0)
    mu, sd = pooled.mean(axis=0), pooled.std(axis=0)
    return mu.astype(np.float32), (sd + 1e-8).astype(np.float32)


def make_oracle(node: int, spec: ProblemSpec, partition: int | None = None) -> Any:
    """The oracle of ``node`` for ``spec.problem`` (a built-in problem or a task name)."""
    if spec.problem == "linreg":
        return LinRegOracle(node if partition is None else partition, spec)
    if spec.problem in ("clusters", "clusters-logistic"):
        return clusters_problem(node if partition is None else partition, spec, spec.problem == "clusters-logistic")
    if spec.problem == "csv":
        return csv_problem(node, spec, partition)
    if spec.problem == "vector":
        return VectorOracle(node if partition is None else partition, spec)
    try:
        from graphfl.tasks import registry  # loaded only for a task problem (peer start-up)
    except ImportError as exc:  # pragma: no cover - tasks package is part of graphfl
        raise ConfigError(f"problem {spec.problem!r} needs graphfl.tasks: {exc}") from None
    registry.get(spec.problem)  # ConfigError naming the valid tasks
    return TorchTaskOracle(node, spec, partition)
