"""Quotas isolate on Redis: the floods of ``tests/store_floods.py`` on a RedisKVStore of
the run's redis-server (its entries' sizes and last use read from Redis), each
leaving every other tenant's entries and the ingested passages in place. The
same floods on memory and disk stores, and the selection's properties, are in
``tests/unit/test_store_isolation.py``.
"""

from __future__ import annotations

import pytest
from store_floods import KEY_A, Budgeted, anonymous_agent_flood, past_quota, salt_flood

from kvrag_integrations import RedisKVStore


@pytest.fixture()
def settled(redis_store: RedisKVStore) -> Budgeted:
    budgeted = Budgeted(redis_store)
    budgeted.settle()
    return budgeted


def test_an_anonymous_agent_flood_stays_in_its_owners_share_of_the_private_pool(
    settled: Budgeted,
) -> None:
    """Private entries are grouped by owner (issue 59): the anonymous callers'
    together hold at most their share of the pool and give way themselves."""
    stored = anonymous_agent_flood(settled)
    assert settled.missing() == []
    assert settled.held_by_kind("private") <= settled.budget.max_bytes // 8
    assert stored == 10 * 12 and settled.budget.evicted > 0  # the flood's own oldest went


def test_a_salt_flood_stays_in_the_salts_pool(settled: Budgeted) -> None:
    stored = salt_flood(settled, salts=80)
    assert settled.missing() == []
    assert settled.held_by_kind("salt") <= settled.budget.max_bytes // 4
    assert 0 < stored < 40 and settled.refused == 80 - stored


def test_a_tenant_past_its_quota_gives_way_itself(settled: Budgeted) -> None:
    past_quota(settled, KEY_A, writes=100)
    assert settled.missing(KEY_A) == []
    assert settled.held(KEY_A) <= settled.budget.max_bytes // 2
    assert settled.most <= settled.budget.max_bytes and settled.budget.evicted >= 40
