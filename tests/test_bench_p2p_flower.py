"""p2p-throughput's Flower column: the same bytes through a real graphfl Flower deployment."""

from __future__ import annotations

from pathlib import Path

import pytest

from graphfl.bench.p2p_throughput import measure_flower
from graphfl.tasks import registry


def test_synthetic_vector_model_is_all_payload() -> None:
    from graphfl.common.config import DataConfig

    task = registry.create("synthetic-vector", data=DataConfig(dim=1234), seed=0)
    model = task.build_model()
    assert sum(p.numel() for p in model.parameters()) == 1234
    data = task.client_data(1, 4)
    assert data.y_train.shape == (2, 1234) and data.x_train.shape == (2, 1)
    import torch

    # one SGD step with step 1 lands on the mean of the client's targets (gradient θ − mean(y))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    loss = task.loss_fn()(model(torch.as_tensor(data.x_train)), torch.as_tensor(data.y_train))
    loss.backward()
    opt.step()
    torch.testing.assert_close(model.theta.detach(), torch.as_tensor(data.y_train).mean(0))


@pytest.mark.parametrize("shape", [(3, 7), (1, 5), (2, 1)])
def test_half_squared_error_is_the_explicit_formula(shape: tuple[int, int]) -> None:
    """The fused loss equals ½ mean over rows of ‖output − target‖², value and gradient."""
    import torch

    from graphfl.tasks.models import HalfSquaredError

    gen = torch.Generator().manual_seed(sum(shape))
    output = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    target = torch.randn(shape, generator=gen, dtype=torch.float64)
    fused = HalfSquaredError()(output, target)
    (grad,) = torch.autograd.grad(fused, output)
    explicit = 0.5 * ((output - target) ** 2).sum(dim=1).mean()
    (grad_explicit,) = torch.autograd.grad(explicit, output)
    torch.testing.assert_close(fused, explicit)
    torch.testing.assert_close(grad, grad_explicit)
    # on VectorModel's broadcast rows the gradient in θ is θ − mean(target)
    theta = torch.randn(shape[1], generator=gen, dtype=torch.float64, requires_grad=True)
    (g_theta,) = torch.autograd.grad(HalfSquaredError()(theta.expand(shape[0], -1), target), theta)
    torch.testing.assert_close(g_theta, theta.detach() - target.mean(0))


def test_half_squared_error_refuses_other_shapes_and_gives_nan_on_no_rows() -> None:
    import torch

    from graphfl.tasks.models import HalfSquaredError

    loss = HalfSquaredError()
    assert torch.isnan(loss(torch.zeros(0, 3), torch.zeros(0, 3)))
    for out, tgt in ((torch.zeros(3), torch.zeros(3)), (torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)),
                     (torch.zeros(1, 3), torch.zeros(2, 3))):
        with pytest.raises(ValueError, match=r"must both be \(rows, d\) of the same shape"):
            loss(out, tgt)


@pytest.mark.e2e
def test_flower_round_moves_the_same_bytes_as_the_ring(tmp_path: Path) -> None:
    d, n = 1000, 2
    res = measure_flower(tmp_path / "flower", d, n, rounds=2, insecure=True, timeout=300)
    assert res["ok"], res
    assert res["status"] == "completed" and len(res["round_s"]) == 2
    assert res["bytes_per_round"] == 2 * n * 4 * d  # n messages of 4d bytes down, n up: the ring's 2n
    assert res["median_round_s"] > 0


def test_case_folders_of_an_earlier_run_are_removed_not_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A second run into the same --out must not read the first run's peer files or run.json."""
    from graphfl.bench.p2p_throughput import _fresh

    stale = tmp_path / "runs" / "100-4-plain-4peers"
    stale.mkdir(parents=True)
    (stale / "peer-0.json").write_text('{"outcome": "done", "records": []}')
    with caplog.at_level("WARNING"):
        _fresh(stale)
        _fresh(tmp_path / "flower" / "never-made")  # absent: nothing to do, no error
    assert not stale.exists()
    assert "earlier run" in caplog.text and caplog.text.count("removing") == 1


def test_bench_refuses_an_out_folder_of_an_earlier_run(tmp_path: Path) -> None:
    """graphfl bench into a non-empty --out: refused before any work, for benchmarks without a run cache."""
    from graphfl.tests.cli_runner import graphfl_cli

    (tmp_path / "p2p_throughput.json").write_text("{}")
    res = graphfl_cli("bench", "p2p-throughput", "--quick", "--out", str(tmp_path), timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    text = " ".join((res.stdout + res.stderr).split())
    assert "already holds p2p_throughput.json" in text and "choose a new --out" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p2p_throughput.json"]  # nothing written, nothing lost


def test_network_round_is_the_last_peers_completion_interval() -> None:
    """Start-up skew is not round time: a peer that waited 40 s for a late neighbour does not make 40 s rounds."""
    from graphfl.bench.p2p_throughput import network_round_seconds

    early = [{"wall": w} for w in (1.0, 1.1, 41.2, 41.5)]   # ran ahead, then waited for the late peer
    late = [{"wall": w} for w in (41.0, 41.05, 41.3, 41.6)]  # started 40 s later
    got = network_round_seconds([early, late], 4)
    assert got[0] is None
    assert got[1:] == pytest.approx([0.05, 0.25, 0.3])  # T = 41.0, 41.05, 41.3, 41.6
    # a round some peer never finished has no time (not a made-up one)
    assert network_round_seconds([early, late[:2]], 4)[2:] == [None, None]


def test_flower_memory_estimate_covers_the_out_of_memory_case_and_spares_the_rest():
    """The guard skips (with the reason) a Flower case that would run the machine out of memory:
    10M x 16 nodes took 22 GB of processes when the kernel killed the SuperLink (24 GB machine),
    while every 1M case and 10M x 4 completed."""
    from graphfl.bench.p2p_throughput import flower_memory_mb

    assert flower_memory_mb(10_000_000, 16) > 22_000
    assert flower_memory_mb(1_000_000, 16) < 8_000 and flower_memory_mb(10_000_000, 4) < 12_000
    assert flower_memory_mb(1_000_000, 8) > flower_memory_mb(1_000_000, 4) > flower_memory_mb(100_000, 4)
