"""The content index's append-only log on the store, and ``SyncedIndex`` on top of it.

Every entry a server indexes is appended as one record ``(namespace, ids)``
(``records``) to a log next to the store's entries: a file for a disk store, a
Redis list for a Redis store. Each replica replays the log at start and then
reads what others appended, so the index survives a restart and is shared by
every server on one store. Records are only ever appended; a reader keeps its
position (a byte offset, a list index) and asks only for what is new.
"""

from __future__ import annotations

import abc
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvrag_integrations.matching.index import ContentIndex
from kvrag_integrations.matching.records import RecordError, encode_record, parse_records
from kvrag_integrations.matching.runs import Run

logger = logging.getLogger(__name__)

INDEX_DIR = "_index"  # under a disk store's root; the store lists only 2-char shards
LOG_NAME = "records.log"
_READ_BLOCK = 32 << 20  # bytes read from a log file at a time
_REDIS_BATCH = 10_000  # list items fetched per LRANGE
RETRY_S = 5.0  # seconds ``SyncedIndex.cover`` leaves a failing log alone


class IndexLog(abc.ABC):
    """An append-only log of ``(namespace, ids)`` records shared through a store."""

    @abc.abstractmethod
    def append(self, namespace: str, ids: Sequence[int] | np.ndarray) -> None:
        """Append one record (visible to every reader, this one included)."""

    @abc.abstractmethod
    def read_new(self) -> list[tuple[str, np.ndarray]]:
        """Every record appended (by anyone) since this reader's last call; the
        first call returns them all. Cheap when nothing was appended."""

    def close(self) -> None:  # noqa: B027 - a log may hold nothing to close
        """Release what the log holds open."""


class MemoryIndexLog(IndexLog):
    """A log in this process's memory (tests, one process); ``reader()`` gives
    another reader of the same records, as a second replica would have."""

    def __init__(self) -> None:
        self._records: list[bytes] = []
        self._lock = threading.Lock()
        self._next = 0

    def reader(self) -> MemoryIndexLog:
        """A log sharing these records, with its own position (at the start)."""
        other = MemoryIndexLog()
        other._records, other._lock = self._records, self._lock
        return other

    def append(self, namespace: str, ids: Sequence[int] | np.ndarray) -> None:
        data = encode_record(namespace, ids)
        with self._lock:
            self._records.append(data)

    def read_new(self) -> list[tuple[str, np.ndarray]]:
        with self._lock:
            new, self._next = self._records[self._next :], len(self._records)
        return _parse_items(new)


class DiskIndexLog(IndexLog):
    """``root/_index/records.log``: records appended with one ``os.write`` each on
    an ``O_APPEND`` descriptor (whole, never interleaved, between processes on a
    local file system). A reader keeps a byte offset; ``read_new`` is one
    ``os.stat`` when the file has not grown. A torn trailing record is left for
    the next call, a damaged one followed by valid records is skipped (logged).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.path = Path(root) / INDEX_DIR / LOG_NAME
        self._write_fd: int | None = None
        self._read_fd: int | None = None
        self._file_id: tuple[int, int] | None = None  # (device, inode) being read
        self._offset = 0  # bytes consumed
        self._seen = -1  # file size at the last read
        self._lock = threading.Lock()

    def append(self, namespace: str, ids: Sequence[int] | np.ndarray) -> None:
        data = encode_record(namespace, ids)
        with self._lock:
            if self._write_fd is not None and not _same_file(self._write_fd, self.path):
                os.close(self._write_fd)  # the file was removed or replaced: follow it
                self._write_fd = None
            if self._write_fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
                self._write_fd = os.open(self.path, flags, 0o644)
            written = os.write(self._write_fd, data)  # one write: one whole record
        if written != len(data):  # disk full: readers will skip the torn bytes
            raise OSError(f"short write to {self.path}: {written} of {len(data)} bytes")

    def read_new(self) -> list[tuple[str, np.ndarray]]:
        with self._lock:
            try:
                info = os.stat(self.path)
            except FileNotFoundError:
                self._reset(None)
                return []
            if (info.st_dev, info.st_ino) != self._file_id or info.st_size < self._offset:
                self._reset((info.st_dev, info.st_ino))  # replaced or cut: read it anew
            if info.st_size == self._seen:
                return []
            return self._read_to(info.st_size)

    def _reset(self, file_id: tuple[int, int] | None) -> None:
        if self._read_fd is not None:
            os.close(self._read_fd)
        self._read_fd, self._file_id, self._offset, self._seen = None, file_id, 0, -1

    def _read_to(self, size: int) -> list[tuple[str, np.ndarray]]:
        if self._read_fd is None:
            self._read_fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        out: list[tuple[str, np.ndarray]] = []
        buf, pos = b"", self._offset
        while pos < size:
            block = os.pread(self._read_fd, min(_READ_BLOCK, size - pos), pos)
            if not block:
                break
            pos += len(block)
            buf = buf + block if buf else block
            records, used, skipped = parse_records(buf)
            if skipped:
                logger.warning("index log %s: skipped %d damaged bytes", self.path, skipped)
            out += records
            self._offset += used
            buf = buf[used:]
        self._seen = size
        return out

    def close(self) -> None:
        with self._lock:
            for fd in (self._write_fd, self._read_fd):
                if fd is not None:
                    os.close(fd)
            self._write_fd = self._read_fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        info, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (info.st_dev, info.st_ino) == (held.st_dev, held.st_ino)


class RedisIndexLog(IndexLog):
    """The Redis list ``f"{prefix}index"`` (one record per item, RPUSH): the same
    server, db and prefix as the ``RedisKVStore`` it sits beside (its ``keys``
    lists only 64-hex names, so the list is never taken for an entry). A reader
    keeps a list index; ``read_new`` is one LLEN when nothing was appended.

    Args:
        client: a ``redis.Redis`` (``decode_responses=False``), e.g. the store's.
        prefix: the store's key prefix.
        owner: kept alive with the log and closed by ``close`` (the store whose
            client this is, when the log opened it).
    """

    def __init__(self, client: Any, prefix: str = "kvrag:", *, owner: Any = None) -> None:
        self.client, self.key, self._owner = client, f"{prefix}index", owner
        self._next = 0
        self._lock = threading.Lock()

    def append(self, namespace: str, ids: Sequence[int] | np.ndarray) -> None:
        self.client.rpush(self.key, encode_record(namespace, ids))

    def read_new(self) -> list[tuple[str, np.ndarray]]:
        with self._lock:
            length = int(self.client.llen(self.key))
            if length < self._next:  # the list was dropped (flushed server): anew
                self._next = 0
            out: list[tuple[str, np.ndarray]] = []
            while self._next < length:
                stop = min(length, self._next + _REDIS_BATCH) - 1
                items = self.client.lrange(self.key, self._next, stop)
                if not items:
                    break
                out += _parse_items(items)
                self._next += len(items)
            return out

    def close(self) -> None:
        if self._owner is not None and hasattr(self._owner, "close"):
            self._owner.close()


class SyncedIndex:
    """A ``ContentIndex`` kept in step with an ``IndexLog`` (thread-safe).

    ``add`` appends to the log, then applies every new record in log order, so
    replicas add entries in the same order (ties in ``cover`` break the same
    way everywhere); ``cover`` first applies what others appended, at most every
    ``refresh_s`` seconds. A log that fails (Redis down) is logged and the index
    serves what it has. ``remove`` is local: an entry found evicted from the
    store; a restart replays it, and finding it missing removes it again.

    Args:
        log: where records are appended and read.
        index: the index to fill (default: a new ``ContentIndex``).
        refresh_s: the least time between two reads of the log by ``cover``.
        max_records: entries the index may hold: beyond, new records are ignored
            (one warning), so a client cannot exhaust the server's memory.

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
        max_records: int = 2_000_000,
    ) -> None:
        self.log = log
        self.index = index if index is not None else ContentIndex()
        self.refresh_s, self.max_records = refresh_s, max_records
        self._lock = threading.RLock()
        self._refreshed = float("-inf")
        self._warned_full = False
        self._failing = False

    def refresh(self) -> int:
        """Apply the records appended since the last read; how many entries were new."""
        with self._lock:
            self._refreshed = time.monotonic()
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
            return self._apply(records)

    def _apply(self, records: list[tuple[str, np.ndarray]]) -> int:
        # Parsed records always fit the index (ints >= 0 in int32, non-empty).
        if len(records) <= self.max_records - len(self.index):
            added = self.index.add_many(records)  # the usual case: one bulk add
            if added > 1000:  # a replay: sort now, not in the next request's cover
                self.index.flush()
            return added
        added = 0
        for namespace, ids in records:
            if len(self.index) < self.max_records:
                added += self.index.add(namespace, ids)
            elif (namespace, ids) not in self.index:
                self._full()
        return added

    def _full(self) -> None:
        if not self._warned_full:
            self._warned_full = True
            logger.warning(
                "content index holds max_records=%d entries: new records are ignored",
                self.max_records,
            )

    def add(self, namespace: str, ids: Sequence[int] | np.ndarray) -> bool:
        """Index ``ids`` here and on every replica; False if it is known already
        (or the index is full)."""
        with self._lock:
            if not self._failing:  # a failing log is retried by ``cover`` only
                self.refresh()  # another replica may have logged it already
            if (namespace, ids) in self.index:
                return False
            if len(self.index) >= self.max_records:
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


def _parse_items(items: list[bytes]) -> list[tuple[str, np.ndarray]]:
    """Records stored one per item: an item that is not one whole record is skipped."""
    out = []
    for item in items:
        records, used, _ = parse_records(bytes(item))
        if len(records) == 1 and used == len(item):
            out += records
        else:
            logger.warning("index log: skipped a damaged record of %d bytes", len(item))
    return out


def index_log_for(store: Any, *, owned: bool = False) -> IndexLog:
    """The index log beside ``store``: a ``DiskKVStore``'s folder, a
    ``RedisKVStore``'s server and prefix (its client), a memory log for a
    ``MemoryKVStore`` (this process only), a ``TieredKVStore``'s backend's.
    ``owned``: the log's ``close`` closes the store too (else the caller's store
    is left open).

    Raises:
        ValueError: a store of another kind.
    """
    from kvrag_integrations.store import DiskKVStore, MemoryKVStore, RedisKVStore, TieredKVStore

    if isinstance(store, TieredKVStore):
        return index_log_for(store.backend, owned=owned)
    if isinstance(store, DiskKVStore):
        return DiskIndexLog(store.root)
    if isinstance(store, RedisKVStore):
        return RedisIndexLog(store.client, store.prefix, owner=store if owned else None)
    if isinstance(store, MemoryKVStore):
        return MemoryIndexLog()
    raise ValueError(f"no index log for a {type(store).__name__}")


def open_index_log(store_url: str) -> IndexLog:
    """The index log of the store ``store_url`` names (what ``open_store`` takes:
    ``disk:DIR``, ``redis://host:port/db``, ``rediss://...``, ``memory``).

    Raises:
        ValueError: another form of URL (``StoreURLError`` is a ``ValueError``).
    """
    from kvrag_integrations.store.url import open_store  # torch: only when a URL is opened

    return index_log_for(open_store(store_url), owned=True)
