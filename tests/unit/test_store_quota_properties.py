"""``select_for_budget``'s invariants, as properties over any entries, quotas and write.

- No write evicts an entry of another group within its quota (replayed in the
  order chosen: each evicted entry's group past its limit, its pool past the
  pool's without the write, or the entry an idle pooled one, at that moment).
- An allowed write fits its group, its pool and the store; a refused one
  evicts nothing but unreadable entries.
- A write is refused only where what it may evict surely cannot make room.

The floods on real stores are in ``test_store_isolation.py``.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from kvrag_integrations.store.base import EntryInfo
from kvrag_integrations.store.eviction import select_for_budget
from kvrag_integrations.store.quotas import UNREADABLE, Pool, Quotas

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

GROUPS = [
    "",
    "key-" + "a" * 24,
    "key-" + "b" * 24,
    *("salt-" + c * 24 for c in "0123"),
    *("private-" + c * 24 for c in "45"),
]
NO_KIND = "0123456789abcdef01234567"  # a bare id: "?"


def fingerprint(group: str | None) -> str | None:
    if group is None:
        return None
    return "m" if group == "" else f"m+ns-{group}"


entry = st.tuples(
    st.sampled_from([*GROUPS, NO_KIND, None]),
    st.integers(1, 40),
    st.one_of(st.none(), st.floats(0, 10_000)),
)
pool = st.builds(Pool, st.floats(0.05, 1), st.floats(0.02, 1), st.floats(0, 8000))


@hypothesis.settings(max_examples=400, deadline=None, derandomize=True)
@hypothesis.given(
    st.lists(entry, max_size=40),
    st.floats(0.1, 1),
    st.dictionaries(st.sampled_from(GROUPS[:3]), st.integers(0, 300), max_size=3),
    pool,
    pool,
    st.integers(40, 400),
    st.sampled_from(GROUPS),
    st.integers(1, 80),
    st.integers(0, 40),
    st.floats(0.5, 1),
    st.floats(0, 20_000),
)
def test_no_write_evicts_a_group_within_its_quota(
    raw: list[tuple[str | None, int, float | None]],
    share: float,
    named: dict[str, int],
    salts: Pool,
    private: Pool,
    max_bytes: int,
    writing: str,
    nbytes: int,
    reserved: int,
    low_water: float,
    now: float,
) -> None:
    infos = [EntryInfo(f"e{i}", n, t, fingerprint(g)) for i, (g, n, t) in enumerate(raw)]
    quotas = Quotas(share, named, salts, private)
    pick = select_for_budget(
        infos,
        quotas,
        max_bytes,
        writing=writing,
        nbytes=nbytes,
        reserved_bytes=reserved,
        low_water=low_water,
        now=now,
    )
    group_of = {i.key: quotas.group(i.fingerprint) for i in infos}
    held: dict[str, int] = defaultdict(int)
    pools: dict[str, int] = defaultdict(int)
    for info in infos:
        if group_of[info.key] != UNREADABLE:  # (always evicted)
            held[group_of[info.key]] += info.nbytes
    held[writing] += nbytes
    for name, size in held.items():
        if quotas.pool(name) is not None:
            pools[quotas.pool(name)] += size
    own_pool = quotas.pool(writing)

    def idle(info: EntryInfo, name: str) -> bool:
        kind = quotas.pool(name)
        if kind is None:
            return False
        used = info.updated_at
        return used is None or now - used > quotas.shares(kind).idle_s

    unreadable = [i for i in infos if group_of[i.key] == UNREADABLE]
    assert pick.evict[: len(unreadable)] == unreadable  # always taken, first
    for info in pick.evict[len(unreadable) :]:  # replayed in order
        name = group_of[info.key]
        kind = quotas.pool(name)
        write = nbytes if kind is not None and kind == own_pool else 0
        out = name == writing or held[name] > quotas.limit(name, max_bytes) or idle(info, name)
        out = out or (kind is not None and pools[kind] - write > quotas.pool_limit(kind, max_bytes))
        assert out, f"evicted {info} of {name!r}, within its quota"
        held[name] -= info.nbytes
        if kind is not None:
            pools[kind] -= info.nbytes
    total = reserved + sum(held.values())
    if not pick.fits:
        assert pick.evict == unreadable
        return
    assert held[writing] <= quotas.limit(writing, max_bytes) and total <= max_bytes
    assert own_pool is None or pools[own_pool] <= quotas.pool_limit(own_pool, max_bytes)


@hypothesis.settings(max_examples=400, deadline=None, derandomize=True)
@hypothesis.given(
    st.lists(entry, max_size=40),
    st.floats(0.1, 1),
    pool,
    pool,
    st.integers(40, 400),
    st.sampled_from(GROUPS),
    st.integers(1, 80),
    st.integers(0, 40),
    st.floats(0, 20_000),
)
def test_a_write_is_refused_only_where_no_room_can_be_made(
    raw: list[tuple[str | None, int, float | None]],
    share: float,
    salts: Pool,
    private: Pool,
    max_bytes: int,
    writing: str,
    nbytes: int,
    reserved: int,
    now: float,
) -> None:
    """Where evicting what a write may evict (its own group, what is past a limit,
    idle pooled entries, unreadable ones) surely makes room, it is allowed."""
    infos = [EntryInfo(f"e{i}", n, t, fingerprint(g)) for i, (g, n, t) in enumerate(raw)]
    quotas = Quotas(share, {}, salts, private)
    pick = select_for_budget(
        infos, quotas, max_bytes, writing=writing, nbytes=nbytes, reserved_bytes=reserved, now=now
    )
    by_group: dict[str, list[EntryInfo]] = defaultdict(list)
    for info in infos:
        by_group[quotas.group(info.fingerprint)].append(info)
    by_group.pop(UNREADABLE, None)
    own = sum(i.nbytes for i in by_group.pop(writing, []))
    own_pool = quotas.pool(writing)

    def freeable(name: str, group: list[EntryInfo]) -> int:  # at least this much may go
        excess = sum(i.nbytes for i in group) - quotas.limit(name, max_bytes)
        kind = quotas.pool(name)
        if kind is None:
            return max(0, excess)
        idle_s = quotas.shares(kind).idle_s
        gone = sum(i.nbytes for i in group if i.updated_at is None or now - i.updated_at > idle_s)
        return max(0, excess, gone)

    free = {name: freeable(name, group) for name, group in by_group.items()}
    held = {name: sum(i.nbytes for i in group) for name, group in by_group.items()}
    room = reserved + sum(held.values()) + nbytes - sum(free.values()) <= max_bytes
    fits_group = nbytes <= quotas.limit(writing, max_bytes)
    fits_pool = True
    if own_pool is not None:
        pooled = [n for n in held if quotas.pool(n) == own_pool]
        in_pool = sum(held[n] - free[n] for n in pooled) + nbytes
        fits_pool = in_pool <= quotas.pool_limit(own_pool, max_bytes)
    if room and fits_group and fits_pool:
        assert pick.fits, (own, free)
