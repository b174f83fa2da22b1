"""Where a benchmark's figures go: `<stem>.json` (raw, for later re-rendering) and
`<stem>.md` (the table a reader opens) in the results folder, and the table on stdout."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any


def utc_stamp() -> str:
    """When a result was measured, as every results file and report states it."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def write_results(out: Path, stem: str, doc: dict[str, Any], text: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    (out / f"{stem}.md").write_text(text)
    print(text)
