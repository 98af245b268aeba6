"""graphfl.deploy — real processes, for both runtimes.

* Flower: :mod:`~graphfl.deploy.run` (``graphfl run``), :mod:`~graphfl.deploy.federation` (a local
  SuperLink and SuperNodes), :mod:`~graphfl.deploy.superlink`, :mod:`~graphfl.deploy.supernode`,
  :mod:`~graphfl.deploy.warm`, :mod:`~graphfl.deploy.processes` (process groups and teardown);
* p2p: :mod:`~graphfl.deploy.p2p_launch` (``graphfl p2p``: one peer process per node),
  :mod:`~graphfl.deploy.p2p_inprocess` (``--engine inprocess``), :mod:`~graphfl.deploy.p2p_outdir`
  (output-folder rules), :mod:`~graphfl.deploy.p2p_cli` (the ``graphfl peer`` / ``graphfl p2p`` commands).
"""
