"""In-process LRU store bounded by the bytes of the tensors it holds."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.store.base import EntryInfo, KVStore

logger = logging.getLogger(__name__)


class MemoryKVStore(KVStore):
    """Keeps ``ChunkKV`` objects as they are (no copy, no serialization), LRU-evicted.

    The size bound is the sum of ``ChunkKV.nbytes``; putting an entry evicts the
    least recently used ones until it fits, and ``get`` refreshes recency. Tensors
    stay on whatever device they were put on, so the bound also limits GPU memory
    if callers store GPU entries. Safe to share between threads.

    Args:
        max_bytes: the byte budget, or ``None`` for no bound.

    Examples:
        >>> import torch
        >>> from kvrag_integrations.chunk_kv import ChunkKV
        >>> kv = ChunkKV(torch.arange(3), torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), "fp")
        >>> store = MemoryKVStore(max_bytes=1 << 20)
        >>> key = store.put(kv)
        >>> store.get(key, "fp") is kv
        True
        >>> store.get(key, "another-model") is None  # foreign entries are misses
        True
    """

    def __init__(self, max_bytes: int | None = 2 * 1024**3) -> None:
        super().__init__()
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        self._max_bytes = max_bytes
        self._entries: OrderedDict[str, ChunkKV] = OrderedDict()  # oldest first
        self._written: dict[str, float] = {}  # key -> unix time of its last put
        self._nbytes = 0
        self._lock = threading.Lock()
        self.records: dict[str, bytes] = {}  # ``store.records``: small named records

    @property
    def max_bytes(self) -> int | None:
        """The byte budget (``None``: unbounded)."""
        return self._max_bytes

    @property
    def nbytes(self) -> int:
        """Bytes currently held (sum of ``ChunkKV.nbytes``)."""
        with self._lock:
            return self._nbytes

    def _get(self, key: str) -> ChunkKV | None:
        with self._lock:
            kv = self._entries.get(key)
            if kv is not None:
                self._entries.move_to_end(key)
            return kv

    def _put(self, key: str, kv: ChunkKV) -> None:
        size = kv.nbytes
        if self._max_bytes is not None and size > self._max_bytes:
            # Evicting everything would still not make room; keep the cache as is.
            logger.warning(
                "cache entry %s (%d bytes) exceeds max_bytes=%d; not stored",
                key[:16],
                size,
                self._max_bytes,
            )
            return
        evicted = 0
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._nbytes -= old.nbytes
            if self._max_bytes is not None:
                while self._entries and self._nbytes + size > self._max_bytes:
                    victim_key, victim = self._entries.popitem(last=False)
                    self._written.pop(victim_key, None)
                    self._nbytes -= victim.nbytes
                    evicted += 1
            self._entries[key] = kv
            self._written[key] = time.time()
            self._nbytes += size
        if evicted:
            self._count("evictions", evicted)

    def _delete(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            self._written.pop(key, None)
            if old is not None:
                self._nbytes -= old.nbytes

    def entries(self) -> Iterator[EntryInfo]:
        """Describe a snapshot of the entries, least recently used first."""
        with self._lock:
            snapshot = [
                EntryInfo(key, kv.nbytes, self._written.get(key), kv.fingerprint)
                for key, kv in self._entries.items()
            ]
        return iter(snapshot)

    def keys(self) -> Iterator[str]:
        """Iterate over a snapshot of the keys, least recently used first."""
        with self._lock:
            snapshot = list(self._entries)
        return iter(snapshot)

    def contains(self, key: str) -> bool:
        """Whether ``key`` is held (does not refresh recency)."""
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
