"""The committed admin API modules are exactly what grpcio-tools makes of proto/admin.proto."""

from __future__ import annotations

from pathlib import Path

from proto.generate import ROOT, generate


def test_generated_modules_match_the_proto(tmp_path: Path) -> None:
    generate(tmp_path)
    for name in ("admin_pb2.py", "admin_pb2_grpc.py"):
        fresh = (tmp_path / "proto" / name).read_text()
        committed = (ROOT / "proto" / name).read_text()
        assert fresh == committed, f"proto/{name} is stale: run `python -m proto.generate`"
