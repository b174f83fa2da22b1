"""Resident LoRA adapter slots (vLLM's ``max_loras``).

A running request pins its adapter; an adapter that is not resident must be loaded into a free
slot, or into the slot of the least recently used idle adapter, before its request can run.
"""

from __future__ import annotations

from collections import OrderedDict


class LoraSlots:
    """Which adapters are resident, and how many running requests use each."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._resident: OrderedDict[str, int] = OrderedDict()  # adapter -> running users, LRU
        self.loads = 0

    @property
    def resident(self) -> list[str]:
        return list(self._resident)

    def can_acquire(self, adapter: str) -> bool:
        """Whether acquire(adapter) would succeed now."""
        if adapter in self._resident or len(self._resident) < self.max_loras:
            return True
        return any(users == 0 for users in self._resident.values())

    def acquire(self, adapter: str) -> bool | None:
        """Pin adapter for one running request.

        Returns False when it was already resident, True when it had to be loaded (the caller
        pays the load delay), None when every slot is pinned by running requests.
        """
        users = self._resident.get(adapter)
        if users is not None:
            self._resident[adapter] = users + 1
            self._resident.move_to_end(adapter)
            return False
        if len(self._resident) >= self.max_loras and not self._evict_idle():
            return None
        self._resident[adapter] = 1
        self.loads += 1
        return True

    def release(self, adapter: str) -> None:
        """Unpin; the adapter stays resident (and reusable) until a load needs its slot."""
        self._resident[adapter] -= 1

    def _evict_idle(self) -> bool:
        for name, users in self._resident.items():
            if users == 0:
                del self._resident[name]
                return True
        return False
