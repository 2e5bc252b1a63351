"""The one interface every chunk-cache store implements."""

from __future__ import annotations

import contextlib
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

from kvrag_integrations.engine.kv import ChunkKV

logger = logging.getLogger(__name__)


@dataclass
class StoreStats:
    """Counters every store keeps (read them with ``store.stats``)."""

    hits: int = 0
    misses: int = 0
    rejected: int = 0  # entries found but unusable: corrupt, truncated, foreign
    writes: int = 0
    evictions: int = 0


class KVStore(ABC):
    """Where ``ChunkKV`` entries live, addressed by ``cache_key``.

    ``get`` returns ``None`` for a miss *and* for any entry that must not be used
    (corrupt, truncated, made by another model fingerprint, stored under another
    key): such entries are logged, counted in ``stats.rejected`` and dropped so the
    caller recomputes and overwrites them. Stores never pickle.

    Subclasses implement ``_get``, ``_put``, ``_delete`` and ``keys``.
    """

    def __init__(self) -> None:
        self.stats = StoreStats()
        self._stats_lock = threading.Lock()

    def get(self, key: str, fingerprint: str) -> ChunkKV | None:
        """Return the entry under ``key`` if it is intact and made by ``fingerprint``."""
        try:
            kv = self._get(key)
        except Exception as exc:
            self._count("rejected")
            logger.warning("cache entry %s unusable (%s); it will be recomputed", key[:16], exc)
            self._safe_delete(key)
            return None
        if kv is None:
            self._count("misses")
            return None
        if kv.fingerprint != fingerprint or kv.key != key:
            self._count("rejected")
            logger.warning("cache entry %s belongs to another model or key; ignored", key[:16])
            self._safe_delete(key)
            return None
        self._count("hits")
        return kv

    def put(self, kv: ChunkKV) -> str:
        """Store ``kv`` under ``kv.key`` (overwriting) and return the key."""
        key = kv.key
        self._put(key, kv)
        self._count("writes")
        return key

    def contains(self, key: str) -> bool:
        """Whether an entry exists under ``key`` (not verified: ``get`` verifies)."""
        return key in set(self.keys())

    def delete(self, key: str) -> None:
        """Remove the entry under ``key`` if present."""
        self._delete(key)

    def _safe_delete(self, key: str) -> None:
        with contextlib.suppress(Exception):
            self._delete(key)

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    @abstractmethod
    def _get(self, key: str) -> ChunkKV | None:
        """Return the decoded entry, ``None`` if absent; raise if unusable."""

    @abstractmethod
    def _put(self, key: str, kv: ChunkKV) -> None:
        """Write the entry (atomically where the backend allows)."""

    @abstractmethod
    def _delete(self, key: str) -> None:
        """Remove the entry if present."""

    @abstractmethod
    def keys(self) -> Iterator[str]:
        """Iterate over the stored keys."""

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())
