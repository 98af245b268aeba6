"""Which torch device ``auto`` means, from a model's size (no torch import here).

Measured on an H100 machine (16 CPU cores, torch 2.11, one thread per client as graphfl runs
them), one minibatch gradient of 32 samples as the p2p oracle computes it (parameters in,
gradient out as numpy):

============================  ==========  ===========  ==========
model                         parameters  CPU (ms)     CUDA (ms)
============================  ==========  ===========  ==========
digits MLP                         4,810        0.58         0.90
MNIST CNN (2 conv + 2 FC)      1,663,370       28.1          3.13
============================  ==========  ===========  ==========

A tiny model is slower on the GPU (kernel launches and host-device copies dominate), a
CNN is 9x faster. ``auto`` therefore picks the GPU only for models of at least
:data:`AUTO_GPU_MIN_PARAMS` parameters; ``cuda`` / ``cuda:N`` always use the GPU.
"""

from __future__ import annotations

AUTO_GPU_MIN_PARAMS = 100_000
"""``auto`` uses a visible GPU for models with at least this many parameters (see the table above)."""


def resolve_auto(gpu_available: bool, num_params: int | None) -> str:
    """``cuda`` when a GPU is visible and the model is large enough to gain from it, else ``cpu``.

    ``num_params=None`` (size unknown) keeps the GPU when one is visible.
    """
    if not gpu_available:
        return "cpu"
    if num_params is not None and num_params < AUTO_GPU_MIN_PARAMS:
        return "cpu"
    return "cuda"
