"""Integration tier fixtures: the real default model (loaded once per test run), Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from redis_cluster_helpers import PASSWORD, cluster_binaries
from redis_helpers import RedisServer, find_redis_server

from kvrag_integrations import KVRAGEngine, RedisKVStore
from kvrag_integrations.bench.redis_cluster import LocalRedisCluster


@pytest.fixture(scope="session")
def engine() -> KVRAGEngine:
    """The bundled SmolLM2-135M-Instruct on CPU (the process-wide shared engine).

    Set to encode missed chunks on the request path (``on_miss="encode"``):
    strategy and exactness tests compare strategies on chunks they did not
    encode first. Tests of the default (``"defer"``: plain prefill, background
    encoding) build their own engine on ``engine.loaded``.

    Chunk caches are stored at model precision (``cache_precision="model"``):
    exactness tests compare reuse against full prefill with float32 tolerances.
    """
    shared = KVRAGEngine.shared()
    shared.on_miss = "encode"
    shared.cache_precision = "model"
    return shared


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server on loopback for the run (no persistence); skips when there is none."""
    pytest.importorskip("redis", reason="the redis client is missing: pip install -e '.[test]'")
    if (binary := find_redis_server()) is None:
        pytest.skip("redis-server not found (apt-get install redis-server; .ci/run installs it)")
    srv = RedisServer(binary, tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


@pytest.fixture()
def redis_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix of this test's own: tests share the server, never keys."""
    return f"t-{request.node.originalname}-{time.monotonic_ns()}:"


@pytest.fixture()
def redis_store(redis_server: RedisServer, redis_prefix: str) -> Iterator[RedisKVStore]:
    """A RedisKVStore on ``redis_server`` under ``redis_prefix``."""
    store = RedisKVStore(redis_server.url, prefix=redis_prefix)
    yield store
    store.close()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    """A Redis Cluster for the run: 3 primaries, 3 replicas, a password, no
    persistence; skips where redis-server or redis-cli is missing."""
    pytest.importorskip("redis", reason="the redis client is missing: pip install -e '.[test]'")
    if (missing := cluster_binaries()) is not None:
        pytest.skip(missing)
    cluster = LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster"), password=PASSWORD)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture()
def cluster_store(redis_cluster: LocalRedisCluster, redis_prefix: str) -> Iterator[RedisKVStore]:
    """A RedisKVStore on ``redis_cluster`` (by its URL) under ``redis_prefix``."""
    store = RedisKVStore(redis_cluster.url, prefix=redis_prefix)
    yield store
    store.close()
