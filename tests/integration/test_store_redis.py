"""RedisKVStore against a real redis-server started on loopback for this run.

The store alone: round trips, namespaces, split values, damaged values, a dead
or silent server. The engine over Redis is in test_engine_redis.py.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
from redis_helpers import DAMAGE, RedisServer, flip, raw_keys

from kvrag_integrations import RedisKVStore
from kvrag_integrations.bench.ports import free_port
from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.errors import StoreWriteError
from kvrag_integrations.store.codec import encode_entry
from kvrag_integrations.store.redis import _MANIFEST_MAGIC

redis = pytest.importorskip("redis", reason="the redis client is missing: pip install -e '.[test]'")

FP = "fp-test"


@pytest.fixture(scope="module")
def server(redis_server: RedisServer) -> RedisServer:
    """The run's redis-server (tests/integration/conftest.py); skips without one."""
    return redis_server


@pytest.fixture()
def prefix(request: pytest.FixtureRequest) -> str:
    return f"t-{request.node.originalname}-{time.monotonic_ns()}:"  # one namespace per test


@pytest.fixture()
def store(server: RedisServer, prefix: str) -> Iterator[RedisKVStore]:
    s = RedisKVStore(server.url, prefix=prefix)
    yield s
    s.close()


def make_kv(seed: int = 0, n: int = 16, dtype: torch.dtype = torch.float32) -> ChunkKV:
    gen, shape = torch.Generator().manual_seed(seed), (2, 2, n, 8)
    keys, values = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    return ChunkKV(torch.randint(0, 32000, (n,), generator=gen), keys, values, FP)


def assert_same(a: ChunkKV | None, b: ChunkKV) -> None:
    assert a is not None
    for name in ("token_ids", "keys", "values"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


# ---------------------------------------------------------------- the store alone
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_bit_exact(store: RedisKVStore, dtype: torch.dtype) -> None:
    kv = make_kv(dtype=dtype)
    assert store.get(kv.key, FP) is None
    key = store.put(kv)
    assert_same(store.get(key, FP), kv)
    assert list(store.keys()) == [key] and store.contains(key) and len(store) == 1
    assert (store.stats.hits, store.stats.misses, store.stats.writes) == (1, 1, 1)
    assert store.ttl(key) is None  # no TTL unless asked


def test_prefix_namespaces_and_keys_are_hashes(server: RedisServer, prefix: str) -> None:
    a = RedisKVStore(server.url, prefix=prefix + "a:")
    b = RedisKVStore(server.url, prefix=prefix + "b:")
    kv = make_kv()
    a.put(kv)
    assert raw_keys(a) == {f"{prefix}a:{kv.key}"}
    assert b.get(kv.key, FP) is None and list(b.keys()) == [] and not b.contains(kv.key)
    odd = RedisKVStore(server.url, prefix=prefix + "[x]*?:")  # glob characters are escaped
    odd.put(kv)
    assert list(odd.keys()) == [kv.key] and list(a.keys()) == [kv.key]
    with pytest.raises(ValueError, match="64 lowercase hex"):
        a.get("../etc/passwd", FP)
    with pytest.raises(ValueError):
        a.contains(kv.key + "\n")  # "$" in a regex would let this through


def test_split_entry_round_trips_with_ttl_and_a_missing_part_is_a_miss(
    server: RedisServer, prefix: str
) -> None:
    store = RedisKVStore(server.url, prefix=prefix, max_value_bytes=2048, ttl_s=120)
    kv = make_kv(n=64, dtype=torch.bfloat16)
    assert len(encode_entry(kv)) > 3 * 2048
    store.put(kv)
    manifest = prefix + kv.key
    parts = sorted(raw_keys(store) - {manifest})
    assert len(parts) >= 4 and len(store.client.get(manifest)) < 300
    assert all(store.client.strlen(p) <= 2048 for p in parts)
    assert 110 < store.ttl(kv.key) <= 120  # the same TTL on the manifest and every part
    assert all(110_000 < store.client.pttl(p) <= 120_000 for p in parts)
    assert list(store.keys()) == [kv.key]  # parts are not entries
    assert_same(store.get(kv.key, FP), kv)

    store.put(kv)  # a rewrite: parts of the old copy (if named differently) expire
    current = store._old_parts(store.client, manifest)
    expiring = raw_keys(store) - {manifest, *current}
    assert all(store.client.pttl(p) > 0 for p in expiring)
    assert store.get(kv.key, FP) is not None

    store.client.delete(current[1])
    assert store.get(kv.key, FP) is None and store.stats.rejected == 1
    assert raw_keys(store) - expiring == set()  # the broken entry went, with its parts

    store.put(kv)
    assert store.get(kv.key, FP) is not None


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
def test_damaged_values_are_misses(server: RedisServer, prefix: str, damage, split: bool) -> None:
    store = RedisKVStore(server.url, prefix=prefix, max_value_bytes=1024 if split else 2**20)
    kv = make_kv(n=32)
    store.put(kv)
    if split:  # damage the last part: header intact, payload wrong or short
        last = max(raw_keys(store) - {prefix + kv.key}, key=lambda k: int(k.rsplit(":", 1)[1]))
        store.client.set(last, damage(store.client.get(last), kv))
    else:
        store.client.set(prefix + kv.key, damage(store.client.get(prefix + kv.key), kv))
    assert store.get(kv.key, FP) is None
    assert store.stats.rejected == 1 and store.stats.hits == 0
    assert not store.contains(kv.key)


def _manifest(size: object, part: object, count: object, digest: str = "0" * 64) -> bytes:
    return json.dumps({"size": size, "part": part, "count": count, "sha256": digest}).encode()


@pytest.mark.parametrize(
    "manifest",
    [b"not json", _manifest(10**15, 1, 10**15), _manifest(10, 4, 2), _manifest(10, 4, 3, "../x")],
    ids=["garbage", "huge", "bad-count", "bad-digest"],
)
def test_malformed_manifest_is_a_miss(store: RedisKVStore, manifest: bytes) -> None:
    kv = make_kv()
    store.client.set(store.prefix + kv.key, _MANIFEST_MAGIC + manifest)
    assert store.get(kv.key, FP) is None and store.stats.rejected == 1
    assert raw_keys(store) == set()


@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
def test_entries_and_check_read_headers_only(server: RedisServer, prefix: str, split: bool):
    store = RedisKVStore(server.url, prefix=prefix, max_value_bytes=1024 if split else 2**20)
    good, foreign, bad = make_kv(seed=1, n=32), make_kv(seed=2), make_kv(seed=3, n=32)
    foreign = ChunkKV(foreign.token_ids, foreign.keys, foreign.values, "another-model")
    for kv in (good, foreign, bad):
        store.put(kv)
    if split:
        last = max(
            (k for k in raw_keys(store) if k.startswith(prefix + bad.key + ":part:")),
            key=lambda k: int(k.rsplit(":", 1)[1]),
        )
        store.client.set(last, flip(store.client.get(last)))
    else:
        store.client.set(prefix + bad.key, flip(store.client.get(prefix + bad.key)))
    infos = {info.key: info for info in store.entries()}
    assert set(infos) == {good.key, foreign.key, bad.key}
    assert infos[good.key].nbytes == len(encode_entry(good))  # the whole blob, even when split
    assert infos[foreign.key].fingerprint == "another-model"
    assert infos[bad.key].fingerprint == FP  # the header is intact; only check() decodes
    assert all(abs(info.updated_at - time.time()) < 60 for info in infos.values())
    assert store.check(good.key) is None and store.check(foreign.key) is None
    assert "checksum" in store.check(bad.key)


@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
def test_listing_entries_keeps_their_least_recently_used_order(
    server: RedisServer, prefix: str, split: bool
) -> None:
    """``entries`` is what every budget eviction orders by: listing must not count as
    a use (a GETRANGE or STRLEN resets Redis's idle time), or every listing makes all
    entries equally fresh and an eviction takes a just-written entry as readily as
    one unused for an hour. A load (GET) is a use."""
    store = RedisKVStore(server.url, prefix=prefix, max_value_bytes=1024 if split else 2**20)
    old, new = make_kv(seed=4, n=32), make_kv(seed=5, n=32)
    store.put(old)
    time.sleep(2.2)  # (Redis's idle clock counts whole seconds)
    store.put(new)
    for _ in range(3):  # the writer's own listings read no header
        infos = {info.key: info for info in store.entries()}
        assert infos[old.key].updated_at < infos[new.key].updated_at - 1.5
    # another process's store (a replica's budget) reads each header once, after
    # the idle time (that read resets it: the one use a listing makes)
    other = RedisKVStore(server.url, prefix=prefix, max_value_bytes=store.max_value_bytes)
    infos = {info.key: info for info in other.entries()}
    assert infos[old.key].updated_at < infos[new.key].updated_at - 1.5
    assert infos[old.key].fingerprint == FP
    assert {info.key: info.nbytes for info in store.entries()} == {
        kv.key: len(encode_entry(kv)) for kv in (old, new)
    }
    assert store.get(old.key, FP) is not None  # a load: now the most recently used
    infos = {info.key: info for info in store.entries()}
    assert time.time() - infos[old.key].updated_at < 1.5
    store.delete(new.key)
    assert [info.key for info in store.entries()] == [old.key]


@pytest.mark.parametrize("precision", ["float16", "bfloat16", "int8", "model"])
def test_round_trip_per_storage_precision(store: RedisKVStore, precision: str) -> None:
    kv = make_kv(n=24).stored_as(precision)
    store.put(kv)
    got = store.get(kv.key, FP)
    assert got is not None and got.precision == kv.precision
    for name, tensor in kv.tensors().items():
        other = got.tensors()[name]
        assert other.dtype == tensor.dtype and torch.equal(other, tensor), name
    keys = got.to("cpu", torch.float32).keys
    assert keys.dtype == torch.float32 and torch.allclose(keys, kv.to("cpu", torch.float32).keys)


# A writer of a ~46 MB entry in 4 MiB parts, on a slow network (1 MiB per send).
KILLED_WRITER = r"""
import socket, sys, time
real_sendall = socket.socket.sendall
def slow_sendall(self, data, *args):
    view = memoryview(data).cast("B")
    for start in range(0, len(view), 1 << 20):
        time.sleep(0.005)
        real_sendall(self, view[start : start + (1 << 20)], *args)
socket.socket.sendall = slow_sendall
import torch
from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.store import RedisKVStore
url, prefix, fp = sys.argv[1:4]
gen, shape = torch.Generator().manual_seed(0), (24, 2, 1870, 64)
keys, values = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
kv = ChunkKV(torch.arange(1870), keys, values, fp)
print(kv.key, flush=True)
RedisKVStore(url, prefix=prefix, max_value_bytes=4 << 20, socket_timeout=60).put(kv)
"""


def test_a_writer_killed_mid_transaction_leaves_no_key(
    server: RedisServer, store: RedisKVStore
) -> None:
    """SIGKILL while the server holds part of the write's MULTI: the connection
    closes, the server drops the queued commands, and no part or manifest remains."""
    writer = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, server.url, store.prefix, FP],
        stdout=subprocess.PIPE,
        text=True,
    )
    key = writer.stdout.readline().strip()

    def queued() -> int:  # commands the server holds in some client's open MULTI
        return max(int(c.get("multi", -1)) for c in store.client.client_list())

    deadline = time.monotonic() + 120  # a guard against a hang, not a timing check
    while queued() < 2 and writer.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert writer.poll() is None and queued() >= 2  # mid-transaction: parts queued, no EXEC
    writer.send_signal(signal.SIGKILL)
    assert writer.wait() == -signal.SIGKILL  # killed, not finished
    while queued() > 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # the server notices the closed connection
    assert raw_keys(store) == set() and store.get(key, FP) is None


# ------------------------------------------------------ a server that is not there
def test_dead_or_silent_redis_does_not_hang() -> None:
    pytest.importorskip("redis", reason="the redis client is missing: pip install -e '.[test]'")
    kv = ChunkKV(torch.arange(4), torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), FP)
    dead = RedisKVStore(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens
    started = time.monotonic()
    assert dead.get(kv.key, FP) is None and not dead.contains(kv.key)
    with pytest.raises(StoreWriteError, match="cannot write"):
        dead.put(kv)
    assert time.monotonic() - started < 5
    assert dead.stats.misses == 1 and dead.stats.rejected == 0  # down is a miss, not damage

    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        mute = RedisKVStore(f"redis://127.0.0.1:{silent.getsockname()[1]}/0")
        started = time.monotonic()
        assert mute.get(kv.key, FP) is None
        with pytest.raises(StoreWriteError):
            mute.put(kv)
        assert time.monotonic() - started < 15  # ~1 s timeout, one retry, per call


def test_a_private_entry_expires_and_a_shared_one_stays(store: RedisKVStore) -> None:
    """Issue 59 hole 11: one request's own (private) entries had no expiry: a server
    killed mid-request left them until eviction under pressure. Redis expires them
    after ``PRIVATE_TTL_S`` (every part with its manifest); other entries keep the
    store's TTL (none here)."""
    from kvrag_integrations.store.namespaces import PRIVATE_TTL_S
    from kvrag_integrations.vllm.trust import Tenant

    small = make_kv(1)
    private = Tenant.of_request("anonymous", "nonce").fingerprint(small.fingerprint)
    own = ChunkKV(small.token_ids, small.keys, small.values, private)
    split = RedisKVStore(client=store.client, prefix=store.prefix, max_value_bytes=1024)
    split.put(own)
    store.put(make_kv(2))
    ttl = store.ttl(own.key)
    assert ttl is not None and PRIVATE_TTL_S - 60 < ttl <= PRIVATE_TTL_S
    parts = [k for k in raw_keys(store) if ":part:" in k]
    assert parts and all(0 < store.client.pttl(k) <= PRIVATE_TTL_S * 1000 for k in parts)
    assert store.ttl(make_kv(2).key) is None


def test_a_redis_that_evicts_by_itself_is_refused_at_start(store: RedisKVStore) -> None:
    """Issue 59 hole 14: the examples recommended ``allkeys-lru`` where the cluster
    docs said ``noeviction``; under LRU Redis evicts entries, their parts and the
    index log past every quota. A server's store must be ``noeviction`` (the
    budget evicts): the connector and ``serve`` refuse anything else, naming it."""
    from kvrag_integrations.errors import StoreURLError
    from kvrag_integrations.store.redis_client import check_eviction_policy

    check_eviction_policy(store.client)  # Redis's default: noeviction
    store.client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        with pytest.raises(StoreURLError, match="allkeys-lru"):
            check_eviction_policy(store.client)
    finally:
        store.client.config_set("maxmemory-policy", "noeviction")
