"""`python -m picker --config FILE --state-dir DIR`: the picker process alone.

`igw serve` runs this under its supervisor next to Envoy.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contract.config import ConfigError
from picker.app import PickerApp


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed: fewer syscalls per gRPC message on the request path."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picker")
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--host", default="127.0.0.1", help="address the gRPC ports bind")
    parser.add_argument(
        "--metrics-host",
        default=os.environ.get("IGW_METRICS_HOST"),
        help="address the Prometheus /metrics port binds (default: --host; "
        "env IGW_METRICS_HOST), e.g. 0.0.0.0 so an in-cluster Prometheus can scrape it",
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    return run_process(
        "picker",
        args.log_level,
        lambda: PickerApp(
            args.config, args.state_dir, host=args.host, metrics_host=args.metrics_host
        ),
    )


def run_process(prog: str, log_level: str, make_app: Callable[[], Any]) -> int:
    """Structured logs, the app built (a bad config: exit 2 with its one-line error), then
    its `run_until_signalled` on uvloop when installed: the picker's and the global
    router's process alike."""
    logging.basicConfig(
        level=log_level.upper(),
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
    try:
        app = make_app()
    except ConfigError as exc:
        print(f"{prog}: invalid config: {exc}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(app.run_until_signalled())
    return 0


if __name__ == "__main__":
    sys.exit(main())
