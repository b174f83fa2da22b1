"""The InferenceGatewayConfig CRD's schema agrees with the picker's own validation.

No API server runs here, so the CRD's `openAPIV3Schema` is checked with
`jsonschema` after the conversion the API server effectively applies:
`x-kubernetes-int-or-string` is "integer or string", and unknown fields are
errors (`additionalProperties: false` on every object with properties), which
is what kubectl's strict server-side field validation does with a structural
schema. The CEL rules (`x-kubernetes-validations`) are evaluated with
cel-python where it is installed.

Direction that matters: whatever the picker accepts, the CRD accepts (else a
valid config could not be stored); what the CRD rejects, the picker rejects
too (the CRD only fails earlier, at `kubectl apply`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from contract.config import ConfigError, parse_config

ROOT = Path(__file__).resolve().parent.parent
CRD_PATH = ROOT / "deploy" / "crd" / "inferencegatewayconfigs.yaml"
CHART_CRD = ROOT / "deploy" / "helm" / "inference-gateway" / "crds" / "inferencegatewayconfigs.yaml"
EXAMPLE = ROOT / "examples" / "hyperpod-example.yaml"
OUR_API = "inference-gateway.io/v1alpha1"


def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def open_api_schema() -> dict[str, Any]:
    (version,) = crd()["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def to_json_schema(node: Any) -> Any:
    """Kubernetes OpenAPI v3 (structural) → JSON Schema with strict unknown-field handling."""
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("anyOf", None)
        out["type"] = ["integer", "string"]
    if node.get("nullable"):
        out.pop("nullable")
        out["type"] = [out["type"], "null"]
    if "properties" in node and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out


def rules(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple, dict]]:
    """Every CEL rule with the path (`[]` = each list item) of the value it applies to."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule
    for name, sub in (schema.get("properties") or {}).items():
        yield from rules(sub, (*path, name))
    if "items" in schema:
        yield from rules(schema["items"], (*path, "[]"))


def values_at(doc: Any, path: tuple[str, ...]) -> Iterator[Any]:
    if not path:
        yield doc
        return
    head, rest = path[0], path[1:]
    if head == "[]":
        for item in doc if isinstance(doc, list) else []:
            yield from values_at(item, rest)
    elif isinstance(doc, dict) and head in doc:
        yield from values_at(doc[head], rest)


def cel_failures(doc: dict[str, Any]) -> list[str]:
    """Messages of the CEL rules this document breaks (needs cel-python)."""
    celpy = pytest.importorskip("celpy")
    env = celpy.Environment()
    failed = []
    for path, rule in rules(open_api_schema()):
        program = env.program(env.compile(rule["rule"]))
        for value in values_at(doc, path):
            if not program.evaluate({"self": celpy.json_to_cel(value)}):
                failed.append(rule["message"])
    return failed


def crd_errors(doc: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(to_json_schema(open_api_schema()))
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]


def ours(doc: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    doc["apiVersion"] = OUR_API
    return doc


def example() -> dict[str, Any]:
    return ours(yaml.safe_load(EXAMPLE.read_text()))


def with_scheduler(**fields: Any) -> dict[str, Any]:
    d = example()
    d["spec"]["schedulers"][0].update(fields)
    return d


def with_spec(**fields: Any) -> dict[str, Any]:
    d = example()
    d["spec"].update(fields)
    return d


def two_schedulers(bbr: bool = True, model: str = "m2") -> dict[str, Any]:
    d = with_spec(bbr={"enabled": bbr})
    d["spec"]["schedulers"].append({"name": "b", "modelName": model, "endpoints": ["10.0.0.1:80"]})
    return d


# Configs the picker accepts, in the style of tests/test_config.py.
ACCEPTED: dict[str, Callable[[], dict[str, Any]]] = {
    "hyperpod example": example,
    "our additions": lambda: with_spec(
        schedulers=[
            {
                "name": "llama-70b",
                "modelName": "llama-3.1-70b",
                "endpoints": ["127.0.0.1:8001", "[::1]:8002", "pod-a.local:8000"],
                "routeTimeout": "90s",
                "weights": {"queue": 1, "prefix": 5},
                "metrics": {"interval": "100ms", "staleAfter": "3s"},
                "loraAdapters": ["sql-lora"],
            }
        ],
        listener={"port": 9443},
        failureMode="open",
        maxFallbacks=3,
    ),
    "every field": lambda: with_spec(
        tls={"certificateFile": "/tls/tls.crt", "keyFile": "/tls/tls.key", "secretName": "gw",
             "clientCaFile": "/tls/clients.pem", "requireClientCertificate": True},
        bbr={"enabled": True, "maxRequestBodyBytes": 268435456},
        auth={"jwt": {"issuer": "https://issuer", "audiences": ["a"], "jwksUri": "https://j"}},
        schedulers=[
            {
                "name": "llama-70b",
                "modelName": "llama-3.1-70b",
                "modelSelector": {"matchLabels": {"app": "vllm-llama", "tier": "gpu"}},
                "targetPort": 65535,
                "scheduler": "round-robin",
                "engineType": "trtllm",
                "weights": {
                    "queue": 2,
                    "kvCache": 2.5,
                    "prefix": 3,
                    "lru": 0,
                    "loraAffinity": 1,
                    "runningRequests": 1000,
                    "predictedLatency": 0.5,
                },
                "loraAdapters": ["a", "b"],
                "routeTimeout": 300,
                "replicas": 4,
                "metrics": {
                    "source": "prometheus",
                    "prometheusUrl": "http://prometheus:9090",
                    "interval": "1s",
                    "timeout": "500ms",
                    "staleAfter": "1m",
                    "path": "/metrics",
                },
                "saturation": {
                    "queueThreshold": 0,
                    "kvCacheThreshold": 1,
                    "queueSize": 0,
                    "queueTimeout": "1h",
                    "maxStartDelay": "500ms",
                    "slotAllowance": 0,
                    "fairShareWindow": "2s",
                },
            }
        ],
        listener={"address": "::", "port": 443},
        ports={"picker": 9002, "admin": 9003, "metrics": 9090, "envoyAdmin": 9901},
        failureMode="closed",
        maxFallbacks=0,
    ),
    "jwks file": lambda: with_spec(auth={"jwt": {"issuer": "i", "jwksFile": "/j.json"}}),
    "flow control off": lambda: with_scheduler(saturation={"maxStartDelay": "0s"}),
    "fair shares off": lambda: with_scheduler(saturation={"fairShareWindow": "0s"}),
    "two schedulers with bbr": two_schedulers,
    "empty tls and metadata extras": lambda: {
        **example(),
        "metadata": {"name": "gw", "namespace": "models", "labels": {"a": "b"}},
    },
    "sglang least-request": lambda: with_scheduler(engineType="sglang", scheduler="least-request"),
    "coordination url only": lambda: with_spec(coordination={"url": "redis://redis:6379/0"}),
    "coordination every field": lambda: with_spec(
        coordination={
            "url": "rediss://cache.example:6380/2",
            "passwordFile": "/var/run/secrets/redis/password",
            "username": "gateway",
            "caFile": "/etc/igw-coordination/ca.pem",
            "keyPrefix": "igw:prod",
            "flushInterval": "2ms",
            "heartbeatInterval": "500ms",
            "replicaTimeout": "3s",
            "timeout": "100ms",
            "snapshotInterval": "1m",
            "streamMaxLen": 100000,
            "bufferSize": 4096,
            "shareScrapes": False,
        }
    ),
    "tenants with api keys": lambda: with_spec(
        tenants={"keysFile": "/etc/igw-tenant-keys/keys", "list": [{"name": "team-a"}]}
    ),
    "tenants every field": lambda: with_spec(
        auth={"jwt": {"issuer": "i", "jwksFile": "/j.json"}},
        tenants={
            "jwtClaim": "org.team",
            "failureMode": "closed",
            "list": [
                {
                    "name": "team-a",
                    "weight": 2.5,
                    "limits": {"requestsPerMinute": 600, "tokensPerMinute": 10**6,
                               "maxConcurrentRequests": 8},
                    "modelLimits": {"llama-3.1-70b": {"tokensPerMinute": 1000}},
                },
                {"name": "Team_B.eu", "weight": 0.001},
            ],
        },
    ),
}

def _tenants(**fields: Any) -> dict[str, Any]:
    return with_spec(tenants={"keysFile": "/k", "list": [{"name": "team-a", **fields}]})


# Broken configs: the CRD's schema or CEL rules and the picker both refuse them.
REJECTED: dict[str, Callable[[], dict[str, Any]]] = {
    "bad scheduler enum": lambda: with_scheduler(scheduler="fastest"),
    "bad engine enum": lambda: with_scheduler(engineType="tgi"),
    "port out of range": lambda: with_scheduler(targetPort=70000),
    "port zero": lambda: with_spec(listener={"port": 0}),
    "port as string": lambda: with_scheduler(targetPort="8000"),
    "missing modelName": lambda: _without_model_name(),
    "unknown spec field": lambda: with_spec(colour="blue"),
    "misspelt scheduler field": lambda: with_scheduler(modelname="x"),
    "misspelt weight": lambda: with_scheduler(weights={"kvcache": 1}),
    "body limit too large": lambda: with_spec(bbr={"enabled": True, "maxRequestBodyBytes": 2**30}),
    "bad duration": lambda: with_scheduler(routeTimeout="soon"),
    "endpoint without port": lambda: with_scheduler(endpoints=["nohost"]),
    "bad failure mode": lambda: with_spec(failureMode="maybe"),
    "too many fallbacks": lambda: with_spec(maxFallbacks=9),
    "kv threshold above 1": lambda: with_scheduler(saturation={"kvCacheThreshold": 1.5}),
    "bad start delay": lambda: with_scheduler(saturation={"maxStartDelay": "soon"}),
    "negative slot allowance": lambda: with_scheduler(saturation={"slotAllowance": -1}),
    "bad fair share window": lambda: with_scheduler(saturation={"fairShareWindow": "soon"}),
    "upper-case name": lambda: with_scheduler(name="Llama"),
    "no schedulers": lambda: with_spec(schedulers=[]),
    "coordination without url": lambda: with_spec(coordination={"flushInterval": "5ms"}),
    "coordination http url": lambda: with_spec(coordination={"url": "http://redis:6379"}),
    "coordination unknown field": lambda: with_spec(coordination={"url": "redis://r", "db": 1}),
    "coordination tiny stream": lambda: with_spec(
        coordination={"url": "redis://r", "streamMaxLen": 10}
    ),
    "tenants without a list": lambda: with_spec(tenants={"keysFile": "/k"}),
    "tenants empty list": lambda: with_spec(tenants={"keysFile": "/k", "list": []}),
    "tenant name with a space": lambda: _tenants(name="team a"),
    "tenant weight zero": lambda: _tenants(weight=0),
    "tenant zero limit": lambda: _tenants(limits={"requestsPerMinute": 0}),
    "tenant misspelt limit": lambda: _tenants(limits={"rpm": 5}),
    "tenant misspelt model limit": lambda: _tenants(
        modelLimits={"llama-3.1-70b": {"tokensPerMinut": 5}}),
    "tenant unknown field": lambda: _tenants(colour="blue"),
    "tenants bad failure mode": lambda: with_spec(
        tenants={"keysFile": "/k", "failureMode": "maybe", "list": [{"name": "a"}]}),
    "101 schedulers": lambda: with_spec(
        bbr={"enabled": True},
        schedulers=[
            {"name": f"s{i}", "modelName": f"m{i}", "endpoints": ["a:1"]} for i in range(101)
        ],
    ),
}

# Refused by CEL rules only (jsonschema cannot express them).
REJECTED_BY_CEL: dict[str, tuple[Callable[[], dict[str, Any]], str]] = {
    "two schedulers without bbr": (lambda: two_schedulers(bbr=False), "bbr.enabled"),
    "duplicate modelName": (lambda: two_schedulers(model="llama-3.1-70b"), "modelName"),
    "certificate without key": (
        lambda: with_spec(tls={"certificateFile": "/c"}),
        "certificateFile and keyFile",
    ),
    "client certificates required without their CA": (
        lambda: with_spec(tls={"requireClientCertificate": True}),
        "requireClientCertificate needs clientCaFile",
    ),
    "both jwks sources": (
        lambda: with_spec(auth={"jwt": {"issuer": "i", "jwksUri": "u", "jwksFile": "f"}}),
        "exactly one of jwksUri or jwksFile",
    ),
    "neither selector nor endpoints": (
        lambda: with_scheduler(modelSelector={"matchLabels": {}}),
        "modelSelector.matchLabels or endpoints",
    ),
    "prometheus without url": (
        lambda: with_scheduler(metrics={"source": "prometheus"}),
        "prometheusUrl",
    ),
    "tenants with both keys and a claim": (
        lambda: with_spec(auth={"jwt": {"issuer": "i", "jwksFile": "/j.json"}}, tenants={
            "keysFile": "/k", "jwtClaim": "team", "list": [{"name": "a"}]}),
        "exactly one of keysFile or jwtClaim",
    ),
    "tenants with neither keys nor a claim": (
        lambda: with_spec(tenants={"list": [{"name": "a"}]}),
        "exactly one of keysFile or jwtClaim",
    ),
    "coordination caFile without tls": (
        lambda: with_spec(coordination={"url": "redis://r:6379/0", "caFile": "/ca.pem"}),
        "caFile only with a rediss:// url",
    ),
}


def _without_model_name() -> dict[str, Any]:
    d = example()
    del d["spec"]["schedulers"][0]["modelName"]
    return d


def test_crd_identity():
    doc = crd()
    assert doc["apiVersion"] == "apiextensions.k8s.io/v1"
    spec = doc["spec"]
    assert (spec["group"], spec["scope"], spec["names"]["kind"]) == (
        "inference-gateway.io",
        "Namespaced",
        "InferenceGatewayConfig",
    )
    assert doc["metadata"]["name"] == f"{spec['names']['plural']}.{spec['group']}"
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Accepted"] == '.status.conditions[?(@.type=="Accepted")].status'
    assert f"{OUR_API}" == f"{spec['group']}/{version['name']}"


def test_chart_ships_the_same_crd():
    assert CHART_CRD.read_text() == CRD_PATH.read_text()


def test_schema_is_structural():
    """What the API server requires: a type everywhere (or int-or-string), no
    additionalProperties beside properties, no types inside anyOf but int-or-string's."""

    def walk(node: dict[str, Any], where: str) -> None:
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, where
            assert node.get("anyOf", [{"type": "integer"}, {"type": "string"}]) == [
                {"type": "integer"},
                {"type": "string"},
            ], where
        else:
            assert node.get("type") in (
                "object",
                "array",
                "string",
                "integer",
                "number",
                "boolean",
            ), where
            assert "anyOf" not in node, where
        if "properties" in node:
            assert "additionalProperties" not in node, where
            for name, sub in node["properties"].items():
                walk(sub, f"{where}.{name}")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{where}.*")
        if "items" in node:
            walk(node["items"], f"{where}[]")

    walk(open_api_schema(), "")


def test_schema_covers_exactly_the_picker_fields():
    spec = open_api_schema()["properties"]["spec"]["properties"]
    assert set(spec) == {
        "tls",
        "bbr",
        "auth",
        "schedulers",
        "listener",
        "ports",
        "failureMode",
        "maxFallbacks",
        "coordination",
        "tenants",
    }
    tenants = spec["tenants"]["properties"]
    assert set(tenants) == {"keysFile", "jwtClaim", "failureMode", "measureUsage", "list"}
    tenant = tenants["list"]["items"]["properties"]
    assert set(tenant) == {"name", "weight", "limits", "modelLimits"}
    assert set(tenant["limits"]["properties"]) == {
        "requestsPerMinute", "tokensPerMinute", "maxConcurrentRequests"}
    from contract.config import MAX_TENANTS, TENANT_FAILURE_MODES

    assert tuple(tenants["failureMode"]["enum"]) == TENANT_FAILURE_MODES
    assert tenants["list"]["maxItems"] == MAX_TENANTS
    assert set(spec["coordination"]["properties"]) == {
        "url", "passwordFile", "username", "caFile", "keyPrefix", "flushInterval",
        "heartbeatInterval", "replicaTimeout", "timeout", "snapshotInterval", "streamMaxLen",
        "bufferSize", "shareScrapes",
    }
    sched = spec["schedulers"]["items"]["properties"]
    assert set(sched) == {
        "name",
        "modelName",
        "modelSelector",
        "targetPort",
        "scheduler",
        "engineType",
        "weights",
        "loraAdapters",
        "routeTimeout",
        "replicas",
        "endpoints",
        "metrics",
        "saturation",
    }
    from contract.config import ENGINE_TYPES, FAILURE_MODES, SCHEDULER_PROFILES, WEIGHT_NAMES

    assert tuple(sched["scheduler"]["enum"]) == SCHEDULER_PROFILES
    assert tuple(sched["engineType"]["enum"]) == ENGINE_TYPES
    assert tuple(spec["failureMode"]["enum"]) == FAILURE_MODES
    assert tuple(sched["weights"]["properties"]) == WEIGHT_NAMES
    assert sched["targetPort"]["default"] == 8000
    assert spec["schedulers"]["maxItems"] == 100
    assert spec["bbr"]["properties"]["maxRequestBodyBytes"]["maximum"] == 268435456


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_what_the_picker_accepts_the_crd_accepts(name):
    doc = ACCEPTED[name]()
    parse_config(doc)  # the picker takes it...
    assert crd_errors(doc) == []  # ...so must the CRD
    assert cel_failures(doc) == []


def test_repository_configs_are_accepted():
    """Every InferenceGatewayConfig file in the repository, under our apiVersion."""
    found = 0
    for path in [*ROOT.glob("examples/*.yaml"), *ROOT.glob("deploy/examples/*.yaml")]:
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict) or doc.get("kind") != "InferenceGatewayConfig":
                continue
            found += 1
            doc = ours(doc)
            parse_config(doc)
            assert crd_errors(doc) == [], path
            assert cel_failures(doc) == [], path
    assert found >= 2


@pytest.mark.parametrize("name", list(REJECTED))
def test_broken_configs_are_rejected_by_both(name):
    doc = REJECTED[name]()
    with pytest.raises(ConfigError):
        parse_config(doc)
    assert crd_errors(doc), f"the CRD schema accepted: {name}"


def test_error_names_the_field():
    errors = crd_errors(with_scheduler(scheduler="fastest"))
    assert any(e.startswith("spec.schedulers.0.scheduler:") for e in errors), errors
    errors = crd_errors(_without_model_name())
    assert any("'modelName' is a required property" in e for e in errors), errors


@pytest.mark.parametrize("name", list(REJECTED_BY_CEL))
def test_cel_rules_reject_what_the_picker_rejects(name):
    make, message = REJECTED_BY_CEL[name]
    doc = make()
    with pytest.raises(ConfigError):
        parse_config(doc)
    assert crd_errors(doc) == []  # structurally fine...
    failures = cel_failures(doc)  # ...but a rule refuses it
    assert any(message in f for f in failures), failures


def test_status_written_by_the_picker_fits_the_schema():
    from picker.discovery.config_resource import Outcome, status_patch

    schema = to_json_schema(open_api_schema()["properties"]["status"])
    for outcome in (Outcome(True, "Applied", "ok"), Outcome(False, "Invalid", "spec.x: bad")):
        status = status_patch(outcome, generation=3, pools=2)["status"]
        jsonschema.Draft7Validator(schema, format_checker=jsonschema.FormatChecker()).validate(
            status
        )
