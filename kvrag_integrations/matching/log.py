"""The content index's log on the store: what every log does, and the one in memory.

Every entry a server indexes is appended as one record ``(namespace, ids)``
(``records``) to a log next to the store's entries: a file for a disk store, a
Redis list for a Redis store (``store_logs``). Each replica replays the log at
start and then reads what others appended (``synced.SyncedIndex``), so the
index survives a restart and is shared by every server on one store. Writers
only append; a reader keeps its position (a byte offset, a list index) and asks
only for what is new.

The one rewrite is ``compact``: the store's budget (``store.maintenance``)
calls it after evicting entries, and it keeps only the records whose entries
are still stored (the first of each), so the log costs what is live and a
replay at start reads what is live, not all history. A reader that finds the
log rewritten reads it anew and bumps its ``generation``: ``SyncedIndex`` then
rebuilds its index from the live records alone.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Callable, Sequence

import numpy as np

from kvrag_integrations.matching.records import encode_record, parse_records

logger = logging.getLogger(__name__)

Live = Callable[[str, np.ndarray], bool]
"""Whether the entry of a record ``(namespace, ids)`` is still stored."""


class IndexLog(abc.ABC):
    """A log of ``(namespace, ids)`` records shared through a store: appended by
    writers, rewritten only by ``compact``.

    Attributes:
        generation: how many times this reader found the log rewritten (or
            dropped) and read it anew from its start; records read since then
            are the whole live log.
    """

    generation: int = 0

    @abc.abstractmethod
    def append(self, namespace: str, ids: Sequence[int] | np.ndarray) -> None:
        """Append one record (visible to every reader, this one included)."""

    @abc.abstractmethod
    def read_new(self) -> list[tuple[str, np.ndarray]]:
        """Every record appended (by anyone) since this reader's last call; the
        first call, and the first after a rewrite (``generation`` then grows),
        returns them all. Cheap when nothing was appended."""

    @abc.abstractmethod
    def compact(self, live: Live) -> tuple[int, int]:
        """Rewrite the log with the records ``live`` keeps (the first of each
        ``(namespace, ids)``), in order, losing none appended meanwhile by any
        process; ``(kept, dropped)``. Never under way twice at once."""

    def nbytes(self) -> int:
        """Bytes the log takes in its store (what the store's budget counts)."""
        return 0

    def close(self) -> None:  # noqa: B027 - a log may hold nothing to close
        """Release what the log holds open."""


def keep_live(records: list[bytes], live: Live) -> list[bytes]:
    """The records (one encoded record each) to keep: whole, first of their kind,
    and ``live``; what does not parse goes too."""
    kept, seen = [], set()
    for data in records:
        parsed, used, _ = parse_records(bytes(data))
        if len(parsed) != 1 or used != len(data) or bytes(data) in seen:
            continue
        if live(*parsed[0]):
            seen.add(bytes(data))
            kept.append(data)
    return kept


class MemoryIndexLog(IndexLog):
    """A log in this process's memory (tests, one process); ``reader()`` gives
    another reader of the same records, as a second replica would have."""

    def __init__(self) -> None:
        self._records: list[bytes] = []
        self._rewrites = [0]  # shared with readers: how often it was compacted
        self._lock = threading.Lock()
        self._next = 0
        self._seen = 0

    def reader(self) -> MemoryIndexLog:
        """A log sharing these records, with its own position (at the start)."""
        other = MemoryIndexLog()
        other._records, other._lock, other._rewrites = self._records, self._lock, self._rewrites
        other._seen = self._rewrites[0]
        return other

    def append(self, namespace: str, ids: Sequence[int] | np.ndarray) -> None:
        data = encode_record(namespace, ids)
        with self._lock:
            self._records.append(data)

    def read_new(self) -> list[tuple[str, np.ndarray]]:
        with self._lock:
            if self._seen != self._rewrites[0]:
                self._seen, self._next = self._rewrites[0], 0
                self.generation += 1
            new, self._next = self._records[self._next :], len(self._records)
        return parse_items(new)

    def compact(self, live: Live) -> tuple[int, int]:
        with self._lock:
            kept = keep_live(self._records, live)
            dropped = len(self._records) - len(kept)
            if dropped:
                self._records[:] = kept
                self._rewrites[0] += 1
        return len(kept), dropped

    def nbytes(self) -> int:
        with self._lock:
            return sum(len(r) for r in self._records)


def parse_items(items: Sequence[bytes]) -> list[tuple[str, np.ndarray]]:
    """Records stored one per item: an item that is not one whole record is skipped."""
    out = []
    for item in items:
        records, used, _ = parse_records(bytes(item))
        if len(records) == 1 and used == len(item):
            out += records
        else:
            logger.warning("index log: skipped a damaged record of %d bytes", len(item))
    return out
