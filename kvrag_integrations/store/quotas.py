"""Namespace quotas in a store's budget: one tenant cannot evict the others.

A server's entries are keyed by their tenant's namespace: the storage
fingerprint of a tenant's entry ends with ``+ns-<namespace id>``
(``vllm.trust.Tenant.fingerprint``), the shared namespace's has none. The
budget (``maintenance.StoreBudget``) groups entries by namespace:

- the shared namespace (``""``): what writers ingested for everyone;
- each API key's namespace (``--tenant-keys``), listed in ``Quotas.named``;
- every other namespace (one per client ``cache_salt``) together, as ``"*"``:
  a client can name as many salts as it likes, so they share one quota;
- entries whose header cannot be read (``"?"``): evicted first.

Each group may hold at most its quota: ``share`` of the budget (0.5 by
default), or the bytes its keys' ``quota_bytes`` give. A write that would take
its group past its quota evicts that group's own least recently used entries;
a write that would take the store past its budget evicts from the group
holding the most bytes (its least recently used entries first), so whoever
fills the store gives way first.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvrag_integrations.store.base import EntryInfo

NAMESPACE_MARK = "+ns-"  # what vllm.trust.Tenant.fingerprint puts before a namespace id
SHARED = ""
SALTED = "*"
UNREADABLE = "?"
DEFAULT_SHARE = 0.5


def namespace_of(fingerprint: str | None) -> str | None:
    """The namespace id a storage fingerprint names ("": the shared one; None: an
    unreadable header).

    Examples:
        >>> namespace_of("model+ctx-sink:1+ns-0123abcd"), namespace_of("model")
        ('0123abcd', '')
    """
    if fingerprint is None:
        return None
    _, mark, namespace = fingerprint.rpartition(NAMESPACE_MARK)
    return namespace if mark else SHARED


@dataclass(frozen=True)
class Quotas:
    """How much of the budget each group of namespaces may hold.

    Attributes:
        share: the share of the budget a group may hold unless named (0 to 1].
        named: key namespaces (their ids) with their own quota in bytes (0: the
            default share); a namespace not listed, but the shared one, is
            counted with every client salt's (``"*"``).
    """

    share: float = DEFAULT_SHARE
    named: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1:
            raise ValueError(f"a namespace's share of the budget is in (0, 1], got {self.share}")
        for name, quota in self.named.items():
            if isinstance(quota, bool) or not isinstance(quota, int) or quota < 0:
                raise ValueError(f"the quota of namespace {name!r} must be bytes >= 0")

    def group(self, fingerprint: str | None) -> str:
        """The group an entry of ``fingerprint`` counts in."""
        namespace = namespace_of(fingerprint)
        if namespace is None:
            return UNREADABLE
        return namespace if namespace == SHARED or namespace in self.named else SALTED

    def limit(self, group: str, max_bytes: int) -> int:
        """The most bytes ``group`` may hold in a budget of ``max_bytes``."""
        if group == UNREADABLE:
            return 0
        quota = self.named.get(group) or int(self.share * max_bytes)
        return min(quota, max_bytes)


def _lru(infos: Iterable[EntryInfo]) -> list[EntryInfo]:
    """Least recently used first (unknown times first)."""
    return sorted(infos, key=lambda i: (i.updated_at is not None, i.updated_at or 0.0))


def select_for_budget(
    entries: Iterable[EntryInfo],
    quotas: Quotas,
    max_bytes: int,
    *,
    writing: str,
    nbytes: int,
    reserved_bytes: int = 0,
    low_water: float = 0.8,
) -> list[EntryInfo]:
    """The entries to evict before a write of ``nbytes`` in group ``writing``.

    Unreadable entries always go. If the write takes its group past its quota,
    the group's own least recently used entries go until it holds ``low_water``
    of its quota with the write. If it takes the store (entries, the write and
    ``reserved_bytes``: live temp files, the index log) past ``max_bytes``,
    entries go until the store holds ``low_water`` of it: each time the least
    recently used entry of the group then holding the most bytes (the write
    counted in its group).

    Examples:
        >>> infos = [EntryInfo("a", 40, 1.0, "m+ns-x"), EntryInfo("b", 30, 2.0, "m"),
        ...          EntryInfo("c", 20, 3.0, "m+ns-x")]
        >>> q = Quotas(0.5, {"x": 0})
        >>> [i.key for i in select_for_budget(infos, q, 100, writing="x", nbytes=10)]
        ['a']
        >>> [i.key for i in select_for_budget(infos, q, 100, writing="", nbytes=15)]
        ['a']
    """
    groups: dict[str, list[EntryInfo]] = defaultdict(list)
    for info in entries:
        groups[quotas.group(info.fingerprint)].append(info)
    chosen = list(groups.pop(UNREADABLE, []))
    queues = {name: deque(_lru(infos)) for name, infos in groups.items()}
    held = {name: sum(i.nbytes for i in infos) for name, infos in groups.items()}
    held[writing] = held.get(writing, 0) + nbytes
    queues.setdefault(writing, deque())
    limit = quotas.limit(writing, max_bytes)
    if held[writing] > limit:
        target = int(limit * low_water)
        own = queues[writing]
        while held[writing] > target and own:
            info = own.popleft()
            chosen.append(info)
            held[writing] -= info.nbytes
    total = reserved_bytes + sum(held.values())
    if total > max_bytes:
        target = int(max_bytes * low_water)
        heap = [(-size, name) for name, size in held.items() if queues[name]]
        heapq.heapify(heap)
        while total > target and heap:
            size, name = heapq.heappop(heap)
            if -size != held[name] or not queues[name]:
                if queues[name]:  # a stale size: its group shrank meanwhile
                    heapq.heappush(heap, (-held[name], name))
                continue
            info = queues[name].popleft()
            chosen.append(info)
            held[name] -= info.nbytes
            total -= info.nbytes
            if queues[name]:
                heapq.heappush(heap, (-held[name], name))
    return chosen
