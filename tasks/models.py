"""Models used by the tasks: MLP, the seed's 8-16-16-8 net, the 2-conv + 2-FC CNN, ResNet-18 (GroupNorm), a bare vector."""

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


class _BasicBlock(nn.Module):
    """ResNet basic block: two 3×3 convolutions with GroupNorm, identity (or 1×1 projection) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(groups, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(groups, out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                          nn.GroupNorm(groups, out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32×32 images (He et al. 2016, CIFAR variant), GroupNorm instead of BatchNorm.

    Stem: one 3×3 convolution (64 channels, stride 1, no max-pool); four stages of two basic
    blocks with 64, 128, 256, 512 channels (stride 2 from the second stage on); global average
    pool; one linear layer. 11.17M parameters for 3 input channels and 10 classes.

    GroupNorm (``groups`` groups per layer, Wu & He 2018) has no running statistics: the model's
    state is its parameters only, so what a client uploads is the whole model and an average of
    client models is a model. BatchNorm's running means would be averaged across clients with
    other label mixes, which Hsieh et al. (2020, "The non-IID data quagmire") show degrades
    federated training under skew.
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 10, groups: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False),
                                  nn.GroupNorm(groups, 64), nn.ReLU())
        blocks: list[nn.Module] = []
        prev = 64
        for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [_BasicBlock(prev, width, stride, groups), _BasicBlock(width, width, 1, groups)]
            prev = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(x))
        return self.head(features.mean(dim=(2, 3)))


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
    Computed as ``½ · mse_loss(output, target, reduction="sum") / rows`` (torch's fused squared
    error, which reads :class:`VectorModel`'s broadcast rows in place). ``output`` and ``target``
    must be ``(rows, d)`` of the same shape; no rows gives NaN.
    """

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if output.dim() != 2 or output.shape != target.shape:
            raise ValueError(f"HalfSquaredError: output {tuple(output.shape)} and target {tuple(target.shape)} "
                             "must both be (rows, d) of the same shape")
        return 0.5 * nn.functional.mse_loss(output, target, reduction="sum") / output.shape[0]
