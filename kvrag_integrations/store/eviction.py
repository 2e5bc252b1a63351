"""What a write evicts: the rules of ``quotas`` applied to a store's entries.

``select_for_budget`` chooses, for a write into one group, what to evict from
the whole store (the steps of ``quotas``' docstring); ``select_on_shard`` what
to evict from one Redis primary (``shards``) without evicting any group within
its quota over the whole store; ``select_over_quota`` what a prune evicts
(``maintenance``): groups over their quota first.
"""

from __future__ import annotations

import heapq
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvrag_integrations.store.base import EntryInfo
from kvrag_integrations.store.quotas import UNREADABLE, Quotas


@dataclass(frozen=True)
class Selection:
    """What a write needs (``select_for_budget``).

    Attributes:
        evict: the entries to delete first, in order.
        fits: whether the write fits once they are gone (False: refused; only
            the unreadable entries are chosen).
    """

    evict: list[EntryInfo]
    fits: bool


def _recency(info: EntryInfo) -> tuple[bool, float]:
    """Least recently used first (unknown times first)."""
    return (info.updated_at is not None, info.updated_at or 0.0)


Where = Callable[[EntryInfo], bool]
"""Which entries a selection may evict (all of them, or one shard's)."""


class _Group:
    __slots__ = ("held", "limit", "name", "pool", "queue")

    def __init__(
        self, name: str, pool: str | None, limit: int, infos: list[EntryInfo], where: Where
    ) -> None:
        self.name, self.pool, self.limit = name, pool, limit
        self.queue = deque(sorted((i for i in infos if where(i)), key=_recency))
        self.held = sum(i.nbytes for i in infos)  # (all of it: the quota is the store's)


class _Book:
    """The bytes of every group and pool as a selection evicts from them, the write
    of ``nbytes`` in group ``writing`` counted; only entries ``where`` allows are
    evicted (groups and pools count all of theirs)."""

    def __init__(
        self,
        entries: Iterable[EntryInfo],
        quotas: Quotas,
        max_bytes: int,
        now: float,
        writing: str,
        nbytes: int,
        where: Where = lambda info: True,
    ) -> None:
        by_group: dict[str, list[EntryInfo]] = defaultdict(list)
        for info in entries:
            by_group[quotas.group(info.fingerprint)].append(info)
        self.unreadable = [i for i in by_group.pop(UNREADABLE, []) if where(i)]
        self.where = where
        self.quotas, self.max_bytes, self.now = quotas, max_bytes, now
        self.pools: dict[str, int] = defaultdict(int)
        self.groups = {name: self._group(name, infos) for name, infos in by_group.items()}
        self.own = self.groups.get(writing) or self._group(writing, [])
        self.groups[writing] = self.own
        self.nbytes = nbytes
        self.total = sum(g.held for g in self.groups.values())
        self.chosen: list[EntryInfo] = []
        self.charge(self.own, nbytes)

    def _group(self, name: str, infos: list[EntryInfo]) -> _Group:
        limit = self.quotas.limit(name, self.max_bytes)
        group = _Group(name, self.quotas.pool(name), limit, infos, self.where)
        if group.pool is not None:
            self.pools[group.pool] += group.held
        return group

    def charge(self, group: _Group, nbytes: int) -> None:
        group.held += nbytes
        self.total += nbytes
        if group.pool is not None:
            self.pools[group.pool] += nbytes

    def evict(self, group: _Group) -> None:
        info = group.queue.popleft()
        self.chosen.append(info)
        self.charge(group, -info.nbytes)

    def pool_over(self, pool: str | None, bound: int | None = None) -> bool:
        """Whether ``pool`` holds more than ``bound`` (its limit), the write counted."""
        if pool is None:
            return False
        limit = self.quotas.pool_limit(pool, self.max_bytes) if bound is None else bound
        return self.pools[pool] > limit

    def out_of_quota(self, group: _Group) -> bool:
        """Whether another group than the writer's may give up its least recently used
        entry: the group past its limit, its pool past the pool's without the write
        (a pool only this write fills is not), or the entry an idle pooled one."""
        if self.idle(group):
            return True
        write = self.nbytes if group.pool is not None and group.pool == self.own.pool else 0
        pool_held = self.pools[group.pool] - write if group.pool is not None else 0
        return self.quotas.over(group.name, group.held, pool_held, self.max_bytes)

    def idle(self, group: _Group) -> bool:
        """Whether ``group``'s least recently used entry is a pooled one unused for its
        pool's ``idle_s`` (unknown times count as idle)."""
        if group.pool is None or not group.queue:
            return False
        used = group.queue[0].updated_at
        return used is None or self.now - used > self.quotas.shares(group.pool).idle_s

    def fits(self, reserved_bytes: int) -> bool:
        own = self.own
        within = own.held <= own.limit and not self.pool_over(own.pool)
        return within and reserved_bytes + self.total <= self.max_bytes

    def evict_own(self, more: Callable[[], bool]) -> None:
        while self.own.queue and more():
            self.evict(self.own)

    def evict_others(self, groups: Iterable[_Group], more: Callable[[], bool]) -> None:
        """While ``more()``: evict the least recently used entry among the heads of
        ``groups`` out of their quota (asked at each eviction; a group that is not,
        is not again: its bytes only shrink, its next entry is used more recently)."""
        heap = [(_recency(g.queue[0]), g.name) for g in groups if g.queue and g is not self.own]
        heapq.heapify(heap)
        while heap and more():
            _, name = heapq.heappop(heap)
            group = self.groups[name]
            if not self.out_of_quota(group):
                continue
            self.evict(group)
            if group.queue:
                heapq.heappush(heap, (_recency(group.queue[0]), name))


def select_for_budget(
    entries: Iterable[EntryInfo],
    quotas: Quotas,
    max_bytes: int,
    *,
    writing: str,
    nbytes: int,
    reserved_bytes: int = 0,
    low_water: float = 0.8,
    now: float | None = None,
) -> Selection:
    """What to evict before a write of ``nbytes`` in group ``writing``, and whether it
    fits then (the three steps of the module docstring; ``now``: the unix time
    idle entries are judged at, default ``time.time()``).

    Examples:
        >>> key, salt = "key-" + "a" * 24, "salt-" + "b" * 24
        >>> infos = [EntryInfo("a", 45, 1.0, "m+ns-" + key), EntryInfo("b", 45, 2.0, "m"),
        ...          EntryInfo("c", 5, 3.0, "m+ns-" + salt)]
        >>> pick = select_for_budget(infos, Quotas(0.5), 100, writing=key, nbytes=10, now=9)
        >>> [i.key for i in pick.evict], pick.fits  # past its quota: its own go
        (['a'], True)
        >>> new = "salt-" + "c" * 24
        >>> pick = select_for_budget(infos, Quotas(0.5), 100, writing=new, nbytes=6, now=9)
        >>> [i.key for i in pick.evict], pick.fits  # every other group within its quota
        ([], False)
        >>> pick = select_for_budget(infos, Quotas(0.5), 100, writing=new, nbytes=6, now=5000)
        >>> [i.key for i in pick.evict], pick.fits  # the other salt unused for an hour
        (['c'], True)
    """
    now = time.time() if now is None else now
    book = _Book(entries, quotas, max_bytes, now, writing, nbytes)
    own = book.own
    # 1. its group past its limit: its own entries
    if own.held > own.limit:
        target = int(own.limit * low_water)
        book.evict_own(lambda: own.held > target)
    # 2. its pool past the pool's limit: its own entries (until the write fits, and
    # toward the low-water mark only a low-water share of its own), then the pool's
    # out of quota
    if own.pool is not None and book.pool_over(own.pool):
        target = int(quotas.pool_limit(own.pool, max_bytes) * low_water)
        floor = int(own.held * low_water)
        book.evict_own(
            lambda: (
                book.pool_over(own.pool) or (book.pool_over(own.pool, target) and own.held > floor)
            )
        )
        members = [g for g in book.groups.values() if g.pool == own.pool]
        book.evict_others(members, lambda: book.pool_over(own.pool, target))
    # 3. the store past its budget: its own entries (as in 2), then those out of
    # their quota
    if own.held <= own.limit and not book.pool_over(own.pool):
        target = int(max_bytes * low_water)
        if reserved_bytes + book.total > max_bytes:
            floor = int(own.held * low_water)
            book.evict_own(
                lambda: (
                    reserved_bytes + book.total > max_bytes
                    or (reserved_bytes + book.total > target and own.held > floor)
                )
            )
            book.evict_others(book.groups.values(), lambda: reserved_bytes + book.total > target)
    if not book.fits(reserved_bytes):
        return Selection(list(book.unreadable), False)
    return Selection(book.unreadable + book.chosen, True)


def select_on_shard(
    entries: Iterable[EntryInfo],
    quotas: Quotas,
    max_bytes: int,
    *,
    writing: str,
    nbytes: int,
    where: Where,
    need: int,
    want: int,
    now: float | None = None,
) -> list[EntryInfo] | None:
    """What to evict on one shard (the entries ``where`` allows) for a write of
    ``nbytes`` in group ``writing`` there: at least ``need`` bytes, at most ``want``
    (toward the shard's low-water mark), of the writer's own entries there (only
    until ``need``), then the least recently used there of groups out of their
    quota over the whole store (``entries``: all of it, so that a group the
    hashing put mostly on one primary is judged by what it holds in all). None:
    ``need`` cannot be freed without evicting a group within its quota.

    Examples:
        >>> a, b = "m+ns-key-" + "a" * 24, "m+ns-key-" + "b" * 24
        >>> infos = [EntryInfo("a", 40, 1.0, a), EntryInfo("b", 40, 2.0, b)]
        >>> on_one = lambda info: True  # both on the shard written to
        >>> select_on_shard(infos, Quotas(0.5), 200, writing="", nbytes=10, where=on_one,
        ...                 need=30, want=50) is None  # both within their quota of the store
        True
    """
    now = time.time() if now is None else now
    book = _Book(entries, quotas, max_bytes, now, writing, nbytes, where)
    freed = lambda: sum(info.nbytes for info in book.unreadable + book.chosen)  # noqa: E731
    book.evict_own(lambda: freed() < need)
    book.evict_others(book.groups.values(), lambda: freed() < want)
    return book.unreadable + book.chosen if freed() >= need else None


def select_over_quota(
    entries: Iterable[EntryInfo],
    quotas: Quotas,
    max_bytes: int,
    *,
    reserved_bytes: int = 0,
    now: float | None = None,
) -> list[EntryInfo]:
    """What a prune to ``max_bytes`` evicts, until the store (with ``reserved_bytes``)
    fits: unreadable entries, then, one at a time, the least recently used entry
    of a group out of its quota (``Quotas.over``, idle pooled entries), then the
    least recently used of any group.

    Examples:
        >>> a, b = "m+ns-key-" + "a" * 24, "m+ns-key-" + "b" * 24
        >>> infos = [EntryInfo("a", 70, 1.0, a), EntryInfo("b", 30, 2.0, b),
        ...          EntryInfo("c", 30, 3.0, a)]
        >>> [i.key for i in select_over_quota(infos, Quotas(0.5), 110)]  # key's over its 55
        ['a']
    """
    now = time.time() if now is None else now
    book = _Book(entries, quotas, max_bytes, now, UNREADABLE, 0)
    unreadable, book.unreadable = sorted(book.unreadable, key=_recency), []
    held = [sum(info.nbytes for info in unreadable)]
    over = lambda: reserved_bytes + held[0] + book.total > max_bytes  # noqa: E731
    while unreadable and over():
        book.chosen.append(unreadable.pop(0))
        held[0] -= book.chosen[-1].nbytes
    book.evict_others(book.groups.values(), over)
    while over():
        heads = [g for g in book.groups.values() if g.queue and g is not book.own]
        if not heads:
            break
        book.evict(min(heads, key=lambda g: _recency(g.queue[0])))
    return book.chosen
