"""Looking after a store: what it holds, which entries are corrupt, what to evict."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvrag_integrations.store.base import EntryInfo, KVStore
from kvrag_integrations.store.quotas import Quotas, select_for_budget
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

    Before a write that would take its namespace's group past its quota, or the
    store past its budget, entries are evicted (``quotas.select_for_budget``:
    the group's own least recently used ones, then those of whichever group
    holds the most) until the store holds at most ``low_water`` of the budget
    with the new entry. ``EntryInfo.updated_at`` orders use (``touch`` marks
    one). The store's size counts its entries, live writers' temp files and the
    content index's log (``index_log``), which is compacted after each eviction
    (the records of evicted entries go). The sizes are measured then and counted
    forward from each write in between, so a write costs no listing until a
    bound is near. Writers in other processes are seen at the next measurement:
    the budget holds per writer, and across writers up to what they write in
    between. On Redis each primary (one server, or each of a cluster's) is kept
    within its own bounds as well (``store.shards``: its share of the budget,
    and its ``maxmemory`` with all else it holds): a write whose primary is
    full evicts there first, or is refused.

    Args:
        store: the store to keep in bounds.
        max_bytes: its budget (``budget.store_budget`` sizes one from the store).
        low_water: the share of a bound an eviction frees down to.
        quotas: the namespaces' quotas (default: none but the budget; a server's
            connector gives each group a share).
        index_log: the content index's log beside the store (``matching``), or None.

    Examples:
        >>> from kvrag_integrations.store.memory import MemoryKVStore
        >>> StoreBudget(MemoryKVStore(), max_bytes=100).admit(200)
        False
    """

    def __init__(
        self,
        store: KVStore,
        max_bytes: int,
        low_water: float = 0.8,
        *,
        quotas: Quotas | None = None,
        index_log: Any = None,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.store = store
        self.max_bytes = max_bytes
        self.low_water = low_water
        self.quotas = quotas if quotas is not None else Quotas(share=1.0)
        self.index_log = index_log
        self.evicted = 0
        self.shards = Shards.of(store, max_bytes)
        self._known: int | None = None
        self._groups: dict[str, int] = {}
        self._lock = threading.Lock()

    def admit(self, nbytes: int, fingerprint: str | None = "", key: str | None = None) -> bool:
        """Make room for a write of ``nbytes`` by the entry of ``fingerprint`` (its
        namespace's group is charged) under cache key ``key`` (on Redis, its primary
        must hold it too); False if it could not fit."""
        group = self.quotas.group(fingerprint)
        limit = self.quotas.limit(group, self.max_bytes)
        if nbytes > limit:
            return False
        sharded = self.shards is not None and key is not None
        with self._lock:
            near = self._known is None or self._known + nbytes > self.max_bytes
            shard_full = sharded and not self.shards.fits(key, nbytes)
            if shard_full and self.shards.refused_lately(key):
                return False
            over = near or shard_full or self._groups.get(group, 0) + nbytes > limit
            if over and not self._make_room(group, nbytes, key if sharded else None):
                return False
            assert self._known is not None
            self._known += nbytes
            self._groups[group] = self._groups.get(group, 0) + nbytes
            if sharded:
                self.shards.add(key, nbytes)
            return True

    def _make_room(self, group: str, nbytes: int, key: str | None = None) -> bool:
        """Measure the store; evict what the bounds need (and compact the index log).
        False: the primary of ``key`` cannot hold the write."""
        live = self.store.temp_files()
        entries = list(self.store.entries())
        reserved = sum(t.nbytes for t in live) + self._log_bytes()
        chosen = select_for_budget(
            entries,
            self.quotas,
            self.max_bytes,
            writing=group,
            nbytes=nbytes,
            reserved_bytes=reserved,
            low_water=self.low_water,
        )
        room = True
        if self.shards is not None:
            by_shard = self.shards.measure(entries, {info.key for info in chosen})
            if key is not None:
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
        self._known = reserved + sum(info.nbytes for info in kept)
        self._groups = {}
        for info in kept:
            name = self.quotas.group(info.fingerprint)
            self._groups[name] = self._groups.get(name, 0) + info.nbytes
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
