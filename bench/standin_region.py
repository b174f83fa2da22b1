"""A region that costs (almost) nothing: for measuring what the global tier adds on its own.

    python -m bench.standin_region --port 18443 --state-dir DIR [--model M]

What the global tier sees of a region, a Tier-1 gateway's TLS listener, without the
gateway behind it. On `--port`, an Envoy with Tier 1's listener TLS (a certificate from
igw_envoy.tls under DIR/tls; the region's `caFile` is DIR/tls/ca.pem), HTTP/2 or
HTTP/1.1 by ALPN as Tier 1's listener:
- any POST: bench.echo_server's one-token chat completion, answered by Envoy itself
  (`direct_response`), so the answer costs the same over HTTP/2 (the global tier's
  Envoy) as over HTTP/1.1 (wrk, for the direct measurement);
- anything else, to this process over plaintext HTTP/1.1 on a port of its own:
  `GET /igw/v1/load-summary` (contract.headers.LOAD_SUMMARY_PATH, picker.load_summary's
  document): one idle, ready pool serving the model, not saturated, a 50 ms predicted
  TTFT, its generation one higher at every answer (the router counts a summary whose
  generation stopped moving as stale), so the router places every request here; other
  paths: bench.echo_server's answers (404 for an unknown path).

Why Envoy in front and not Python alone: a Python HTTP/2 server cost about 0.08 ms of
CPU per request behind the global tier against 0.04 for its HTTP/1.1 reached directly,
a difference the global tier was charged for (docs/global.md).

Prints `standin-region ready <port>` once both listen; SIGTERM/SIGINT stop both. Bench
and test support: no part of the product.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import orjson
import yaml

from bench.echo_server import COMPLETION, EchoProtocol, _response, run
from bench.echo_server import serve_until_signalled as serve_echo
from bench.envoy_baseline import listener_tls
from bench.overhead import MODEL
from contract.headers import LOAD_SUMMARY_PATH
from igw.ports import free_ports
from igw_envoy.clusters import static_assignment
from igw_envoy.http_filters import BUFFER, BUFFER_TYPE, router_filter
from igw_envoy.listener import HCM_TYPE
from igw_envoy.process import EnvoyProcess
from igw_envoy.tls import DEFAULT_HOSTS, TlsFiles, ensure_self_signed, generated_files

SUMMARY = LOAD_SUMMARY_PATH.encode()
JSON = b"application/json"
SUMMARY_CLUSTER = "summary"
BODY_LIMIT = 4 << 20  # a request body the stand-in holds before answering


class Summary:
    """The region's load summary: fixed but for its generation, which moves per answer."""

    def __init__(self, model: str) -> None:
        self.generation = 0
        self.pool = {
            "pool": "standin", "model": model, "adapters": [], "pods": 1, "readyPods": 1,
            "queueLength": 0, "engineWaiting": 0.0, "running": 0.0, "committedRequests": 0,
            "committedPrefillTokens": 0.0, "saturation": 0.0, "saturated": False,
            "predictedTtftS": 0.05, "typicalPromptTokens": 64, "prefillTokensPerS": 10000.0,
        }

    def body(self) -> bytes:
        self.generation += 1
        return orjson.dumps({
            "version": 1, "gateway": "standin-region", "generation": self.generation,
            "generatedAt": round(time.time(), 3), "intervalS": 0.25, "serving": True,
            "pools": [self.pool],
        })


class RegionH1(EchoProtocol):
    """bench.echo_server's HTTP/1.1, plus the load summary."""

    def __init__(self, summary: Summary) -> None:
        super().__init__()
        self.summary = summary

    def answer_get(self, path: bytes) -> bytes:
        if path == SUMMARY:
            return _response(b"200 OK", self.summary.body(), JSON)
        return super().answer_get(path)


def _routes() -> list[dict]:
    """POSTs answered by Envoy; the rest to this process."""
    post = {"name": ":method", "string_match": {"exact": "POST"}}
    answer_headers = [
        {"header": {"key": "content-type", "value": JSON.decode()},
         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
        {"header": {"key": "x-sim-pod", "value": "standin"}},
    ]
    return [
        {"match": {"prefix": "/", "headers": [post]},
         "direct_response": {"status": 200, "body": {"inline_string": COMPLETION.decode()}},
         "response_headers_to_add": answer_headers},
        {"match": {"prefix": "/"}, "route": {"cluster": SUMMARY_CLUSTER, "timeout": "10s"}},
    ]


def bootstrap(port: int, summary_port: int, admin_port: int, files: TlsFiles,
              host: str = "127.0.0.1") -> dict:
    """The stand-in's Envoy: Tier 1's listener TLS policy over file certificates."""
    hcm = {
        "@type": HCM_TYPE, "stat_prefix": "standin", "codec_type": "AUTO",
        # the whole body before the answer: an HTTP/1.1 answer sent before the request
        # ends makes Envoy close the connection (a new TLS handshake per request)
        "http_filters": [
            {"name": BUFFER, "typed_config": {"@type": BUFFER_TYPE,
                                              "max_request_bytes": BODY_LIMIT}},
            router_filter(),
        ],
        "route_config": {"name": "standin", "virtual_hosts": [
            {"name": "standin", "domains": ["*"], "routes": _routes()}]},
    }
    tls = listener_tls(files.cert, files.key)
    summary = {
        "name": SUMMARY_CLUSTER, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": static_assignment(SUMMARY_CLUSTER, [("127.0.0.1", summary_port)]),
    }
    listener = {
        "name": "standin",
        "address": {"socket_address": {"address": host, "port_value": port}},
        "filter_chains": [{"transport_socket": tls, "filters": [{
            "name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                 "port_value": admin_port}}},
        "static_resources": {"listeners": [listener], "clusters": [summary]},
    }


def ca_file(state_dir: Path) -> Path:
    """The CA of the stand-in serving from `state_dir`: the region's `caFile`."""
    ca = generated_files(state_dir).ca_cert
    assert ca is not None
    return ca


async def serve(port: int, state_dir: Path, model: str, host: str = "127.0.0.1") -> None:
    summary = Summary(model)
    files = ensure_self_signed(state_dir, DEFAULT_HOSTS)
    summary_port, admin_port = free_ports(2)
    config = state_dir / "standin-envoy.yaml"
    config.write_text(yaml.safe_dump(bootstrap(port, summary_port, admin_port, files, host)))
    # Envoy's own worker count, as Tier 1 runs it
    with EnvoyProcess(config, admin_port):
        await serve_echo(lambda: RegionH1(summary), summary_port,
                         announce=f"standin-region ready {port}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.standin_region")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--state-dir", type=Path, required=True,
                   help="where the certificate goes (STATE_DIR/tls/ca.pem is its CA)")
    p.add_argument("--model", default=MODEL, help="the model the summary says it serves")
    args = p.parse_args(argv)
    run(serve(args.port, args.state_dir, args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
