"""Tenants through the real path: openai/httpx client → HTTPS Envoy → ext_proc picker → pods.

One gateway with API keys serves two pools: the simulator (`llama`) and a pod
that records the headers it receives (`echo`, tests/header_pod.py), so the
tests can check what reached a model server. A second gateway identifies
tenants from a JWT claim. Every refusal is checked as a client sees it:
status, OpenAI error body, headers.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric import ec

from igw.admin_client import status
from tests.docker_env import METRICS_MODULE, defined_series, exposed
from tests.header_pod import header_pod
from tests.jwt_keys import es256_token, jwks
from tests.procs import gateway, gateway_config, mint_key, sim_fleet
from tests.test_reliability_reload import write_config
from tests.test_reliability_support import Figures, picker_metrics

LLAMA = "llama-3.1-8b"
ECHO = "echo-model"
LIMIT_HEADERS = (
    "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens",
)
TENANTS = [
    {"name": "team-a", "weight": 2, "limits": {"requestsPerMinute": 1000,
                                                "tokensPerMinute": 1_000_000}},
    # two requests a minute, whatever they ask for
    {"name": "team-tight", "limits": {"requestsPerMinute": 2}},
    # a small token budget on one model only
    {"name": "team-b", "modelLimits": {ECHO: {"tokensPerMinute": 100}}},
    {"name": "team-one", "limits": {"maxConcurrentRequests": 1}},
    # output tokens counted from responses (no limits), and a token budget they correct
    {"name": "team-usage"},
    {"name": "team-tpm", "modelLimits": {ECHO: {"tokensPerMinute": 100}}},
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    keys_file = tmp / "keys"
    keys = {t["name"]: mint_key(keys_file, t["name"]) for t in TENANTS}
    pods = [{"name": "llama-0", "gpu": "h100", "model": LLAMA, "engine": "vllm"}]
    with sim_fleet(tmp, pods, time_scale=20.0) as fleet, header_pod() as pod:
        config = gateway_config(
            [
                {"name": "llama", "modelName": LLAMA, "endpoints": fleet.addresses(LLAMA)},
                {"name": "echo", "modelName": ECHO, "endpoints": [pod.address]},
            ],
            tenants={"keysFile": str(keys_file), "list": TENANTS},
        )
        with gateway(tmp, config) as gw:
            yield gw, pod, keys, keys_file


@pytest.fixture(scope="module")
def http(stack):
    gw = stack[0]
    ctx = ssl.create_default_context(cafile=str(gw.ca))
    with httpx.Client(base_url=gw.url, verify=ctx, timeout=30) as c:
        yield c


def chat(model: str = ECHO, max_tokens: int = 8, text: str = "hello") -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def post_until(http: httpx.Client, status: int, key: str, timeout: float,
               poll: float = 0.1) -> httpx.Response:
    """Post with `key` until the answer has `status` or `timeout` passed; the last answer."""
    deadline = time.monotonic() + timeout
    while True:
        response = http.post("/v1/chat/completions", json=chat(), headers=bearer(key))
        if response.status_code == status or time.monotonic() > deadline:
            return response
        time.sleep(poll)


def assert_401(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert response.headers["www-authenticate"] == "Bearer"


def test_missing_garbage_and_unknown_keys_are_401(stack, http):
    _, pod, keys, _ = stack
    before = len(pod.seen)
    key = keys["team-a"]
    wrong_secret = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    fig = Figures("tenant_bad_keys")
    slowest = 0.0
    cases = ({}, {"authorization": "Bearer"}, {"authorization": f"Basic {key}"},
             bearer("sk-not-ours"), {"authorization": ("Bearer igw_" + "é" * 20).encode()},
             bearer("x" * 5000), bearer(wrong_secret), bearer("igw_000000000000_" + "a" * 43))
    for headers in cases:
        response = http.post("/v1/chat/completions", json=chat(), headers=headers)
        assert_401(response)
        slowest = max(slowest, response.elapsed.total_seconds())
    fig["cases"] = len(cases)
    fig["slowest_401_s"] = slowest
    fig.emit()
    # a bad key is refused before the body: even a broken body is a 401, not a 400
    assert_401(http.post("/v1/chat/completions", content=b"{not json", headers={
        "content-type": "application/json"}))
    # and so is an unknown path or method: nothing is answered to a stranger
    assert_401(http.get("/v1/nothing-here"))
    assert_401(http.get("/v1/chat/completions"))
    assert len(pod.seen) == before  # nothing reached a model server


def test_openai_client_with_a_key_is_served_and_the_pod_never_sees_credentials(stack):
    gw, pod, keys, _ = stack
    http_client = httpx.Client(verify=ssl.create_default_context(cafile=str(gw.ca)), timeout=30)
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=keys["team-a"],
                           http_client=http_client)
    try:
        reply = client.chat.completions.create(
            model=LLAMA, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.usage.completion_tokens == 4
        raw = client.chat.completions.with_raw_response.create(
            model=ECHO, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_headers={"x-gateway-tenant": "team-tight"})
        assert raw.parse().choices[0].message.content == "ok"
        seen = pod.seen[-1]
        assert "authorization" not in seen and "x-gateway-tenant" not in seen
        assert seen["x-gateway-pool"] == "echo"
        # OpenAI's headers on a served response: team-a has both per-minute limits
        assert raw.headers["x-ratelimit-limit-requests"] == "1000"
        assert raw.headers["x-ratelimit-limit-tokens"] == "1000000"
        assert 0 < int(raw.headers["x-ratelimit-remaining-requests"]) < 1000
        assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
        assert {m.id for m in client.models.list()} == {LLAMA, ECHO}
        wrong = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sk-wrong",
                              http_client=http_client)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()  # the model list is not public either
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model=ECHO, messages=[{"role": "user", "content": "x"}])
    finally:
        http_client.close()


def test_requests_per_minute_limit_is_a_429_with_openais_headers(stack, http):
    keys = stack[2]
    answers = [http.post("/v1/chat/completions", json=chat(), headers=bearer(keys["team-tight"]))
               for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429], answers[-1].text
    assert answers[0].headers["x-ratelimit-remaining-requests"] == "1"
    assert answers[1].headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-limit-tokens" not in answers[0].headers  # no token limit set
    refused = answers[2]
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-limit-requests"] == "2"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"]
    # another tenant is not affected
    assert http.post("/v1/chat/completions", json=chat(),
                     headers=bearer(keys["team-a"])).status_code == 200


def test_per_model_token_limit_counts_prompt_plus_max_tokens(stack, http):
    keys = stack[2]
    # 100 tokens a minute on the echo model: a request reserving 90 passes, the next does not
    first = http.post("/v1/chat/completions", json=chat(max_tokens=88),
                      headers=bearer(keys["team-b"]))
    assert first.status_code == 200, first.text
    assert first.headers["x-ratelimit-limit-tokens"] == "100"
    second = http.post("/v1/chat/completions", json=chat(max_tokens=88),
                       headers=bearer(keys["team-b"]))
    assert second.status_code == 429
    assert second.json()["error"]["code"] == "rate_limit_exceeded"
    assert second.headers["x-ratelimit-limit-tokens"] == "100"
    # the other model has no limit for this tenant
    other = http.post("/v1/chat/completions", json=chat(LLAMA, max_tokens=88),
                      headers=bearer(keys["team-b"]))
    assert other.status_code == 200, other.text


def test_a_concurrency_slot_is_held_until_the_request_ends_or_the_client_leaves(stack, http):
    gw, pod, keys, _ = stack
    headers = bearer(keys["team-one"])
    ctx = ssl.create_default_context(cafile=str(gw.ca))

    def wait_until_at_pod(count: int) -> None:
        deadline = time.monotonic() + 10
        while len(pod.seen) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(pod.seen) >= count

    pod.delay_s = 1.5
    try:
        with ThreadPoolExecutor(1) as pool:
            before = len(pod.seen)
            first = pool.submit(http.post, "/v1/chat/completions", json=chat(), headers=headers)
            wait_until_at_pod(before + 1)
            second = http.post("/v1/chat/completions", json=chat(), headers=headers)
            assert second.status_code == 429, second.text
            assert second.json()["error"]["code"] == "rate_limit_exceeded"
            assert first.result(timeout=30).status_code == 200
        # ended: the slot is free again
        assert http.post("/v1/chat/completions", json=chat(),
                         headers=headers).status_code == 200
        # a client that gives up: Envoy ends the call, the picker frees the slot while
        # the pod is still working on the abandoned request
        pod.delay_s = 5.0
        before = len(pod.seen)
        with httpx.Client(base_url=gw.url, verify=ctx, timeout=0.5) as impatient, \
                pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/chat/completions", json=chat(), headers=headers)
        wait_until_at_pod(before + 1)
        pod.delay_s = 0.0
        gave_up = time.monotonic()
        third = post_until(http, 200, keys["team-one"], 3, poll=0.005)
        assert third.status_code == 200, third.text
        fig = Figures("tenant_concurrency_release")
        fig["slot_free_after_client_left_s"] = time.monotonic() - gave_up
        fig.emit()
    finally:
        pod.delay_s = 0.0


def test_absurd_max_tokens_is_a_400_not_a_reservation(stack, http):
    keys = stack[2]
    for value in (-5, 10**30, "many"):
        response = http.post("/v1/chat/completions", json=chat() | {"max_tokens": value},
                             headers=bearer(keys["team-a"]))
        assert response.status_code == 400, response.text


def test_keys_file_reload_adds_and_removes_a_key(stack, http):
    _, _, _, keys_file = stack
    fig = Figures("tenant_keys_reload")
    key = mint_key(keys_file, "team-a")
    added = time.monotonic()
    key_id = key.split("_")[1]
    response = post_until(http, 200, key, 10)
    assert response.status_code == 200, response.text
    fig["added_key_served_after_s"] = time.monotonic() - added
    subprocess.run([sys.executable, "-m", "igw.cli", "tenants", "remove-key", key_id,
                    "--keys-file", str(keys_file)], check=True, timeout=60, capture_output=True)
    removed = time.monotonic()
    assert_401(post_until(http, 401, key, 10))
    fig["removed_key_refused_after_s"] = time.monotonic() - removed
    fig.emit()


def test_per_tenant_usage_metrics_name_configured_tenants_only(stack, http):
    gw, _, keys, _ = stack
    http.post("/v1/chat/completions", json=chat(), headers=bearer(keys["team-a"]))
    http.post("/v1/chat/completions", json=chat(), headers=bearer("igw_000000000000_" + "b" * 43))
    samples = picker_metrics(gw.ports["metrics"])
    assert samples['igw_tenant_requests_total{tenant="team-a"}'] >= 1
    assert samples['igw_tenant_prompt_tokens_total{tenant="team-a"}'] >= 1
    assert samples['igw_tenant_unauthorized_total{reason="invalid"}'] >= 1
    assert samples["igw_tenant_keys"] >= 3
    # the dashboard tests read series names from gateway_metrics.py's source: a picker
    # with tenants must expose none they cannot see there
    names = {k.partition("{")[0] for k in samples if k.startswith("igw_")}
    assert names <= exposed(defined_series(METRICS_MODULE.read_text())), names
    assert "igw_tenant_limits_shared" in names
    tenants = {name.split('tenant="')[1].split('"')[0] for name in samples
               if name.startswith("igw_tenant") and 'tenant="' in name}
    assert tenants == {t["name"] for t in TENANTS}


def test_jwt_claim_names_the_tenant_and_a_forged_header_does_not(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    jwks_file = tmp_path / "jwks.json"
    jwks_file.write_text(json.dumps(jwks(key)))
    now = int(time.time())
    claims = {"iss": "https://issuer.test", "aud": "igw", "sub": "u", "exp": now + 600}
    with header_pod() as pod:
        config = gateway_config(
            [{"name": "echo", "modelName": ECHO, "endpoints": [pod.address]}],
            auth={"jwt": {"issuer": "https://issuer.test", "audiences": ["igw"],
                          "jwksFile": str(jwks_file)}},
            tenants={"jwtClaim": "team", "list": [
                {"name": "team-a", "limits": {"requestsPerMinute": 1}}]},
        )
        with gateway(tmp_path, config) as gw:
            ctx = ssl.create_default_context(cafile=str(gw.ca))
            with httpx.Client(base_url=gw.url, verify=ctx, timeout=30) as http:
                def post(token: str | None, **headers: str) -> httpx.Response:
                    if token:
                        headers["authorization"] = f"Bearer {token}"
                    return http.post("/v1/chat/completions", json=chat(), headers=headers)

                team_a = es256_token(key, {**claims, "team": "team-a"})
                served = post(team_a)
                assert served.status_code == 200, served.text
                assert served.headers["x-ratelimit-limit-requests"] == "1"
                assert "authorization" not in pod.seen[-1]
                assert post(team_a).status_code == 429  # its limit: one a minute
                # no claim, a forged header on top: the header is stripped, still 401
                no_claim = es256_token(key, claims)
                assert_401(post(no_claim, **{"x-gateway-tenant": "team-a"}))
                assert_401(post(es256_token(key, {**claims, "team": "team-z"})))
                assert post(None).status_code == 401  # Envoy's own JWT refusal


def test_a_tenant_added_by_config_reload_is_served_and_limited(stack, http):
    """Runs last in the module: it changes the shared gateway's config."""
    gw, _, _, keys_file = stack
    key = mint_key(keys_file, "team-new")  # a key whose tenant is not configured yet
    assert_401(post_until(http, 200, key, 2))
    doc = yaml.safe_load(gw.config_path.read_text())
    doc["spec"]["tenants"]["list"].append(
        {"name": "team-new", "limits": {"requestsPerMinute": 1}})
    write_config(gw.config_path, doc)
    started = time.monotonic()
    served = post_until(http, 200, key, 10)
    assert served.status_code == 200, served.text
    assert served.headers["x-ratelimit-limit-requests"] == "1"
    refused = http.post("/v1/chat/completions", json=chat(), headers=bearer(key))
    assert refused.status_code == 429
    fig = Figures("tenant_config_reload")
    fig["new_tenant_served_after_s"] = time.monotonic() - started
    fig.emit()


def output_tokens(gw, tenant: str, at_least: float, timeout: float = 5.0) -> tuple[float, float]:
    """The tenant's (output tokens, of which estimated) once the first reaches
    `at_least` (Envoy's access log flushes every 200 ms), or at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        samples = picker_metrics(gw.ports["metrics"])
        total = samples.get(f'igw_tenant_output_tokens_total{{tenant="{tenant}"}}', 0.0)
        if total >= at_least or time.monotonic() > deadline:
            return total, samples.get(
                f'igw_tenant_output_tokens_estimated_total{{tenant="{tenant}"}}', 0.0)
        time.sleep(0.1)


def streamed(http: httpx.Client, body: dict, key: str) -> list[dict]:
    """The stream's events, parsed, as a client reads them."""
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True},
                     headers=bearer(key)) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: {")]


def test_output_tokens_are_counted_per_tenant_from_the_responses(stack, http):
    gw, _, keys, _ = stack
    key = keys["team-usage"]
    assert output_tokens(gw, "team-usage", 0, timeout=0) == (0.0, 0.0)
    # a non-streamed answer: its usage object
    reply = http.post("/v1/chat/completions", json=chat(LLAMA, max_tokens=5), headers=bearer(key))
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5
    # a stream that asked for usage: its usage event
    events = streamed(http, {**chat(LLAMA, max_tokens=7),
                             "stream_options": {"include_usage": True}}, key)
    assert events[-1]["usage"]["completion_tokens"] == 7
    # a stream without: the gateway counts its token events (an estimate, flagged)
    events = streamed(http, chat(LLAMA, max_tokens=9), key)
    tokens = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert len(tokens) == 9 and "usage" not in events[-1]
    assert output_tokens(gw, "team-usage", 21) == (21.0, 9.0)
    # (requests other tests cut short are counted as never measured, 10 s after their end)
    assert "igw_tenant_usage_unmeasured_total" in picker_metrics(gw.ports["metrics"])


def test_a_token_reservation_is_corrected_with_the_real_output(stack, http):
    keys = stack[2]
    headers = bearer(keys["team-tpm"])
    # 100 tokens a minute on the echo model; the reservation is prompt + max_tokens
    first = http.post("/v1/chat/completions", json=chat(max_tokens=80), headers=headers)
    assert first.status_code == 200, first.text
    left = int(first.headers["x-ratelimit-remaining-tokens"])
    prompt = 100 - 80 - left
    assert prompt > 0
    # the echo pod answers one token: once Envoy's access log reported it, the first
    # request counts prompt + 1, and a second reservation of prompt + 80 fits
    second = None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        second = http.post("/v1/chat/completions", json=chat(max_tokens=80), headers=headers)
        if second.status_code == 200:
            break
        assert second.status_code == 429, second.text
        time.sleep(0.05)
    assert second is not None and second.status_code == 200, second.text
    assert int(second.headers["x-ratelimit-remaining-tokens"]) == 100 - (prompt + 1) - (
        prompt + 80)


def test_igw_status_shows_the_tenants_and_their_usage(stack, http):
    gw, _, keys, _ = stack
    assert http.post("/v1/chat/completions", json=chat(LLAMA, max_tokens=3),
                     headers=bearer(keys["team-a"])).status_code == 200
    doc = status(gw.admin)["tenants"]
    assert doc["enabled"] and doc["limits_redis"] == "off" and doc["measure_usage"]
    by_name = {t["name"]: t for t in doc["tenants"]}
    assert set(by_name) >= {t["name"] for t in TENANTS}  # (+ one a reload test adds)
    assert int(by_name["team-a"]["requests"]) >= 1
    assert by_name["team-a"]["weight"] == 2
    out = subprocess.run([sys.executable, "-m", "igw.cli", "status", "--admin", gw.admin],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    assert "tenants limits=local redis=off" in out and "output_tokens=measured" in out
    (line,) = [x for x in out.splitlines() if x.strip().startswith("team-a ")]
    assert "weight=2 " in line and "requests=" in line
