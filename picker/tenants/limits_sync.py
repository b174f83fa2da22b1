"""The limiter's background exchange with the other replicas: one Redis script call.

Every `sync_interval_s` (and never on the request path) the replica sends, per
limited key, its own totals for the current and the previous window and its
in-flight count, and reads back the global totals, in one EVALSHA:

- window counts: a hash per (window, key), `<prefix>:rl:w:<window>:<key>`, field
  `r|<replica>` / `t|<replica>` = that replica's requests / tokens in the window.
  Absolute values, not increments: a sync that timed out after Redis applied it
  is harmless when repeated, and a Redis that restarted empty gets every
  replica's counts back at its next sync. Expires two windows after its last write;
- concurrency: `<prefix>:rl:c:<key>`, field `<replica>` = its in-flight requests,
  summed over the live replicas only;
- liveness: `<prefix>:rl:replicas`, a sorted set of replica → Redis time (ms) of its
  last sync; members silent for `replica_ttl_s` are removed (and their in-flight
  fields), so a dead replica's concurrency ages out within replica_ttl_s plus
  one sync interval of the survivors.
The script also returns Redis TIME: every replica counts windows on that one
clock (offset from its monotonic clock, half the round trip assumed each way),
so replicas' own clock skew does not split a window.

The cost per sync is O(keys x replicas) inside Redis (hundreds of tenants: well
under a millisecond). Every call is bounded by `timeout_s`; a failure is retried
after a capped, jittered exponential backoff (50 ms doubling to 2 s) with the
same redis.asyncio client, whose pool reconnects; the script is reloaded by
redis-py when a restarted Redis no longer knows it (NOSCRIPT).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from picker.cancellation import cancel_and_wait
from picker.coordination.replicas import default_replica_id

if TYPE_CHECKING:
    from picker.tenants.limits import Limiter, _Key, _Window

log = logging.getLogger("picker.tenants.limits")

BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0
STOP_TIMEOUT_S = 1.0
# Values sent per key: name; limits of requests, tokens, concurrency (-1: none); this
# replica's requests and tokens in the current and the previous window; its in-flight;
# its demand (cost asked for since the last sync) of each. Read back per key: the global
# requests and tokens of both windows, the live replicas' in-flight, and this replica's
# new claims (headroom) of requests, tokens and concurrency.
SENT_PER_KEY = 12
READ_PER_KEY = 8

# ARGV: prefix, replica, replica ttl ms, key ttl ms, current window, previous window,
# fraction of the current window elapsed, then SENT_PER_KEY values per key. Returns
# TIME (s, us), the number of live replicas, then READ_PER_KEY values per key.
SYNC_SCRIPT = """
local prefix, me = ARGV[1], ARGV[2]
local ttl, kttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local wcur, wprev, f = ARGV[5], ARGV[6], tonumber(ARGV[7])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local reg = prefix .. ':rl:replicas'
redis.call('ZADD', reg, now_ms, me)
redis.call('PEXPIRE', reg, kttl)
local dead = redis.call('ZRANGEBYSCORE', reg, '-inf', now_ms - ttl)
if #dead > 0 then redis.call('ZREM', reg, unpack(dead)) end
local live = redis.call('ZRANGE', reg, 0, -1)
local n = #live
-- the other live replicas' claims (h) and demands (w), per kind: r, t, c
local peer_fields = {}
for _, name in ipairs(live) do
  if name ~= me then
    for _, kind in ipairs({'r', 't', 'c'}) do
      peer_fields[#peer_fields + 1] = 'h' .. kind .. '|' .. name
      peer_fields[#peer_fields + 1] = 'w' .. kind .. '|' .. name
    end
  end
end
local function put(key, field, value)
  if value == '0' then redis.call('HDEL', key, field) else
    redis.call('HSET', key, field, value) end
end
local function sums(key)
  local r, tk = 0, 0
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, 1) == 'r' then r = r + tonumber(all[i + 1])
    else tk = tk + tonumber(all[i + 1]) end
  end
  return r, tk
end
-- A claim. Demand (cost asked for in the last interval, doubled) within what is
-- unused: every replica gets its demand plus an equal part of the surplus, so an
-- idle replica can still start at once. Beyond it (contended): a demand-weighted
-- share, nothing for a replica that asked for nothing. Never more than the others
-- leave: the live replicas' claims never add up past the unused part of the limit.
local function claim(limit, used, held, want, wants)
  if limit < 0 then return 0 end
  local unused = limit - used
  if unused <= 0 then return 0 end
  local h
  if wants <= unused then h = want + (unused - wants) / n
  else h = unused * want / wants end
  h = math.min(math.floor(unused - held), math.ceil(h))
  if h < 0 then return 0 end
  return h
end
local out = {tonumber(t[1]), tonumber(t[2]), n}
local i = 8
while i <= #ARGV do
  local name = ARGV[i]
  local lr, lt, lc = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local wc = prefix .. ':rl:w:' .. wcur .. ':' .. name
  local wp = prefix .. ':rl:w:' .. wprev .. ':' .. name
  put(wc, 'r|' .. me, ARGV[i + 4])
  put(wc, 't|' .. me, ARGV[i + 5])
  put(wp, 'r|' .. me, ARGV[i + 6])
  put(wp, 't|' .. me, ARGV[i + 7])
  redis.call('PEXPIRE', wc, kttl)
  redis.call('PEXPIRE', wp, kttl)
  local ck = prefix .. ':rl:c:' .. name
  put(ck, me, ARGV[i + 8])
  if #dead > 0 then redis.call('HDEL', ck, unpack(dead)) end
  redis.call('PEXPIRE', ck, kttl)
  local conc = 0
  for _, v in ipairs(redis.call('HMGET', ck, unpack(live))) do
    if v then conc = conc + tonumber(v) end
  end
  local rc, tc = sums(wc)
  local rp, tp = sums(wp)
  local hk = prefix .. ':rl:h:' .. name
  local held = {r = 0, t = 0, c = 0}
  local wants = {r = 0, t = 0, c = 0}
  if #peer_fields > 0 then
    local vals = redis.call('HMGET', hk, unpack(peer_fields))
    for j, v in ipairs(vals) do
      if v then
        local pf = peer_fields[j]
        local kind = string.sub(pf, 2, 2)
        if string.sub(pf, 1, 1) == 'h' then held[kind] = held[kind] + tonumber(v)
        else wants[kind] = wants[kind] + tonumber(v) end
      end
    end
  end
  local wr, wt, wc = tonumber(ARGV[i + 9]), tonumber(ARGV[i + 10]), tonumber(ARGV[i + 11])
  local hr = claim(lr, rp * (1 - f) + rc, held.r, wr, wants.r + wr)
  local ht = claim(lt, tp * (1 - f) + tc, held.t, wt, wants.t + wt)
  local hc = claim(lc, conc, held.c, wc, wants.c + wc)
  put(hk, 'hr|' .. me, tostring(hr))
  put(hk, 'ht|' .. me, tostring(ht))
  put(hk, 'hc|' .. me, tostring(hc))
  put(hk, 'wr|' .. me, tostring(wr))
  put(hk, 'wt|' .. me, tostring(wt))
  put(hk, 'wc|' .. me, tostring(wc))
  if #dead > 0 then
    for _, d in ipairs(dead) do
      redis.call('HDEL', hk, 'hr|' .. d, 'ht|' .. d, 'hc|' .. d, 'wr|' .. d, 'wt|' .. d,
                 'wc|' .. d)
    end
  end
  redis.call('PEXPIRE', hk, kttl)
  for _, v in ipairs({rc, tc, rp, tp, conc, hr, ht, hc}) do out[#out + 1] = v end
  i = i + 12
end
return out
"""

# A stopping replica leaves at once: out of the live set, its in-flight fields gone.
LEAVE_SCRIPT = """
local prefix, me = ARGV[1], ARGV[2]
redis.call('ZREM', prefix .. ':rl:replicas', me)
for i = 3, #ARGV do
  redis.call('HDEL', prefix .. ':rl:c:' .. ARGV[i], me)
  redis.call('HDEL', prefix .. ':rl:h:' .. ARGV[i], 'hr|' .. me, 'ht|' .. me, 'hc|' .. me,
             'wr|' .. me, 'wt|' .. me, 'wc|' .. me)
end
return 1
"""


class LimitSync:
    """One replica's sync task for one Limiter."""

    def __init__(self, limiter: Limiter, redis: Any, prefix: str, *, replica: str | None,
                 timeout_s: float) -> None:
        self.limiter = limiter
        self._redis_arg = redis
        self.client: Any = None
        self._owned = False
        self.prefix = prefix
        self.replica = replica or default_replica_id()
        self.timeout_s = timeout_s
        self.syncs = 0
        self.errors = 0
        self.last_error = ""
        self.connected = False
        self._task: asyncio.Task[None] | None = None
        self._script: Any = None
        self._leave: Any = None

    async def start(self) -> None:
        redis = self._redis_arg
        if callable(redis) and not hasattr(redis, "evalsha"):
            redis = redis()
            if asyncio.iscoroutine(redis):
                redis = await redis
            self._owned = True
        self.client = redis
        self._script = redis.register_script(SYNC_SCRIPT)
        self._leave = redis.register_script(LEAVE_SCRIPT)
        # one bounded attempt first: claims in place before the gateway takes traffic
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await self.sync_once()
            self.connected = True
        self._task = asyncio.create_task(self._run(), name="limits-sync")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task], STOP_TIMEOUT_S * 2)
            self._task = None
        if self.client is None:
            return
        names = [k.name for k in self.limiter.all_keys()]
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await self._leave(args=[self.prefix, self.replica, *names])
        if self._owned:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await self.client.aclose()
        self.client = None

    def stats(self) -> dict[str, Any]:
        return {"replica": self.replica, "syncs": self.syncs, "sync_errors": self.errors,
                "last_sync_error": self.last_error}

    async def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            try:
                await self.sync_once()
            except (RedisError, OSError, TimeoutError) as exc:
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:200]
                if self.connected:
                    log.warning("limits sync failed, retrying with backoff: %s",
                                self.last_error)
                self.connected = False
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                continue
            if not self.connected:
                log.info("limits sync connected (%d replicas live)", self.limiter.replicas)
            self.connected = True
            backoff = BACKOFF_MIN_S
            await asyncio.sleep(self.limiter.sync_interval_s)

    async def sync_once(self) -> None:
        """One exchange: send this replica's totals and demand, take in the global
        totals and this replica's new claims."""
        lim = self.limiter
        keys = lim.all_keys()
        t0 = lim.clock()
        w, f = lim.window_at(t0)
        args: list[Any] = [self.prefix, self.replica, int(lim.replica_ttl_s * 1000),
                           int((2 * lim.window_s + lim.replica_ttl_s) * 1000), w, w - 1,
                           f"{f:.6f}"]
        sent = [_Sent.of(k, w) for k in keys]
        for key, snap in zip(keys, sent, strict=True):
            args.append(key.name)
            args.extend(snap.args())
        async with asyncio.timeout(self.timeout_s):
            reply = await self._script(args=args)
        t1 = lim.clock()
        lim.offset = (int(reply[0]) + int(reply[1]) / 1e6) - (t0 + t1) / 2
        lim.replicas = max(1, int(reply[2]))
        for n, (key, snap) in enumerate(zip(keys, sent, strict=True)):
            base = 3 + READ_PER_KEY * n
            snap.take(key, w, [int(v) for v in reply[base:base + READ_PER_KEY]])
        lim.last_ok = t1
        lim.synced_once = True
        self.syncs += 1


def _limit(value: int | None) -> int:
    return -1 if value is None else value


class _Sent:
    """What one sync sent for one key, to apply the answer against."""

    __slots__ = ("attempted", "inflight", "limits", "mine", "spent")

    def __init__(self, limits: list[int], mine: list[int], spent: list[int],
                 attempted: list[int], inflight: int) -> None:
        self.limits = limits  # requests, tokens, concurrency; -1: none
        self.mine = mine  # r_cur, t_cur, r_prev, t_prev
        self.spent = spent  # requests, tokens
        self.attempted = attempted  # requests, tokens, concurrency
        self.inflight = inflight

    @classmethod
    def of(cls, key: _Key, w: int) -> _Sent:
        def mine(rate: _Window | None, window: int) -> int:
            return rate.mine[rate.slot(window)] if rate is not None else 0

        rates = (key.requests, key.tokens)
        lim = key.limits
        return cls([_limit(lim.requests_per_minute), _limit(lim.tokens_per_minute),
                    _limit(lim.max_concurrent_requests)],
                   [mine(key.requests, w), mine(key.tokens, w), mine(key.requests, w - 1),
                    mine(key.tokens, w - 1)],
                   [r.spent if r is not None else 0 for r in rates],
                   [*(r.attempted if r is not None else 0 for r in rates),
                    key.conc_attempted],
                   key.inflight)

    def args(self) -> list[Any]:
        # demand: twice what was asked for since the last sync
        return [*self.limits, *self.mine, self.inflight, *(2 * a for a in self.attempted)]

    def take(self, key: _Key, w: int, reply: list[int]) -> None:
        r_cur, t_cur, r_prev, t_prev, conc, h_r, h_t, h_c = reply
        for n, (rate, cur, prev, s_cur, s_prev, claim) in enumerate((
                (key.requests, r_cur, r_prev, self.mine[0], self.mine[2], h_r),
                (key.tokens, t_cur, t_prev, self.mine[1], self.mine[3], h_t))):
            if rate is None:
                continue
            for s_w, total, mine in ((w, cur, s_cur), (w - 1, prev, s_prev)):
                s = s_w & 1
                if rate.win[s] == s_w:
                    rate.seen[s] = total
                    rate.synced[s] = mine
            rate.headroom = claim
            rate.spent = max(0, rate.spent - self.spent[n])
            rate.attempted = max(0, rate.attempted - self.attempted[n])
        key.conc_seen = conc
        key.conc_synced = self.inflight
        key.conc_headroom = h_c
        key.conc_attempted = max(0, key.conc_attempted - self.attempted[2])
