"""Container health check: exit 0 when every URL answers 200 in time.

    python /opt/igw/healthcheck.py [URL ...]

Without URLs it checks the gateway described by $IGW_CONFIG (default
/etc/igw/gateway.yaml): Envoy's HTTPS `/healthz` on the listener port, which
Envoy answers by itself, and the picker's `/healthz` on the metrics port,
which says whether the picker is up and not draining. Both are needed: Envoy
stays "healthy" while its picker crash-loops.

The gateway's certificate is self-signed by default and the check only talks
to its own container, so it is not verified. Standard library (and the
project's config loader) only: the image has no curl.
"""

from __future__ import annotations

import os
import ssl
import sys
import urllib.request

TIMEOUT_S = 2.0
DEFAULT_CONFIG = "/etc/igw/gateway.yaml"
ANY_ADDRESS = {"0.0.0.0": "127.0.0.1", "::": "127.0.0.1"}


def gateway_urls(config_path: str) -> list[str]:
    from contract.config import load_config

    config = load_config(config_path)
    host = ANY_ADDRESS.get(config.listen_address, config.listen_address)
    if ":" in host:
        host = f"[{host}]"
    metrics_host = os.environ.get("IGW_METRICS_HOST") or "127.0.0.1"
    metrics_host = ANY_ADDRESS.get(metrics_host, metrics_host)
    return [
        f"https://{host}:{config.listen_port}/healthz",
        f"http://{metrics_host}:{config.metrics_port}/healthz",
    ]


def check(url: str, context: ssl.SSLContext) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S, context=context) as reply:
            if reply.status == 200:
                return True
            print(f"healthcheck: {url}: HTTP {reply.status}", file=sys.stderr)
    except (OSError, ValueError) as exc:
        print(f"healthcheck: {url}: {exc}", file=sys.stderr)
    return False


def main(argv: list[str]) -> int:
    try:
        urls = argv[1:] or gateway_urls(os.environ.get("IGW_CONFIG", DEFAULT_CONFIG))
    except Exception as exc:  # a config that cannot be read means not healthy
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return 0 if all([check(url, context) for url in urls]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
