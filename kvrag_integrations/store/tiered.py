"""Two tiers: a bounded in-memory LRU in front of a shared disk or Redis store."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict
from typing import Literal

import torch

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.store.base import EntryInfo, KVStore, TempFileInfo
from kvrag_integrations.store.budget import memory_budget
from kvrag_integrations.store.memory import MemoryKVStore


class TieredKVStore(KVStore):
    """A ``MemoryKVStore`` (the fast tier) in front of ``backend`` (the shared tier).

    Reads go through: a memory hit is served at once; a memory miss asks the
    backend, which verifies the entry as usual, and a backend hit is promoted into
    memory. Writes go through: the backend first (a failing write raises
    ``StoreWriteError`` and leaves memory untouched, so a retry writes again), then
    memory. With ``device`` (e.g. ``"cuda"``), memory keeps entries there, so hot
    chunks skip the host-to-device copy; ``max_bytes`` then bounds device memory.
    Entries the memory tier keeps on the host are pinned (page-locked) when CUDA
    is present, so a CUDA engine copies them to the device asynchronously.

    ``stats`` counts the store as a whole (a hit in either tier is a hit);
    ``tier_stats`` has each tier's own counters: ``"memory"`` (hits, misses,
    rejected, writes, evictions of the LRU, plus ``promotions``) and
    ``"backend"`` (the backend store's ``stats``, including calls made to it
    directly).

    Args:
        backend: the store behind the cache, e.g. ``DiskKVStore`` or ``RedisKVStore``.
        max_bytes: the memory tier's budget in bytes (``None``: unbounded;
            ``"auto"``, the default: ``budget.memory_budget`` of ``device``, a
            share of the memory free there when the store is made).
        device: where the memory tier keeps tensors (``None``: as they come).
        pin_memory: pin entries kept on the host (``None``: when CUDA is
            available; never without it).

    Examples:
        >>> import tempfile, torch
        >>> from kvrag_integrations.chunk_kv import ChunkKV
        >>> from kvrag_integrations.store import DiskKVStore
        >>> kv = ChunkKV(torch.arange(3), torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), "fp")
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     disk = DiskKVStore(tmp)
        ...     key = disk.put(kv)  # e.g. written by another worker
        ...     store = TieredKVStore(disk, max_bytes=1 << 20)
        ...     _ = store.get(key, "fp")  # backend hit, promoted
        ...     _ = store.get(key, "fp")  # memory hit
        ...     store.tier_stats["memory"]["hits"], store.tier_stats["backend"]["hits"]
        (1, 1)
    """

    @property
    def parallel_reads(self) -> bool:  # type: ignore[override]
        """A memory miss waits on the backend."""
        return self.backend.parallel_reads

    def __init__(
        self,
        backend: KVStore,
        max_bytes: int | Literal["auto"] | None = "auto",
        device: str | torch.device | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(backend, KVStore):
            raise TypeError(f"backend must be a KVStore, got {type(backend).__name__}")
        self.backend = backend
        self.device = torch.device(device) if device is not None else None
        if max_bytes == "auto":
            max_bytes = memory_budget(self.device)
        self.memory = MemoryKVStore(max_bytes=max_bytes)
        # Pinning needs CUDA; without it nothing changes.
        self.pin_memory = pin_memory is not False and torch.cuda.is_available()
        self._promotions = 0

    @property
    def tier_stats(self) -> dict[str, dict[str, int]]:
        """Each tier's counters (a snapshot)."""
        memory = asdict(self.memory.stats) | {"promotions": self._promotions}
        return {"memory": memory, "backend": asdict(self.backend.stats)}

    def _local(self, kv: ChunkKV) -> ChunkKV:
        kv = kv if self.device is None else kv.to(self.device)
        # Pinned once when kept, not per request: an entry read from the backend
        # is pageable memory, which a CUDA copy must stage synchronously.
        return kv.pin_memory() if self.pin_memory else kv

    def get(self, key: str, fingerprint: str) -> ChunkKV | None:
        """The entry from memory, else from the backend (then promoted); else ``None``."""
        kv = self.memory.get(key, fingerprint)
        if kv is None:
            kv = self.backend.get(key, fingerprint)  # verifies: a bad entry is a miss here
            if kv is not None:
                kv = self._local(kv)
                self.memory.put(kv)
                with self._stats_lock:
                    self._promotions += 1
        self._count("hits" if kv is not None else "misses")
        return kv

    def put(self, kv: ChunkKV) -> str:
        """Write ``kv`` to the backend, then to memory; returns its key."""
        key = self.backend.put(kv)
        self.memory.put(self._local(kv))
        self._count("writes")
        return key

    def contains(self, key: str) -> bool:
        """Whether either tier holds ``key`` (not verified: ``get`` verifies)."""
        return self.memory.contains(key) or self.backend.contains(key)

    def delete(self, key: str) -> None:
        """Remove ``key`` from both tiers."""
        self.memory.delete(key)
        self.backend.delete(key)

    def touch(self, key: str) -> None:
        """A memory-tier hit is a use of the shared entry too: pruning sees it."""
        self.backend.touch(key)

    # The base class's hooks, for completeness; get/put/delete above use the tiers'
    # public methods so that each tier verifies and counts for itself.
    def _get(self, key: str) -> ChunkKV | None:
        kv = self.memory._get(key)
        return kv if kv is not None else self.backend._get(key)

    def _put(self, key: str, kv: ChunkKV) -> None:
        self.put(kv)

    def _delete(self, key: str) -> None:
        self.delete(key)

    def keys(self) -> Iterator[str]:
        """Keys in either tier, each once (memory's first)."""
        return iter(dict.fromkeys([*self.memory.keys(), *self.backend.keys()]))

    def entries(self) -> Iterator[EntryInfo]:
        """The backend's entries, then those held only in memory."""
        seen: set[str] = set()
        for info in self.backend.entries():
            seen.add(info.key)
            yield info
        for info in self.memory.entries():
            if info.key not in seen:
                yield info

    def temp_files(self) -> list[TempFileInfo]:
        """The backend's partial writes (memory has none)."""
        return self.backend.temp_files()

    def reclaim_temp_files(self) -> tuple[int, int]:
        """The backend's reclaim (memory has nothing to reclaim)."""
        return self.backend.reclaim_temp_files()

    def check(self, key: str) -> str | None:
        """The backend's verdict on ``key`` (memory's for an entry only in memory)."""
        if self.backend.contains(key):
            return self.backend.check(key)
        return self.memory.check(key)

    def clear_memory(self) -> None:
        """Drop the memory tier (the backend keeps everything)."""
        for key in list(self.memory.keys()):
            self.memory.delete(key)


__all__ = ["TieredKVStore"]
