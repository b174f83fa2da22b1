"""Running Envoy as a child process: start, wait until it serves, stop by PID.

Used by tests and by the `igw` launcher. Readiness is Envoy's own admin
`/ready` (LIVE once listeners are up and initial EDS/SDS files are loaded).
A file access log is flushed every 10 s by default; pass
`extra_args=("--file-flush-interval-msec", "1000")` to see lines sooner.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from igw_envoy.binary import envoy_command

READY_POLL_S = 0.05


class EnvoyStartError(RuntimeError):
    """Envoy exited or did not become ready in time; carries the tail of its log."""


class EnvoyProcess:
    """One Envoy child: `with EnvoyProcess(...) as envoy:` starts and always stops it."""

    def __init__(
        self,
        config_path: str | Path,
        admin_port: int,
        *,
        log_path: str | Path | None = None,
        log_level: str = "warning",
        base_id: int | None = None,
        concurrency: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.config_path = Path(config_path)
        self.admin_port = admin_port
        self.log_path = Path(log_path) if log_path else self.config_path.with_suffix(".log")
        self.cmd = envoy_command(
            self.config_path,
            base_id=base_id,
            log_level=log_level,
            concurrency=concurrency,
            extra_args=extra_args,
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20.0) -> EnvoyProcess:
        """Start Envoy and block until its admin `/ready` says LIVE."""
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"http://127.0.0.1:{self.admin_port}/ready"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise EnvoyStartError(
                    f"envoy exited with {self.proc.returncode}: {self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(READY_POLL_S)
        raise EnvoyStartError(f"envoy not ready after {timeout_s}s: {self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM this Envoy (by PID), SIGKILL if it lingers; safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout_s)

    def __enter__(self) -> EnvoyProcess:
        return self.start() if self.proc is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
