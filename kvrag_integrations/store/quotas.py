"""Quotas in a store's budget: no write evicts what another group holds within its quota.

Entries are grouped by the namespace their fingerprint names (``namespaces``
reads it, and its kind):

- the shared namespace (``""``): what writers ingested for everyone;
- each API key's namespace;
- each client ``cache_salt``'s namespace; all of them together are the salts'
  pool;
- each owner's private entries (every request's own entries, grouped by who
  sent it: the anonymous callers together, each key of the shared namespace);
  all of them together are the private pool;
- entries whose header cannot be read, or whose namespace id names no kind
  (``"?"``): no request reads them, so every eviction takes them first.

Limits, as shares of the budget ``B`` (``Quotas``):

- the shared namespace and each key's: the bytes ``named`` gives it (the key
  file's ``quota_bytes``), else ``share * B`` (half);
- each salt: ``salts.each * B`` (1/16), all salts together
  ``salts.together * B`` (1/4). A client can name any number of salts: many
  small ones together hold no more than their pool;
- each owner's private entries, and all of them together:
  ``private.each * B`` (1/8), ``private.together * B`` (1/4).

Another group's entry is out of its quota, and a write may evict it, while
its group holds more than its limit, its pool more than the pool's (this
write not counted: a pool the write alone would fill is not over), or, in a
pool, while it has not been used for the pool's ``idle_s`` (salts: an hour;
private entries: ten minutes, ``namespaces.PRIVATE_TTL_S``, after which they
expire; ``EntryInfo.updated_at``, which loads refresh; unknown: idle): a salt
no one uses any more, or the private entry of a request long answered, does
not keep its pool's room for ever. A write of
``n`` bytes into group ``w`` (``eviction.select_for_budget``):

1. that takes ``w`` past its limit evicts ``w``'s own least recently used
   entries until ``w`` holds ``low_water`` of its limit with the write;
2. that takes ``w``'s pool past the pool's limit evicts ``w``'s own least
   recently used entries until the write fits (and, toward the low-water
   mark, at most until ``w`` holds ``low_water`` of what it held: never its
   whole group where one eviction would do), then, one at a time, the least
   recently used entry of the pool out of its quota, until the pool holds
   ``low_water`` of its limit;
3. that takes the store (its entries, the write and ``reserved_bytes``) past
   the budget evicts ``w``'s own least recently used entries as in 2, then,
   one at a time, the least recently used entry out of its quota, until the
   store holds ``low_water`` of the budget.

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

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvrag_integrations.store.namespaces import (
    PRIVATE,
    PRIVATE_TTL_S,
    SALT,
    SHARED_ID,
    namespace_kind,
    namespace_of,
    private_group,
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
PRIVATE_POOL = Pool(together=0.25, each=0.125, idle_s=PRIVATE_TTL_S)


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
            each owner's).
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
        """The group an entry of ``fingerprint`` counts in: its namespace id (a private
        namespace's owner's: ``namespaces.private_group``), or ``"?"`` (an
        unreadable header, an id of no kind)."""
        namespace = namespace_of(fingerprint)
        kind = namespace_kind(namespace)
        if namespace is None or kind is None:
            return UNREADABLE
        if not self.grouped:
            return SHARED_ID
        return private_group(namespace) if kind == PRIVATE else namespace

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

    def over(self, group: str, held: int, pool_held: int, max_bytes: int) -> bool:
        """The over-quota rule: whether ``group``, holding ``held`` bytes in a pool
        that holds ``pool_held`` (without the write being made room for), is out of
        its quota, so that another group's write may evict it (an idle pooled entry
        is too: ``_Book.idle``)."""
        if held > self.limit(group, max_bytes):
            return True
        pool = self.pool(group)
        return pool is not None and pool_held > self.pool_limit(pool, max_bytes)

    def pool_limit(self, pool: str, max_bytes: int) -> int:
        """The most bytes all groups of ``pool`` may hold together."""
        return int(self.shares(pool).together * max_bytes)

    def shares(self, pool: str) -> Pool:
        return self.salts if pool == SALT else self.private


__all__ = [
    "DEFAULT_SHARE",
    "PRIVATE_POOL",
    "SALT_POOL",
    "UNREADABLE",
    "Pool",
    "Quotas",
    "namespace_of",
]
