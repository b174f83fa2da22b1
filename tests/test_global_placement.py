"""The global router's region table, filters and placement (globalrouter.regions,
globalrouter.placement) on hand-written load summaries; the poller's summary checks."""

from __future__ import annotations

import math

import orjson
import pytest

from contract.errors import NoEligibleRegion
from contract.global_config import parse_global_config
from globalrouter.placement import allow_list, place
from globalrouter.poller import SummaryError, parse_summary
from globalrouter.regions import RegionTable

M = "llama"
NOW = 1000.0


def _table(models=None, **spec) -> RegionTable:
    regions = [
        {"name": "near", "endpoint": "127.0.0.2:1", "tags": {"residency": "us"},
         "costs": {M: {"perMillionTokens": 0.30}}},
        {"name": "mid", "endpoint": "127.0.0.3:1", "tags": {"residency": "us"},
         "costs": {M: {"perMillionTokens": 0.20}}},
        {"name": "far", "endpoint": "127.0.0.4:1", "tags": {"residency": "eu"},
         "costs": {M: {"perMillionTokens": 0.10}}},
    ]
    doc = {"apiVersion": "inference-gateway.io/v1alpha1", "kind": "GlobalRouterConfig",
           "spec": {"regions": regions, "models": models or [
               {"name": M, "policy": "cheapest-within-slo", "ttftSlo": "500ms"}], **spec}}
    return RegionTable(parse_global_config(doc))


def _summary(ttft: float | None, generation: int = 1, ready: int = 2, saturation: float = 0.1,
             saturated: bool = False, adapters=(), model: str = M) -> dict:
    return {"version": 1, "generation": generation, "serving": True, "pools": [{
        "pool": "p", "model": model, "adapters": list(adapters), "pods": 2, "readyPods": ready,
        "saturation": saturation, "saturated": saturated, "predictedTtftS": ttft}]}


def _feed(table: RegionTable, ttfts: dict[str, float], rtts: dict[str, float] | None = None,
          **summary) -> None:
    for name, ttft in ttfts.items():
        rtt = (rtts or {}).get(name, 0.01)
        table.record_ok(table.index[name], _summary(ttft, **summary), rtt, NOW)


def _place(table: RegionTable, header: str | None = None, count: int = 3, now: float = NOW):
    policy = table.config.policy_for(M)
    return place(table, M, table.views[M], policy, allow_list(table, header), now, count, header)


def test_cheapest_region_within_the_slo_first_then_by_speed():
    table = _table()
    _feed(table, {"near": 0.05, "mid": 0.10, "far": 0.30}, {"far": 0.10})
    placed = _place(table)
    assert placed.names == ("far", "mid", "near")  # all within 500 ms: by price
    assert placed.meets_slo and math.isclose(placed.predicted_ttft_s, 0.40)
    assert placed.addresses[0] == "127.0.0.4:1"


def test_a_region_missing_the_slo_goes_after_those_meeting_it_and_rtt_counts():
    table = _table()
    # far's own TTFT fits, but with its RTT it misses the 500 ms SLO
    _feed(table, {"near": 0.05, "mid": 0.10, "far": 0.30}, {"far": 0.25})
    assert _place(table).names == ("mid", "near", "far")


def test_none_meets_the_slo_then_the_fastest_first():
    table = _table()
    _feed(table, {"near": 0.9, "mid": 0.7, "far": 2.0})
    placed = _place(table)
    assert placed.names == ("mid", "near", "far") and not placed.meets_slo


def test_fastest_policy_ignores_price():
    table = _table(models=[{"name": M, "policy": "fastest"}])
    _feed(table, {"near": 0.05, "mid": 0.03, "far": 0.30})
    assert _place(table).names == ("mid", "near", "far")


def test_a_saturated_region_is_spilled_over_to_the_back():
    table = _table()
    _feed(table, {"near": 0.05, "mid": 0.10})
    table.record_ok(table.index["far"], _summary(0.1, saturation=1.2), 0.01, NOW)
    assert _place(table).names == ("mid", "near", "far")
    table.record_ok(table.index["far"], _summary(0.1, generation=2, saturated=True), 0.01, NOW)
    assert _place(table).names[-1] == "far"
    # every region saturated: still placed (Tier 1 queues or sheds), cheapest first
    for name in ("near", "mid"):
        table.record_ok(table.index[name], _summary(0.1, generation=3, saturation=2.0), 0.01, NOW)
    assert _place(table).names[0] == "far"


def test_count_bounds_the_retry_list():
    table = _table()
    _feed(table, {"near": 0.05, "mid": 0.10, "far": 0.30})
    assert _place(table, count=2).names == ("far", "mid")


def test_the_allow_list_only_narrows():
    table = _table()
    _feed(table, {"near": 0.05, "mid": 0.10, "far": 0.30})
    assert _place(table, " near , mid").names == ("mid", "near")
    assert _place(table, "near,unknown").names == ("near",)
    for header in ("", "unknown", " , "):
        with pytest.raises(NoEligibleRegion, match="x-gateway-regions"):
            _place(table, header)


def test_residency_filter_names_the_residency():
    table = _table(models=[{"name": M, "residency": ["eu"]}])
    _feed(table, {"near": 0.05, "mid": 0.10, "far": 0.30})
    assert _place(table).names == ("far",)
    table.record_failure(table.index["far"], "refused")
    with pytest.raises(NoEligibleRegion, match="residency eu"):
        _place(table)


def test_stale_failed_drained_and_unready_regions_are_filtered():
    table = _table()
    _feed(table, {"near": 0.05, "mid": 0.10, "far": 0.30})
    stale = NOW + table.config.polling.stale_after_s + 0.01
    with pytest.raises(NoEligibleRegion, match="no region has a fresh load summary"):
        _place(table, now=stale)
    table.record_failure(table.index["far"], "ClientConnectorError: refused")
    assert "far" not in _place(table).names
    table.record_ok(table.index["mid"], _summary(0.1, generation=2, ready=0), 0.01, NOW)
    assert _place(table).names == ("near",)
    table.drained[table.index["near"]] = True
    with pytest.raises(NoEligibleRegion, match="drained"):
        _place(table)


def test_a_summary_whose_generation_stops_moving_ages_out():
    table = _table()
    row = table.index["near"]
    table.record_ok(row, _summary(0.05, generation=7), 0.01, NOW)
    table.record_ok(row, _summary(0.05, generation=7), 0.01, NOW + 1.5)  # same document
    stale_after = table.config.polling.stale_after_s
    assert table.fresh(NOW + stale_after - 0.01)[row]
    assert not table.fresh(NOW + stale_after + 0.01)[row]
    table.record_ok(row, _summary(0.05, generation=8), 0.01, NOW + 5)
    assert table.fresh(NOW + 5)[row]


def test_a_draining_region_is_unknown_at_once():
    table = _table()
    row = table.index["near"]
    table.record_ok(row, _summary(0.05), 0.01, NOW)
    draining = {**_summary(0.05, generation=2), "serving": False}
    table.record_ok(row, draining, 0.01, NOW + 0.1)
    assert not table.fresh(NOW + 0.1)[row]


def test_rtt_is_the_median_of_recent_polls():
    table = _table()
    row = table.index["near"]
    for i, rtt in enumerate((0.02, 0.02, 0.5, 0.02, 0.03)):
        table.record_ok(row, _summary(0.05, generation=i), rtt, NOW)
    assert table.rtt_s[row] == pytest.approx(0.02)


def test_adapters_are_served_names_and_hostile_figures_are_ignored():
    table = _table()
    row = table.index["near"]
    summary = _summary(0.05, adapters=["sql-lora"])
    summary["pools"][0]["saturation"] = "high"
    summary["pools"][0]["readyPods"] = float("nan")
    summary["pools"].append({"model": 5, "adapters": None})
    table.record_ok(row, summary, 0.01, NOW)
    assert set(table.models()) == {M, "sql-lora"}
    view = table.views["sql-lora"]
    assert view.serves[row] and not view.ready[row] and view.saturation[row] == 0.0
    assert math.isinf(view.cost[row])  # no price for the adapter: last among equals


@pytest.mark.parametrize(("body", "message"), [
    (b"{", "not JSON"),
    (b"[]", "not a version 1"),
    (b'{"version": 2, "pools": [], "generation": 1}', "not a version 1"),
    (b'{"version": 1, "pools": {}, "generation": 1}', "needs `pools`"),
    (b'{"version": 1, "pools": [], "generation": "1"}', "needs `pools`"),
    (b'{"version": 1, "pools": [3], "generation": 1}', "every pool entry"),
])
def test_the_poller_refuses_what_is_not_a_summary(body: bytes, message: str):
    with pytest.raises(SummaryError, match=message):
        parse_summary(body)
    assert parse_summary(orjson.dumps(_summary(0.1)))["generation"] == 1


def test_one_timeout_is_tolerated_a_second_is_not():
    table = _table()
    row = table.index["near"]
    table.record_ok(row, _summary(0.05), 0.01, NOW)
    table.record_failure(row, "TimeoutError", definite=False)
    assert table.fresh(NOW)[row]
    table.record_failure(row, "TimeoutError", definite=False)
    assert not table.fresh(NOW)[row]
    table.record_ok(row, _summary(0.05, generation=2), 0.01, NOW)
    table.record_failure(row, "ClientConnectorError: refused")
    assert not table.fresh(NOW)[row]


def test_an_overdue_poll_makes_the_region_suspect_and_placed_last():
    """The cheapest region's poll goes out and does not come back: past its bound
    (4 RTTs, at least 0.3 s) it is placed after the others, before any timeout; the
    answer arriving in time clears it."""
    table = _table()
    _feed(table, {"near": 0.05, "mid": 0.10, "far": 0.30}, {"far": 0.05})
    far = table.index["far"]
    table.poll_sent(far, NOW)
    assert _place(table, now=NOW + 0.25).names[0] == "far"  # within the floor
    assert _place(table, now=NOW + 0.35).names == ("mid", "near", "far")
    assert table.fresh(NOW + 0.35)[far]  # still fresh: a fallback of last resort
    assert table.describe(NOW + 0.35)[far]["suspect"]
    table.record_ok(far, _summary(0.30, generation=2), 0.05, NOW + 0.2)
    assert _place(table, now=NOW + 0.4).names[0] == "far"


def test_the_suspect_bound_follows_the_region_rtt_up_to_the_timeout():
    table = _table()
    _feed(table, {"near": 0.05, "mid": 0.10, "far": 0.05}, {"far": 0.2})
    far = table.index["far"]
    table.poll_sent(far, NOW)
    assert not table.suspect(NOW + 0.75)[far]  # 4 x 200 ms
    assert table.suspect(NOW + 0.85)[far]
    _feed(table, {"far": 0.05}, {"far": 0.6}, generation=2)
    _feed(table, {"far": 0.05}, {"far": 0.6}, generation=3)
    table.poll_sent(far, NOW)
    assert table.suspect_after_s[far] == table.config.polling.timeout_s  # capped at 1 s
    assert table.suspect(NOW + 1.05)[far]


def test_a_failed_or_slow_poll_keeps_the_region_suspect_until_a_good_one():
    table = _table()
    _feed(table, {"near": 0.05, "mid": 0.10, "far": 0.30}, {"far": 0.05})
    far = table.index["far"]
    table.record_failure(far, "TimeoutError", definite=False)
    assert table.fresh(NOW)[far] and table.suspect(NOW)[far]  # one timeout: still fresh
    assert _place(table).names[-1] == "far"
    table.record_ok(far, _summary(0.30, generation=2), 0.9, NOW)  # answered, but slowly
    assert table.suspect(NOW)[far] and _place(table).names[-1] == "far"
    table.record_ok(far, _summary(0.30, generation=3), 0.05, NOW)
    assert not table.suspect(NOW)[far] and _place(table).names[0] == "far"


def test_a_region_turned_slow_is_suspect_then_placed_by_its_new_rtt():
    """10 ms → 800 ms: suspect from the first slow poll; once 800 ms is the median it is
    no longer an anomaly, and its RTT itself keeps it behind the regions that meet the
    SLO (500 ms here)."""
    table = _table()
    far = table.index["far"]
    for generation in range(1, 6):
        _feed(table, {"near": 0.05, "mid": 0.10, "far": 0.05}, generation=generation)
    for generation in range(6, 12):
        table.record_ok(far, _summary(0.05, generation=generation), 0.8, NOW)
        assert _place(table).names[-1] == "far", generation
    assert not table.suspect(NOW)[far]  # the median moved: placed by its RTT now
    assert table.rtt_s[far] == pytest.approx(0.8)


def test_when_every_region_is_suspect_the_policy_order_stands():
    """A stalled router sees every poll overdue at once: nothing is dropped for it."""
    table = _table()
    _feed(table, {"near": 0.05, "mid": 0.10, "far": 0.30}, {"far": 0.05})
    for row in range(len(table)):
        table.poll_sent(row, NOW)
    assert table.suspect(NOW + 0.9).all()
    assert _place(table, now=NOW + 0.9).names == ("far", "mid", "near")


def test_the_poller_marks_a_region_that_stops_answering_suspect_before_its_timeout():
    """A real poller against a listener that accepts and then says nothing (a hung
    region: the TLS handshake never completes): the region is suspect once its poll is
    0.3 s old (not before), well before the 1 s timeout fails it."""
    import asyncio
    import time

    from globalrouter.poller import SummaryPoller
    from igw.ports import free_port

    async def main() -> tuple[bool, bool, int]:
        async def silent(reader, _writer):
            await reader.read()  # until the poller gives up

        port = free_port()
        server = await asyncio.start_server(silent, "127.0.0.1", port)
        config = parse_global_config({
            "apiVersion": "inference-gateway.io/v1alpha1", "kind": "GlobalRouterConfig",
            "spec": {"regions": [{"name": "hung", "endpoint": f"127.0.0.1:{port}"}]}})
        table = RegionTable(config)
        poller = SummaryPoller(config, table)
        poller.start()
        try:
            await asyncio.sleep(0.15)
            early = bool(table.suspect(time.monotonic())[0])
            await asyncio.sleep(0.35)
            later = bool(table.suspect(time.monotonic())[0])
            failures = table.status[0].failures  # the 1 s timeout has not fired yet
        finally:
            await poller.stop()
            server.close()
            await server.wait_closed()
        return early, later, failures

    early, later, failures = asyncio.run(main())
    assert not early and later and failures == 0


def test_igw_global_status_marks_a_suspect_region():
    from igw.cli import region_line

    table = _table()
    _feed(table, {"near": 0.05, "mid": 0.10, "far": 0.30})
    table.record_failure(table.index["far"], "TimeoutError", definite=False)
    lines = [region_line(r) for r in table.describe(NOW)]
    assert lines[2].startswith("far") and " fresh suspect rtt=10.0ms" in lines[2]
    assert "suspect" not in lines[0] and " fresh rtt=10.0ms  llama ready=2/2" in lines[0]
