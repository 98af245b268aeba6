"""The one place where graphfl touches Flower's non-public names (the Flower seam).

Every import of a private ``flwr`` module path, private attribute or patched function lives
here; ``tests/test_flower_seam.py`` forbids them anywhere else. Only ``flwr`` and the standard
library are imported.
"""
