"""Environment facts recorded next to every result (python, torch, flwr, cpus, device)."""

from __future__ import annotations

import os
import platform
from importlib import metadata


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def env_info(device: str | None = None) -> dict[str, object]:
    """A small, JSON-ready description of the machine and library versions."""
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
    if device is None:
        try:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
            if device == "cuda":
                info["gpu"] = torch.cuda.get_device_name(0)
        except (ImportError, RuntimeError):  # pragma: no cover - torch is a dependency
            device = "cpu"
    info["device"] = device
    return info
