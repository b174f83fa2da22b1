"""Rendering the Envoy bootstrap: every variant passes `envoy --mode validate`, and the
parts the security and failure design rests on are where they must be.

Live behaviour (real traffic through a real Envoy) is in test_envoy_live.py.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from bbr.request import API_PATHS
from contract import headers as hdr
from contract.config import GatewayConfig, parse_config
from contract.endpoints import EndpointError, resolve_endpoint
from igw_envoy import (
    EnvoyConfigError,
    EnvoyNotFoundError,
    cluster_name,
    default_paths,
    ensure_self_signed,
    find_envoy,
    generated_files,
    read_endpoints,
    render_bootstrap,
    validate_config,
    write_bootstrap,
    write_endpoints,
)
from igw_envoy.eds import eds_path
from igw_envoy.http_filters import PROCESSING_MODE
from igw_envoy.routes import decimal_at_most
from picker.datastore import Pool


def document(**spec: object) -> dict:
    base: dict = {
        "tls": {},
        "schedulers": [
            {"name": "llama", "modelName": "llama-3", "endpoints": ["127.0.0.1:8000"]},
        ],
    }
    base.update(spec)
    return {
        "apiVersion": "inference.sagemaker.aws.amazon.com/v1alpha1",
        "kind": "InferenceGatewayConfig",
        "metadata": {"name": "gw"},
        "spec": base,
    }


TWO_POOLS = [
    {
        "name": "llama",
        "modelName": "llama-3",
        "endpoints": ["127.0.0.1:8000", "127.0.0.1:8001"],
        "routeTimeout": "120s",
    },
    {"name": "qwen", "modelName": "qwen", "modelSelector": {"matchLabels": {"app": "qwen"}}},
]


def _jwks_file(tmp: Path) -> str:
    path = tmp / "jwks.json"
    path.write_text(
        json.dumps(
            {
                "keys": [
                    {
                        "kty": "EC",
                        "crv": "P-256",
                        "kid": "k",
                        "x": "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU",
                        "y": "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0",
                    }
                ]
            }
        )
    )
    return str(path)


TENANTS_KEYS = {"keysFile": "/etc/igw/keys", "list": [{"name": "team-a"}]}


def variants(tmp: Path) -> dict[str, dict]:
    user_tls = ensure_self_signed(tmp / "user-tls")
    return {
        "one_pool": document(),
        "two_pools_bbr": document(
            bbr={"enabled": True, "maxRequestBodyBytes": 4 * 1024 * 1024}, schedulers=TWO_POOLS
        ),
        "jwt_local": document(
            auth={
                "jwt": {
                    "issuer": "https://id.test",
                    "audiences": ["gw"],
                    "jwksFile": _jwks_file(tmp),
                }
            }
        ),
        "jwt_remote": document(
            auth={
                "jwt": {
                    "issuer": "https://id.test",
                    "jwksUri": "https://id.test/.well-known/jwks.json",
                }
            }
        ),
        "user_tls": document(
            tls={"certificateFile": str(user_tls.cert), "keyFile": str(user_tls.key)}
        ),
        "fail_open": document(failureMode="open"),
        "fail_open_two_pools": document(
            failureMode="open", bbr={"enabled": True}, schedulers=TWO_POOLS
        ),
        "tenants_keys": document(tenants=TENANTS_KEYS),
        "tenants_jwt": document(
            auth={"jwt": {"issuer": "https://id.test", "jwksFile": _jwks_file(tmp)}},
            tenants={"jwtClaim": "org.team", "list": [{"name": "team-a"}]},
        ),
        "no_fallbacks_ipv6": document(
            maxFallbacks=0,
            listener={"address": "::", "port": 9443},
            schedulers=[{"name": "v6", "modelName": "m", "endpoints": ["[::1]:8000"]}],
        ),
    }


@pytest.mark.parametrize(
    "name",
    [
        "one_pool",
        "two_pools_bbr",
        "jwt_local",
        "jwt_remote",
        "user_tls",
        "fail_open",
        "fail_open_two_pools",
        "tenants_keys",
        "tenants_jwt",
        "no_fallbacks_ipv6",
    ],
)
def test_every_variant_passes_envoy_validate(tmp_path: Path, name: str) -> None:
    config = parse_config(variants(tmp_path)[name])
    bootstrap = write_bootstrap(config, tmp_path / "state")
    validate_config(bootstrap)  # raises with Envoy's message on failure


def test_validate_reports_envoys_message(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("static_resources: {clusters: [{name: x, type: NOPE}]}\n")
    with pytest.raises(EnvoyConfigError, match="NOPE"):
        validate_config(broken)


def test_find_envoy(monkeypatch: pytest.MonkeyPatch) -> None:
    assert os.access(find_envoy(), os.X_OK)
    monkeypatch.setenv("IGW_ENVOY_BIN", "/nonexistent/envoy")
    with pytest.raises(EnvoyNotFoundError):
        find_envoy()


# --- structure --------------------------------------------------------------


def _render(tmp: Path, doc: dict) -> tuple[GatewayConfig, dict]:
    config = parse_config(doc)
    return config, render_bootstrap(config, default_paths(config, tmp))


def _hcm(bootstrap: dict) -> dict:
    listener = bootstrap["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def _routes(bootstrap: dict) -> list[dict]:
    return _hcm(bootstrap)["route_config"]["virtual_hosts"][0]["routes"]


def test_filter_order_strip_jwt_ext_proc_hold_router(tmp_path: Path) -> None:
    doc = document(auth={"jwt": {"issuer": "i", "jwksFile": _jwks_file(tmp_path)}})
    _, bootstrap = _render(tmp_path, doc)
    filters = _hcm(bootstrap)["http_filters"]
    assert [f["name"] for f in filters] == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.jwt_authn",
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.buffer",
        "envoy.filters.http.router",
    ]
    assert filters[3]["disabled"] is True  # only the one-message routes turn it on
    _, plain = _render(tmp_path, document())
    assert "envoy.filters.http.jwt_authn" not in [f["name"] for f in _hcm(plain)["http_filters"]]


def test_every_routing_header_is_stripped_early_and_in_the_filter(tmp_path: Path) -> None:
    _, bootstrap = _render(tmp_path, document())
    hcm = _hcm(bootstrap)
    early = hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    strip = hcm["http_filters"][0]["typed_config"]["mutations"]["request_mutations"]
    for mutations in (early, strip):
        assert {m["remove"] for m in mutations} == set(hdr.ROUTING_HEADERS) | {
            hdr.FALLBACK_MODEL, hdr.TENANT}


def test_body_model_fallback_only_for_fail_open_with_several_pools(tmp_path: Path) -> None:
    bbr = {"enabled": True}
    open2 = document(failureMode="open", bbr=bbr, schedulers=TWO_POOLS)
    names = {}
    for label, doc in (("open2", open2), ("open1", document(failureMode="open")),
                       ("closed2", document(bbr=bbr, schedulers=TWO_POOLS))):
        _, bootstrap = _render(tmp_path / label, doc)
        names[label] = [f["name"] for f in _hcm(bootstrap)["http_filters"]]
    assert names["open2"][-2:] == ["envoy.filters.http.lua", "envoy.filters.http.router"]
    assert "envoy.filters.http.lua" not in names["open1"] + names["closed2"]
    _, bootstrap = _render(tmp_path / "routes", open2)
    routes = {r["name"]: r for r in _routes(bootstrap)}
    for name in ("healthz", *(f"pool_{p['name']}" for p in TWO_POOLS)):
        assert routes[name]["typed_per_filter_config"]["envoy.filters.http.lua"]["disabled"]
    for pool in TWO_POOLS:
        fallback = routes[f"fallback_{pool['name']}_0"]
        assert fallback["match"]["headers"][0]["string_match"] == {"exact": pool["modelName"]}


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_ext_proc_settings(tmp_path: Path, mode: str) -> None:
    _, bootstrap = _render(tmp_path, document(failureMode=mode))
    ext_proc = _hcm(bootstrap)["http_filters"][1]["typed_config"]
    assert ext_proc["failure_mode_allow"] is (mode == "open")
    assert ext_proc["status_on_error"] == {"code": "ServiceUnavailable"}
    assert ext_proc["processing_mode"] == {
        "request_header_mode": "SEND",
        "response_header_mode": "SKIP",
        "request_body_mode": "BUFFERED",
        "response_body_mode": "NONE",
        "request_trailer_mode": "SKIP",
        "response_trailer_mode": "SKIP",
    }
    assert ext_proc["request_attributes"] == list(hdr.REQUEST_ATTRIBUTES)
    assert ext_proc["metadata_options"]["receiving_namespaces"] == {"untyped": ["envoy.lb"]}
    assert (ext_proc["message_timeout"], ext_proc["max_message_timeout"]) == ("2s", "60s")
    assert ext_proc["allow_mode_override"] is False
    assert ext_proc["grpc_service"]["envoy_grpc"]["cluster_name"] == "picker"


def test_buffer_limits_follow_the_body_limit(tmp_path: Path) -> None:
    limit = 3 * 1024 * 1024
    _, bootstrap = _render(tmp_path, document(bbr={"maxRequestBodyBytes": limit}))
    listener = bootstrap["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] == limit
    h2 = _hcm(bootstrap)["http2_protocol_options"]
    assert h2["initial_stream_window_size"] == limit
    assert h2["initial_connection_window_size"] == limit
    pools = [c for c in bootstrap["static_resources"]["clusters"] if c["name"].startswith("pool")]
    assert pools
    for cluster in pools:
        assert cluster["per_connection_buffer_limit_bytes"] == limit


def test_routes_two_pools(tmp_path: Path) -> None:
    doc = document(bbr={"enabled": True}, schedulers=TWO_POOLS, maxFallbacks=3)
    config, bootstrap = _render(tmp_path, doc)
    routes = _routes(bootstrap)
    assert routes[0]["match"]["path"] == "/healthz"
    assert routes[0]["direct_response"]["status"] == 200
    summary = routes[1]  # the global router's poll: the picker's HTTP server, no ext_proc
    assert summary["match"]["path"] == hdr.LOAD_SUMMARY_PATH
    assert summary["route"]["cluster"] == "picker_http"
    assert summary["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"]
    for route, sched in zip(routes[2:4], config.schedulers, strict=True):
        assert route["match"]["dynamic_metadata"] == [
            {
                "filter": "envoy.lb",
                "path": [{"key": hdr.POOL}],
                "value": {"string_match": {"exact": sched.name}},
            }
        ]
        assert "headers" not in route["match"]  # a client header can never pick the pool
        copies = {h["header"]["key"]: h["header"]["value"] for h in route["request_headers_to_add"]}
        assert copies[hdr.POOL] == f"%DYNAMIC_METADATA(envoy.lb:{hdr.POOL})%"
        assert set(copies) == set(hdr.ROUTING_HEADERS)
        assert route["route"]["cluster"] == Pool(sched).cluster_name
        assert route["route"]["retry_policy"]["num_retries"] == 3
        assert route["route"]["retry_policy"]["retry_on"] == (
            "connect-failure,reset,refused-stream,gateway-error"
        )
    assert routes[2]["route"]["timeout"] == "120s"
    assert [r["name"] for r in routes[4:-1]] == [
        f"one_message{path.replace('/', '_')}" for path in API_PATHS
    ]
    assert routes[-1]["direct_response"]["status"] == 503  # no pool chosen: no safe guess


@pytest.mark.parametrize("schedulers", [None, TWO_POOLS], ids=["one_pool", "two_pools"])
def test_one_message_routes(tmp_path: Path, schedulers: list | None) -> None:
    """POST + inference path + content-length 1..limit: headers message skipped, the hold
    filter on, and the fallback's action (what happens when the picker names no pool)."""
    doc = document(bbr={"enabled": True, "maxRequestBodyBytes": 4096})
    if schedulers:
        doc["spec"]["schedulers"] = schedulers
    _, bootstrap = _render(tmp_path, doc)
    routes = _routes(bootstrap)
    fallback = {k: v for k, v in routes[-1].items() if k not in ("name", "match")}
    fast = [r for r in routes if r["name"].startswith("one_message")]
    assert [r["match"]["path"] for r in fast] == list(API_PATHS)
    for route in fast:
        method, length = route["match"]["headers"]
        assert method == {"name": ":method", "string_match": {"exact": "POST"}}
        assert length["name"] == "content-length"
        assert length["string_match"]["safe_regex"]["regex"] == decimal_at_most(4096)
        per_filter = route.pop("typed_per_filter_config")
        assert {k: v for k, v in route.items() if k not in ("name", "match")} == fallback
        mode = per_filter["envoy.filters.http.ext_proc"]["overrides"]["processing_mode"]
        assert mode == {**PROCESSING_MODE, "request_header_mode": "SKIP"}
        assert per_filter["envoy.filters.http.buffer"]["buffer"] == {"max_request_bytes": 4096}


@pytest.mark.parametrize("limit", [1, 9, 10, 11, 99, 100, 1000, 4096, 8388608, 268435456, 1203])
def test_decimal_at_most_matches_exactly_one_to_limit(limit: int) -> None:
    pattern = re.compile(decimal_at_most(limit))
    near = {1, limit - 1, limit, limit + 1, limit * 10, 10 ** len(str(limit)) - 1}
    near |= {int(str(limit)[:i] + "9" * (len(str(limit)) - i)) for i in range(len(str(limit)))}
    near |= set(range(3000))
    for n in near:
        assert (pattern.fullmatch(str(n)) is not None) == (1 <= n <= limit), n
    for bad in ("0", "01", "-1", "+1", "1.0", " 1", "", "1e3"):
        assert pattern.fullmatch(bad) is None, bad


def test_one_pool_fallback_route_goes_to_the_pool(tmp_path: Path) -> None:
    _, bootstrap = _render(tmp_path, document(maxFallbacks=0))
    fallback = _routes(bootstrap)[-1]
    assert fallback["route"]["cluster"] == "pool_llama"
    assert "retry_policy" not in fallback["route"]


def test_pool_cluster_uses_override_host_over_eds(tmp_path: Path) -> None:
    config, bootstrap = _render(tmp_path, document())
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    assert set(clusters) == {"picker", "picker_http", "pool_llama"}
    pool = clusters["pool_llama"]
    assert pool["type"] == "EDS"
    source = pool["eds_cluster_config"]["eds_config"]["path_config_source"]
    assert source["path"] == str(eds_path(tmp_path.resolve() / "eds", "pool_llama"))
    assert source["watched_directory"]["path"] == str(tmp_path.resolve() / "eds")
    policy = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    assert policy["typed_config"]["override_host_sources"] == [
        {"metadata": {"key": "envoy.lb", "path": [{"key": hdr.DESTINATION_ENDPOINT}]}}
    ]  # the picker's metadata only: no request header can choose the host
    fallback = policy["typed_config"]["fallback_policy"]["policies"][0]["typed_extension_config"]
    assert fallback["name"] == "envoy.load_balancing_policies.least_request"
    picker = clusters["picker"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert picker["endpoint"]["address"]["socket_address"]["port_value"] == config.picker_port
    assert bootstrap["admin"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": config.envoy_admin_port,
    }


def test_write_bootstrap_keeps_discovered_members(tmp_path: Path) -> None:
    config = parse_config(document(bbr={"enabled": True}, schedulers=TWO_POOLS))
    state = tmp_path / "state"
    write_bootstrap(config, state)
    assert read_endpoints(state / "eds", "pool_qwen") == []
    write_endpoints(state / "eds", "pool_qwen", ["10.0.0.9:8000"])
    write_bootstrap(config, state)
    assert read_endpoints(state / "eds", "pool_qwen") == ["10.0.0.9:8000"]  # picker's view kept
    assert read_endpoints(state / "eds", "pool_llama") == ["127.0.0.1:8000", "127.0.0.1:8001"]


def test_cli_prints_yaml_without_writing(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml.safe_dump(document()))
    state = tmp_path / "state"
    out = subprocess.run(
        [sys.executable, "-m", "igw_envoy.render", str(cfg), str(state)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert yaml.safe_load(out.stdout)["node"]["id"] == "igw-gw"
    assert "RuntimeWarning" not in out.stderr
    assert not state.exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(document(bogus=1)))
    res = subprocess.run(
        [sys.executable, "-m", "igw_envoy.render", str(bad), str(state)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 2
    assert "spec.bogus" in res.stderr


# --- EDS files --------------------------------------------------------------


def test_resolve_endpoint_forms() -> None:
    assert resolve_endpoint("10.1.2.3:8000") == ["10.1.2.3:8000"]
    assert resolve_endpoint("[0:0::1]:8000") == ["[::1]:8000"]
    assert set(resolve_endpoint("localhost:8000")) <= {"127.0.0.1:8000", "[::1]:8000"}
    assert len(resolve_endpoint("localhost:8000")) == 1  # one family, not two members
    for bad in ("nohost", "host:", "h:99999", "no-such-host.invalid:80"):
        with pytest.raises(EndpointError):
            resolve_endpoint(bad)


def test_write_endpoints_is_atomic_and_round_trips(tmp_path: Path) -> None:
    eds_dir = tmp_path / "eds"
    write_endpoints(eds_dir, "pool_x", ["10.0.0.1:80", "[fd00::2]:81", "10.0.0.1:80"])
    assert read_endpoints(eds_dir, "pool_x") == ["10.0.0.1:80", "[fd00::2]:81"]
    write_endpoints(eds_dir, "pool_x", ["no-such-host.invalid:80", "10.0.0.3:80"])
    assert read_endpoints(eds_dir, "pool_x") == ["10.0.0.3:80"]  # unresolvable skipped
    assert sorted(p.name for p in eds_dir.iterdir()) == ["pool_x.json"]  # no temp left
    doc = json.loads(eds_path(eds_dir, "pool_x").read_text())
    resource = doc["resources"][0]
    assert resource["@type"].endswith("envoy.config.endpoint.v3.ClusterLoadAssignment")
    assert resource["cluster_name"] == "pool_x"


def test_cluster_name_matches_the_datastore() -> None:
    config = parse_config(document())
    assert cluster_name("llama") == Pool(config.schedulers[0]).cluster_name


# --- TLS files --------------------------------------------------------------


def _sans(path: Path) -> set[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(v) for v in san.get_values_for_type(x509.IPAddress)} | set(
        san.get_values_for_type(x509.DNSName)
    )


def test_self_signed_is_created_reused_and_reissued(tmp_path: Path) -> None:
    files = ensure_self_signed(tmp_path)
    assert files.ca_cert is not None
    assert {"localhost", "127.0.0.1", "::1"} <= _sans(files.cert)
    assert files == generated_files(tmp_path)
    assert files.ca_cert == tmp_path / "tls" / "ca.pem"  # the path igw and tests/procs.py use
    for key in (files.key, tmp_path / "tls" / "ca-key.pem"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    ca_before, cert_before = files.ca_cert.read_bytes(), files.cert.read_bytes()
    again = ensure_self_signed(tmp_path)
    assert again == files
    assert files.cert.read_bytes() == cert_before  # reused
    ensure_self_signed(tmp_path, hosts=("localhost", "gw.example.test"))
    assert "gw.example.test" in _sans(files.cert)
    assert files.ca_cert.read_bytes() == ca_before  # clients keep trusting the same CA
    ca = x509.load_pem_x509_certificate(ca_before)
    x509.load_pem_x509_certificate(files.cert.read_bytes()).verify_directly_issued_by(ca)


def test_tenants_add_identity_attributes_key_removal_and_limit_headers(tmp_path: Path) -> None:
    """Without spec.tenants nothing changes; with API keys the picker reads the key, the
    router drops it, and pool routes answer the picker's x-ratelimit-* metadata."""
    _, plain = _render(tmp_path / "plain", document())
    _, keyed = _render(tmp_path / "keyed", document(tenants=TENANTS_KEYS))
    vars_ = variants(tmp_path)
    _, jwt = _render(tmp_path / "jwt", vars_["tenants_jwt"])

    def ext_proc(bootstrap: dict) -> dict:
        (f,) = [f for f in _hcm(bootstrap)["http_filters"] if f["name"].endswith("ext_proc")]
        return f["typed_config"]

    assert ext_proc(plain)["request_attributes"] == list(hdr.REQUEST_ATTRIBUTES)
    assert ext_proc(keyed)["request_attributes"] == [
        *hdr.REQUEST_ATTRIBUTES, *hdr.TENANT_ATTRIBUTES]
    host = _hcm(keyed)["route_config"]["virtual_hosts"][0]
    assert host["request_headers_to_remove"] == ["authorization"]
    assert "request_headers_to_remove" not in _hcm(plain)["route_config"]["virtual_hosts"][0]
    # JWT: jwt_authn already removes the token; the claim becomes x-gateway-tenant
    assert "request_headers_to_remove" not in _hcm(jwt)["route_config"]["virtual_hosts"][0]
    (jwt_filter,) = [f for f in _hcm(jwt)["http_filters"] if f["name"].endswith("jwt_authn")]
    provider = jwt_filter["typed_config"]["providers"]["igw"]
    assert provider["claim_to_headers"] == [
        {"header_name": hdr.TENANT, "claim_name": "org.team"}]
    (pool,) = [r for r in _routes(keyed) if r["name"] == "pool_llama"]
    assert [h["header"]["key"] for h in pool["response_headers_to_add"]] == list(
        hdr.RATE_LIMIT_HEADERS)
    (plain_pool,) = [r for r in _routes(plain) if r["name"] == "pool_llama"]
    assert "response_headers_to_add" not in plain_pool


def test_tenants_add_the_output_token_counter_and_its_access_log(tmp_path: Path) -> None:
    """With spec.tenants a Lua filter, last before the router, counts each response's
    output tokens and a gRPC access log to the picker carries the counted entries only;
    without tenants neither exists (not one more step per request)."""
    _, plain = _render(tmp_path / "plain", document())
    _, keyed = _render(tmp_path / "keyed", document(tenants=TENANTS_KEYS))
    names = [f["name"] for f in _hcm(keyed)["http_filters"]]
    assert names[-2:] == ["igw.usage", "envoy.filters.http.router"]
    assert "igw.usage" not in [f["name"] for f in _hcm(plain)["http_filters"]]
    grpc_logs = [a for a in _hcm(keyed)["access_log"] if a["name"].endswith("http_grpc")]
    (log,) = grpc_logs
    assert log["typed_config"]["common_config"]["grpc_service"] == {
        "envoy_grpc": {"cluster_name": "picker"}}
    assert log["filter"]["metadata_filter"]["match_if_key_not_found"] is False
    assert not [a for a in _hcm(plain)["access_log"] if a["name"].endswith("http_grpc")]
