"""Per-tenant limits that hold across every gateway replica, checked without a round trip.

What is limited, per (tenant, model) key ("" as the model: tenant-wide; a request
is checked against both): requests per minute, tokens per minute (the reservation
made at admission, prompt tokens + `max_tokens`, optionally corrected with the real
usage when Envoy's access log reports it, picker.tenants.usage) and concurrent
requests.

Why local counters (docs/ratelimits.md has the measurement): asking Redis, or a
rate-limit service that asks Redis, on every request adds a round trip to the
request path; here `admit` is a few dict lookups and additions on this replica's
counters, and a background task (picker.tenants.limits_sync) exchanges them with
the other replicas through Redis every `sync_interval_s` in one script call.

Windows: one-minute windows aligned on the shared clock (Redis TIME once synced),
counted as a *sliding window counter*: the estimate at fraction f of the current
window is prev · (1 − f) + cur. Under steady load it admits exactly the limit
per minute; its error is the assumption that the previous window's traffic was
spread evenly (a burst at the end of a window can let through up to twice the
limit in the 60 s straddling the boundary, never more than the limit per
calendar window plus the previous one's weighted share).

Replicas: each replica admits against an allowance it claimed at its last sync
(`headroom`, per key and per rate or concurrency), never against a count it
would have to ask for. Claims are made in one atomic script call per sync, each
seeing the others' current claims, so the live replicas' claims never add up
past what is left of the limit: the total overshoot is zero by construction
(up to the sliding estimate's own error and the clock offset). A claim is the
replica's demand (what it was asked for in the last interval, doubled) plus an
equal part of what nobody asked for, or, when the demands exceed what is
unused, a demand-weighted share of it (nothing for a replica asked for nothing,
so traffic that reaches one replica only still gets the whole limit).
Concurrency is a level, not a count: each replica publishes its in-flight count
per key under its name; a replica that stops syncing drops out of the live set
after `replica_ttl_s`, its in-flight count and its claims with it.

A replica keeps spending what is left of its claim while a sync is in flight, so
Redis keeps holding at least that for it until the next sync (limits_sync): a sync
that is slow, or fails after Redis applied it, cannot let the total overshoot.
Redis unreachable for `stale_after_s`: `failure_mode` "open" keeps enforcing, on
this replica's own counts alone, its share of each limit (limit ÷ the replicas
last seen live, rounded up): the total holds if every replica lost Redis, a
tenant that reaches only one replica gets that share. "closed" refuses every
request of a limited key with 503 `rate_limit_unavailable` and Retry-After
(the client did not exceed anything: a 429 would tell it otherwise).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from contract.config import CoordinationConfig, RateLimits
from contract.errors import ApiError, echo

if TYPE_CHECKING:
    from picker.tenants.limits_sync import LimitSync

log = logging.getLogger("picker.tenants.limits")

__all__ = [
    "FAILURE_MODES",
    "Grant",
    "Limiter",
    "LimitsUnavailable",
    "RateLimited",
    "format_reset",
]

FAILURE_MODES = ("open", "closed")
WINDOW_S = 60.0
# Background exchange with Redis: the staleness of the other replicas' counts.
SYNC_INTERVAL_S = 0.05
# A replica silent this long is dead: its in-flight requests stop counting.
REPLICA_TTL_S = 3.0
# No successful sync for this long: Redis counts as down and failure_mode applies.
STALE_AFTER_S = 1.0


def format_reset(seconds: float) -> str:
    """A duration as OpenAI's x-ratelimit-reset-* headers write it: `12ms`, `1s`, `6m0s`."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    minutes, rest = divmod(round(seconds, 3), 60)
    secs = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{secs}s" if minutes else f"{secs}s"


class RateLimited(ApiError):
    """429: the tenant (or tenant x model) is over one of its limits.

    `headers` are the x-ratelimit-* headers of the key that refused; they are also the
    instance's `extra_headers`, so contract.errors.error_headers sends them.
    """

    status = 429
    error_type = "requests"
    code = "rate_limit_exceeded"
    default_retry_after = 1

    def __init__(self, message: str, *, retry_after: int,
                 headers: list[tuple[str, str]]) -> None:
        super().__init__(message, retry_after=retry_after)
        self.headers = headers
        self.extra_headers = tuple(headers)


class TokensRateLimited(RateLimited):
    """429 on tokens per minute (OpenAI's error type `tokens`)."""

    error_type = "tokens"


class LimitsUnavailable(ApiError):
    """503 under failure_mode "closed": the shared counts cannot be checked right now."""

    status = 503
    error_type = "server_error"
    code = "rate_limit_unavailable"
    default_retry_after = 1


class _Window:
    """One rate (requests or tokens) of one key: two fixed windows, sliding estimate.

    Per slot (window index parity): `seen` the global total at the last sync,
    `mine` this replica's own total, `synced` what `mine` was when that total
    was read; global estimate = seen + mine − synced. With Redis, admission
    spends `headroom`, the allowance this replica claimed at its last sync
    (limits_sync: the claims of all live replicas never add up past the limit);
    `spent` is what it admitted since.
    """

    __slots__ = ("attempted", "headroom", "limit", "mine", "seen", "spent", "synced", "win")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.win = [-1, -1]
        self.seen = [0, 0]
        self.mine = [0, 0]
        self.synced = [0, 0]
        self.headroom = 0.0
        self.spent = 0
        # cost asked for since the last sync, admitted or not: the next claim's demand
        self.attempted = 0

    def slot(self, w: int) -> int:
        s = w & 1
        if self.win[s] != w:
            self.win[s] = w
            self.seen[s] = self.mine[s] = self.synced[s] = 0
        return s

    def global_pair(self, w: int) -> tuple[float, float]:
        """(previous, current) window totals as this replica knows them now."""
        c, p = self.slot(w), self.slot(w - 1)
        return (self.seen[p] + self.mine[p] - self.synced[p],
                self.seen[c] + self.mine[c] - self.synced[c])

    def allows(self, w: int, f: float, cost: int) -> bool:
        """This replica alone (no Redis configured): the estimate against the limit."""
        prev, cur = self.global_pair(w)
        return prev * (1.0 - f) + cur + cost <= self.limit

    def allows_claimed(self, cost: int) -> bool:
        """Synced with the other replicas: within the claimed headroom."""
        self.attempted += cost
        return self.spent + cost <= self.headroom

    def allows_alone(self, w: int, f: float, cost: int, replicas: int) -> bool:
        """Redis down, failure mode open: own counts against this replica's share."""
        c, p = self.slot(w), self.slot(w - 1)
        own = self.mine[p] * (1.0 - f) + self.mine[c]
        return own + cost <= math.ceil(self.limit / max(1, replicas))

    def add(self, w: int, cost: int) -> None:
        s = self.slot(w)
        self.mine[s] += cost
        self.spent += cost

    def correct(self, w: int, delta: int) -> None:
        s = w & 1
        if self.win[s] == w:
            self.mine[s] = max(0, self.mine[s] + delta)

    def remaining(self, w: int, f: float) -> int:
        prev, cur = self.global_pair(w)
        return max(0, math.floor(self.limit - prev * (1.0 - f) - cur))

    def reset_s(self, w: int, f: float, window_s: float) -> float:
        """Until the estimate is back to zero (OpenAI: "resets to its initial state")."""
        prev, cur = self.global_pair(w)
        if cur > 0:
            return (2.0 - f) * window_s
        return (1.0 - f) * window_s if prev > 0 else 0.0

    def wait_s(self, w: int, f: float, cost: int, window_s: float) -> float:
        """Until `cost` more fits under the limit (the Retry-After of a refusal)."""
        prev, cur = self.global_pair(w)
        room = self.limit - cost
        if cost > self.limit:
            return self.reset_s(w, f, window_s)
        if cur <= room:  # later in this window, as the previous one's weight decays
            at = 1.0 - (room - cur) / prev if prev > 0 else f
            return max(0.0, at - f) * window_s
        # next window: cur becomes the previous one and decays
        return (1.0 - f + 1.0 - room / cur) * window_s


class _Key:
    """One limited (tenant, model): its rates and its concurrency.

    Concurrency is a level: `inflight` here, `conc_seen` the live replicas' sum at
    the last sync (this one's `conc_synced` included), `conc_headroom` the slots
    beyond `conc_synced` this replica claimed then.
    """

    __slots__ = ("conc_attempted", "conc_headroom", "conc_seen", "conc_synced", "dirty",
                 "inflight", "limits", "model", "name", "requests", "tenant", "tokens")

    def __init__(self, tenant: str, model: str, limits: RateLimits) -> None:
        self.tenant = tenant
        self.model = model
        # the Redis field name: tenants and models never contain '|' (contract.config)
        self.name = f"{tenant}|{model}"
        self.inflight = 0
        self.conc_seen = 0
        self.conc_synced = 0
        self.conc_headroom = 0
        self.conc_attempted = 0
        # used since the last sync: the next sync carries it (limits_sync)
        self.dirty = True
        self.requests: _Window | None = None
        self.tokens: _Window | None = None
        self.limits = limits
        self.apply(limits)

    def apply(self, limits: RateLimits) -> None:
        """New limits, counts kept (a reload must not hand out a fresh minute)."""
        self.limits = limits
        self.requests = self._rate(self.requests, limits.requests_per_minute)
        self.tokens = self._rate(self.tokens, limits.tokens_per_minute)

    @staticmethod
    def _rate(old: _Window | None, limit: int | None) -> _Window | None:
        if limit is None:
            return None
        if old is None:
            return _Window(limit)
        old.limit = limit
        return old

    def conc_allows(self, mode: int, replicas: int) -> bool:
        cap = self.limits.max_concurrent_requests
        if cap is None:
            return True
        if mode == _LOCAL:
            return self.inflight + 1 <= cap
        if mode == _ALONE:
            return self.inflight + 1 <= math.ceil(cap / max(1, replicas))
        self.conc_attempted += 1
        return self.inflight - self.conc_synced + 1 <= self.conc_headroom

    def who(self) -> str:
        return f"tenant `{echo(self.tenant)}`" + (
            f" on model `{echo(self.model)}`" if self.model else "")


# How admission decides: no Redis configured, synced claims, Redis lost (open).
_LOCAL, _CLAIMED, _ALONE = 0, 1, 2


class Grant:
    """What one admitted request holds: the keys it counted in, its window, its tokens."""

    __slots__ = ("corrected", "keys", "released", "tokens", "window", "window_f")

    def __init__(self, keys: tuple[_Key, ...], window: int, window_f: float,
                 tokens: int) -> None:
        self.keys = keys
        self.window = window
        self.window_f = window_f
        self.tokens = tokens
        self.released = False
        self.corrected = False


class Limiter:
    """The request path's side: `admit` and `release`, both O(1), no I/O.

    `start(redis)` adds the background sync with the other replicas; without it
    (or before it) the limits hold on this replica alone.
    """

    def __init__(self, *, failure_mode: str = "open", clock: Callable[[], float] = time.monotonic,
                 window_s: float = WINDOW_S, sync_interval_s: float = SYNC_INTERVAL_S,
                 replica_ttl_s: float = REPLICA_TTL_S, stale_after_s: float = STALE_AFTER_S,
                 wall_offset: float | None = None) -> None:
        if failure_mode not in FAILURE_MODES:
            raise ValueError(f"failure_mode must be one of {FAILURE_MODES}")
        self.failure_mode = failure_mode
        self.clock = clock
        self.window_s = window_s
        self.sync_interval_s = sync_interval_s
        self.replica_ttl_s = replica_ttl_s
        self.stale_after_s = stale_after_s
        # shared time = clock() + offset: wall time until Redis TIME replaces it
        self.offset = time.time() - clock() if wall_offset is None else wall_offset
        self.keys: dict[str, dict[str, _Key]] = {}
        self.replicas = 1
        # set by the sync: Redis expected, synced at least once, when it last answered
        self.shared = False
        self.synced_once = False
        self.last_ok = 0.0
        self.refused = {"requests": 0, "tokens": 0, "concurrency": 0, "unavailable": 0}
        self.admitted = 0
        self._sync: LimitSync | None = None

    # -- configuration -----------------------------------------------------------------

    def configure(self, limits: Mapping[tuple[str, str], RateLimits]) -> None:
        """Replace the limit table; surviving keys keep their counts and in-flight."""
        table: dict[str, dict[str, _Key]] = {}
        for (tenant, model), rl in limits.items():
            if (rl.requests_per_minute is None and rl.tokens_per_minute is None
                    and rl.max_concurrent_requests is None):
                continue
            old = self.keys.get(tenant, {}).get(model)
            if old is not None:
                old.apply(rl)
                key = old
            else:
                key = _Key(tenant, model, rl)
            table.setdefault(tenant, {})[model] = key
        self.keys = table

    def all_keys(self) -> list[_Key]:
        return [k for models in self.keys.values() for k in models.values()]

    # -- request path ------------------------------------------------------------------

    def window_at(self, now: float) -> tuple[int, float]:
        t = (now + self.offset) / self.window_s
        w = math.floor(t)
        return w, t - w

    def _mode(self, now: float) -> int:
        if not self.shared:
            return _LOCAL
        if now - self.last_ok > self.stale_after_s:
            return _ALONE
        # just started, first sync not answered yet: this replica's counts, whole limit
        return _CLAIMED if self.synced_once else _LOCAL

    def admit(self, tenant: str, model: str, tokens: int, now: float) -> Grant:
        """Count one request of `tokens` reserved tokens, or raise RateLimited /
        LimitsUnavailable. Nothing is counted when it raises."""
        models = self.keys.get(tenant)
        if models is None:
            return _UNLIMITED
        tenant_wide = models.get("")
        per_model = models.get(model) if model else None
        keys = tuple(k for k in (tenant_wide, per_model) if k is not None)
        if not keys:
            return _UNLIMITED
        w, f = self.window_at(now)
        mode = self._mode(now)
        if mode == _ALONE and self.failure_mode == "closed":
            self.refused["unavailable"] += 1
            raise LimitsUnavailable(
                "Rate limits cannot be checked right now (shared store unreachable); "
                "retry shortly.", retry_after=1)
        tokens = max(0, int(tokens))
        for key in keys:
            key.dirty = True
        for key in keys:
            self._check(key, keys, w, f, tokens, mode)
        for key in keys:
            if key.requests is not None:
                key.requests.add(w, 1)
            if key.tokens is not None:
                key.tokens.add(w, tokens)
            key.inflight += 1
        self.admitted += 1
        return Grant(keys, w, f, tokens)

    def _check(self, key: _Key, keys: tuple[_Key, ...], w: int, f: float, tokens: int,
               mode: int) -> None:
        n = self.replicas
        for rate, cost, kind in ((key.requests, 1, "requests"), (key.tokens, tokens, "tokens")):
            if rate is None:
                continue
            if mode == _CLAIMED:
                ok = rate.allows_claimed(cost)
            elif mode == _ALONE:
                ok = rate.allows_alone(w, f, cost, n)
            else:
                ok = rate.allows(w, f, cost)
            if not ok:
                self.refused[kind] += 1
                wait = max(1, math.ceil(rate.wait_s(w, f, cost, self.window_s)))
                unit = "requests per min (RPM)" if kind == "requests" else "tokens per min (TPM)"
                cls = RateLimited if kind == "requests" else TokensRateLimited
                raise cls(
                    f"Rate limit reached for {key.who()} on {unit}: Limit {rate.limit}, "
                    f"Requested {cost}. Please try again in {wait}s.",
                    retry_after=wait, headers=self._keys_headers(keys, w, f))
        if not key.conc_allows(mode, n):
            self.refused["concurrency"] += 1
            cap = key.limits.max_concurrent_requests
            raise RateLimited(
                f"Concurrent request limit reached for {key.who()}: Limit {cap}. "
                "Please try again when a request has finished.",
                retry_after=1, headers=self._keys_headers(keys, w, f))

    def release(self, grant: Grant) -> None:
        """The request ended: its concurrency slot frees."""
        if grant.released or not grant.keys:
            return
        grant.released = True
        for key in grant.keys:
            key.dirty = True
            key.inflight = max(0, key.inflight - 1)

    def correct(self, grant: Grant, used_tokens: int) -> None:
        """The request's real use is known (Envoy's access log, after it ended): the
        token reservation becomes `used_tokens` in the window it was counted in, if
        that window still counts. Once per grant; the next sync carries the change."""
        if grant.corrected or not grant.keys:
            return
        grant.corrected = True
        delta = max(0, int(used_tokens)) - grant.tokens
        if not delta:
            return
        for key in grant.keys:
            if key.tokens is not None:
                key.dirty = True
                key.tokens.correct(grant.window, delta)

    def headers(self, grant: Grant) -> list[tuple[str, str]]:
        """OpenAI's x-ratelimit-* headers for an admitted request (the tightest key)."""
        if not grant.keys:
            return []
        return self._keys_headers(grant.keys, grant.window, grant.window_f)

    def _keys_headers(self, keys: tuple[_Key, ...], w: int, f: float) -> list[tuple[str, str]]:
        requests = self._tightest([k.requests for k in keys], w, f)
        tokens = self._tightest([k.tokens for k in keys], w, f)
        return self._headers(requests, tokens, w, f)

    @staticmethod
    def _tightest(rates: list[_Window | None], w: int, f: float) -> _Window | None:
        live = [r for r in rates if r is not None]
        if len(live) <= 1:
            return live[0] if live else None
        return min(live, key=lambda r: r.remaining(w, f))

    def _headers(self, requests: _Window | None, tokens: _Window | None, w: int,
                 f: float) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for rate, kind in ((requests, "requests"), (tokens, "tokens")):
            if rate is not None:
                out += [(f"x-ratelimit-limit-{kind}", str(rate.limit)),
                        (f"x-ratelimit-remaining-{kind}", str(rate.remaining(w, f))),
                        (f"x-ratelimit-reset-{kind}",
                         format_reset(rate.reset_s(w, f, self.window_s)))]
        return out

    # -- shared state ------------------------------------------------------------------

    async def start(self, redis: Any, key_prefix: str, *, replica: str | None = None,
                    timeout_s: float = 0.25) -> None:
        """Sync with the other replicas through `redis` (a redis.asyncio client, or a
        callable returning one) under `key_prefix`; None: this replica's counts only."""
        if redis is None or self._sync is not None:
            return
        from picker.tenants.limits_sync import LimitSync

        self._sync = LimitSync(self, redis, key_prefix, replica=replica, timeout_s=timeout_s)
        self.shared = True
        self.last_ok = self.clock()
        await self._sync.start()

    async def start_shared(self, settings: CoordinationConfig | None, key_prefix: str, *,
                           replica: str | None = None) -> None:
        """Share the limits through the coordination Redis of `settings` (None: this
        replica enforces them alone); a password that cannot be read is logged and the
        limits stay local, since a limiter that will not start must not stop the gateway."""
        if settings is None:
            await self.start(None, "")
            return
        from picker.coordination.bus import BusError, client_factory

        try:
            clients = client_factory(settings, 2)
        except BusError as exc:
            log.error("tenant limits not shared (each replica enforces them alone): %s", exc)
            await self.start(None, "")
            return
        await self.start(clients, key_prefix, replica=replica, timeout_s=settings.timeout_s)

    async def stop(self) -> None:
        if self._sync is not None:
            await self._sync.stop()
            self._sync = None
        self.shared = self.synced_once = False
        self.replicas = 1

    def status(self) -> dict[str, Any]:
        """For metrics and `igw status`: plain numbers and short strings."""
        now = self.clock()
        state = self._mode(now)
        if not self.shared:
            redis, mode = "off", "local"
        elif state == _ALONE:
            redis = "down"
            mode = "own-share" if self.failure_mode == "open" else "refusing"
        elif state == _LOCAL:
            redis, mode = "connecting", "local"
        else:
            redis, mode = "connected", "shared"
        sync = self._sync.stats() if self._sync is not None else {}
        return {
            "redis": redis, "failure_mode": self.failure_mode, "mode": mode,
            "replicas": self.replicas, "keys": len(self.all_keys()),
            "admitted": self.admitted, "refused": dict(self.refused),
            "last_sync_age_s": round(now - self.last_ok, 3) if self.shared else None,
            **sync,
        }


_UNLIMITED = Grant((), 0, 0.0, 0)
