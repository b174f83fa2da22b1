"""Compact encoding of what a replica routed: one stream entry per batch of events.

An entry has three fields: `m`, the batch's metadata as JSON (orjson: sending
time, sequence number, a table of the (pool, pod address) pairs the batch
names, the dispatches and the completions), `h`, the dispatches' prefix block
hashes concatenated as little-endian uint64 (8 bytes per 64 prompt
characters: the bulk of a batch, so kept binary), and `bye` on a replica's
last entry. Pods are named by pool and address, never by row: rows differ
between replicas (each assigns them as its pods appear); the receiver
resolves the address with its own O(1) map.

Events as the request path buffers them (plain tuples, no allocation beyond):
- `(DISPATCH, request_id, pool, address, prompt_tokens, max_tokens, adapter,
  cached, prefix_hashes, tenant, tenant_weight)` (tenant "" without spec.tenants);
- `(COMPLETE, request_id, duration_s)`: `duration_s` is the origin's measure of
  a success (dispatch to end), None for a failure.
Request ids are per replica (a counter); (replica, id) is unique.

Completions travel as `c`, their ids, and `cd`, their durations aligned with
`c` (null: none); an older reader ignores `cd` and a batch without it (an
older writer) decodes to no durations, so a rolling upgrade keeps working and
only the speed learning from other replicas' requests waits for it. Likewise
`dt`, aligned with `d`: each dispatch's `[tenant, weight]` (null: no tenant),
absent when no dispatch of the entry has one; the receiver counts the tenant's
request in its fair shares (picker.scheduling.shares), so a tenant's share of a
pool's slots holds across the replicas, not per replica.

Shared scrape results (picker.coordination.scrapes) ride in the same entries:
`k` in the metadata names the signals the entry's results carry, once, and
each result in `r` is `[pod, ok, age_s, values aligned with k (null:
absent), lora ([running, waiting, max_lora] or null), error]`, about 200 bytes
for a vLLM page. `age_s` is the time since the scrape on the owner's
monotonic clock when the entry was encoded; the receiver adds the entry's
transit (its wall clocks) to judge staleness. An older reader ignores `k` and
`r` (so dispatch sharing survives a rolling upgrade), and a reader skips the
values of signals in `k` it does not know (a newer writer's), so adding a
signal never costs an older replica the entry's dispatches; this version
refuses an entry whose results break any bound or type below (CodecError). `ns`
(true) says its writer does not share scrape results (`shareScrapes: false`):
the others must not leave any pod to it (picker.coordination.scrapes); absent
means it shares.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from picker.datalayer.engines import REQUIRED_SIGNALS, Signal
from picker.datalayer.parser import LoraInfo, MetricsSnapshot

DISPATCH = 0
COMPLETE = 1
VERSION = 1
# Blocks shared per dispatch (≈ 32k prompt characters of prefix): a remote pod's
# match then covers any prefix up to there; the rest stays local knowledge.
MAX_SHARED_BLOCKS = 512
# A batch ends at whichever comes first; more events make more entries.
MAX_BATCH_EVENTS = 256
MAX_BATCH_HASH_BYTES = 64 * 1024
# Shared scrape results per entry (more make more entries), and their bounds: a LoRA
# list longer than a pool's adapter slots, or a name longer than this, is cut when
# encoding; an error message is cut like the collector's.
MAX_BATCH_SCRAPES = 128
MAX_SHARED_ADAPTERS = 64
MAX_ADAPTER_NAME = 256
MAX_ERROR_CHARS = 200
# A result older than this is refused (no pool's staleAfter comes near it).
MAX_SCRAPE_AGE_S = 3600.0
# A completion's duration beyond this is refused (no routeTimeout comes near it).
MAX_DURATION_S = 86_400.0
# A dispatch's tenant: the config's bounds (contract.config: names, weights).
MAX_TENANT_NAME = 64
MAX_TENANT_WEIGHT = 1000.0

HASH_DTYPE = np.dtype("<u8")
_NO_HASHES = np.empty(0, dtype=HASH_DTYPE)

Event = tuple[Any, ...]


class CodecError(ValueError):
    """An entry that is not a batch this version can read (skipped, counted)."""


@dataclass(frozen=True, slots=True)
class RemoteDispatch:
    request_id: int
    pool: str
    address: str
    prompt_tokens: int
    max_tokens: int
    adapter: str | None
    cached: float
    prefix_hashes: np.ndarray
    tenant: str = ""
    tenant_weight: float = 1.0


@dataclass(frozen=True, slots=True)
class SharedScrape:
    """One pod's scrape as its owner read it, for the replicas that did not scrape it."""

    pool: str
    address: str
    age_s: float  # since the scrape, owner's monotonic clock, when its entry was encoded
    snapshot: MetricsSnapshot | None  # None: the scrape failed
    error: str = ""


@dataclass(frozen=True, slots=True)
class Batch:
    """One decoded entry: what one replica routed during one flush interval."""

    sent_at: float  # the origin's wall clock (time.time()) when it flushed
    seq: int
    dispatches: list[RemoteDispatch] = field(default_factory=list)
    completions: list[int] = field(default_factory=list)
    bye: bool = False
    scrapes: list[SharedScrape] = field(default_factory=list)
    # Aligned with `completions`: the origin's duration of each success (None: none known).
    durations: list[float | None] = field(default_factory=list)
    shares_scrapes: bool = True  # its writer publishes the scrapes of the pods it owns


def encode_batches(
    events: Sequence[Event], seq: int, sent_at: float, bye: bool = False,
    scrapes: Sequence[SharedScrape] = (), shares_scrapes: bool = True,
) -> list[dict[bytes, bytes]]:
    """Stream entries for `events` (in order) and `scrapes`, split at the batch bounds;
    at least one entry even when both are empty (that one is a heartbeat, or the bye)."""
    entries: list[dict[bytes, bytes]] = []
    start = shared = 0
    scrapes = [s for s in scrapes if s.age_s <= MAX_SCRAPE_AGE_S]  # older ones are refused
    while True:
        end, hash_bytes = start, 0
        while end < len(events) and end - start < MAX_BATCH_EVENTS:
            event = events[end]
            if event[0] == DISPATCH:
                size = min(len(event[8]), MAX_SHARED_BLOCKS) * 8
                if hash_bytes + size > MAX_BATCH_HASH_BYTES and end > start:
                    break
                hash_bytes += size
            end += 1
        chunk = scrapes[shared : shared + MAX_BATCH_SCRAPES]
        shared += len(chunk)
        last = end >= len(events) and shared >= len(scrapes)
        entries.append(_encode_one(events[start:end], seq + len(entries), sent_at, bye and last,
                                   chunk, shares_scrapes))
        if last:
            return entries
        start = end


def _encode_one(
    events: Sequence[Event], seq: int, sent_at: float, bye: bool,
    scrapes: Sequence[SharedScrape] = (), shares_scrapes: bool = True,
) -> dict[bytes, bytes]:
    pods: dict[tuple[str, str], int] = {}
    dispatches: list[list[Any]] = []
    completions: list[int] = []
    durations: list[float | None] = []
    tenants: list[list[Any] | None] = []
    hashes: list[np.ndarray] = []
    for event in events:
        if event[0] == COMPLETE:
            completions.append(event[1])
            duration = event[2] if len(event) > 2 else None
            durations.append(None if duration is None else round(duration, 4))
            continue
        _, rid, pool, address, prompt, output, adapter, cached, blocks, tenant, weight = event
        pod = pods.setdefault((pool, address), len(pods))
        blocks = blocks[:MAX_SHARED_BLOCKS]
        hashes.append(blocks)
        dispatches.append([rid, pod, prompt, output, adapter, round(cached, 3), len(blocks)])
        tenants.append([tenant, weight] if tenant else None)
    meta = {
        "v": VERSION,
        "t": sent_at,
        "s": seq,
        "p": [list(k) for k in pods],
        "d": dispatches,
        "c": completions,
    }
    if any(d is not None for d in durations):
        meta["cd"] = durations
    if any(t is not None for t in tenants):
        meta["dt"] = tenants
    if not shares_scrapes:
        meta["ns"] = True
    if scrapes:
        meta["k"], meta["r"] = _encode_scrapes(scrapes, pods)
        meta["p"] = [list(k) for k in pods]
    entry = {b"m": orjson.dumps(meta)}
    if hashes:
        entry[b"h"] = np.concatenate(hashes).astype(HASH_DTYPE, copy=False).tobytes()
    if bye:
        entry[b"bye"] = b"1"
    return entry


def _encode_scrapes(
    scrapes: Sequence[SharedScrape], pods: dict[tuple[str, str], int]
) -> tuple[list[str], list[list[Any]]]:
    """(signal names, results) of an entry; pods are added to the entry's pod table."""
    keys: dict[Signal, int] = {}
    for s in scrapes:
        if s.snapshot is not None:
            for signal, value in s.snapshot.values.items():
                if math.isfinite(value):
                    keys.setdefault(signal, len(keys))
    results: list[list[Any]] = []
    for s in scrapes:
        pod = pods.setdefault((s.pool, s.address), len(pods))
        values: list[float | None] = [None] * len(keys)
        lora: list[Any] | None = None
        if s.snapshot is not None:
            for signal, value in s.snapshot.values.items():
                if math.isfinite(value):
                    values[keys[signal]] = value
            if s.snapshot.lora is not None:
                lora = _encode_lora(s.snapshot.lora)
        results.append([pod, s.snapshot is not None, round(max(s.age_s, 0.0), 4), values,
                        lora, s.error[:MAX_ERROR_CHARS]])
    return [signal.value for signal in keys], results


def _encode_lora(lora: LoraInfo) -> list[Any]:
    def names(adapters: tuple[str, ...]) -> list[str]:
        return [a for a in adapters if len(a) <= MAX_ADAPTER_NAME][:MAX_SHARED_ADAPTERS]

    max_lora = lora.max_lora if math.isfinite(lora.max_lora) else 0.0
    return [names(lora.running), names(lora.waiting), max_lora]


def decode_batch(fields: dict[bytes, bytes]) -> Batch:
    """The batch of one stream entry; CodecError when it is not one."""
    try:
        meta = orjson.loads(fields[b"m"])
        if meta["v"] != VERSION:
            raise CodecError(f"batch version {meta['v']!r}, expected {VERSION}")
        raw = fields.get(b"h", b"")
        if len(raw) % 8:
            raise CodecError("prefix hashes not a whole number of uint64")
        all_hashes = np.frombuffer(raw, dtype=HASH_DTYPE) if raw else _NO_HASHES
        pods = [(str(p), str(a)) for p, a in meta["p"]]
        dispatches = []
        offset = 0
        tenants = _decode_tenants(meta.get("dt"), len(meta["d"]))
        for (rid, pod, prompt, output, adapter, cached, nblocks), (tenant, weight) in zip(
                meta["d"], tenants, strict=True):
            pool, address = pods[pod]
            blocks = all_hashes[offset : offset + nblocks]
            offset += nblocks
            dispatches.append(
                RemoteDispatch(int(rid), pool, address, int(prompt), int(output),
                               adapter, float(cached), blocks, tenant, weight)
            )
        if offset != len(all_hashes):
            raise CodecError("prefix hashes do not match the dispatches' block counts")
        completions = [int(c) for c in meta["c"]]
        durations = _decode_durations(meta.get("cd"), len(completions))
        scrapes = _decode_scrapes(meta, pods)
        not_sharing = meta.get("ns", False)
        if type(not_sharing) is not bool:
            raise CodecError(f"ns must be a boolean, not {not_sharing!r}")
        return Batch(float(meta["t"]), int(meta["s"]), dispatches, completions,
                     fields.get(b"bye") == b"1", scrapes, durations, not not_sharing)
    except CodecError:
        raise
    except (KeyError, ValueError, TypeError, IndexError) as exc:  # JSONDecodeError is a ValueError
        raise CodecError(f"not a batch: {type(exc).__name__}: {exc}") from None


def _decode_tenants(raw: Any, n: int) -> list[tuple[str, float]]:
    """The dispatches' (tenant, weight) (`dt`); ("", 1.0) each when absent."""
    if raw is None:
        return [("", 1.0)] * n
    if not isinstance(raw, list) or len(raw) != n:
        raise CodecError("dt must be a list aligned with the dispatches")
    out = []
    for item in raw:
        if item is None:
            out.append(("", 1.0))
            continue
        tenant, weight = item
        if (not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_NAME
                or type(weight) not in (int, float)
                or not 0.0 < float(weight) <= MAX_TENANT_WEIGHT):
            raise CodecError(f"not a tenant and weight: {item!r}"[:200])
        out.append((tenant, float(weight)))
    return out


def _decode_durations(raw: Any, count: int) -> list[float | None]:
    """The completions' durations (`cd`); all None when the writer sent none."""
    if raw is None:
        return [None] * count
    if not isinstance(raw, list) or len(raw) != count:
        raise CodecError("completion durations do not match the completions")
    for d in raw:
        if d is not None and not (_number(d) and 0.0 <= d <= MAX_DURATION_S):
            raise CodecError(f"completion duration {d!r} out of range")
    return [None if d is None else float(d) for d in raw]


def _decode_scrapes(meta: dict[str, Any], pods: list[tuple[str, str]]) -> list[SharedScrape]:
    """The entry's shared scrape results; CodecError on any broken bound or type."""
    results = meta.get("r")
    if results is None:
        return []
    if not isinstance(results, list) or len(results) > MAX_BATCH_SCRAPES:
        raise CodecError(f"scrape results: a list of at most {MAX_BATCH_SCRAPES} expected")
    keys = meta["k"]
    if not isinstance(keys, list) or len(set(keys)) != len(keys):
        raise CodecError("scrape signals: a list of distinct names expected")
    if not all(isinstance(k, str) for k in keys):
        raise CodecError("scrape signals: names expected")
    signals = [_KNOWN_SIGNALS.get(k) for k in keys]  # None: a newer writer's, skipped
    return [_decode_scrape(item, signals, pods) for item in results]


_KNOWN_SIGNALS = {signal.value: signal for signal in Signal}


def _decode_scrape(item: Any, signals: list[Signal | None], pods: list[tuple[str, str]]
                   ) -> SharedScrape:
    pod, ok, age, values, lora, error = item
    if type(ok) is not bool or not isinstance(error, str) or len(error) > MAX_ERROR_CHARS:
        raise CodecError("scrape result: ok must be a boolean, error a short string")
    if not _number(age) or not 0.0 <= age <= MAX_SCRAPE_AGE_S:
        raise CodecError(f"scrape result: age {age!r} out of range")
    if not isinstance(values, list) or len(values) != len(signals):
        raise CodecError("scrape result: values do not match the entry's signals")
    if type(pod) is not int or not 0 <= pod < len(pods):
        raise CodecError(f"scrape result: pod {pod!r} not in the entry's pod table")
    pool, address = pods[pod]
    if not ok:
        if any(v is not None for v in values) or lora is not None:
            raise CodecError("scrape result: a failed scrape carries no values")
        return SharedScrape(pool, address, float(age), None, error)
    present: dict[Signal, float] = {}
    for signal, value in zip(signals, values, strict=True):
        if value is None or signal is None:
            continue
        if not _number(value) or not math.isfinite(value):
            raise CodecError(f"scrape result: {signal.value} is not a finite number")
        present[signal] = float(value)
    if not present.keys() >= REQUIRED_SIGNALS:
        raise CodecError("scrape result: a good scrape lacks a required signal")
    snapshot = MetricsSnapshot(values=present, lora=None if lora is None else _decode_lora(lora))
    return SharedScrape(pool, address, float(age), snapshot, error)


def _decode_lora(lora: Any) -> LoraInfo:
    running, waiting, max_lora = lora
    for names in (running, waiting):
        if not isinstance(names, list) or len(names) > MAX_SHARED_ADAPTERS or not all(
            isinstance(n, str) and len(n) <= MAX_ADAPTER_NAME for n in names
        ):
            raise CodecError("scrape result: adapters must be a short list of short names")
    if not _number(max_lora) or not math.isfinite(max_lora):
        raise CodecError("scrape result: max_lora is not a finite number")
    return LoraInfo(tuple(running), tuple(waiting), float(max_lora))


def _number(value: Any) -> bool:
    return type(value) in (int, float)
