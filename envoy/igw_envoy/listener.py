"""The HTTPS listener: TLS, the connection manager, its filters and its routes put together.

The parts are modules of their own: downstream TLS (igw_envoy.downstream_tls),
the HTTP filter chain and why its order is the security argument
(igw_envoy.http_filters), the routes (igw_envoy.routes; inline, or from the
watched RDS file of igw_envoy.xds). What stays here is the listener and its
HTTP connection manager: timeouts, HTTP/2 windows, local replies, access log.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from contract import headers
from contract.config import GatewayConfig, TlsConfig
from igw_envoy import replies
from igw_envoy.downstream_tls import downstream_tls
from igw_envoy.http_filters import early_strip, http_filters
from igw_envoy.routes import duration, route_config
from igw_envoy.usage import measures_usage, usage_access_log
from igw_envoy.xds import rds_config

HCM_TYPE = (
    "type.googleapis.com/"
    "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)

# HTTP/2: Envoy caps what a stream may buffer at the stream's flow-control
# window, not at the connection buffer limit (measured on 1.40: with a 1 MiB
# window a 1.1 MiB body got 413 despite an 8 MiB connection limit). So both
# windows are the body limit (Envoy's own default is 256 MiB, the largest
# body limit the config allows); h2 needs at least 65535.
H2_MIN_WINDOW = 65_535
H2_MAX_STREAMS = 1024


@dataclass(frozen=True)
class ListenerInputs:
    """What the listener needs besides the config: where the certificate's SDS file is."""

    sds_dir: Path
    access_log_path: str | None
    jwt_base_dir: Path | None = None
    # Set: routes come from the watched RDS file under this state dir (igw_envoy.xds);
    # None: routes are inline (a self-contained bootstrap, e.g. for `envoy --mode validate`).
    rds_state_dir: Path | None = None


def listener(config: GatewayConfig, inputs: ListenerInputs) -> dict:
    """The HTTPS listener on listen_address:listen_port."""
    return https_listener(
        config.listen_address,
        config.listen_port,
        config.bbr.max_request_body_bytes,
        http_connection_manager(config, inputs),
        inputs.sds_dir,
        config.tls,
    )


def https_listener(address: str, port: int, body_limit: int, hcm: dict, sds_dir: Path,
                   tls: TlsConfig | None = None) -> dict:
    """A TLS listener (certificate from the SDS file) running `hcm`; the global router's
    front door (igw_envoy.global_front) is the same listener with its own manager."""
    socket_address: dict = {"address": address, "port_value": port}
    if address == "::":
        socket_address["ipv4_compat"] = True  # "all addresses" includes IPv4 clients
    return {
        "name": "https",
        "address": {"socket_address": socket_address},
        # A buffered body beyond the connection buffer limit is a 413 from
        # Envoy (1 MiB by default, DESIGN §8): the limit is the body limit.
        "per_connection_buffer_limit_bytes": body_limit,
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": hcm,
                    }
                ],
                "transport_socket": downstream_tls(sds_dir, tls),
            }
        ],
    }


def http_connection_manager(config: GatewayConfig, inputs: ListenerInputs) -> dict:
    longest = max(s.route_timeout_s for s in config.schedulers)
    return {
        **connection_manager_base(config.bbr.max_request_body_bytes, longest),
        "http_filters": http_filters(config, inputs.jwt_base_dir),
        **_routes(config, inputs),
        "local_reply_config": replies.local_reply_config(config.bbr.max_request_body_bytes),
        "access_log": replies.access_log(inputs.access_log_path, headers.LOAD_SUMMARY_PATH)
        + ([usage_access_log()] if measures_usage(config) else []),
    }


def connection_manager_base(body_limit: int, longest_route_s: float) -> dict:
    """What every gateway listener's connection manager shares (Tier 1 and the global
    router): request ids, path normalization, timeouts, HTTP/2 windows, the early strip."""
    return {
        "@type": HCM_TYPE,
        "stat_prefix": "ingress_https",
        "codec_type": "AUTO",
        "server_name": "inference-gateway",
        "use_remote_address": True,
        # x-request-id on every response, so a client can quote it and an
        # operator find the access-log line (and the picker's log) for it.
        "always_set_request_id_in_response": True,
        "normalize_path": True,
        "merge_slashes": True,
        "request_headers_timeout": "10s",
        # Streams are idle while a long prompt waits in a queue or prefills;
        # never cut them before the route timeout would.
        "stream_idle_timeout": duration(max(longest_route_s, 300.0)),
        "common_http_protocol_options": {"idle_timeout": "3600s"},
        "http2_protocol_options": h2_options(body_limit),
        "early_header_mutation_extensions": [early_strip()],
    }


def _routes(config: GatewayConfig, inputs: ListenerInputs) -> dict:
    if inputs.rds_state_dir is None:
        return {"route_config": route_config(config)}
    return {"rds": rds_config(inputs.rds_state_dir)}


def h2_options(body_limit: int) -> dict:
    """HTTP/2 windows as large as the body limit, so a buffered body up to it fits."""
    window = max(body_limit, H2_MIN_WINDOW)
    return {
        "max_concurrent_streams": H2_MAX_STREAMS,
        "initial_stream_window_size": window,
        "initial_connection_window_size": window,
    }
