"""graphfl.p2p — the serverless peer-to-peer layer (docs/p2p.md).

Modules, one job each:

* :mod:`~graphfl.p2p.topology` — network description (TOML) and generators;
* :mod:`~graphfl.p2p.mixing` — mixing matrices, validation, per-round re-weighting, ``mix``;
* :mod:`~graphfl.p2p.algorithms` — DFL-SGD / DFL-GT / gossip as per-node step functions;
* :mod:`~graphfl.p2p.oracles` — a node's local problem (task model + data) as a gradient oracle;
* :mod:`~graphfl.p2p.driver` — in-process driver (all nodes) and the one-node loop;
* :mod:`~graphfl.p2p.codec` — tensors <-> protobuf frames (never pickle);
* :mod:`~graphfl.p2p.transport` — transport interface, mailbox, in-process transport;
* :mod:`~graphfl.p2p.grpc_transport` — gRPC transport (handshake, mutual TLS, chunked push);
* :mod:`~graphfl.p2p.exchange` — one gossip exchange with the failure policy;
* :mod:`~graphfl.p2p.config`, :mod:`~graphfl.p2p.tls` — run config / network file, certificates;
* :mod:`~graphfl.p2p.peer`, :mod:`~graphfl.p2p.launcher`, :mod:`~graphfl.p2p.cli` — processes and commands.
"""
