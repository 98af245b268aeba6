"""The model and data of the example: linear regression on 3 planted client groups.

Partition ``p`` belongs to group ``p % 3``; its samples are ``y = x·w_g + noise`` with
``x ~ N(0, I_4)``, drawn from a generator seeded by ``p``. Training is full-batch gradient
descent (deterministic), so the same app gives the same numbers wherever it runs.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

IN_DIM = 4
GROUP_WEIGHTS = np.array([[2.0, -1.0, 0.5, 0.0], [-2.0, 1.0, 0.0, 1.5], [0.0, 0.0, -2.0, -2.0]], dtype=np.float32)
TRAIN, TEST = 40, 20


def make_model() -> nn.Module:
    """``Linear(4, 1)`` with fixed initial weights (every run starts from the same model)."""
    torch.manual_seed(0)
    return nn.Linear(IN_DIM, 1)


def load_data(partition_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)`` of partition ``partition_id``."""
    rng = np.random.default_rng(1000 + partition_id)
    w = GROUP_WEIGHTS[partition_id % len(GROUP_WEIGHTS)]
    x = rng.normal(size=(TRAIN + TEST, IN_DIM)).astype(np.float32)
    y = (x @ w + 0.1 * rng.normal(size=TRAIN + TEST)).astype(np.float32)[:, None]
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    return xt[:TRAIN], yt[:TRAIN], xt[TRAIN:], yt[TRAIN:]


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float,
          extra: Callable[[nn.Module], torch.Tensor] | None = None,
          after_step: Callable[[nn.Module, torch.Tensor, torch.Tensor], object] | None = None) -> float:
    """``steps`` full-batch gradient steps on the MSE (plus ``extra(model)``), each followed by
    ``after_step(model, x, y)``; returns the last loss.
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss = torch.zeros(())
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        total = loss + extra(model) if extra is not None else loss
        total.backward()
        opt.step()
        if after_step is not None:
            after_step(model, x, y)
    return float(loss.detach())


def client_graph(n: int) -> np.ndarray:
    """A client graph over ``n`` partitions for BiG-FL: the ring ``p ~ p ± 1 (mod n)``.

    BiG-FL's upper level needs a graph whose connected parts are not complete: on a complete part
    the GCN propagation gives every member the same embedding and the hypergradient is 0.
    """
    adj = np.zeros((n, n))
    for p in range(n):
        adj[p, (p + 1) % n] = adj[(p + 1) % n, p] = 1.0
    np.fill_diagonal(adj, 0.0)
    return adj


def test(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test MSE."""
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))
