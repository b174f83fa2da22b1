"""The limiter's background exchange with the other replicas: one Redis script call.

Every `sync_interval_s` (and never on the request path) the replica sends, per
limited key, its own totals for the current and the previous window, its in-flight
count and its demand, and gets back the global totals and its new claims, in one
EVALSHA (atomic: each claim sees every other replica's current one):

- window counts: a hash per (window, key), `<prefix>:rl:w:<window>:<key>`, fields
  `r|<replica>` / `t|<replica>` = that replica's requests / tokens in the window.
  Absolute values, not increments: a sync that timed out after Redis applied it
  is harmless when repeated, and a Redis that restarted empty gets every
  replica's counts back at its next sync;
- per key, `<prefix>:rl:k:<key>`: per replica its in-flight requests (`i|`), what
  is held for it (`hr|`, `ht|`, `hc|`: requests, tokens, concurrency: its new claim,
  or what was left of its previous one when it sent this sync if more, since it
  spends that until the answer arrives) and its demands (`wr|`, `wt|`, `wc|`); only
  the live replicas' fields count;
- liveness: `<prefix>:rl:replicas`, a sorted set of replica → Redis time (ms) of its
  last sync; members silent for `replica_ttl_s` are removed (and their fields), so a
  dead replica's concurrency and claims age out within replica_ttl_s plus one sync
  interval of a survivor.
Every key expires two windows plus replica_ttl_s after its last write. The script
also returns Redis TIME: every replica counts windows on that one clock (offset
from its monotonic clock, half the round trip assumed each way), so the replicas'
own clock skew does not split a window.

Which keys a sync carries: those used here since the last sync (admitted, refused,
released) and a rotating slice of the others, so that every key is refreshed
at least every IDLE_REFRESH_S: the cost per sync follows the traffic, not the
number of configured tenants (an idle key's claim and totals are at most that old).
Every call is bounded by `timeout_s`; a failure is retried after a capped,
jittered exponential backoff (50 ms doubling to 2 s) with the same redis.asyncio
client, whose pool reconnects; redis-py reloads the script when a restarted Redis
no longer knows it (NOSCRIPT).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from picker.cancellation import cancel_and_wait
from picker.coordination.backoff import Backoff
from picker.coordination.replicas import default_replica_id

if TYPE_CHECKING:
    from picker.tenants.limits import Limiter, _Key, _Window

log = logging.getLogger("picker.tenants.limits")

# Every key is in a sync at least this often, used or not.
IDLE_REFRESH_S = 1.0
STOP_TIMEOUT_S = 1.0
# Values sent per key: name; limits of requests, tokens, concurrency (-1: none); this
# replica's requests and tokens in the current and the previous window; its in-flight;
# its demand (cost asked for since the last sync) of each. Read back per key: the global
# requests and tokens of both windows, the live replicas' in-flight, and this replica's
# new claims (headroom) of requests, tokens and concurrency.
# Each key is two arguments (its name, then its fourteen numbers in one space-separated
# string) and the answer is one string of numbers: packing and parsing a thousand small
# values one by one was most of a sync's CPU in redis-py.
SENT_PER_KEY = 14
READ_PER_KEY = 8

# ARGV: prefix, replica, replica ttl ms, key ttl ms, current window, previous window,
# fraction of the current window elapsed, then per key its name and its SENT_PER_KEY
# values. Returns one space-separated string: TIME (s, us), the number of live replicas,
# then READ_PER_KEY values per key.
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
-- per key, per replica: i (in flight), h? (claims) and w? (demands) of r, t, c
local KINDS = {'i', 'hr', 'ht', 'hc', 'wr', 'wt', 'wc'}
local peer_fields = {}
for _, name in ipairs(live) do
  if name ~= me then
    for _, kind in ipairs(KINDS) do peer_fields[#peer_fields + 1] = kind .. '|' .. name end
  end
end
local dead_fields = {}
for _, name in ipairs(dead) do
  for _, kind in ipairs(KINDS) do dead_fields[#dead_fields + 1] = kind .. '|' .. name end
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
local out = {t[1], t[2], tostring(n)}
local i = 8
while i <= #ARGV do
  local name = ARGV[i]
  local v = {}
  for num in string.gmatch(ARGV[i + 1], '%S+') do v[#v + 1] = num end
  local lr, lt, lc = tonumber(v[1]), tonumber(v[2]), tonumber(v[3])
  local wc = prefix .. ':rl:w:' .. wcur .. ':' .. name
  local wp = prefix .. ':rl:w:' .. wprev .. ':' .. name
  local hk = prefix .. ':rl:k:' .. name
  redis.call('HSET', wc, 'r|' .. me, v[4], 't|' .. me, v[5])
  redis.call('HSET', wp, 'r|' .. me, v[6], 't|' .. me, v[7])
  redis.call('PEXPIRE', wc, kttl)
  redis.call('PEXPIRE', wp, kttl)
  local mine = tonumber(v[8])
  local peer = {i = mine, hr = 0, ht = 0, hc = 0, wr = 0, wt = 0, wc = 0}
  if #peer_fields > 0 then
    for j, got in ipairs(redis.call('HMGET', hk, unpack(peer_fields))) do
      if got then
        local kind = KINDS[(j - 1) % 7 + 1]
        peer[kind] = peer[kind] + tonumber(got)
      end
    end
  end
  if #dead_fields > 0 then redis.call('HDEL', hk, unpack(dead_fields)) end
  local rc, tc = sums(wc)
  local rp, tp = sums(wp)
  local wr, wt, wcc = tonumber(v[9]), tonumber(v[10]), tonumber(v[11])
  local hr = claim(lr, rp * (1 - f) + rc, peer.hr, wr, peer.wr + wr)
  local ht = claim(lt, tp * (1 - f) + tc, peer.ht, wt, peer.wt + wt)
  local hc = claim(lc, peer.i, peer.hc, wcc, peer.wc + wcc)
  -- what is held for this replica: its new claim, or what is left of the old one if
  -- more (it keeps spending that until this answer arrives); either fits, the old one
  -- was held already
  local kr = math.max(hr, tonumber(v[12]))
  local kt = math.max(ht, tonumber(v[13]))
  local kc = math.max(hc, tonumber(v[14]))
  redis.call('HSET', hk, 'i|' .. me, mine, 'hr|' .. me, kr, 'ht|' .. me, kt,
             'hc|' .. me, kc, 'wr|' .. me, wr, 'wt|' .. me, wt, 'wc|' .. me, wcc)
  redis.call('PEXPIRE', hk, kttl)
  for _, x in ipairs({rc, tc, rp, tp, peer.i, hr, ht, hc}) do
    out[#out + 1] = string.format('%d', x)
  end
  i = i + 2
end
return table.concat(out, ' ')
"""

# A stopping replica leaves at once: out of the live set, its in-flight and claims gone.
LEAVE_SCRIPT = """
local prefix, me = ARGV[1], ARGV[2]
redis.call('ZREM', prefix .. ':rl:replicas', me)
for i = 3, #ARGV do
  redis.call('HDEL', prefix .. ':rl:k:' .. ARGV[i], 'i|' .. me, 'hr|' .. me, 'ht|' .. me,
             'hc|' .. me, 'wr|' .. me, 'wt|' .. me, 'wc|' .. me)
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
        # where the next slice of idle keys starts
        self._idle_at = 0

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
        backoff = Backoff()
        while True:
            try:
                await self.sync_once()
            except Exception as exc:  # Redis down, slow, or an answer it cannot read:
                # whatever it is, retry later; the limits degrade, never the requests
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:200]
                if self.connected:
                    log.warning("limits sync failed, retrying with backoff: %s",
                                self.last_error)
                self.connected = False
                await backoff.sleep()
                continue
            if not self.connected:
                log.info("limits sync connected (%d replicas live)", self.limiter.replicas)
            self.connected = True
            backoff.reset()
            await asyncio.sleep(self.limiter.sync_interval_s)

    async def sync_once(self) -> None:
        """One exchange: send this replica's totals and demand, take in the global
        totals and this replica's new claims."""
        lim = self.limiter
        keys = self._due(lim.all_keys())
        t0 = lim.clock()
        w, f = lim.window_at(t0)
        args: list[Any] = [self.prefix, self.replica, int(lim.replica_ttl_s * 1000),
                           int((2 * lim.window_s + lim.replica_ttl_s) * 1000), w, w - 1,
                           f"{f:.6f}"]
        sent = []
        for key in keys:
            key.dirty = False
            snap = _Sent.of(key, w)
            sent.append(snap)
            args.append(key.name)
            args.append(" ".join(map(str, snap.args())))
        try:
            async with asyncio.timeout(self.timeout_s):
                reply = await self._script(args=args)
        except BaseException:
            # applied or not, what was left of each claim is still held for this
            # replica (the script keeps it): spending it stays within the limit
            for key in keys:
                key.dirty = True
            raise
        t1 = lim.clock()
        values = [int(v) for v in reply.split()]
        lim.offset = (values[0] + values[1] / 1e6) - (t0 + t1) / 2
        lim.replicas = max(1, values[2])
        for n, (key, snap) in enumerate(zip(keys, sent, strict=True)):
            base = 3 + READ_PER_KEY * n
            snap.take(key, w, values[base:base + READ_PER_KEY])
        lim.last_ok = t1
        lim.synced_once = True
        self.syncs += 1

    def _due(self, keys: list[_Key]) -> list[_Key]:
        """The keys used since the last sync, and the next slice of the others."""
        if not self.limiter.synced_once:
            return keys
        per_refresh = max(1, round(IDLE_REFRESH_S / max(self.limiter.sync_interval_s, 1e-3)))
        size = -(-len(keys) // per_refresh)
        start = self._idle_at % max(1, len(keys))
        self._idle_at = start + size
        idle = set(range(start, start + size))
        return [k for i, k in enumerate(keys)
                if k.dirty or i in idle or i + len(keys) in idle]


def _limit(value: int | None) -> int:
    return -1 if value is None else value


class _Sent:
    """What one sync sent for one key, to apply the answer against."""

    __slots__ = ("attempted", "inflight", "left", "limits", "mine", "spent")

    def __init__(self, limits: list[int], mine: list[int], spent: list[int],
                 attempted: list[int], inflight: int, left: list[int]) -> None:
        self.limits = limits  # requests, tokens, concurrency; -1: none
        self.mine = mine  # r_cur, t_cur, r_prev, t_prev
        self.spent = spent  # requests, tokens
        self.attempted = attempted  # requests, tokens, concurrency
        self.inflight = inflight
        # what is left of the current claims (requests, tokens, concurrency): this
        # replica may spend it until the answer arrives, so Redis keeps holding it
        self.left = left

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
                   key.inflight,
                   [*(max(0, math.floor(r.headroom - r.spent)) if r is not None else 0
                      for r in rates),
                    max(0, key.conc_headroom - (key.inflight - key.conc_synced))])

    def args(self) -> list[Any]:
        # demand: twice what was asked for since the last sync
        return [*self.limits, *self.mine, self.inflight, *(2 * a for a in self.attempted),
                *self.left]

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
