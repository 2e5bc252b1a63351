"""RedisKVStore on a real Redis Cluster: 3 primaries, 3 replicas, a password.

The run's cluster (``redis_cluster``, tests/integration/conftest.py) behind a
``redis+cluster://`` URL: an entry's keys and the index log each in one slot,
entries spread over the primaries, damaged and foreign entries missed as on
one node, and URLs naming no healthy cluster refused at start. Faults (a
primary killed, paused, resharded) are in test_redis_cluster_faults.py, the
budget across primaries in test_store_budget_cluster.py.
"""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import pytest
from redis_cluster_helpers import FP, PASSWORD, cluster_binaries, entries_per_primary, make_kv, same
from redis_helpers import DAMAGE, RedisServer, flip

from kvrag_integrations import RedisKVStore
from kvrag_integrations.bench.ports import free_port
from kvrag_integrations.bench.redis_cluster import LocalRedisCluster
from kvrag_integrations.errors import StoreURLError
from kvrag_integrations.matching import RedisIndexLog, index_log_for, open_index_log
from kvrag_integrations.store import open_store
from kvrag_integrations.store.codec import encode_entry
from kvrag_integrations.store.url import redact_url

redis = pytest.importorskip("redis", reason="the redis client is missing: pip install -e '.[test]'")


def keys_under(store: RedisKVStore) -> list[str]:
    """Every Redis key under the store's prefix on every primary, parts included."""
    return [k.decode() for k in store.client.scan_iter(match=f"{store.prefix}*")]


def test_an_entry_its_parts_and_the_index_log_each_live_in_one_slot(
    redis_cluster: LocalRedisCluster, redis_prefix: str
) -> None:
    store = open_store(redis_cluster.url.replace("redis+cluster", "REDIS+CLUSTER"))
    assert isinstance(store, RedisKVStore) and store.cluster and store.prefix == "kvrag:"
    store = RedisKVStore(redis_cluster.url, prefix=redis_prefix, max_value_bytes=1024)
    kv = make_kv(n=64)
    key = store.put(kv)
    names = keys_under(store)
    assert len(names) > 4 and f"{redis_prefix}{{{key}}}" in names  # the manifest, its parts
    assert len({store.client.keyslot(name) for name in names}) == 1
    assert same(store.get(key, FP), kv) and list(store.keys()) == [key] and len(store) == 1
    (info,) = store.entries()
    assert (info.key, info.nbytes, info.fingerprint) == (key, len(encode_entry(kv)), FP)

    log, replica = index_log_for(store), RedisIndexLog(store.client, redis_prefix)
    log.append(FP, [1, 2, 3])
    assert log.key == f"{redis_prefix}{{index}}" and list(store.keys()) == [key]
    assert [(ns, ids.tolist()) for ns, ids in replica.read_new()] == [(FP, [1, 2, 3])]
    assert log.compact(lambda namespace, ids: False) == (0, 1)  # one MULTI over the list and
    log.append(FP, [4])  # its generation: they share a slot
    assert [ids.tolist() for _, ids in replica.read_new()] == [[4]] and replica.generation == 1
    log_keys = set(keys_under(store)) - set(names)
    assert len({store.client.keyslot(name) for name in log_keys}) == 1
    store.delete(key)
    assert set(keys_under(store)) == log_keys
    store.client.delete(*log_keys)


def test_a_few_hundred_entries_spread_evenly_over_the_primaries(
    cluster_store: RedisKVStore,
) -> None:
    for seed in range(300):
        cluster_store.put(make_kv(seed, n=8))
    counts = entries_per_primary(cluster_store)  # asked of each primary
    print(f"entries per primary after 300 writes: {dict(counts)}")
    assert len(counts) == 3 and sum(counts.values()) == 300
    assert all(abs(n - 100) <= 25 for n in counts.values()), counts  # within 25% of even
    stored = list(cluster_store.keys())  # (every primary's SCAN)
    assert len(stored) == 300 and {cluster_store.shard_of(k) for k in stored} == set(counts)


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
def test_damaged_and_foreign_entries_are_misses(
    redis_cluster: LocalRedisCluster, redis_prefix: str, damage, split: bool
) -> None:
    store = RedisKVStore(
        redis_cluster.url, prefix=redis_prefix, max_value_bytes=1024 if split else 2**20
    )
    kv = make_kv(n=32)
    store.put(kv)
    target = manifest = f"{redis_prefix}{{{kv.key}}}"
    if split:  # the last part: header intact, payload wrong or short
        target = max(set(keys_under(store)) - {manifest}, key=lambda k: int(k.rsplit(":", 1)[1]))
    store.client.set(target, damage(store.client.get(target), kv))
    assert store.get(kv.key, FP) is None
    assert store.stats.rejected == 1 and store.stats.hits == 0 and not store.contains(kv.key)
    assert keys_under(store) == [] or split  # the bad entry went (a split one's parts expire)


def test_another_namespace_or_prefix_sees_nothing(
    redis_cluster: LocalRedisCluster, redis_prefix: str
) -> None:
    mine = RedisKVStore(redis_cluster.url, prefix=redis_prefix + "a:")
    other = RedisKVStore(redis_cluster.url, prefix=redis_prefix + "b:")
    kv = make_kv(seed=7)
    mine.put(kv)
    assert other.get(kv.key, FP) is None and list(other.keys()) == []
    assert mine.get(kv.key, "another-tenant's-fingerprint") is None  # a foreign namespace
    assert mine.stats.rejected == 1 and not mine.contains(kv.key)  # dropped, recomputed
    store = RedisKVStore(redis_cluster.url, prefix=redis_prefix)
    store.client.set(f"{redis_prefix}{{{kv.key}}}", flip(encode_entry(kv)))  # tampered in Redis
    assert store.get(kv.key, FP) is None and store.stats.rejected == 1
    with pytest.raises(ValueError, match="64 lowercase hex"):
        store.get("../" + kv.key[3:], FP)
    with pytest.raises(ValueError, match="prefix cannot hold"):
        RedisKVStore(redis_cluster.url, prefix="{tenant}:")  # would put every key in one slot


def test_a_port_taken_before_its_node_binds_it_is_drawn_again(tmp_path: Path) -> None:
    """CI once lost the whole cluster suite to one node's port, taken by another
    process between the draw and the bind: before the join, a new one is drawn."""
    if cluster_binaries() is not None:
        pytest.skip("redis-server or redis-cli is missing")
    cluster = LocalRedisCluster(tmp_path, primaries=1, replicas=0)
    taken = cluster.nodes[0].port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with cluster:
            assert cluster.nodes[0].port != taken
            assert cluster.client(cluster.nodes[0].port).cluster("info")["cluster_state"] == "ok"


def test_urls_naming_no_healthy_cluster_are_refused_at_start(
    redis_cluster: LocalRedisCluster,
    redis_server: RedisServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    good = redis_cluster.url
    nodes = good.split("@", 1)[1]
    first = nodes.split(",")[0]

    def refused(url: str, match: str) -> str:
        started = time.monotonic()
        with pytest.raises(StoreURLError, match=match) as caught:
            open_store(url)
        assert time.monotonic() - started < 15  # no hang on a dead or silent node
        assert PASSWORD not in str(caught.value)
        return str(caught.value)

    down = f"redis+cluster://:{PASSWORD}@127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    refused(down, "no Redis Cluster node answers")
    refused(f"redis+cluster://:wrong@{nodes}", "invalid username-password|WRONGPASS|auth")
    plain = redis_server.url.replace("redis://", "redis+cluster://")
    refused(plain, "cluster mode disabled")
    refused(f"redis+cluster://:{PASSWORD}@{nodes}/1", "database 0 only")
    refused(f"redis+cluster://:{PASSWORD}@{first}?colour=red", "unknown .* option.*colour")
    refused(f"redis+cluster://:{PASSWORD}@{first}:x", "bad port")
    refused(f"redis+cluster://:{PASSWORD}@{first},{redis_server.url[8:-2]}", "without cluster")

    # One node serving every slot is a cluster, but not this one.
    with LocalRedisCluster(tmp_path / "other", primaries=1, replicas=0) as other:
        one = other.url.split("//", 1)[1]
        assert open_store(other.url).cluster  # a cluster of one primary is fine
        refused(f"redis+cluster://:{PASSWORD}@{first},{one}", "another Redis Cluster")
    bare = LocalRedisCluster(tmp_path / "bare", primaries=1, replicas=0).start(join=False)
    try:
        refused(bare.url, "does not serve every hash slot")
    finally:
        bare.stop()

    # A listed node that does not answer is logged, and the store opens.
    with caplog.at_level(logging.WARNING):
        store = open_store(f"{good},127.0.0.1:{free_port()}")
    assert store.cluster and "does not answer" in caplog.text
    assert redact_url(good) == f"redis+cluster://***@{nodes}"
    log = open_index_log(good)
    assert isinstance(log, RedisIndexLog) and log.key == "kvrag:{index}"
    log.close()
