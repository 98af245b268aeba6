"""Models used by the tasks: MLP, the seed's 8-16-16-8 net, the 2-conv + 2-FC CNN, a bare vector."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """Fully connected net ``in -> hidden... -> out`` with a configurable activation."""

    def __init__(
        self,
        in_dim: int,
        hidden: tuple[int, ...],
        out_dim: int,
        activation: type[nn.Module] = nn.ReLU,
        bias: bool = True,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        prev = in_dim
        for width in hidden:
            layers += [nn.Linear(prev, width, bias=bias), activation()]
            prev = width
        layers.append(nn.Linear(prev, out_dim, bias=bias))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


def multicenter_net() -> MLP:
    """The seed's LL model (ALGORITHMS.md §5.9): 8×16, 16×16, 16×8 weights, no biases
    (512 parameters), sigmoid after the two hidden layers, linear output.
    """
    return MLP(8, (16, 16), 8, activation=nn.Sigmoid, bias=False)


class CNN(nn.Module):
    """The 2-conv + 2-FC CNN of McMahan et al. (FedAvg): conv5-pool-conv5-pool-fc-fc."""

    def __init__(
        self, in_channels: int = 1, image_size: int = 28, num_classes: int = 10,
        c1: int = 32, c2: int = 64, hidden: int = 512,
    ) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, c1, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        )
        side = image_size // 4
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(c2 * side * side, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def seeded(seed: int, factory, *args, **kwargs) -> nn.Module:
    """Build a model under a fixed torch seed without disturbing the global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return factory(*args, **kwargs)


class VectorModel(nn.Module):
    """A bare parameter vector ``θ ∈ R^d`` (zeros): ``forward(x)`` returns ``θ`` for every row of ``x``.

    The model of ``synthetic-vector`` (a transport workload: all of its size is payload).
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.theta.expand(x.shape[0], -1)


class HalfSquaredError(nn.Module):
    """``½ ‖output − target‖²`` per row (summed over coordinates), averaged over rows.

    Its gradient in ``θ`` for :class:`VectorModel` is ``θ − mean(target)``, independent of ``d``.
    """

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((output - target) ** 2).sum(dim=1).mean()
