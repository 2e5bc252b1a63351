"""Integration tier fixtures: the real default model (loaded once per test run), Redis,
and the count of vLLM starts (``vllm_starts``: see vllm_starts.py)."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator

import pytest
from redis_cluster_helpers import PASSWORD, cluster_binaries
from redis_helpers import RedisServer
from vllm_starts import VLLMStarts, Watcher

from kvrag_integrations import KVRAGEngine, RedisKVStore
from kvrag_integrations.bench.redis_cluster import LocalRedisCluster, find_binary


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
    if (binary := find_binary("redis-server")) is None:
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


_STARTS = pytest.StashKey[VLLMStarts]()
_WATCHER = pytest.StashKey[Watcher]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_STARTS] = starts = VLLMStarts()
    if importlib.util.find_spec("vllm") is not None:  # elsewhere no test starts one
        config.stash[_WATCHER] = Watcher(starts).start()


@pytest.fixture(scope="session")
def vllm_starts(pytestconfig: pytest.Config) -> VLLMStarts:
    """The run's ledger of vLLM starts: the fixtures that start vLLM declare each start."""
    return pytestconfig.stash[_STARTS]


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that starts vLLM itself says how many times (``starts_vllm(n)``)."""
    if (marker := item.get_closest_marker("starts_vllm")) is not None:
        item.config.stash[_STARTS].declare(item.nodeid, int(marker.args[0]))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fails the run on an undeclared vLLM start, or on more than ``MAX_STARTS``."""
    if (watcher := session.config.stash.get(_WATCHER, None)) is not None:
        watcher.stop()
    if session.config.stash[_STARTS].problems():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    starts = config.stash[_STARTS]
    if _WATCHER in config.stash:  # where vLLM is installed
        terminalreporter.write_line(starts.summary())
    for problem in starts.problems():
        terminalreporter.write_line(f"FAILED (vLLM starts): {problem}", red=True)
