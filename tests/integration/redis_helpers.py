"""A throwaway redis-server for the integration tier, and what tests do to its values.

Used through the fixtures in tests/integration/conftest.py (``redis_server``,
``redis_prefix``, ``redis_store``); tests that kill a server start their own
``RedisServer``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from kvrag_integrations import RedisKVStore
from kvrag_integrations.bench.ports import free_port
from kvrag_integrations.bench.redis_cluster import answers_ping
from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.store.codec import encode_entry


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
        if answers_ping(self.port, self.proc):
            return self
        self.stop()
        log_text = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"redis-server did not come up on {self.port}:\n{log_text}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # a crash, as far as clients can tell
            self.proc.wait(timeout=10)
        self.proc = None


def raw_keys(store: RedisKVStore) -> set[str]:
    """Every Redis key under the store's prefix, parts included."""
    return {k.decode() for k in store.client.scan_iter() if k.decode().startswith(store.prefix)}


def flip(data: bytes) -> bytes:
    """One byte near the end inverted (payload damage, header intact)."""
    return data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:]


# Ways to damage a stored value: (bytes, the entry) -> new bytes.
DAMAGE = {
    "truncated": lambda data, kv: data[: len(data) // 2],
    "bit-flip": lambda data, kv: flip(data),
    "foreign-fingerprint": lambda data, kv: encode_entry(
        ChunkKV(kv.token_ids, kv.keys, kv.values, "another-model")
    ),
}
