"""The live web dashboard (``graphfl dashboard``): a read-only view of run, p2p and benchmark folders.

:mod:`~graphfl.dashboard.readers` turns a folder's result files (``run.json``, ``progress.jsonl``,
``network.toml``, ``peer-<id>.json`` / ``.rounds.jsonl`` / ``.status.json``, ``p2p.json``, bench
JSON) into one JSON-ready snapshot; :mod:`~graphfl.dashboard.server` serves the page (``static/``)
and the snapshots over the standard library's HTTP server. Nothing here writes into the folders.
"""
