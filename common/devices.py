"""Which torch device ``auto`` means, from a model's size (no torch import here).

A tiny model's minibatch gradient is slower on a GPU than on one CPU thread (kernel launches
and host-device copies dominate), a convolutional network's much faster (the measurements:
docs/deployment.md, ``--device``). ``auto`` therefore picks the GPU only for models of at least
:data:`AUTO_GPU_MIN_PARAMS` parameters; ``cuda`` / ``cuda:N`` always use the GPU.
"""

from __future__ import annotations

AUTO_GPU_MIN_PARAMS = 100_000
"""``auto`` uses a visible GPU for models with at least this many parameters (module docstring)."""


def resolve_auto(gpu_available: bool, num_params: int | None) -> str:
    """``cuda`` when a GPU is visible and the model is large enough to gain from it, else ``cpu``.

    ``num_params=None`` (size unknown) keeps the GPU when one is visible.
    """
    if not gpu_available:
        return "cpu"
    if num_params is not None and num_params < AUTO_GPU_MIN_PARAMS:
        return "cpu"
    return "cuda"
