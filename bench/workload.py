"""Requests of a scenario, generated up front from a seed: arrival times, prompts, bodies.

Everything a router run sends is decided before the run starts, so every router sees the
very same sequence (same arrival times, same prompts, same output lengths) and a slow
router cannot slow the arrivals down. Prompts are slices of a seeded random word corpus,
so no two requests share a prefix by accident; shared system prompts are the only
intended prefixes. The simulator counts 4 characters per token (docs/simulator.md), so a
prompt of N tokens is 4N characters.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

import orjson

CHARS_PER_TOKEN = 4
_VOCAB_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "so what out up more who can said will no about into them some could him time only "
    "other then its two may these first any new like our over such also most after where "
    "model token cache router latency request server prompt system answer query vector "
    "index graph policy cluster node queue stream batch kernel memory tensor weight layer "
    "data table field value record report result review summary question context document"
)
_VOCAB = tuple(_VOCAB_TEXT.split())


@dataclass(frozen=True)
class RequestSpec:
    """One request of a run: when (model seconds after the start), what, and its label."""

    index: int
    at: float
    model: str  # the body's "model" (an adapter name for LoRA requests)
    pool: str  # base model whose pool serves it (picks the router URL for per-pool routers)
    body: bytes
    prompt_tokens: int
    max_tokens: int
    group: str = ""  # e.g. the system prompt or adapter it uses, for breakdowns
    shared_prefix_tokens: int = 0  # leading tokens shared with other requests (system prompt)


class Corpus:
    """A long random word text; prompts are slices of it at random offsets."""

    def __init__(self, rng: random.Random, chars: int = 2_000_000) -> None:
        words: list[str] = []
        size = 0
        while size < chars:
            w = rng.choice(_VOCAB)
            words.append(w)
            size += len(w) + 1
        self.text = " ".join(words)
        self.rng = rng

    def text_of(self, tokens: int) -> str:
        n = max(1, tokens) * CHARS_PER_TOKEN
        if n >= len(self.text):
            reps = n // len(self.text) + 1
            return (self.text * reps)[:n]
        start = self.rng.randrange(0, len(self.text) - n)
        return self.text[start : start + n]


def lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    """A clipped log-normal integer (request lengths in production traces are heavy-tailed)."""
    return int(min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))))


def lognormal_mean(median: float, sigma: float) -> float:
    """Mean of the unclipped log-normal (close enough for calibration)."""
    return median * math.exp(sigma * sigma / 2)


def poisson_arrivals(rng: random.Random, rate: float, start: float, end: float) -> Iterator[float]:
    """Arrival times of a Poisson process of `rate` per second in [start, end)."""
    if rate <= 0:
        return
    t = start + rng.expovariate(rate)
    while t < end:
        yield t
        t += rng.expovariate(rate)


def on_off_arrivals(
    rng: random.Random,
    *,
    rate_on: float,
    rate_off: float,
    on_s: float,
    off_s: float,
    duration: float,
) -> list[float]:
    """Bursts: Poisson at rate_off for off_s, then rate_on for on_s, repeated.

    The run starts with an off phase so the first burst meets a fleet already serving
    background traffic, as a real burst would.
    """
    times: list[float] = []
    t = 0.0
    while t < duration:
        off_end = min(duration, t + off_s)
        times.extend(poisson_arrivals(rng, rate_off, t, off_end))
        on_end = min(duration, off_end + on_s)
        times.extend(poisson_arrivals(rng, rate_on, off_end, on_end))
        t = on_end
    return times


def chat_body(
    model: str,
    user: str,
    max_tokens: int,
    system: str | None = None,
) -> bytes:
    """An OpenAI chat body, streamed, with the usage chunk at the end."""
    messages = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": user})
    return orjson.dumps(
        {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


def chat_prompt_tokens(user: str, system: str | None = None) -> int:
    """Tokens the simulator counts for this chat (role markers included)."""
    chars = len(f"<|user|>\n{user}\n<|assistant|>\n")
    if system is not None:
        chars += len(f"<|system|>\n{system}\n")
    return math.ceil(chars / CHARS_PER_TOKEN)
