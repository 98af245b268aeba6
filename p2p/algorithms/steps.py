"""Step sizes and the float64 update shared by the first-order algorithms (ALGORITHMS §2.2)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from graphfl.common.config import ConfigError
from graphfl.p2p.algorithms.base import Array

STEP_RULES = ("inv-sqrt", "constant")


@dataclass(frozen=True)
class StepSize:
    """``α_t = alpha0 / sqrt(t + 1)`` (``rule="inv-sqrt"``, ALGORITHMS §2.2) or ``α_t = alpha0``.

    The ``t + 1`` shift of the seed's ``15/√t`` avoids ``t = 0`` (reconstructed).
    """

    alpha0: float = 0.1
    rule: str = "inv-sqrt"

    def __post_init__(self) -> None:
        if self.rule not in STEP_RULES:
            raise ConfigError(f"step-rule = {self.rule!r} is not valid; choose one of {list(STEP_RULES)}")

    def __call__(self, t: int) -> float:
        if self.rule == "inv-sqrt":
            return self.alpha0 / math.sqrt(t + 1)
        return self.alpha0


def axpy(base: Array, alpha: float, g: Array) -> Array:
    """``base − α g`` accumulated in float64, cast back to ``base.dtype`` (one rounding per step)."""
    out: Array = (np.asarray(base, np.float64) - alpha * np.asarray(g, np.float64)).astype(base.dtype, copy=False)
    return out
