"""graphfl: graph-aware federated learning.

The repository root is this package; its top-level folders are the subpackages:

- ``graphfl.strategies``: server-side algorithms (pure cores + one Flower adapter)
- ``graphfl.client``: the Flower ClientApp and the client half of each algorithm
- ``graphfl.server``: the Flower ServerApp, the in-process driver, results
- ``graphfl.p2p``: the gRPC peer-to-peer layer and decentralized algorithms
- ``graphfl.deploy``: launching real SuperLink/SuperNode processes, TLS material
- ``graphfl.tasks``: datasets, partitions, models, client graphs
- ``graphfl.common``: config, registry, CLI, environment info
- ``graphfl.bench``: paper reproductions (``graphfl bench NAME``)
"""

__version__ = "0.1.0"
