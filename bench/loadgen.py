"""Open-loop load generator: streamed OpenAI requests at pre-generated arrival times.

- **Open loop.** Arrival times come from the scenario (seeded), not from responses: a
  request is sent at its time whether or not earlier ones finished, so a slow router
  cannot slow the arrivals down. The only bound is a concurrency cap (default 4,096
  open requests): an arrival that finds the cap full is not sent and is counted as an
  error (`dropped`), never delayed. A total time cap ends the run; requests still open
  then are cut: without a first token yet they count as errors (`cut`), their TTFT
  censored at the time they had waited (a lower bound, which flatters the slower router,
  never ours); already streaming they are `unfinished` (TTFT known, E2E unknown), not
  errors.
- **Per request:** TTFT = first chunk carrying content (not the role-only chunk);
  end-to-end latency = last byte; output tokens from the final usage chunk
  (`stream_options.include_usage`), else counted chunks; HTTP status; the pod that
  served it (`x-sim-pod`, when the router passes it through; or another header,
  `pod_header`, e.g. the global tier's `x-gateway-region`).
- **Its own health:** lateness of every send (actual send − scheduled time, wall ms) is
  recorded, so a report can show the generator kept up.
- **Shared:** `send_open_loop` and `settle` (the schedule, the cap, the time cap) also drive
  the reliability tests' client, which reads whole answers and their headers instead.

Times in `Result` are model seconds (wall × time_scale): what a client of the simulated
GPUs would see. Only the first few SSE events of a response and its last ~2 KB are parsed;
the rest of the stream is counted, not decoded, to keep the client cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import ssl
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import orjson

from bench.workload import RequestSpec

DEFAULT_CONCURRENCY_CAP = 4096
# An idle keep-alive connection is closed after this many wall seconds (aiohttp's connector).
KEEPALIVE_S = 30.0
HEADERS = {"content-type": "application/json", "accept": "text/event-stream"}
TAIL_BYTES = 2048


@dataclass
class Result:
    index: int
    model: str
    group: str
    scheduled_s: float  # model seconds after the start
    lateness_ms: float  # wall ms between the scheduled and the actual send
    status: int  # HTTP status; 0 = no response
    error: str  # "" when the request succeeded
    ttft_s: float | None  # model seconds
    e2e_s: float | None  # model seconds
    output_tokens: int
    prompt_tokens: int
    pod: str
    done_at_s: float | None  # model seconds after the start, when the last byte arrived
    tokens_in_window: int = 0  # output tokens received before the arrival window closed

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _content_event(event: bytes) -> bool:
    """Does this SSE event carry generated text (not just the role, usage or [DONE])?"""
    if not event.startswith(b"data:"):
        return False
    payload = event[5:].strip()
    if not payload or payload == b"[DONE]":
        return False
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return False
    for choice in data.get("choices") or ():
        delta = choice.get("delta")
        if isinstance(delta, dict) and delta.get("content"):
            return True
        if choice.get("text"):
            return True
    return False


def _usage_tokens(tail: bytes) -> int | None:
    """completion_tokens of the last usage chunk in the stream's tail, if any."""
    for event in reversed(tail.split(b"\n\n")):
        event = event.strip()
        if b'"usage"' not in event or not event.startswith(b"data:"):
            continue
        try:
            usage = orjson.loads(event[5:].strip()).get("usage")
        except orjson.JSONDecodeError:
            continue
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            return usage["completion_tokens"]
    return None


async def send_open_loop(
    targets: Iterable[float],
    start: Callable[[int, float], Coroutine[Any, Any, None]],
    *,
    deadline: float = math.inf,
    full: Callable[[], bool],
    on_full: Callable[[int, float], None],
) -> dict[int, asyncio.Task[None]]:
    """Open loop: start request i at the i-th target (monotonic, ascending) whatever the
    earlier ones did; targets are read one at a time, so a long run's first request is
    not late. An arrival that finds `full()` is not sent but handed to `on_full`; none is
    sent after `deadline`. Returns the task of every request sent, by arrival index."""
    tasks: dict[int, asyncio.Task[None]] = {}
    for i, target in enumerate(targets):
        if target > deadline:
            break
        delay = target - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if full():
            on_full(i, target)
            continue
        tasks[i] = asyncio.create_task(start(i, target))
    return tasks


async def settle(tasks: Iterable[asyncio.Task[None]], deadline: float) -> None:
    """Let the requests run until `deadline`, then cancel the rest and wait for them."""
    every = list(tasks)
    pending = [t for t in every if not t.done()]
    if pending:
        await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
    for task in every:
        if not task.done():
            task.cancel()
    await asyncio.gather(*every, return_exceptions=True)


def clients_of(requests: int, clients: int) -> list[int]:
    """Which client sends each of `requests` requests: seeded, so the same for every router
    (and for the twin's model of the front, bench/twin.py)."""
    rng = random.Random(0)
    return [rng.randrange(clients) for _ in range(requests)]


class LoadGenerator:
    """Sends `specs` to `url_for(spec)` at their times; `run()` returns one Result each."""

    def __init__(
        self,
        specs: Sequence[RequestSpec],
        url_for: Callable[[RequestSpec], str],
        *,
        time_scale: float = 1.0,
        concurrency_cap: int = DEFAULT_CONCURRENCY_CAP,
        time_cap_s: float = 600.0,
        ssl_context: ssl.SSLContext | None = None,
        on_done: Callable[[Result], None] | None = None,
        request_timeout_s: float | None = None,
        clients: int = 1,
        pod_header: str = "x-sim-pod",
    ) -> None:
        self.specs = list(specs)
        self.pod_header = pod_header
        self.client_of = clients_of(len(self.specs), clients)
        self.url_for = url_for
        self.scale = time_scale
        self.cap = concurrency_cap
        self.time_cap_s = time_cap_s
        self.ssl_context = ssl_context
        self.on_done = on_done
        self.request_timeout_s = request_timeout_s
        self.results: dict[int, Result] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.t0 = 0.0
        self.window_end = float("inf")  # monotonic time the arrival window closes
        self.arrivals_done_at: float | None = None

    def _session(self) -> aiohttp.ClientSession:
        """One client: its own keep-alive connection pool."""
        connector = aiohttp.TCPConnector(
            limit=self.cap, limit_per_host=0, ssl=self.ssl_context or False,
            keepalive_timeout=KEEPALIVE_S, ttl_dns_cache=None,
        )
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s, connect=10)
        return aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    async def run(self) -> list[Result]:
        """Each request is sent by one of `clients` clients (drawn at random, seeded): with
        several, the requests come over independent connection pools, as from many users
        behind an L4 load balancer (which spreads connections: one client's reused
        connections would all land on one backend)."""
        async with contextlib.AsyncExitStack() as stack:
            sessions = [await stack.enter_async_context(self._session())
                        for _ in range(max(self.client_of, default=0) + 1)]
            self.t0 = time.monotonic()
            deadline = self.t0 + self.time_cap_s
            if self.specs:
                self.window_end = self.t0 + self.window_s()
            tasks = await send_open_loop(
                (self.t0 + spec.at / self.scale for spec in self.specs),
                lambda i, target: self._one(sessions[self.client_of[i]], self.specs[i],
                                            target),
                deadline=deadline,
                full=lambda: self.in_flight >= self.cap,
                on_full=lambda i, target: self._finish(self._result(
                    self.specs[i], target, 0, "dropped", None, None, 0, "", None)),
            )
            self.arrivals_done_at = time.monotonic()
            await settle(tasks.values(), deadline)
            now = time.monotonic()
            for i in tasks:
                spec = self.specs[i]
                if spec.index not in self.results:
                    target = self.t0 + spec.at / self.scale
                    waited = (now - target) * self.scale
                    self._finish(self._result(spec, target, 0, "cut", waited, None, 0, "", None))
        return [self.results[i] for i in sorted(self.results)]

    def window_s(self) -> float:
        """Wall seconds of the arrival window: up to the last scheduled arrival."""
        return max((s.at for s in self.specs), default=0.0) / self.scale

    def _result(self, spec: RequestSpec, target: float, status: int, error: str,
                ttft: float | None, e2e: float | None, tokens: int, pod: str,
                done_at: float | None, lateness_ms: float = 0.0,
                tokens_in_window: int = 0) -> Result:
        return Result(
            index=spec.index, model=spec.model, group=spec.group,
            scheduled_s=round(spec.at, 6), lateness_ms=round(lateness_ms, 3),
            status=status, error=error,
            ttft_s=None if ttft is None else round(ttft, 6),
            e2e_s=None if e2e is None else round(e2e, 6),
            output_tokens=tokens, prompt_tokens=spec.prompt_tokens, pod=pod,
            done_at_s=None if done_at is None else round(done_at, 6),
            tokens_in_window=tokens_in_window,
        )

    def _finish(self, result: Result) -> None:
        self.results[result.index] = result
        if self.on_done is not None:
            self.on_done(result)

    async def _one(self, session: aiohttp.ClientSession, spec: RequestSpec, target: float) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        sent = time.monotonic()
        lateness_ms = (sent - target) * 1000.0
        status, error, pod = 0, "", ""
        stream = _Stream(self.window_end)
        try:
            async with session.post(self.url_for(spec), data=spec.body, headers=HEADERS) as resp:
                status = resp.status
                pod = resp.headers.get(self.pod_header, "")
                if status != 200:
                    await resp.read()
                    error = f"http {status}"
                else:
                    await stream.read(resp)
                    if stream.first is None:
                        error = "no content"
        except asyncio.CancelledError:
            # cut by the time cap. Streaming already: TTFT is known and the request is only
            # unfinished (E2E unknown). No first token yet: an error, TTFT censored at the
            # time waited so far (a lower bound).
            now = time.monotonic()
            ttft = ((stream.first or now) - sent) * self.scale
            error = "unfinished" if stream.first is not None else "cut"
            self._finish(self._result(spec, target, status, error, ttft, None, stream.tokens(),
                                      pod, None, lateness_ms, stream.in_window()))
            self.in_flight -= 1
            raise
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            error = type(exc).__name__
        self.in_flight -= 1
        first, end = stream.first, stream.end
        ttft = (first - sent) * self.scale if first is not None else None
        e2e = (end - sent) * self.scale if (end is not None and not error) else None
        done_at = (end - self.t0) * self.scale if (end is not None and not error) else None
        self._finish(self._result(spec, target, status, error, ttft, e2e, stream.tokens(), pod,
                                  done_at, lateness_ms, stream.in_window()))


class _Stream:
    """What one streamed response has delivered so far (read incrementally)."""

    def __init__(self, window_end: float) -> None:
        self.window_end = window_end
        self.first: float | None = None
        self.end: float | None = None
        self.events = 0
        self.events_in_window = 0
        self.tail = b""
        self.usage: int | None = None

    async def read(self, resp: aiohttp.ClientResponse) -> None:
        head = b""
        async for chunk in resp.content.iter_any():
            now = time.monotonic()
            if self.first is None:
                head += chunk
                while self.first is None:
                    cut = head.find(b"\n\n")
                    if cut < 0:
                        break
                    event, head = head[:cut], head[cut + 2 :]
                    self.events += 1
                    if _content_event(event.strip()):
                        self.first = now
                if self.first is not None:
                    self.events += head.count(b"\n\n")
                    self.tail = head[-TAIL_BYTES:]
            else:
                self.events += chunk.count(b"\n\n")
                self.tail = (self.tail + chunk)[-TAIL_BYTES:]
            if now <= self.window_end:
                self.events_in_window = self.events
        self.end = time.monotonic()
        self.usage = _usage_tokens(self.tail)

    def tokens(self) -> int:
        """From the usage chunk; else data events minus role, finish and [DONE] chunks."""
        if self.usage is not None:
            return self.usage
        return max(0, self.events - (3 if self.end is not None else 1))

    def in_window(self) -> int:
        """Output tokens that arrived before the arrival window closed (≈ data events - 1)."""
        if self.end is not None and self.end <= self.window_end:
            return self.tokens()
        return max(0, self.events_in_window - 1)
