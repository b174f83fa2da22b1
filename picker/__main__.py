"""`python -m picker --config FILE --state-dir DIR`: the picker process alone.

`igw serve` runs this under its supervisor next to Envoy.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from picker.app import PickerApp
from picker.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picker")
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--host", default="127.0.0.1", help="address the gRPC/metrics ports bind")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
    try:
        app = PickerApp(args.config, args.state_dir, host=args.host)
    except ConfigError as exc:
        print(f"picker: invalid config: {exc}", file=sys.stderr)
        return 2
    asyncio.run(app.run_until_signalled())
    return 0


if __name__ == "__main__":
    sys.exit(main())
