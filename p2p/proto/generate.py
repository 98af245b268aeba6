"""Regenerate ``graphfl_p2p_pb2.py`` (+ ``.pyi`` type stub) / ``graphfl_p2p_pb2_grpc.py`` from ``graphfl_p2p.proto``.

Needs grpcio-tools. The generated modules are committed, so installing graphfl does not need
grpcio-tools; ``tests/test_p2p_wire.py`` checks that they are up to date with the ``.proto`` file.
Run ``python -m graphfl.p2p.proto.generate [OUTDIR]``.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def generate(out_dir: Path = HERE) -> list[Path]:
    """Run protoc on ``graphfl_p2p.proto``; return the generated files (imports made package-relative)."""
    from grpc_tools import protoc  # type: ignore[import-untyped]

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "graphfl_p2p.proto"
        src.write_text((HERE / "graphfl_p2p.proto").read_text())
        rc = protoc.main(
            ["grpc_tools.protoc", f"-I{tmp}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
             f"--grpc_python_out={out_dir}", str(src)]
        )
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    grpc_file = out_dir / "graphfl_p2p_pb2_grpc.py"
    text = grpc_file.read_text()
    text = re.sub(r"^import graphfl_p2p_pb2 as", "from . import graphfl_p2p_pb2 as", text, flags=re.M)
    grpc_file.write_text(text)
    return [out_dir / "graphfl_p2p_pb2.py", out_dir / "graphfl_p2p_pb2.pyi", grpc_file]


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    for f in generate(out):
        print(f)
