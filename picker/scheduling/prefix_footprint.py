"""How many tokens of prompt prefix the pool's recent requests share (one per pool).

A prefix is shared once a request's leading blocks were already routed somewhere
(`PrefixIndex.insert` says how many). Each shared prefix is kept under its first block
(its root: a system prompt, a conversation) with the depth shared at its latest request;
the footprint is their sum over roots seen within `window_s`. It is what every pod would
hold if each held every shared prefix, to compare with a pod's KV cache
(`scorers.prefix`): where it is a small part of the smallest cache, affinity buys nothing
a pod cannot get by serving the prefix once.

Bounded: at most `max_roots` roots (least recently seen dropped first); O(1) per
request, the sum kept as roots come, change and go.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_WINDOW_S = 60.0
DEFAULT_MAX_ROOTS = 1024


class PrefixFootprint:
    """Shared prefix tokens per root seen lately, and their sum."""

    __slots__ = ("_roots", "max_roots", "tokens", "window_s")

    def __init__(self, window_s: float = DEFAULT_WINDOW_S,
                 max_roots: int = DEFAULT_MAX_ROOTS) -> None:
        self.window_s = window_s
        self.max_roots = max_roots
        self._roots: OrderedDict[int, tuple[int, float]] = OrderedDict()
        self.tokens = 0  # the footprint: shared tokens summed over the roots held

    def __len__(self) -> int:
        return len(self._roots)

    def record(self, root: int, shared_tokens: int, now: float) -> None:
        """A request under `root` shared `shared_tokens` leading tokens with earlier ones."""
        if shared_tokens > 0:
            old = self._roots.pop(root, None)
            if old is not None:
                self.tokens -= old[0]
            self._roots[root] = (shared_tokens, now)
            self.tokens += shared_tokens
        self.expire(now)

    def expire(self, now: float) -> None:
        """Drop roots not seen within the window, and the oldest beyond the bound."""
        roots = self._roots
        horizon = now - self.window_s
        while roots:
            root, (tokens, seen) = next(iter(roots.items()))
            if seen >= horizon and len(roots) <= self.max_roots:
                return
            del roots[root]
            self.tokens -= tokens
