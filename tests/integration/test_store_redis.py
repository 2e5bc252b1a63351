"""RedisKVStore against a real redis-server started on loopback for this module."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvrag_integrations import KVRAGEngine, RedisKVStore, TieredKVStore
from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.errors import StoreWriteError
from kvrag_integrations.store.codec import encode_entry
from kvrag_integrations.store.redis import _MANIFEST_MAGIC

redis = pytest.importorskip("redis", reason="the redis client is missing: pip install -e '.[test]'")

FP = "fp-test"
CHUNK = "The Hubble Space Telescope was launched in April 1990 aboard the shuttle Discovery."
QUESTION = "When was the Hubble Space Telescope launched?"


def find_redis_server() -> str | None:
    candidates = [shutil.which("redis-server"), "/usr/bin/redis-server", "/usr/sbin/redis-server"]
    return next((p for p in candidates if p and os.access(p, os.X_OK)), None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A throwaway redis-server: no persistence, loopback only, stoppable and restartable."""

    def __init__(self, binary: str, workdir: Path, port: int | None = None) -> None:
        self.binary, self.workdir, self.port = binary, workdir, port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir)]
        args += ["--save", "", "--appendonly", "no"]  # nothing survives a kill: a real loss
        with open(self.workdir / "redis.log", "ab") as log:
            self.proc = subprocess.Popen([self.binary, *args], stdout=log, stderr=log)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        deadline = time.monotonic() + 20
        while self.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                if client.ping():
                    client.close()
                    return self
            time.sleep(0.05)
        self.stop()
        log_text = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"redis-server did not come up on {self.port}:\n{log_text}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # a crash, as far as clients can tell
            self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if (binary := find_redis_server()) is None:
        pytest.skip("redis-server not found (apt-get install redis-server; .ci/run installs it)")
    srv = RedisServer(binary, tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


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


def raw_keys(store: RedisKVStore) -> set[str]:
    """Every Redis key under the store's prefix, parts included."""
    return {k.decode() for k in store.client.scan_iter() if k.decode().startswith(store.prefix)}


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


def _flip(data: bytes) -> bytes:
    return data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:]


DAMAGE = {
    "truncated": lambda data, kv: data[: len(data) // 2],
    "bit-flip": lambda data, kv: _flip(data),
    "foreign-fingerprint": lambda data, kv: encode_entry(
        ChunkKV(kv.token_ids, kv.keys, kv.values, "another-model")
    ),
}


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
        store.client.set(last, _flip(store.client.get(last)))
    else:
        store.client.set(prefix + bad.key, _flip(store.client.get(prefix + bad.key)))
    infos = {info.key: info for info in store.entries()}
    assert set(infos) == {good.key, foreign.key, bad.key}
    assert infos[good.key].nbytes == len(encode_entry(good))  # the whole blob, even when split
    assert infos[foreign.key].fingerprint == "another-model"
    assert infos[bad.key].fingerprint == FP  # the header is intact; only check() decodes
    assert all(abs(info.updated_at - time.time()) < 60 for info in infos.values())
    assert store.check(good.key) is None and store.check(foreign.key) is None
    assert "checksum" in store.check(bad.key)


# ------------------------------------------------------------------ with the engine
@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_engine_recomputes_a_damaged_entry(engine: KVRAGEngine, store: RedisKVStore, damage):
    eng = KVRAGEngine(engine.loaded, store=store, on_miss="encode")  # recompute on the request
    (ref,) = eng.encode_chunks([CHUNK], show_progress=False)
    rkey = store.prefix + ref.key
    good = eng.store.get(ref.key, eng.fingerprint)
    store.client.set(rkey, damage(store.client.get(rkey), good))

    result = eng.generate(question=QUESTION, chunks=[CHUNK], max_new_tokens=4)
    assert result.generated_tokens > 0 and result.lazily_encoded_chunks == 1
    assert store.stats.rejected == 1
    again = eng.generate(question=QUESTION, chunks=[CHUNK], max_new_tokens=4)
    assert again.lazily_encoded_chunks == 0 and again.text == result.text  # rewritten, reused


def test_server_killed_mid_run_then_back(
    engine: KVRAGEngine, server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    own = RedisServer(server.binary, tmp_path / "redis").start()  # ours to kill
    try:
        store = RedisKVStore(own.url)
        eng = KVRAGEngine(engine.loaded, store=store, on_miss="encode")
        eng.encode_chunks([CHUNK], show_progress=False)
        baseline = eng.generate(question=QUESTION, chunks=[CHUNK], max_new_tokens=4)
        assert baseline.lazily_encoded_chunks == 0

        own.stop()
        started = time.monotonic()
        down = eng.generate(question=QUESTION, chunks=[CHUNK], max_new_tokens=4)
        assert down.text == baseline.text and down.lazily_encoded_chunks == 1  # recomputed
        assert "answering uncached" in caplog.text and time.monotonic() - started < 30
        with pytest.raises(StoreWriteError):
            eng.encode_chunks(["Ingestion must say the store is down."], show_progress=False)

        own.start()  # same port, empty (no persistence); same store object
        kv = make_kv()
        store.put(kv)
        assert store.get(kv.key, FP) is not None
        first = eng.generate(question=QUESTION, chunks=[CHUNK], max_new_tokens=4)
        second = eng.generate(question=QUESTION, chunks=[CHUNK], max_new_tokens=4)
        assert first.lazily_encoded_chunks == 1 and second.lazily_encoded_chunks == 0
        assert second.text == baseline.text
    finally:
        own.stop()


@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
def test_concurrent_ingestion_writes_one_valid_entry(
    engine: KVRAGEngine, server: RedisServer, prefix: str, split: bool
) -> None:
    store = RedisKVStore(server.url, prefix=prefix, max_value_bytes=64 * 1024 if split else 2**26)
    eng = KVRAGEngine(engine.loaded, store=store)
    barrier = threading.Barrier(8)

    def ingest() -> str:
        barrier.wait()
        return eng.encode_chunks([CHUNK], show_progress=False)[0].key

    with ThreadPoolExecutor(max_workers=8) as pool:
        keys = {f.result() for f in [pool.submit(ingest) for _ in range(8)]}
    (key,) = keys
    assert list(store.keys()) == [key]
    got = store.get(key, eng.fingerprint)
    assert got is not None and got.key == key
    # Besides the entry (and its parts), at most parts of overwritten copies, expiring.
    current = {prefix + key} | set(store._old_parts(store.client, prefix + key))
    assert split == (len(current) > 1)
    assert all(store.client.pttl(k) > 0 for k in raw_keys(store) - current)


def test_tiered_over_redis_promotes_shared_entries(engine: KVRAGEngine, store: RedisKVStore):
    writer = KVRAGEngine(engine.loaded, store=store)  # another worker, same Redis
    writer.encode_chunks([CHUNK], show_progress=False)
    tiered = TieredKVStore(store, max_bytes=64 * 2**20)
    reader = KVRAGEngine(engine.loaded, store=tiered)
    for _ in range(2):
        result = reader.generate(question=QUESTION, chunks=[CHUNK], max_new_tokens=2)
        assert result.lazily_encoded_chunks == 0
    assert tiered.tier_stats["backend"]["hits"] == 1 and tiered.tier_stats["memory"]["hits"] == 1


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
