"""The one place where graphfl touches Flower's non-public names (the Flower seam).

Every import of a private ``flwr`` module path, private attribute or patched function lives
here; ``tests/test_flower_seam.py`` forbids them anywhere else. Each use is a named fast path
(:class:`graphfl.flowerx.policy.FastPath`) that runs only on the Flower versions it was verified
on and when its check of Flower's internals passes; otherwise it is off, one log line says so,
and graphfl runs on Flower's stock behaviour (:mod:`graphfl.flowerx.policy`). Layer 0: imports
``flwr``, the two Flower dependencies whose objects the wrapped code hands around (Starlette,
httpx) and the standard library only.
"""
