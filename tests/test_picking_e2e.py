"""GPU-aware picking through the real path: Envoy → picker → simulated pods with live metrics.

Each test builds the fleet state it needs (a queue, a burst, a shared prefix, a
resident adapter, a stale pod, a saturated pool) with the simulator's own
controls, then checks where the gateway sends the next requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
import time
from collections import Counter
from contextlib import ExitStack

import httpx
import pytest

from tests.procs import gateway, gateway_config, sim_fleet

MODEL = "llama-3.1-8b"
ADAPTERS = ["sql-lora", "chat-lora"]


def pods(n: int, gpu: str = "h100", **extra) -> list[dict]:
    return [
        {"name": f"pod-{i}", "gpu": gpu, "model": MODEL, "engine": "vllm",
         "lora_adapters": ADAPTERS, "max_loras": 1, **extra}
        for i in range(n)
    ]


def chat(text: str, model: str = MODEL, max_tokens: int = 4) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens}


class Stack:
    """A fleet and a gateway in front of it, plus the calls the tests make."""

    def __init__(self, tmp, fleet_pods, scheduler="llm-d", metrics=None, saturation=None,
                 time_scale=1.0):
        self._stack = ExitStack()
        self.fleet = self._stack.enter_context(sim_fleet(tmp, fleet_pods, time_scale=time_scale))
        sched = {"name": "llama", "modelName": MODEL, "endpoints": self.fleet.addresses(),
                 "loraAdapters": ADAPTERS, "scheduler": scheduler,
                 "metrics": metrics or {"interval": "50ms", "staleAfter": "1s"}}
        if saturation:
            sched["saturation"] = saturation
        self.gw = self._stack.enter_context(gateway(tmp, gateway_config([sched])))
        self.ctx = ssl.create_default_context(cafile=str(self.gw.ca))
        self.http = self._stack.enter_context(
            httpx.Client(base_url=self.gw.url, verify=self.ctx, timeout=60)
        )
        self.control = self._stack.enter_context(
            httpx.Client(base_url=f"http://127.0.0.1:{self.fleet.control_port}", timeout=10)
        )

    def close(self) -> None:
        self._stack.close()

    def send(self, body: dict, headers: dict | None = None) -> httpx.Response:
        return self.http.post("/v1/chat/completions", json=body, headers=headers or {})

    def served(self, n: int, make=lambda i: chat(f"q{i}")) -> Counter[str]:
        out: Counter[str] = Counter()
        for i in range(n):
            r = self.send(make(i))
            assert r.status_code == 200, r.text
            out[r.headers["x-sim-pod"]] += 1
        return out

    def faults(self, pod: str, **faults) -> None:
        r = self.control.post(f"/pods/{pod}/faults", json=faults)
        assert r.status_code == 200, r.text

    def clear_faults(self, pod: str) -> None:
        assert self.control.delete(f"/pods/{pod}/faults").status_code == 200

    def state(self, pod: str) -> dict:
        return self.control.get(f"/pods/{pod}/state").json()

    async def burst(self, bodies: list[dict], headers: dict | None = None) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=self.gw.url, verify=self.ctx, timeout=60) as c:
            return await asyncio.gather(
                *(c.post("/v1/chat/completions", json=b, headers=headers or {}) for b in bodies)
            )

    def direct(self, pod: str, body: dict) -> None:
        """Queue work on a pod behind the gateway's back. The connection is held open
        in a background thread (an engine aborts a request whose client went away);
        it ends with the fleet at teardown."""
        url = f"http://{self.fleet.address(pod)}/v1/chat/completions"

        def hold() -> None:
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(url, json=body, timeout=120)

        threading.Thread(target=hold, daemon=True).start()


@pytest.fixture
def stack_factory(tmp_path):
    made: list[Stack] = []

    def make(*args, **kwargs) -> Stack:
        s = Stack(tmp_path, *args, **kwargs)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def wait_for(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def test_pod_with_a_long_queue_gets_no_new_traffic(stack_factory):
    s = stack_factory(pods(3, max_num_seqs=1))
    s.faults("pod-0", slowdown=50)
    for i in range(5):
        s.direct("pod-0", chat(f"background {i}", max_tokens=200))
    wait_for(lambda: s.state("pod-0")["num_requests_waiting"] >= 3, what="queue on pod-0")
    time.sleep(0.2)  # a scrape or two
    served = s.served(12)
    assert served["pod-0"] == 0, served


def test_burst_inside_one_scrape_interval_spreads(stack_factory):
    # Scrapes every 2 s: the whole burst lands between two scrapes, so only the
    # gateway's own dispatch counts can keep it from herding onto one pod.
    s = stack_factory(pods(3), metrics={"interval": "2s", "staleAfter": "10s"})
    s.served(1)
    responses = asyncio.run(s.burst([chat(f"burst {i}", max_tokens=64) for i in range(30)]))
    served = Counter(r.headers["x-sim-pod"] for r in responses if r.status_code == 200)
    assert sum(served.values()) == 30
    assert min(served.get(f"pod-{i}", 0) for i in range(3)) >= 6, served


def test_shared_long_prefix_sticks_to_one_pod(stack_factory):
    s = stack_factory(pods(3))
    system = "You are a careful assistant for the ACME corp. " * 80  # ~3.8k chars, 60 blocks

    def body(i: int) -> dict:
        return {"model": MODEL, "max_tokens": 4, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"question number {i}?"}]}

    served = s.served(10, body)
    assert len(served) == 1, served
    other = s.served(6, lambda i: chat(f"unrelated {i} " * 40))
    assert sum(other.values()) == 6


def test_adapter_request_prefers_the_pod_where_it_is_resident(stack_factory):
    # vLLM's metrics show only adapters of *running* requests; an adapter loaded
    # by an earlier request stays resident (LRU) and only the gateway remembers
    # where it sent it. Every pod is idle, so residency is what decides.
    s = stack_factory(pods(3))
    first = s.send(chat("load the adapter", model="sql-lora"))
    assert first.status_code == 200
    home = first.headers["x-sim-pod"]
    time.sleep(0.2)  # scrapes now show no running adapter anywhere
    served = s.served(6, lambda i: chat(f"sql {i}", model="sql-lora"))
    assert served == Counter({home: 6}), (home, served)
    assert s.state(home)["lora_loads"] == 1


def test_pod_with_failing_metrics_gets_nothing_then_returns(stack_factory):
    s = stack_factory(pods(3), scheduler="least-request",
                      metrics={"interval": "50ms", "staleAfter": "300ms"})
    for mode in ("down", "garbled", "closed"):
        s.faults("pod-1", metrics=mode)
        time.sleep(0.6)
        served = s.served(9)
        assert served["pod-1"] == 0, (mode, served)
        s.clear_faults("pod-1")
        time.sleep(1.5)  # a failing pod is re-scraped with capped backoff (<= 1 s)
        # Sequential requests leave every pod at 0 in flight: ties, broken at random, so
        # enough of them that a recovered pod missing out by chance is ~1e-4, not 3 %.
        served = s.served(24)
        assert served["pod-1"] > 0, (mode, served)


def test_saturated_pool_sheds_sheddable_requests(stack_factory):
    s = stack_factory(
        pods(2, max_num_seqs=1),
        saturation={"queueThreshold": 1, "kvCacheThreshold": 0.99, "queueTimeout": "2s"},
    )
    for pod in ("pod-0", "pod-1"):
        s.faults(pod, slowdown=100)
        for i in range(3):
            s.direct(pod, chat(f"fill {pod} {i}", max_tokens=100))
    wait_for(lambda: all(s.state(p)["num_requests_waiting"] >= 1 for p in ("pod-0", "pod-1")),
             what="both pods queued")
    time.sleep(0.2)
    r = s.send(chat("can wait"), headers={"x-gateway-criticality": "sheddable"})
    assert r.status_code == 429, r.text
    assert r.headers.get("retry-after")
    assert r.json()["error"]["type"]
    # A non-sheddable request waits in the bounded admission queue, then gets 503.
    started = time.monotonic()
    r = s.send(chat("must not be shed"))
    assert r.status_code == 503, r.text
    assert 1.5 < time.monotonic() - started < 10
    for pod in ("pod-0", "pod-1"):
        s.control.post(f"/pods/{pod}/restart")
    time.sleep(0.3)
    assert s.send(chat("after recovery")).status_code == 200
