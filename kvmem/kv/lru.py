"""Entries within a byte budget, the least recently used out first: the store's RAM tier and the
connector worker's tier of mapped blobs. Not locked: each owner holds its own lock around it."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class ByteLRU(Generic[V]):
    def __init__(self, limit: int) -> None:
        self.limit = limit  # bytes; 0 keeps nothing
        self.bytes = 0
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()  # key -> (value, its bytes)

    def get(self, key: str) -> V | None:
        """The value, leaving its recency as it is (`touch` marks a use)."""
        hit = self._entries.get(key)
        return None if hit is None else hit[0]

    def touch(self, key: str) -> None:
        self._entries.move_to_end(key)

    def put(self, key: str, value: V, size: int) -> None:
        """Keep `value` (replacing the key's old one), evicting the least recently used past the
        budget; a value larger than the whole budget is not kept."""
        if size > self.limit:
            return
        self.pop(key)
        self._entries[key] = (value, size)
        self.bytes += size
        while self.bytes > self.limit:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.bytes -= evicted

    def pop(self, key: str) -> V | None:
        hit = self._entries.pop(key, None)
        if hit is None:
            return None
        self.bytes -= hit[1]
        return hit[0]

    def size(self, key: str) -> int:
        """The key's bytes (0 when absent)."""
        hit = self._entries.get(key)
        return 0 if hit is None else hit[1]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        """Least recently used first."""
        return list(self._entries)
