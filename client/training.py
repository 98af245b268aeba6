"""Torch helpers shared by client trainers: arrays <-> model, local SGD, evaluation.

Every function is deterministic given its ``rng``; trainers derive that generator from
(seed, partition id, round) so the Flower ClientApp and the in-process driver agree.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from graphfl.common.devices import resolve_auto
from graphfl.common.types import ClientData


def get_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """``state_dict`` as numpy arrays (copies, CPU), in registration order."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def check_arrays(shapes: dict[str, tuple[int, ...]], arrays: dict[str, np.ndarray]) -> None:
    """Raise ValueError naming the problem when ``arrays`` do not fit a model whose ``state_dict``
    has these ``shapes`` (missing or extra keys, a wrong shape).
    """
    missing = [k for k in shapes if k not in arrays]
    extra = [k for k in arrays if k not in shapes]
    if missing or extra:
        raise ValueError(f"arrays do not match the model: missing {missing}, unexpected {extra}")
    for k, shape in shapes.items():
        if tuple(arrays[k].shape) != shape:
            raise ValueError(f"array {k!r} has shape {arrays[k].shape}, the model expects {shape}")


def set_arrays(model: nn.Module, arrays: dict[str, np.ndarray]) -> None:
    """Load named arrays into ``model``; missing/extra keys or wrong shapes raise ValueError.

    ``load_state_dict`` copies each array into the model's own tensors, so read-only arrays (views
    into a received message, :func:`graphfl.common.records.unpack_arrays`) are loaded without a
    copy of their own: the temporary tensors that share their memory are only read.
    """
    own = model.state_dict()
    check_arrays({k: tuple(v.shape) for k, v in own.items()}, arrays)
    with warnings.catch_warnings():  # torch's warning about sharing a read-only array (read only here)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        model.load_state_dict({k: torch.as_tensor(np.asarray(arrays[k])) for k in own})


def param_keys(model: nn.Module) -> tuple[str, ...]:
    """Keys of trainable parameters (θ of ALGORITHMS.md §1.1), in registration order."""
    return tuple(name for name, _ in model.named_parameters())


def pick_device(requested: str = "auto", num_params: int | None = None) -> str:
    """The torch device a client trains on.

    ``auto``: ``cuda`` when torch sees a GPU and the model has at least
    :data:`graphfl.common.devices.AUTO_GPU_MIN_PARAMS` parameters (``num_params``; a tiny model
    is slower on a GPU, :mod:`graphfl.common.devices`), else ``cpu``.
    ``cuda`` / ``cuda:N``: that GPU, an error naming what torch sees when it is absent (a
    missing GPU is an error only if asked for).
    """
    if requested == "auto":
        return resolve_auto(torch.cuda.is_available(), num_params)
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {requested!r} requested but torch sees no CUDA device")
        _, _, index = requested.partition(":")
        if index and int(index) >= torch.cuda.device_count():
            raise RuntimeError(f"device {requested!r} requested but torch sees {torch.cuda.device_count()} GPU(s) "
                               f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
    return requested


def _batches(n: int, batch_size: int, steps: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Yield ``steps`` index batches, reshuffling each pass (with replacement if n < batch)."""
    if n == 0:
        raise ValueError("client has no training samples")
    if n < batch_size:
        for _ in range(steps):
            yield rng.integers(0, n, size=batch_size)
        return
    order = rng.permutation(n)
    pos = 0
    for _ in range(steps):
        if pos + batch_size > n:
            order, pos = rng.permutation(n), 0
        yield order[pos : pos + batch_size]
        pos += batch_size


def sgd_steps(
    model: nn.Module,
    data: ClientData,
    loss_fn: nn.Module,
    steps: int,
    batch_size: int,
    lr: float,
    rng: np.random.Generator,
    penalty: Callable[[nn.Module], torch.Tensor] | None = None,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    device: str = "cpu",
) -> float:
    """Run ``steps`` minibatch SGD steps on ``data`` (train split); return the mean data loss.

    Update: ``θ ← θ − lr · ∇[ℓ(θ; batch) + penalty(θ)]`` (torch SGD, optional momentum and
    weight decay). ``penalty`` carries algorithm-specific terms, e.g. FedProx's
    ``μ/2 ‖θ − θ_global‖²``.
    """
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    buffers: list[torch.Tensor | None] = [None] * len(params)
    collate = data.collate
    x_tensor = torch.as_tensor(data.x_train) if collate is None else None
    y_all = torch.as_tensor(data.y_train)
    total = 0.0
    for idx in _batches(len(data.x_train), batch_size, steps, rng):
        idx_t = torch.as_tensor(idx)
        if x_tensor is not None:
            x = x_tensor[idx_t].to(device)
        else:
            assert collate is not None
            x = collate(data.x_train[idx]).to(device)
        y = y_all[idx_t].to(device)
        for p in params:
            p.grad = None
        loss = loss_fn(model(x), y)
        total += float(loss.detach())
        if penalty is not None:
            loss = loss + penalty(model)
        loss.backward()
        sgd_update(params, buffers, lr, momentum, weight_decay)
    return total / max(steps, 1)


def model_input(x: np.ndarray, collate: Callable[[np.ndarray], Any] | None, device: str) -> Any:
    """The model input for the sample rows ``x`` on ``device`` (``ClientData.collate`` or a tensor)."""
    return (collate(x) if collate is not None else torch.as_tensor(x)).to(device)


@torch.no_grad()
def sgd_update(params: Sequence[torch.Tensor], buffers: list[torch.Tensor | None], lr: float,
               momentum: float = 0.0, weight_decay: float = 0.0) -> None:
    """One step of PyTorch's SGD (dampening 0, no Nesterov), in place.

    ``g ← ∇ + wd·θ``; with momentum ``b ← g`` on the first step, then ``b ← μ b + g``, ``g ← b``;
    ``θ ← θ − lr·g``. Written out because constructing ``torch.optim.SGD`` imports
    ``torch._dynamo`` (about 1.5 s), paid by every ClientApp process in deployment.
    """
    for i, p in enumerate(params):
        if p.grad is None:
            continue
        g = p.grad
        if weight_decay:
            g = g.add(p, alpha=weight_decay)
        if momentum:
            buf = buffers[i]
            if buf is None:
                buf = buffers[i] = g.detach().clone()
            else:
                buf.mul_(momentum).add_(g)
            g = buf
        p.add_(g, alpha=-lr)


@torch.no_grad()
def evaluate_model(
    model: nn.Module, x: np.ndarray, y: np.ndarray, loss_fn: nn.Module, classification: bool,
    device: str = "cpu", batch_size: int = 1024,
    collate: Callable[[np.ndarray], Any] | None = None,
    metrics_fn: Callable[[np.ndarray, np.ndarray], dict[str, float]] | None = None,
) -> dict[str, float]:
    """Mean loss (and accuracy for classification) of ``model`` on (x, y).

    ``collate`` builds each batch's input (see :class:`~graphfl.common.types.ClientData`);
    ``metrics_fn(outputs, y)`` adds task metrics computed on all outputs at once (a task's
    :meth:`~graphfl.tasks.base.Task.metrics`, e.g. ROC-AUC, which does not average over batches).
    """
    model.to(device).eval()
    n = len(x)
    if n == 0:
        out = {"test_loss": float("nan"), "num_test": 0.0}
        if classification:
            out["test_acc"] = float("nan")
        if metrics_fn is not None:
            out.update(metrics_fn(np.zeros((0,), np.float32), np.asarray(y)))
        return out
    loss_sum, correct = 0.0, 0
    outputs: list[np.ndarray] = []
    for start in range(0, n, batch_size):
        xb = model_input(x[start : start + batch_size], collate, device)
        yb = torch.as_tensor(y[start : start + batch_size]).to(device)
        out_b = model(xb)
        loss_sum += float(loss_fn(out_b, yb)) * len(yb)
        if classification:
            correct += int((out_b.argmax(1) == yb).sum())
        if metrics_fn is not None:
            outputs.append(out_b.detach().cpu().numpy())
    out = {"test_loss": loss_sum / n, "num_test": float(n)}
    if classification:
        out["test_acc"] = correct / n
    if metrics_fn is not None:
        out.update(metrics_fn(np.concatenate(outputs), np.asarray(y)))
    return out


def evaluate_client(model: nn.Module, task: Any, data: ClientData, loss_fn: nn.Module,
                    device: str = "cpu") -> dict[str, float]:
    """:func:`evaluate_model` on ``data``'s test split with the task's collate and metrics."""
    return evaluate_model(model, data.x_test, data.y_test, loss_fn, task.kind == "classification",
                          device=device, collate=data.collate, metrics_fn=task.metrics)
