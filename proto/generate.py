"""Compile proto/*.proto into importable modules with grpcio-tools.

Run from anywhere: `python -m proto.generate [OUT_DIR]`. The test suite
regenerates into a temporary directory and compares, so the committed
modules can never drift from the .proto source.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted(p.relative_to(ROOT) for p in (ROOT / "proto").glob("*.proto"))


def generate(out_dir: Path = ROOT) -> None:
    """Write `proto/<name>_pb2.py` and `_pb2_grpc.py` under `out_dir`."""
    (out_dir / "proto").mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *map(str, PROTOS),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
