"""Scorers, one module each; importing this package registers them all by name."""

from picker.scheduling.scorers import (
    inflight,
    kv_cache,
    latency,
    lora,
    lru,
    prefix,
    queue,
    running,
)

__all__ = ["inflight", "kv_cache", "latency", "lora", "lru", "prefix", "queue", "running"]
