"""The real-model-size task ``cifar10-resnet18``: ResNet-18 (GroupNorm) on CIFAR-10.

The architecture is checked by its exact parameter count (integer arithmetic) and its state
(parameters only, no running statistics); the task trains for real through graphfl's
in-process and batched engines on a tiny CIFAR-10 tarball of test_loaders.py's layout.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphfl.common.config import parse_run_config
from graphfl.server.inprocess import run_federated_inprocess
from graphfl.tasks import registry
from graphfl.tasks.models import ResNet18

from .test_loaders import write_tiny_cifar

# stem 3·64·9 + GN(64)·2; stage widths (64, 128, 256, 512), two basic blocks each, 1×1 projections
# where the width or stride changes; head 512·10 + 10.
RESNET18_CIFAR_PARAMETERS = 11_173_962


def _expected_parameters(in_channels: int = 3, classes: int = 10) -> int:
    def conv(c_in: int, c_out: int, k: int) -> int:
        return c_in * c_out * k * k

    def gn(c: int) -> int:
        return 2 * c

    total = conv(in_channels, 64, 3) + gn(64)
    prev = 64
    for width in (64, 128, 256, 512):
        for block in range(2):
            c_in = prev if block == 0 else width
            total += conv(c_in, width, 3) + gn(width) + conv(width, width, 3) + gn(width)
            if block == 0 and (c_in != width):
                total += conv(c_in, width, 1) + gn(width)
        prev = width
    return total + prev * classes + classes


def test_resnet18_has_the_cifar_resnet18_size_and_no_buffers():
    model = ResNet18(3, 10)
    count = sum(p.numel() for p in model.parameters())
    assert count == _expected_parameters() == RESNET18_CIFAR_PARAMETERS
    assert list(model.buffers()) == []                      # GroupNorm: the state is the parameters
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert sum(p.numel() for p in ResNet18(1, 7).parameters()) == _expected_parameters(1, 7)


def test_the_task_is_registered_and_seeds_its_model():
    assert "cifar10-resnet18" in registry.names()
    a = registry.create("cifar10-resnet18", seed=3).build_model()
    b = registry.create("cifar10-resnet18", seed=3).build_model()
    c = registry.create("cifar10-resnet18", seed=4).build_model()
    assert isinstance(a, ResNet18)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.stem[0].weight, c.stem[0].weight)


def test_a_missing_tarball_names_the_file(tmp_path):
    from graphfl.tasks.base import DataError

    with pytest.raises(DataError, match="cifar10-jpg-train.tar.gz"):
        registry.create("cifar10-resnet18", data_dir=str(tmp_path)).load_pool()


@pytest.fixture()
def tiny_cifar(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHFL_CACHE", str(tmp_path / "cache"))
    write_tiny_cifar(tmp_path / "data", per_class=4)
    return tmp_path / "data"


def test_fedavg_trains_resnet18_on_cifar_with_both_engines(tiny_cifar, tmp_path):
    """Two rounds of FedAvg over 2 clients on the in-process and on the batched engine: the whole
    model (11.17M float32 parameters) is uploaded by each client each round, and the batched engine
    (client-by-client forward for a convolutional model on the CPU) gives the in-process engine's
    losses within float32 tolerance."""
    curves = {}
    for engine in ("inprocess", "batched"):
        values = {"task": "cifar10-resnet18", "strategy": "fedavg", "nodes": 2, "rounds": 2, "engine": engine,
                  "data-dir": str(tiny_cifar), "data.min-partition-size": 5, "data.dirichlet-alpha": 100.0,
                  "device": "cpu", "train.local-steps": 2, "train.batch-size": 8, "train.lr": 0.01,
                  "run-key": "resnet"}
        doc, _ = run_federated_inprocess(parse_run_config(values), tmp_path / engine)
        assert doc["status"] == "completed"
        curves[engine] = [row for row in doc["methods"]["fedavg"]["curve"] if row["round"] > 0]
    for engine, curve in curves.items():
        assert len(curve) == 2, engine
        assert all(row["bytes_up"] == 2 * 4 * RESNET18_CIFAR_PARAMETERS for row in curve), engine
        assert all(np.isfinite(row["train_loss"]) and np.isfinite(row["test_loss"]) for row in curve), engine
    for key in ("train_loss", "test_loss"):
        np.testing.assert_allclose([row[key] for row in curves["batched"]], [row[key] for row in curves["inprocess"]],
                                   rtol=1e-4, err_msg=key)
