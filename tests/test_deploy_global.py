"""The global router's Helm chart (deploy/helm/global-router): valid, and what it mounts
is what its config names.

No cluster and no helm binary here, as in tests/test_deploy.py: the chart is rendered
by Helm's own Go engine through `helm-python-sdk` (skipped without it), the objects are
validated offline against the Kubernetes OpenAPI schemas (strict), and the ConfigMap's
GlobalRouterConfig is parsed by the router's own strict parser.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from contract.global_config import GlobalRouterConfig, parse_global_config
from tests.test_deploy import assert_lint_clean, by_kind, one, render_manifests, validate_k8s

CHART = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "global-router"
TENANTS = {"keysFile": "/placeholder", "list": [{"name": "acme",
                                                 "limits": {"requestsPerMinute": 600}}]}


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    pytest.importorskip("helm_python")
    rendered = render_manifests.render_chart(values, namespace="edge", chart=CHART,
                                             release="global")
    return render_manifests.objects(rendered)


def defaults() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def with_spec(**spec: Any) -> dict[str, Any]:
    """The default config with `spec` fields added (values replace a list, not merge)."""
    config = defaults()["config"]
    config["spec"].update(spec)
    return config


def pod(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objs, "Deployment")["spec"]["template"]["spec"]


def mounts(objs: list[dict[str, Any]]) -> dict[str, str]:
    (container,) = pod(objs)["containers"]
    return {m["name"]: m["mountPath"] for m in container["volumeMounts"]}


def volumes(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in pod(objs)["volumes"]}


def config_of(objs: list[dict[str, Any]]) -> GlobalRouterConfig:
    return parse_global_config(yaml.safe_load(one(objs, "ConfigMap")["data"]["config.yaml"]))


def test_default_render_is_valid_and_runs_igw_global_serve():
    objs = render()
    for obj in objs:
        validate_k8s(obj)
    assert {o["kind"] for o in objs} == {"ConfigMap", "Deployment", "Service",
                                        "PodDisruptionBudget"}
    (container,) = pod(objs)["containers"]
    assert container["command"][:4] == ["igw", "--log-level", "INFO", "global"]
    assert container["command"][4:] == ["serve", "--config", "/etc/igw/config.yaml",
                                        "--state-dir", "/var/lib/igw"]
    assert container["ports"] == [{"name": "https", "containerPort": 8443, "protocol": "TCP"}]
    assert "127.0.0.1:9012" in " ".join(container["livenessProbe"]["exec"]["command"])
    assert pod(objs)["automountServiceAccountToken"] is False
    assert mounts(objs)["config"] == "/etc/igw"
    config = config_of(objs)
    assert [r.name for r in config.regions] == ["us-east-1", "eu-west-1"]
    assert all(r.ca_file is None for r in config.regions)
    assert config.coordination is None and config.tenants is None
    service = one(objs, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "https"
    assert one(objs, "Deployment")["metadata"]["namespace"] == "edge"


def test_helm_lint_is_clean():
    assert_lint_clean(CHART)


def test_region_cas_tls_client_tls_redis_and_tenant_keys_are_mounted_where_the_config_says():
    objs = render({
        "config": with_spec(tenants=TENANTS, ports={"picker": 9100}),
        "regionCAs": {"us-east-1": {"secretName": "us-east-ca"},
                      "eu-west-1": {"configMap": "eu-west-ca", "key": "bundle.pem"}},
        "tls": {"secretName": "global-tls"},
        "regionClientTls": {"secretName": "router-client"},
        "coordination": {"url": "rediss://redis.edge:6380/0", "existingSecret": "redis-auth",
                         "settings": {"keyPrefix": "igw-global-prod"}},
        "tenants": {"keysSecret": "tenant-keys"},
    })
    for obj in objs:
        validate_k8s(obj)
    config = config_of(objs)
    at, vols = mounts(objs), volumes(objs)
    cas = {r.name: r.ca_file for r in config.regions}
    assert cas == {"us-east-1": "/etc/igw-regions/us-east-1/ca.pem",
                   "eu-west-1": "/etc/igw-regions/eu-west-1/ca.pem"}
    # sorted by region name: eu-west-1 is volume 0
    assert at["region-ca-0"] == "/etc/igw-regions/eu-west-1"
    assert vols["region-ca-0"]["configMap"] == {
        "name": "eu-west-ca", "items": [{"key": "bundle.pem", "path": "ca.pem"}]}
    assert at["region-ca-1"] == "/etc/igw-regions/us-east-1"
    assert vols["region-ca-1"]["secret"] == {
        "secretName": "us-east-ca", "items": [{"key": "ca.crt", "path": "ca.pem"}]}
    assert (config.tls.certificate_file, config.tls.key_file) == (
        "/etc/igw-tls/tls.crt", "/etc/igw-tls/tls.key")
    assert at["tls"] == "/etc/igw-tls" and vols["tls"]["secret"]["secretName"] == "global-tls"
    assert config.region_client_tls is not None
    assert (config.region_client_tls.certificate_file, config.region_client_tls.key_file) == (
        "/etc/igw-region-client/tls.crt", "/etc/igw-region-client/tls.key")
    assert at["region-client-tls"] == "/etc/igw-region-client"
    assert vols["region-client-tls"]["secret"]["secretName"] == "router-client"
    assert config.coordination is not None
    assert config.coordination.url == "rediss://redis.edge:6380/0"
    assert config.coordination.key_prefix == "igw-global-prod"
    assert config.coordination.password_file == "/etc/igw-coordination/password"
    assert at["coordination-auth"] == "/etc/igw-coordination"
    assert vols["coordination-auth"]["secret"]["items"] == [{"key": "password",
                                                            "path": "password"}]
    assert config.tenants is not None and config.tenants.keys_file == "/etc/igw-tenants/keys"
    assert at["tenant-keys"] == "/etc/igw-tenants"
    assert [t.name for t in config.tenants.tenants] == ["acme"]
    (container,) = pod(objs)["containers"]
    assert "127.0.0.1:9100" in " ".join(container["livenessProbe"]["exec"]["command"])
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_a_config_change_rolls_the_pods():
    def checksum(objs):
        return one(objs, "Deployment")["spec"]["template"]["metadata"]["annotations"][
            "checksum/config"]

    other = with_spec(defaultPolicy={"policy": "fastest"})
    assert checksum(render()) != checksum(render({"config": other}))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"config": with_spec(tenants=TENANTS)}, "coordination.url: required with"),
        ({"regionCAs": {"mars-1": {"secretName": "x"}}}, "regionCAs.mars-1: no region"),
        ({"regionCAs": {"us-east-1": {}}}, "exactly one of secretName and configMap"),
        ({"regionCAs": {"us-east-1": {"secretName": "a", "configMap": "b"}}}, "exactly one"),
        ({"tenants": {"keysSecret": "k"}}, "config.spec.tenants .* is required"),
        ({"coordination": {"existingSecret": "auth"}}, "needs coordination.url"),
    ],
)
def test_chart_refuses_values_that_would_break_the_router(values, message):
    helm = pytest.importorskip("helm_python")
    with pytest.raises(helm.HelmError, match=message):
        render_manifests.render_chart(values, chart=CHART)


def test_one_replica_with_tenants_needs_no_redis():
    objs = render({"replicaCount": 1, "config": with_spec(tenants=TENANTS)})
    assert config_of(objs).coordination is None
    assert not by_kind(objs, "Secret")
