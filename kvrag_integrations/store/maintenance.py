"""Looking after a store: what it holds, which entries are corrupt, what to evict."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvrag_integrations.store.base import EntryInfo, KVStore
from kvrag_integrations.store.quotas import UNREADABLE, Quotas, select_for_budget
from kvrag_integrations.store.shards import Shards

logger = logging.getLogger(__name__)


@dataclass
class StoreSummary:
    """Totals over a store's entries (see :func:`summarize`).

    Attributes:
        entries: how many entries.
        nbytes: their total stored size (temp files not included).
        by_fingerprint: entries per model fingerprint (``None``: unreadable header).
        oldest, newest: the earliest and latest ``updated_at`` (``None``: unknown).
        temp_files, temp_bytes: partial writes of writers that may be alive
            (in flight here, or on another host), apart from the entries.
        temp_files_reclaimed, temp_bytes_reclaimed: partial writes of dead
            writers removed since the store last reported (by this call too).
    """

    entries: int = 0
    nbytes: int = 0
    by_fingerprint: dict[str | None, int] = field(default_factory=dict)
    oldest: float | None = None
    newest: float | None = None
    temp_files: int = 0
    temp_bytes: int = 0
    temp_files_reclaimed: int = 0
    temp_bytes_reclaimed: int = 0


def summarize(store: KVStore) -> StoreSummary:
    """Count the entries of ``store``, their bytes and their fingerprints, and its
    temp files (removing dead writers' first)."""
    temps = store.temp_files()
    infos = list(store.entries())
    times = [i.updated_at for i in infos if i.updated_at is not None]
    reclaimed, reclaimed_bytes = store.reclaim_temp_files()
    return StoreSummary(
        entries=len(infos),
        nbytes=sum(i.nbytes for i in infos),
        by_fingerprint=dict(Counter(i.fingerprint for i in infos).most_common()),
        oldest=min(times, default=None),
        newest=max(times, default=None),
        temp_files=len(temps),
        temp_bytes=sum(t.nbytes for t in temps),
        temp_files_reclaimed=reclaimed,
        temp_bytes_reclaimed=reclaimed_bytes,
    )


def find_corrupt(store: KVStore, *, delete: bool = False) -> list[tuple[str, str]]:
    """Decode every entry with the codec (checksums included) and list the bad ones.

    Args:
        store: the store to check.
        delete: also remove each bad entry.

    Returns:
        ``(key, reason)`` per entry that cannot be used, in the store's key order.
    """
    bad = []
    for key in list(store.keys()):
        reason = store.check(key)
        if reason is not None:
            bad.append((key, reason))
            if delete:
                store.delete(key)
    return bad


def select_for_pruning(
    entries: Iterable[EntryInfo],
    *,
    max_bytes: int | None = None,
    older_than_s: float | None = None,
    foreign_to: str | None = None,
    now: float | None = None,
    reserved_bytes: int = 0,
) -> list[EntryInfo]:
    """Choose the entries to evict; every criterion given adds to the choice.

    Args:
        entries: the store's entries (``store.entries()``).
        max_bytes: after the other criteria, evict the least recently updated
            entries (unknown times first) until the rest, plus
            ``reserved_bytes``, fit in this many bytes.
        older_than_s: evict entries last updated more than this many seconds ago
            (entries of unknown age are kept).
        foreign_to: evict entries whose fingerprint is readable and differs from
            this one (entries made by another model, tokenizer or dtype).
        now: the current unix time (default: ``time.time()``).
        reserved_bytes: bytes the store holds besides its entries that cannot
            be evicted (live writers' temp files): they count toward ``max_bytes``.

    Returns:
        The chosen entries, in the order they should be deleted.

    Examples:
        >>> infos = [EntryInfo("a", 10, 100.0, "m"), EntryInfo("b", 10, 200.0, "m"),
        ...          EntryInfo("c", 10, 300.0, "other")]
        >>> [i.key for i in select_for_pruning(infos, foreign_to="m")]
        ['c']
        >>> [i.key for i in select_for_pruning(infos, max_bytes=15)]
        ['a', 'b']
        >>> [i.key for i in select_for_pruning(infos, older_than_s=150, now=300.0)]
        ['a']
        >>> [i.key for i in select_for_pruning(infos, max_bytes=25, reserved_bytes=10)]
        ['a', 'b']
    """
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    if older_than_s is not None and older_than_s < 0:
        raise ValueError(f"older_than_s must be >= 0, got {older_than_s}")
    now = time.time() if now is None else now
    keep: list[EntryInfo] = []
    chosen: list[EntryInfo] = []
    for info in entries:
        foreign = foreign_to is not None and info.fingerprint not in (None, foreign_to)
        old = older_than_s is not None and info.updated_at is not None
        old = old and now - info.updated_at > older_than_s
        (chosen if foreign or old else keep).append(info)
    if max_bytes is not None:
        keep.sort(key=lambda i: (i.updated_at is not None, i.updated_at or 0.0))
        total = reserved_bytes + sum(i.nbytes for i in keep)
        for info in keep:
            if total <= max_bytes:
                break
            chosen.append(info)
            total -= info.nbytes
    return chosen


class PruneResult(list[EntryInfo]):
    """The entries :func:`prune` evicted (or would evict: ``dry_run``), in order (a
    plain list of ``EntryInfo``), with what it found of partial writes.

    Attributes:
        temp_files_reclaimed, temp_bytes_reclaimed: dead writers' temp files
            removed (since the store last reported them).
        temp_files, temp_bytes: live writers' temp files, kept and counted
            toward ``max_bytes``.
    """

    temp_files_reclaimed: int = 0
    temp_bytes_reclaimed: int = 0
    temp_files: int = 0
    temp_bytes: int = 0


def prune(store: KVStore, *, dry_run: bool = False, **criteria: float | str | None) -> PruneResult:
    """Remove dead writers' temp files, then evict what the criteria choose (see
    :func:`select_for_pruning`; live writers' temp bytes count toward ``max_bytes``).

    ``dry_run``: choose, evict nothing (dead writers' temp files are still
    removed: every listing of the store removes them)."""
    live = store.temp_files()
    result = PruneResult(
        select_for_pruning(
            store.entries(),
            reserved_bytes=sum(t.nbytes for t in live),
            **criteria,  # type: ignore[arg-type]
        )
    )
    if not dry_run:
        for info in result:
            store.delete(info.key)
    result.temp_files_reclaimed, result.temp_bytes_reclaimed = store.reclaim_temp_files()
    result.temp_files, result.temp_bytes = len(live), sum(t.nbytes for t in live)
    return result


class StoreBudget:
    """Keeps a store within ``max_bytes`` as entries are written to it, and each
    group of namespaces within its quota (``store.quotas``).

    Before a write that would take its group past its quota, its pool past the
    pool's, or the store past its budget, entries are evicted as
    ``quotas.select_for_budget`` chooses: the writer's group's own least
    recently used ones first, then only those of groups over their quota. A
    write that cannot fit without evicting a group within its quota is refused
    (``admit`` is False: the entry is not stored). ``EntryInfo.updated_at``
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
            connector gives each group a share).
        index_log: the content index's log beside the store (``matching``), or None.
        clock: seconds, for how old a measurement is (``time.monotonic``).

    Examples:
        >>> from kvrag_integrations.store.memory import MemoryKVStore
        >>> StoreBudget(MemoryKVStore(), max_bytes=100).admit(200)
        False
    """

    # How long a measurement decides refusals: others' deletes (a private entry
    # dropped after its request) are seen this late; a flood of refused writes
    # lists the store at most once per this.
    REMEASURE_S = 1.0

    def __init__(
        self,
        store: KVStore,
        max_bytes: int,
        low_water: float = 0.8,
        *,
        quotas: Quotas | None = None,
        index_log: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.store = store
        self.max_bytes = max_bytes
        self.low_water = low_water
        self.quotas = quotas if quotas is not None else Quotas.budget_only()
        self.index_log = index_log
        self.clock = clock
        self.evicted = 0
        self.refused = 0
        self.shards = Shards.of(store, max_bytes)
        self._known: int | None = None
        self._measured_at = float("-inf")  # by ``clock``
        self._groups: dict[str, int] = {}
        self._pools: dict[str, int] = {}
        self._idle: dict[str, int] = {}  # bytes of pooled entries idle at the measurement
        self._next_idle = float("-inf")  # when the next one turns idle (unix time)
        self._lock = threading.Lock()

    def admit(self, nbytes: int, fingerprint: str | None = "", key: str | None = None) -> bool:
        """Make room for a write of ``nbytes`` by the entry of ``fingerprint`` (its
        group is charged) under cache key ``key`` (on Redis, its primary must hold
        it too); False: refused (larger than its quota, no room without evicting
        a group within its quota, or its primary full)."""
        group = self.quotas.group(fingerprint)
        pool = self.quotas.pool(group)
        if nbytes > self.quotas.limit(group, self.max_bytes):
            self.refused += 1
            return False
        sharded = self.shards is not None and key is not None
        with self._lock:
            shard_full = sharded and not self.shards.fits(key, nbytes)
            if (shard_full and self.shards.refused_lately(key)) or (
                (shard_full or self._near(group, pool, nbytes))
                and not self._make_room(group, nbytes, key if sharded else None)
            ):
                self.refused += 1
                return False
            assert self._known is not None
            self._known += nbytes
            self._charge(group, nbytes)
            if sharded:
                self.shards.add(key, nbytes)
            return True

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
            if name in (group, UNREADABLE) or held > quotas.limit(name, limit):
                return True
            of = quotas.pool(name)
            return of is not None and self._pools.get(of, 0) > quotas.pool_limit(of, limit)

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
        entries = list(self.store.entries())
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
        chosen = list(selection.evict)
        room = selection.admitted
        if self.shards is not None:
            by_shard = self.shards.measure(entries, {info.key for info in chosen})
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
