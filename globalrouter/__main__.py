"""`python -m globalrouter --config FILE`: the global router process alone.

`igw global serve` runs this under its supervisor next to the global Envoy.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from contract.config import ConfigError
from globalrouter.app import GlobalRouterApp
from picker.__main__ import _loop_factory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m globalrouter")
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--host", default="127.0.0.1", help="address its ports bind")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
    try:
        app = GlobalRouterApp(args.config, host=args.host)
    except ConfigError as exc:
        print(f"globalrouter: invalid config: {exc}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(app.run_until_signalled())
    return 0


if __name__ == "__main__":
    sys.exit(main())
