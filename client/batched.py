"""Many clients' local SGD as one batched computation (the ``batched`` engine's numerics).

The clients of a round share the model's architecture, so their parameters are stacked on a
leading *client axis* and one forward and backward serves all of them per local step
(``torch.func.vmap`` of ``grad`` of ``functional_call``). Every client keeps its own numbers:

* its minibatch indices are drawn from its own generator, in the order
  :func:`graphfl.client.training.sgd_steps` draws them (:func:`draw_indices`);
* its loss is ``ℓ(θ_i; batch_i) + Σ_t penalty_t(θ_i)`` with its own penalty tensors
  (:class:`~graphfl.client.objective.LocalObjective`, the same terms the per-client trainer adds);
* its update is :func:`~graphfl.client.training.sgd_update` applied to its slice (momentum and
  weight decay elementwise, so stacking changes nothing);
* a personal model (APFL, :class:`~graphfl.client.objective.PersonalModel`) is a second stack
  trained after each step on the loss of :func:`~graphfl.client.objective.mixture_output` with
  each client's own ``α_i`` (a vector over the client axis; its gradient is each client's own).

The forward is ``vmap`` of ``functional_call`` over the client axis; the backward is plain
autograd of the sum of the clients' losses, whose gradient with respect to client ``i``'s slice
is client ``i``'s own gradient (``torch.func.grad`` would give the same, but its first call
imports ``torch._dynamo``: seconds of set-up).

The results equal the per-client loop up to floating-point summation order (batched matrix
products reduce in another order): relative differences of about ``1e-7`` per step.

What cannot be batched, :func:`unbatchable_reason` says: inputs built by a ``collate`` function
(graph tasks: PyG batches of different sizes), models with buffers (batch norm) or random layers
(dropout), whose per-client numbers stacking would change. Memory is bounded by training the
client axis in chunks (:func:`client_chunk`).
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.profiler import record_function

from graphfl.client.objective import LocalObjective, OutputMix, PersonalResult, mixture_output
from graphfl.client.training import _batches, sgd_update
from graphfl.common.types import Arrays, ClientData
from graphfl.strategies.apfl_math import alpha_step

logger = logging.getLogger(__name__)

with warnings.catch_warnings():  # torch.func's import calls the deprecated torch.jit.script
    warnings.simplefilter("ignore", DeprecationWarning)
    from torch.func import functional_call, vmap

CPU_BUDGET_BYTES = 1 << 30
"""Working memory the client axis of one chunk may use on the CPU (1 GiB)."""
GPU_BUDGET_FRACTION = 0.5
"""Share of the GPU's free memory one chunk may use."""
PREGATHER_BYTES = 64 << 20
"""Up to this size a chunk's minibatches of all steps are gathered at once, else step by step."""
PROFILE_LABELS = {part: f"batched.{part}" for part in
                  ("gather", "forward", "backward", "optimizer", "personal", "unstack", "evaluate")}
"""``torch.profiler.record_function`` names of the parts of a batched round (``gather``: minibatch
indexing; ``forward``: the stacked forward, loss and penalties; ``backward``; ``optimizer``: the SGD
update; ``personal``: APFL's personal step; ``unstack``: the trained parameters to host arrays;
``evaluate``: test-split evaluation). Outside a profiler they cost a few microseconds each."""
RANDOM_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


def unbatchable_reason(model: nn.Module, data: ClientData) -> str | None:
    """Why clients of this model and data cannot train stacked, or ``None`` when they can."""
    if data.collate is not None:
        return "its inputs are built per batch by a collate function (graph batches differ in size)"
    buffers = [k for k, _ in model.named_buffers()]
    if buffers:
        return f"the model has buffers {buffers[:3]} (batch statistics are per client)"
    random_layers = [type(m).__name__ for m in model.modules() if isinstance(m, RANDOM_LAYERS)]
    if random_layers:
        return f"the model has random layers ({random_layers[0]})"
    return None


@dataclass
class StackedData:
    """Every client's train and test split, zero-padded to one tensor each, on ``device``.

    Row ``row[pid]`` of ``x_train`` holds client ``pid``'s training inputs in their own order,
    ``n_train[row]`` of them; the same for the test split.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    n_train: np.ndarray
    x_test: torch.Tensor
    y_test: torch.Tensor
    n_test: np.ndarray
    row: dict[int, int]

    @classmethod
    def build(cls, datas: Mapping[int, ClientData], device: str) -> StackedData:
        """Stack ``datas`` (partition id → data) in partition-id order."""
        pids = sorted(datas)

        def pad(arrays: list[np.ndarray]) -> tuple[torch.Tensor, np.ndarray]:
            n = np.array([len(a) for a in arrays], dtype=np.int64)
            ref = next((a for a in arrays if len(a)), arrays[0])
            out = np.zeros((len(arrays), max(int(n.max()), 1), *ref.shape[1:]), dtype=ref.dtype)
            for i, a in enumerate(arrays):
                out[i, : len(a)] = a
            return torch.as_tensor(out).to(device), n

        x_train, n_train = pad([datas[p].x_train for p in pids])
        y_train, _ = pad([datas[p].y_train for p in pids])
        x_test, n_test = pad([datas[p].x_test for p in pids])
        y_test, _ = pad([datas[p].y_test for p in pids])
        return cls(x_train, y_train, n_train, x_test, y_test, n_test, {p: i for i, p in enumerate(pids)})

    @property
    def nbytes(self) -> int:
        """Bytes of the stacked tensors."""
        return int(sum(t.numel() * t.element_size() for t in (self.x_train, self.y_train, self.x_test, self.y_test)))


def draw_indices(objective: LocalObjective, num_train: int, batch_size: int) -> np.ndarray:
    """The ``steps × batch`` minibatch indices of a client, drawn from its objective's generator
    exactly as :func:`graphfl.client.training.sgd_steps` draws them (raises ``ValueError`` for a
    client without training samples, as it does).
    """
    steps, rng = objective.steps, objective.rng
    if steps <= 0:
        return np.zeros((0, batch_size), dtype=np.int64)
    if num_train < batch_size:
        return np.stack(list(_batches(num_train, batch_size, steps, rng))).astype(np.int64)
    per_pass = num_train // batch_size          # _batches reshuffles when fewer than a batch is left
    passes = -(-steps // per_pass)
    orders = np.empty((passes, num_train), dtype=np.int64)
    for i in range(passes):                     # the same draws, in order
        orders[i] = rng.permutation(num_train)
    return orders[:, : per_pass * batch_size].reshape(-1, batch_size)[:steps]


def activation_numel(model: nn.Module, sample: torch.Tensor) -> int:
    """Elements of every module output for one sample (an activation-memory estimate)."""
    total = 0

    def hook(_m: nn.Module, _i: Any, out: Any) -> None:
        nonlocal total
        if isinstance(out, torch.Tensor):
            total += out.numel()

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        with torch.no_grad():
            model(sample[None])
    finally:
        for h in handles:
            h.remove()
    return max(total, 1)


def memory_budget(device: str) -> int:
    """Working memory one chunk of clients may use: :data:`CPU_BUDGET_BYTES` on the CPU,
    :data:`GPU_BUDGET_FRACTION` of the free memory on a GPU.
    """
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free * GPU_BUDGET_FRACTION)
    return CPU_BUDGET_BYTES


def client_bytes(model: nn.Module, sample: torch.Tensor, batch_size: int) -> int:
    """Working memory of one client in a batched step: parameters, gradients, momentum, anchors
    (5 copies) and a minibatch's activations for forward and backward (3 copies), float32.
    """
    numel = sum(p.numel() for p in model.parameters())
    return 4 * (5 * numel + 3 * batch_size * activation_numel(model, sample))


def penalty_bytes(objective: LocalObjective) -> int:
    """Bytes of one client's penalty tensors (BiG-FL's ``φ`` is ``d×d`` per client)."""
    def size(value: Any) -> int:
        if isinstance(value, dict):
            return sum(size(v) for v in value.values())
        return int(value.numel() * value.element_size())

    return sum(size(t.tensors) for t in objective.penalties)


def client_chunk(model: nn.Module, sample: torch.Tensor, batch_size: int, device: str,
                 budget_bytes: int | None = None) -> int:
    """How many clients train in one chunk: :func:`client_bytes` into ``budget_bytes`` (default
    :func:`memory_budget`).
    """
    budget = memory_budget(device) if budget_bytes is None else budget_bytes
    return max(1, int(budget // client_bytes(model, sample, batch_size)))


def _stack(items: Sequence[Any]) -> Any:
    """Stack a list of equally shaped tensors, or dicts of them, on a new leading axis."""
    first = items[0]
    if isinstance(first, dict):
        return {k: _stack([it[k] for it in items]) for k in first}
    return torch.stack(list(items))


UNREDUCED_LOSSES = (nn.CrossEntropyLoss, nn.MSELoss, nn.L1Loss)
"""Losses whose ``reduction='mean'`` is the plain mean of the ``reduction='none'`` values."""


def unreduced(loss_fn: nn.Module) -> nn.Module | None:
    """A copy of ``loss_fn`` with ``reduction='none'`` when its mean is the plain mean of those
    values (no class weights), else ``None``.
    """
    if type(loss_fn) not in UNREDUCED_LOSSES or getattr(loss_fn, "weight", None) is not None:
        return None
    out = copy.copy(loss_fn)
    setattr(out, "reduction", "none")  # noqa: B010 - an attribute of the loss classes above, not of Module
    return out


def per_sample_losses(loss_fn: nn.Module, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``loss_fn`` of each sample: ``outputs`` and ``targets`` have two leading axes (clients ×
    samples); returns clients × samples.

    A mean-reduced loss runs once on the flattened samples (:func:`unreduced`); any other runs
    under ``vmap`` over both axes, one sample at a time.
    """
    c, n = outputs.shape[:2]
    plain = unreduced(loss_fn)
    if plain is not None:
        values: torch.Tensor = plain(outputs.flatten(0, 1), targets.flatten(0, 1))
        return values.reshape(c, n, -1).mean(-1)

    def one(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        value: torch.Tensor = loss_fn(o[None], t[None])
        return value

    stacked: torch.Tensor = vmap(vmap(one))(outputs, targets)
    return stacked


def client_losses(loss_fn: nn.Module, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``loss_fn`` of each client's minibatch (clients × batch × ...): a vector over clients."""
    plain = unreduced(loss_fn)
    if plain is not None:
        c = outputs.shape[0]
        values: torch.Tensor = plain(outputs.flatten(0, 1), targets.flatten(0, 1))
        return values.reshape(c, -1).mean(1)
    stacked: torch.Tensor = vmap(loss_fn)(outputs, targets)
    return stacked


ELEMENTWISE = (nn.ReLU, nn.Sigmoid, nn.Tanh, nn.GELU, nn.LeakyReLU, nn.ELU, nn.SiLU, nn.Softplus, nn.Identity)
"""Parameter-free layers that act on each element, so a client axis in front changes nothing."""

StackedForward = Callable[[Mapping[str, torch.Tensor], torch.Tensor], torch.Tensor]


def _layer_plan(model: nn.Module) -> tuple[bool, list[tuple[Any, ...]]] | None:
    """``(flatten input, layers)`` of a stack of ``Linear`` and :data:`ELEMENTWISE` layers (a
    :class:`graphfl.tasks.models.MLP` or a plain ``nn.Sequential``), else ``None``.
    """
    from graphfl.tasks.models import MLP

    if type(model) is MLP:
        seq, prefix, flatten = model.net, "net.", True
    elif type(model) is nn.Sequential:
        seq, prefix, flatten = model, "", False
    else:
        return None
    plan: list[tuple[Any, ...]] = []
    for name, layer in seq.named_children():
        if type(layer) is nn.Linear:
            plan.append(("linear", f"{prefix}{name}.weight", f"{prefix}{name}.bias" if layer.bias is not None else None))
        elif type(layer) in ELEMENTWISE:
            plan.append(("act", layer))
        elif type(layer) is nn.Flatten and layer.start_dim == 1 and layer.end_dim == -1:
            plan.append(("flatten",))
        else:
            return None
    return flatten, plan


CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _per_client_forward(model: nn.Module) -> bool:
    """Whether the stacked forward runs client by client: a convolutional model on the CPU, where
    ``vmap`` turns each convolution into a grouped one (one group per client) that runs slower
    than the clients' own dense convolutions one after the other.
    """
    first = next(model.parameters(), None)
    return (first is not None and first.device.type == "cpu"
            and any(isinstance(m, CONVOLUTIONS) for m in model.modules()))


def stacked_forward(model: nn.Module) -> StackedForward:
    """``(stacked params, x) ↦ outputs`` for every client at once (inputs and outputs clients ×
    samples × ...).

    A stack of ``Linear`` and elementwise layers (:func:`_layer_plan`) runs as batched matrix
    products (``baddbmm``: one call per layer for all clients); a convolutional model on the CPU
    (:func:`_per_client_forward`) as ``functional_call`` on each client's slice of the stacked
    parameters in turn (the backward, the update and the rest of the step stay stacked); any
    other model as ``vmap`` of ``functional_call`` over the client axis. Both compute each client's own ``model(x_i)``,
    up to the order of floating-point summation.
    """
    found = _layer_plan(model)
    if found is None and _per_client_forward(model):
        def each(params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            slices = {k: v.unbind(0) for k, v in params.items()}    # one stack in the backward, not c
            return torch.stack([functional_call(model, {k: s[i] for k, s in slices.items()}, (x[i],))
                                for i in range(x.shape[0])])
        return each
    if found is None:
        mapped: StackedForward = vmap(lambda p, x: functional_call(model, dict(p), (x,)))
        return mapped
    flatten, plan = found

    def forward(params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        h = x.flatten(2) if flatten else x
        for layer in plan:
            if layer[0] == "linear":
                weight = params[layer[1]].transpose(1, 2)
                h = torch.bmm(h, weight) if layer[2] is None else torch.baddbmm(params[layer[2]].unsqueeze(1), h, weight)
            elif layer[0] == "act":
                h = layer[1](h)
            else:
                h = h.flatten(2)
        return h

    return forward


def _step_fn(model: nn.Module, loss_fn: nn.Module, objective: LocalObjective) -> Callable[..., Any]:
    """``(params, x, y, tensors) -> (total loss, data loss)`` per client, for stacked inputs."""
    terms = [(t.fn, t.static) for t in objective.penalties]
    forward = stacked_forward(model)

    def penalty(params: dict[str, torch.Tensor], tensors: list[dict[str, Any]]) -> torch.Tensor:
        (fn, static), t = terms[0], tensors[0]
        total: torch.Tensor = fn(params, t, *static)
        for (fn, static), t in zip(terms[1:], tensors[1:]):
            total = total + fn(params, t, *static)
        return total

    penalties = vmap(penalty) if terms else None

    def step(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
             tensors: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        data = client_losses(loss_fn, forward(params, x), y)
        return (data if penalties is None else data + penalties(params, tensors)), data

    return step


def batched_sgd(
    model: nn.Module, loss_fn: nn.Module, stacked: StackedData, pids: Sequence[int],
    objectives: Sequence[LocalObjective], indices: Sequence[np.ndarray], lr: float,
    momentum: float = 0.0, weight_decay: float = 0.0, chunk: int | None = None,
) -> tuple[list[Arrays], np.ndarray, list[PersonalResult | None]]:
    """Train clients ``pids`` (objectives of equal :attr:`~LocalObjective.signature`) together.

    ``indices[i]`` are client ``pids[i]``'s minibatches (:func:`draw_indices`). Returns each
    client's trained arrays (the model's ``state_dict`` keys, float32 numpy), mean data loss
    over its steps and trained personal model (``None`` without one). ``chunk`` clients at a
    time (default: all).
    """
    if not pids:
        return [], np.zeros(0), []
    chunk = chunk or len(pids)
    arrays: list[Arrays] = []
    losses: list[np.ndarray] = []
    personal: list[PersonalResult | None] = []
    for lo in range(0, len(pids), chunk):
        part = slice(lo, lo + chunk)
        a, l_, p = _train_chunk(model, loss_fn, stacked, pids[part], objectives[part], indices[part],
                                lr, momentum, weight_decay)
        arrays += a
        losses.append(l_)
        personal += p
    return arrays, np.concatenate(losses), personal


def _stack_arrays(items: Sequence[Arrays], keys: Sequence[str], device: Any) -> dict[str, torch.Tensor]:
    """``{key: clients × shape}`` float32 tensors on ``device`` from each client's arrays (one
    array repeated when every client holds the same object, as after a broadcast). The arrays
    may be read-only (a received payload's views): they are only read, into fresh tensors.
    """
    out = {}
    for k in keys:
        first = items[0][k]
        if all(a[k] is first for a in items):
            one = torch.tensor(np.asarray(first, dtype=np.float32)).to(device)  # a copy: the array may be read-only
            out[k] = one.unsqueeze(0).expand(len(items), *one.shape).clone()
        else:
            out[k] = torch.as_tensor(np.stack([np.asarray(a[k], dtype=np.float32) for a in items])).to(device)
    return out


def _unstack(params: Mapping[str, torch.Tensor], keys: Sequence[str], n: int) -> list[Arrays]:
    """Each client's arrays: rows of one fresh host copy per key (disjoint views, nothing else holds them)."""
    host = {k: list(np.array(params[k].detach().cpu().numpy(), copy=True)) for k in keys}
    return [{k: host[k][i] for k in keys} for i in range(n)]


def _mean_over_steps(values: list[torch.Tensor], n: int) -> np.ndarray:
    if not values:
        return np.zeros(n)
    out: np.ndarray = (torch.stack(values).double().sum(0) / len(values)).cpu().numpy()
    return out


def _train_chunk(
    model: nn.Module, loss_fn: nn.Module, stacked: StackedData, pids: Sequence[int],
    objectives: Sequence[LocalObjective], indices: Sequence[np.ndarray], lr: float,
    momentum: float, weight_decay: float,
) -> tuple[list[Arrays], np.ndarray, list[PersonalResult | None]]:
    device = stacked.x_train.device
    keys = [k for k, _ in model.named_parameters()]
    params = _stack_arrays([o.start for o in objectives], keys, device)
    n_terms = len(objectives[0].penalties)
    tensors = [_stack([o.penalties[t].to(str(device)).tensors for o in objectives]) for t in range(n_terms)]
    step = _step_fn(model, loss_fn, objectives[0])
    rows = torch.as_tensor([stacked.row[p] for p in pids], device=device)[:, None, None]
    idx = torch.as_tensor(np.stack(indices)).to(device)          # clients × steps × batch
    steps = idx.shape[1]
    gathered = idx.numel() * (stacked.x_train[0, 0].numel() * stacked.x_train.element_size()
                              + stacked.y_train[0, 0].numel() * stacked.y_train.element_size())
    if gathered <= PREGATHER_BYTES:    # every step's minibatch in one gather: steps × clients × batch × ...
        by_step, rows_t = idx.transpose(0, 1), rows.transpose(0, 1)     # steps × clients × batch
        with record_function(PROFILE_LABELS["gather"]):
            xs = stacked.x_train[rows_t, by_step]
            ys = stacked.y_train[rows_t, by_step]

        def minibatch(s: int) -> tuple[torch.Tensor, torch.Tensor]:
            return xs[s], ys[s]
    else:
        def minibatch(s: int) -> tuple[torch.Tensor, torch.Tensor]:
            return stacked.x_train[rows[:, 0], idx[:, s]], stacked.y_train[rows[:, 0], idx[:, s]]
    plist = [params[k].requires_grad_() for k in keys]
    buffers: list[torch.Tensor | None] = [None] * len(plist)
    data_losses: list[torch.Tensor] = []
    first = objectives[0].personal
    personal = None
    if first is not None:
        personal = _PersonalStack(model, loss_fn, [o.personal for o in objectives], keys, device)
    with torch.enable_grad():
        for s in range(steps):
            with record_function(PROFILE_LABELS["gather"]):
                x, y = minibatch(s)
            for p in plist:
                p.grad = None
            with record_function(PROFILE_LABELS["forward"]):
                total, data = step(params, x, y, tensors)
            data_losses.append(data.detach())
            with record_function(PROFILE_LABELS["backward"]):
                total.sum().backward()
            with record_function(PROFILE_LABELS["optimizer"]):
                sgd_update(plist, buffers, lr, momentum, weight_decay)
            if personal is not None:
                with record_function(PROFILE_LABELS["personal"]):
                    personal.step(params, x, y, lr, momentum, weight_decay)
    n = len(pids)
    with record_function(PROFILE_LABELS["unstack"]):
        trained = _unstack(params, keys, n)
    mean_loss = _mean_over_steps(data_losses, n) if steps else np.zeros(n)
    if personal is None:
        return trained, mean_loss, [None] * n
    return trained, mean_loss, personal.results(n)


class _PersonalStack:
    """The personal models ``v_i`` of a chunk, stacked, and their ``α_i`` (one step per call).

    Each step, after the step of ``w_i``: ``ŷ_i = mixture_output(α_i, h(v_i; x_i), h(w_i; x_i))``
    with ``h(w_i)`` at the post-step ``w_i``, ``v_i`` by the same SGD rule on ``ℓ(ŷ_i, y_i)`` and,
    adaptive, ``α_i ← alpha_step(α_i, ∂ℓ/∂α_i, alpha_lr)`` (the per-client trainer's
    :func:`graphfl.client.gate_trainer.personal_step`).
    """

    def __init__(self, model: nn.Module, loss_fn: nn.Module, specs: Sequence[Any], keys: Sequence[str],
                 device: Any) -> None:
        self.loss_fn, self.keys = loss_fn, list(keys)
        self.forward = stacked_forward(model)
        self.params = _stack_arrays([s.start for s in specs], keys, device)
        self.plist = [self.params[k].requires_grad_() for k in keys]
        self.buffers: list[torch.Tensor | None] = [None] * len(self.plist)
        self.alpha = [float(s.alpha) for s in specs]
        self.adaptive, self.alpha_lr = bool(specs[0].adaptive), float(specs[0].alpha_lr)
        self.losses: list[torch.Tensor] = []
        self.device = device

    def step(self, params_w: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, lr: float,
             momentum: float, weight_decay: float) -> None:
        with torch.no_grad():
            h_w = self.forward(dict(params_w), x)
        a = torch.tensor(self.alpha, dtype=h_w.dtype, device=h_w.device, requires_grad=self.adaptive)
        for p in self.plist:
            p.grad = None
        h_v = self.forward(self.params, x)
        y_hat = mixture_output(a.reshape(-1, *([1] * (h_v.dim() - 1))), h_v, h_w)
        losses = client_losses(self.loss_fn, y_hat, y)
        losses.sum().backward()
        sgd_update(self.plist, self.buffers, lr, momentum, weight_decay)
        self.losses.append(losses.detach())
        if self.adaptive:
            assert a.grad is not None
            self.alpha = [alpha_step(al, g, self.alpha_lr) for al, g in zip(self.alpha, a.grad.tolist())]

    def results(self, n: int) -> list[PersonalResult | None]:
        arrays = _unstack(self.params, self.keys, n)
        loss = _mean_over_steps(self.losses, n)
        return [PersonalResult(arrays[i], self.alpha[i], float(loss[i])) for i in range(n)]


def batched_evaluate(
    model: nn.Module, loss_fn: nn.Module, classification: bool, stacked: StackedData,
    pids: Sequence[int], arrays: Sequence[Arrays | OutputMix], chunk: int | None = None,
) -> list[dict[str, float]]:
    """Each model ``arrays[i]`` on client ``pids[i]``'s test split, all at once.

    An item is a model's arrays or an :class:`~graphfl.client.objective.OutputMix` (the output
    ``α h(v) + (1 − α) h(w)``). The metrics of :func:`graphfl.client.training.evaluate_model`:
    ``test_loss`` (the mean of the per-sample losses), ``num_test`` and, for classification,
    ``test_acc``; ``nan`` for a client without test samples. The loss must be a mean over
    samples (``reduction='mean'``).
    """
    out: list[dict[str, float] | None] = [None] * len(pids)
    chunk = chunk or max(len(pids), 1)
    for kind in (False, True):      # plain models, then mixtures: each chunk holds one kind
        where = [i for i, a in enumerate(arrays) if isinstance(a, OutputMix) == kind]
        for lo in range(0, len(where), chunk):
            part = where[lo : lo + chunk]
            with record_function(PROFILE_LABELS["evaluate"]):
                results = _evaluate_chunk(model, loss_fn, classification, stacked, [pids[i] for i in part],
                                          [arrays[i] for i in part])
            for i, metrics in zip(part, results):
                out[i] = metrics
    return [m for m in out if m is not None]


def _evaluate_chunk(model: nn.Module, loss_fn: nn.Module, classification: bool, stacked: StackedData,
                    pids: Sequence[int], arrays: Sequence[Arrays | OutputMix]) -> list[dict[str, float]]:
    device = stacked.x_test.device
    keys = [k for k, _ in model.named_parameters()]
    rows = torch.as_tensor([stacked.row[p] for p in pids], device=device)
    x, y = stacked.x_test[rows], stacked.y_test[rows]
    n = torch.as_tensor(stacked.n_test[rows.cpu().numpy()], device=device)
    forward = stacked_forward(model)
    if isinstance(arrays[0], OutputMix):
        mixes: list[OutputMix] = list(arrays)  # type: ignore[arg-type]
        h_v = forward(_stack_arrays([m.v for m in mixes], keys, device), x)
        h_w = forward(_stack_arrays([m.w for m in mixes], keys, device), x)
        alpha = torch.tensor([float(m.alpha) for m in mixes], dtype=h_v.dtype, device=device)
        outputs = mixture_output(alpha.reshape(-1, *([1] * (h_v.dim() - 1))), h_v, h_w)
    else:
        outputs = forward(_stack_arrays(arrays, keys, device), x)  # type: ignore[arg-type]
    per = per_sample_losses(loss_fn, outputs, y)
    mask = torch.arange(x.shape[1], device=device)[None, :] < n[:, None]
    nf = n.to(per.dtype)
    loss = ((per * mask).double().sum(1) / nf.double()).cpu().numpy()
    acc = None
    if classification:
        acc = (((outputs.argmax(-1) == y) & mask).sum(1).double() / nf.double()).cpu().numpy()
    result = []
    for i in range(len(pids)):
        num = int(n[i])
        m = {"test_loss": float(loss[i]) if num else float("nan"), "num_test": float(num)}
        if acc is not None:
            m["test_acc"] = float(acc[i]) if num else float("nan")
        result.append(m)
    return result
