"""The index log beside a store: a file for a disk store, a list for a Redis store.

Both are appended to by every process writing entries (the vLLM workers of
every replica) and read by every API server. ``compact`` rewrites either
without losing what other processes append meanwhile: the file under an
exclusive ``flock`` that appenders share (then an atomic rename, which readers
see as a new file), the list in one MULTI/EXEC that keeps what was appended
after the snapshot it filtered (under a lock key: one compactor at a time),
with a generation counter readers check in the same transaction as each read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvrag_integrations.matching.log import IndexLog, Live, MemoryIndexLog, keep_live, parse_items
from kvrag_integrations.matching.records import encode_record, parse_records

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: appends and compaction are not fenced
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

INDEX_DIR = "_index"  # under a disk store's root; the store lists only 2-char shards
LOG_NAME = "records.log"
_READ_BLOCK = 32 << 20  # bytes read from a log file at a time
_REDIS_BATCH = 10_000  # list items fetched (or pushed) per command
_COMPACT_LOCK_MS = 120_000  # a Redis compactor that died frees its lock after this


def _flock(fd: int, how: int) -> None:
    if fcntl is not None:
        with contextlib.suppress(OSError):  # a file system without locks: unfenced
            fcntl.flock(fd, how)


class DiskIndexLog(IndexLog):
    """``root/_index/records.log``: records appended with one ``os.write`` each on
    an ``O_APPEND`` descriptor (whole, never interleaved, between processes on a
    local file system), under a shared ``flock`` of the file that ``compact``
    takes exclusively. A reader keeps a byte offset; ``read_new`` is one
    ``os.stat`` when the file has not grown. A torn trailing record is left for
    the next call, a damaged one followed by valid records is skipped (logged).
    A file replaced (compacted) or cut is read anew from its start. Anything but
    a regular file there (a FIFO, a device) is refused at once, named
    (``NotRegularFileError``), never opened blocking.
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
            fd = self._locked_write_fd()
            try:
                written = os.write(fd, data)  # one write: one whole record
            finally:
                _flock(fd, fcntl.LOCK_UN if fcntl else 0)
        if written != len(data):  # disk full: readers will skip the torn bytes
            raise OSError(f"short write to {self.path}: {written} of {len(data)} bytes")

    def _locked_write_fd(self) -> int:
        """The write descriptor of the file now at ``path``, under a shared lock (a
        compaction in progress finishes first; its new file is then followed)."""
        while True:
            if self._write_fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
                self._write_fd, _ = _open(self.path, flags)
            _flock(self._write_fd, fcntl.LOCK_SH if fcntl else 0)
            if _same_file(self._write_fd, self.path):
                return self._write_fd
            os.close(self._write_fd)  # removed or replaced (compacted): follow it
            self._write_fd = None

    def read_new(self) -> list[tuple[str, np.ndarray]]:
        with self._lock:
            try:
                info = os.stat(self.path)
            except FileNotFoundError:
                if self._file_id is not None:
                    self.generation += 1
                self._reset(None)
                return []
            if (info.st_dev, info.st_ino) != self._file_id or info.st_size < self._offset:
                if self._file_id is not None:  # replaced or cut: read it anew
                    self.generation += 1
                self._reset((info.st_dev, info.st_ino))
            if info.st_size == self._seen:
                return []
            return self._read_to(info.st_size)

    def _reset(self, file_id: tuple[int, int] | None) -> None:
        if self._read_fd is not None:
            os.close(self._read_fd)
        self._read_fd, self._file_id, self._offset, self._seen = None, file_id, 0, -1

    def _read_to(self, size: int) -> list[tuple[str, np.ndarray]]:
        if self._read_fd is None:
            self._read_fd, _ = _open(self.path)
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

    def compact(self, live: Live) -> tuple[int, int]:
        """Keep the live records: read the file under its exclusive lock (appenders
        wait, then follow the new file), write them to a temp file and rename it
        over the log."""
        try:
            fd, _ = _open(self.path)
        except FileNotFoundError:
            return 0, 0
        try:
            _flock(fd, fcntl.LOCK_EX if fcntl else 0)
            if not _same_file(fd, self.path):  # another compactor just did it
                return 0, 0
            data = _read_all(fd)
            records = _split(data)
            kept = keep_live(records, live)
            # a tail that does not parse under the lock is no write in flight: damage
            if len(kept) == len(records) and sum(map(len, records)) == len(data):
                return len(kept), 0
            tmp = self.path.with_name(f".{LOG_NAME}.{os.getpid()}-{secrets.token_hex(4)}")
            try:
                out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.write(out, b"".join(kept))
                    os.fsync(out)
                finally:
                    os.close(out)
                os.replace(tmp, self.path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            return len(kept), len(records) - len(kept)
        finally:
            os.close(fd)  # drops the lock: appenders find the new file

    def nbytes(self) -> int:
        try:
            return os.stat(self.path).st_size
        except FileNotFoundError:
            return 0

    def close(self) -> None:
        with self._lock:
            for fd in (self._write_fd, self._read_fd):
                if fd is not None:
                    os.close(fd)
            self._write_fd = self._read_fd = None


def _open(path: Path, flags: int = os.O_RDONLY) -> tuple[int, int]:
    """The log file opened only if it is a regular file (``store.files.open_regular``:
    a FIFO there is refused at once, named, never opened blocking)."""
    from kvrag_integrations.store.files import open_regular

    return open_regular(path, flags, follow=True, what="index log")


def _read_all(fd: int) -> bytes:
    chunks, pos = [], 0
    while block := os.pread(fd, _READ_BLOCK, pos):
        chunks.append(block)
        pos += len(block)
    return b"".join(chunks)


def _split(data: bytes) -> list[bytes]:
    """The whole valid records in ``data``, each as its own bytes (re-encoding a
    parsed record gives its bytes back: the format is canonical)."""
    records, _, _ = parse_records(data)
    return [encode_record(namespace, ids) for namespace, ids in records]


def _same_file(fd: int, path: Path) -> bool:
    try:
        info, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (info.st_dev, info.st_ino) == (held.st_dev, held.st_ino)


class RedisIndexLog(IndexLog):
    """The Redis list ``f"{prefix}index"`` (one record per item, RPUSH): the same
    server, db and prefix as the ``RedisKVStore`` it sits beside (its ``keys``
    lists only 64-hex names, so the list is never taken for an entry). On a
    Redis Cluster it is ``f"{prefix}{{index}}"``: the hash tag keeps the list,
    its generation and its lock in one slot (they share transactions). A reader
    keeps a list index and the list's generation (``f"{prefix}index:gen"``, one
    more at each compaction), both read in one transaction with each read:
    ``read_new`` is one round trip when nothing was appended.

    Args:
        client: a ``redis.Redis`` (``decode_responses=False``), e.g. the store's.
        prefix: the store's key prefix.
        owner: kept alive with the log and closed by ``close`` (the store whose
            client this is, when the log opened it).
    """

    def __init__(self, client: Any, prefix: str = "kvrag:", *, owner: Any = None) -> None:
        from kvrag_integrations.store.redis_client import is_cluster, slot_key

        self.key = slot_key(prefix, "index", cluster=is_cluster(client))
        self.client, self._owner = client, owner
        self._gen_key, self._lock_key = f"{self.key}:gen", f"{self.key}:compacting"
        self._next = 0
        self._gen: bytes | None = None
        self._lock = threading.Lock()

    def append(self, namespace: str, ids: Sequence[int] | np.ndarray) -> None:
        self.client.rpush(self.key, encode_record(namespace, ids))

    def read_new(self) -> list[tuple[str, np.ndarray]]:
        with self._lock:
            out: list[bytes] = []
            while True:
                with self.client.pipeline(transaction=True) as pipe:
                    pipe.get(self._gen_key)
                    pipe.llen(self.key)
                    pipe.lrange(self.key, self._next, self._next + _REDIS_BATCH - 1)
                    gen, length, items = pipe.execute()
                if gen != self._gen or int(length) < self._next:  # compacted or dropped
                    if self._gen is not None or self._next:
                        self.generation += 1
                    self._gen, self._next, out = gen, 0, []
                    continue
                out += items
                self._next += len(items)
                if not items or self._next >= int(length):
                    return parse_items(out)

    def compact(self, live: Live) -> tuple[int, int]:
        """Filter a snapshot of the list's first items, then in one transaction
        drop them and put the kept ones back in front of what was appended since."""
        token = secrets.token_hex(8)
        if not self.client.set(self._lock_key, token, nx=True, px=_COMPACT_LOCK_MS):
            return 0, 0  # another process is compacting
        try:
            length = int(self.client.llen(self.key))
            items: list[bytes] = []
            while len(items) < length:
                stop = min(length, len(items) + _REDIS_BATCH) - 1
                batch = self.client.lrange(self.key, len(items), stop)
                if not batch:
                    break
                items += batch
            kept = keep_live(items, live)
            if len(kept) == len(items):
                return len(kept), 0
            with self.client.pipeline(transaction=True) as pipe:
                pipe.ltrim(self.key, len(items), -1)  # what others appended stays
                for end in range(len(kept), 0, -_REDIS_BATCH):  # LPUSH: last batch first
                    pipe.lpush(self.key, *reversed(kept[max(0, end - _REDIS_BATCH) : end]))
                pipe.incr(self._gen_key)
                pipe.execute()
            return len(kept), len(items) - len(kept)
        finally:
            if self.client.get(self._lock_key) == token.encode():
                self.client.delete(self._lock_key)

    def nbytes(self) -> int:
        """The list's memory (Redis ``MEMORY USAGE``, sampled), else its items' bytes."""
        try:
            used = self.client.memory_usage(self.key)
        except Exception:  # an older server, or a managed one without MEMORY
            used = None
        return int(used or 0)

    def close(self) -> None:
        if self._owner is not None and hasattr(self._owner, "close"):
            self._owner.close()


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
