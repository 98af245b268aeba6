"""Environment facts recorded next to every result (python, torch, flwr, cpus, device)."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def env_info(device: str | None = None) -> dict[str, object]:
    """A small, JSON-ready description of the machine and library versions.

    ``device`` is the torch device the computation really used, where the caller knows it (an
    in-process run); otherwise only ``gpu_visible`` (and ``gpu``) describe this process's
    machine, and a deployment's rows say how many clients trained on a GPU (``clients_on_gpu``).
    torch is asked only when it is already imported: a numpy-only run (p2p on linear problems)
    must not pay torch's import (seconds and hundreds of MB) for this line; ``gpu_visible`` is then absent.
    """
    info: dict[str, object] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "graphfl": _version("graphfl"),
        "flwr": _version("flwr"),
        "torch": _version("torch"),
        "numpy": _version("numpy"),
        "grpcio": _version("grpcio"),
    }
    if "torch" in sys.modules:
        try:
            import torch

            info["gpu_visible"] = bool(torch.cuda.is_available())
            if info["gpu_visible"]:
                info["gpu"] = torch.cuda.get_device_name(0)
        except (ImportError, RuntimeError):  # pragma: no cover - torch is a dependency
            info["gpu_visible"] = False
    if device is not None:
        info["device"] = device
    return info


def peak_rss_mb() -> float | None:
    """Peak resident set of the calling process in MB: ``VmHWM`` of ``/proc/self/status`` (Linux).

    Not ``getrusage(...).ru_maxrss``: Linux carries the parent's high-water mark over ``fork`` +
    ``exec`` into it, so a child spawned by a 100 MB parent reports at least 100 MB. ``None``
    where ``/proc`` is missing.
    """
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None
