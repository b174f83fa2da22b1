"""Per-pod speed, learned from the engine's own counters between two scrapes.

Histogram `_sum`/`_count` pairs and token counters only ever grow, so the
difference between two scrapes describes exactly the requests that finished
in between: their mean TTFT, their prefill speed, their time per output
token. Each window's figure is folded into an EWMA whose weight grows with the
number of observations in the window, so a window with one request nudges
the estimate and a window with fifty moves it most of the way.

An estimate also expires: when observations arrive after more than
`SPEED_STALE_S` without any (the pod got no requests, e.g. because it was
slow), they replace the old estimate instead of nudging it, so a pod that
recovered is re-learned from its first requests instead of staying "slow" for
good. A shorter gap changes nothing.

Counters restart from zero when a pod restarts; like Prometheus' `rate()`, a
decrease is read as a reset and the new value is the whole delta since then,
so a restart never yields a negative or huge rate. Everything here is a small
pure function over floats; `SpeedLearner` applies them to one pool row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from picker.datalayer.engines import Signal
from picker.datalayer.parser import MetricsSnapshot
from picker.datastore import SPEED_STALE_S, PodTable

DEFAULT_ALPHA = 0.1  # weight of one observation


def counter_deltas(current: tuple[float, ...], previous: tuple[float, ...]) -> tuple[float, ...]:
    """Growth of related counters since the last scrape, reset-aware as a group.

    If any of them went down the pod restarted, and every counter of the group
    restarted with it: the current values are then the whole growth.
    """
    if restarted(current, previous):
        return current
    return tuple(c - p for c, p in zip(current, previous, strict=True))


def restarted(current: tuple[float, ...], previous: tuple[float, ...]) -> bool:
    """A group of counters went down: the pod restarted since `previous` was read."""
    return any(c < p for c, p in zip(current, previous, strict=True))


def window_mean(delta_sum: float, delta_count: float) -> float | None:
    """Mean of the observations made in the window, or None if there were none."""
    if delta_count <= 0 or delta_sum < 0 or not math.isfinite(delta_sum):
        return None
    return delta_sum / delta_count


def prefill_rate(delta_tokens: float, delta_seconds: float) -> float | None:
    """Prompt tokens per second of prefill, or None if the window holds no prefill."""
    if delta_tokens <= 0 or delta_seconds <= 0:
        return None
    rate = delta_tokens / delta_seconds
    return rate if math.isfinite(rate) else None


def observation_weight(n: float, alpha: float = DEFAULT_ALPHA) -> float:
    """EWMA weight of a window holding `n` observations: 1 - (1 - alpha)^n."""
    if n <= 0:
        return 0.0
    return 1.0 - (1.0 - alpha) ** n


def forget_weight(gap_s: float) -> float:
    """Least weight of a new window after `gap_s` seconds without observations:
    1 (replace) once the old estimate has expired, else 0 (no effect)."""
    return 1.0 if gap_s > SPEED_STALE_S else 0.0


def ewma(previous: float, sample: float, weight: float) -> float:
    """Move `previous` towards `sample`; a pod without an estimate yet takes the sample."""
    if not previous > 0 or not math.isfinite(previous):
        return sample
    return previous + weight * (sample - previous)


@dataclass(frozen=True)
class _Estimate:
    """One learned column: which counters feed it and which raw columns keep them."""

    column: str
    raw_columns: tuple[str, ...]


TTFT = _Estimate("ttft_s", ("raw_ttft_sum", "raw_ttft_count"))
QUEUE = _Estimate("queue_s", ("raw_queue_sum", "raw_queue_count"))
DECODE = _Estimate("decode_step_s", ("raw_tpot_sum", "raw_tpot_count"))
PREFILL = _Estimate("prefill_tps", ("raw_prefill_sum", "raw_prefill_count", "raw_prefill_tokens"))
CACHE_HITS = _Estimate("prefill_tps_uncached", ("raw_cache_queries", "raw_cache_hits"))
# The step counter where it last moved, when, whether the pod was busy then, and the step
# length and the time between moves learned so far (`SpeedLearner._iterations`).
ITERATION_RAW_COLUMNS = ("raw_iterations", "raw_iterations_at", "raw_iterations_busy",
                         "raw_iteration_mean", "raw_iteration_gap")
RAW_COLUMNS = (*(c for e in (TTFT, QUEUE, DECODE, PREFILL, CACHE_HITS) for c in e.raw_columns),
               *ITERATION_RAW_COLUMNS)
# Weight of one new step-length sample: the step length is a load signal, so it follows
# the pod within a few samples rather than averaging over many.
ITERATION_ALPHA = 0.5


def _stored(table: PodTable, row: int, est: _Estimate) -> tuple[float, ...]:
    """The raw counter values of `est` kept from the row's previous scrape."""
    return tuple(float(getattr(table, c)[row]) for c in est.raw_columns)


def _present(snapshot: MetricsSnapshot, *signals: Signal) -> tuple[float, ...] | None:
    values = snapshot.values
    out = tuple(values.get(s, math.nan) for s in signals)
    return None if any(math.isnan(v) for v in out) else out


class SpeedLearner:
    """Updates a row's speed columns from a fresh snapshot; one per pool, stateless itself."""

    def __init__(self, alpha: float = DEFAULT_ALPHA) -> None:
        self.alpha = alpha

    def update(self, table: PodTable, row: int, snapshot: MetricsSnapshot,
               now: float | None = None) -> None:
        """Fold the window since the last scrape into the row; `now` (monotonic) enables
        forgetting by age (see the module docstring)."""
        seen = float(table.speed_seen_at[row])
        forget = forget_weight(now - seen) if now is not None and seen > 0 else 0.0
        observed = self._mean(table, row, TTFT,
                              _present(snapshot, Signal.TTFT_SUM, Signal.TTFT_COUNT), forget)
        observed |= self._mean(table, row, QUEUE,
                               _present(snapshot, Signal.QUEUE_TIME_SUM,
                                        Signal.QUEUE_TIME_COUNT), forget)
        observed |= self._mean(table, row, DECODE,
                               _present(snapshot, Signal.TPOT_SUM, Signal.TPOT_COUNT), forget)
        observed |= self._prefill(table, row, snapshot, forget)
        if observed and now is not None:
            table.speed_seen_at[row] = now
        if now is not None:
            self._iterations(table, row, snapshot, now)

    def _iterations(self, table: PodTable, row: int, snapshot: MetricsSnapshot,
                    now: float) -> None:
        """How long the engine's next step will take (`iteration_s`), from a step counter
        (TensorRT-LLM's iterations): time between two scrapes at which the counter moved,
        over its growth, folded into a quick EWMA; 0 while idle.

        TensorRT-LLM's page has no latency histogram and no token counter, so nothing else
        shows the work it holds: its scheduler admits every request it has room for into
        the next step (`waiting` stays near 0), and the load shows as longer steps, each
        carrying the admitted prompts' prefill and a longer batch. A request sent there
        waits for the step in progress and then shares the next. Read between moves of the
        counter, not between scrapes: Triton refreshes its metrics on its own interval
        (`--metrics-interval-ms`, 2 s by default), the counter stands still in between and
        a refresh's jump covers the time since the last one. Only while the pod was busy
        at both moves (`running` >= 1). A step still running longer than the usual time
        between moves (a long prefill, a stalled engine) counts at its length so far, so a
        pod that just took a burst does not look idle until its first step ends; within
        the usual time the counter may just not be refreshed yet.
        """
        current = snapshot.values.get(Signal.ITERATIONS, math.nan)
        if math.isnan(current):
            return
        busy = snapshot.values.get(Signal.RUNNING, 0.0) >= 1.0
        previous = float(table.raw_iterations[row])
        since = now - float(table.raw_iterations_at[row])
        anchored = table.raw_iterations_busy[row] > 0
        if busy and anchored and current == previous:  # no step ended that the page shows
            stalled = since - float(table.raw_iteration_gap[row])
            table.iteration_s[row] = max(float(table.raw_iteration_mean[row]), stalled)
            return
        if not busy:
            table.raw_iteration_mean[row] = 0.0
        elif anchored and current > previous:
            mean = ewma(float(table.raw_iteration_mean[row]), since / (current - previous),
                        ITERATION_ALPHA)
            table.raw_iteration_mean[row] = mean
            table.raw_iteration_gap[row] = ewma(float(table.raw_iteration_gap[row]), since,
                                                ITERATION_ALPHA)
        table.iteration_s[row] = table.raw_iteration_mean[row]
        table.raw_iterations[row] = current  # the new anchor (a decrease: a restart)
        table.raw_iterations_at[row] = now
        table.raw_iterations_busy[row] = 1.0 if busy else 0.0

    def _remember(self, table: PodTable, row: int, est: _Estimate,
                  current: tuple[float, ...]) -> tuple[float, ...]:
        """Swap the stored raw counters for `current`; returns the reset-aware deltas."""
        previous = _stored(table, row, est)
        for column, value in zip(est.raw_columns, current, strict=True):
            getattr(table, column)[row] = value
        return counter_deltas(current, previous)

    def _mean(self, table: PodTable, row: int, est: _Estimate,
              current: tuple[float, ...] | None, forget: float = 0.0) -> bool:
        if current is None:
            return False
        d_sum, d_count = self._remember(table, row, est, current)
        sample = window_mean(d_sum, d_count)
        if sample is None:
            return False
        column: np.ndarray = getattr(table, est.column)
        weight = max(observation_weight(d_count, self.alpha), forget)
        column[row] = ewma(float(column[row]), sample, weight)
        return True

    def _prefill(self, table: PodTable, row: int, snapshot: MetricsSnapshot,
                 forget: float = 0.0) -> bool:
        # prompt tokens of finished requests pair exactly with the prefill-time
        # histogram (both observed when a request finishes); the running token
        # counter is the fallback for engines without that histogram
        tokens = Signal.FINISHED_PROMPT_TOKENS
        if tokens not in snapshot.values:
            tokens = Signal.PROMPT_TOKENS
        current = _present(snapshot, Signal.PREFILL_TIME_SUM, Signal.PREFILL_TIME_COUNT, tokens)
        mean_prompt = None
        if current is None:
            current, mean_prompt = _derived_prefill(snapshot)
        if current is None:
            return False
        d_seconds, d_count, d_units = self._remember(table, row, PREFILL, current)
        if mean_prompt is not None:
            return self._priced(table, row, snapshot, d_seconds, d_count, mean_prompt, forget)
        uncached = self._uncached(table, row, snapshot, d_units)
        sample = prefill_rate(d_units, d_seconds)
        if sample is None:
            return False
        weight = max(observation_weight(d_count, self.alpha), forget)
        table.prefill_tps[row] = ewma(float(table.prefill_tps[row]), sample, weight)
        # at least a token per request: the engine recomputes a fully cached prompt's last
        fresh = prefill_rate(max(uncached, d_count), d_seconds)
        column = table.prefill_tps_uncached
        column[row] = ewma(float(column[row]), fresh if fresh is not None else sample, weight)
        return True

    def _priced(self, table: PodTable, row: int, snapshot: MetricsSnapshot, d_seconds: float,
                d_count: float, mean_prompt: float, forget: float) -> bool:
        """Fold a window that counts requests, not tokens (`_derived_prefill`): its
        requests and seconds join decayed sums, and the speed is those requests at the
        pod's latest mean prompt over those seconds.

        The mean prompt is of the requests that finished so far, a few at first: priced
        into each window as it came, an early one stayed in the estimate, and a pod read
        slow from one window got too few requests to correct it (family-0-9, fourteen
        SGLang L4s: 320 to 2,027 tokens/s, the slowest two took 3 and 10 of 300 requests
        and the rest a p95 10 % over round-robin's). Re-priced at every window, the kept
        windows follow the mean as more requests finish.
        """
        if d_count <= 0 or d_seconds <= 0:
            return False
        uncached = self._uncached(table, row, snapshot, d_count * mean_prompt)
        keep = 1.0 - max(observation_weight(d_count, self.alpha), forget)
        requests = table.prefill_requests_acc[row] * keep + d_count
        # at least a token per request: the engine recomputes a fully cached prompt's last
        fresh = table.prefill_fresh_acc[row] * keep + max(uncached, d_count) / mean_prompt
        seconds = table.prefill_seconds_acc[row] * keep + d_seconds
        table.prefill_requests_acc[row] = requests
        table.prefill_fresh_acc[row] = fresh
        table.prefill_seconds_acc[row] = seconds
        table.prefill_tps[row] = mean_prompt * requests / seconds
        table.prefill_tps_uncached[row] = mean_prompt * fresh / seconds
        return True

    def _uncached(self, table: PodTable, row: int, snapshot: MetricsSnapshot,
                  d_tokens: float) -> float:
        """How many of the window's `d_tokens` prompt tokens the engine had to compute:
        all of them on a page without prefix-cache counters.

        The engine's prompt-token counts include cached prefix tokens, which cost no
        prefill time; taken as they are, a pod serving hot system prompts read up to 3x
        faster than its identical neighbours and drew their work (family-0-95: three
        H100s learned at 17k, 52k and 56k tokens/s, the last taking 171 of 290 requests
        and the p95 tail). The cache counters move when a request is scheduled, its
        prompt tokens when its prefill (or, in vLLM's histogram, the request) ends: a
        later window. So lookups wait as pending until prompt tokens arrive, and each
        window's tokens take the hits of that share of the pending lookups (a share, not
        a count: vLLM 0.8 counts blocks in these counters, later versions tokens). A
        window's own hits, or a share over a decayed horizon, missed the one request a
        sparse pod gets between two idle gaps (family-1-40: an A10G read 8x its speed).
        """
        current = _present(snapshot, Signal.PREFIX_QUERIES, Signal.PREFIX_HITS)
        if current is None:
            return d_tokens
        if restarted(current, _stored(table, row, CACHE_HITS)):  # its lookups are gone
            table.pending_cache_queries[row] = table.pending_cache_hits[row] = 0.0
        d_queries, d_hits = self._remember(table, row, CACHE_HITS, current)
        queries = float(table.pending_cache_queries[row]) + max(d_queries, 0.0)
        hits = float(table.pending_cache_hits[row]) + max(d_hits, 0.0)
        if queries <= 0:
            return d_tokens
        keep = 1.0 - min(d_tokens / queries, 1.0)
        table.pending_cache_queries[row] = queries * keep
        table.pending_cache_hits[row] = hits * keep
        return d_tokens * (1.0 - min(hits / queries, 1.0))


def _derived_prefill(snapshot: MetricsSnapshot
                     ) -> tuple[tuple[float, float, float] | None, float | None]:
    """(prefill seconds, requests, prompt tokens or requests) as counters, and the mean
    prompt that prices the requests where the third counter counts requests (None where it
    counts tokens), for a page with no prefill-time histogram but TTFT and queue-time
    histograms (SGLang 0.5): a request's TTFT less its time in the queue is its prefill
    and first step, as vLLM's prefill-time histogram measures it. Each request adds TTFT
    >= queue time, so the difference of the two sums only grows, as a counter does.

    A prompt counter that grows at the first token pairs with those sums as it is. SGLang's
    grows when a request finishes, so a window's prompt tokens were other requests' than
    its first tokens (read so, alike L4s learned 0 to 4,089 tokens/s and the two fastest
    took two fifths of the traffic: family-0-9). There the window's first tokens count as
    that many requests (the third counter is TTFT's count) of the mean prompt of finished
    requests, the prompt counter over the end-to-end histogram's count: both are observed
    together (`SpeedLearner._priced`)."""
    mean_prompt = None
    if Signal.PROMPT_TOKENS in snapshot.values:
        tokens = Signal.PROMPT_TOKENS
    else:
        finished = _present(snapshot, Signal.FINISHED_PROMPT_TOKENS, Signal.FINISHED_REQUESTS)
        if finished is None or finished[1] <= 0 or finished[0] <= 0:
            return None, None
        tokens, mean_prompt = Signal.TTFT_COUNT, finished[0] / finished[1]
    present = _present(snapshot, Signal.TTFT_SUM, Signal.TTFT_COUNT, Signal.QUEUE_TIME_SUM,
                       Signal.QUEUE_TIME_COUNT, tokens)
    if present is None:
        return None, None
    ttft_sum, ttft_count, queue_sum, queue_count, counted = present
    if queue_count != ttft_count:  # not the same requests: no window to read
        return None, None
    return (max(ttft_sum - queue_sum, 0.0), ttft_count, counted), mean_prompt
