"""When is a pod, and a whole pool, too busy to take another request right now?

A pod is saturated when the engine's waiting queue (as last scraped) reaches
`saturation.queueThreshold`, or its KV-cache usage
reaches `saturation.kvCacheThreshold`. The pool is saturated when every
candidate pod (ready, not draining, fresh metrics) is. A threshold of 0
disables the queue test. With no fresh pod the pool is *not* called saturated:
saturation is unknown then, and holding requests in the gateway on no
evidence is worse than letting the engines queue them.
"""

from __future__ import annotations

import numpy as np

from picker.datastore import Pool


def saturated_pods(pool: Pool) -> np.ndarray:
    """Boolean per table row: the pod is past a saturation threshold (any row, even invalid)."""
    t = pool.table
    cfg = pool.config.saturation
    full = t.kv_usage >= cfg.kv_cache_threshold
    if cfg.queue_threshold > 0:
        # The engine's own waiting count only. Requests sent since the last scrape
        # are mostly *running* on a pod with free slots; counting them as waiting
        # marked a fast pod saturated at `queueThreshold` in-flight requests per
        # scrape interval (measured: a 157 req/s ceiling at 32 connections).
        full |= t.waiting >= cfg.queue_threshold
    return full


def candidate_pods(pool: Pool, now: float) -> np.ndarray:
    """Boolean per table row: ready, not draining, metrics fresh (the pick's base filters)."""
    t = pool.table
    max_age = pool.config.metrics.stale_after_s
    return t.valid & t.ready & ~t.draining & t.metrics_ok & (t.scraped_at >= now - max_age)


def pool_saturated(pool: Pool, now: float) -> bool:
    """True when every candidate pod is saturated (and there is at least one)."""
    candidates = candidate_pods(pool, now)
    if not candidates.any():
        return False
    return not (candidates & ~saturated_pods(pool)).any()
