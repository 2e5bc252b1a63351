"""A Redis Cluster's faults while requests run: a primary killed, a primary paused,
slots moved. Loads are misses (recomputed exactly), never wrong or half entries;
reuse comes back without restarting anything of ours.

Each test leaves the run's cluster healthy (``healed``: killed nodes restarted,
rejoined as replicas; moved slots moved back).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from redis_cluster_helpers import FP, healed, make_kv, replicated, same

from kvrag_integrations import KVRAGEngine, RedisKVStore
from kvrag_integrations.bench.redis_cluster import LocalRedisCluster
from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.errors import StoreWriteError

pytest.importorskip("redis", reason="the redis client is missing: pip install -e '.[test]'")

CHUNKS = [
    "The Hubble Space Telescope was launched in April 1990 aboard the shuttle Discovery.",
    "Mount Everest, at 8,849 metres, is Earth's highest mountain above sea level.",
    "The Danube flows through ten countries, more than any other river in the world.",
    "Marie Curie won Nobel Prizes in both physics and chemistry, in 1903 and 1911.",
    "The Great Barrier Reef lies off the coast of Queensland in north-east Australia.",
    "Ada Lovelace wrote what is seen as the first program, for Babbage's Analytical Engine.",
]
QUESTION = "Which of these happened first?"


class Readers:
    """``count`` threads reading every entry in turn until stopped: each read must be
    the entry bit for bit or a miss; records per entry how each read went."""

    def __init__(self, store: RedisKVStore, kvs: list[ChunkKV], count: int = 8) -> None:
        self.store, self.kvs, self.stop = store, kvs, threading.Event()
        self.hits: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self.wrong: list[str] = []
        self.slowest = 0.0
        self.pool = ThreadPoolExecutor(count)
        self.futures = [self.pool.submit(self._run, i) for i in range(count)]

    def _run(self, offset: int) -> None:
        while not self.stop.is_set():
            for kv in self.kvs[offset:] + self.kvs[:offset]:
                started = time.monotonic()
                got = self.store.get(kv.key, FP)
                self.slowest = max(self.slowest, time.monotonic() - started)
                if got is None:
                    self.misses[kv.key] += 1
                elif same(got, kv):
                    self.hits[kv.key] += 1
                else:
                    self.wrong.append(kv.key)

    def join(self) -> None:
        self.stop.set()
        for future in self.futures:
            future.result()  # a reader that raised fails the test here
        self.pool.shutdown()


def until(condition: Callable[[], bool], timeout: float) -> float:
    """Seconds until ``condition()`` holds (polled); fails past ``timeout``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"not within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_primary_killed_under_load_costs_misses_then_fails_over(
    redis_cluster: LocalRedisCluster, redis_prefix: str
) -> None:
    store = RedisKVStore(redis_cluster.url, prefix=redis_prefix, max_value_bytes=4096)
    kvs = [make_kv(seed, n=48) for seed in range(48)]  # split entries: several keys each
    for kv in kvs:
        store.put(kv)
    replicated(redis_cluster)
    shards = Counter(store.shard_of(kv.key) for kv in kvs)
    victim = shards.most_common(1)[0][0]
    on_victim = [kv for kv in kvs if store.shard_of(kv.key) == victim]
    with healed(redis_cluster):
        readers = Readers(store, kvs)
        time.sleep(0.5)  # reads in flight on every primary
        redis_cluster.kill(int(victim.rsplit(":", 1)[1]))
        killed = time.monotonic()

        def reused() -> bool:
            return all(same(store.get(kv.key, FP), kv) for kv in on_victim)

        back = until(reused, 60)
        time.sleep(0.5)
        readers.join()
        print(
            f"\nprimary {victim} killed: its {len(on_victim)} of {len(kvs)} entries reused "
            f"again after {back:.1f} s (failover, no restart of ours); slowest read "
            f"{readers.slowest:.2f} s; reads: {sum(readers.hits.values())} hits, "
            f"{sum(readers.misses.values())} misses"
        )
        assert readers.wrong == [] and store.stats.rejected == 0  # no half or wrong entry
        assert sum(readers.misses.values()) > 0  # the kill was seen
        assert readers.slowest < 10  # a read never hangs
        assert store.shard_of(on_victim[0].key) != victim and time.monotonic() - killed < 60
        assert all(same(store.get(kv.key, FP), kv) for kv in kvs)  # the replica had them all
        after = make_kv(seed=999)
        assert same(store.get(store.put(after), FP), after)  # writes go on


def test_the_engine_answers_every_request_exactly_through_a_failover(
    engine: KVRAGEngine, redis_cluster: LocalRedisCluster, redis_prefix: str
) -> None:
    """Requests in flight when a primary dies: each is answered, its lost chunks
    encoded again on the request (on_miss="encode"), with the text of a run that
    lost nothing."""
    store = RedisKVStore(redis_cluster.url, prefix=redis_prefix)
    eng = KVRAGEngine(engine.loaded, store=store, on_miss="encode")
    refs = eng.encode_chunks(CHUNKS, show_progress=False)
    replicated(redis_cluster)
    asks = [CHUNKS[i : i + 3] for i in range(len(CHUNKS) - 2)] * 2
    baseline = {
        tuple(c): eng.generate(question=QUESTION, chunks=c, max_new_tokens=4).text for c in asks
    }
    victim = Counter(store.shard_of(ref.key) for ref in refs).most_common(1)[0][0]
    with healed(redis_cluster), ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(eng.generate, question=QUESTION, chunks=c, max_new_tokens=4) for c in asks
        ]
        time.sleep(0.1)
        redis_cluster.kill(int(victim.rsplit(":", 1)[1]))
        results = [f.result(timeout=120) for f in futures]
    lost = sum(r.lazily_encoded_chunks for r in results)
    print(f"\n{len(asks)} requests through a failover: {lost} chunks encoded again on the request")
    assert [r.text for r in results] == [baseline[tuple(c)] for c in asks]
    assert all(r.generated_tokens > 0 for r in results) and store.stats.rejected == 0
    assert lost > 0  # the kill was felt: what it took was computed, exactly


def test_a_paused_primary_costs_misses_not_hangs(
    redis_cluster: LocalRedisCluster, cluster_store: RedisKVStore
) -> None:
    """``CLIENT PAUSE`` (a primary too slow to answer within the 1 s timeout): its
    entries are misses within seconds, the others hit, nothing is taken for damaged,
    and once it answers again its entries hit."""
    store = cluster_store
    kvs = [make_kv(seed, n=16) for seed in range(24)]
    for kv in kvs:
        store.put(kv)
    victim = store.shard_of(kvs[0].key)
    slow = [kv for kv in kvs if store.shard_of(kv.key) == victim][:2]
    fast = [kv for kv in kvs if store.shard_of(kv.key) != victim][:4]
    pause_ms = 5000
    redis_cluster.client(int(victim.rsplit(":", 1)[1])).execute_command(
        "CLIENT", "PAUSE", pause_ms, "ALL"
    )
    paused = time.monotonic()
    for kv in slow:
        started = time.monotonic()
        assert store.get(kv.key, FP) is None
        assert time.monotonic() - started < 4  # 1 s timeout, one retry
    for kv in fast:
        assert same(store.get(kv.key, FP), kv)
    assert time.monotonic() - paused < pause_ms / 1000  # all of it while paused
    time.sleep(max(0.0, pause_ms / 1000 - (time.monotonic() - paused)) + 0.2)
    assert all(same(store.get(kv.key, FP), kv) for kv in slow + fast)
    assert store.stats.rejected == 0


def test_resharding_under_reads_and_writes_loses_nothing(
    redis_cluster: LocalRedisCluster, redis_prefix: str
) -> None:
    """``redis-cli --cluster reshard`` moves 1000 slots while 8 readers and a writer
    run: redis-py follows MOVED and ASK; every read is the entry (or a miss), every
    write that returned is readable after."""
    store = RedisKVStore(redis_cluster.url, prefix=redis_prefix, max_value_bytes=2048)
    kvs = [make_kv(seed, n=24) for seed in range(160)]
    for kv in kvs:
        store.put(kv)
    source, target = redis_cluster.primary_ports()[:2]
    moved = [kv for kv in kvs if store.shard_of(kv.key).endswith(f":{source}")]
    nodes, redirected = store.client.nodes_manager, Counter()
    for name in ("move_slot", "initialize"):  # what redis-py does on MOVED
        method = getattr(nodes, name)
        setattr(
            nodes,
            name,
            lambda *a, _m=method, _n=name, **k: (redirected.update([_n]), _m(*a, **k))[1],
        )
    readers = Readers(store, kvs)
    written, failed = [], 0
    reshard = redis_cluster.reshard(source, target, 1000)
    try:
        seed = 1000
        while reshard.poll() is None:
            kv = make_kv(seed, n=24)
            seed += 1
            time.sleep(0.01)  # a steady writer, not one that keeps the slots moving
            try:
                store.put(kv)
                written.append(kv)
            except StoreWriteError:
                failed += 1
    finally:
        reshard.wait(120)
        readers.join()
    assert reshard.returncode == 0, (redis_cluster.workdir / "reshard.log").read_text()[-2000:]
    now_on_target = [kv for kv in moved if store.shard_of(kv.key).endswith(f":{target}")]
    print(
        f"\nresharding 1000 slots: {len(now_on_target)} of {len(kvs)} entries moved; "
        f"reads: {sum(readers.hits.values())} hits, {sum(readers.misses.values())} misses; "
        f"{len(written)} writes, {failed} failed; slot map updates on MOVED: {dict(redirected)}"
    )
    assert readers.wrong == [] and store.stats.rejected == 0
    assert now_on_target and redirected  # entries moved under the readers, who followed
    assert all(same(store.get(kv.key, FP), kv) for kv in kvs + written)
    assert redis_cluster.reshard(target, source, 1000).wait(120) == 0
    redis_cluster.wait_healthy()
