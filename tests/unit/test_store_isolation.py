"""Quotas isolate: no write evicts what another group holds within its quota.

Floods (``tests/store_floods.py``) on real memory and disk stores, each
against the same residents: passages ingested in the shared namespace, two key
tenants' entries and a salt tenant's. Then ``select_for_budget``'s invariants
as properties over any store, quotas and write.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

import pytest
from store_floods import (
    KEY_A,
    KEY_B,
    Budgeted,
    anonymous_agent_flood,
    make_kv,
    past_quota,
    salt_flood,
)

from kvrag_integrations.store import DiskKVStore, MemoryKVStore
from kvrag_integrations.store.base import EntryInfo
from kvrag_integrations.store.quotas import UNREADABLE, Pool, Quotas, select_for_budget
from kvrag_integrations.vllm.trust import Tenant


@pytest.fixture(params=["memory", "disk"])
def settled(request: pytest.FixtureRequest, tmp_path: Path) -> Budgeted:
    store = MemoryKVStore(max_bytes=None) if request.param == "memory" else DiskKVStore(tmp_path)
    budgeted = Budgeted(store)
    budgeted.settle()
    return budgeted


def test_an_anonymous_agent_flood_stays_in_the_private_pool(settled: Budgeted) -> None:
    stored = anonymous_agent_flood(settled)
    assert settled.missing() == []  # the ingested passages, both keys', the salt's
    max_bytes = settled.budget.max_bytes
    assert settled.held_by_kind("private") <= max_bytes // 4  # the private pool
    assert settled.most <= max_bytes
    assert stored >= 10 * 4  # each wave stored prefixes while its pool had room ...
    assert settled.refused > 0  # ... and was refused past it (never evicting others)


def test_a_salt_flood_stays_in_the_salts_pool(settled: Budgeted) -> None:
    stored = salt_flood(settled)
    assert settled.missing() == []  # the team's salt in use keeps its entries too
    assert settled.held_by_kind("salt") <= settled.budget.max_bytes // 4
    assert 0 < stored < 40 and settled.refused == 300 - stored


def test_a_tenant_past_its_quota_gives_way_itself(settled: Budgeted) -> None:
    past_quota(settled, KEY_A)
    assert settled.missing(KEY_A) == []
    assert settled.held(KEY_A) <= settled.budget.max_bytes // 2
    assert settled.most <= settled.budget.max_bytes
    assert settled.budget.evicted >= 150 and settled.refused == 0


def test_a_full_store_refuses_a_write_rather_than_evict_a_tenant_within_its_quota(
    tmp_path: Path,
) -> None:
    class Listed(DiskKVStore):
        listings = 0

        def entries(self):  # type: ignore[no-untyped-def]
            Listed.listings += 1
            return super().entries()

    budgeted = Budgeted(Listed(tmp_path))
    budgeted.settle()
    # both keys fill the rest of the store within their quotas (as another replica
    # writes: the budget sees them at its next measurement)
    one = next(budgeted.store.entries()).nbytes
    tenants = [KEY_A, KEY_B]
    while budgeted.held() + one < budgeted.budget.max_bytes:
        budgeted.store.put(make_kv(tenants[len(budgeted.store) % 2]))
    assert max(budgeted.held(KEY_A), budgeted.held(KEY_B)) <= budgeted.budget.max_bytes // 2
    budgeted.restart()  # (or the budget's next measurement)
    before, listings = budgeted.held(), Listed.listings
    admitted = [budgeted.write(make_kv(Tenant.of_salt(f"s{i}"))) for i in range(50)]
    assert Listed.listings - listings == 1  # measured once, then refused from it
    assert not any(admitted) and budgeted.held() == before  # nothing evicted
    assert budgeted.missing() == []


def test_idle_salts_give_their_room_to_a_new_one(tmp_path: Path) -> None:
    budgeted = Budgeted(DiskKVStore(tmp_path))
    budgeted.settle()
    salt_flood(budgeted, salts=60)
    assert not budgeted.write(make_kv(Tenant.of_salt("new")))  # the pool is full
    team = {kv.key for kv in budgeted.residents}
    hours_ago = time.time() - 2 * 3600
    for info in budgeted.store.entries():  # the flood's entries: unused for two hours
        if "+ns-salt-" in str(info.fingerprint) and info.key not in team:
            os.utime(tmp_path / info.key[:2] / f"{info.key}.safetensors", (hours_ago,) * 2)
    budgeted.wait(60)  # (a minute on the budget's clock: it measures the store again)
    assert budgeted.write(make_kv(Tenant.of_salt("new")))
    assert budgeted.missing() == []  # the team's salt, used within the hour, kept


def test_entries_of_no_namespace_a_tenant_reads_are_evicted_first(tmp_path: Path) -> None:
    budgeted = Budgeted(DiskKVStore(tmp_path))
    legacy = make_kv(Tenant("0123456789abcdef01234567"))  # an id from before kinds
    budgeted.store.put(legacy)
    assert budgeted.write(make_kv(Tenant()))  # the budget's first measurement
    assert not budgeted.store.contains(legacy.key) and len(budgeted.store) == 1


# ----------------------------------------------------------------- properties
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
    raw, share, named, salts, private, max_bytes, writing, nbytes, reserved, low_water, now
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
    if not pick.admitted:
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
    raw, share, salts, private, max_bytes, writing, nbytes, reserved, now
) -> None:
    """Where evicting what a write may evict (its own group, what is past a limit,
    idle pooled entries, unreadable ones) surely makes room, it is admitted."""
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
        assert pick.admitted, (own, free)
