"""Request authentication with `envoy.filters.http.jwt_authn` when `spec.auth.jwt` is set.

It sits before ext_proc, so a request without a valid token gets 401 from
Envoy and never costs the picker anything. `/healthz` is exempt so load
balancers and probes need no token. The token is removed before the request
goes upstream (`forward: false`): model servers have no use for a user's
credentials. With `spec.tenants.jwtClaim`, the verified token's claim is copied
into `x-gateway-tenant` (`claim_to_headers`) for the picker; a client's own
copy of that header is stripped before this filter runs.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from urllib.parse import urlsplit

from contract import headers
from contract.config import JwtConfig
from igw_envoy.upstream_tls import upstream_tls

PROVIDER = "igw"
JWKS_CLUSTER = "jwks"
JWT_TYPE = "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication"
HEALTH_PATH = "/healthz"
_CA_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
)


class JwtRenderError(ValueError):
    """The JWT settings cannot be turned into Envoy config (bad URI, no CA bundle)."""


def jwt_filter(
    jwt: JwtConfig, config_dir: Path | None = None, tenant_claim: str | None = None
) -> dict:
    """The jwt_authn HTTP filter: one provider, required on every path but /healthz."""
    provider: dict = {
        "issuer": jwt.issuer,
        "forward": False,
        "clock_skew_seconds": 60,
    }
    if tenant_claim is not None:
        provider["claim_to_headers"] = [
            {"header_name": headers.TENANT, "claim_name": tenant_claim}
        ]
    if jwt.audiences:
        provider["audiences"] = list(jwt.audiences)
    if jwt.jwks_file is not None:
        provider["local_jwks"] = {"filename": _abs(jwt.jwks_file, config_dir)}
    else:
        provider["remote_jwks"] = {
            "http_uri": {"uri": jwt.jwks_uri, "cluster": JWKS_CLUSTER, "timeout": "5s"},
            "cache_duration": "300s",
            "async_fetch": {"failed_refetch_duration": "5s"},
            "retry_policy": {"num_retries": 3},
        }
    rules = [
        {"match": {"path": HEALTH_PATH}},
        # The global router's poll of the load summary carries no client token.
        {"match": {"path": headers.LOAD_SUMMARY_PATH}},
        {"match": {"prefix": "/"}, "requires": {"provider_name": PROVIDER}},
    ]
    return {
        "name": "envoy.filters.http.jwt_authn",
        "typed_config": {"@type": JWT_TYPE, "providers": {PROVIDER: provider}, "rules": rules},
    }


def _abs(path: str, base: Path | None) -> str:
    p = Path(path)
    if not p.is_absolute() and base is not None:
        p = base / p
    return str(p.resolve())


def jwks_cluster(jwks_uri: str) -> dict:
    """DNS cluster for the JWKS host; TLS with the system CA bundle and SAN check for https."""
    parts = urlsplit(jwks_uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise JwtRenderError(f"spec.auth.jwt.jwksUri: expected an http(s) URL, got {jwks_uri!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    cluster: dict = {
        "name": JWKS_CLUSTER,
        "type": "LOGICAL_DNS",
        "dns_lookup_family": "V4_PREFERRED",
        "connect_timeout": "2s",
        "load_assignment": {
            "cluster_name": JWKS_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {
                                        "address": parts.hostname,
                                        "port_value": port,
                                    }
                                }
                            }
                        }
                    ]
                }
            ],
        },
    }
    if tls:
        cluster["transport_socket"] = upstream_tls(parts.hostname, system_ca_bundle())
    return cluster


def system_ca_bundle() -> str:
    """The system's PEM bundle of trusted CAs (what Envoy verifies the JWKS host with)."""
    paths = ssl.get_default_verify_paths()
    for candidate in (paths.cafile, paths.openssl_cafile, *_CA_BUNDLES):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    raise JwtRenderError("no system CA bundle found for verifying the https JWKS host")
