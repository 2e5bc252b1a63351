"""The one interface every chunk-cache store implements."""

from __future__ import annotations

import contextlib
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

from kvrag_integrations.chunk_kv import ChunkKV

logger = logging.getLogger(__name__)


@dataclass
class StoreStats:
    """Counters every store keeps (read them with ``store.stats``)."""

    hits: int = 0
    misses: int = 0
    rejected: int = 0  # entries found but unusable: corrupt, truncated, foreign
    writes: int = 0
    evictions: int = 0
    # partial writes of dead writers this store removed (disk: temp files)
    temp_files_reclaimed: int = 0
    temp_bytes_reclaimed: int = 0


@dataclass(frozen=True)
class EntryInfo:
    """What a store can tell about one entry without using it (see ``KVStore.entries``).

    Attributes:
        key: the entry's cache key.
        nbytes: its stored size in bytes (memory: the tensors' bytes).
        updated_at: unix time of its last write (Redis: of its last access), or
            ``None`` when the backend cannot tell.
        fingerprint: the model fingerprint recorded in it, or ``None`` when its
            header is unreadable (``check`` says why).
    """

    key: str
    nbytes: int
    updated_at: float | None
    fingerprint: str | None


@dataclass(frozen=True)
class TempFileInfo:
    """A partial write a store can see (disk: a temp file) whose writer may be alive.

    Partial writes of writers known to be dead are never listed: listing removes
    them (see ``KVStore.temp_files``).

    Attributes:
        name: where it is, relative to the store (disk: ``"ab/.tmp-...part"``).
        nbytes: its size in bytes so far.
        updated_at: unix time of its last write.
        writer: who writes it (``"host pid N"``), or ``None`` when unknown (a
            temp file of an older version).
        alive: ``True`` when its writer provably lives (it holds the file's
            lock); ``None`` when this host cannot tell (a writer on another host,
            or an unknown one): it is removed once idle for the store's grace period.
    """

    name: str
    nbytes: int
    updated_at: float | None
    writer: str | None
    alive: bool | None


class KVStore(ABC):
    """Where ``ChunkKV`` entries live, addressed by ``cache_key``.

    ``get`` returns ``None`` for a miss *and* for any entry that must not be used
    (corrupt, truncated, made by another model fingerprint, stored under another
    key): such entries are logged, counted in ``stats.rejected`` and dropped so the
    caller recomputes and overwrites them. Stores never pickle.

    Subclasses implement ``_get``, ``_put``, ``_delete`` and ``keys``; they may
    override ``entries`` with a cheaper listing (the default decodes every entry).
    """

    # Whether a ``get`` waits on I/O (disk, network): the engine then reads a
    # prompt's entries on several threads, and ahead of time when prefetching.
    parallel_reads: bool = False

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

    def touch(self, key: str) -> None:
        """Note that the entry under ``key`` was just used (what least-recently-used
        pruning orders by: ``EntryInfo.updated_at``); stores that track use
        themselves, or cannot, do nothing."""
        return None

    def temp_files(self) -> list[TempFileInfo]:
        """Partial writes of writers that may be alive (disk: temp files in flight).

        Listing first removes those of dead writers (``reclaim_temp_files`` reports
        them). Most stores have none: their writes are atomic on the server.
        """
        return []

    def reclaim_temp_files(self) -> tuple[int, int]:
        """Remove the partial writes of dead writers; return ``(files, bytes)`` removed
        since the last call, by this call or by listings meanwhile."""
        return 0, 0

    def check(self, key: str) -> str | None:
        """Decode the entry under ``key`` and say why it is unusable, if it is.

        Any fingerprint is fine here (``get`` is the place that checks the model).
        ``stats`` are not touched and nothing is deleted.

        Returns:
            ``None`` for an intact (or absent) entry, else the reason, e.g.
            ``"entry checksum mismatch: ..."``.
        """
        try:
            kv = self._get(key)
        except Exception as exc:
            return str(exc) or type(exc).__name__
        if kv is not None and kv.key != key:
            return "entry is stored under another key"
        return None

    def entries(self) -> Iterator[EntryInfo]:
        """Describe every stored entry (size, last write, fingerprint).

        This default decodes each entry; backends override it with a read of the
        metadata only. An entry that cannot be decoded is listed with
        ``fingerprint=None``.
        """
        for key in list(self.keys()):
            try:
                kv = self._get(key)
            except Exception:
                yield EntryInfo(key, 0, None, None)
                continue
            if kv is not None:
                yield EntryInfo(key, kv.nbytes, None, kv.fingerprint)

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
