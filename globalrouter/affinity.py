"""Keeping a conversation where its KV cache is: session and prefix affinity per region.

A region that served a conversation's last turn holds its prefix in its engines'
KV caches (its own gateway keeps it on the pod that has it: Tier 1's prefix
affinity); sending the next turn elsewhere pays the whole prefill again, in time
to first token and in GPU work. The router remembers two things per region,
both bounded, both written at placement (off no network, on no lock):

    sessions   `x-session-id` → the region placed last, LRU, forgotten after
               `spec.affinity.sessionIdleTimeout` without a request
    prefixes   the prompt's block hashes (bbr.prefix, the Tier-1 chain) → the
               regions they were placed on: Tier 1's PrefixIndex with regions as
               rows, `spec.affinity.prefixBlocksPerRegion` blocks per region

How placement uses them (globalrouter.placement): a session is sticky, its region
goes first while it passes every filter, is neither saturated nor suspect and is
predicted to meet the model's SLO. A prefix is not sticky: it makes the prediction better, the
matched share of the prompt taken off the region's predicted TTFT when nothing
waits there (a cached prefix shortens the prefill, not a queue). So a prompt
shared by everyone (a system prompt) glues no traffic to the region that saw it
first; a long conversation stays where skipping its prefill keeps it fastest or
within the SLO.

Each router replica keeps its own maps; with `spec.coordination` the session
bindings are shared (globalrouter.session_sync: published in batches, read in the
background), so a conversation whose turns reach different replicas stays in one
region. Prefixes are not shared: each replica learns them from what it places.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from bbr.prefix import BLOCK_CHARS
from contract.errors import InvalidRequest
from contract.global_config import AffinityConfig
from contract.headers import SESSION
from picker.scheduling.prefix_index import PrefixIndex

# Session ids longer than this are refused (400): AWS's session identifiers, and
# the LLM gateways that read this header, stop at 255-256 characters.
MAX_SESSION_CHARS = 256


class RegionAffinity:
    """Sessions and prefixes per region row; `n` regions."""

    __slots__ = ("_idle_s", "_max_sessions", "_prefixes", "_sessions", "n")

    def __init__(self, config: AffinityConfig, n: int) -> None:
        self.n = n
        self._max_sessions = config.max_sessions
        self._idle_s = config.session_idle_timeout_s
        # session → (region row, last seen, last published to the other replicas)
        self._sessions: OrderedDict[str, tuple[int, float, float]] = OrderedDict()
        blocks = config.prefix_blocks_per_region
        self._prefixes = PrefixIndex(blocks) if blocks > 0 else None

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    @property
    def prefix_blocks(self) -> int:
        return 0 if self._prefixes is None else len(self._prefixes)

    def session_row(self, session: str | None, now: float) -> int:
        """The region the session was placed on last (-1: none, or idle too long)."""
        if session is None or self._max_sessions == 0:
            return -1
        if len(session) > MAX_SESSION_CHARS:
            raise InvalidRequest(
                f"The `{SESSION}` header must be at most {MAX_SESSION_CHARS} characters, "
                f"got {len(session)}.", param=SESSION)
        entry = self._sessions.get(session)
        if entry is None or now - entry[1] > self._idle_s:
            return -1
        return entry[0]

    def matched(self, hashes: list[int], prompt_chars: int) -> np.ndarray | None:
        """Per region, the share of the prompt (0..1) it was sent last; None: no match."""
        if self._prefixes is None or not hashes or prompt_chars <= 0:
            return None
        blocks = self._prefixes.match(hashes, self.n)
        if blocks is None:
            return None
        return np.minimum(blocks * (BLOCK_CHARS / prompt_chars), 1.0)

    def record(self, session: str | None, hashes: list[int], row: int, now: float) -> bool:
        """The request went to `row`: its session and prefix are there now. True when the
        binding is news for the other replicas (globalrouter.session_sync): new, moved,
        or not told for half the idle timeout (theirs would expire meanwhile)."""
        if self._prefixes is not None and hashes:
            self._prefixes.insert(row, hashes)
        if session is None or self._max_sessions == 0:
            return False
        sessions = self._sessions
        old = sessions.get(session)
        news = old is None or old[0] != row or now - old[2] > self._idle_s / 2
        sessions[session] = (row, now, now if news else old[2])
        sessions.move_to_end(session)
        self._expire(now)
        return news

    def adopt(self, session: str, row: int, now: float) -> None:
        """Another replica placed the session on `row` (globalrouter.session_sync)."""
        if self._max_sessions == 0 or len(session) > MAX_SESSION_CHARS:
            return
        self._sessions[session] = (row, now, now)
        self._sessions.move_to_end(session)
        self._expire(now)

    def _expire(self, now: float) -> None:
        """Oldest first (the dict is in last-use order): idle sessions, then any over
        the bound; each call drops what it finds, so the work is O(dropped)."""
        sessions = self._sessions
        while sessions:
            oldest = next(iter(sessions.values()))
            if len(sessions) <= self._max_sessions and now - oldest[1] <= self._idle_s:
                return
            sessions.popitem(last=False)
