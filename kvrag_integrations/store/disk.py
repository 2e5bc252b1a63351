"""On-disk store: one self-verifying safetensors file per entry, written atomically."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.errors import CacheEntryError, StoreWriteError
from kvrag_integrations.store import tempfiles
from kvrag_integrations.store.base import EntryInfo, TempFileInfo
from kvrag_integrations.store.codec import (
    entry_size,
    header_length,
    read_metadata,
)
from kvrag_integrations.store.encoded import EncodedKVStore
from kvrag_integrations.store.files import open_regular
from kvrag_integrations.store.tempfiles import STALE_TEMP_S

logger = logging.getLogger(__name__)

_KEY_RE = re.compile(r"^[0-9a-f]{64}$")
_SUFFIX = ".safetensors"
_MAX_HEADER = 1 << 20  # our headers are a few hundred bytes; larger means a damaged file


class DiskKVStore(EncodedKVStore):
    """Entries live at ``root/<key[:2]>/<key>.safetensors`` (see ``store.codec``).

    Paths are only ever derived from sha256 hex keys, so no user text reaches the
    file system. Writes go to a temp file in the target directory and are renamed
    into place, so readers (other threads or processes) see a whole entry or none.
    ``root`` is created on the first ``put``: a store on a read-only path can
    still be constructed and read; writing then raises ``StoreWriteError``.

    Only regular files the store wrote are read: symlinks, FIFOs and devices
    are refused without blocking, and no more bytes are read than the entry's
    header declares (bounded by the file's size).

    A write's temp file names its writer (host, pid) and is locked by it while
    it lives (see ``store.tempfiles``). Whatever lists the directory (``keys``,
    ``entries``, ``len``, ``nbytes``, ``verify``, ``temp_files``) removes the temp
    files of writers that died on this host at once, and those of other hosts'
    (or unknown) writers once untouched for ``temp_grace_s`` seconds; a live
    writer's is never removed. ``reclaim_temp_files`` reports what was removed,
    ``stats`` counts it. ``get`` lists nothing.

    Args:
        root: the cache directory.
        secret: sign entries with HMAC-SHA256 under this key and refuse unsigned
            or foreign-signed ones (default: ``$KVRAG_STORE_SECRET``, else none).

    Examples:
        >>> import tempfile, torch
        >>> from kvrag_integrations.chunk_kv import ChunkKV
        >>> kv = ChunkKV(torch.arange(3), torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), "fp")
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     store = DiskKVStore(tmp)
        ...     key = store.put(kv)
        ...     torch.equal(store.get(key, "fp").keys, kv.keys)
        True
    """

    parallel_reads = True
    # Seconds a temp file of a writer that may be alive (another host) may sit untouched.
    temp_grace_s: float = STALE_TEMP_S

    def __init__(self, root: str | os.PathLike[str], *, secret: str | bytes | None = None) -> None:
        super().__init__(secret=secret)
        self.root = Path(root)
        self._unreported = [0, 0]  # temp files and bytes reclaimed, not yet reported
        self._reclaim_lock = threading.Lock()

    def _path(self, key: str) -> Path:
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise ValueError(f"invalid cache key {key!r}: expected 64 lowercase hex characters")
        return self.root / key[:2] / f"{key}{_SUFFIX}"

    def get(self, key: str, fingerprint: str) -> ChunkKV | None:
        """Like ``KVStore.get``; raises ``ValueError`` for a key that is not a hash."""
        self._path(key)  # validate before the base class turns every error into a miss
        return super().get(key, fingerprint)

    def contains(self, key: str) -> bool:
        """Whether a file exists for ``key`` (not verified: ``get`` verifies)."""
        return self._path(key).is_file()

    def touch(self, key: str) -> None:
        """The file's mtime is its last use: pruning by size evicts the least used."""
        with contextlib.suppress(OSError):
            os.utime(self._path(key))

    def _read_bytes(self, key: str) -> bytearray | None:
        try:
            return read_entry_file(self._path(key))
        except FileNotFoundError:
            return None

    def _write_bytes(self, key: str, data: bytes, ttl_s: float | None = None) -> None:
        # (an expiry: entries' mtimes, swept by ``maintenance.expired_private``)
        path = self._path(key)
        fd: int | None = None
        tmp_path: str | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Same directory as the target so os.replace is an atomic rename; the
            # file names this process and stays locked until it is closed.
            fd, tmp_path = tempfiles.create(path.parent)
            tempfiles.write_all(fd, data)
            os.fsync(fd)  # content is durable before the name points at it
            os.replace(tmp_path, path)  # still locked: never looks like a dead writer's
            tmp_path = None
        except OSError as exc:
            raise StoreWriteError(f"cannot write cache entry to {path}: {exc}") from exc
        finally:
            if tmp_path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp_path)
            if fd is not None:
                tempfiles.done(fd)

    def _delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def _shards(self) -> Iterator[Path]:
        if not self.root.is_dir():
            return
        for shard in sorted(self.root.iterdir()):
            # Two-character folders only: the content index's log (root/_index,
            # matching/log.py) is never listed, swept or pruned as entries.
            if len(shard.name) == 2 and shard.is_dir():
                yield shard

    def _entry_files(self) -> Iterator[tuple[str, Path]]:
        for shard in self._shards():
            paths = sorted(shard.iterdir())
            temps = [path for path in paths if tempfiles.is_temp_name(path.name)]
            if temps:  # every listing reclaims dead writers' temp files
                self._sweep(temps)
            for path in paths:
                # Skips temp files and anything not named by a key.
                key = path.name[: -len(_SUFFIX)]
                if path.name.endswith(_SUFFIX) and _KEY_RE.fullmatch(key) and key[:2] == shard.name:
                    yield key, path

    def keys(self) -> Iterator[str]:
        """Iterate over the keys of the entry files under ``root``."""
        for key, _ in self._entry_files():
            yield key

    def __len__(self) -> int:
        return sum(1 for _ in self._entry_files())

    def entries(self) -> Iterator[EntryInfo]:
        """Describe each entry file from its size, mtime and header (tensors are not read)."""
        for key, path in self._entry_files():
            try:
                info = path.lstat()
                fingerprint = _peek_fingerprint(path)
            except FileNotFoundError:  # deleted meanwhile
                continue
            yield EntryInfo(key, info.st_size, info.st_mtime, fingerprint)

    @property
    def nbytes(self) -> int:
        """Total size of the entry files, in bytes."""
        total = 0
        for _, path in self._entry_files():
            with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                total += path.lstat().st_size
        return total

    def temp_files(self) -> list[TempFileInfo]:
        """Temp files of writes in flight (writers alive, or on another host), after
        removing those of dead writers."""
        temps = [
            path
            for shard in self._shards()
            for path in sorted(shard.iterdir())
            if tempfiles.is_temp_name(path.name)
        ]
        return self._sweep(temps)

    def reclaim_temp_files(self) -> tuple[int, int]:
        """Remove dead writers' temp files; return ``(files, bytes)`` removed since the
        last call (by this call, or by any listing meanwhile)."""
        self.temp_files()
        with self._reclaim_lock:
            files, nbytes = self._unreported
            self._unreported = [0, 0]
        return files, nbytes

    def _sweep(self, paths: list[Path]) -> list[TempFileInfo]:
        named = [(path, f"{path.parent.name}/{path.name}") for path in paths]
        kept, files, nbytes = tempfiles.sweep(named, grace_s=self.temp_grace_s)
        if files:
            logger.info("removed %d temp files (%d bytes) of dead writers", files, nbytes)
            self._count("temp_files_reclaimed", files)
            self._count("temp_bytes_reclaimed", nbytes)
            with self._reclaim_lock:
                self._unreported[0] += files
                self._unreported[1] += nbytes
        return kept


def _open_regular(path: Path) -> tuple[int, int]:
    return open_regular(path)  # (an entry: no symlink either)


def _read_exactly(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        block = os.read(fd, min(left, 1 << 24))
        if not block:
            break
        chunks.append(block)
        left -= len(block)
    return b"".join(chunks)


def _read_head(fd: int, size: int) -> bytes:
    first8 = _read_exactly(fd, 8)
    header_len = header_length(first8)
    if header_len > _MAX_HEADER or 8 + header_len > size:
        raise CacheEntryError("entry header is larger than the file or than any we write")
    return first8 + _read_exactly(fd, header_len)


def read_entry_file(path: Path) -> bytearray:
    """An entry file's bytes, read safely: a regular file, no more than its header declares.

    The bytes are read straight into one preallocated ``bytearray`` (no joined
    copy), which ``decode_entry`` then builds its tensors over.

    Raises:
        FileNotFoundError: no such file (a miss).
        CacheEntryError: not a regular file, or a header that does not fit the file.
    """
    fd, size = _open_regular(path)
    try:
        head = _read_head(fd, size)
        total = entry_size(head)
        if total != size:
            raise CacheEntryError(f"entry declares {total} bytes but the file has {size}")
        data = bytearray(total)
        data[: len(head)] = head
        view, done = memoryview(data), len(head)
        while done < total:
            n = os.readv(fd, [view[done:]])
            if n == 0:
                break
            done += n
        if done != total:
            raise CacheEntryError(f"entry file shrank while read: {done} of {total} bytes")
        return data
    finally:
        os.close(fd)


def _peek_fingerprint(path: Path) -> str | None:
    """The fingerprint in the file's header, or ``None`` if the header is unreadable."""
    try:
        fd, size = _open_regular(path)
    except CacheEntryError:
        return None
    try:
        return read_metadata(_read_head(fd, size))["fingerprint"]
    except CacheEntryError:
        return None
    finally:
        os.close(fd)
