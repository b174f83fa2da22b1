"""Pools and their pods, with every per-pod signal in a preallocated numpy column.

One row per pod. Discovery adds and removes rows (off the request path); the
metrics collector writes scraped numbers into the rows in place; the request
path only reads columns and bumps the gateway's own counters. A pod that
leaves frees its row for the next one, so steady churn never reallocates, and
growth (doubling) happens only when discovery adds more pods than ever before.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from contract.config import GatewayConfig, SchedulerConfig
from contract.endpoints import resolve_endpoints

INITIAL_CAPACITY = 16
MAX_ADAPTERS = 64
# A learned speed not refreshed by any observation for this long is unknown: the
# scheduler gives the pod the pool median (so it gets requests again), and the speed
# learner takes the next observation as the new estimate (picker.datalayer.speed).
SPEED_STALE_S = 5.0

FLOAT_COLUMNS = (
    # scraped from the pod's /metrics
    "waiting",
    "running",
    "kv_usage",
    "max_lora",
    "scraped_at",
    "scrape_failures",
    # learned speed (see picker.datalayer.speed)
    "prefill_tps",
    "prefill_tps_uncached",  # the same, counting only prompt tokens not found cached
    "decode_step_s",
    "ttft_s",
    # how long the engine's next step will take while it is busy, from its step counter
    # (TensorRT-LLM's iterations); 0 while idle or unknown
    "iteration_s",
    # the gateway's own view, kept between scrapes
    "inflight",
    "dispatched",
    "outstanding_prefill",
    "outstanding_decode",
    "last_picked_at",
    "picks",
    # appended by the data layer (picker.datalayer): more scraped and learned signals
    "queue_s",
    "kv_block_size",
    "kv_num_blocks",
    # raw counter values at the previous scrape, for speed learning (picker.datalayer.speed)
    "raw_ttft_sum",
    "raw_ttft_count",
    "raw_queue_sum",
    "raw_queue_count",
    "raw_tpot_sum",
    "raw_tpot_count",
    "raw_prefill_sum",
    "raw_prefill_count",
    "raw_prefill_tokens",
    # where a page counts the requests of a prefill window but not their prompt tokens
    # (SGLang 0.5): decayed sums of those requests, of their uncached share in requests,
    # and of their prefill seconds, priced at the latest mean prompt (picker.datalayer.speed)
    "prefill_requests_acc",
    "prefill_fresh_acc",
    "prefill_seconds_acc",
    "raw_cache_queries",
    "raw_cache_hits",
    # the step counter where it last moved, when, whether the pod was busy then, and
    # the step length and time between moves learned from it
    "raw_iterations",
    "raw_iterations_at",
    "raw_iterations_busy",
    "raw_iteration_mean",
    "raw_iteration_gap",
    # prefix-cache lookups counted at scheduling whose prompt tokens were not counted yet
    "pending_cache_queries",
    "pending_cache_hits",
    # the engine's prompt-token counter (tokens whose prefill completed) as last scraped;
    # NaN when the engine does not publish it (picker.scheduling.state's prefill backlog)
    "prompt_tokens_total",
    # a counter that moves with the engine's steps as last scraped (iterations, else
    # tokens generated); NaN when the page has neither (PoolState.slot_limits)
    "engine_steps",
    # when a scrape last brought speed observations (picker.datalayer.speed forgets by it)
    "speed_seen_at",
    # how old the load gauges as last scraped may have been at that scrape (seconds): 0
    # where they are live; more where the engine sets them now and then (SGLang: at a
    # prefill batch and every 40th decode step; picker.datalayer.columns)
    "gauge_age_s",
)
BOOL_COLUMNS = (
    "valid", "ready", "draining", "metrics_ok",
    # the pod's engine exports no series a prefill speed is learned from (no TTFT or
    # prefill-time histogram, no prompt-token counter: Triton's TensorRT-LLM page); set by
    # each good scrape (picker.datalayer.columns)
    "prefill_unmeasured",
)


@dataclass
class Pod:
    """Identity of one row; the numbers live in the pool's columns."""

    address: str
    row: int
    name: str = ""
    labels: dict[str, str] = field(default_factory=dict)


class PodTable:
    """Column store: attribute per signal, each a float64 or bool array of `capacity`."""

    def __init__(self, capacity: int = INITIAL_CAPACITY) -> None:
        self.capacity = capacity
        for name in FLOAT_COLUMNS:
            setattr(self, name, np.zeros(capacity))
        for name in BOOL_COLUMNS:
            setattr(self, name, np.zeros(capacity, dtype=bool))
        self.lora_running = np.zeros((capacity, MAX_ADAPTERS), dtype=bool)
        self.lora_waiting = np.zeros((capacity, MAX_ADAPTERS), dtype=bool)

    def grow(self) -> None:
        """Double the capacity, keeping every row; only discovery calls this."""
        new = self.capacity * 2
        for name in (*FLOAT_COLUMNS, *BOOL_COLUMNS, "lora_running", "lora_waiting"):
            old = getattr(self, name)
            grown = np.zeros((new, *old.shape[1:]), dtype=old.dtype)
            grown[: self.capacity] = old
            setattr(self, name, grown)
        self.capacity = new

    def reset_row(self, row: int) -> None:
        for name in FLOAT_COLUMNS:
            getattr(self, name)[row] = 0.0
        for name in BOOL_COLUMNS:
            getattr(self, name)[row] = False
        self.lora_running[row] = False
        self.lora_waiting[row] = False


class Pool:
    """The pods serving one model (one scheduler entry of the config)."""

    def __init__(self, config: SchedulerConfig, capacity: int = INITIAL_CAPACITY) -> None:
        self.config = config
        self.table = PodTable(capacity)
        self.pods: dict[str, Pod] = {}
        self.row_address: list[str | None] = [None] * capacity
        self._free_rows: list[int] = list(range(capacity - 1, -1, -1))
        self.adapter_index: dict[str, int] = {}
        for adapter in config.lora_adapters:
            self.adapter_slot(adapter)
        self.version = 0

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def cluster_name(self) -> str:
        """Envoy cluster that holds this pool's members."""
        return f"pool_{self.config.name}"

    def adapter_slot(self, adapter: str) -> int | None:
        """Column of an adapter in the LoRA matrices; None once all slots are taken."""
        slot = self.adapter_index.get(adapter)
        if slot is None and len(self.adapter_index) < MAX_ADAPTERS:
            slot = self.adapter_index[adapter] = len(self.adapter_index)
        return slot

    def add_pod(self, address: str, name: str = "", labels: dict[str, str] | None = None) -> Pod:
        existing = self.pods.get(address)
        if existing is not None:
            return existing
        if not self._free_rows:
            old = self.table.capacity
            self.table.grow()
            self.row_address.extend([None] * (self.table.capacity - old))
            self._free_rows.extend(range(self.table.capacity - 1, old - 1, -1))
        row = self._free_rows.pop()
        self.table.reset_row(row)
        self.table.valid[row] = True
        self.table.ready[row] = True
        pod = Pod(address=address, row=row, name=name or address, labels=labels or {})
        self.pods[address] = pod
        self.row_address[row] = address
        self.version += 1
        return pod

    def remove_pod(self, address: str) -> None:
        pod = self.pods.pop(address, None)
        if pod is None:
            return
        self.table.reset_row(pod.row)
        self.row_address[pod.row] = None
        self._free_rows.append(pod.row)
        self.version += 1

    def set_members(
        self, addresses: Iterable[str], names: dict[str, str] | None = None
    ) -> bool:
        """Make the pod set exactly `addresses` (`ip:port`, the form Envoy's members
        have); `names` gives a display name per address. True when it changed."""
        wanted = list(dict.fromkeys(addresses))
        before = self.version
        for address in [a for a in self.pods if a not in set(wanted)]:
            self.remove_pod(address)
        for address in wanted:
            self.add_pod(address, name=(names or {}).get(address, ""))
        return self.version != before

    def members(self) -> list[str]:
        return list(self.pods)

    def mark_scrape(self, row: int, ok: bool, now: float | None = None) -> None:
        """Record a scrape outcome; the values themselves are written by the collector."""
        t = self.table
        if ok:
            t.scraped_at[row] = time.monotonic() if now is None else now
            t.scrape_failures[row] = 0.0
            t.metrics_ok[row] = True
            t.dispatched[row] = 0.0
        else:
            t.scrape_failures[row] += 1.0
            t.metrics_ok[row] = False


def set_static_members(pool: Pool, endpoints: Iterable[str]) -> bool:
    """Members from configured `host:port` endpoints, names resolved to `ip:port`.

    The picker's destination header must carry exactly the addresses Envoy's
    cluster members have (override_host matches them literally), and those are
    IPs; a configured name is kept as the pod's display name. True on change.
    """
    resolved = resolve_endpoints(endpoints)
    return pool.set_members([ip for ip, _ in resolved], dict(resolved))


class Datastore:
    """All pools, looked up by pool name or by any model / adapter name they serve."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.pools: dict[str, Pool] = {}
        self.by_model: dict[str, Pool] = {}
        self.apply_config(config)

    def apply_config(self, config: GatewayConfig) -> None:
        """Adopt a new config, keeping the live rows of pools that still exist."""
        self.config = config
        pools: dict[str, Pool] = {}
        for sched in config.schedulers:
            pool = self.pools.get(sched.name)
            if pool is None:
                pool = Pool(sched)
            else:
                pool.config = sched
                for adapter in sched.lora_adapters:
                    pool.adapter_slot(adapter)
            if sched.endpoints:
                set_static_members(pool, sched.endpoints)
            pools[sched.name] = pool
        self.pools = pools
        self.by_model = {}
        for pool in pools.values():
            self.by_model[pool.config.model_name] = pool
            for adapter in pool.config.lora_adapters:
                self.by_model[adapter] = pool

    def pool_for_model(self, model: str) -> Pool | None:
        return self.by_model.get(model)
