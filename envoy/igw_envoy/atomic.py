"""Atomic file replacement, the one way every file Envoy watches is written.

Envoy's file-based xDS (`path_config_source` with `watched_directory`) and its
certificate watches react to a file being *moved into* the watched directory,
and must never read a half-written file. So each file is written to a
temporary name in the same directory (same filesystem, so the rename is
atomic) and then renamed over the target.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data` in one rename; readers see the old or the new file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
