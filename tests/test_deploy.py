"""The Helm chart, the plain manifests and the examples: in sync, valid, least privilege.

No cluster and no helm binary here. Instead:
- objects are validated offline against the Kubernetes OpenAPI schemas that
  `kubernetes-validate` bundles (strict: unknown fields are errors);
- the chart is rendered by Helm's own Go engine through `helm-python-sdk`
  (when installed): its default render must equal deploy/manifests/, and
  variants (TLS Secret, config resource, other pod namespace, discovery off)
  are rendered and checked too;
- without that package, deploy/manifests/ is still compared with values.yaml
  field by field, so neither can drift silently.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from contract.config import parse_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "inference-gateway"
MANIFESTS = DEPLOY / "manifests"
EXAMPLES = DEPLOY / "examples"
KUBE_VERSIONS = ("1.30.0", "1.33.0")  # oldest EKS version the chart targets, and a newer one
NLB_ANNOTATIONS = {
    "service.beta.kubernetes.io/aws-load-balancer-scheme": "internal",
    "service.beta.kubernetes.io/aws-load-balancer-type": "external",
    "service.beta.kubernetes.io/aws-load-balancer-nlb-target-type": "ip",
}

sys.path.insert(0, str(DEPLOY))
import render_manifests  # noqa: E402


def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def manifests() -> list[dict[str, Any]]:
    return [o for p in sorted(MANIFESTS.glob("*.yaml")) for o in load_all(p)]


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (obj,) = by_kind(objs, kind)
    return obj


def values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def chart() -> dict[str, Any]:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())


def container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def env_of(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(objs)["env"]}


def validate_k8s(obj: dict[str, Any]) -> None:
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            name = f"{obj['kind']}/{obj['metadata'].get('name')}"
            raise AssertionError(f"{name} invalid for Kubernetes {version}: {exc}") from None


def render(values: dict[str, Any] | None = None, namespace: str = "models") -> list:
    pytest.importorskip("helm_python")
    return render_manifests.objects(render_manifests.render_chart(values, namespace=namespace))


# -- plain manifests: valid, and the same as the chart's values -------------------------


def test_manifests_and_examples_are_valid_kubernetes_objects():
    objs = manifests() + [o for p in sorted(EXAMPLES.glob("*.yaml")) for o in load_all(p)]
    kinds = set()
    for obj in objs:
        if obj["kind"] == "InferenceGatewayConfig":
            continue  # a custom resource: checked against the CRD in test_deploy_crd.py
        if obj["kind"] == "ScaledObject":
            continue  # KEDA's custom resource: checked structurally below
        validate_k8s(obj)
        kinds.add(obj["kind"])
    assert kinds >= {
        "Namespace",
        "CustomResourceDefinition",
        "ConfigMap",
        "Deployment",
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    }


def test_manifests_match_values():
    objs, vals = manifests(), values()
    deployment = one(objs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    c = container(objs)
    tag = vals["image"]["tag"] or chart()["appVersion"]
    assert c["image"] == f"{vals['image']['repository']}:{tag}"
    assert c["imagePullPolicy"] == vals["image"]["pullPolicy"]
    assert deployment["spec"]["replicas"] == vals["replicaCount"]
    assert c["resources"] == vals["resources"]
    assert c["securityContext"] == vals["securityContext"]
    assert pod["securityContext"] == vals["podSecurityContext"]
    assert pod["terminationGracePeriodSeconds"] == vals["terminationGracePeriodSeconds"]
    assert c["lifecycle"]["preStop"]["sleep"]["seconds"] == vals["preStopSleepSeconds"]
    for probe in ("startup", "readiness", "liveness"):
        for key, value in vals["probes"][probe].items():
            assert c[f"{probe}Probe"][key] == value, (probe, key)
    assert c["command"][:5] == ["igw", "--log-level", vals["logLevel"], "serve", "--config"]
    assert c["command"][5] == "/etc/igw/config.yaml"
    assert c["ports"] == [
        {
            "name": "https",
            "containerPort": vals["config"]["spec"]["listener"]["port"],
            "protocol": "TCP",
        }
    ]
    service = one(objs, "Service")
    assert service["metadata"]["annotations"] == vals["service"]["annotations"]
    assert service["spec"]["type"] == vals["service"]["type"]
    assert service["spec"]["ports"][0]["port"] == vals["service"]["port"]
    pdb = one(objs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == vals["podDisruptionBudget"]["maxUnavailable"]
    config = yaml.safe_load(one(objs, "ConfigMap")["data"]["config.yaml"])
    assert config == vals["config"]
    assert env_of(objs)["IGW_DISCOVERY"] == (
        "kubernetes" if vals["discovery"]["enabled"] else "off"
    )
    assert env_of(objs)["IGW_DISCOVERY_RESYNC"] == str(vals["discovery"]["resyncSeconds"])
    crd = one(objs, "CustomResourceDefinition")
    assert crd == yaml.safe_load((CHART / "crds" / "inferencegatewayconfigs.yaml").read_text())


def test_manifests_are_the_chart_rendered_with_defaults():
    pytest.importorskip("helm_python")
    wanted = render_manifests.manifest_files()
    present = {p.name: p.read_text() for p in MANIFESTS.glob("*.yaml")}
    assert present == wanted, "deploy/manifests/ is stale: run python deploy/render_manifests.py"


def assert_lint_clean(chart: Path) -> None:
    """`helm lint --strict` through Helm's engine: no error, no warning."""
    helm = pytest.importorskip("helm_python")
    report = helm.lint(chart, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_helm_lint_is_clean():
    assert_lint_clean(CHART)


# -- what the objects say -----------------------------------------------------------------


def test_gateway_config_is_valid_for_the_picker():
    config = parse_config(yaml.safe_load(one(manifests(), "ConfigMap")["data"]["config.yaml"]))
    assert [s.match_labels for s in config.schedulers] == [{"app": "vllm-llama"}]


def test_service_is_an_internal_nlb_to_pod_ips():
    service = one(manifests(), "Service")
    assert service["spec"]["type"] == "LoadBalancer"
    assert NLB_ANNOTATIONS.items() <= service["metadata"]["annotations"].items()
    assert service["spec"]["ports"][0]["targetPort"] == "https"
    deployment = one(manifests(), "Deployment")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_pod_runs_non_root_with_probes_and_spread():
    objs = manifests()
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    c = container(objs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert c["readinessProbe"]["httpGet"] == {
        "path": "/healthz",
        "port": "https",
        "scheme": "HTTPS",
    }
    assert c["livenessProbe"]["exec"]["command"][:2] == ["python", "-c"]
    preferred = pod["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert preferred[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert "subPath" not in mounts["/etc/igw"]  # ConfigMap updates must reach the file


def test_rbac_is_namespaced_read_only():
    objs = manifests()
    assert not by_kind(objs, "ClusterRole") and not by_kind(objs, "ClusterRoleBinding")
    role = one(objs, "Role")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    binding = one(objs, "RoleBinding")
    sa = one(objs, "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "inference-gateway"}
    ]
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]


def test_vllm_example_matches_the_gateway_config():
    (deployment,) = load_all(EXAMPLES / "vllm-llama.yaml")
    pod = deployment["spec"]["template"]
    (c,) = pod["spec"]["containers"]  # no sidecar
    assert pod["metadata"]["labels"]["app"] == "vllm-llama"
    assert c["ports"][0]["containerPort"] == 8000
    assert (
        c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"]
    )
    (config,) = load_all(EXAMPLES / "gateway-config.yaml")
    sched = parse_config(config).schedulers[0]
    assert sched.match_labels.items() <= pod["metadata"]["labels"].items()
    assert sched.target_port == 8000
    assert f"--served-model-name={sched.model_name}" in c["args"]


def test_liveness_command_checks_the_pickers_grpc_health():
    """Run the probe's own command against a gRPC health server: SERVING → 0, else non-zero."""
    command = container(manifests())["livenessProbe"]["exec"]["command"]
    assert command[0] == "python"
    from igw.ports import free_port

    port = free_port()
    script = command[2].replace("127.0.0.1:9002", f"127.0.0.1:{port}")
    assert script != command[2]

    async def scenario() -> list[int]:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        codes = []
        try:
            for status in (
                health_pb2.HealthCheckResponse.SERVING,
                health_pb2.HealthCheckResponse.NOT_SERVING,
            ):
                await servicer.set("", status)
                codes.append(await probe())
        finally:
            await server.stop(None)
        codes.append(await probe())  # nothing listening
        return codes

    async def probe() -> int:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, stderr=subprocess.DEVNULL
        )
        return await asyncio.wait_for(proc.wait(), 20)

    serving, not_serving, down = asyncio.run(scenario())
    assert serving == 0 and not_serving != 0 and down != 0


# -- chart variants (rendered by Helm's engine) ------------------------------------------


def test_chart_default_render_is_valid():
    objs = render()
    for obj in objs:
        validate_k8s(obj)
    assert one(objs, "Deployment")["metadata"]["namespace"] == "models"


def test_chart_mounts_the_client_ca_for_mutual_tls():
    objs = render({"tls": {"secretName": "gw-tls", "clientCaSecret": "router-ca",
                           "requireClientCertificate": True}})
    for obj in objs:
        validate_k8s(obj)
    c = container(objs)
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "client-ca", "mountPath": "/etc/igw-client-ca",
            "readOnly": True} in c["volumeMounts"]
    assert {"name": "client-ca", "secret": {"secretName": "router-ca", "items": [
        {"key": "ca.crt", "path": "ca.pem"}]}} in pod["volumes"]
    config = parse_config(yaml.safe_load(one(objs, "ConfigMap")["data"]["config.yaml"]))
    assert config.tls.client_ca_file == "/etc/igw-client-ca/ca.pem"
    assert config.tls.require_client_certificate
    assert config.tls.certificate_file == "/etc/igw-tls/tls.crt"


def test_chart_refuses_required_client_certificates_without_their_ca():
    helm = pytest.importorskip("helm_python")
    with pytest.raises(helm.HelmError, match=r"tls\.requireClientCertificate: needs"):
        render_manifests.render_chart({"tls": {"requireClientCertificate": True}})


def test_chart_with_tls_secret_and_config_resource():
    objs = render({"tls": {"secretName": "gw-tls"}, "configResource": {"enabled": True}})
    for obj in objs:
        validate_k8s(obj)
    c = container(objs)
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "tls", "mountPath": "/etc/igw-tls", "readOnly": True} in c["volumeMounts"]
    assert {"name": "tls", "secret": {"secretName": "gw-tls"}} in pod["volumes"]
    config = parse_config(yaml.safe_load(one(objs, "ConfigMap")["data"]["config.yaml"]))
    assert config.tls.certificate_file == "/etc/igw-tls/tls.crt"
    assert config.tls.key_file == "/etc/igw-tls/tls.key"
    env = env_of(objs)
    assert env["IGW_CONFIG_RESOURCE"] == "models/my-gateway"
    assert env["IGW_CONFIG_STATUS"] == "true"
    rules = one(objs, "Role")["rules"]
    assert {
        "apiGroups": ["inference-gateway.io"],
        "resources": ["inferencegatewayconfigs"],
        "verbs": ["get", "list", "watch"],
    } in rules
    assert {
        "apiGroups": ["inference-gateway.io"],
        "resources": ["inferencegatewayconfigs/status"],
        "resourceNames": ["my-gateway"],
        "verbs": ["patch"],
    } in rules


def test_chart_with_pods_in_another_namespace():
    objs = render({"discovery": {"podNamespace": "vllm"}})
    for obj in objs:
        validate_k8s(obj)
    assert not by_kind(objs, "ClusterRole")
    (role,) = by_kind(objs, "Role")
    assert role["metadata"]["namespace"] == "vllm"
    assert role["rules"][0]["resources"] == ["pods"]
    (binding,) = by_kind(objs, "RoleBinding")
    assert binding["metadata"]["namespace"] == "vllm"
    assert binding["subjects"][0]["namespace"] == "models"
    assert env_of(objs)["IGW_POD_NAMESPACE"] == "vllm"


def test_chart_without_discovery_grants_nothing():
    static = {
        "apiVersion": "inference-gateway.io/v1alpha1",
        "kind": "InferenceGatewayConfig",
        "metadata": {"name": "static"},
        "spec": {
            "schedulers": [{"name": "a", "modelName": "m", "endpoints": ["10.1.2.3:8000"]}],
            "listener": {"port": 9443},
            "ports": {"picker": 9102},
        },
    }
    objs = render({"discovery": {"enabled": False}, "config": static})
    assert not by_kind(objs, "Role") and not by_kind(objs, "RoleBinding")
    assert env_of(objs)["IGW_DISCOVERY"] == "off"
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    c = container(objs)
    assert c["ports"][0]["containerPort"] == 9443
    assert "127.0.0.1:9102" in c["livenessProbe"]["exec"]["command"][2]


# -- coordination: shared routing state on Redis -----------------------------------------

RELEASE = "inference-gateway"
ELASTICACHE_URL = "rediss://master.igw.abc123.use1.cache.amazonaws.com:6379/0"


def gateway_config(objs: list[dict[str, Any]]):
    return parse_config(yaml.safe_load(one(objs, "ConfigMap")["data"]["config.yaml"]))


def notes(values: dict[str, Any]) -> str:
    pytest.importorskip("helm_python")
    rendered = render_manifests.render_chart(values, namespace="models")
    return rendered["inference-gateway/templates/NOTES.txt"]


def gateway_deployment(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [d for d in by_kind(objs, "Deployment") if d["metadata"]["name"] == RELEASE]
    return deployment


def test_chart_default_has_no_coordination_and_says_what_replicas_lose():
    objs = render()
    assert gateway_config(objs).coordination is None
    assert (
        "coordination" not in yaml.safe_load(one(objs, "ConfigMap")["data"]["config.yaml"])["spec"]
    )
    text = notes({})
    assert values()["replicaCount"] > 1
    assert "2 replicas WITHOUT coordination" in text
    for lost in ("in flight", "prefix-cache", "LoRA adapters", "coordination.url"):
        assert lost in text, lost
    assert "WITHOUT coordination" not in notes({"replicaCount": 1})


def test_chart_with_external_redis_url_and_auth_secret():
    """ElastiCache (or any Redis/Valkey) with TLS and an AUTH token from a Secret:
    the token is mounted as a file and named by passwordFile, never inlined."""
    objs = render(
        {
            "coordination": {
                "url": ELASTICACHE_URL,
                "existingSecret": "igw-redis-auth",
                "existingSecretKey": "auth-token",
                "settings": {"timeout": "500ms", "keyPrefix": "igw:prod"},
            }
        }
    )
    for obj in objs:
        validate_k8s(obj)
    coordination = gateway_config(objs).coordination
    assert coordination is not None
    assert coordination.url == ELASTICACHE_URL
    assert coordination.password_file == "/etc/igw-coordination/password"
    assert coordination.timeout_s == 0.5 and coordination.key_prefix == "igw:prod"
    c = container(objs)
    pod = gateway_deployment(objs)["spec"]["template"]["spec"]
    assert {
        "name": "coordination-auth",
        "mountPath": "/etc/igw-coordination",
        "readOnly": True,
    } in c["volumeMounts"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "coordination-auth"]
    assert volume["secret"]["secretName"] == "igw-redis-auth"
    assert volume["secret"]["items"] == [{"key": "auth-token", "path": "password"}]
    assert "igw-redis-auth" not in one(objs, "ConfigMap")["data"]["config.yaml"]
    assert len(by_kind(objs, "Deployment")) == 1  # no bundled Redis
    assert not by_kind(objs, "NetworkPolicy")
    text = notes({"coordination": {"url": ELASTICACHE_URL}})
    assert "share routing state" in text and ELASTICACHE_URL in text
    assert "WITHOUT coordination" not in text


def test_chart_with_an_acl_user_and_a_private_ca():
    objs = render({"coordination": {"url": ELASTICACHE_URL, "existingSecret": "igw-redis-auth",
                                    "username": "gateway", "caConfigMap": "redis-ca"}})
    for obj in objs:
        validate_k8s(obj)
    coordination = gateway_config(objs).coordination
    assert coordination is not None and coordination.username == "gateway"
    assert coordination.ca_file == "/etc/igw-coordination-ca/ca.pem"
    assert {"name": "coordination-ca", "mountPath": "/etc/igw-coordination-ca",
            "readOnly": True} in container(objs)["volumeMounts"]
    pod = gateway_deployment(objs)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "coordination-ca"]
    assert volume["configMap"] == {"name": "redis-ca",
                                   "items": [{"key": "ca.crt", "path": "ca.pem"}]}
    with pytest.raises(Exception, match="needs a rediss://"):
        render({"coordination": {"url": "redis://valkey:6379/0", "caConfigMap": "redis-ca"}})


def test_chart_external_url_without_secret_mounts_nothing():
    objs = render({"coordination": {"url": "redis://valkey.cache.svc:6379/2"}})
    coordination = gateway_config(objs).coordination
    assert coordination is not None and coordination.password_file is None
    assert coordination.url == "redis://valkey.cache.svc:6379/2"
    # Releases in two namespaces sharing one Redis do not share keys.
    assert gateway_config(objs).coordination_prefix == "igw:models:my-gateway"
    other = gateway_config(
        render({"coordination": {"url": "redis://valkey.cache.svc:6379/2"}}, namespace="team-b")
    )
    assert other.coordination_prefix == "igw:team-b:my-gateway"
    mounts = {m["name"] for m in container(objs)["volumeMounts"]}
    assert "coordination-auth" not in mounts


def test_chart_coordination_settings_merge_with_the_configs_own():
    config = values()["config"]
    config = {**config, "spec": {**config["spec"], "coordination": {
        "url": "redis://ignored:6379/0", "replicaTimeout": "10s", "timeout": "1s"}}}  # fmt: skip
    objs = render(
        {
            "config": config,
            "coordination": {
                "url": "redis://redis.cache.svc:6379/0",
                "settings": {"timeout": "300ms"},
            },
        }
    )
    coordination = gateway_config(objs).coordination
    assert coordination.url == "redis://redis.cache.svc:6379/0"  # the chart's value wins
    assert coordination.timeout_s == 0.3  # settings over config.spec.coordination
    assert coordination.replica_timeout_s == 10.0  # kept from config.spec.coordination


def test_chart_with_bundled_redis_for_trials():
    objs = render({"coordination": {"bundled": {"enabled": True}}})
    for obj in objs:
        validate_k8s(obj)
    (redis,) = [d for d in by_kind(objs, "Deployment") if d["metadata"]["name"] != RELEASE]
    services = {s["metadata"]["name"]: s for s in by_kind(objs, "Service")}
    redis_service = services[redis["metadata"]["name"]]
    port = redis_service["spec"]["ports"][0]["port"]
    coordination = gateway_config(objs).coordination
    assert coordination is not None and coordination.password_file is None
    assert coordination.url == f"redis://{redis['metadata']['name']}.models.svc:{port}/0"
    assert redis["metadata"]["namespace"] == "models"
    # One replica, no persistence (trials): a restart starts empty.
    assert redis["spec"]["replicas"] == 1
    assert redis["spec"]["strategy"]["type"] == "Recreate"
    pod = redis["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert c["command"][0] == "redis-server"
    assert c["command"][c["command"].index("--save") + 1] == ""
    assert c["command"][c["command"].index("--appendonly") + 1] == "no"
    assert "persistentVolumeClaim" not in str(pod["spec"]["volumes"])
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["spec"]["automountServiceAccountToken"] is False
    # Neither the gateway's Service, PDB nor anti-affinity may select the Redis pod.
    gateway_selector = services[RELEASE]["spec"]["selector"]
    assert not gateway_selector.items() <= pod["metadata"]["labels"].items()
    assert redis_service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    pdb = one(objs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]
    assert not pdb.items() <= pod["metadata"]["labels"].items()
    # Only the gateway pods may connect.
    policy = one(objs, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"] == redis["spec"]["selector"]["matchLabels"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": gateway_selector}}]
    text = notes({"coordination": {"bundled": {"enabled": True}}})
    assert "for trials" in text and "no" in text and "persistence" in text
    assert not by_kind(
        render({"coordination": {"bundled": {"enabled": True, "networkPolicy": False}}}),
        "NetworkPolicy",
    )


def test_chart_bundled_redis_with_a_password_secret():
    objs = render({"coordination": {"bundled": {"enabled": True}, "existingSecret": "trial-auth"}})
    for obj in objs:
        validate_k8s(obj)
    (redis,) = [d for d in by_kind(objs, "Deployment") if d["metadata"]["name"] != RELEASE]
    (c,) = redis["spec"]["template"]["spec"]["containers"]
    assert c["command"][:2] == ["sh", "-c"]
    assert '--requirepass "$REDIS_PASSWORD"' in c["command"][2]
    assert c["env"] == [
        {
            "name": "REDIS_PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": "trial-auth", "key": "password"}},
        }
    ]
    assert gateway_config(objs).coordination.password_file == "/etc/igw-coordination/password"


@pytest.mark.parametrize(
    ("coordination", "message"),
    [
        ({"url": "http://redis:6379/0"}, "coordination.url: must be redis://"),
        ({"url": "redis://r:6379/0", "bundled": {"enabled": True}}, "not both"),
        ({"existingSecret": "auth"}, "needs coordination.url"),
    ],
)
def test_chart_refuses_bad_coordination_values(coordination, message):
    helm = pytest.importorskip("helm_python")
    with pytest.raises(helm.HelmError, match=message):
        render_manifests.render_chart({"coordination": coordination})


def test_chart_mounts_the_tenant_keys_secret_and_names_it_in_the_config():
    config = values()["config"]
    tenants = {"list": [{"name": "team-a", "limits": {"requestsPerMinute": 600}}]}
    config = {**config, "spec": {**config["spec"], "tenants": tenants}}
    objs = render({"config": config, "tenants": {"keysSecret": "igw-tenant-keys"}})
    for obj in objs:
        validate_k8s(obj)
    parsed = gateway_config(objs).tenants
    assert parsed is not None and parsed.keys_file == "/etc/igw-tenant-keys/keys"
    assert {"name": "tenant-keys", "mountPath": "/etc/igw-tenant-keys",
            "readOnly": True} in container(objs)["volumeMounts"]
    pod = gateway_deployment(objs)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tenant-keys"]
    assert volume["secret"]["secretName"] == "igw-tenant-keys"
    assert volume["secret"]["items"] == [{"key": "keys", "path": "keys"}]
    assert gateway_config(render()).tenants is None
    assert "tenant-keys" not in {m["name"] for m in container(render())["volumeMounts"]}
    with pytest.raises(Exception, match=r"needs config\.spec\.tenants\.list"):
        render({"tenants": {"keysSecret": "igw-tenant-keys"}})


# -- the KEDA example: a custom resource, checked structurally ---------------------------

KEDA_TRIGGER_METADATA = {"serverAddress", "query", "threshold", "activationThreshold"}
KEDA_METRIC_TYPES = {"Utilization", "AverageValue", "Value"}


def test_keda_example_scales_the_model_deployment_on_defined_gateway_series():
    """No KEDA here (its CRD is not installed): the ScaledObject's fields are checked
    against KEDA's documented spec (keda.sh/docs, ScaledObject specification and the
    Prometheus scaler), its HPA behaviour against Kubernetes' own HPA schema, and its
    queries against the series picker/gateway_metrics.py defines."""
    from tests.docker_env import METRICS_MODULE, defined_series, exposed

    (scaled,) = load_all(EXAMPLES / "keda-scaledobject.yaml")
    (deployment,) = load_all(EXAMPLES / "vllm-llama.yaml")
    (config,) = load_all(EXAMPLES / "gateway-config.yaml")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1" and scaled["kind"] == "ScaledObject"
    spec = scaled["spec"]
    assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount",
                         "pollingInterval", "cooldownPeriod", "advanced", "triggers"}
    assert spec["scaleTargetRef"] == {"name": deployment["metadata"]["name"]}
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": scaled["metadata"]["name"]},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                               "name": spec["scaleTargetRef"]["name"]},
            "minReplicas": spec["minReplicaCount"],
            "maxReplicas": spec["maxReplicaCount"],
            "behavior": spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
        },
    }
    validate_k8s(hpa)
    pool = parse_config(config).schedulers[0].name
    series = exposed(defined_series(METRICS_MODULE.read_text()))
    used = set()
    for trigger in spec["triggers"]:
        assert trigger["type"] == "prometheus" and trigger["metricType"] in KEDA_METRIC_TYPES
        meta = trigger["metadata"]
        assert {"serverAddress", "query", "threshold"} <= set(meta) <= KEDA_TRIGGER_METADATA
        assert all(isinstance(v, str) for v in meta.values())  # KEDA metadata is strings
        assert float(meta["threshold"]) > 0
        names = re.findall(r"\b(igw_[a-z_]+)\{pool=\"([^\"]+)\"\}", meta["query"])
        assert names, meta["query"]
        for name, label in names:
            assert name in series, name
            assert label == pool
            used.add(name)
    assert used == {"igw_pool_saturation", "igw_admission_queue_length"}
