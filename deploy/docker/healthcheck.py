"""Container health check: exit 0 when a URL answers 200 within the timeout.

    python /opt/igw/healthcheck.py [URL]

URL defaults to $IGW_HEALTH_URL (the image sets the gateway's
https://127.0.0.1:8443/healthz). The gateway's certificate is self-signed by
default and the check only talks to its own container, so it is not verified.
Standard library only: the image has no curl.
"""

from __future__ import annotations

import os
import ssl
import sys
import urllib.request

TIMEOUT_S = 2.5


def main(argv: list[str]) -> int:
    url = argv[1] if len(argv) > 1 else os.environ.get("IGW_HEALTH_URL", "")
    if not url:
        print("healthcheck: no URL (argument or IGW_HEALTH_URL)", file=sys.stderr)
        return 1
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S, context=context) as reply:
            return 0 if reply.status == 200 else 1
    except (OSError, ValueError) as exc:
        print(f"healthcheck: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
