"""Shared scrape results between coordinated replicas (picker.coordination.scrapes).

Units first: rendezvous ownership, the codec's scrape results (round trip and
refusals), the fold writing a shared result exactly as a local scrape, and the
scrape-or-skip decision. Then two or three replicas (Datastore, Director,
MetricsCollector and Coordinator each, no servers) over stand-in pods and a real
redis-server: each pod scraped by one replica, the owner's death or stop taken
over within the stated bound, Redis down making every replica scrape every pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import pytest

from contract.config import GatewayConfig, MetricsConfig, parse_config
from picker.cancellation import cancel_and_wait
from picker.coordination import Coordinator
from picker.coordination.codec import (
    DISPATCH,
    MAX_ADAPTER_NAME,
    MAX_BATCH_SCRAPES,
    MAX_SHARED_ADAPTERS,
    CodecError,
    SharedScrape,
    decode_batch,
    encode_batches,
)
from picker.coordination.coordinator import TASKS_END_TIMEOUT_S
from picker.coordination.scrapes import (
    FALLBACK,
    FRESH_GAPS,
    MEMBERS_REFRESH_S,
    OWNER,
    PRUNE_SLACK,
    SHARED,
    Ownership,
    owner,
)
from picker.datalayer.collector import MetricsCollector
from picker.datalayer.columns import WRITTEN_COLUMNS, write_outcome
from picker.datalayer.engines import Signal
from picker.datalayer.parser import LoraInfo, MetricsSnapshot
from picker.datastore import Datastore, Pool
from picker.director import Director
from picker.gateway_metrics import GatewayMetrics
from picker.scheduling.request import SchedulingRequest
from simulator.standin import StandInPod
from simulator.standin_pages import LoraSeries, PodState
from tests.test_coordination_support import eventually, redis_server

POOL = "llama"
MODEL = "llama-3.1-8b"
ADAPTERS = ("sql-lora", "chat-lora")
INTERVAL_S = 0.05  # the default scrape interval
HEARTBEAT_S = 0.2
REPLICA_TIMEOUT_S = 1.0
FLUSH_S = 0.01
# A non-owner scrapes a pod itself at its first tick after the owner's newest result
# stops being fresh: FRESH_GAPS intervals + a flush after that result was scraped, then
# up to one interval (+10 % jitter) to the tick, plus the ownership cache.
FALLBACK_BOUND_S = FRESH_GAPS * INTERVAL_S + FLUSH_S + 1.1 * INTERVAL_S + MEMBERS_REFRESH_S
# A noisy 2-core machine shared with other test runs: scheduling delays on top.
SLACK_S = 0.4


# -- ownership --------------------------------------------------------------------------------


ADDRESSES = [f"10.{i // 250}.{i % 250}.7:8000" for i in range(2000)]


def owners(members: list[str]) -> dict[str, str]:
    return {a: owner(a, members) for a in ADDRESSES}


def test_ownership_does_not_depend_on_order_or_on_the_process():
    members = ["gw-a-1f2e3d", "gw-b-9c8b7a", "gw-c-000001"]
    mine = owners(members)
    assert owners(list(reversed(members))) == mine
    # another interpreter with another hash seed computes the same owners (never `hash`)
    code = ("import json, sys; from picker.coordination.scrapes import owner; "
            "print(json.dumps([owner(a, sys.argv[2:]) for a in json.loads(sys.argv[1])]))")
    sample = ADDRESSES[:50]
    out = subprocess.run(
        [sys.executable, "-c", code, orjson.dumps(sample).decode(), *members],
        capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    assert orjson.loads(out.stdout) == [mine[a] for a in sample]


def test_ownership_is_balanced():
    for members in (["a", "b"], ["a", "b", "c", "d"]):
        counts: dict[str, int] = {}
        for who in owners(members).values():
            counts[who] = counts.get(who, 0) + 1
        expected = len(ADDRESSES) / len(members)
        assert set(counts) == set(members)
        assert all(abs(n - expected) < 0.1 * expected for n in counts.values()), counts


def test_a_replica_joining_or_leaving_moves_only_its_own_share():
    before = owners(["a", "b", "c"])
    joined = owners(["a", "b", "c", "d"])
    moved = [a for a in ADDRESSES if joined[a] != before[a]]
    assert all(joined[a] == "d" for a in moved)  # only to the newcomer...
    assert abs(len(moved) - len(ADDRESSES) / 4) < 0.1 * len(ADDRESSES) / 4  # ...its share
    left = owners(["a", "c"])
    changed = [a for a in ADDRESSES if left[a] != before[a]]
    assert all(before[a] == "b" for a in changed)  # only what the leaver held moves
    assert len(changed) == sum(1 for who in before.values() if who == "b")


def test_the_owner_cache_follows_the_replica_set():
    ownership = Ownership("a")
    assert ownership.owner(ADDRESSES[0]) == "a"  # alone: every pod is its own
    assert ownership.set_members(["b", "c"]) and ownership.members == ("a", "b", "c")
    assert not ownership.set_members(["c", "b", "a"])
    assert [ownership.owner(x) for x in ADDRESSES[:100]] == \
        [owner(x, ["a", "b", "c"]) for x in ADDRESSES[:100]]
    ownership.set_members([])
    assert {ownership.owner(x) for x in ADDRESSES[:100]} == {"a"}


# -- codec ------------------------------------------------------------------------------------


def snapshot(waiting: float = 3.0, **extra: float) -> MetricsSnapshot:
    values = {Signal.WAITING: waiting, Signal.RUNNING: 5.0, Signal.KV_USAGE: 0.25,
              Signal.KV_NUM_BLOCKS: 8192.0, Signal.TTFT_SUM: 12.5, Signal.TTFT_COUNT: 40.0}
    values.update({Signal(k): v for k, v in extra.items()})
    return MetricsSnapshot(values=values, lora=LoraInfo(("sql-lora",), ("chat-lora",), 4.0))


def test_codec_round_trip_of_shared_scrapes_beside_dispatches():
    good = SharedScrape(POOL, "10.0.0.1:8000", 0.0123, snapshot())
    plain = SharedScrape(POOL, "10.0.0.2:8000", 0.0, MetricsSnapshot(
        {Signal.WAITING: 0.0, Signal.RUNNING: 0.0, Signal.KV_USAGE: 0.0}))
    failed = SharedScrape("other", "10.0.0.3:9000", 1.5, None, "TimeoutError: ")
    dispatch = (DISPATCH, 1, POOL, "10.0.0.1:8000", 100, 10, None, 0.0, [], "", 1.0)
    (entry,) = encode_batches([dispatch], 3, 99.0, scrapes=[good, plain, failed])
    batch = decode_batch(entry)
    assert len(batch.dispatches) == 1 and batch.dispatches[0].address == "10.0.0.1:8000"
    assert batch.scrapes == [good, plain, failed]
    assert len(entry[b"m"]) < 700  # the pod table and signal names once per entry


def test_codec_splits_many_scrape_results_over_entries():
    results = [SharedScrape(POOL, f"10.0.1.{i}:8000", 0.0, snapshot(float(i)))
               for i in range(2 * MAX_BATCH_SCRAPES + 5)]
    entries = encode_batches([], 0, 1.0, bye=True, scrapes=results)
    assert len(entries) == 3 and [b"bye" in e for e in entries] == [False, False, True]
    assert [s for e in entries for s in decode_batch(e).scrapes] == results
    assert encode_batches([], 0, 1.0, scrapes=[SharedScrape(POOL, "x:1", 4000.0, None)]) \
        == encode_batches([], 0, 1.0)  # too old to share: never sent, so never refused


def test_codec_cuts_what_a_receiver_would_refuse():
    names = tuple(f"adapter-{i}" for i in range(MAX_SHARED_ADAPTERS + 10))
    lora = LoraInfo(("x" * (MAX_ADAPTER_NAME + 1), *names), (), math.nan)
    big = MetricsSnapshot(snapshot().values, lora)
    (entry,) = encode_batches([], 0, 1.0, scrapes=[
        SharedScrape(POOL, "a:1", 0.0, big, "e" * 1000),
        SharedScrape(POOL, "b:1", 0.0, MetricsSnapshot(
            {**snapshot().values, Signal.QUEUE_TIME_SUM: math.inf}))])
    first, second = decode_batch(entry).scrapes
    assert first.snapshot is not None and first.snapshot.lora is not None
    assert first.snapshot.lora.running == names[:MAX_SHARED_ADAPTERS]
    assert first.snapshot.lora.max_lora == 0.0 and len(first.error) == 200
    assert second.snapshot is not None and Signal.QUEUE_TIME_SUM not in second.snapshot.values


def test_codec_says_whether_its_writer_shares_scrapes():
    (sharing,) = encode_batches([], 0, 1.0)
    (alone,) = encode_batches([], 0, 1.0, shares_scrapes=False)
    assert decode_batch(sharing).shares_scrapes and not decode_batch(alone).shares_scrapes
    with pytest.raises(CodecError):
        decode_batch({b"m": b'{"v":1,"t":0,"s":0,"p":[],"d":[],"c":[],"ns":1}'})


def test_an_entry_of_an_older_writer_has_no_scrapes():
    meta = {"v": 1, "t": 1.0, "s": 0, "p": [], "d": [], "c": []}
    assert decode_batch({b"m": orjson.dumps(meta)}).scrapes == []


def _entry(results: Any, keys: Any = ("waiting", "running", "kv_usage"),
           pods: Any = ((POOL, "a:1"),)) -> dict[bytes, bytes]:
    meta = {"v": 1, "t": 1.0, "s": 0, "p": [list(p) for p in pods], "d": [], "c": [],
            "k": list(keys), "r": results}
    return {b"m": orjson.dumps(meta)}


GOOD = [0, True, 0.01, [1, 2, 0.5], None, ""]


def _good(**change: Any) -> list[Any]:
    fields = ["pod", "ok", "age", "values", "lora", "error"]
    return [change.get(f, v) for f, v in zip(fields, GOOD, strict=True)]


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param(_entry([_good()], keys=("waiting", "running", 7)), id="signal not a name"),
        pytest.param(_entry([_good()], keys=("waiting", "waiting", "kv_usage")), id="signal twice"),
        pytest.param(_entry([_good()], keys="waiting"), id="signals not a list"),
        pytest.param(_entry("r"), id="results not a list"),
        pytest.param(_entry([GOOD] * (MAX_BATCH_SCRAPES + 1)), id="too many results"),
        pytest.param(_entry([GOOD[:5]]), id="short result"),
        pytest.param(_entry([_good(pod=1)]), id="pod out of the table"),
        pytest.param(_entry([_good(pod=-1)]), id="negative pod"),
        pytest.param(_entry([_good(ok=1)]), id="ok not a boolean"),
        pytest.param(_entry([_good(age=-0.5)]), id="negative age"),
        pytest.param(_entry([_good(age=1e9)]), id="absurd age"),
        pytest.param(_entry([_good(age="0")]), id="age not a number"),
        pytest.param(_entry([_good(values=[1, 2])]), id="values short"),
        pytest.param(_entry([_good(values=[1, "2", 0.5])]), id="value a string"),
        pytest.param(_entry([_good(values=[1, True, 0.5])]), id="value a boolean"),
        pytest.param(_entry([_good(values=[1, None, 0.5])]), id="good lacks a required signal"),
        pytest.param(_entry([_good(ok=False)]), id="failed with values"),
        pytest.param(_entry([_good(ok=False, values=[None] * 3, lora=[[], [], 1])]),
                     id="failed with lora"),
        pytest.param(_entry([_good(lora=[["a"], []])]), id="lora short"),
        pytest.param(_entry([_good(lora=[["a"] * (MAX_SHARED_ADAPTERS + 1), [], 4])]),
                     id="too many adapters"),
        pytest.param(_entry([_good(lora=[["a" * (MAX_ADAPTER_NAME + 1)], [], 4])]),
                     id="adapter name too long"),
        pytest.param(_entry([_good(lora=[[1], [], 4])]), id="adapter not a string"),
        pytest.param(_entry([_good(lora=[[], [], "4"])]), id="max_lora not a number"),
        pytest.param(_entry([_good(error="e" * 201)]), id="error too long"),
        pytest.param({b"m": orjson.dumps({"v": 1, "t": 1.0, "s": 0, "p": [], "d": [], "c": [],
                                          "r": []})}, id="results without signals"),
    ],
)
def test_codec_refuses_a_malformed_scrape_result(fields):
    with pytest.raises(CodecError):
        decode_batch(fields)


def test_a_signal_this_version_does_not_know_is_skipped_not_refused():
    """A newer writer's new signal (a rolling upgrade): the rest of its result, and the
    entry's dispatches, still count here."""
    result = _good(values=[1, 2, 0.5, 9])
    (scrape,) = decode_batch(_entry([result], keys=("waiting", "running", "colour",
                                                    "kv_usage"))).scrapes
    assert scrape.snapshot is not None
    assert scrape.snapshot.values == {Signal.WAITING: 1.0, Signal.RUNNING: 2.0,
                                      Signal.KV_USAGE: 9.0}


def test_the_good_result_the_refusals_alter_decodes():
    (good,) = decode_batch(_entry([GOOD])).scrapes
    assert good.snapshot is not None and good.snapshot.values[Signal.KV_USAGE] == 0.5


# -- the fold writes a shared result like a local scrape ---------------------------------------


def scrape_config(endpoints: list[str], url: str = "redis://127.0.0.1:1/0", *,
                  prefix: str = "", **coordination: Any) -> GatewayConfig:
    return parse_config({
        "apiVersion": "inference-gateway.io/v1alpha1", "kind": "InferenceGatewayConfig",
        "metadata": {"name": "test"},
        "spec": {
            "schedulers": [{"name": POOL, "modelName": MODEL, "endpoints": endpoints,
                            "loraAdapters": list(ADAPTERS)}],
            "coordination": {
                "url": url, "keyPrefix": prefix or f"igw-test-{time.monotonic_ns()}",
                "heartbeatInterval": f"{int(HEARTBEAT_S * 1000)}ms",
                "replicaTimeout": f"{REPLICA_TIMEOUT_S:g}s",
                "flushInterval": f"{int(FLUSH_S * 1000)}ms", **coordination,
            },
        },
    })


@dataclass
class Scraper:
    """One replica's routing and scraping parts; `start()` / `await stop()`."""

    name: str
    datastore: Datastore
    collector: MetricsCollector
    coordinator: Coordinator

    @classmethod
    def make(cls, config: GatewayConfig, name: str, skew_s: float = 0.0) -> Scraper:
        """`skew_s`: this replica's host wall clock is that far ahead of the others'."""
        datastore = Datastore(config)
        director = Director(datastore, GatewayMetrics())
        collector = MetricsCollector(datastore)
        return cls(name, datastore, collector,
                   Coordinator(config, director, replica=name, collector=collector,
                               wall_clock=lambda: time.time() + skew_s))

    @property
    def pool(self) -> Pool:
        return self.datastore.pools[POOL]

    @property
    def sharing(self):
        assert self.coordinator.scrapes is not None
        return self.coordinator.scrapes

    def start(self) -> None:
        self.collector.start()
        self.coordinator.start()

    async def stop(self) -> None:
        await self.coordinator.stop()
        await self.collector.stop()

    async def kill(self) -> None:
        """Gone without a bye: no more scrapes, entries or heartbeats."""
        # cancel_and_wait: on Python 3.11 one cancel can be lost (picker.cancellation)
        await cancel_and_wait(self.coordinator._tasks, TASKS_END_TIMEOUT_S)
        await self.collector.stop()
        await self.coordinator.bus.close()

    def own_scrapes(self, address: str) -> int:
        stats = self.collector.counters.get(POOL, address)
        return 0 if stats is None else stats.ok + stats.failed

    def row(self, address: str) -> int:
        return self.pool.pods[address].row

    def roles(self) -> dict[str, int]:
        return self.sharing.roles()


def not_owning(address: str, owner_name: str) -> str:
    """A replica name that, beside `owner_name`, does not own `address`."""
    return next(n for n in ("b", "c", "d", "e", "f") if owner(address, [owner_name, n]) ==
                owner_name)


def test_a_shared_result_fills_the_row_exactly_like_a_local_scrape():
    address = "10.0.0.1:8000"
    config = scrape_config([address])
    # "a" scrapes (and owns the pod: the fold makes it a live peer of the other)
    local, remote = Scraper.make(config, "a"), Scraper.make(config, not_owning(address, "a"))
    now = time.monotonic()
    pages = [snapshot(2.0), snapshot(4.0, ttft_sum=20.0, ttft_count=48.0,
                                     prefill_time_sum=1.0, prefill_time_count=4.0,
                                     finished_prompt_tokens=4000.0, prompt_tokens=5000.0)]
    for i, page in enumerate([*pages, None]):
        at = now - 1.0 + 0.3 * i
        write_outcome(local.pool, local.row(address), page, local.collector.learner, at)
        # the result as the owner sends it 20 ms after its scrape, in transit 5 ms
        (entry,) = encode_batches([], i, time.time(), scrapes=[
            SharedScrape(POOL, address, 0.02, page, "" if page else "HTTP 500")])
        remote.coordinator.folder.fold("a", decode_batch(entry), at + 0.025, 0.005)
        for column in WRITTEN_COLUMNS:
            mine = getattr(local.pool.table, column)[local.row(address)]
            theirs = getattr(remote.pool.table, column)[remote.row(address)]
            # times are rebuilt from the owner's offsets (at + 0.025 - 0.02 - 0.005): equal
            # to a few ulps, which at a large monotonic clock (hours of uptime) is not ==
            assert np.allclose(mine, theirs, rtol=0.0, atol=1e-6, equal_nan=True), column
    table = remote.pool.table
    row = remote.row(address)
    assert table.ttft_s[row] > 0 and table.scrape_failures[row] == 1 and not table.metrics_ok[row]
    assert table.lora_running[row, remote.pool.adapter_index["sql-lora"]]
    assert remote.sharing.stats.used == 3 and remote.own_scrapes(address) == 0
    # an older result than the row's is not written (a row only moves forward)
    (entry,) = encode_batches([], 9, time.time(), scrapes=[
        SharedScrape(POOL, address, 5.0, snapshot(9.0))])
    remote.coordinator.folder.fold("a", decode_batch(entry), time.monotonic(), 0.0)
    assert table.waiting[row] == 4.0 and remote.sharing.stats.ignored == 1
    # unknown pods are counted, not written
    (entry,) = encode_batches([], 10, time.time(), scrapes=[
        SharedScrape(POOL, "10.9.9.9:1", 0.0, snapshot())])
    remote.coordinator.folder.fold("a", decode_batch(entry), time.monotonic(), 0.0)
    assert remote.coordinator.folder.unresolved == 1


def test_a_shared_result_keeps_the_sends_made_after_it_was_taken():
    """A shared result is written dated when its owner scraped (~flushInterval before it
    arrives): the sends this replica made or folded after that moment are not in it, so
    they still count as sent since the scrape; those before it are in it."""
    address = "10.0.0.1:8000"
    config = scrape_config([address])
    replica = Scraper.make(config, not_owning(address, "a"))
    sched = replica.coordinator.director.schedulers[POOL]
    row, table = replica.row(address), replica.pool.table
    now = time.monotonic()
    for at, prompt in ((now - 0.030, 100), (now - 0.008, 200), (now - 0.004, 300)):
        sched.on_dispatch(row, SchedulingRequest(model=MODEL, prompt_tokens=prompt,
                                                 max_tokens=10), at)
    assert table.dispatched[row] == 3.0
    # taken 15 ms ago by the owner (10 ms before its flush, 5 ms in transit): it saw the
    # first send, not the two after it
    (entry,) = encode_batches([], 0, time.time(), scrapes=[
        SharedScrape(POOL, address, 0.010, snapshot(1.0))])
    replica.coordinator.folder.fold("a", decode_batch(entry), now, 0.005)
    assert np.isclose(table.scraped_at[row], now - 0.015, atol=1e-6)
    assert table.waiting[row] == 1.0 and table.dispatched[row] == 2.0
    since = sched.state.since_scrape_tokens(slice(row, row + 1), table.dispatched[row:row + 1])
    assert since is not None and since[0] == 500.0
    # the next send adds to them; a newer result (one that saw them all) clears them
    sched.on_dispatch(row, SchedulingRequest(model=MODEL, prompt_tokens=50, max_tokens=10),
                      now + 0.001)
    assert table.dispatched[row] == 3.0 and sched.state.since_tokens[row] == 550.0
    # the prefill backlog folded that result with what it could have seen: the first send
    assert sched.state.fold_sent[row] == 100.0
    (entry,) = encode_batches([], 1, time.time(), scrapes=[
        SharedScrape(POOL, address, 0.0, snapshot(4.0))])
    replica.coordinator.folder.fold("a", decode_batch(entry), now + 0.002, 0.0)
    assert table.dispatched[row] == 0.0
    assert sched.state.since_scrape_tokens(slice(row, row + 1),
                                           table.dispatched[row:row + 1]) is None


def test_a_non_owner_skips_only_while_the_owners_results_are_fresh():
    address = "10.0.0.1:8000"
    config = scrape_config([address])
    replica = Scraper.make(config, not_owning(address, "a"))
    sharing, pool, link = replica.sharing, replica.pool, replica.coordinator.stats
    replicas = replica.coordinator.replicas
    pod = pool.pods[address]
    link.connected = True
    now = time.monotonic()
    replicas.heard("a", now, 0.0)  # the owner is alive...
    assert sharing.should_scrape(pool, pod, now)  # ...but nothing came from it yet
    assert sharing.roles()[FALLBACK] == 1
    result = SharedScrape(POOL, address, 0.0, snapshot())
    sharing.received(pool, pod, result, now, 0.0)
    window = FRESH_GAPS * INTERVAL_S + FLUSH_S
    assert not sharing.should_scrape(pool, pod, now + window - 0.001)
    assert sharing.roles()[SHARED] == 1 and sharing.stats.skipped == 1
    assert sharing.should_scrape(pool, pod, now + window + 0.001)  # overdue: scrape here
    link.connected = False
    sharing.received(pool, pod, result, now + 0.3, 0.0)
    assert sharing.should_scrape(pool, pod, now + 0.3)  # link down: scrape everything
    link.connected = True
    # a failing pod: the owner backs off, and each of its scrapes may take the timeout
    failed = SharedScrape(POOL, address, 0.0, None, "TimeoutError")
    sharing.received(pool, pod, failed, now + 0.6, 0.0)
    assert not sharing.should_scrape(pool, pod, now + 0.6 + window + 0.2)
    assert sharing.stats.fallbacks == 3
    # the owner silent past replicaTimeout is dead: this replica owns the pod, and as
    # the only one left it shares nothing (no one would read it)
    later = now + REPLICA_TIMEOUT_S + 0.1
    assert sharing.should_scrape(pool, pod, later) and sharing.roles()[OWNER] == 1
    sharing.scraped(pool, pod, snapshot(), "", later)
    assert len(sharing.outbox) == 0
    replicas.heard("a", later, 0.0)  # back: the pod is its again
    sharing.should_scrape(pool, pod, later + 2 * MEMBERS_REFRESH_S)
    assert sharing.roles()[OWNER] == 0


def test_the_per_pod_table_stays_bounded_when_pods_come_and_go_unscraped():
    """A pod that leaves before its scrape task started is never forgotten by the
    collector; results received for it meanwhile must not pile up."""
    replica = Scraper.make(scrape_config(["10.0.0.1:8000"]), "b")
    pool, sharing = replica.pool, replica.sharing
    now = time.monotonic()
    replica.coordinator.replicas.heard("a", now, 0.0)
    theirs = [x for x in (f"10.1.{i // 250}.{i % 250}:8000" for i in range(8 * PRUNE_SLACK))
              if owner(x, ["a", replica.name]) == "a"][: 3 * PRUNE_SLACK]
    for address in theirs:
        pod = pool.add_pod(address)
        sharing.received(pool, pod, SharedScrape(POOL, address, 0.0, snapshot()), now, 0.0)
        pool.remove_pod(address)
    assert sharing.stats.used == 3 * PRUNE_SLACK  # every one written: the table grew...
    assert len(sharing._pods) <= PRUNE_SLACK + 1  # ...and was pruned of the departed


# -- two replicas, real pods, real Redis -------------------------------------------------------


PODS = 6


async def start_pods() -> list[StandInPod]:
    pods = [StandInPod("vllm", PodState(waiting=i, running=10 + i, kv_usage=i / 10,
                                        num_gpu_blocks=1000 + i)) for i in range(PODS)]
    pods[1].state.lora = [LoraSeries(("sql-lora",), ("chat-lora",), 1.7e9)]
    for pod in pods:
        await pod.start()
    return pods


@pytest.fixture
async def stand_ins() -> AsyncIterator[list[StandInPod]]:
    pods = await start_pods()
    yield pods
    for pod in pods:
        await pod.stop()


def settled(*replicas: Scraper) -> bool:
    """Every replica sees all the others and no pod is in fallback."""
    names = sorted(r.name for r in replicas)
    return all(
        r.coordinator.stats.connected
        and list(r.sharing.ownership.members) == names
        and r.roles()[FALLBACK] == 0
        and r.roles()[OWNER] + r.roles()[SHARED] == PODS
        for r in replicas
    )


def same_numbers(a: Scraper, b: Scraper, addresses: list[str]) -> bool:
    columns = ("waiting", "running", "kv_usage", "kv_num_blocks", "kv_block_size", "max_lora",
               "metrics_ok", "lora_running", "lora_waiting")
    return all(
        (getattr(a.pool.table, c)[a.row(x)] == getattr(b.pool.table, c)[b.row(x)]).all()
        for x in addresses for c in columns
    )


@contextlib.asynccontextmanager
async def started_pair(config: GatewayConfig) -> AsyncIterator[tuple[Scraper, Scraper]]:
    """Replicas "a" and "b" of `config`, started, and stopped whatever the test did."""
    a, b = Scraper.make(config, "a"), Scraper.make(config, "b")
    a.start()
    b.start()
    try:
        yield a, b
    finally:
        await a.stop()
        await b.stop()


def max_row_age(replica: Scraper) -> float:
    t, now = replica.pool.table, time.monotonic()
    rows = [replica.row(x) for x in replica.pool.pods]
    return max(now - float(t.scraped_at[r]) for r in rows)


async def test_each_pod_is_scraped_by_one_replica_and_both_hold_the_same_numbers(stand_ins):
    addresses = [p.address for p in stand_ins]
    with redis_server() as redis:
        async with started_pair(scrape_config(addresses, redis.url)) as (a, b):
            await eventually(lambda: settled(a, b), 10)
            before = {x: (a.own_scrapes(x), b.own_scrapes(x)) for x in addresses}
            hits = [p.hits for p in stand_ins]
            await asyncio.sleep(1.0)
            after = {x: (a.own_scrapes(x), b.own_scrapes(x)) for x in addresses}
            for x in addresses:
                grew = dict(zip("ab", (n1 - n0 for n0, n1 in zip(before[x], after[x],
                                                                  strict=True)), strict=True))
                owners = {r.sharing.ownership.owner(x) for r in (a, b)}
                assert len(owners) == 1, (x, owners)
                (mine,) = owners
                (other,) = set(grew) - {mine}
                assert grew[mine] >= 12, (x, grew)  # the owner scrapes at ~20/s...
                # ...and the other not at all, unless a result came late on this loaded
                # machine (past its 110 ms window): then one fallback scrape, counted
                assert grew[other] <= 2, (x, grew)
            per_pod = [p.hits - h for p, h in zip(stand_ins, hits, strict=True)]
            assert all(12 <= n <= 24 for n in per_pod), per_pod  # one replica's 20/s
            assert a.roles()[OWNER] + b.roles()[OWNER] == PODS
            assert same_numbers(a, b, addresses)
            assert b.pool.table.lora_running[b.row(addresses[1]),
                                             b.pool.adapter_index["sql-lora"]]
            # a change on a pod reaches the replica that does not scrape it, as fresh
            for pod in stand_ins:
                pod.state.waiting += 7
            took = await eventually(lambda: all(
                r.pool.table.waiting[r.row(x)] == i + 7
                for r in (a, b) for i, x in enumerate(addresses)), 2.0, 0.005)
            assert took < 0.5, took  # one interval + a flush + a Redis hop, and noise
            assert max(max_row_age(a), max_row_age(b)) < 0.3
            assert a.coordinator.stats.scrapes_sent + b.coordinator.stats.scrapes_sent > 0
            assert a.sharing.stats.used + b.sharing.stats.used > 0


async def _takeover(stand_ins: list[StandInPod], how: str) -> None:
    addresses = [p.address for p in stand_ins]
    with redis_server() as redis:
        config = scrape_config(addresses, redis.url)
        replicas = [Scraper.make(config, name) for name in ("a", "b", "c")]
        for r in replicas:
            r.start()
        try:
            await eventually(lambda: settled(*replicas), 10)
            # the owner of the first pod goes (so it owns at least that one)
            victim = next(r for r in replicas
                          if r.sharing.ownership.owner(addresses[0]) == r.name)
            survivors = [r for r in replicas if r is not victim]
            held = [x for x in addresses if victim.sharing.ownership.owner(x) == victim.name]
            before = {x: [r.own_scrapes(x) for r in survivors] for x in held}
            if how == "kill":
                await victim.kill()
            else:
                await victim.stop()
            gone = time.monotonic()
            # killed: at once (its results overdue) both survivors scrape its pods
            # themselves until it is judged dead; stopped: its bye hands them over
            wanted = len(survivors) if how == "kill" else 1
            took = await eventually(lambda: all(
                sum(r.own_scrapes(x) > n for r, n in zip(survivors, before[x], strict=True))
                >= wanted for x in held), 3.0, 0.005)
            assert took <= FALLBACK_BOUND_S + SLACK_S, took
            # the pods get one owner among the survivors (killed: once silent for
            # replicaTimeout) and the fallback scraping ends; all along, routing never
            # goes blind: every row stays fresh on every survivor
            handover = None
            while handover is None or time.monotonic() - gone < 1.5:
                assert max(max_row_age(r) for r in survivors) < FALLBACK_BOUND_S + SLACK_S
                if handover is None and settled(*survivors):
                    handover = time.monotonic() - gone
                assert time.monotonic() - gone < REPLICA_TIMEOUT_S + 5.0, "never settled"
                await asyncio.sleep(0.01)
            silent = REPLICA_TIMEOUT_S if how == "kill" else 0.0
            assert handover <= silent + MEMBERS_REFRESH_S + FALLBACK_BOUND_S + SLACK_S, handover
            names = {r.name for r in survivors}
            for x in addresses:
                seen = {r.sharing.ownership.owner(x) for r in survivors}
                assert len(seen) == 1 and seen <= names, (x, seen)
        finally:
            for r in replicas:
                await r.stop()


async def test_a_killed_owner_is_taken_over_within_the_stated_bound(stand_ins):
    await _takeover(stand_ins, "kill")


async def test_a_stopped_owner_hands_its_pods_over_at_once(stand_ins):
    await _takeover(stand_ins, "stop")


async def test_with_redis_down_every_replica_scrapes_every_pod_and_sharing_comes_back(
        stand_ins):
    addresses = [p.address for p in stand_ins]
    with redis_server() as redis:
        async with started_pair(scrape_config(addresses, redis.url)) as (a, b):
            await eventually(lambda: settled(a, b), 10)
            redis.stop()
            await eventually(lambda: not a.coordinator.stats.connected
                             and not b.coordinator.stats.connected, 5)
            await asyncio.sleep(2 * INTERVAL_S)
            before = {x: (a.own_scrapes(x), b.own_scrapes(x)) for x in addresses}
            await asyncio.sleep(0.5)
            for x in addresses:
                assert a.own_scrapes(x) > before[x][0] + 3 and \
                    b.own_scrapes(x) > before[x][1] + 3, x
            assert a.roles()[SHARED] == 0 and b.roles()[SHARED] == 0
            assert max(max_row_age(a), max_row_age(b)) < 0.3
            redis.start()
            await eventually(lambda: settled(a, b), 15)


async def test_a_replica_that_does_not_share_is_left_no_pod(stand_ins):
    """One replica configured `shareScrapes: false` beside one that shares: the sharing
    one owns every pod (no fallbacks), the other scrapes every pod itself."""
    addresses = [p.address for p in stand_ins]
    with redis_server() as redis:
        prefix = f"igw-test-{time.monotonic_ns()}"
        on = Scraper.make(scrape_config(addresses, redis.url, prefix=prefix), "a")
        off = Scraper.make(scrape_config(addresses, redis.url, prefix=prefix,
                                         shareScrapes=False), "b")
        for r in (on, off):
            r.start()
        try:
            await eventually(lambda: on.coordinator.replicas.live(time.monotonic()) == ["b"]
                             and off.coordinator.replicas.live(time.monotonic()) == ["a"], 10)
            await asyncio.sleep(3 * MEMBERS_REFRESH_S)
            before = {x: (on.own_scrapes(x), off.own_scrapes(x)) for x in addresses}
            fallbacks = on.sharing.stats.fallbacks
            await asyncio.sleep(0.5)
            assert on.sharing.ownership.members == ("a",)
            assert on.roles()[OWNER] == PODS and on.sharing.stats.fallbacks == fallbacks
            for x in addresses:
                assert on.own_scrapes(x) > before[x][0] + 3, x
                assert off.own_scrapes(x) > before[x][1] + 3, x
        finally:
            for r in (on, off):
                await r.stop()


async def test_host_clock_skew_neither_ages_results_nor_kills_peers(stand_ins):
    """Replica b's wall clock 2 s ahead (beyond replicaTimeout, 18x the freshness
    window): entries are aged on the Redis server's clock, so the pair settles as
    with synchronised hosts; by the wall clocks b would judge a dead and a's results
    late (every pod b does not own in fallback)."""
    addresses = [p.address for p in stand_ins]
    with redis_server() as redis:
        prefix = f"igw-test-{time.monotonic_ns()}"
        a = Scraper.make(scrape_config(addresses, redis.url, prefix=prefix), "a")
        b = Scraper.make(scrape_config(addresses, redis.url, prefix=prefix), "b", skew_s=2.0)
        for r in (a, b):
            r.start()
        try:
            await eventually(lambda: settled(a, b), 10)
            fallbacks = a.sharing.stats.fallbacks + b.sharing.stats.fallbacks
            await asyncio.sleep(1.0)
            assert settled(a, b)
            # Aged by the wall clocks, b would fall back on its 3 unowned pods at every
            # tick (~60 in this second); a stall of a loaded host may cost each pod one.
            assert a.sharing.stats.fallbacks + b.sharing.stats.fallbacks <= fallbacks + PODS
            assert abs(b.coordinator.clock.offset_s + 2.0) < 0.05
            assert b.coordinator.stats.lag_s < 0.3 and a.coordinator.stats.lag_s < 0.3
        finally:
            for r in (a, b):
                await r.stop()


async def test_sharing_is_off_without_the_setting_or_the_collector():
    address = "10.0.0.1:8000"
    off = Scraper.make(scrape_config([address], shareScrapes=False), "b")
    assert off.coordinator.scrapes is None
    assert off.coordinator.status()["share_scrapes"] is False
    off.coordinator.start()  # (its Redis is unreachable: it goes on retrying, routing alone)
    assert off.collector.sharing is None  # the collector scrapes every pod
    await off.coordinator.stop()
    (entry,) = encode_batches([], 0, time.time(), scrapes=[
        SharedScrape(POOL, address, 0.0, snapshot(9.0))])
    off.coordinator.folder.fold("a", decode_batch(entry), time.monotonic(), 0.0)
    assert off.pool.table.waiting[off.row(address)] == 0  # another replica's result ignored
    # the routing-only harness (no collector) has nothing to share either
    director = Director(Datastore(scrape_config([address])), GatewayMetrics())
    assert Coordinator(scrape_config([address]), director).scrapes is None
    # on: start() hands the collector its sharing, stop() takes it back
    on = Scraper.make(scrape_config([address]), "b")
    on.coordinator.start()
    assert on.collector.sharing is on.sharing
    await on.coordinator.stop()
    assert on.collector.sharing is None
    assert MetricsConfig().interval_s == INTERVAL_S  # the bounds above assume the default
