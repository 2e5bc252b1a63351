"""Each Redis primary within its own bounds, as entries are written.

A Redis Cluster spreads entries over its primaries by hash slot, so one
primary can fill before the cluster does: it serves more slots, holds others'
keys, or chance put more entries there. And any Redis, one server too, holds
more than the store's entries: its own overhead, the index log, others' keys.
Past its ``maxmemory`` a primary answers writes with Redis's OOM error (or,
under an eviction policy, drops keys of its own choosing: parts of entries,
the index log). ``write_budget.StoreBudget`` therefore keeps each primary (a
shard; one server is one shard) within two bounds:

- its share of the store's budget, for the store's entries: the budget split
  in proportion to the primaries' capacities, and never more than its
  capacity (a ``--max-store-bytes`` past what the primaries can hold bounds
  nothing more);
- its capacity (``sizing.redis_capacities``: ``REDIS_FRACTION`` of its
  ``maxmemory``), for all it holds (``used_memory``).

Both are measured with a listing of the store (and ``INFO memory``), then
counted forward from each write. A write that would take its shard past either
evicts entries of that shard first (``eviction.select_on_shard``): the
writer's own there, then there the least recently used of groups out of their
quota over the whole store. A group within its quota keeps its entries on
every shard, however the hashing spread them (one that hashing put mostly on
one primary is not "over" there). A write the shard cannot hold even then is
refused (not stored).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvrag_integrations.store.base import EntryInfo
from kvrag_integrations.store.eviction import select_on_shard
from kvrag_integrations.store.quotas import Quotas

# How long a measurement decides refusals (the budget's, and a shard's that could not
# make room): every refused write would otherwise list the whole store; others'
# deletes (a private entry dropped after its request) are seen this late.
REMEASURE_S = 1.0


@dataclass
class Shard:
    """One primary's bounds and what it holds, in bytes."""

    share: int  # of the store's budget: for the store's entries
    capacity: int  # for all it holds
    other: int = 0  # held besides the store's entries: overhead, the index log, others' keys
    entries: int = 0  # the store's entries on it
    refused_at: float = float("-inf")  # when a write last found no room even after eviction

    @property
    def reserved(self) -> int:
        """What counts against the share besides the entries: the part of ``other``
        that does not fit in the capacity left over by the share."""
        return max(0, self.other - max(0, self.capacity - self.share))

    def fits(self, nbytes: int) -> bool:
        return self.reserved + self.entries + nbytes <= self.share


class Shards:
    """The primaries of a Redis store, for a store budget of ``max_bytes``.

    Examples:
        >>> from kvrag_integrations.store.memory import MemoryKVStore
        >>> Shards.of(MemoryKVStore(), 100) is None  # only Redis stores have primaries
        True
    """

    def __init__(self, store: Any, max_bytes: int) -> None:
        self.store, self.max_bytes = store, max_bytes
        self.shards: dict[str, Shard] = {}

    @classmethod
    def of(cls, store: Any, max_bytes: int) -> Shards | None:
        """The shards of ``store`` (a ``RedisKVStore``: one server or a cluster), else None."""
        return cls(store, max_bytes) if callable(getattr(store, "shard_of", None)) else None

    def fits(self, key: str, nbytes: int) -> bool:
        """Whether the shard of ``key``, as last measured and counted, holds ``nbytes`` more."""
        shard = self.shards.get(self.store.shard_of(key))
        return shard is not None and shard.fits(nbytes)

    def add(self, key: str, nbytes: int) -> None:
        """Count a write of ``nbytes`` to the shard of ``key``."""
        shard = self.shards.get(self.store.shard_of(key))
        if shard is not None:
            shard.entries += nbytes

    def measure(
        self, entries: Iterable[EntryInfo], gone: set[str] | frozenset[str] = frozenset()
    ) -> dict[str, list[EntryInfo]]:
        """Read each primary's memory and capacity; group ``entries`` (the store's
        listing, less the keys ``gone``, being evicted) by shard and count them.
        Returns the entries kept, by shard."""
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
            share = min(int(self.max_bytes * capacity / total), capacity)
            ours = sum(info.nbytes for info in by_shard.get(name, []))
            other = max(0, memory[name]["used_memory"] - ours - leaving[name])
            refused = before[name].refused_at if name in before else float("-inf")
            self.shards[name] = Shard(share, capacity, other, ours, refused)
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
        there (by group ``writing``), after ``measure`` (``by_shard``: every shard's
        entries kept, whose groups' quotas hold over the whole store); None: even
        then it would not fit (the write is refused, nothing of this shard evicted)."""
        name = self.store.shard_of(key)
        shard = self.shards.get(name)
        if shard is None:  # a primary the listing did not see (a failover meanwhile)
            return None
        if shard.fits(nbytes):
            return []
        held = shard.reserved + shard.entries + nbytes
        here = {info.key for info in by_shard.get(name, [])}
        evicted = select_on_shard(
            [info for infos in by_shard.values() for info in infos],
            quotas,
            self.max_bytes,
            writing=writing,
            nbytes=nbytes,
            where=lambda info: info.key in here,
            need=held - shard.share,
            want=held - int(shard.share * low_water),
        )
        if evicted is None:
            shard.refused_at = time.monotonic()
            return None
        shard.entries -= sum(info.nbytes for info in evicted)
        return evicted

    def refused_lately(self, key: str) -> bool:
        """Whether the shard of ``key`` had no room for a write moments ago."""
        shard = self.shards.get(self.store.shard_of(key))
        return shard is not None and time.monotonic() - shard.refused_at < REMEASURE_S
