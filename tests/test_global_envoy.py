"""The global router's Envoy bootstrap (igw_envoy.global_front): shape, and the real
Envoy binary's `--mode validate` on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric import ec

from contract import headers as hdr
from contract.global_config import parse_global_config
from igw_envoy.binary import validate_config
from igw_envoy.global_front import write_global_bootstrap
from igw_envoy.tls import ensure_self_signed
from tests.jwt_keys import jwks as jwks_doc


def _config(tmp_path: Path, **spec):
    ca = ensure_self_signed(tmp_path / "region-ca", ("127.0.0.2",)).ca_cert
    doc = {
        "apiVersion": "inference-gateway.io/v1alpha1",
        "kind": "GlobalRouterConfig",
        "spec": {
            "regions": [
                {"name": "us-east-1", "endpoint": "127.0.0.2:8443", "caFile": str(ca)},
                {"name": "eu-west-1", "endpoint": "127.0.0.4:9443", "caFile": str(ca),
                 "serverName": "eu.gateway.test"},
            ],
            "listener": {"address": "127.0.0.1", "port": 18443},
            **spec,
        },
    }
    return parse_global_config(doc)


@pytest.fixture
def bootstrap(tmp_path: Path) -> dict:
    path = write_global_bootstrap(_config(tmp_path), tmp_path / "state")
    return yaml.safe_load(path.read_text())


def _clusters(bootstrap: dict) -> dict[str, dict]:
    return {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}


def _hcm(bootstrap: dict) -> dict:
    return bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]


def test_the_real_envoy_accepts_the_bootstrap(tmp_path: Path) -> None:
    path = write_global_bootstrap(_config(tmp_path, maxRetries=3), tmp_path / "state")
    validate_config(path)


def test_one_regions_cluster_each_region_with_its_own_tls(bootstrap: dict) -> None:
    regions = _clusters(bootstrap)["regions"]
    endpoints = regions["load_assignment"]["endpoints"][0]["lb_endpoints"]
    addresses = [e["endpoint"]["address"]["socket_address"] for e in endpoints]
    assert [(a["address"], a["port_value"]) for a in addresses] == [
        ("127.0.0.2", 8443), ("127.0.0.4", 9443)]
    names = [e["metadata"]["filter_metadata"]["igw"]["region"] for e in endpoints]
    assert names == ["us-east-1", "eu-west-1"]
    matches = {m["name"]: m for m in regions["transport_socket_matches"]}
    assert [e["metadata"]["filter_metadata"]["envoy.transport_socket_match"] for e in endpoints
            ] == [m["match"] for m in regions["transport_socket_matches"]]
    east = matches["us-east-1"]["transport_socket"]["typed_config"]
    eu = matches["eu-west-1"]["transport_socket"]["typed_config"]
    assert east["sni"] == "127.0.0.2" and eu["sni"] == "eu.gateway.test"
    san = eu["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"]
    assert san == [{"san_type": "DNS", "matcher": {"exact": "eu.gateway.test"}}]
    assert eu["common_tls_context"]["alpn_protocols"] == ["h2"]
    policy = regions["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    check = regions["health_checks"][0]
    assert check["http_health_check"]["path"] == hdr.LOAD_SUMMARY_PATH
    assert check["no_traffic_interval"] == check["interval"]
    assert regions["outlier_detection"]["consecutive_gateway_failure"] >= 1
    # a partitioned region: PINGs close its connections within a few seconds; no per-try
    # timer could tell it from a long TTFT
    options = regions["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
    keepalive = options["http2_protocol_options"]["connection_keepalive"]
    assert keepalive == {"interval": "1s", "timeout": "1.5s"}


def test_routes_retry_on_the_next_region_and_name_the_region(bootstrap: dict) -> None:
    routes = _hcm(bootstrap)["route_config"]["virtual_hosts"][0]["routes"]
    assert routes[0]["name"] == "healthz"
    for route in routes[1:]:
        action = route["route"]
        assert action["cluster"] == "regions"
        retry = action["retry_policy"]
        assert retry["retry_on"] == "connect-failure,reset,refused-stream,retriable-status-codes"
        assert retry["retriable_status_codes"] == [503, 429]
        assert retry["num_retries"] == 2
        assert "per_try_timeout" not in retry and "per_try_idle_timeout" not in retry
        assert retry["retry_host_predicate"][0]["name"] == (
            "envoy.retry_host_predicates.previous_hosts")
        (added,) = route["response_headers_to_add"]
        assert added["header"] == {"key": hdr.REGION, "value": "%UPSTREAM_METADATA(igw:region)%"}


def test_the_filter_chain_strips_then_asks_the_router(bootstrap: dict) -> None:
    hcm = _hcm(bootstrap)
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ["envoy.filters.http.header_mutation", "envoy.filters.http.ext_proc",
                     "envoy.filters.http.buffer", "envoy.filters.http.router"]
    ext_proc = hcm["http_filters"][1]["typed_config"]
    assert f"request.headers['{hdr.REGIONS}']" in ext_proc["request_attributes"]
    assert ext_proc["failure_mode_allow"] is False
    assert _clusters(bootstrap)["picker"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0][
        "endpoint"]["address"]["socket_address"]["port_value"] == 9012


def test_with_tenants_the_limits_are_answered_and_the_key_kept(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("")
    config = _config(tmp_path, tenants={"keysFile": str(keys), "list": [{"name": "acme"}]})
    path = write_global_bootstrap(config, tmp_path / "state")
    validate_config(path)
    host = _hcm(yaml.safe_load(path.read_text()))["route_config"]["virtual_hosts"][0]
    assert host["request_headers_to_remove"] == [hdr.AUTHORIZATION]
    added = {h["header"]["key"] for h in host["routes"][-1]["response_headers_to_add"]}
    assert added == {hdr.REGION, *hdr.RATE_LIMIT_HEADERS}
    ext_proc = _hcm(yaml.safe_load(path.read_text()))["http_filters"][1]["typed_config"]
    assert f"request.headers['{hdr.AUTHORIZATION}']" in ext_proc["request_attributes"]


@pytest.mark.parametrize("jwks", ["file", "uri"])
def test_with_jwt_the_token_is_checked_before_the_router(tmp_path: Path, jwks: str) -> None:
    keys = tmp_path / "jwks.json"
    keys.write_text(json.dumps(jwks_doc(ec.generate_private_key(ec.SECP256R1()))))
    source = {"jwksFile": str(keys)} if jwks == "file" else {
        "jwksUri": "https://login.example.com/.well-known/jwks.json"}
    config = _config(tmp_path, auth={"jwt": {"issuer": "https://issuer.test", **source}},
                     tenants={"jwtClaim": "team", "list": [{"name": "acme"}]})
    path = write_global_bootstrap(config, tmp_path / "state")
    validate_config(path)
    bootstrap = yaml.safe_load(path.read_text())
    filters = _hcm(bootstrap)["http_filters"]
    assert [f["name"] for f in filters][:3] == [
        "envoy.filters.http.header_mutation", "envoy.filters.http.jwt_authn",
        "envoy.filters.http.ext_proc"]
    provider = filters[1]["typed_config"]["providers"]["igw"]
    assert provider["claim_to_headers"] == [{"header_name": hdr.TENANT, "claim_name": "team"}]
    assert provider["forward"] is False
    assert ("jwks" in _clusters(bootstrap)) == (jwks == "uri")
