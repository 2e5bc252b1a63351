"""StoreBudget: a store kept within its budget, and each group within its quota,
as entries are written (the connector's writers; ``maintenance`` looks after a
store at rest)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvrag_integrations.store.base import EntryInfo, KVStore
from kvrag_integrations.store.eviction import select_for_budget
from kvrag_integrations.store.maintenance import expired_private
from kvrag_integrations.store.namespaces import namespace_kind
from kvrag_integrations.store.quotas import UNREADABLE, Quotas
from kvrag_integrations.store.shards import REMEASURE_S, Shards

logger = logging.getLogger(__name__)


class StoreBudget:
    """Keeps a store within ``max_bytes`` as entries are written to it, and each
    group of namespaces within its quota (``store.quotas``).

    Before a write that would take its group past its quota, its pool past the
    pool's, or the store past its budget, entries are evicted as
    ``eviction.select_for_budget`` chooses: the writer's group's own least
    recently used ones first, then only those of groups over their quota. A
    write that cannot fit without evicting a group within its quota is refused
    (``allow_write`` is False: the entry is not stored). ``EntryInfo.updated_at``
    orders use (``touch`` marks one). The store's size counts its entries, live
    writers' temp files and the content index's log (``index_log``), which is
    compacted after each eviction (the records of evicted entries go). The
    sizes are measured then and counted forward from each write in between, so
    a write costs no listing until a bound is near; while the last measurement
    (under ``REMEASURE_S`` old, and no pooled entry turned idle since) shows
    that a write cannot fit even with every entry it may evict gone, it is
    refused without a listing. Writers in other
    processes are seen at the next measurement: the budget holds per writer,
    and across writers up to what they write in between. On Redis each primary
    (one server, or each of a cluster's) is kept within its own bounds as well
    (``store.shards``: its share of the budget, and its ``maxmemory`` with all
    else it holds): a write whose primary is full evicts there first, or is
    refused.

    Args:
        store: the store to keep in bounds.
        max_bytes: its budget (``budget.store_budget`` sizes one from the store).
        low_water: the share of a bound an eviction frees down to.
        quotas: the groups' quotas (default: none but the budget; a server's
            connector gives each group a share), or what returns the current ones
            (read at each write: a key file edited while the server runs).
        index_log: the content index's log beside the store (``matching``), or None.
        clock: seconds, for how old a measurement is (``time.monotonic``).

    Examples:
        >>> from kvrag_integrations.store.memory import MemoryKVStore
        >>> StoreBudget(MemoryKVStore(), max_bytes=100).allow_write(200)
        False
    """

    REMEASURE_S = REMEASURE_S  # (``shards.REMEASURE_S``: tests may set their own)

    def __init__(
        self,
        store: KVStore,
        max_bytes: int,
        low_water: float = 0.8,
        *,
        quotas: Quotas | Callable[[], Quotas] | None = None,
        index_log: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.store = store
        self.max_bytes = max_bytes
        self.low_water = low_water
        fixed = quotas if quotas is not None else Quotas.budget_only()
        self._current_quotas = quotas if callable(quotas) else (lambda: fixed)
        self.quotas = self._current_quotas()
        self.index_log = index_log
        self.clock = clock
        self.evicted = 0
        self.refused = 0
        self.refusals: dict[str, int] = {}  # refused writes by the writer's kind of namespace
        self._taken: tuple[dict[str, int], int] = ({}, 0)  # the counts ``take_counts`` gave
        self.shards = Shards.of(store, max_bytes)
        self._known: int | None = None
        self._measured_at = float("-inf")  # by ``clock``
        self._groups: dict[str, int] = {}
        self._pools: dict[str, int] = {}
        self._idle: dict[str, int] = {}  # bytes of pooled entries idle at the measurement
        self._next_idle = float("-inf")  # when the next one turns idle (unix time)
        self._lock = threading.Lock()

    def allow_write(
        self, nbytes: int, fingerprint: str | None = "", key: str | None = None
    ) -> bool:
        """Make room for a write of ``nbytes`` by the entry of ``fingerprint`` (its
        group is charged) under cache key ``key`` (on Redis, its primary must hold
        it too); False: refused (larger than its quota, no room without evicting
        a group within its quota, or its primary full)."""
        self.quotas = self._current_quotas()
        group = self.quotas.group(fingerprint)
        pool = self.quotas.pool(group)
        if nbytes > self.quotas.limit(group, self.max_bytes):
            self._refuse(group)
            return False
        sharded = self.shards is not None and key is not None
        with self._lock:
            shard_full = sharded and not self.shards.fits(key, nbytes)
            if (shard_full and self.shards.refused_lately(key)) or (
                (shard_full or self._near(group, pool, nbytes))
                and not self._make_room(group, nbytes, key if sharded else None)
            ):
                self._refuse(group)
                return False
            assert self._known is not None
            self._known += nbytes
            self._charge(group, nbytes)
            if sharded:
                self.shards.add(key, nbytes)
            return True

    def take_counts(self) -> tuple[dict[str, int], int]:
        """Refused writes (by the writer's kind of namespace) and evictions since the
        last call."""
        with self._lock:
            refusals, evicted = dict(self.refusals), self.evicted
        before, before_evicted = self._taken
        self._taken = (refusals, evicted)
        since = {kind: n - before.get(kind, 0) for kind, n in refusals.items()}
        return since, evicted - before_evicted

    def _refuse(self, group: str) -> None:
        self.refused += 1
        kind = namespace_kind(group) if group != UNREADABLE else None
        self.refusals[kind or "unreadable"] = self.refusals.get(kind or "unreadable", 0) + 1

    def _near(self, group: str, pool: str | None, nbytes: int) -> bool:
        """Whether a write of ``nbytes`` in ``group`` may pass a bound."""
        if self._known is None or self._known + nbytes > self.max_bytes:
            return True
        if self._groups.get(group, 0) + nbytes > self.quotas.limit(group, self.max_bytes):
            return True
        if pool is None:
            return False
        return self._pools.get(pool, 0) + nbytes > self.quotas.pool_limit(pool, self.max_bytes)

    def _charge(self, group: str, nbytes: int) -> None:
        self._groups[group] = self._groups.get(group, 0) + nbytes
        pool = self.quotas.pool(group)
        if pool is not None:
            self._pools[pool] = self._pools.get(pool, 0) + nbytes

    def _surely_refused(self, group: str, nbytes: int) -> bool:
        """Whether the last measurement, if recent, shows that a write of ``nbytes``
        in ``group`` cannot fit its pool or the store even with all of the
        writer's group, every group out of its quota and every idle pooled entry
        gone. Saves a listing per write while the store, or the writer's pool,
        is full of groups within their quotas."""
        if self._known is None or self.clock() - self._measured_at > self.REMEASURE_S:
            return False
        if time.time() >= self._next_idle:
            return False
        quotas, limit = self.quotas, self.max_bytes

        def out(name: str, held: int) -> bool:
            pool_held = self._pools.get(quotas.pool(name) or "", 0)
            return name in (group, UNREADABLE) or quotas.over(name, held, pool_held, limit)

        free = {name: held for name, held in self._groups.items() if out(name, held)}
        if self._known + nbytes - sum(free.values()) - sum(self._idle.values()) > limit:
            return True
        pool = quotas.pool(group)
        if pool is None:
            return False
        pool_free = self._idle.get(pool, 0)
        pool_free += sum(held for name, held in free.items() if quotas.pool(name) == pool)
        return self._pools.get(pool, 0) + nbytes - pool_free > quotas.pool_limit(pool, limit)

    def _measured(self, kept: list[EntryInfo], reserved: int) -> None:
        """Count what the store holds now: by group, by pool, and its idle entries."""
        self._known = reserved + sum(info.nbytes for info in kept)
        self._measured_at, now = self.clock(), time.time()
        self._groups, self._pools = {}, {}
        self._idle, self._next_idle = {}, float("inf")
        for info in kept:
            group = self.quotas.group(info.fingerprint)
            self._charge(group, info.nbytes)
            pool = self.quotas.pool(group)
            if pool is None:
                continue
            idle_at = (info.updated_at or 0.0) + self.quotas.shares(pool).idle_s
            if idle_at <= now:
                self._idle[pool] = self._idle.get(pool, 0) + info.nbytes
            else:
                self._next_idle = min(self._next_idle, idle_at)

    def _make_room(self, group: str, nbytes: int, key: str | None = None) -> bool:
        """Measure the store; evict what the bounds need (and compact the index log).
        False: the write does not fit (refused), or the primary of ``key`` cannot
        hold it."""
        if self._surely_refused(group, nbytes):
            return False
        live = self.store.temp_files()
        entries, expired = [], []  # (private entries past their time go at every measurement)
        for info in self.store.entries():
            (expired if expired_private(info) else entries).append(info)
        reserved = sum(t.nbytes for t in live) + self._log_bytes()
        selection = select_for_budget(
            entries,
            self.quotas,
            self.max_bytes,
            writing=group,
            nbytes=nbytes,
            reserved_bytes=reserved,
            low_water=self.low_water,
        )
        chosen = expired + selection.evict
        room = selection.fits
        if self.shards is not None:
            by_shard = self.shards.measure(entries + expired, {info.key for info in chosen})
            if key is not None and room:
                there = self.shards.select(
                    by_shard,
                    key,
                    nbytes,
                    writing=group,
                    quotas=self.quotas,
                    low_water=self.low_water,
                )
                room = there is not None
                chosen += there or []
        for info in chosen:
            self.store.delete(info.key)
        self.evicted += len(chosen)
        gone = {info.key for info in chosen}
        kept = [info for info in entries if info.key not in gone]
        if chosen and self.index_log is not None:
            self._compact_log({info.key for info in kept})
            reserved = sum(t.nbytes for t in live) + self._log_bytes()
        self._measured(kept, reserved)
        return room

    def _log_bytes(self) -> int:
        if self.index_log is None:
            return 0
        try:
            return int(self.index_log.nbytes())
        except Exception:  # an unreachable log: its entries' budget still holds
            return 0

    def _compact_log(self, live_keys: set[str]) -> None:
        """Drop the index log's records of entries no longer stored (an entry written
        since the listing is asked for by key)."""
        from kvrag_integrations.chunk_kv import cache_key

        def live(namespace: str, ids: Any) -> bool:
            key = cache_key(namespace, ids.tolist())
            return key in live_keys or self.store.contains(key)

        try:
            kept, dropped = self.index_log.compact(live)
        except Exception as exc:  # the entries are evicted all the same
            logger.warning("index log not compacted: %s", exc)
            return
        if dropped:
            logger.info("index log compacted: %d records kept, %d dropped", kept, dropped)
