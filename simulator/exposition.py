"""Prometheus text exposition: the one writer of every engine `/metrics` page here.

The simulator's pods (metrics_text.py) and the stand-in pages the data layer's tests
and benchmark control (standin_pages.py) both write their lines through `Page`, so a
float, an escaped label value or a histogram ladder is spelled one way: the way
prometheus_client spells it (floats by `repr`, `NaN`, `+Inf`, `-Inf`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

_SPECIAL = {"nan": "NaN", "inf": "+Inf", "-inf": "-Inf"}


def fmt(value: float) -> str:
    """A sample value or bucket bound as prometheus_client writes it."""
    text = repr(float(value))
    return _SPECIAL.get(text, text)


def fmt_integral(value: float) -> str:
    """A sample value as prometheus-cpp (Triton's exporter) writes it: integral values
    without a decimal point (`6239`, `1700074049`), others as floats (`0.4875`)."""
    value = float(value)
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return fmt(value)


def escape(value: str) -> str:
    """A label value with backslash, double quote and newline escaped."""
    if "\\" not in value and '"' not in value and "\n" not in value:
        return value  # the common case, checked first: pages are written 20 times a second
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def label_text(labels: dict[str, str]) -> str:
    """`k="v",k2="v2"` in the dict's order (no braces; empty for no labels)."""
    return ",".join([f'{key}="{escape(value)}"' for key, value in labels.items()])


def _line(name: str, labels: str, value: float) -> str:
    text = repr(float(value))  # fmt(), inlined: most lines of a page come through here
    text = _SPECIAL.get(text, text)
    return f"{name}{{{labels}}} {text}" if labels else f"{name} {text}"


class Page:
    """The lines of one page; `labels` arguments are `label_text` strings."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def head(self, name: str, kind: str, doc: str) -> None:
        self.lines.append(f"# HELP {name} {doc}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: str, value: float) -> None:
        self.lines.append(_line(name, labels, value))

    def metric(self, name: str, kind: str, doc: str, labels: str, value: float) -> None:
        """HELP, TYPE and the sample of a one-series metric, in one step (the hot path)."""
        self.lines += (f"# HELP {name} {doc}", f"# TYPE {name} {kind}", _line(name, labels, value))

    def histogram_series(self, name: str, labels: str, bounds: Sequence[float],
                         cumulative: Sequence[float], total: float, *,
                         le_first: bool = False) -> None:
        """Buckets (`cumulative` ends with the +Inf bucket, the count), `_count`, `_sum`.

        `le_first` puts `le` before the other labels (the simulator's order) rather
        than after them (prometheus_client's).
        """
        for bound, count in zip((*bounds, math.inf), cumulative, strict=True):
            le = f'le="{fmt(bound)}"'
            both = f"{le},{labels}" if le_first else (f"{labels},{le}" if labels else le)
            self.sample(f"{name}_bucket", both, count)
        self.sample(f"{name}_count", labels, cumulative[-1])
        self.sample(f"{name}_sum", labels, total)

    def histogram_sorted(self, name: str, before: str, after: str, bounds: Sequence[float],
                         cumulative: Sequence[float], total: float) -> None:
        """Like `histogram_series`, with `le` between the `before` and `after` label texts:
        prometheus_client sorts label names, so `le` lands where it sorts
        (`engine="0",le="1.0",model_name="m"` on a vLLM page)."""
        head = f"{before}," if before else ""
        tail = f",{after}" if after else ""
        labels = ",".join(part for part in (before, after) if part)
        for bound, count in zip((*bounds, math.inf), cumulative, strict=True):
            self.sample(f"{name}_bucket", f'{head}le="{fmt(bound)}"{tail}', count)
        self.sample(f"{name}_count", labels, cumulative[-1])
        self.sample(f"{name}_sum", labels, total)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"
