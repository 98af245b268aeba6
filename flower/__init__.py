"""Flower-native graphfl strategies: classes a user drops into their own ServerApp.

Each class is a real Flower ``Strategy`` built on graphfl's pure server cores
(``graphfl.strategies``); the client helpers (Flower mods) a ClientApp adds where an
algorithm needs the client's cooperation live beside them.
"""

from graphfl.flower.adapter import CooperationError, GraphflStrategy, WrapperRefused
from graphfl.flower.strategies import (
    APFL,
    CFL,
    JGESR,
    APFLGate,
    BiGFL,
    FedAMP,
    FedAvg,
    FedGATE,
    FedProx,
    FeSEM,
    Local,
    PFedGraph,
)

__all__ = ["APFL", "CFL", "JGESR", "APFLGate", "BiGFL", "CooperationError", "FeSEM", "FedAMP", "FedAvg", "FedGATE",
           "FedProx", "GraphflStrategy", "Local", "PFedGraph", "WrapperRefused"]
