"""Synthetic tasks: seed 000's 5-node DFL regression and 50-node multi-center task, and a bare
vector (a transport workload of any size).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from graphfl.common.graph import gcn_propagation, knn_graph
from graphfl.tasks.base import ClientData, Task, TaskSpec

# ALGORITHMS.md §2.10: node-specific input intervals and nonlinearities, in this order.
DFL_INTERVALS = ((-30.0, 30.0), (40.0, 100.0), (-55.0, -50.0), (-1.0, 1.0), (-0.1, 0.1))
DFL_NONLINEARITIES = ("tanh", "sigmoid", "relu", "sin", "cos")

_NONLIN: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "tanh": np.tanh,
    "sigmoid": lambda z: 1.0 / (1.0 + np.exp(-np.clip(z, -500, 500))),
    "relu": lambda z: np.maximum(z, 0.0),
    "sin": np.sin,
    "cos": np.cos,
}


class SyntheticDFL(Task):
    """Heterogeneous nonlinear regression (seed 000, Fig. 10.1; details ALGORITHMS.md §2.10).

    Node i draws inputs ``X_i ~ U[interval_i]^10`` and targets ``y = σ_i(X_i w*) + N(0, 0.01²)``
    with one shared ``w* ~ N(0, I_10)``; node i uses interval/nonlinearity ``i mod 5``.
    1000 train and 200 test samples per node. Model: MLP 10→64→64→1 (ReLU), MSE loss.
    ``standardize=True`` rescales each node's inputs to zero mean / unit variance (the
    spec's fallback when the step 15/√t diverges on raw inputs up to 100).
    """

    spec = TaskSpec("synthetic-dfl", "regression", default_nodes=5,
                    summary="5-node heterogeneous nonlinear regression (seed 000 Fig. 10.1)")
    dim = 10
    n_train = 1000
    n_test = 200
    noise = 0.01

    def __init__(self, *args, standardize: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.standardize = standardize

    def client_data(self, partition_id: int, num_partitions: int) -> ClientData:
        self.check_num_partitions(num_partitions)
        w_star = np.random.default_rng([self.seed, 0]).standard_normal(self.dim)
        rng = np.random.default_rng([self.seed, 1, partition_id])
        lo, hi = DFL_INTERVALS[partition_id % 5]
        f = _NONLIN[DFL_NONLINEARITIES[partition_id % 5]]

        def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
            x = rng.uniform(lo, hi, size=(n, self.dim))
            y = f(x @ w_star) + self.noise * rng.standard_normal(n)
            return x, y[:, None]

        x_tr, y_tr = draw(self.n_train)
        x_te, y_te = draw(self.n_test)
        if self.standardize:
            mu, sd = x_tr.mean(0), x_tr.std(0) + 1e-12
            x_tr, x_te = (x_tr - mu) / sd, (x_te - mu) / sd
        f32 = np.float32
        return ClientData(x_tr.astype(f32), y_tr.astype(f32), x_te.astype(f32), y_te.astype(f32))

    def build_model(self):
        from graphfl.tasks.models import MLP, seeded

        return seeded(self.seed, MLP, self.dim, (64, 64), 1)


class SyntheticMulticenter(Task):
    """Multi-center linear tasks on a client graph (seed 000 Table 10.1; ALGORITHMS.md §5.9).

    Node vectors ``v_i ∈ R^64`` come from an equal-weight mixture of 3 Gaussians (centers
    ``~U[-0.5, 0.5]^64``, std 0.5); client i's ground truth is ``W_i = v_i.reshape(8, 8)``.
    Inputs ``X ~ U[-60, 60]^{100×8}``, targets ``Y = X W_i``, train and test drawn
    independently. The client graph links each node to its 4 nearest neighbours (union).
    ``scale=True`` (default) divides X and Y by 60 (inputs in [-1, 1]) for optimizer
    stability, as the spec allows; MSE is then reported in those units.

    Knobs (``data.*``, defaults = the paper's setting): ``data.client-samples`` training rows
    per client (0 = 100; the test rows stay 100, drawn after the training rows from the same
    stream: the first ``min(m, 100)`` training rows do not depend on ``m``, the test rows do); ``data.cluster-std`` the standard
    deviation of each mixture component around its center (0 = 0.5). The centers and labels do
    not depend on either knob, and the component noise is the same standard-normal draw scaled
    by ``cluster-std``, so changing it moves every client's vector along one fixed direction.

    Variants (class attributes, one registered name each):

    * ``ground_truth_kind = "smooth"`` (``synthetic-multicenter-smooth``): the ground truth
      follows the paper's graph model, eq. 10.13: with ``V`` the mixture samples (rows ``v_i``),
      ``A`` their 4-NN graph and ``Â = D̃^{-1/2}(A+I)D̃^{-1/2}``, client i's weight is row i of
      ``U = ÂV`` (graph-smoothed; neighbours' tasks are averaged with GCN weights).
    * ``graph_role = "test"`` (``…-testgraph``): the paper's homologous TEST graph — a second
      set of ``n`` node vectors from the *same* mixture (same centers, fresh draws of labels
      and vectors), its own 4-NN graph, its own ground truth and data. Used to evaluate
      transfer (ALGORITHMS.md §5.9: learn on the train graph, run on the test graph).
    """

    spec = TaskSpec("synthetic-multicenter", "regression", default_nodes=50,
                    summary="50 clients, 3 planted clusters, 4-NN graph, 8x8 linear tasks")
    num_clusters = 3
    dim = 8
    samples = 100
    """Training rows per client when ``data.client-samples`` is 0, and test rows always."""
    cluster_std = 0.5
    """Component standard deviation when ``data.cluster-std`` is 0."""
    knn = 4
    ground_truth_kind = "mixture"  # or "smooth" (U = ÂV, eq. 10.13)
    graph_role = "train"  # or "test" (the homologous test graph)

    def __init__(self, *args, scale: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale = scale
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _vectors(self, num_partitions: int) -> tuple[np.ndarray, np.ndarray]:
        """Mixture samples ``V`` (n×64) and their component labels (before any smoothing)."""
        if num_partitions not in self._cache:
            rng = np.random.default_rng([self.seed, 10])
            centers = rng.uniform(-0.5, 0.5, size=(self.num_clusters, self.dim * self.dim))
            if self.graph_role == "test":
                rng = np.random.default_rng([self.seed, 12])  # same centers, fresh nodes
            labels = rng.integers(0, self.num_clusters, size=num_partitions)
            vectors = centers[labels] + self.component_std * rng.standard_normal((num_partitions, self.dim**2))
            self._cache[num_partitions] = (vectors, labels)
        return self._cache[num_partitions]

    @property
    def train_samples(self) -> int:
        """Training rows per client (``data.client-samples``, else :attr:`samples`)."""
        return int(self.data.client_samples) or self.samples

    @property
    def component_std(self) -> float:
        """Standard deviation of each mixture component (``data.cluster-std``, else :attr:`cluster_std`)."""
        return float(self.data.cluster_std) or self.cluster_std

    def mixture_vectors(self, num_partitions: int) -> np.ndarray:
        """The mixture samples ``V`` (n×64), from which the graph is built."""
        return self._vectors(num_partitions)[0].copy()

    def _weights(self, num_partitions: int) -> np.ndarray:
        vectors = self._vectors(num_partitions)[0]
        if self.ground_truth_kind == "smooth":
            return gcn_propagation(knn_graph(vectors, self.knn)) @ vectors
        return vectors

    def client_data(self, partition_id: int, num_partitions: int) -> ClientData:
        self.check_num_partitions(num_partitions)
        w = self._weights(num_partitions)[partition_id].reshape(self.dim, self.dim)
        stream = 11 if self.graph_role == "train" else 13
        rng = np.random.default_rng([self.seed, stream, partition_id])
        x_tr = rng.uniform(-60, 60, size=(self.train_samples, self.dim))
        x_te = rng.uniform(-60, 60, size=(self.samples, self.dim))
        if self.scale:
            x_tr, x_te = x_tr / 60.0, x_te / 60.0
        f32 = np.float32
        return ClientData(x_tr.astype(f32), (x_tr @ w).astype(f32), x_te.astype(f32), (x_te @ w).astype(f32))

    def build_model(self):
        from graphfl.tasks.models import multicenter_net, seeded

        return seeded(self.seed, multicenter_net)

    def cluster_labels(self, num_partitions: int) -> np.ndarray:
        return self._vectors(num_partitions)[1].copy()

    def client_graph(self, num_partitions: int) -> np.ndarray:
        return knn_graph(self._vectors(num_partitions)[0], self.knn)

    def ground_truth(self, num_partitions: int) -> np.ndarray:
        """The clients' 8×8 weights, shape (n, 8, 8)."""
        return self._weights(num_partitions).reshape(-1, self.dim, self.dim).copy()


class SyntheticMulticenterTestGraph(SyntheticMulticenter):
    """The homologous test graph of ``synthetic-multicenter`` (see :class:`SyntheticMulticenter`)."""

    spec = TaskSpec("synthetic-multicenter-testgraph", "regression", default_nodes=50,
                    summary="test graph of synthetic-multicenter (same mixture, new nodes)")
    graph_role = "test"


class SyntheticMulticenterSmooth(SyntheticMulticenter):
    """Ground truth ``U = ÂV`` from the graph model (eq. 10.13; see :class:`SyntheticMulticenter`)."""

    spec = TaskSpec("synthetic-multicenter-smooth", "regression", default_nodes=50,
                    summary="50 clients, graph-smoothed 8x8 linear tasks U = ÂV (eq. 10.13)")
    ground_truth_kind = "smooth"


class SyntheticMulticenterSmoothTestGraph(SyntheticMulticenterSmooth):
    """The homologous test graph of ``synthetic-multicenter-smooth``."""

    spec = TaskSpec("synthetic-multicenter-smooth-testgraph", "regression", default_nodes=50,
                    summary="test graph of synthetic-multicenter-smooth (same mixture, new nodes)")
    graph_role = "test"


class SyntheticVector(Task):
    """Quadratic consensus over a bare vector ``θ ∈ R^d``: a transport workload of any size.

    Client i holds targets ``y = μ_i + 0.1 ε`` with ``μ_i ~ N(0, I_d)`` (2 train rows, 1 test row)
    and minimises ``½ ‖θ − y‖²`` (:class:`~graphfl.tasks.models.HalfSquaredError`), so one SGD
    step with step η moves ``θ`` by ``η (mean(y) − θ)``; FedAvg's fixed point is the mean of the
    clients' targets. The model (:class:`~graphfl.tasks.models.VectorModel`) is all payload:
    ``d`` float32 values and nothing else, the Flower counterpart of the p2p ``vector``
    problem (``graphfl bench p2p-throughput`` sends the same bytes both ways). ``d`` is
    ``data.dim`` (default 100 000).
    """

    spec = TaskSpec("synthetic-vector", "regression", default_nodes=4,
                    summary="bare d-parameter vector, quadratic loss (data.dim; a transport workload)")
    default_dim = 100_000
    n_train = 2
    n_test = 1

    @property
    def dim(self) -> int:
        return int(self.data.dim) or self.default_dim

    def client_data(self, partition_id: int, num_partitions: int) -> ClientData:
        self.check_num_partitions(num_partitions)
        rng = np.random.default_rng([self.seed, 21, partition_id])
        mu = rng.standard_normal(self.dim, dtype=np.float32)

        def rows(m: int) -> np.ndarray:
            return mu + np.float32(0.1) * rng.standard_normal((m, self.dim), dtype=np.float32)

        y_tr, y_te = rows(self.n_train), rows(self.n_test)
        f32 = np.float32
        return ClientData(np.zeros((self.n_train, 1), f32), y_tr, np.zeros((self.n_test, 1), f32), y_te)

    def build_model(self):
        from graphfl.tasks.models import VectorModel

        return VectorModel(self.dim)

    def loss_fn(self):
        from graphfl.tasks.models import HalfSquaredError

        return HalfSquaredError()


MULTICENTER_TASKS = (SyntheticMulticenter, SyntheticMulticenterTestGraph, SyntheticMulticenterSmooth,
                     SyntheticMulticenterSmoothTestGraph)
