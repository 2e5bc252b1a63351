"""Whether a prompt's chunk caches can stay in the store: fallbacks are never silent.

A chunk that misses although this engine stored it was evicted (or lost), and
a prompt whose chunk caches add up to more than a bounded memory store holds
can never be fully reused: each request evicts what the previous one encoded.
``Residency`` remembers which keys this engine wrote, so a miss says whether it
is new or evicted (``Miss.evicted``, and the request's ``fallback``), and warns
once per engine when a prompt's chunk caches exceed the store's capacity.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from kvrag_integrations.store import KVStore, MemoryKVStore

logger = logging.getLogger(__name__)


def store_capacity(store: KVStore) -> int | None:
    """The most bytes ``store`` keeps before evicting (None: no bound it enforces
    by evicting entries a request still needs: disk, Redis, a tiered store's
    backend keeps them)."""
    if isinstance(store, MemoryKVStore):
        return store.max_bytes
    return None


class Residency:
    """Keys this engine stored (the most recent ``max_keys``), and the one warning.

    Thread-safe.
    """

    def __init__(self, max_keys: int = 1 << 16) -> None:
        self.max_keys = max_keys
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self.warned = False

    def stored(self, key: str) -> None:
        """``key`` was written to the chunk store."""
        with self._lock:
            self._keys[key] = None
            self._keys.move_to_end(key)
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)

    def was_stored(self, key: str) -> bool:
        with self._lock:
            return key in self._keys

    def check(self, store: KVStore, nbytes: int, chunks: int) -> str | None:
        """A reason if ``chunks`` caches of ``nbytes`` in all cannot all stay in
        ``store`` (logged as a warning the first time per engine), else None."""
        capacity = store_capacity(store)
        if capacity is None or nbytes <= capacity:
            return None
        reason = (
            f"the prompt's {chunks} chunk caches need {nbytes / 2**20:.2f} MiB but the store "
            f"keeps {capacity / 2**20:.2f} MiB (max_bytes): they cannot all stay cached, "
            "so requests on them keep missing"
        )
        with self._lock:
            first, self.warned = not self.warned, True
        if first:
            logger.warning(
                "%s; raise the store's max_bytes, use a disk or Redis store, or store "
                "chunk caches at a lower cache_precision (this warning is logged once "
                "per engine)",
                reason,
            )
        return reason
