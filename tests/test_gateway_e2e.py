"""The whole data path for real: openai client → HTTPS Envoy → ext_proc picker → simulated pods.

One gateway and one simulated fleet are shared by the module (starting them
costs seconds); each test checks one promise of the data path.
"""

from __future__ import annotations

import ssl
import time
from collections import Counter

import httpx
import openai
import orjson
import pytest

from contract import headers as hdr
from igw.admin_client import list_pools
from igw.ports import free_port
from tests.procs import gateway, gateway_config, sim_fleet
from tests.test_reliability_support import envoy_stat

LLAMA = "llama-3.1-8b"
QWEN = "qwen3-32b"
ADAPTERS = ["sql-lora", "chat-lora"]
BODY_LIMIT = 8 * 1024 * 1024

PODS = [
    {
        "name": "llama-0",
        "gpu": "h100",
        "model": LLAMA,
        "engine": "vllm",
        "max_loras": 1,
        "lora_adapters": ADAPTERS,
    },
    {
        "name": "llama-1",
        "gpu": "h100",
        "model": LLAMA,
        "engine": "vllm",
        "max_loras": 1,
        "lora_adapters": ADAPTERS,
    },
    {
        "name": "llama-2",
        "gpu": "a100",
        "model": LLAMA,
        "engine": "vllm",
        "max_loras": 1,
        "lora_adapters": ADAPTERS,
    },
    {"name": "qwen-0", "gpu": "h100", "model": QWEN, "engine": "sglang"},
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    with sim_fleet(tmp, PODS, time_scale=20.0) as fleet:
        config = gateway_config(
            [
                {
                    "name": "llama",
                    "modelName": LLAMA,
                    "endpoints": fleet.addresses(LLAMA),
                    "loraAdapters": ADAPTERS,
                    "scheduler": "least-request",
                },
                {
                    "name": "qwen",
                    "modelName": QWEN,
                    "endpoints": fleet.addresses(QWEN),
                    "engineType": "sglang",
                },
                {
                    "name": "dead",
                    "modelName": "dead-model",
                    "endpoints": [f"127.0.0.1:{free_port()}"],
                },
            ],
            bbr={"enabled": True, "maxRequestBodyBytes": BODY_LIMIT},
        )
        with gateway(tmp, config) as gw:
            yield fleet, gw


@pytest.fixture(scope="module")
def client(stack):
    _, gw = stack
    http = httpx.Client(verify=ssl.create_default_context(cafile=str(gw.ca)), timeout=30)
    yield openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", http_client=http)
    http.close()


@pytest.fixture(scope="module")
def http(stack):
    _, gw = stack
    ctx = ssl.create_default_context(cafile=str(gw.ca))
    with httpx.Client(base_url=gw.url, verify=ctx, timeout=30) as c:
        yield c


def served_by(fleet, response: httpx.Response) -> str:
    return response.headers["x-sim-pod"]


def chat(model: str, text: str = "hello", **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        **extra,
    }


def test_chat_and_completions_with_openai_client(client):
    reply = client.chat.completions.create(
        model=LLAMA, messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens == 5
    stream = client.chat.completions.create(
        model=LLAMA,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 6
    assert chunks[-1].usage.completion_tokens == 6
    done = client.completions.create(model=QWEN, prompt="once upon a time", max_tokens=4)
    assert done.usage.completion_tokens == 4
    streamed = list(client.completions.create(model=QWEN, prompt="x", max_tokens=3, stream=True))
    assert sum(1 for c in streamed if c.choices and c.choices[0].text) == 3


def _ext_proc_counts(gw) -> tuple[float, float]:
    """(streams, messages) Envoy's ext_proc filter has sent to the picker so far."""
    port = gw.ports["envoyAdmin"]
    prefix = "http.ingress_https.ext_proc."
    return (
        envoy_stat(port, prefix + "streams_started") or 0.0,
        envoy_stat(port, prefix + "stream_msgs_sent") or 0.0,
    )


def test_openai_requests_cost_one_ext_proc_message(stack, client):
    """The common request takes the one-message route: Envoy skips the headers
    message and the picker routes from the body and its attributes alone."""
    _, gw = stack
    streams, messages = _ext_proc_counts(gw)
    for i in range(3):
        client.chat.completions.create(
            model=LLAMA, messages=[{"role": "user", "content": f"one {i}"}], max_tokens=2
        )
    client.completions.create(model=QWEN, prompt="one message", max_tokens=2)
    after_streams, after_messages = _ext_proc_counts(gw)
    assert after_streams - streams == 4
    assert after_messages - messages == 4


def test_empty_and_chunked_bodies_take_the_two_message_path(stack, http):
    fleet, gw = stack
    streams, messages = _ext_proc_counts(gw)
    r = http.post("/v1/chat/completions", content=b"", headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert "body required" in r.json()["error"]["message"]
    body = orjson.dumps(chat(LLAMA))
    r = http.post(  # a generator body: chunked, no content-length
        "/v1/chat/completions", content=iter([body]), headers={"content-type": "application/json"}
    )
    assert r.status_code == 200, r.text
    assert "content-length" not in r.request.headers
    assert served_by(fleet, r).startswith("llama-")
    after_streams, after_messages = _ext_proc_counts(gw)
    assert (after_streams - streams, after_messages - messages) == (2, 3)  # headers; headers+body


def test_models_listed_by_the_gateway(client):
    ids = {m.id for m in client.models.list().data}
    assert {LLAMA, QWEN, "dead-model", *ADAPTERS} <= ids


def test_each_model_routes_to_its_own_pool(stack, http):
    fleet, _ = stack
    for model, prefix in ((LLAMA, "llama-"), (QWEN, "qwen-"), ("sql-lora", "llama-")):
        for _ in range(3):
            r = http.post("/v1/chat/completions", json=chat(model))
            assert r.status_code == 200, r.text
            assert served_by(fleet, r).startswith(prefix)


def test_requests_reach_the_pod_the_picker_chose(stack, http):
    fleet, gw = stack
    before = _picks(gw)
    served: Counter[str] = Counter()
    for i in range(24):
        r = http.post("/v1/chat/completions", json=chat(LLAMA, f"request {i}"))
        assert r.status_code == 200
        served[served_by(fleet, r)] += 1
    after = _picks(gw)
    picked = Counter({fleet.name_of(a): after[a] - before.get(a, 0) for a in after})
    picked = +picked
    assert picked == served
    assert len(served) == 3  # least-request spreads sequential requests over all pods


def _picks(gw) -> dict[str, int]:
    pools = {p["name"]: p for p in list_pools(gw.admin)}
    return {pod["address"]: int(pod.get("picks", 0)) for pod in pools["llama"]["pods"]}


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "JSON"),
        (b"[1, 2]", 400, "object"),
        (orjson.dumps({"messages": []}), 400, "model"),
        (orjson.dumps({"model": 7, "messages": []}), 400, "model"),
        (orjson.dumps(chat("no-such-model")), 404, "no-such-model"),
        (orjson.dumps(chat("dead-model")), 503, "dead"),
    ],
)
def test_failure_table(http, body, status, needle):
    r = http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert needle in err["message"]
    assert {"message", "type", "code"} <= set(err)
    if status == 503:
        assert "retry-after" in r.headers


def test_client_routing_header_is_never_honoured(stack, http):
    fleet, gw = stack
    qwen_pod = fleet.address("qwen-0")
    envoy_admin = f"127.0.0.1:{gw.ports['envoyAdmin']}"
    for target in (qwen_pod, envoy_admin, f"{qwen_pod},{envoy_admin}"):
        for _ in range(3):
            r = http.post(
                "/v1/chat/completions",
                json=chat(LLAMA),
                headers={"x-gateway-destination-endpoint": target, "x-gateway-pool": "qwen"},
            )
            assert r.status_code == 200, r.text
            assert served_by(fleet, r).startswith("llama-")


def test_large_body_within_limit_and_over(http):
    # The bulk sits outside the prompt (a 5 MiB prompt would exceed the model's
    # context and get the engine's own 400): what is tested is the gateway's path.
    big = {"blob": "a" * (5 * 1024 * 1024)}
    r = http.post(
        "/v1/completions", json={"model": QWEN, "prompt": "hi", "max_tokens": 1, "metadata": big}
    )
    assert r.status_code == 200, r.text[:200]
    over = "a" * (BODY_LIMIT + 1024)
    r = http.post("/v1/completions", json={"model": QWEN, "prompt": over, "max_tokens": 1})
    assert r.status_code == 413
    assert "error" in r.json()


def test_http2_and_tls_floor(stack):
    _, gw = stack
    ctx = ssl.create_default_context(cafile=str(gw.ca))
    with httpx.Client(base_url=gw.url, verify=ctx, http2=True, timeout=30) as h2:
        r = h2.post("/v1/chat/completions", json=chat(LLAMA))
        assert r.status_code == 200
        assert r.http_version == "HTTP/2"
    ctx = ssl.create_default_context(cafile=str(gw.ca))
    ctx.maximum_version = ssl.TLSVersion.TLSv1_1
    ctx.minimum_version = ssl.TLSVersion.TLSv1
    with pytest.raises((ssl.SSLError, httpx.ConnectError)), httpx.Client(verify=ctx) as old:
        old.get(f"{gw.url}/healthz")


def test_inflight_accounting_returns_to_zero(stack, http):
    _, gw = stack
    for i in range(5):
        http.post("/v1/chat/completions", json=chat(LLAMA, f"x{i}", stream=True))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pods = {p["name"]: p for p in list_pools(gw.admin)}["llama"]["pods"]
        if all(pod.get("inflight", 0) == 0 for pod in pods):
            return
        time.sleep(0.1)
    pytest.fail(f"in-flight counts did not return to 0: {pods}")


def test_gateway_metrics_exported(stack, http):
    _, gw = stack
    http.post("/v1/chat/completions", json=chat("no-such-model"))
    http.post("/v1/chat/completions", json=chat(LLAMA, "metrics " * 40))
    text = httpx.get(f"http://127.0.0.1:{gw.ports['metrics']}/metrics", timeout=10).text
    for needle in (
        'igw_requests_total{pool="llama"}',
        'igw_request_errors_total{code="404"}',
        "igw_scheduling_duration_seconds_bucket",
        "# HELP igw_requests_shed_total",
        'igw_pod_picks_total{pod="',
        "igw_pod_waiting_requests{",
        "igw_pod_kv_cache_usage_ratio{",
        "igw_pod_inflight_requests{",
        "igw_pod_observed_ttft_seconds{",
        "igw_pod_metrics_age_seconds{",
        'igw_pod_scrapes_total{outcome="ok"',
        'igw_admission_queue_length{pool="llama"}',
        'igw_prefix_index_blocks{pool="llama"}',
        'igw_prefix_shared_tokens{pool="llama"}',
        'igw_prefix_hit_blocks_total{pool="llama"}',
        'igw_prefix_query_blocks_total{pool="llama"}',
    ):
        assert needle in text, needle


def test_load_summary_for_the_global_router(stack, http):
    """GET /igw/v1/load-summary through the TLS listener: every pool, its ready pods and
    the predicted TTFT of a typical request; rebuilt in the background (generation moves)."""
    fleet, _ = stack
    deadline = time.monotonic() + 10
    while True:  # the first scrapes make the pods ready
        first = http.get(hdr.LOAD_SUMMARY_PATH)
        assert first.status_code == 200
        llama = next(p for p in first.json()["pools"] if p["pool"] == "llama")
        if llama["readyPods"] == llama["pods"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert first.headers["content-type"].startswith("application/json")
    doc = first.json()
    assert doc["version"] == 1 and doc["serving"] is True
    pools = {p["pool"]: p for p in doc["pools"]}
    assert set(pools) == {"llama", "qwen", "dead"}
    llama = pools["llama"]
    assert llama["model"] == LLAMA and llama["adapters"] == ADAPTERS
    assert llama["pods"] == llama["readyPods"] == len(fleet.addresses(LLAMA))
    assert 0 < llama["predictedTtftS"] < 10
    assert llama["prefillTokensPerS"] > 0  # the global router scales to a prompt with it
    assert llama["saturated"] is False and 0 <= llama["saturation"] < 1
    for key in ("queueLength", "engineWaiting", "running", "committedRequests",
                "committedPrefillTokens", "typicalPromptTokens"):
        assert llama[key] >= 0, key
    assert pools["dead"]["readyPods"] == 0 and pools["dead"]["predictedTtftS"] is None
    assert pools["dead"]["prefillTokensPerS"] is None
    deadline = time.monotonic() + 10
    while http.get(hdr.LOAD_SUMMARY_PATH).json()["generation"] == doc["generation"]:
        assert time.monotonic() < deadline, "the summary is never rebuilt"
        time.sleep(0.1)
    assert http.post(hdr.LOAD_SUMMARY_PATH, json={}).status_code != 200  # GET only
