"""Where `igw` keeps its state (generated TLS files, rendered Envoy config, EDS)."""

from __future__ import annotations

import os
from pathlib import Path


def default_state_dir() -> Path:
    """`$IGW_STATE_DIR`, else `~/.local/state/igw`."""
    env = os.environ.get("IGW_STATE_DIR")
    return Path(env) if env else Path.home() / ".local" / "state" / "igw"
