"""Shared tools of the reliability suites (no tests here): load, process probes, polling.

- `Load`: open-loop load (requests start on a fixed schedule whatever the answers, as
  real clients do; the benchmark's scheduler), bounded in request count, in-flight
  requests and wall time, over TLS to 127.0.0.1 only; one `Outcome` per request.
- psutil probes of the processes `igw serve` runs: children by role, RSS, open
  file descriptors, listening sockets.
- Small HTTP helpers for the simulator's control port and the picker's metrics.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import ssl
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import psutil

from bench.loadgen import send_open_loop, settle

MAX_INFLIGHT = 400


def chat_body(model: str, text: str = "hello", max_tokens: int = 8, **extra: Any) -> bytes:
    return orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            **extra,
        }
    )


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it. `status` 0 means a transport error."""

    index: int
    sent: float
    done: float = 0.0
    status: int = 0
    error: str = ""
    pod: str = ""
    retry_after: str | None = None
    content_type: str = ""
    complete: bool = False  # the whole answer arrived (streams: `data: [DONE]`)
    body: bytes = b""
    first: float = 0.0  # when the first bytes of the answer's body arrived (0: none)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.complete

    @property
    def latency(self) -> float:
        return self.done - self.sent

    @property
    def ttft(self) -> float:
        """Time to the answer's first body bytes: a stream's first token."""
        return self.first - self.sent


@dataclass
class LoadResult:
    outcomes: list[Outcome]
    started: float
    ended: float
    skipped: int = 0  # arrivals dropped because MAX_INFLIGHT were open (client-side bound)

    def statuses(self, outcomes: Iterable[Outcome] | None = None) -> Counter[int]:
        return Counter(o.status for o in (self.outcomes if outcomes is None else outcomes))

    def failed(self, outcomes: Iterable[Outcome] | None = None) -> list[Outcome]:
        return [o for o in (self.outcomes if outcomes is None else outcomes) if not o.ok]

    def after(self, t: float) -> list[Outcome]:
        return [o for o in self.outcomes if o.sent >= t]

    def before(self, t: float) -> list[Outcome]:
        return [o for o in self.outcomes if o.sent < t]

    def summary(self) -> str:
        lat = sorted(o.latency for o in self.outcomes if o.ok)
        p = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000) if lat else (lambda q: 0)
        return (
            f"{len(self.outcomes)} requests in {self.ended - self.started:.1f}s, "
            f"statuses {dict(self.statuses())}, ok p50 {p(0.5):.0f} ms p99 {p(0.99):.0f} ms"
        )


def client_ssl(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


class Load:
    """Open-loop HTTPS load: `rate` requests/s for `duration` s, at most `max_requests`.

    The schedule is the benchmark's (bench/loadgen.py `send_open_loop`); this client reads
    whole answers and the headers the tests check. `body(i)` gives the i-th request body.
    Streams are read to the end and checked for `data: [DONE]`. Every request has a
    `timeout`; the whole run stops by `duration + timeout + 5` s at the latest.
    """

    def __init__(
        self,
        url: str,
        ca: Path,
        *,
        rate: float,
        duration: float,
        body: Callable[[int], bytes],
        path: str = "/v1/chat/completions",
        stream: bool = False,
        headers: dict[str, str] | None = None,
        timeout: float = 20.0,
        max_requests: int = 20_000,
        keep_body: bool = False,
    ) -> None:
        self.url = url.rstrip("/") + path
        self.ssl = client_ssl(ca)
        self.rate = rate
        self.duration = duration
        self.body = body
        self.stream = stream
        self.headers = {"content-type": "application/json", **(headers or {})}
        self.timeout = timeout
        self.max_requests = max_requests
        self.keep_body = keep_body
        self.open = 0  # requests sent and not finished

    def in_thread(self) -> concurrent.futures.Future[LoadResult]:
        """Run in a thread of its own (own event loop), so the test can block meanwhile."""
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="load")
        future = pool.submit(asyncio.run, self.run())
        pool.shutdown(wait=False)
        return future

    async def run(self) -> LoadResult:
        connector = aiohttp.TCPConnector(ssl=self.ssl, limit=MAX_INFLIGHT)
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        outcomes: list[Outcome] = []
        skipped = 0

        def send(i: int, _due: float) -> Coroutine[Any, Any, None]:
            outcome = Outcome(index=i, sent=time.monotonic())
            outcomes.append(outcome)
            self.open += 1
            return self._one(session, outcome, self.body(i))

        def skip(_i: int, _due: float) -> None:
            nonlocal skipped
            skipped += 1

        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            start = time.monotonic()
            n = int(min(self.max_requests, self.rate * self.duration))
            tasks = await send_open_loop(
                (start + i / self.rate for i in range(n)), send,
                full=lambda: self.open >= MAX_INFLIGHT, on_full=skip)
            await settle(tasks.values(), time.monotonic() + self.timeout + 5)
            ended = time.monotonic()
        return LoadResult(outcomes, start, ended, skipped)

    async def _one(self, session: aiohttp.ClientSession, out: Outcome, body: bytes) -> None:
        try:
            async with session.post(self.url, data=body, headers=self.headers) as resp:
                out.status = resp.status
                out.pod = resp.headers.get("x-sim-pod", "")
                out.retry_after = resp.headers.get("retry-after")
                out.content_type = resp.headers.get("content-type", "")
                chunks = []
                async for chunk in resp.content.iter_any():
                    if not chunks:
                        out.first = time.monotonic()
                    chunks.append(chunk)
                data = b"".join(chunks)
                if self.keep_body or resp.status != 200:
                    out.body = data[:4096]
                if resp.status == 200:
                    out.complete = (not self.stream) or data.rstrip().endswith(b"data: [DONE]")
        except (aiohttp.ClientError, TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            out.done = time.monotonic()
            self.open -= 1


# --- processes ------------------------------------------------------------------------------


def children(pid: int) -> dict[str, int]:
    """Direct children of `pid` by role: 'picker', 'envoy', 'simulator' (from argv)."""
    found: dict[str, int] = {}
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(pid).children():
            role = _role(child)
            if role:
                found[role] = child.pid
    return found


def _role(proc: psutil.Process) -> str:
    try:
        argv = proc.cmdline()
    except psutil.Error:
        return ""
    text = " ".join(argv)
    if "-m picker" in text or "picker/__main__" in text:
        return "picker"
    if (argv and argv[0].endswith("envoy")) or "envoy.yaml" in text:
        return "envoy"
    if "simulator" in text:
        return "simulator"
    return ""


def wait_child(pid: int, role: str, timeout: float, not_pid: int | None = None) -> int:
    """The PID of `pid`'s child `role` (a different one than `not_pid`), waiting for it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        child = children(pid).get(role)
        if child is not None and child != not_pid:
            return child
        time.sleep(0.02)
    raise AssertionError(f"no {role} child of {pid} within {timeout}s")


def rss_bytes(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def open_fds(pid: int) -> int:
    return psutil.Process(pid).num_fds()


def kill(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that `pid` holds open."""
    try:
        sockets = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return []
    return [(c.laddr.ip, c.laddr.port) for c in sockets if c.status == psutil.CONN_LISTEN]


# --- services -------------------------------------------------------------------------------


def control(fleet_port: int, method: str, path: str, body: Any = None) -> Any:
    """Call the simulator's control port (faults, crash, restart)."""
    url = f"http://127.0.0.1:{fleet_port}{path}"
    resp = httpx.request(method, url, json=body, timeout=10)
    resp.raise_for_status()
    return resp.json()


def pod_states(admin: str, pool: str) -> dict[str, dict[str, Any]]:
    """The picker's view of a pool's pods (admin API), by address."""
    from igw.admin_client import list_pools

    pools = {p["name"]: p for p in list_pools(admin)}
    return {p["address"]: p for p in pools[pool].get("pods", [])}


def routable(state: dict[str, Any]) -> bool:
    """What the picker's filters need: ready, fresh metrics, not draining."""
    return (
        bool(state.get("ready")) and bool(state.get("metrics_fresh")) and not state.get("draining")
    )


def picker_metrics(port: int) -> dict[str, float]:
    """The picker's /metrics as {'name{labels}': value}."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out


def envoy_stat(admin_port: int, name: str) -> float | None:
    text = httpx.get(
        f"http://127.0.0.1:{admin_port}/stats", params={"filter": f"^{name}$"}, timeout=5
    ).text
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        if key == name:
            with contextlib.suppress(ValueError):
                return float(value)
    return None


def wait_for(check: Callable[[], bool], timeout: float, what: str, poll: float = 0.02) -> float:
    """Poll until `check()` is true; seconds it took. Fails after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        with contextlib.suppress(httpx.HTTPError, OSError):
            if check():
                return time.monotonic() - start
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class Figures:
    """Measured numbers a test prints (pytest -s shows them; RELIABILITY.md quotes them)."""

    name: str
    values: dict[str, Any] = field(default_factory=dict)

    def __setitem__(self, key: str, value: Any) -> None:
        self.values[key] = value

    def emit(self) -> None:
        line = " ".join(
            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in self.values.items()
        )
        print(f"\nFIGURES {self.name}: {line}", flush=True)
        out = os.environ.get("IGW_FIGURES_FILE")
        if out:
            with open(out, "a") as fh:
                record = {"test": self.name, **self.values}
                fh.write(orjson.dumps(record, default=str, option=orjson.OPT_NON_STR_KEYS).decode())
                fh.write("\n")
