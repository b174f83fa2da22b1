"""Child processes for the benchmarks and the tests: start, wait until ready, stop by PID.

Every process a benchmark or an integration test starts is started here, in its own
session, and stopped here by its PID (SIGTERM, then SIGKILL of its session after a grace
period): nothing is ever killed by name. A child says it is ready by a line, either in
its log file (`start_child`, `wait_log_line`) or on its piped stdout (`start_piped`,
`wait_line`). CPU time comes from psutil (utime + stime of each process; a process's
descendants are found the same way), so a router made of several processes (the
gateway's supervisor, picker and Envoy) can be reported per process and in total.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil


class StartError(RuntimeError):
    """A child exited or did not say it was ready in time; carries its output tail."""


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def free_port_base(count: int) -> int:
    """A base port with count consecutive free ports above it (checked, then released), for
    the simulator's `--port-base` (one pod per port from there)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - count)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


class _LineReader:
    """One thread per piped child reading its stdout into a queue (until `discard`).

    A selector on the pipe plus `readline()` on the buffered stream can miss a line:
    one read may pull two lines into Python's buffer, the selector then waits for the
    pipe, which has nothing more (measured: the gateway's URL line arrived together
    with an Envoy access-log line, and the wait timed out after 60 s).
    """

    def __init__(self, stream: IO[bytes]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._discard = False
        threading.Thread(target=self._run, args=(stream,), daemon=True).start()

    def _run(self, stream: IO[bytes]) -> None:
        with stream:  # this thread owns the pipe: it closes it at end of output
            for raw in stream:
                if not self._discard:
                    self.lines.put(raw.decode(errors="replace"))
        self.lines.put(None)

    def discard(self) -> None:
        """Keep draining the pipe (a full pipe blocks the child) but keep nothing."""
        self._discard = True
        with contextlib.suppress(queue.Empty):
            while True:
                self.lines.get_nowait()


@dataclass
class Child:
    """One started process; `log` holds its output (stderr only when stdout is piped)."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path | None = None
    reader: _LineReader | None = field(default=None, repr=False)

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

    def drain(self) -> None:
        """Keep reading the piped stdout after the ready line, keeping nothing. Envoy's
        access log goes there under `igw serve`: an undrained pipe fills after ~64 KiB and
        then blocks Envoy's log-flush thread, which makes Envoy hang on SIGTERM."""
        if self.reader is not None:
            self.reader.discard()

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
    with open(log, "ab") as out:
        proc = _popen(argv, out, subprocess.STDOUT, env=env, cwd=cwd)
    return Child(name, proc, log)


def start_piped(
    name: str,
    argv: Sequence[str],
    *,
    log: Path | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    stdin_pipe: bool = False,
) -> Child:
    """Start argv in a new session with stdout piped (read it with `wait_line`).

    stderr goes to `log` (appended) when given, else where this process's goes.
    `stdin_pipe` gives the child a stdin that closes when this process exits, for
    children that stop on EOF there.
    """
    stdin = subprocess.PIPE if stdin_pipe else subprocess.DEVNULL
    if log is None:
        proc = _popen(argv, subprocess.PIPE, None, env=env, cwd=cwd, stdin=stdin)
    else:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as err:
            proc = _popen(argv, subprocess.PIPE, err, env=env, cwd=cwd, stdin=stdin)
    assert proc.stdout is not None
    return Child(name, proc, log, _LineReader(proc.stdout))


def _popen(argv: Sequence[str], stdout: int | IO[bytes], stderr: int | IO[bytes] | None, *,
           env: dict[str, str] | None, cwd: Path | None,
           stdin: int = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        list(argv),
        stdout=stdout,
        stderr=stderr,
        stdin=stdin,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        start_new_session=True,
    )


def wait_line(child: Child, predicate: Callable[[str], bool], timeout: float) -> str:
    """Read the child's piped stdout until a line matches; StartError if it ends first."""
    assert child.reader is not None, f"{child.name}: stdout is not piped"
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = child.reader.lines.get(timeout=min(left, 0.2))
        except queue.Empty:
            continue
        if line is None:  # end of output: the process is gone
            break
        seen.append(line)
        if predicate(line):
            return line.strip()
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
    """SIGTERM the process (by PID), SIGKILL it and its session if it lingers.

    Its stdin pipe is closed here; a piped stdout belongs to the child's reader thread.
    """
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
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    return proc.returncode


# ----- CPU accounting ----------------------------------------------------------------------


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of one process (all its threads), seconds; None if gone."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


def process_name(pid: int) -> str:
    """The executable's name, or the module of `python -m MODULE`; "?" if unknown."""
    try:
        words = [w for w in psutil.Process(pid).cmdline() if w]
    except psutil.Error:
        return "?"
    if not words:
        return "?"
    exe = Path(words[0]).name
    if exe.startswith("python") and len(words) > 2 and words[1] == "-m":
        return words[2]
    return exe


def descendants(pid: int) -> list[int]:
    """PIDs of every live descendant of pid."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot; idle and iowait are not
    busy, guest time is left out (Linux counts it in user and nice already)."""
    t = psutil.cpu_times()
    idle = t.idle + t.iowait
    total = t.user + t.nice + t.system + idle + t.irq + t.softirq + t.steal
    return total - idle, total


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
