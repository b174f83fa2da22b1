"""`docker-compose up` for real: the image built from the Dockerfile, two gateway
replicas behind an L4 front (Envoy tcp_proxy) sharing Redis, in front of one
simulated pod per container, Prometheus scraping them all.

Needs root and Debian's docker.io, docker-compose, debootstrap and prometheus
(`IGW_DOCKER_TESTS=1 make system-deps`); skips with the reason otherwise. No
image registry is needed: tests/docker_env.py builds what one would give. The
client side talks only to the ports the compose file publishes on 127.0.0.1.
About 2½ minutes on 2 cores the first time (debootstrap included), 2 after.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.docker_env import (
    GATEWAYS,
    METRICS_MODULE,
    ComposeStack,
    DockerEnv,
    compose_stack,
    defined_series,
    docker_environment,
    exposed,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.timeout(1800)]

MODEL = "llama-3.1-8b"
PODS = ("pod-h100-0", "pod-h100-1", "pod-a10g-0")
IGW_SERVICES = ("front", *GATEWAYS, *PODS)  # the project image, uid 65532
GATEWAY_TARGETS = {f"{g}:9090" for g in GATEWAYS}
REDIS_UID = "999"  # the official redis image's and igw-local/redis:debian's user
SCRAPE_TIMEOUT_S = 90
SERVED_PER_POD = 'sum by (instance) (vllm:request_success_total{job="igw-pods"})'


@pytest.fixture(scope="module")
def denv() -> Iterator[DockerEnv]:
    with docker_environment() as env:
        yield env
        print(f"\ndocker compose test timings (s): {json.dumps(env.timings)}", file=sys.stderr)


@pytest.fixture(scope="module")
def stack(denv: DockerEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    with compose_stack(denv, tmp_path_factory.mktemp("compose")) as running:
        yield running


@pytest.fixture
def client(stack: ComposeStack) -> Iterator[openai.OpenAI]:
    http = httpx.Client(verify=stack.ssl_context(), timeout=30)
    with http:
        yield openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", http_client=http)


def test_containers_are_healthy_non_root_and_published_on_loopback_only(
    stack: ComposeStack,
) -> None:
    for service in IGW_SERVICES:
        info = stack.inspect(service)
        assert info["State"]["Health"]["Status"] == "healthy", service
        assert info["Config"]["User"] == "65532:65532", service
        uid = stack.docker("exec", info["Id"], "id", "-u").stdout.strip()
        assert uid == "65532", service
    redis = stack.inspect("redis")
    assert redis["State"]["Health"]["Status"] == "healthy"
    assert stack.docker("exec", redis["Id"], "id", "-u").stdout.strip() == REDIS_UID
    tls_init = stack.inspect("tls-init")["State"]
    assert (tls_init["Status"], tls_init["ExitCode"]) == ("exited", 0)
    services = (*IGW_SERVICES, "redis", "prometheus")
    for service in services:
        bindings = stack.inspect(service)["HostConfig"]["PortBindings"] or {}
        for port, binds in bindings.items():
            assert all(b["HostIp"] == "127.0.0.1" for b in binds), (service, port, binds)
    published = {
        service: sorted(stack.inspect(service)["HostConfig"]["PortBindings"] or {})
        for service in services
    }
    assert published == {
        "front": ["8443/tcp"],
        "gateway-1": [],
        "gateway-2": [],
        "pod-h100-0": [],
        "pod-h100-1": [],
        "pod-a10g-0": [],
        "redis": [],
        "prometheus": ["9090/tcp"],
    }


def front_connections(stack: ComposeStack) -> dict[str, int]:
    """Connections the front has opened to each gateway address (Envoy's /clusters,
    read inside the front container: its admin listens on loopback only)."""
    script = (
        "import urllib.request as u; "
        "print(u.urlopen('http://127.0.0.1:9901/clusters', timeout=5).read().decode())"
    )
    out = stack.docker("exec", stack.container("front"), "python", "-c", script).stdout
    counts = {}
    for line in out.splitlines():
        cluster, _, rest = line.partition("::")
        host, _, stat = rest.rpartition("::")
        if cluster == "gateways" and host.endswith("::cx_total"):
            counts[host.removesuffix("::cx_total")] = int(stat)
    return counts


def gateway_address(stack: ComposeStack, service: str) -> str:
    networks = stack.inspect(service)["NetworkSettings"]["Networks"]
    (network,) = networks.values()
    return f"{network['IPAddress']}:8443"


def test_the_front_spreads_connections_over_both_replicas(stack: ComposeStack) -> None:
    """Every request on a new TCP connection: the front's round-robin sends them to
    both replicas, and both replicas' pickers counted requests."""
    before = front_connections(stack)
    question = [{"role": "user", "content": "which one?"}]
    body = {"model": MODEL, "messages": question, "max_tokens": 2}
    for _ in range(8):
        with httpx.Client(verify=stack.ssl_context(), timeout=30) as http:  # one connection
            assert http.post(f"{stack.url}/v1/chat/completions", json=body).status_code == 200
    after = front_connections(stack)
    replicas = {gateway_address(stack, g) for g in GATEWAYS}
    assert set(after) == replicas, (after, replicas)
    opened = {host: after[host] - before.get(host, 0) for host in replicas}
    assert all(n >= 2 for n in opened.values()), opened

    def counted_by_both() -> dict[str, float] | None:
        result = stack.prometheus_query('sum by (instance) (igw_requests_total{job="igw-gateway"})')
        per = {r["metric"]["instance"]: float(r["value"][1]) for r in result}
        return per if set(per) == GATEWAY_TARGETS and all(per.values()) else None

    wait_for("igw_requests_total > 0 on both replicas", counted_by_both, SCRAPE_TIMEOUT_S, 2)


def test_redis_is_up_and_both_replicas_are_coordinated(stack: ComposeStack) -> None:
    redis = stack.container("redis")
    assert stack.docker("exec", redis, "redis-cli", "ping").stdout.strip() == "PONG"
    # No persistence (trials only): nothing is written to disk.
    config = stack.docker("exec", redis, "redis-cli", "config", "get", "save").stdout.split()
    assert config == ["save"]  # the value is the empty string

    def gauge(name: str) -> dict[str, float]:
        result = stack.prometheus_query(f'{name}{{job="igw-gateway"}}')
        return {r["metric"]["instance"]: float(r["value"][1]) for r in result}

    def coordinated() -> tuple[dict[str, float], dict[str, float]] | None:
        connected = gauge("igw_coordination_connected")
        live = gauge("igw_coordination_live_replicas")
        if connected == dict.fromkeys(GATEWAY_TARGETS, 1.0) and live == dict.fromkeys(
            GATEWAY_TARGETS, float(len(GATEWAYS))
        ):
            return connected, live
        return None

    # Each replica: connected to Redis and hearing the other one.
    wait_for("both replicas coordinated (connected, 2 live)", coordinated, SCRAPE_TIMEOUT_S, 2)
    clients = stack.docker("exec", redis, "redis-cli", "info", "clients").stdout
    connected_clients = int(
        next(ln for ln in clients.splitlines() if ln.startswith("connected_clients:")).split(":")[1]
    )
    assert connected_clients >= len(GATEWAYS) + 1  # the replicas and this redis-cli
    # The shared state is under one key prefix (metadata.name of gateway.yaml).
    keys = stack.docker(
        "exec", redis, "redis-cli", "--scan", "--pattern", "igw:default:igw-compose*"
    ).stdout.split()
    assert keys, "no coordination keys in Redis"


def test_one_replicas_requests_are_in_the_others_view(stack: ComposeStack) -> None:
    """A request through one replica is folded by the other: its events received grow."""

    def received() -> dict[str, float]:
        result = stack.prometheus_query('igw_coordination_events_received_total{job="igw-gateway"}')
        return {r["metric"]["instance"]: float(r["value"][1]) for r in result}

    before = wait_for("coordination counters scraped", received, SCRAPE_TIMEOUT_S, 2)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "shared"}], "max_tokens": 2}
    for _ in range(6):  # new connections: the front alternates replicas
        with httpx.Client(verify=stack.ssl_context(), timeout=30) as http:
            assert http.post(f"{stack.url}/v1/chat/completions", json=body).status_code == 200

    def grew() -> dict[str, float] | None:
        now = received()
        ok = set(now) == GATEWAY_TARGETS and all(now[g] > before.get(g, 0) for g in now)
        return now if ok else None

    wait_for("events received by both replicas", grew, SCRAPE_TIMEOUT_S, 2)


def test_chat_completion_with_the_openai_client(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello from a container."}],
        max_tokens=16,
    )
    assert reply.model == MODEL
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens > 0

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Stream a few tokens."}],
            max_tokens=8,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text


def test_chat_completion_with_curl(stack: ComposeStack) -> None:
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    )
    out = subprocess.run(
        [
            "curl", "-sS", "--max-time", "30", "--cacert", str(stack.ca_file),
            "-H", "content-type: application/json", "-d", body,
            "-w", "\n%{http_code}", f"{stack.url}/v1/chat/completions",
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    payload, status = out.stdout.rsplit("\n", 1)
    assert status == "200", out.stdout
    reply = json.loads(payload)
    assert reply["model"] == MODEL
    assert reply["choices"][0]["message"]["content"]


def test_unknown_model_is_an_openai_style_404(stack: ComposeStack) -> None:
    with httpx.Client(verify=stack.ssl_context(), timeout=30) as http:
        reply = http.post(
            f"{stack.url}/v1/chat/completions",
            json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
        )
    assert reply.status_code == 404
    assert "no-such-model" in reply.json()["error"]["message"]


def test_prometheus_scrapes_every_pod_and_the_gateway(
    stack: ComposeStack, client: openai.OpenAI
) -> None:
    def targets_up() -> dict[str, str] | None:
        up = {r["metric"]["instance"]: r["value"][1] for r in stack.prometheus_query("up")}
        wanted = {f"{pod}:8000" for pod in PODS} | GATEWAY_TARGETS
        return up if wanted <= set(up) and all(up[t] == "1" for t in wanted) else None

    wait_for("every target up in Prometheus", targets_up, SCRAPE_TIMEOUT_S, interval=2)

    for _ in range(3):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "count me"}], max_tokens=4
        )

    def pods_scraped() -> bool:
        running = stack.prometheus_query('vllm:num_requests_running{job="igw-pods"}')
        return {r["metric"]["instance"] for r in running} == {f"{p}:8000" for p in PODS}

    wait_for("pod metrics in Prometheus", pods_scraped, SCRAPE_TIMEOUT_S, interval=2)

    def gateway_counted() -> float:
        result = stack.prometheus_query('sum(igw_requests_total{job="igw-gateway"})')
        return float(result[0]["value"][1]) if result else 0.0

    assert wait_for("igw_requests_total >= 3", lambda: gateway_counted() >= 3, SCRAPE_TIMEOUT_S)
    ready = stack.prometheus_query('igw_pod_ready{job="igw-gateway"}')
    assert {(r["metric"]["instance"], r["metric"]["pod"]) for r in ready} == {
        (g, f"{p}:8000") for g in GATEWAY_TARGETS for p in PODS
    }


def test_requests_go_to_the_pod_the_picker_chose(
    stack: ComposeStack, client: openai.OpenAI
) -> None:
    prompt = "The same long prompt every time, so prefix affinity keeps choosing one pod. " * 4
    for _ in range(12):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2
        )
    done = time.time()

    def scraped_since_done() -> bool:
        # Each target is scraped at its own moment: read the counts only once every
        # gateway and pod was scraped after the last request (equal sums alone are
        # not enough: one pod's count ahead and another's behind add up the same).
        result = stack.prometheus_query('min(timestamp(up{job=~"igw-gateway|igw-pods"}))')
        targets = stack.prometheus_query('count(up{job=~"igw-gateway|igw-pods"} == 1)')
        if not result or not targets:
            return False
        up = int(targets[0]["value"][1])
        return float(result[0]["value"][1]) > done and up == len(GATEWAYS) + len(PODS)

    wait_for("every gateway and pod scraped after the requests", scraped_since_done,
             SCRAPE_TIMEOUT_S, 1)  # fmt: skip

    def per_pod(query: str, label: str) -> dict[str, float]:
        return {r["metric"][label]: float(r["value"][1]) for r in stack.prometheus_query(query)}

    # Both replicas pick: their picks per pod summed.
    picks = per_pod('sum by (pod) (igw_pod_picks_total{job="igw-gateway"})', "pod")
    served = per_pod(SERVED_PER_POD, "instance")
    assert sum(picks.values()) >= 12
    assert picks == served


def test_every_gateway_series_is_defined_in_gateway_metrics(stack: ComposeStack) -> None:
    """The dashboard test reads metric names from picker/gateway_metrics.py's source
    ("every name is defined in this file"): what the running gateway exposes must
    be among them, or the dashboard cannot be checked against it."""
    wait_for(
        "the gateway scraped",
        lambda: len(stack.prometheus_query('up{job="igw-gateway"} == 1')) == len(GATEWAYS),
        SCRAPE_TIMEOUT_S,
        interval=2,
    )
    reply = httpx.get(
        f"{stack.prometheus_url}/api/v1/label/__name__/values",
        params={"match[]": '{job="igw-gateway"}'},
        timeout=5,
    )
    scraped = {n for n in reply.json()["data"] if n.startswith("igw_")}
    parsed = exposed(defined_series(METRICS_MODULE.read_text()))
    assert scraped and scraped <= parsed, scraped - parsed


def test_compose_file_is_the_one_under_test(stack: ComposeStack) -> None:
    """Guards the fixture itself: the stack runs this checkout's compose file and image."""
    for service in ("front", *GATEWAYS):
        assert stack.inspect(service)["Config"]["Image"] == stack.image, service
    labels = stack.inspect(GATEWAYS[0])["Config"]["Labels"]
    assert Path(labels["com.docker.compose.project.working_dir"]).resolve() == (
        Path(__file__).resolve().parent.parent
    )


def test_a_redis_outage_delays_no_request_and_both_replicas_reconnect(
    stack: ComposeStack,
) -> None:
    """Redis stopped: requests through both replicas still answer at once, both
    replicas report the link down; Redis back (empty: no persistence): both
    reconnect and hear each other again."""

    def gauge(name: str) -> dict[str, float]:
        result = stack.prometheus_query(f'{name}{{job="igw-gateway"}}')
        return {r["metric"]["instance"]: float(r["value"][1]) for r in result}

    def every_replica(name: str, value: float):
        return lambda: gauge(name) == dict.fromkeys(GATEWAY_TARGETS, value)

    body = {"model": MODEL, "messages": [{"role": "user", "content": "outage"}], "max_tokens": 2}
    stack.compose("stop", "-t", "5", "redis")
    try:
        for _ in range(4):  # new connections: both replicas
            with httpx.Client(verify=stack.ssl_context(), timeout=30) as http:
                start = time.monotonic()
                reply = http.post(f"{stack.url}/v1/chat/completions", json=body)
                assert reply.status_code == 200
                assert time.monotonic() - start < 5, "a request waited for Redis"
        wait_for(
            "both replicas report coordination down",
            every_replica("igw_coordination_connected", 0.0),
            SCRAPE_TIMEOUT_S,
            2,
        )
    finally:
        stack.compose("start", "redis")
    wait_for(
        "redis healthy again",
        lambda: stack.inspect("redis")["State"].get("Health", {}).get("Status") == "healthy",
        60,
    )
    wait_for(
        "both replicas reconnected",
        every_replica("igw_coordination_connected", 1.0),
        SCRAPE_TIMEOUT_S,
        2,
    )
    wait_for(
        "both replicas hear each other again",
        every_replica("igw_coordination_live_replicas", float(len(GATEWAYS))),
        SCRAPE_TIMEOUT_S,
        2,
    )
    reconnects = gauge("igw_coordination_reconnects_total")
    assert set(reconnects) == GATEWAY_TARGETS and all(n >= 1 for n in reconnects.values())
