"""The listener's downstream TLS: the protocol versions, suites and ALPN clients get.

The certificate itself comes from a watched SDS file (igw_envoy.sds), generated
by igw_envoy.tls when the config names none.
"""

from __future__ import annotations

from pathlib import Path

from contract.config import TlsConfig
from igw_envoy.sds import sds_config

TLS_DOWNSTREAM_TYPE = (
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext"
)

# TLS 1.2 suites: forward secrecy (ECDHE) and AEAD only. TLS 1.3 suites are
# fixed by BoringSSL and all qualify.
TLS12_CIPHERS = (
    "ECDHE-ECDSA-AES128-GCM-SHA256",
    "ECDHE-RSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384",
    "ECDHE-RSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-CHACHA20-POLY1305",
    "ECDHE-RSA-CHACHA20-POLY1305",
)


def downstream_tls(sds_dir: Path, tls: TlsConfig | None = None) -> dict:
    """TLS 1.2+ with modern suites, ALPN h2 and http/1.1, certificate from watched SDS;
    with `clientCaFile`, client certificates verified against it (mutual TLS), required
    of every connection with `requireClientCertificate`."""
    sources: dict = {"tls_certificate_sds_secret_configs": [sds_config(sds_dir)]}
    if tls is None or not tls.client_ca_file:
        return downstream_tls_socket(sources)
    sources["validation_context"] = {"trusted_ca": {"filename": tls.client_ca_file}}
    socket = downstream_tls_socket(sources)
    socket["typed_config"]["require_client_certificate"] = tls.require_client_certificate
    return socket


def downstream_tls_socket(certificates: dict) -> dict:
    """The listener's TLS policy with the given certificate source (SDS or files);
    the benchmark's plain-Envoy baseline uses it too, so both terminate TLS alike."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": TLS_DOWNSTREAM_TYPE,
            "common_tls_context": {
                "tls_params": {
                    "tls_minimum_protocol_version": "TLSv1_2",
                    "tls_maximum_protocol_version": "TLSv1_3",
                    "cipher_suites": list(TLS12_CIPHERS),
                },
                "alpn_protocols": ["h2", "http/1.1"],
                **certificates,
            },
        },
    }
