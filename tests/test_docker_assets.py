"""Fast checks of the Docker and Grafana files, without Docker.

The Grafana dashboard must be valid JSON whose every `igw_*` series is one that
picker/gateway_metrics.py defines (names parsed from that module's source,
its POD_GAUGES table included), and whose engine series are ones the picker
reads. The compose file, the gateway config and prometheus.yml must agree on
service names and ports, and publish only on the host's loopback.
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
        "gateway": "127.0.0.1:${IGW_HTTPS_PORT:-8443}:8443",
        "prometheus": "127.0.0.1:${IGW_PROMETHEUS_PORT:-9090}:9090",
    }

    config = load_config(GATEWAY_CONFIG)
    assert config.listen_address == "0.0.0.0" and config.listen_port == 8443
    gateway = services["gateway"]
    assert "/etc/igw/gateway.yaml" in gateway["command"]
    assert "./deploy/docker/gateway.yaml:/etc/igw/gateway.yaml:ro" in gateway["volumes"]
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
    depends = gateway["depends_on"]
    assert all(depends[p]["condition"] == "service_healthy" for p in pods)

    prometheus = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = {
        job["job_name"]: {t for group in job["static_configs"] for t in group["targets"]}
        for job in prometheus["scrape_configs"]
    }
    assert targets["igw-pods"] == endpoints
    assert targets["igw-gateway"] == {f"gateway:{config.metrics_port}"}
    assert gateway["environment"]["IGW_METRICS_HOST"] == "0.0.0.0"


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
