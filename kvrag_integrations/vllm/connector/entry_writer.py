"""A worker's writes to the store: each entry within its namespace's quota, announced.

An entry a worker saves is stored in the configured precision where the
store's budget and its namespace's quota hold it (``StoreBudget``: least
recently used entries are evicted first; a write they cannot hold is skipped,
logged and counted), then announced in the content index's log, where the
OpenAI server's detection (``detection``) finds it (a private entry is not:
found by no one). A failed write is logged; the entry is then a miss for later
requests. A deferred save (a prompt the server learns) is stored by a writer
thread, best effort: at most ``MAX_DEFERRED`` wait, the cache's memory is not.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.errors import StoreWriteError
from kvrag_integrations.store import KVStore
from kvrag_integrations.store.write_budget import StoreBudget

logger = logging.getLogger(__name__)

MAX_DEFERRED = 4  # deferred saves copied out of the cache, waiting for the writer


class EntryWriter:
    """Stores a worker's entries (see the module docstring).

    Args:
        entries: the store.
        precision: how entries are stored.
        budget: the store's budget (None: unbounded).
        index_log: the content index's log (``matching.IndexLog``; None: not
            indexed, as on tensor-parallel ranks but the first).
    """

    def __init__(
        self,
        entries: KVStore,
        precision: str,
        budget: StoreBudget | None = None,
        index_log: Any = None,
    ) -> None:
        self.entries = entries
        self.precision = precision
        self.budget = budget
        self.index_log = index_log
        self._lock = threading.Lock()
        self._writer: ThreadPoolExecutor | None = None  # stores deferred saves
        self._waiting = 0

    def later(self, request_id: str, kv: ChunkKV, indexed: bool = True) -> int:
        """Store ``kv`` on the writer thread (at most ``MAX_DEFERRED`` waiting: a deferred save is
        best effort, the cache's memory is not)."""
        with self._lock:
            if self._waiting >= MAX_DEFERRED:
                logger.info("request %s: deferred entry dropped (writer busy)", request_id)
                return 0
            self._waiting += 1
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvrag-store-writer")
        self._writer.submit(self._store_later, request_id, kv, indexed)
        return 1

    def _store_later(self, request_id: str, kv: ChunkKV, indexed: bool) -> None:
        try:
            self.store(request_id, kv, indexed)
        except Exception:
            logger.exception("request %s: entry not stored", request_id)
        finally:
            with self._lock:
                self._waiting -= 1

    def store(self, request_id: str, kv: ChunkKV, indexed: bool = True) -> int:
        """Store ``kv`` now, where its namespace's quota holds it (1: stored)."""
        try:
            kv = kv.stored_as(self.precision)
            with self._lock:  # the budget's accounting: one writer at a time
                allowed = self.budget is None or self.budget.allow_write(
                    _entry_bytes(kv), kv.fingerprint, kv.key
                )
                if not allowed:  # (counted too: ``stats.budget_counts``)
                    logger.info("request %s: entry refused: no room within its quota", request_id)
                    return 0
                self.entries.put(kv)
        except StoreWriteError as exc:
            logger.warning("request %s: entry not stored (%s)", request_id, exc)
            return 0
        if self.index_log is not None and indexed:  # (a private entry: found by no one)
            self._announce(kv)
        return 1

    def _announce(self, kv: ChunkKV) -> None:
        try:
            self.index_log.append(kv.fingerprint, kv.token_ids.tolist())
        except Exception as exc:  # stored all the same; only detection misses it
            logger.warning("entry not indexed (%s)", exc)

    def drain(self) -> None:
        """Wait for the deferred saves handed over so far (tests, shutdown)."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None


def _entry_bytes(kv: ChunkKV) -> int:
    """About what an entry takes in the store: its tensors and a header."""
    return kv.nbytes + 4096
