"""A Prometheus text-format reader that looks only at the series a profile names.

A vLLM `/metrics` page is mostly histogram buckets, Python runtime and HTTP
server series the gateway never reads; a general parser (prometheus_client's)
tokenizes every one of those lines in Python. This one lets one compiled
regex find, in C, the lines that start with a wanted name, and parses only
those, so the Python work grows with the handful of wanted series rather than
with the page. It assumes nothing about the order or grouping of families.

Garbage never crashes the collector and never yields half-trusted numbers: a
wanted line that does not parse, or a page without the required signals (an
HTML error page, a truncated body), raises `MetricsParseError`, which the
collector records as a failed scrape.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from picker.datalayer.engines import (
    INFO_SIGNALS,
    Aggregate,
    EngineProfile,
    Signal,
    aggregate_of,
    split_key,
)


class MetricsParseError(ValueError):
    """A scrape body that cannot be trusted; counts as a failed scrape."""


@dataclass(frozen=True)
class LoraInfo:
    """vLLM's `lora_requests_info`: which adapters run and wait, and the slot count."""

    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    max_lora: float = 0.0


@dataclass
class MetricsSnapshot:
    """One scrape, in signals: `values` holds every numeric signal that was present."""

    values: dict[Signal, float] = field(default_factory=dict)
    lora: LoraInfo | None = None

    def get(self, signal: Signal, default: float = math.nan) -> float:
        return self.values.get(signal, default)


class SnapshotBuilder:
    """Folds series (from a page or a PromQL answer) into one snapshot.

    Shared by the text parser and the Prometheus source so both resolve
    preferred names, several series of one name and info gauges the same way.
    """

    __slots__ = ("_cache_done", "_lora_stamp", "_rank", "lora", "profile", "values")

    def __init__(self, profile: EngineProfile) -> None:
        self.profile = profile
        self.values: dict[Signal, float] = {}
        self._rank: dict[Signal, int] = {}
        self.lora: LoraInfo | None = None
        self._lora_stamp = -math.inf
        self._cache_done = False

    def add(self, name: str, value: float) -> None:
        """One sample of a plain series; NaN and ±Inf carry nothing usable and are dropped."""
        if not math.isfinite(value):
            return
        signal = self.profile.names[name]
        rank = self.profile.rank[name]
        held = self._rank.get(signal)
        if held is None or rank < held:
            self.values[signal] = value
            self._rank[signal] = rank
        elif rank == held:
            self.values[signal] = _combine(aggregate_of(signal), self.values[signal], value)

    def add_info(self, name: str, labels: dict[str, str], value: float) -> None:
        """One sample of an info gauge, whose facts are in its labels."""
        signal = self.profile.names[name]
        if signal is Signal.LORA_INFO:
            # vLLM keeps one series per label combination ever seen; its value
            # is the time it was set, so the largest value is the current state
            if math.isfinite(value) and value > self._lora_stamp:
                self._lora_stamp = value
                self.lora = lora_from_labels(labels)
        elif signal is Signal.CACHE_INFO and not self._cache_done:
            self._cache_done = True
            size_label, blocks_label = self.profile.cache_labels
            for label, target in ((size_label, Signal.KV_BLOCK_SIZE),
                                  (blocks_label, Signal.KV_NUM_BLOCKS)):
                number = _float_or_nan(labels.get(label, ""))
                if math.isfinite(number) and target not in self.values:
                    self.values[target] = number

    def build(self) -> MetricsSnapshot:
        missing = [s.value for s in self.profile.required if s not in self.values]
        if missing:
            raise MetricsParseError(f"missing required series: {', '.join(sorted(missing))}")
        return MetricsSnapshot(values=self.values, lora=self.lora)


def _combine(how: Aggregate, held: float, value: float) -> float:
    if how is Aggregate.MAX:
        return max(held, value)
    if how is Aggregate.FIRST:
        return held
    return held + value


def _float_or_nan(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def _split_adapters(text: str) -> tuple[str, ...]:
    return tuple(a for a in (part.strip() for part in text.split(",")) if a)


def lora_from_labels(labels: dict[str, str]) -> LoraInfo:
    """Adapters are comma-joined in one label; `max_lora` is the adapter slot count."""
    max_lora = _float_or_nan(labels.get("max_lora", ""))
    return LoraInfo(
        running=_split_adapters(labels.get("running_lora_adapters", "")),
        waiting=_split_adapters(labels.get("waiting_lora_adapters", "")),
        max_lora=max_lora if math.isfinite(max_lora) else 0.0,
    )


_LABEL_RE = re.compile(
    r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"[ \t]*(,|$)')
_ESCAPE_RE = re.compile(r"\\(.)")


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return _ESCAPE_RE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse_labels(text: str) -> dict[str, str]:
    """The inside of `{...}`: `a="x",b="y\\"z"` with escaped quotes, backslashes, newlines."""
    labels: dict[str, str] = {}
    pos, end = 0, len(text.rstrip(" \t"))
    while pos < end:
        match = _LABEL_RE.match(text, pos, end)
        if match is None:
            raise MetricsParseError(f"bad label set {{{text[:80]}}}")
        labels[match.group(1)] = _unescape(match.group(2))
        pos = match.end()
        if not match.group(3) and pos < end:
            raise MetricsParseError(f"bad label set {{{text[:80]}}}")
    return labels


def _common_prefix(names: list[str]) -> str:
    """Longest string every name starts with (character-wise, e.g. `vllm:`)."""
    first, last = min(names), max(names)
    size = 0
    while size < min(len(first), len(last)) and first[size] == last[size]:
        size += 1
    return first[:size]


_PLAIN, _INFO, _SELECTED = "plain", "info", "selected"


class MetricsParser:
    """Reads the series of one engine profile out of exposition text.

    One compiled regex finds every line that starts with exactly a wanted
    name: a literal "\n" + the names' common prefix lets the regex engine skip
    through the page in C, so only the wanted lines reach Python.
    """

    def __init__(self, profile: EngineProfile) -> None:
        self.profile = profile
        # one lookup per wanted line says how to read it: plain, info gauge, or label-selected
        self._kind = {name: _INFO if signal in INFO_SIGNALS else _PLAIN
                      for name, signal in profile.series if split_key(name)[1] is None}
        self._kind.update((family, _SELECTED) for family in profile.selected)
        names = sorted(self._kind, key=len, reverse=True)
        common = _common_prefix(names)
        alternatives = "|".join(re.escape(n[len(common):]) for n in names)
        names_re = rf"({re.escape(common)}(?:{alternatives}))(?=[{{ \t\r\n]|\Z)"
        self._first = re.compile(names_re)  # a wanted series on the very first line
        self._rest = re.compile(r"\n" + names_re)

    def parse(self, text: str) -> MetricsSnapshot:
        """Every wanted series in `text`; raises `MetricsParseError` on garbage."""
        builder = SnapshotBuilder(self.profile)
        head = self._first.match(text)
        if head is not None:
            self._line(text, 0, head.group(1), builder)
        for match in self._rest.finditer(text):
            self._line(text, match.start(1), match.group(1), builder)
        return builder.build()

    def _line(self, text: str, start: int, name: str, builder: SnapshotBuilder) -> None:
        """Parse the sample line of `name` that starts at `start`."""
        eol = text.find("\n", start)
        if eol < 0:
            eol = len(text)
        after = start + len(name)
        if after < eol and text[after] == "{":
            close = text.rfind("}", after, eol)
            if close < 0:
                raise MetricsParseError(f"unterminated labels on {name}")
            labels_text = text[after + 1 : close]
            rest = text[close + 1 : eol]
        else:
            labels_text = ""
            rest = text[after:eol]
        value = _sample_value(rest, name)
        kind = self._kind[name]
        if kind is _PLAIN:
            builder.add(name, value)
        elif kind is _INFO:
            builder.add_info(name, parse_labels(labels_text), value)
        else:
            key = self.profile.key_of(name, parse_labels(labels_text))
            if key is not None:  # other label values of the family are not wanted
                builder.add(key, value)


def _sample_value(rest: str, name: str) -> float:
    """`value [timestamp]` after the name/labels; float() takes +Inf, -Inf and NaN."""
    parts = rest.split()
    if not parts or len(parts) > 2:
        raise MetricsParseError(f"bad sample on {name}: {rest.strip()[:40]!r}")
    try:
        return float(parts[0])
    except ValueError:
        raise MetricsParseError(f"bad value on {name}: {parts[0][:40]!r}") from None


_PARSERS: dict[str, MetricsParser] = {}


def parser_for(profile: EngineProfile) -> MetricsParser:
    """Parsers are stateless after construction; one per profile is shared."""
    parser = _PARSERS.get(profile.name)
    if parser is None or parser.profile is not profile:
        parser = _PARSERS[profile.name] = MetricsParser(profile)
    return parser


def parse_metrics(text: str, profile: EngineProfile) -> MetricsSnapshot:
    """Convenience: parse `text` with the shared parser for `profile`."""
    return parser_for(profile).parse(text)
