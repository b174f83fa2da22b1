"""Writing a snapshot into a pool row, and deciding which rows are fresh.

The only place that knows which datastore columns a scrape fills, so the
direct collector and the Prometheus source write exactly the same thing.
Everything here is synchronous and never awaits: a row is written whole
between two awaits, so the request path never sees half a scrape.
"""

from __future__ import annotations

import math

import numpy as np

from picker.datalayer.engines import Signal, profile_for
from picker.datalayer.parser import MetricsSnapshot
from picker.datalayer.speed import RAW_COLUMNS, SpeedLearner
from picker.datastore import Pool

# A decode step for the gauges' lag where none is learned yet: a large model's, under load.
GAUGE_STEP_S = 0.05

# snapshot signal → column; an absent optional gauge is written as 0 (unknown)
GAUGE_COLUMNS: tuple[tuple[Signal, str], ...] = (
    (Signal.WAITING, "waiting"),
    (Signal.RUNNING, "running"),
    (Signal.KV_USAGE, "kv_usage"),
    (Signal.KV_BLOCK_SIZE, "kv_block_size"),
    (Signal.KV_NUM_BLOCKS, "kv_num_blocks"),
)
# The load gauges `_date_gauges` watches: a setting of them nearly always moves the KV share.
LOAD_GAUGES = GAUGE_COLUMNS[:3]
WRITTEN_COLUMNS = (
    "waiting", "running", "kv_usage", "max_lora", "kv_block_size", "kv_num_blocks",
    "lora_running", "lora_waiting",  # (rows, MAX_ADAPTERS) bool matrices
    "prefill_tps", "prefill_tps_uncached", "decode_step_s", "ttft_s", "queue_s", "iteration_s",
    *RAW_COLUMNS,
    "pending_cache_queries", "pending_cache_hits", "prompt_tokens_total",
    "engine_steps", "gauge_age_s", "prefill_unmeasured",
    # through Pool.mark_scrape (which also zeroes `dispatched` on a good scrape)
    "scraped_at", "scrape_failures", "metrics_ok",
)


def write_snapshot(pool: Pool, row: int, snapshot: MetricsSnapshot, learner: SpeedLearner,
                   now: float) -> None:
    """Fill `row` from a good scrape taken at monotonic time `now`, then mark it ok."""
    table = pool.table
    values = snapshot.values
    profile = profile_for(pool.config.engine_type)
    _date_gauges(pool, row, snapshot, profile.gauge_steps, now)
    for signal, column in GAUGE_COLUMNS:
        getattr(table, column)[row] = values.get(signal, 0.0)
    # NaN, not 0, when absent: the scheduler's prefill backlog must tell "no counter"
    # from "nothing prefilled yet"
    table.prompt_tokens_total[row] = values.get(Signal.PROMPT_TOKENS, math.nan)
    table.engine_steps[row] = values.get(Signal.ITERATIONS,
                                         values.get(Signal.GENERATION_TOKENS, math.nan))
    table.prefill_unmeasured[row] = not profile.measures_prefill
    _write_lora(pool, row, snapshot)
    learner.update(table, row, snapshot, now)
    pool.mark_scrape(row, True, now=now)


def _date_gauges(pool: Pool, row: int, snapshot: MetricsSnapshot, steps: int,
                 now: float) -> None:
    """`gauge_age_s`: how long before this scrape, at the most, the engine set the gauges
    it reads.

    Live gauges (vLLM, Triton as simulated): 0. SGLang's scheduler sets them at a prefill
    batch and every `gauge_steps` decode steps, so a scrape may show the batch before the
    gateway's last sends, with nothing waiting while a request waits for an adapter slot
    (family-0-97: 3 adapter slots learned on pods of 2). While the engine decodes they are
    at most `gauge_steps` steps old; values that differ from the last scrape's were set
    after it. Read before the row is overwritten."""
    table = pool.table
    if not steps:
        table.gauge_age_s[row] = 0.0
        return
    step = table.decode_step_s[row]
    age = steps * (step if step > 0 else GAUGE_STEP_S)
    last = float(table.scraped_at[row])
    if table.metrics_ok[row] and now > last:
        values = snapshot.values
        changed = any(getattr(table, column)[row] != values.get(signal, 0.0)
                      for signal, column in LOAD_GAUGES)
        # unchanged values were set no earlier than the last scrape's bound
        age = min(age, now - (last if changed else last - table.gauge_age_s[row]))
    table.gauge_age_s[row] = max(age, 0.0)


def write_outcome(pool: Pool, row: int, snapshot: MetricsSnapshot | None, learner: SpeedLearner,
                  now: float) -> None:
    """One scrape's outcome at monotonic time `now`: a good one (`snapshot`) fills the row,
    a failed one (None) marks it not ok and keeps its last numbers. The one path for a
    local scrape and for another replica's shared result (picker.coordination.scrapes),
    so a row fed by either is filled the same way."""
    if snapshot is None:
        pool.mark_scrape(row, False)
    else:
        write_snapshot(pool, row, snapshot, learner, now)


def _write_lora(pool: Pool, row: int, snapshot: MetricsSnapshot) -> None:
    """Adapters the pool knows (config `loraAdapters`) get their slot's bit set.

    Lookup only, never `adapter_slot()`: adapters a pod reports but no request
    can name must not use up the pool's fixed slots; a config reload that adds
    an adapter allocates its slot and the next scrape fills it.
    """
    table = pool.table
    running = table.lora_running[row]
    waiting = table.lora_waiting[row]
    running[:] = False
    waiting[:] = False
    lora = snapshot.lora
    table.max_lora[row] = lora.max_lora if lora is not None else 0.0
    if lora is None:
        return
    index = pool.adapter_index
    for name in lora.running:
        slot = index.get(name)
        if slot is not None:
            running[slot] = True
    for name in lora.waiting:
        slot = index.get(name)
        if slot is not None:
            waiting[slot] = True


def fresh_mask(pool: Pool, now: float) -> np.ndarray:
    """Rows whose numbers can be trusted at monotonic time `now`.

    valid & ready & metrics_ok & (now - scraped_at <= stale_after_s): a pod
    whose last scrape failed, or whose last good scrape is too old, drops out
    until a scrape succeeds again.
    """
    t = pool.table
    stale_after = pool.config.metrics.stale_after_s
    return t.valid & t.ready & t.metrics_ok & ((now - t.scraped_at) <= stale_after)


def row_age(pool: Pool, row: int, now: float) -> float:
    """Seconds since the row's last good scrape; inf if it never had one."""
    scraped_at = float(pool.table.scraped_at[row])
    return math.inf if scraped_at <= 0 else now - scraped_at
