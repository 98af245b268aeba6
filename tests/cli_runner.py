"""Run the ``graphfl`` command line as a user would (a real process), for the end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


def graphfl_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``graphfl *args``; output goes to files, not pipes: Flower's SuperExec child watches its
    parent's pid and would keep a pipe open while the exited parent waits to be reaped."""
    exe = Path(sys.executable).with_name("graphfl")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([str(exe), *args], stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                env={**os.environ, "COLUMNS": "200"})
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, code, out.read(), err.read())


def default_sigint() -> None:
    """``preexec_fn`` for a child that a test sends SIGINT (a simulated Ctrl-C): SIGINT back to
    its default before exec, so Python turns it into KeyboardInterrupt even when the tests run
    with SIGINT ignored (a background job of a non-interactive shell inherits it ignored, and
    Python then leaves it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
