"""GlobalRouterConfig: defaults, and one test per validation error (contract.global_config)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from contract.config import ConfigError
from contract.global_config import (
    GlobalRouterConfig,
    load_global_config,
    parse_global_config,
)

JWT = {"issuer": "https://issuer.test", "audiences": ["igw"], "jwksFile": "/etc/igw/jwks.json"}


def document(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "regions": [
            {
                "name": "us-east-1",
                "endpoint": "127.0.0.2:8443",
                "caFile": "/tmp/us-ca.pem",
                "tags": {"residency": "us"},
                "costs": {"llama": {"perMillionTokens": 0.2}},
            },
            {
                "name": "eu-west-1",
                "endpoint": "eu.example.com:443",
                "tags": {"residency": "eu"},
                "costs": {"llama": {"perMillionTokens": 0.3}},
            },
        ],
        "models": [{"name": "llama", "policy": "cheapest-within-slo", "ttftSlo": "800ms"}],
    }
    base.update(spec)
    return {
        "apiVersion": "inference-gateway.io/v1alpha1",
        "kind": "GlobalRouterConfig",
        "metadata": {"name": "g", "labels": {"a": "b"}},
        "spec": base,
    }


def test_a_full_document_parses_with_defaults() -> None:
    config = parse_global_config(document())
    assert isinstance(config, GlobalRouterConfig)
    assert [r.name for r in config.regions] == ["us-east-1", "eu-west-1"]
    us = config.regions[0]
    assert us.ca_file == "/tmp/us-ca.pem" and us.residency == "us" and not us.drain
    assert us.costs["llama"].unit == "million_tokens" and us.costs["llama"].value == 0.2
    assert config.policy_for("llama").ttft_slo_s == 0.8
    assert config.policy_for("other") is config.default_policy
    assert config.default_policy.policy == "cheapest-within-slo"
    assert config.polling.stale_after_s > config.polling.interval_s
    assert config.bbr.enabled and config.max_retries == 2 and config.tenants is None


def test_load_from_a_file(tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(document()))
    assert load_global_config(path).name == "g"
    with pytest.raises(ConfigError, match="cannot read"):
        load_global_config(tmp_path / "missing.yaml")
    path.write_text("spec: [")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_global_config(path)


def _region(**changes: Any) -> dict[str, Any]:
    doc = document()
    doc["spec"]["regions"][0].update(changes)
    return doc


def _drop_region_field(name: str) -> dict[str, Any]:
    doc = document()
    del doc["spec"]["regions"][0][name]
    return doc


def _with_meta(**top: Any) -> dict[str, Any]:
    doc = document()
    doc.update(top)
    return doc


KEYS = {"keysFile": "/tmp/keys", "list": [{"name": "acme"}]}

CASES: list[tuple[str, dict[str, Any], str]] = [
    ("api version", _with_meta(apiVersion="v1"), "apiVersion: must be one of"),
    ("kind", _with_meta(kind="InferenceGatewayConfig"), "kind: must be GlobalRouterConfig"),
    ("unknown top", _with_meta(extra=1), "extra: unknown field"),
    ("unknown spec", document(regionz=[]), "spec.regionz: unknown field"),
    ("no regions", document(regions=[]), "spec.regions: required, a non-empty list"),
    ("regions not list", document(regions={"a": 1}), "spec.regions: required"),
    ("too many regions", document(regions=[
        {"name": f"r{i}", "endpoint": f"127.0.0.1:{1000 + i}"} for i in range(65)]),
     "at most 64 regions"),
    ("region name", _region(name="US_East"), r"spec.regions\[0\].name: required, a DNS label"),
    ("region name missing", _drop_region_field("name"), r"spec.regions\[0\].name: required"),
    ("endpoint missing", _drop_region_field("endpoint"), r"spec.regions\[0\].endpoint: required"),
    ("endpoint bad", _region(endpoint="nohost"), r"spec.regions\[0\].endpoint: expected host:port"),
    ("endpoint port", _region(endpoint="h:70000"), "port must be 1-65535"),
    ("unknown region field", _region(weight=1), r"spec.regions\[0\].weight: unknown field"),
    ("ca file type", _region(caFile=3), r"spec.regions\[0\].caFile: expected a non-empty string"),
    ("server name", _region(serverName=""), "serverName: expected a non-empty string"),
    ("tag value", _region(tags={"residency": "e u"}), "residency: a tag value is"),
    ("tag name", _region(tags={"bad key": "x"}), "tag names are"),
    ("tags not mapping", _region(tags=["us"]), r"tags: expected a mapping"),
    ("cost two units", _region(costs={"llama": {"perGpuHour": 1, "perMillionTokens": 2}}),
     r"costs.llama: exactly one of perGpuHour, perMillionTokens"),
    ("cost no unit", _region(costs={"llama": {}}), "exactly one of"),
    ("cost unknown unit", _region(costs={"llama": {"perToken": 1}}), "perToken: unknown field"),
    ("cost negative", _region(costs={"llama": {"perGpuHour": -1}}), "must be between 0"),
    ("cost string", _region(costs={"llama": {"perGpuHour": "1"}}), "expected int or float"),
    ("mixed units", _region(costs={"llama": {"perGpuHour": 2.0}}),
     r"spec.regions\[1\].costs.llama: priced perMillionTokens but spec.regions\[0\] prices it "
     "perGpuHour"),
    ("drain type", _region(drain="yes"), "drain: expected bool"),
    ("duplicate region", document(regions=[{"name": "a", "endpoint": "h:1"},
                                           {"name": "a", "endpoint": "h:2"}]),
     r"spec.regions\[1\].name: duplicate 'a'"),
    ("duplicate endpoint", document(regions=[{"name": "a", "endpoint": "h:1"},
                                             {"name": "b", "endpoint": "h:1"}]),
     r"spec.regions\[1\].endpoint: duplicate 'h:1'"),
    ("models not list", document(models={"llama": {}}), "spec.models: expected list"),
    ("model name", document(models=[{"policy": "fastest"}]), r"spec.models\[0\].name: required"),
    ("policy", document(models=[{"name": "m", "policy": "cheapest"}]),
     r"spec.models\[0\].policy: must be one of cheapest-within-slo, fastest"),
    ("slo format", document(models=[{"name": "m", "ttftSlo": "fast"}]),
     "ttftSlo: expected a duration"),
    ("slo zero", document(models=[{"name": "m", "ttftSlo": 0}]), "ttftSlo: must be positive"),
    ("slo huge", document(models=[{"name": "m", "ttftSlo": "1h"}]), "ttftSlo: at most 600s"),
    ("duplicate model", document(models=[{"name": "m"}, {"name": "m"}]),
     r"spec.models\[1\].name: duplicate 'm'"),
    ("unknown model field", document(models=[{"name": "m", "slo": 1}]), "slo: unknown field"),
    ("residency unknown", document(models=[{"name": "m", "residency": ["apac"]}]),
     r"spec.models\[0\].residency\[0\]: no region has the tag residency: 'apac'"),
    ("residency not list", document(models=[{"name": "m", "residency": "us"}]),
     "residency: expected list"),
    ("default policy residency", document(defaultPolicy={"residency": ["mars"]}),
     r"spec.defaultPolicy.residency\[0\]: no region"),
    ("default policy name", document(defaultPolicy={"name": "m"}),
     "spec.defaultPolicy.name: unknown field"),
    ("polling interval", document(polling={"interval": "1ms"}), "interval: at least 10ms"),
    ("polling stale", document(polling={"interval": "1s", "staleAfter": "500ms"}),
     "staleAfter: must be longer than interval"),
    ("polling unknown", document(polling={"every": "1s"}), "spec.polling.every: unknown field"),
    ("listener address", document(listener={"address": "localhost"}),
     "spec.listener.address: not an IP address"),
    ("listener port", document(listener={"port": 0}), "spec.listener.port: port must be"),
    ("ports unknown", document(ports={"admin": 9000}), "spec.ports.admin: unknown field"),
    ("ports clash", document(listener={"port": 9000}, ports={"picker": 9000}),
     "listener.port and ports.* must all differ"),
    ("failure mode", document(failureMode="half"), "spec.failureMode: must be one of closed, open"),
    ("spill", document(spillSaturation=0), "spec.spillSaturation: must be between 0.1"),
    ("retries", document(maxRetries=9), "spec.maxRetries: must be between 0 and 8"),
    ("retries type", document(maxRetries=True), "spec.maxRetries: expected int, got a boolean"),
    ("tls", document(tls={"certificateFile": "/c"}), "certificateFile and keyFile"),
    ("bbr limit", document(bbr={"maxRequestBodyBytes": 10}), "maxRequestBodyBytes: must be"),
    ("tenants claim", document(tenants={"jwtClaim": "sub", "list": [{"name": "a"}]}),
     "spec.tenants.jwtClaim: needs spec.auth.jwt"),
    ("keys with jwt", document(auth={"jwt": JWT}, tenants={**KEYS, "list": [{"name": "a"}]}),
     "spec.tenants.keysFile: not with spec.auth.jwt"),
    ("jwt keys", document(auth={"jwt": {"issuer": "https://i"}}),
     "spec.auth.jwt: exactly one of jwksUri or jwksFile"),
    ("auth unknown", document(auth={"oidc": {}}), "spec.auth.oidc: unknown field"),
    ("tenants model", document(tenants={**KEYS, "list": [
        {"name": "acme", "modelLimits": {"other": {"requestsPerMinute": 5}}}]}),
     r"spec.tenants.list\[0\].modelLimits.other: not a model of spec.models"),
    ("tenants limit", document(tenants={**KEYS, "list": [
        {"name": "acme", "limits": {"requestsPerMinute": 0}}]}), "requestsPerMinute: must be"),
    ("coordination", document(coordination={"url": "http://x"}), "spec.coordination.url: scheme"),
]


@pytest.mark.parametrize(("doc", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_validation_error_names_the_field(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_global_config(copy.deepcopy(doc))


def test_jwt_names_the_tenant_as_in_tier_1() -> None:
    doc = document(auth={"jwt": JWT}, tenants={"jwtClaim": "team", "list": [{"name": "a"}]})
    config = parse_global_config(doc)
    assert config.jwt is not None and config.jwt.issuer == JWT["issuer"]
    assert config.jwt.audiences == ("igw",) and config.tenants.jwt_claim == "team"


def test_tenants_reuse_the_gateway_types() -> None:
    doc = document(tenants={**KEYS, "list": [
        {"name": "acme", "limits": {"requestsPerMinute": 60},
         "modelLimits": {"llama": {"tokensPerMinute": 1000}}}]})
    config = parse_global_config(doc)
    assert config.tenants is not None
    assert config.tenants.limits()[("acme", "llama")].tokens_per_minute == 1000
