"""Quotas in a store's budget: no write evicts what another group holds within its quota.

Entries are grouped by the namespace their fingerprint names (``namespaces``
reads it, and its kind):

- the shared namespace (``""``): what writers ingested for everyone;
- each API key's namespace;
- each client ``cache_salt``'s namespace; all of them together are the salts'
  pool;
- each request's private entries; all of them together are the private pool;
- entries whose header cannot be read, or whose namespace id names no kind
  (``"?"``): no request reads them, so every eviction takes them first.

Limits, as shares of the budget ``B`` (``Quotas``):

- the shared namespace and each key's: the bytes ``named`` gives it (the key
  file's ``quota_bytes``), else ``share * B`` (half);
- each salt: ``salts.each * B`` (1/16), all salts together
  ``salts.together * B`` (1/4). A client can name any number of salts: many
  small ones together hold no more than their pool;
- each request's private entries, and all of them together:
  ``private.each * B``, ``private.together * B`` (1/4 both).

Another group's entry is out of its quota, and a write may evict it, while
its group holds more than its limit, its pool more than the pool's (this
write not counted: a pool the write alone would fill is not over), or, in a
pool, while it has not been used for the pool's ``idle_s`` (salts: an hour;
private entries: ten minutes; ``EntryInfo.updated_at``, which loads refresh;
unknown: idle): a salt no one uses any more, or the private entry of a
request long answered, does not keep its pool's room for ever. A write of
``n`` bytes into group ``w`` (``select_for_budget``):

1. that takes ``w`` past its limit evicts ``w``'s own least recently used
   entries until ``w`` holds ``low_water`` of its limit with the write;
2. that takes ``w``'s pool past the pool's limit evicts ``w``'s own least
   recently used entries, then, one at a time, the least recently used entry
   of the pool out of its quota, until the pool holds ``low_water`` of its
   limit;
3. that takes the store (its entries, the write and ``reserved_bytes``) past
   the budget evicts ``w``'s own least recently used entries, then, one at a
   time, the least recently used entry out of its quota, until the store
   holds ``low_water`` of the budget.

A write that still does not fit its group, its pool and the store is
refused: it evicts only the ``"?"`` entries and is not stored, which costs
later requests reuse, never correctness. So a write evicts nothing another
group holds within its quota: a flood of salts or of private entries fills
its pool and is then refused, a tenant past its quota gives way itself, and
the shared namespace, every key namespace and every salt in use keep what
they hold within their quotas. Quotas bound groups, they reserve nothing:
where the limits add up to more than the budget (each key's is half of it
unless the key file says otherwise), what each group holds within its quota
stays, and a write that finds no room is refused.
"""

from __future__ import annotations

import heapq
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvrag_integrations.store.base import EntryInfo
from kvrag_integrations.store.namespaces import (
    PRIVATE,
    SALT,
    SHARED_ID,
    namespace_kind,
    namespace_of,
)

UNREADABLE = "?"
DEFAULT_SHARE = 0.5


@dataclass(frozen=True)
class Pool:
    """A kind of namespace any client can mint: the shares of the budget all of them
    hold ``together`` and ``each`` one, and how long an entry keeps its room
    unused (``idle_s``)."""

    together: float
    each: float
    idle_s: float

    def __post_init__(self) -> None:
        for name in ("together", "each"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"a pool's share {name} is a number, got {value!r}")
            if not 0 < value <= 1:
                raise ValueError(f"a pool's share {name} is in (0, 1], got {value}")
        if isinstance(self.idle_s, bool) or not isinstance(self.idle_s, (int, float)):
            raise ValueError(f"a pool's idle_s is seconds, got {self.idle_s!r}")
        if self.idle_s < 0:
            raise ValueError(f"a pool's idle_s is >= 0, got {self.idle_s}")


SALT_POOL = Pool(together=0.25, each=1 / 16, idle_s=3600.0)
PRIVATE_POOL = Pool(together=0.25, each=0.25, idle_s=600.0)


@dataclass(frozen=True)
class Quotas:
    """How much of the budget each group may hold (see the module docstring).

    Attributes:
        share: the share of the budget of the shared namespace and of each key's
            unless named (0 to 1].
        named: namespace ids (a key's, or ``""``: the shared one) with their own
            quota in bytes (0: ``share``).
        salts: the salts' pool (all client salts together, and each).
        private: the private pool (all requests' private entries together, and
            each request's).
        grouped: entries are grouped by namespace (False: the store is one
            group, least recently used first, whoever wrote what).
    """

    share: float = DEFAULT_SHARE
    named: Mapping[str, int] = field(default_factory=dict)
    salts: Pool = SALT_POOL
    private: Pool = PRIVATE_POOL
    grouped: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1:
            raise ValueError(f"a namespace's share of the budget is in (0, 1], got {self.share}")
        for name, quota in self.named.items():
            if isinstance(quota, bool) or not isinstance(quota, int) or quota < 0:
                raise ValueError(f"the quota of namespace {name!r} must be bytes >= 0")

    @classmethod
    def budget_only(cls) -> Quotas:
        """No bound but the budget: the store is one group (its least recently used
        entries go first, whoever wrote them)."""
        return cls(1.0, grouped=False)

    def group(self, fingerprint: str | None) -> str:
        """The group an entry of ``fingerprint`` counts in: its namespace id, or
        ``"?"`` (an unreadable header, an id of no kind)."""
        namespace = namespace_of(fingerprint)
        if namespace is None or namespace_kind(namespace) is None:
            return UNREADABLE
        return namespace if self.grouped else SHARED_ID

    def pool(self, group: str) -> str | None:
        """The pool ``group`` counts in (``"salt"``, ``"private"``), or None."""
        kind = namespace_kind(group)
        return kind if kind in (SALT, PRIVATE) else None

    def limit(self, group: str, max_bytes: int) -> int:
        """The most bytes ``group`` may hold in a budget of ``max_bytes`` (in a pool:
        its own share, at most the pool's)."""
        if group == UNREADABLE:
            return 0
        pool = self.pool(group)
        if pool is not None:
            shares = self.shares(pool)
            return int(min(shares.each, shares.together) * max_bytes)
        quota = self.named.get(group) or int(self.share * max_bytes)
        return min(quota, max_bytes)

    def pool_limit(self, pool: str, max_bytes: int) -> int:
        """The most bytes all groups of ``pool`` may hold together."""
        return int(self.shares(pool).together * max_bytes)

    def shares(self, pool: str) -> Pool:
        return self.salts if pool == SALT else self.private


@dataclass(frozen=True)
class Selection:
    """What a write needs (``select_for_budget``).

    Attributes:
        evict: the entries to delete first, in order.
        admitted: whether the write fits once they are gone (False: refused; only
            the unreadable entries are chosen).
    """

    evict: list[EntryInfo]
    admitted: bool


def _recency(info: EntryInfo) -> tuple[bool, float]:
    """Least recently used first (unknown times first)."""
    return (info.updated_at is not None, info.updated_at or 0.0)


class _Group:
    __slots__ = ("held", "limit", "name", "pool", "queue")

    def __init__(self, name: str, pool: str | None, limit: int, infos: list[EntryInfo]) -> None:
        self.name, self.pool, self.limit = name, pool, limit
        self.queue = deque(sorted(infos, key=_recency))
        self.held = sum(i.nbytes for i in infos)


class _Book:
    """The bytes of every group and pool as a selection evicts from them, the write
    of ``nbytes`` in group ``writing`` counted."""

    def __init__(
        self,
        entries: Iterable[EntryInfo],
        quotas: Quotas,
        max_bytes: int,
        now: float,
        writing: str,
        nbytes: int,
    ) -> None:
        by_group: dict[str, list[EntryInfo]] = defaultdict(list)
        for info in entries:
            by_group[quotas.group(info.fingerprint)].append(info)
        self.unreadable = by_group.pop(UNREADABLE, [])
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
        group = _Group(name, self.quotas.pool(name), self.quotas.limit(name, self.max_bytes), infos)
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
        if group.held > group.limit or self.idle(group):
            return True
        if group.pool is None:
            return False
        write = self.nbytes if group.pool == self.own.pool else 0
        return self.pools[group.pool] - write > self.quotas.pool_limit(group.pool, self.max_bytes)

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
        >>> [i.key for i in pick.evict], pick.admitted  # past its quota: its own go
        (['a'], True)
        >>> new = "salt-" + "c" * 24
        >>> pick = select_for_budget(infos, Quotas(0.5), 100, writing=new, nbytes=6, now=9)
        >>> [i.key for i in pick.evict], pick.admitted  # every other group within its quota
        ([], False)
        >>> pick = select_for_budget(infos, Quotas(0.5), 100, writing=new, nbytes=6, now=5000)
        >>> [i.key for i in pick.evict], pick.admitted  # the other salt unused for an hour
        (['c'], True)
    """
    now = time.time() if now is None else now
    book = _Book(entries, quotas, max_bytes, now, writing, nbytes)
    own = book.own
    # 1. its group past its limit: its own entries
    if own.held > own.limit:
        target = int(own.limit * low_water)
        book.evict_own(lambda: own.held > target)
    # 2. its pool past the pool's limit: its own entries, then the pool's out of quota
    if own.pool is not None and book.pool_over(own.pool):
        target = int(quotas.pool_limit(own.pool, max_bytes) * low_water)
        book.evict_own(lambda: book.pool_over(own.pool, target))
        members = [g for g in book.groups.values() if g.pool == own.pool]
        book.evict_others(members, lambda: book.pool_over(own.pool, target))
    # 3. the store past its budget: its own entries, then those out of their quota
    if own.held <= own.limit and not book.pool_over(own.pool):
        target = int(max_bytes * low_water)
        if reserved_bytes + book.total > max_bytes:
            book.evict_own(lambda: reserved_bytes + book.total > target)
            book.evict_others(book.groups.values(), lambda: reserved_bytes + book.total > target)
    if not book.fits(reserved_bytes):
        return Selection(list(book.unreadable), False)
    return Selection(book.unreadable + book.chosen, True)


__all__ = [
    "DEFAULT_SHARE",
    "PRIVATE_POOL",
    "SALT_POOL",
    "UNREADABLE",
    "Pool",
    "Quotas",
    "Selection",
    "namespace_of",
    "select_for_budget",
]
