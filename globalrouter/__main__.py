"""`python -m globalrouter --config FILE`: the global router process alone.

`igw global serve` runs this under its supervisor next to the global Envoy.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from globalrouter.app import GlobalRouterApp
from picker.__main__ import run_process


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m globalrouter")
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--host", default="127.0.0.1", help="address its ports bind")
    parser.add_argument(
        "--metrics-host", default=os.environ.get("IGW_METRICS_HOST"),
        help="address the HTTP port (/metrics, /regions) binds (default: --host; env "
        "IGW_METRICS_HOST), e.g. 0.0.0.0 so an in-cluster Prometheus can scrape it")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    return run_process("globalrouter", args.log_level, lambda: GlobalRouterApp(
        args.config, host=args.host, metrics_host=args.metrics_host))

if __name__ == "__main__":
    sys.exit(main())
