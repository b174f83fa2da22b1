"""Fault state of one pod and the validation of fault updates.

The same JSON object configures faults at start-up (fleet spec ``faults:``), at run time
(``POST /admin/faults`` on the pod, ``POST /pods/{name}/faults`` on the control port), and is
what ``GET /admin/faults`` returns. Updates are partial: fields left out keep their value.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields
from typing import Any

METRICS_MODES = ("ok", "down", "garbled", "closed")
ERROR_STATUSES = (500, 503)


class FaultError(ValueError):
    """An invalid fault update (the admin endpoint answers 400 with this message)."""


@dataclass
class FaultState:
    """What is currently broken on a pod."""

    unhealthy: bool = False  # /health answers 503
    error_status: int | None = None  # inference answers this status ...
    error_rate: float = 0.0  # ... for this share of requests
    slowdown: float = 1.0  # every engine iteration takes this many times longer
    hang: bool = False  # accept requests and never answer until cleared
    metrics: str = "ok"  # /metrics: ok, down (503), garbled (invalid text), closed (no reply)
    crash: bool = False  # listener closed: connections refused

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def update(self, changes: Any) -> None:
        """Apply a partial update after validating all of it (all or nothing)."""
        if not isinstance(changes, dict):
            raise FaultError("faults must be a JSON object")
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise FaultError(f"unknown fault field(s): {', '.join(unknown)}")
        merged = {**self.as_dict(), **{k: _validate(k, v) for k, v in changes.items()}}
        if "error_status" in changes and "error_rate" not in changes:
            merged["error_rate"] = 1.0 if changes["error_status"] is not None else 0.0
        for key, value in merged.items():
            setattr(self, key, value)

    def failure_status(self, rng: random.Random) -> int | None:
        """The error status this request gets, or None to serve it."""
        if self.error_rate <= 0.0 or rng.random() >= self.error_rate:
            return None
        return self.error_status or 500


def _validate(key: str, value: Any) -> Any:
    if key in ("unhealthy", "hang", "crash"):
        if not isinstance(value, bool):
            raise FaultError(f"{key} must be true or false")
        return value
    if key == "error_status":
        if value is not None and value not in ERROR_STATUSES:
            raise FaultError("error_status must be 500, 503 or null")
        return value
    if key == "metrics":
        if value not in METRICS_MODES:
            raise FaultError(f"metrics must be one of {', '.join(METRICS_MODES)}")
        return value
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise FaultError(f"{key} must be a number")
    if key == "error_rate" and not 0.0 <= value <= 1.0:
        raise FaultError("error_rate must be between 0 and 1")
    if key == "slowdown" and value < 1.0:
        raise FaultError("slowdown must be >= 1")
    return float(value)
