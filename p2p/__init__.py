"""graphfl.p2p — the serverless peer-to-peer layer (docs/p2p.md).

Modules, one job each:

* :mod:`~graphfl.p2p.topology` — network description (TOML) and generators;
* :mod:`~graphfl.p2p.mixing` — mixing matrices, validation, per-round re-weighting, ``mix``;
* :mod:`~graphfl.p2p.algorithms` — the node contract (per-neighbour messages on named channels
  -> ``combine`` -> ``step``, per-edge state), the registry, one module per algorithm
  (DFL-SGD, DFL-GT, gossip, FedADMM, FedRelax) and the mathematics beside them (the pure cores
  of FedADMM and FedRelax, the robust combine rules);
* :mod:`~graphfl.p2p.oracles` — a node's local problem (task model + data, or tabular data such as
  the users' CSV files) as a gradient oracle / data problem;
* :mod:`~graphfl.p2p.node` — one iteration of one node, shared by both runtimes;
* :mod:`~graphfl.p2p.driver` — in-process driver (all nodes) and the one-node loop;
* :mod:`~graphfl.p2p.vectorised` — all nodes as stacked arrays (gossip / DFL-SGD / DFL-GT on linear problems);
* :mod:`~graphfl.p2p.checkpoint` — per-node checkpoints (npz + json, atomic, no pickle);
* :mod:`~graphfl.p2p.codec` — tensors <-> protobuf frames (never pickle);
* :mod:`~graphfl.p2p.transport` — transport interface, mailbox, in-process transport;
* :mod:`~graphfl.p2p.grpc_transport` — gRPC transport (handshake, mutual TLS, chunked push);
* :mod:`~graphfl.p2p.exchange` — one exchange: send, gather per-neighbour messages, failure policy;
* :mod:`~graphfl.p2p.config` — run config and network file (certificates: :mod:`graphfl.common.certs`);
* :mod:`~graphfl.p2p.peer` — one peer process (``python -m graphfl.p2p peer``).

Starting peers is :mod:`graphfl.deploy`'s job, beside the Flower launcher: a local network of peer
processes (:mod:`graphfl.deploy.p2p_launch`), ``graphfl p2p --engine inprocess``
(:mod:`graphfl.deploy.p2p_inprocess`), the output-folder rules (:mod:`graphfl.deploy.p2p_outdir`) and
the ``graphfl peer`` / ``graphfl p2p`` commands (:mod:`graphfl.deploy.p2p_cli`).
"""
