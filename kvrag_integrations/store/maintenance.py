"""Looking after a store at rest: what it holds, which entries are corrupt, what to
prune (``write_budget.StoreBudget`` keeps it within its budget as it is written),
and which private entries have expired (one request's own, unused for
``namespaces.PRIVATE_TTL_S``: every prune, and every budget measurement, takes
them; Redis expires them itself)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvrag_integrations.store.base import EntryInfo, KVStore
from kvrag_integrations.store.eviction import select_over_quota
from kvrag_integrations.store.namespaces import (
    PRIVATE,
    PRIVATE_TTL_S,
    base_fingerprint,
    namespace_kind,
    namespace_of,
)
from kvrag_integrations.store.quotas import Quotas


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


def expired_private(info: EntryInfo, now: float | None = None) -> bool:
    """Whether ``info`` is a private entry unused for ``PRIVATE_TTL_S`` (an entry of
    unknown age is not)."""
    if namespace_kind(namespace_of(info.fingerprint)) != PRIVATE or info.updated_at is None:
        return False
    return (time.time() if now is None else now) - info.updated_at > PRIVATE_TTL_S


def expire_private(store: KVStore, now: float | None = None) -> int:
    """Delete the private entries of ``store`` unused for ``PRIVATE_TTL_S`` (a server
    sweeps them at start: those of requests a killed server never answered); how
    many went."""
    expired = [info for info in store.entries() if expired_private(info, now)]
    for info in expired:
        store.delete(info.key)
    return len(expired)


def select_for_pruning(
    entries: Iterable[EntryInfo],
    *,
    max_bytes: int | None = None,
    older_than_s: float | None = None,
    foreign_to: str | Iterable[str] | None = None,
    now: float | None = None,
    reserved_bytes: int = 0,
    quotas: Quotas | None = None,
) -> list[EntryInfo]:
    """Choose the entries to evict; every criterion given adds to the choice, and
    expired private entries (``expired_private``) are always chosen.

    Args:
        entries: the store's entries (``store.entries()``).
        max_bytes: after the other criteria, evict until the rest, plus
            ``reserved_bytes``, fit in this many bytes: the least recently used
            of groups over their quota in that budget first (``quotas``: each
            namespace its group, as a server's budget holds them), then the least
            recently used of any (``eviction.select_over_quota``).
        older_than_s: evict entries last updated more than this many seconds ago
            (entries of unknown age are kept).
        foreign_to: evict entries whose fingerprint is readable and, its namespace
            aside, none of these (entries made by another model, tokenizer, dtype
            or engine; a server's tenants' entries are its own).
        now: the current unix time (default: ``time.time()``).
        reserved_bytes: bytes the store holds besides its entries that cannot
            be evicted (live writers' temp files): they count toward ``max_bytes``.
        quotas: the groups' quotas (default ``Quotas()``: the shared namespace and
            each key's at most half of ``max_bytes``, salts and private entries in
            their pools).

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
        >>> mine = [EntryInfo("d", 10, 100.0, "m+ns-key-" + "a" * 24)]
        >>> [i.key for i in select_for_pruning(infos + mine, foreign_to="m")]  # a tenant's: kept
        ['c']
    """
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    if older_than_s is not None and older_than_s < 0:
        raise ValueError(f"older_than_s must be >= 0, got {older_than_s}")
    now = time.time() if now is None else now
    ours = {foreign_to} if isinstance(foreign_to, str) else set(foreign_to or ())
    keep: list[EntryInfo] = []
    chosen: list[EntryInfo] = []
    for info in entries:
        known = info.fingerprint is not None
        foreign = bool(ours) and known and base_fingerprint(info.fingerprint) not in ours
        old = older_than_s is not None and info.updated_at is not None
        old = old and now - info.updated_at > older_than_s
        (chosen if foreign or old or expired_private(info, now) else keep).append(info)
    if max_bytes is not None:
        chosen += select_over_quota(
            keep, quotas or Quotas(), max_bytes, reserved_bytes=reserved_bytes, now=now
        )
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
