"""Gradient oracles: a node's local problem ``f_i`` behind the :class:`GradientOracle` protocol.

* ``linreg`` — heterogeneous least squares in numpy (fast; tests and examples):
  node ``i`` has ``A_i ~ N(μ_i, 1)`` (``m x d``), ``b_i = A_i w_i + noise`` with node-specific
  ``w_i``; ``f_i(θ) = ‖A_i θ − b_i‖² / (2m)``.
* ``vector`` — a random vector per node and no gradient (plain gossip, throughput benchmark).
* any task of :mod:`graphfl.tasks` (e.g. ``synthetic-dfl``) — a torch model, loss and the
  node's data partition; θ is the flattened parameter vector (ALGORITHMS §1.1).

Every oracle draws minibatches from its own RNG seeded by ``(seed, node)``, so a node
produces the same gradients in any process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphfl.common.config import ConfigError

logger = logging.getLogger(__name__)

BUILTIN_PROBLEMS = ("linreg", "vector")


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
    input_scale: float = 1.0
    device: str = "cpu"


class LinRegOracle:
    """Heterogeneous least squares; see the module docstring."""

    def __init__(self, node: int, spec: ProblemSpec) -> None:
        d, m = spec.dim, spec.samples
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
    mean/std (the statistics come from the training split only, so a validation or test split
    never leaks into them); with ``input_scale`` they are multiplied by that constant on every
    node after the targets were built. ``graphfl bench dfl`` uses per-node standardisation; the
    constant scale (0.01 there before) shrank the inputs of the nodes on ``[-1, 1]`` and
    ``[-0.1, 0.1]`` to near-constants, which made the task nearly degenerate.
    """

    def __init__(self, node: int, spec: ProblemSpec, partition: int | None = None) -> None:
        import torch
        from torch.nn.utils import parameters_to_vector

        from graphfl.common.config import DataConfig
        from graphfl.tasks import registry

        self.torch = torch
        task = registry.create(spec.problem, data=DataConfig(), data_dir="", seed=spec.seed)
        pid = node if partition is None else partition
        data = task.client_data(pid, spec.num_nodes)
        dev = spec.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(dev)
        x_train, x_test = data.x_train.astype(np.float32), data.x_test.astype(np.float32)
        if spec.standardize:
            mu, sd = x_train.mean(axis=0), x_train.std(axis=0) + 1e-8
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


def make_oracle(node: int, spec: ProblemSpec, partition: int | None = None) -> Any:
    """The oracle of ``node`` for ``spec.problem`` (a built-in problem or a task name)."""
    if spec.problem == "linreg":
        return LinRegOracle(node if partition is None else partition, spec)
    if spec.problem == "vector":
        return VectorOracle(node if partition is None else partition, spec)
    try:
        from graphfl.tasks import registry
    except ImportError as exc:  # pragma: no cover - tasks package is part of graphfl
        raise ConfigError(f"problem {spec.problem!r} needs graphfl.tasks: {exc}") from None
    registry.get(spec.problem)  # ConfigError naming the valid tasks
    return TorchTaskOracle(node, spec, partition)
