"""``SyncedIndex``: a ``ContentIndex`` kept in step with the store's ``IndexLog``."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvrag_integrations.matching.index import ContentIndex
from kvrag_integrations.matching.log import IndexLog, MemoryIndexLog  # noqa: F401 - doctest
from kvrag_integrations.matching.records import RecordError
from kvrag_integrations.matching.runs import Run

logger = logging.getLogger(__name__)

RETRY_S = 5.0  # seconds ``SyncedIndex.cover`` leaves a failing log alone
DEFAULT_MAX_BYTES = 1 << 30  # the index's live entries: ~100M tokens of entries


class SyncedIndex:
    """A ``ContentIndex`` kept in step with an ``IndexLog`` (thread-safe).

    ``add`` appends to the log, then applies every new record in log order, so
    replicas add entries in the same order (ties in ``cover`` break the same
    way everywhere); ``cover`` first applies what others appended, at most every
    ``refresh_s`` seconds. A log that fails (Redis down) is logged and the index
    serves what it has. ``remove`` is local: an entry found evicted from the
    store. A log found rewritten (``IndexLog.compact``, after the store's budget
    evicted entries) is replayed into an emptied index: the index then holds
    the live entries only, as a fresh replica's does.

    Args:
        log: where records are appended and read.
        index: the index to fill (default: a new ``ContentIndex``).
        refresh_s: the least time between two reads of the log by ``cover``.
        max_bytes: the index's live entries may take about this many bytes
            (``ContentIndex.live_nbytes``; removed entries do not count, and their
            rows go once they outweigh the live ones): beyond, new records are
            ignored (one warning), so a client cannot exhaust the server's memory.
            The store's budget bounds what is live far below the default (an
            entry's index rows are a few bytes per token, its K/V kilobytes).

    Examples:
        >>> log = MemoryIndexLog()
        >>> a, b = SyncedIndex(log), SyncedIndex(log.reader(), refresh_s=0)
        >>> a.add("m", list(range(100, 140)))
        True
        >>> [(r.start, r.length) for r in b.cover("m", list(range(100, 120)))]
        [(0, 20)]
    """

    def __init__(
        self,
        log: IndexLog,
        index: ContentIndex | None = None,
        *,
        refresh_s: float = 0.2,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.log = log
        self.index = index if index is not None else ContentIndex()
        self.refresh_s, self.max_bytes = refresh_s, max_bytes
        self._lock = threading.RLock()
        self._refreshed = float("-inf")
        self._warned_full = False
        self._failing = False

    def refresh(self) -> int:
        """Apply the records appended since the last read; how many entries were new."""
        with self._lock:
            self._refreshed = time.monotonic()
            generation = self.log.generation
            try:
                records = self.log.read_new()
            except Exception as exc:  # a log that fails must not fail a request
                if not self._failing:
                    logger.warning("index log unreadable, serving the index as is: %s", exc)
                self._failing = True
                # ``cover`` waits RETRY_S before asking a failing log again: each
                # try may cost a socket timeout.
                self._refreshed += max(0.0, RETRY_S - self.refresh_s)
                return 0
            if self._failing:
                logger.info("index log readable again")
                self._failing = False
            if self.log.generation != generation:  # compacted: what it holds is live
                self.index.clear()
                self._warned_full = False
            return self._apply(records)

    def _apply(self, records: list[tuple[str, np.ndarray]]) -> int:
        # Parsed records always fit the index (ints >= 0 in int32, non-empty).
        index = self.index
        cost = sum(index.cost(len(ids)) for _, ids in records)
        if index.live_nbytes + cost <= self.max_bytes:
            added = index.add_many(records)  # the usual case: one bulk add
            if added > 1000:  # a replay: sort now, not in the next request's cover
                index.flush()
            return added
        added = 0
        for namespace, ids in records:
            if index.live_nbytes + index.cost(len(ids)) <= self.max_bytes:
                added += index.add(namespace, ids)
            elif (namespace, ids) not in index:
                self._full()
        return added

    def _full(self) -> None:
        if not self._warned_full:
            self._warned_full = True
            logger.warning(
                "content index holds %d live entries (about %d bytes, max_bytes=%d): new "
                "records are ignored until entries are evicted from the store",
                len(self.index),
                self.index.live_nbytes,
                self.max_bytes,
            )

    def add(self, namespace: str, ids: Sequence[int] | np.ndarray) -> bool:
        """Index ``ids`` here and on every replica; False if it is known already
        (or the index is full)."""
        with self._lock:
            if not self._failing:  # a failing log is retried by ``cover`` only
                self.refresh()  # another replica may have logged it already
            if (namespace, ids) in self.index:
                return False
            if self.index.live_nbytes + self.index.cost(len(ids)) > self.max_bytes:
                self._full()
                return False
            try:
                self.log.append(namespace, ids)
            except RecordError:  # bad input: the caller's error
                raise
            except Exception as exc:  # the log failed: still serve it here
                logger.warning("index log append failed, indexed locally only: %s", exc)
                return self.index.add(namespace, ids)
            self.refresh()
            if (namespace, ids) not in self.index:  # the log was unreadable meanwhile
                return self.index.add(namespace, ids)
            return True

    def remove(self, namespace: str, ids: Sequence[int] | np.ndarray) -> bool:
        """Forget an entry here only (e.g. found evicted from the store)."""
        with self._lock:
            return self.index.remove(namespace, ids)

    def cover(
        self,
        namespace: str,
        prompt: Sequence[int] | np.ndarray,
        accept: Callable[[tuple[int, ...], int], bool] | None = None,
    ) -> list[Run]:
        """``ContentIndex.cover`` after applying the log's new records (at most
        every ``refresh_s`` seconds)."""
        with self._lock:
            if time.monotonic() - self._refreshed >= self.refresh_s:
                self.refresh()
            return self.index.cover(namespace, prompt, accept)

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, item: object) -> bool:
        with self._lock:
            return item in self.index

    def close(self) -> None:
        self.log.close()
