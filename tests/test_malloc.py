"""common/malloc.py: freed model-sized buffers are reused instead of faulted in again every round."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from graphfl.common.malloc import ENV, keep_freed_memory

ROUNDS = """
import json, resource, sys
import numpy as np
from graphfl.common.malloc import keep_freed_memory
mode = keep_freed_memory() if sys.argv[1] == "keep" else "untouched"
x = np.ones(1_000_000, np.float32)
def one_round():  # what a peer does with a 1M-parameter model: two new 4 MB arrays, then freed
    acc = np.empty_like(x); term = np.empty_like(x)
    np.multiply(x, 0.5, out=acc); np.multiply(x, 0.5, out=term); acc += term
    return float(acc[0])
one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    one_round()
print(json.dumps({"mode": mode, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def run_rounds(kind: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "GLIBC_TUNABLES")}
    res = subprocess.run([sys.executable, "-c", ROUNDS, kind], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's; elsewhere nothing is changed")
def test_freed_buffers_are_reused_not_faulted_in_again():
    kept, default = run_rounds("keep"), run_rounds("default")
    assert kept["mode"] == "retain"
    # 50 rounds x 2 arrays x ~1000 pages with glibc's defaults; a few pages when kept
    assert default["faults"] > 20_000, default
    assert kept["faults"] < 2_000, kept


def test_env_keeps_glibc_defaults(monkeypatch):
    monkeypatch.setenv(ENV, "default")
    assert keep_freed_memory() == "default"
