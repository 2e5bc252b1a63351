"""The content index's log in Redis: beside a RedisKVStore, shared by replicas."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import redis
from redis_helpers import RedisServer

from kvrag_integrations import RedisKVStore
from kvrag_integrations.bench.redis_cluster import find_binary
from kvrag_integrations.matching import RedisIndexLog, SyncedIndex, index_log_for, open_index_log


def ids(seed: int, n: int = 40) -> list[int]:
    return np.random.default_rng(seed).integers(0, 49152, n).tolist()


def plain(records: list) -> list:
    return [(namespace, arr.tolist()) for namespace, arr in records]


def test_replicas_share_records_through_one_list(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    a, b = RedisIndexLog(client, redis_prefix), RedisIndexLog(client, redis_prefix)
    assert a.read_new() == [] and a.key == f"{redis_prefix}index"
    a.append("m", [1, 2, 3])
    b.append("n", ids(1))
    assert plain(a.read_new()) == [("m", [1, 2, 3]), ("n", ids(1))]
    assert a.read_new() == []
    client.rpush(a.key, b"garbage")  # a damaged item is skipped, never fatal
    a.append("m", [4])
    assert plain(a.read_new()) == [("m", [4])]
    assert [ns for ns, _ in b.read_new()] == ["m", "n", "m"]
    restarted = RedisIndexLog(client, redis_prefix)
    assert len(restarted.read_new()) == 3  # the garbage item is skipped again
    client.delete(a.key)  # the server was flushed: readers start anew
    a.append("m", [5])
    assert plain(restarted.read_new()) == [("m", [5])]
    client.close()


def test_the_log_of_a_store_url_is_beside_that_store(redis_server: RedisServer) -> None:
    url = redis_server.url.rsplit("/", 1)[0] + "/2"  # a db of this test's own
    store = RedisKVStore(url)  # the default prefix, as ``open_store(url)`` has it
    log = open_index_log(url)
    try:
        assert isinstance(log, RedisIndexLog) and log.key == store.prefix + "index"
        log.append("m", ids(2))
        assert store.client.llen(log.key) == 1  # same server, same db
        assert list(store.keys()) == [] and len(store) == 0  # never taken for an entry
        same = index_log_for(store)
        assert plain(same.read_new()) == [("m", ids(2))]
    finally:
        store.client.delete(log.key)
        log.close()
        store.close()


def test_synced_indexes_on_redis(redis_server: RedisServer, redis_prefix: str) -> None:
    store = RedisKVStore(redis_server.url, prefix=redis_prefix)
    a = SyncedIndex(index_log_for(store), refresh_s=0)
    b = SyncedIndex(index_log_for(store), refresh_s=0)
    entry = ids(3, 100)
    assert a.add("m", entry) and not b.add("m", entry)
    runs = b.cover("m", [7, *entry[10:90], 8])
    assert [(r.start, r.length, r.offset) for r in runs] == [(1, 80, 10)]
    store.close()


def test_a_dead_server_does_not_fail_cover(tmp_path_factory: pytest.TempPathFactory) -> None:
    server = RedisServer(find_binary("redis-server"), tmp_path_factory.mktemp("redis-dead")).start()
    store = RedisKVStore(server.url, prefix="dead:", socket_timeout=0.5)
    synced = SyncedIndex(index_log_for(store), refresh_s=0)
    synced.add("m", ids(4, 50))
    server.stop()
    assert len(synced.cover("m", ids(4, 50))) == 1  # served from memory
    assert synced.add("m", ids(5, 50))  # indexed locally only
    store.close()


def _append_records(url: str, prefix: str, worker: int, count: int) -> None:
    client = redis.Redis.from_url(url)
    log = RedisIndexLog(client, prefix)
    for i in range(count):
        log.append(f"w{worker}", ids(worker * 100_000 + i, 20))
        log.append("gone", ids(worker * 100_000 + i, 20))  # each compaction drops some
    client.close()


def test_compaction_loses_no_record_appended_by_other_processes(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """Two processes append while this one compacts again and again (dropping only
    records of namespace "gone"); a reader that followed along rebuilds: every
    appended record survives, once, and the dropped ones are gone everywhere."""
    client = redis.Redis.from_url(redis_server.url)
    log = RedisIndexLog(client, redis_prefix)
    reader = SyncedIndex(RedisIndexLog(client, redis_prefix), refresh_s=0)
    for seed in range(50):
        log.append("gone", ids(seed, 20))
    assert reader.refresh() == 50
    context = multiprocessing.get_context("fork")
    workers = [
        context.Process(target=_append_records, args=(redis_server.url, redis_prefix, w, 300))
        for w in (1, 2)
    ]
    for process in workers:
        process.start()
    compactions = 0
    while any(p.is_alive() for p in workers) or compactions < 3:
        log.compact(lambda namespace, arr: namespace != "gone")
        reader.refresh()
        compactions += 1
    for process in workers:
        process.join()
        assert process.exitcode == 0
    records = RedisIndexLog(client, redis_prefix).read_new()
    names = sorted((namespace, tuple(arr.tolist())) for namespace, arr in records)
    want = sorted((f"w{w}", tuple(ids(w * 100_000 + i, 20))) for w in (1, 2) for i in range(300))
    assert names == want
    reader.refresh()
    assert len(reader) == 600 and ("gone", ids(0, 20)) not in reader
    assert log.nbytes() > 0
    client.delete(log.key, f"{log.key}:gen")
    client.close()


def test_a_redis_store_is_sized_from_maxmemory(redis_server: RedisServer) -> None:
    from kvrag_integrations.store.sizing import HOST_FRACTION, REDIS_FRACTION, store_budget

    store = RedisKVStore(redis_server.url)
    before = store.client.config_get("maxmemory")["maxmemory"]
    try:
        store.client.config_set("maxmemory", str(512 * 2**20))
        nbytes, why = store_budget(store)
        assert nbytes == int(REDIS_FRACTION * 512 * 2**20) and "maxmemory" in why
        store.client.config_set("maxmemory", "0")
        host = int(store.client.info("memory")["total_system_memory"])
        assert store_budget(store)[0] == int(HOST_FRACTION * host)
    finally:
        store.client.config_set("maxmemory", before)
        store.close()
