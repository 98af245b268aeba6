"""Decentralized (p2p) algorithms: the node contract, one module per algorithm, one registry.

* :mod:`~graphfl.p2p.algorithms.base` — the contract (:class:`P2PAlgorithm`, :class:`NodeState`,
  :class:`Outgoing`, :class:`Inbox`, :class:`NodeContext`, default ``combine`` = mixing);
* :mod:`~graphfl.p2p.algorithms.registry` — name -> params type + factory;
* :mod:`~graphfl.p2p.algorithms.dfl_sgd`, :mod:`~graphfl.p2p.algorithms.dfl_gt`,
  :mod:`~graphfl.p2p.algorithms.gossip` — ALGORITHMS §2, §3 and plain gossip;
* :mod:`~graphfl.p2p.algorithms.admm`, :mod:`~graphfl.p2p.algorithms.fedrelax` — FedADMM and FedRelax
  (ALGORITHMS §6, §7) on the contract; their mathematics, pure numpy / scikit-learn and tested on
  their own, in :mod:`~graphfl.p2p.algorithms.admm_math` and :mod:`~graphfl.p2p.algorithms.fedrelax_math`;
* :mod:`~graphfl.p2p.algorithms.steps` — step-size rules shared by the first-order algorithms;
* :mod:`~graphfl.p2p.algorithms.robust` — robust ``combine`` rules (clipping, trimmed mean) for
  the mixing algorithms.

A new algorithm is one module that subclasses :class:`P2PAlgorithm` and calls
:func:`~graphfl.p2p.algorithms.registry.register` (docs/p2p.md, "Writing a p2p algorithm").
"""

from graphfl.p2p.algorithms.base import (
    PARAMS,
    THETA,
    Channels,
    ChannelSpecs,
    GradientOracle,
    Inbox,
    LocalProblem,
    NodeContext,
    NodeState,
    Outgoing,
    P2PAlgorithm,
    Phase,
    mix_inbox,
)
from graphfl.p2p.algorithms.registry import P2PAlgorithmSpec, all_specs, create, get, names, register

__all__ = [
    "PARAMS",
    "THETA",
    "ChannelSpecs",
    "Channels",
    "GradientOracle",
    "Inbox",
    "LocalProblem",
    "NodeContext",
    "NodeState",
    "Outgoing",
    "P2PAlgorithm",
    "P2PAlgorithmSpec",
    "Phase",
    "all_specs",
    "create",
    "get",
    "mix_inbox",
    "names",
    "register",
]
