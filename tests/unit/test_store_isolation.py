"""Quotas isolate: no write evicts what another group holds within its quota.

Floods (``tests/store_floods.py``) on real memory and disk stores, each
against the same residents: passages ingested in the shared namespace, two key
tenants' entries and a salt tenant's. ``select_for_budget``'s invariants as
properties over any store, quotas and write: ``test_store_quota_properties.py``.
"""

from __future__ import annotations

import os
import secrets
import time
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
from kvrag_integrations.vllm.trust import Tenant


@pytest.fixture(params=["memory", "disk"])
def settled(request: pytest.FixtureRequest, tmp_path: Path) -> Budgeted:
    store = MemoryKVStore(max_bytes=None) if request.param == "memory" else DiskKVStore(tmp_path)
    budgeted = Budgeted(store)
    budgeted.settle()
    return budgeted


def test_an_anonymous_agent_flood_stays_in_its_owners_share_of_the_private_pool(
    settled: Budgeted,
) -> None:
    """Private entries are grouped by owner (issue 59: the private pool bounded per
    tenant): the anonymous callers' together hold at most their share of the pool
    and give way themselves (their least recently used first), and a key's own
    entries find room beside them."""
    stored = anonymous_agent_flood(settled)
    assert settled.missing() == []  # the ingested passages, both keys', the salt's
    max_bytes = settled.budget.max_bytes
    assert settled.held_by_kind("private") <= max_bytes // 8  # the anonymous callers' share
    assert settled.most <= max_bytes
    assert stored == 10 * 12 and settled.budget.evicted > 0  # the flood's own oldest went
    keyed = [make_kv(Tenant.of_request("a-key-digest", secrets.token_hex(16)), n=32)]
    assert settled.write(keyed[0])  # another owner: room of its own


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
