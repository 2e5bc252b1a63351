"""Each primary of a Redis Cluster within its own bound, as entries are written.

A cluster spreads entries over its primaries by hash slot, so one primary can
fill before the cluster does: it serves more slots, holds others' keys, or
chance put more entries there. Past its ``maxmemory`` a primary answers writes
with Redis's OOM error (or, under an eviction policy, drops keys of its own
choosing: parts of entries, the index log). ``maintenance.StoreBudget``
therefore keeps each primary (a shard) within its bound too:

- its bound: its share of the store's budget, in proportion to the primaries'
  own bounds (``sizing.redis_capacities``: ``REDIS_FRACTION`` of its
  ``maxmemory``), and never past its own bound;
- what it holds: all its memory (``used_memory``: others' keys, the index log,
  Redis's overhead and the store's entries), measured with a listing of the
  store and counted forward from each write;
- a write that would take its shard past the bound evicts entries of that
  shard first, chosen by the store's own rule (``quotas.select_for_budget``)
  on the shard's entries, each weighed as the shard's share of the store
  (``max_bytes / bound``), so a group's quota holds on each shard as on the
  whole: a tenant that fills one primary gives way there first;
- a write the shard cannot hold even then is refused (not stored).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from kvrag_integrations.store.base import EntryInfo
from kvrag_integrations.store.quotas import Quotas, select_for_budget

# A shard that could not make room is not measured again for this long: every
# write to it would otherwise list the whole store.
REMEASURE_S = 5.0


@dataclass
class Shard:
    """One primary's bound and what it holds, in bytes."""

    limit: int
    other: int = 0  # held besides the store's entries: others' keys, overhead
    entries: int = 0  # the store's entries on it
    refused_at: float = float("-inf")  # when a write last found no room even after eviction

    @property
    def held(self) -> int:
        return self.other + self.entries


class Shards:
    """The shards of a store on a Redis Cluster, for a store budget of ``max_bytes``.

    Examples:
        >>> from kvrag_integrations.store.memory import MemoryKVStore
        >>> Shards.of(MemoryKVStore(), 100) is None  # a store on one node has one bound
        True
    """

    def __init__(self, store: Any, max_bytes: int) -> None:
        self.store, self.max_bytes = store, max_bytes
        self.shards: dict[str, Shard] = {}

    @classmethod
    def of(cls, store: Any, max_bytes: int) -> Shards | None:
        """The shards of ``store`` (a ``RedisKVStore`` on a cluster), else None."""
        return cls(store, max_bytes) if getattr(store, "cluster", False) else None

    def fits(self, key: str, nbytes: int) -> bool:
        """Whether the shard of ``key``, as last measured and counted, holds ``nbytes`` more."""
        shard = self.shards.get(self.store.shard_of(key))
        return shard is not None and shard.held + nbytes <= shard.limit

    def add(self, key: str, nbytes: int) -> None:
        """Count a write of ``nbytes`` to the shard of ``key``."""
        shard = self.shards.get(self.store.shard_of(key))
        if shard is not None:
            shard.entries += nbytes

    def measure(
        self, entries: Iterable[EntryInfo], gone: set[str] | frozenset[str] = frozenset()
    ) -> dict[str, list[EntryInfo]]:
        """Read each primary's memory and bound; group ``entries`` (the store's listing,
        less the keys ``gone``, being evicted) by shard and count them. Returns the
        entries kept, by shard."""
        from kvrag_integrations.store.redis_client import primaries_memory
        from kvrag_integrations.store.sizing import redis_capacities

        memory = primaries_memory(self.store.client)
        capacities = {name: nbytes for name, (nbytes, _) in redis_capacities(self.store).items()}
        total = sum(capacities.values()) or 1
        by_shard: dict[str, list[EntryInfo]] = defaultdict(list)
        leaving: dict[str, int] = defaultdict(int)
        for info in entries:
            name = self.store.shard_of(info.key)
            if info.key in gone:
                leaving[name] += info.nbytes
            else:
                by_shard[name].append(info)
        before, self.shards = self.shards, {}
        for name, capacity in capacities.items():
            limit = min(capacity, int(self.max_bytes * capacity / total))
            ours = sum(info.nbytes for info in by_shard.get(name, []))
            other = max(0, memory[name]["used_memory"] - ours - leaving[name])
            refused = before[name].refused_at if name in before else float("-inf")
            self.shards[name] = Shard(limit, other, ours, refused)
        return by_shard

    def select(
        self,
        by_shard: dict[str, list[EntryInfo]],
        key: str,
        nbytes: int,
        *,
        writing: str,
        quotas: Quotas,
        low_water: float,
    ) -> list[EntryInfo] | None:
        """The entries of the shard of ``key`` to evict before a write of ``nbytes``
        there (by group ``writing``), after ``measure``; None: even then it would not
        fit (the write is refused, nothing of this shard evicted)."""
        name = self.store.shard_of(key)
        shard = self.shards.get(name)
        if shard is None:  # a primary the listing did not see (a failover meanwhile)
            return None
        if shard.held + nbytes <= shard.limit:
            return []
        scale = self.max_bytes / max(1, shard.limit)
        weighed = {info.key: info for info in by_shard.get(name, [])}
        chosen = select_for_budget(
            [replace(info, nbytes=round(info.nbytes * scale)) for info in weighed.values()],
            quotas,
            self.max_bytes,
            writing=writing,
            nbytes=round(nbytes * scale),
            reserved_bytes=round(shard.other * scale),
            low_water=low_water,
        )
        evicted = [weighed[info.key] for info in chosen]
        freed = sum(info.nbytes for info in evicted)
        if shard.held - freed + nbytes > shard.limit:
            shard.refused_at = time.monotonic()
            return None
        shard.entries -= freed
        return evicted

    def refused_lately(self, key: str) -> bool:
        """Whether the shard of ``key`` had no room for a write moments ago."""
        shard = self.shards.get(self.store.shard_of(key))
        return shard is not None and time.monotonic() - shard.refused_at < REMEASURE_S
