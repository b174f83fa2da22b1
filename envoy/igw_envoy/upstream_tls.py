"""TLS from Envoy to an upstream it must verify: the JWKS host, a global router's regions."""

from __future__ import annotations

from igw_envoy.tls import is_ip

TLS_UPSTREAM_TYPE = (
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
)


def upstream_tls(host: str, ca_file: str, alpn: list[str] | None = None) -> dict:
    """A TLS transport socket sending `host` as SNI and accepting only a certificate
    signed by `ca_file` whose subject alternative name is `host`."""
    context: dict = {
        "validation_context": {
            "trusted_ca": {"filename": ca_file},
            "match_typed_subject_alt_names": [
                {"san_type": "IP_ADDRESS" if is_ip(host) else "DNS", "matcher": {"exact": host}}
            ],
        }
    }
    if alpn:
        context["alpn_protocols"] = alpn
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {"@type": TLS_UPSTREAM_TYPE, "sni": host, "common_tls_context": context},
    }

