"""Child processes for benchmarks: free ports, start-and-wait, stop by PID, CPU accounting.

Every process a benchmark starts is started here, in its own session, and stopped here by
its PID (SIGTERM, then SIGKILL after a grace period): nothing is ever killed by name.
CPU time is read from /proc (utime + stime of the process and of its descendants), so a
router made of several processes (the gateway's supervisor, picker and Envoy) can be
reported per process and in total.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class StartError(RuntimeError):
    """A child exited or did not say it was ready in time; carries its output tail."""


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass
class Child:
    """One started process; `log` holds its combined stdout/stderr unless piped."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 25) -> str:
        if self.log is None:
            return ""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> int | None:
        return stop_process(self.proc, timeout)


def start_child(
    name: str,
    argv: Sequence[str],
    log: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Child:
    """Start argv in a new session with stdout+stderr to `log` (appended)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **(env or {})}
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
        )
    return Child(name, proc, log)


def start_piped(
    name: str, argv: Sequence[str], log: Path, *, env: dict[str, str] | None = None
) -> Child:
    """Start argv with stdout piped (to read a ready line) and stderr to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **(env or {})}
    with open(log, "ab") as err:
        proc = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=full_env,
            start_new_session=True,
        )
    return Child(name, proc, log)


def wait_line(child: Child, predicate: Callable[[str], bool], timeout: float) -> str:
    """Read the child's piped stdout until a line matches; StartError if it dies first."""
    stdout = child.proc.stdout
    assert stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=0.2):
                if child.proc.poll() is not None:
                    break
                continue
            raw = stdout.readline()
            if not raw:
                if child.proc.poll() is not None:
                    break
                continue
            line = raw.decode(errors="replace")
            seen.append(line)
            if predicate(line):
                return line.strip()
    finally:
        sel.close()
    child.stop()
    raise StartError(
        f"{child.name} not ready (exit {child.proc.returncode}); stdout:\n{''.join(seen)}"
        f"\nlog tail:\n{child.tail()}"
    )


def wait_log_line(child: Child, predicate: Callable[[str], bool], timeout: float) -> str:
    """Poll the child's log file until a line matches; StartError if it dies first.

    Used for children whose stdout goes to a file (so nothing can block on a full pipe).
    """
    assert child.log is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = child.log.read_text(errors="replace")
        except OSError:
            text = ""
        for line in text.splitlines():
            if predicate(line):
                return line.strip()
        if not child.alive():
            break
        time.sleep(0.05)
    child.stop()
    raise StartError(
        f"{child.name} not ready (exit {child.proc.returncode}); log tail:\n{child.tail()}"
    )


def wait_until(check: Callable[[], bool], child: Child, timeout: float, what: str) -> None:
    """Poll `check` until true; StartError if the child exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not child.alive():
            raise StartError(f"{what} exited with {child.proc.returncode}:\n{child.tail()}")
        if check():
            return
        time.sleep(0.05)
    child.stop()
    raise StartError(f"{what} not ready after {timeout:.0f}s:\n{child.tail()}")


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> int | None:
    """SIGTERM the process (by PID), SIGKILL it and its session if it lingers."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: only its children
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(5)
    if proc.stdout is not None:
        with contextlib.suppress(OSError):
            proc.stdout.close()
    return proc.returncode


# ----- CPU accounting ----------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name is in parentheses and may contain spaces
    return raw[raw.rindex(")") + 2 :].split()


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of one process (all its threads), seconds; None if gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def process_name(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [w.decode(errors="replace") for w in cmdline if w]
    if not words:
        return "?"
    exe = Path(words[0]).name
    if exe.startswith("python") and len(words) > 2 and words[1] == "-m":
        return words[2]
    return exe


def descendants(pid: int) -> list[int]:
    """PIDs of every live descendant of pid (children first, breadth first)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is None:
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry.name))
    out: list[int] = []
    queue = [pid]
    while queue:
        for child in parents.get(queue.pop(0), []):
            out.append(child)
            queue.append(child)
    return out


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine from /proc/stat, as seconds."""
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    values = [int(v) for v in parts]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    total = sum(values[:8])
    return (total - idle) / CLOCK_TICKS, total / CLOCK_TICKS


class CpuMeter:
    """CPU seconds of named processes between `start()` and `stop()`, plus a timeline.

    `sample()` records each process's share of one core since the previous sample; the
    peak over the run shows whether a process was saturated at some moment even when
    its average was low.
    """

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = dict(pids)
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.t0 = self.t_last = 0.0
        self.machine0 = (0.0, 0.0)
        self.machine_last = (0.0, 0.0)
        self.peak: dict[str, float] = {}
        self.machine_peak = 0.0
        self.timeline: list[dict[str, float]] = []

    def _read(self) -> dict[str, float]:
        out = {}
        for name, pid in self.pids.items():
            value = cpu_seconds(pid)
            if value is not None:
                out[name] = value
        return out

    def start(self) -> None:
        self.first = self.last = self._read()
        self.t0 = self.t_last = time.monotonic()
        self.machine0 = self.machine_last = machine_cpu()

    def sample(self) -> None:
        now = time.monotonic()
        dt = now - self.t_last
        if dt <= 0.05:
            return
        current = self._read()
        row: dict[str, float] = {"t": now - self.t0}
        for name, value in current.items():
            share = (value - self.last.get(name, value)) / dt
            row[name] = share
            self.peak[name] = max(self.peak.get(name, 0.0), share)
        busy, total = machine_cpu()
        if total > self.machine_last[1]:
            m_share = (busy - self.machine_last[0]) / (total - self.machine_last[1])
            row["machine"] = m_share
            self.machine_peak = max(self.machine_peak, m_share)
        self.machine_last = (busy, total)
        self.timeline.append(row)
        self.last = {**self.last, **current}
        self.t_last = now

    def stop(self) -> dict[str, object]:
        self.sample()
        elapsed = max(self.t_last - self.t0, 1e-9)
        seconds = {
            name: round(self.last.get(name, 0.0) - self.first.get(name, 0.0), 3)
            for name in self.pids
        }
        busy = self.machine_last[0] - self.machine0[0]
        total = self.machine_last[1] - self.machine0[1]
        return {
            "elapsed_s": round(elapsed, 3),
            "cpu_s": seconds,
            "avg_core_share": {n: round(s / elapsed, 3) for n, s in seconds.items()},
            "peak_core_share": {n: round(v, 3) for n, v in self.peak.items()},
            "machine_busy_share": round(busy / total, 3) if total > 0 else None,
            "machine_peak_share": round(self.machine_peak, 3),
            "cores": os.cpu_count(),
        }
