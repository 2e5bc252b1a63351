"""Quotas in a store's budget: no write evicts what another group holds within its quota.

Entries are grouped by the namespace their fingerprint names (``namespaces``
reads it, and its kind):

- the shared namespace (``""``): what writers ingested for everyone;
- each API key's namespace;
- each client ``cache_salt``'s namespace; all salts together are the salts' pool;
- each request's private entries; all of them together are the private pool;
- entries whose header cannot be read, or whose namespace id names no kind
  (``"?"``): no request reads them, so every eviction takes them first.

Each group's limit is a share of the budget ``B`` (``Quotas``):

- the shared namespace and each key's: the bytes ``named`` gives it (the key
  file's ``quota_bytes``), else ``share * B`` (half);
- each salt: ``salts.each * B`` (1/16), all salts together
  ``salts.together * B`` (1/4). A client can name any number of salts: many
  small ones hold no more than their pool;
- each request's private entries: ``private.each * B``, all of them together
  ``private.together * B`` (1/8 both).

A group is within its quota while it holds at most its limit and, in a pool,
its pool at most the pool's limit. A write of ``n`` bytes into group ``w``
(``select_for_budget``):

1. that takes ``w`` past its limit evicts ``w``'s own least recently used
   entries until ``w`` holds ``low_water`` of its limit with the write;
2. that takes ``w``'s pool past the pool's limit evicts ``w``'s own, then the
   pool's least recently used entries until the pool holds ``low_water`` of
   its limit;
3. that takes the store (its entries, the write and ``reserved_bytes``) past
   the budget evicts ``w``'s own least recently used entries, then, one at a
   time, the least recently used entry of a group over its quota at that
   moment, until the store holds ``low_water`` of the budget or no such entry
   is left.

A write that still does not fit (its group, its pool or the store) is
refused: it evicts only the ``"?"`` entries and is not stored, which costs
later requests reuse, never correctness. So a write takes another group's
entries only while that group is over its quota, or from its own pool when it
would take the pool past its limit: a flood of salts or of private entries
gives way within its pool, a tenant past its quota gives way itself, and the
shared namespace and every key namespace keep what they hold within their
quotas. Quotas bound groups, they reserve nothing: where the limits add up to
more than the budget (each key's is half of it unless the key file says
otherwise), what each group holds within its quota stays, and a write that
finds no room is refused.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvrag_integrations.store.base import EntryInfo
from kvrag_integrations.store.namespaces import PRIVATE, SALT, namespace_kind, namespace_of

UNREADABLE = "?"
DEFAULT_SHARE = 0.5


@dataclass(frozen=True)
class Pool:
    """The shares of the budget of a kind of namespace any client can mint: all of
    them ``together``, and ``each`` one."""

    together: float
    each: float

    def __post_init__(self) -> None:
        for name in ("together", "each"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"a pool's share {name} is a number, got {value!r}")
            if not 0 < value <= 1:
                raise ValueError(f"a pool's share {name} is in (0, 1], got {value}")


SALT_POOL = Pool(together=0.25, each=1 / 16)
PRIVATE_POOL = Pool(together=0.125, each=0.125)
WHOLE_BUDGET = Pool(together=1.0, each=1.0)


@dataclass(frozen=True)
class Quotas:
    """How much of the budget each group may hold (see the module docstring).

    Attributes:
        share: the share of the budget of the shared namespace and of each key's
            unless named (0 to 1].
        named: namespace ids (a key's, or ``""``: the shared one) with their own
            quota in bytes (0: ``share``).
        salts: the salts' pool: all client salts together, and each.
        private: the private pool: all requests' private entries together, and
            each request's.
    """

    share: float = DEFAULT_SHARE
    named: Mapping[str, int] = field(default_factory=dict)
    salts: Pool = SALT_POOL
    private: Pool = PRIVATE_POOL

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1:
            raise ValueError(f"a namespace's share of the budget is in (0, 1], got {self.share}")
        for name, quota in self.named.items():
            if isinstance(quota, bool) or not isinstance(quota, int) or quota < 0:
                raise ValueError(f"the quota of namespace {name!r} must be bytes >= 0")

    @classmethod
    def budget_only(cls) -> Quotas:
        """No bound but the budget: every group and pool may hold all of it."""
        return cls(1.0, salts=WHOLE_BUDGET, private=WHOLE_BUDGET)

    def group(self, fingerprint: str | None) -> str:
        """The group an entry of ``fingerprint`` counts in: its namespace id, or
        ``"?"`` (an unreadable header, an id of no kind)."""
        namespace = namespace_of(fingerprint)
        if namespace is None or namespace_kind(namespace) is None:
            return UNREADABLE
        return namespace

    def pool(self, group: str) -> str | None:
        """The pool ``group`` counts in (its kind: ``"salt"``, ``"private"``), or None."""
        kind = namespace_kind(group)
        return kind if kind in (SALT, PRIVATE) else None

    def limit(self, group: str, max_bytes: int) -> int:
        """The most bytes ``group`` may hold in a budget of ``max_bytes`` (in a pool:
        its own share, at most the pool's)."""
        pool = self.pool(group)
        if group == UNREADABLE:
            return 0
        if pool is not None:
            shares = self._pool_shares(pool)
            return int(min(shares.each, shares.together) * max_bytes)
        quota = self.named.get(group) or int(self.share * max_bytes)
        return min(quota, max_bytes)

    def pool_limit(self, pool: str, max_bytes: int) -> int:
        """The most bytes all groups of ``pool`` may hold together."""
        return int(self._pool_shares(pool).together * max_bytes)

    def _pool_shares(self, pool: str) -> Pool:
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
    """The bytes of every group and pool as a selection evicts from them."""

    def __init__(self, entries: Iterable[EntryInfo], quotas: Quotas, max_bytes: int) -> None:
        by_group: dict[str, list[EntryInfo]] = defaultdict(list)
        for info in entries:
            by_group[quotas.group(info.fingerprint)].append(info)
        self.unreadable = by_group.pop(UNREADABLE, [])
        self.quotas, self.max_bytes = quotas, max_bytes
        self.groups: dict[str, _Group] = {}
        self.pools: dict[str, int] = defaultdict(int)
        for name, infos in by_group.items():
            self.add(name, infos)
        self.total = sum(g.held for g in self.groups.values())
        self.chosen: list[EntryInfo] = []

    def add(self, name: str, infos: list[EntryInfo]) -> _Group:
        group = _Group(name, self.quotas.pool(name), self.quotas.limit(name, self.max_bytes), infos)
        self.groups[name] = group
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
        if pool is None:
            return False
        limit = self.quotas.pool_limit(pool, self.max_bytes) if bound is None else bound
        return self.pools[pool] > limit

    def over_quota(self, group: _Group) -> bool:
        return group.held > group.limit or self.pool_over(group.pool)

    def evict_lru(
        self, groups: Iterable[_Group], more: Callable[[], bool], may: Callable[[_Group], bool]
    ) -> None:
        """While ``more()``: evict the least recently used entry of those ``groups`` that
        ``may`` give one up (asked at each eviction: a group that may not, may not
        again, as groups only shrink here)."""
        heap = [(_recency(g.queue[0]), g.name) for g in groups if g.queue]
        heapq.heapify(heap)
        while heap and more():
            _, name = heapq.heappop(heap)
            group = self.groups[name]
            if not may(group):
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
) -> Selection:
    """What to evict before a write of ``nbytes`` in group ``writing``, and whether it
    fits then (the three steps of the module docstring).

    Examples:
        >>> key, salt = "key-" + "a" * 24, "salt-" + "b" * 24
        >>> infos = [EntryInfo("a", 45, 1.0, "m+ns-" + key), EntryInfo("b", 45, 2.0, "m"),
        ...          EntryInfo("c", 5, 3.0, "m+ns-" + salt)]
        >>> pick = select_for_budget(infos, Quotas(0.5), 100, writing=key, nbytes=10)
        >>> [i.key for i in pick.evict], pick.admitted  # past its quota: its own go
        (['a'], True)
        >>> pick = select_for_budget(infos, Quotas(0.5), 100, writing="salt-" + "c" * 24, nbytes=6)
        >>> [i.key for i in pick.evict], pick.admitted  # every other group within its quota
        ([], False)
    """
    book = _Book(entries, quotas, max_bytes)
    own = book.groups.get(writing) or book.add(writing, [])
    book.charge(own, nbytes)
    # 1. its group past its limit: its own entries
    if own.held > own.limit:
        target = int(own.limit * low_water)
        while own.held > target and own.queue:
            book.evict(own)
    # 2. its pool past the pool's limit: its own entries, then the pool's
    if book.pool_over(own.pool):
        target = int(quotas.pool_limit(own.pool, max_bytes) * low_water)  # type: ignore[arg-type]
        while book.pool_over(own.pool, target) and own.queue:
            book.evict(own)
        members = [g for g in book.groups.values() if g.pool == own.pool and g is not own]
        book.evict_lru(members, lambda: book.pool_over(own.pool, target), lambda g: True)
    # 3. the store past its budget: its own entries, then groups over their quota
    if reserved_bytes + book.total > max_bytes:
        target = int(max_bytes * low_water)
        while reserved_bytes + book.total > target and own.queue:
            book.evict(own)
        others = [g for g in book.groups.values() if g is not own]
        book.evict_lru(others, lambda: reserved_bytes + book.total > target, book.over_quota)
    fits = not book.over_quota(own) and reserved_bytes + book.total <= max_bytes
    return Selection(book.unreadable + book.chosen if fits else list(book.unreadable), fits)


__all__ = [
    "DEFAULT_SHARE",
    "UNREADABLE",
    "Pool",
    "Quotas",
    "Selection",
    "namespace_of",
    "select_for_budget",
]
