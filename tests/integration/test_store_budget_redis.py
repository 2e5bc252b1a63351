"""The store's budget on Redis's primaries (``StoreBudget``, ``store.shards``): across
a Redis Cluster's, and on one server.

Every node of the run's cluster gets a small ``maxmemory`` with ``noeviction``
(a write past it is Redis's OOM error) for the test, then none again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_cluster_helpers import FP, make_kv
from redis_helpers import RedisServer

from kvrag_integrations import RedisKVStore
from kvrag_integrations.bench.redis_cluster import LocalRedisCluster
from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.errors import StoreWriteError
from kvrag_integrations.matching import index_log_for
from kvrag_integrations.store.codec import encode_entry
from kvrag_integrations.store.redis_client import primaries_memory
from kvrag_integrations.store.sizing import REDIS_FRACTION, store_budget
from kvrag_integrations.store.write_budget import StoreBudget

pytest.importorskip("redis", reason="the redis client is missing: pip install -e '.[test]'")

MAXMEMORY = 24 * 2**20  # per node
ENTRY = dict(n=256, width=32)  # ~262 KB stored


@pytest.fixture()
def bounded(redis_cluster: LocalRedisCluster, redis_prefix: str) -> Iterator[RedisKVStore]:
    """A store on the cluster whose nodes have ``MAXMEMORY`` each, for this test."""
    live = [n.port for n in redis_cluster.nodes if n.proc is not None]
    for port in live:
        redis_cluster.client(port).config_set("maxmemory", MAXMEMORY)
        redis_cluster.client(port).config_set("maxmemory-policy", "noeviction")
    store = RedisKVStore(redis_cluster.url, prefix=redis_prefix)
    try:
        yield store
    finally:
        for pattern in (f"{redis_prefix}*", "foreign:*"):
            names = list(store.client.scan_iter(match=pattern))
            for name in names:
                store.client.delete(name)
        for port in live:
            redis_cluster.client(port).config_set("maxmemory", 0)
        store.close()


def used(store: RedisKVStore) -> dict[str, int]:
    """Each primary's ``used_memory``."""
    return {name: info["used_memory"] for name, info in primaries_memory(store.client).items()}


def write(store: RedisKVStore, budget: StoreBudget, kvs: list[ChunkKV]) -> tuple[list, int]:
    """Write as the server's worker does (admit, then put); the entries written and the
    most any primary used meanwhile."""
    written, most = [], 0
    for kv in kvs:
        if budget.allow_write(len(encode_entry(kv)), FP, kv.key):
            store.put(kv)  # a Redis OOM error would raise StoreWriteError here
            written.append(kv)
        most = max(most, *used(store).values())
    return written, most


def test_a_store_larger_than_one_node_is_held_whole_within_the_cluster_budget(
    bounded: RedisKVStore,
) -> None:
    store = bounded
    nbytes, why = store_budget(store)
    assert nbytes == 3 * int(REDIS_FRACTION * MAXMEMORY) and "3 cluster primaries" in why
    budget = StoreBudget(store, nbytes, index_log=index_log_for(store))
    kvs = [make_kv(seed, **ENTRY) for seed in range(120)]
    written, most = write(store, budget, kvs)
    held = sum(info.nbytes for info in store.entries())
    print(f"\n{held / 2**20:.1f} MiB held over 3 primaries of {MAXMEMORY / 2**20:.0f} MiB each")
    assert len(written) == len(kvs) and budget.evicted == 0 and len(store) == len(kvs)
    assert held > MAXMEMORY and most <= MAXMEMORY  # more than a node holds, no node full


def test_a_fuller_primary_evicts_its_own_entries_and_no_write_meets_oom(
    bounded: RedisKVStore,
) -> None:
    """One primary holds 12 MiB of someone else's keys: writes to it evict the store's
    least recently used entries there (or are refused), the other primaries keep all
    of theirs, and Redis never answers OOM. Without the budget, it does."""
    store = bounded
    fuller = store.shard_of(make_kv(0, **ENTRY).key)
    for i in range(400):  # someone else's data, on that primary only
        name = f"foreign:{{{i}}}"
        if store.client.get_node_from_key(name).name == fuller:
            store.client.set(name, b"x" * 2**20)
        if used(store)[fuller] > 12 * 2**20:
            break
    budget = StoreBudget(store, store_budget(store)[0], index_log=index_log_for(store))
    kvs = [make_kv(seed, **ENTRY) for seed in range(100)]
    written, most = write(store, budget, kvs)
    wanted = Counter(store.shard_of(kv.key) for kv in kvs)
    stored = list(store.keys())
    kept = Counter(store.shard_of(key) for key in stored)
    print(f"\nentries per primary, written {dict(wanted)}, kept {dict(kept)}")
    assert most <= MAXMEMORY and budget.evicted > 0
    assert kept[fuller] < wanted[fuller]  # evicted (or refused) where it was full
    assert all(kept[name] == wanted[name] for name in wanted if name != fuller)
    assert len(written) >= len(kvs) - wanted[fuller]

    no_room = r"used memory > 'maxmemory'"  # Redis's OOM error, met by the same writes unbudgeted
    with pytest.raises(StoreWriteError, match=no_room):
        for seed in range(1000, 1200):
            kv = make_kv(seed, **ENTRY)
            if store.shard_of(kv.key) == fuller:
                store.put(kv)


def test_a_tenant_that_fills_one_primary_gives_way_there_first(bounded: RedisKVStore) -> None:
    """Keys are hashes a client can grind to land on one primary. Its entries there
    count as its share of the whole store (each weighed by the primary's share of
    the budget), so once that primary is full the flooding tenant's own entries go
    and the shared namespace's stay."""
    store = bounded
    budget = StoreBudget(store, store_budget(store)[0], index_log=index_log_for(store))
    shared = [make_kv(seed, **ENTRY) for seed in range(30)]
    written, _ = write(store, budget, shared)
    assert len(written) == len(shared)
    target = store.shard_of(shared[0].key)
    flood, seed = [], 5000
    while len(flood) < 90:  # ~23 MiB aimed at one primary of 24 MiB
        kv = make_kv(seed, **ENTRY)
        kv = ChunkKV(kv.token_ids, kv.keys, kv.values, FP + "+ns-flood")  # (keyed by it too)
        seed += 1
        if store.shard_of(kv.key) == target:
            flood.append(kv)
    _, most = write(store, budget, flood)
    left = set(store.keys())
    print(f"\nflood on one primary: {sum(kv.key in left for kv in flood)} of {len(flood)} kept")
    assert most <= MAXMEMORY and budget.evicted > 0
    assert all(kv.key in left for kv in shared)  # none of the shared entries went


def test_one_server_full_of_others_keys_refuses_rather_than_meets_oom(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """One server is one shard: its ``used_memory`` counts too, so a budget sized from
    its ``maxmemory`` never takes it to Redis's OOM error."""
    own = RedisServer(redis_server.binary, tmp_path / "redis").start()
    try:
        store = RedisKVStore(own.url, prefix="one:")
        store.client.config_set("maxmemory", MAXMEMORY)
        store.client.config_set("maxmemory-policy", "noeviction")
        for i in range(10):  # someone else's keys: ~13 MiB used with the allocator's rounding
            store.client.set(f"foreign:{i}", b"x" * 2**20)
        budget = StoreBudget(store, store_budget(store)[0])
        written, most = write(store, budget, [make_kv(seed, **ENTRY) for seed in range(40)])
        assert most <= MAXMEMORY and budget.evicted > 0 and len(store) < len(written)
        with pytest.raises(StoreWriteError, match=r"used memory > 'maxmemory'"):
            for seed in range(100, 140):  # the same writes without the budget
                store.put(make_kv(seed, **ENTRY))
    finally:
        own.stop()


def test_a_group_within_its_quota_keeps_its_entries_on_the_primary_hashing_filled(
    bounded: RedisKVStore,
) -> None:
    """Issue 59 hole 4: a primary's evictions judged a group by its entries there
    scaled to the whole store, so a group within its quota that hashing put mostly
    on one primary was "over" there and lost entries to another's writes. A group
    within its quota over the whole store keeps them: the writer's own go first,
    and what does not fit is refused."""
    from kvrag_integrations.store.quotas import Quotas
    from kvrag_integrations.vllm.trust import Tenant

    store = bounded
    nbytes = store_budget(store)[0]
    budget = StoreBudget(store, nbytes, quotas=Quotas(0.5), index_log=index_log_for(store))
    keyed = FP + "+ns-" + Tenant.of_key_namespace("team-k", b"ids").namespace
    target = store.shard_of(make_kv(0, **ENTRY).key)

    def on_target(fingerprint: str, count: int, seed: int) -> list[ChunkKV]:
        out = []
        while len(out) < count:
            kv = make_kv(seed, **ENTRY)
            kv = ChunkKV(kv.token_ids, kv.keys, kv.values, fingerprint)
            seed += 1
            if store.shard_of(kv.key) == target:
                out.append(kv)
        return out

    team = on_target(keyed, 40, 0)  # ~10 MiB: a third of its quota, all on one primary
    written, _ = write(store, budget, team)
    assert len(written) == len(team)
    flood = on_target(FP, 70, 10_000)  # the shared namespace's writer, on that primary
    _, most = write(store, budget, flood)
    left = set(store.keys())
    print(f"\nteam kept {sum(kv.key in left for kv in team)} of {len(team)}")
    assert most <= MAXMEMORY and all(kv.key in left for kv in team)


def test_a_budget_past_the_primaries_capacity_still_keeps_each_within_it(
    bounded: RedisKVStore,
) -> None:
    """Issue 59 hole 4: with ``--max-store-bytes`` past what the primaries can hold,
    a primary's share of it was past its capacity and "80% of maxmemory" bound
    nothing: writes met Redis's OOM error. Each primary's share is at most its
    capacity."""
    store = bounded
    budget = StoreBudget(store, 10 * store_budget(store)[0], index_log=index_log_for(store))
    written, most = write(store, budget, [make_kv(seed, **ENTRY) for seed in range(300)])
    print(f"\n{len(written)} written, most used {most / 2**20:.1f} MiB")
    assert most <= MAXMEMORY and budget.evicted + budget.refused > 0
