"""The limiter on one replica, no Redis: windows, tokens, concurrency, reload, headers,
the refusals' answers, and what each failure mode does once Redis is lost.

Time is passed to `admit` explicitly and the window clock is pinned (`wall_offset=0`),
so window boundaries are exact: window k covers [60 k, 60 (k + 1)) seconds.
"""

from __future__ import annotations

import orjson
import pytest

from contract.config import RateLimits
from contract.errors import error_body, error_headers
from picker.tenants.limits import (
    Limiter,
    LimitsUnavailable,
    RateLimited,
    TokensRateLimited,
    format_reset,
)

W = 60.0
T0 = 600.0  # the start of window 10


def limiter(table: dict[tuple[str, str], RateLimits], **kw) -> Limiter:
    lim = Limiter(wall_offset=0.0, **kw)
    lim.configure(table)
    return lim


def admitted(lim: Limiter, n: int, now: float, tenant: str = "a", model: str = "m",
             tokens: int = 0) -> int:
    ok = 0
    for _ in range(n):
        try:
            lim.release(lim.admit(tenant, model, tokens, now))
            ok += 1
        except RateLimited:
            pass
    return ok


def test_requests_per_minute_fixed_then_sliding() -> None:
    lim = limiter({("a", ""): RateLimits(requests_per_minute=10)})
    assert admitted(lim, 15, T0 + 1) == 10
    # half-way through the next window the previous one weighs half: 5 more fit
    assert admitted(lim, 15, T0 + W + W / 2) == 5
    # two windows later nothing of window 10 counts; window 11 (5) weighs 1 - 0.25
    assert admitted(lim, 15, T0 + 2 * W + W / 4) == 10 - 4  # 5 * 0.75 = 3.75 -> 6 fit


def test_steady_overload_admits_the_limit_per_window() -> None:
    """Demand twice the limit, spread evenly: each full window admits the limit (±1)."""
    limit = 120
    lim = limiter({("a", ""): RateLimits(requests_per_minute=limit)})
    per_window: dict[int, int] = {}
    steps = 2 * limit
    for k in range(6):
        for i in range(steps):
            now = T0 + k * W + i * W / steps
            per_window[k] = per_window.get(k, 0) + admitted(lim, 1, now)
    for k in range(1, 6):
        assert limit - 1 <= per_window[k] <= limit, per_window


def test_refusal_counts_nothing_and_names_the_limit() -> None:
    lim = limiter({("a", ""): RateLimits(requests_per_minute=2)})
    admitted(lim, 2, T0)
    with pytest.raises(RateLimited) as info:
        lim.admit("a", "m", 0, T0 + 30)
    exc = info.value
    assert exc.status == 429 and exc.code == "rate_limit_exceeded"
    # the window ends in 30 s; the next one starts with the previous weighing 1 - g:
    # 2 (1 - g) + 1 <= 2 -> g >= 0.5, 30 s more
    assert exc.retry_after == 60
    body = orjson.loads(error_body(exc))["error"]
    assert body["type"] == "requests" and body["code"] == "rate_limit_exceeded"
    assert "Limit 2" in body["message"] and "tenant `a`" in body["message"]
    headers = dict(error_headers(exc))
    assert headers["retry-after"] == "60"
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert lim.status()["refused"]["requests"] == 1
    # nothing was counted by the refusal
    assert lim.keys["a"][""].requests.mine[10 & 1] == 2


def test_tokens_reserved_then_corrected_with_the_real_use() -> None:
    lim = limiter({("a", ""): RateLimits(tokens_per_minute=1000)})
    g1 = lim.admit("a", "m", 600, T0)  # prompt + max_tokens
    with pytest.raises(TokensRateLimited) as info:
        lim.admit("a", "m", 600, T0 + 1)
    assert orjson.loads(error_body(info.value))["error"]["type"] == "tokens"
    lim.release(g1)
    lim.correct(g1, 150)  # the real use, reported after the request ended
    lim.correct(g1, 10)  # once per grant
    g2 = lim.admit("a", "m", 600, T0 + 2)
    assert dict(lim.headers(g2))["x-ratelimit-remaining-tokens"] == str(1000 - 150 - 600)
    lim.release(g2)  # no correction: the reservation stays counted
    assert lim.keys["a"][""].tokens.remaining(10, 0.1) == 250


def test_correction_of_a_past_window_is_dropped() -> None:
    lim = limiter({("a", ""): RateLimits(tokens_per_minute=1000)})
    grant = lim.admit("a", "m", 900, T0)
    # corrected three windows later: window 10 no longer counts, nothing to correct
    lim.release(grant)
    lim.correct(grant, 10)
    assert admitted(lim, 1, T0 + 3 * W, tokens=1000) == 1


def test_concurrency_counts_until_release() -> None:
    lim = limiter({("a", ""): RateLimits(max_concurrent_requests=2)})
    g1, g2 = lim.admit("a", "m", 0, T0), lim.admit("a", "m", 0, T0)
    with pytest.raises(RateLimited):
        lim.admit("a", "m", 0, T0)
    lim.release(g1)
    lim.release(g1)  # twice: counted once
    g3 = lim.admit("a", "m", 0, T0)
    with pytest.raises(RateLimited):
        lim.admit("a", "m", 0, T0)
    lim.release(g2)
    lim.release(g3)
    assert lim.keys["a"][""].inflight == 0


def test_tenant_wide_and_per_model_both_hold() -> None:
    lim = limiter({("a", ""): RateLimits(requests_per_minute=5),
                   ("a", "big"): RateLimits(requests_per_minute=2)})
    assert admitted(lim, 3, T0, model="big") == 2
    # the refused third did not count against the tenant-wide limit either
    assert admitted(lim, 5, T0, model="small") == 3
    assert admitted(lim, 1, T0, model="big") == 0


def test_unlimited_tenants_and_models() -> None:
    lim = limiter({("a", ""): RateLimits(), ("b", "m"): RateLimits(requests_per_minute=1)})
    grant = lim.admit("a", "m", 10**9, T0)  # all-None limits: not even a key
    assert lim.headers(grant) == []
    lim.release(grant)
    assert admitted(lim, 50, T0, tenant="nobody") == 50
    assert admitted(lim, 3, T0, tenant="b", model="other") == 3
    assert admitted(lim, 3, T0, tenant="b", model="m") == 1


def test_configure_keeps_counts_of_surviving_keys() -> None:
    lim = limiter({("a", ""): RateLimits(requests_per_minute=10, max_concurrent_requests=5),
                   ("b", ""): RateLimits(requests_per_minute=10)})
    admitted(lim, 8, T0)
    held = lim.admit("a", "m", 0, T0)
    admitted(lim, 10, T0, tenant="b")
    # a's limit lowered, b removed, c added
    lim.configure({("a", ""): RateLimits(requests_per_minute=12, max_concurrent_requests=1),
                   ("c", ""): RateLimits(requests_per_minute=1)})
    assert admitted(lim, 5, T0 + 1) == 0  # the held request fills the new concurrency cap
    lim.release(held)
    assert admitted(lim, 5, T0 + 1) == 3  # 9 counted of 12
    assert admitted(lim, 20, T0 + 1, tenant="b") == 20
    assert admitted(lim, 2, T0 + 1, tenant="c") == 1
    assert set(lim.keys) == {"a", "c"}


def test_headers_names_and_formats() -> None:
    lim = limiter({("a", ""): RateLimits(requests_per_minute=100, tokens_per_minute=5000),
                   ("a", "m"): RateLimits(requests_per_minute=3)})
    grant = lim.admit("a", "m", 500, T0 + 15)
    headers = lim.headers(grant)
    assert [name for name, _ in headers] == [
        "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests", "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"]
    values = dict(headers)
    # the tighter key's requests (tenant x model: 3), the tenant-wide tokens
    assert values["x-ratelimit-limit-requests"] == "3"
    assert values["x-ratelimit-remaining-requests"] == "2"
    assert values["x-ratelimit-remaining-tokens"] == "4500"
    # back to the initial state once this window and the next have passed: 105 s
    assert values["x-ratelimit-reset-requests"] == "1m45s"


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (0.012, "12ms"), (0.0004, "1ms"), (1, "1s"), (1.5, "1.5s"), (59.9994, "59.999s"),
    (360, "6m0s"), (105, "1m45s"), (61.25, "1m1.25s")])
def test_format_reset(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


def test_failure_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="failure_mode"):
        Limiter(failure_mode="maybe")


def lost_redis(failure_mode: str, replicas: int) -> Limiter:
    """A limiter whose Redis answered once (with `replicas` live), long ago."""
    lim = limiter({("a", ""): RateLimits(requests_per_minute=10, max_concurrent_requests=4)},
                  failure_mode=failure_mode, clock=lambda: T0)
    lim.shared = lim.synced_once = True
    lim.replicas = replicas
    lim.last_ok = T0 - 10 * lim.stale_after_s
    return lim


def test_redis_lost_open_enforces_this_replicas_share() -> None:
    lim = lost_redis("open", replicas=3)
    assert lim.status()["mode"] == "own-share" and lim.status()["redis"] == "down"
    assert admitted(lim, 10, T0) == 4  # ceil(10 / 3)
    later = T0 + 3 * W  # window 10 no longer counts
    held = [lim.admit("a", "m", 0, later) for _ in range(2)]  # ceil(4 / 3) = 2 at once
    with pytest.raises(RateLimited):
        lim.admit("a", "m", 0, later)
    for grant in held:
        lim.release(grant)


def test_redis_lost_closed_refuses_limited_keys_only() -> None:
    lim = lost_redis("closed", replicas=2)
    assert lim.status()["mode"] == "refusing"
    with pytest.raises(LimitsUnavailable) as info:
        lim.admit("a", "m", 0, T0)
    exc = info.value
    assert exc.status == 503 and exc.code == "rate_limit_unavailable"
    assert dict(error_headers(exc))["retry-after"] == "1"
    assert admitted(lim, 3, T0, tenant="unlimited") == 3
    assert lim.status()["refused"]["unavailable"] == 1


def test_every_idle_key_is_in_a_sync_within_a_second() -> None:
    """A sync carries the keys used since the last one and a rotating slice of the rest:
    at 20 syncs a second, each of 101 idle keys is carried within 20 syncs."""
    from picker.tenants.limits_sync import IDLE_REFRESH_S, LimitSync

    lim = limiter({(f"t{i}", ""): RateLimits(requests_per_minute=5) for i in range(101)},
                  sync_interval_s=0.05)
    lim.synced_once = True
    sync = LimitSync(lim, None, "p", replica="r", timeout_s=0.1)
    keys = lim.all_keys()
    for key in keys:
        key.dirty = False
    lim.release(lim.admit("t7", "m", 0, T0))  # a used key: in every sync until carried
    seen: set[str] = set()
    syncs = round(IDLE_REFRESH_S / lim.sync_interval_s)
    for n in range(syncs):
        due = sync._due(keys)
        assert len(due) <= 7  # 6 idle (ceil(101 / 20)) + the used one
        if n == 0:
            assert "t7|" in {k.name for k in due}
        for key in due:
            key.dirty = False
        seen |= {k.name for k in due}
    assert seen == {k.name for k in keys}
