"""On-disk store: one self-verifying safetensors file per entry, written atomically."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kvrag_integrations.engine.kv import ChunkKV
from kvrag_integrations.errors import CacheEntryError, StoreWriteError
from kvrag_integrations.store.base import EntryInfo, KVStore
from kvrag_integrations.store.codec import (
    decode_entry,
    encode_entry,
    header_length,
    read_metadata,
)

logger = logging.getLogger(__name__)

_KEY_RE = re.compile(r"^[0-9a-f]{64}$")
_SUFFIX = ".safetensors"
_TMP_PREFIX = ".tmp-"
_MAX_HEADER = 1 << 20  # our headers are a few hundred bytes; larger means a damaged file


class DiskKVStore(KVStore):
    """Entries live at ``root/<key[:2]>/<key>.safetensors`` (see ``store.codec``).

    Paths are only ever derived from sha256 hex keys, so no user text reaches the
    file system. Writes go to a temp file in the target directory and are renamed
    into place, so readers (other threads or processes) see a whole entry or none.
    ``root`` is created on the first ``put``: a store on a read-only path can
    still be constructed and read; writing then raises ``StoreWriteError``.

    Args:
        root: the cache directory.

    Examples:
        >>> import tempfile, torch
        >>> from kvrag_integrations.engine.kv import ChunkKV
        >>> kv = ChunkKV(torch.arange(3), torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), "fp")
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     store = DiskKVStore(tmp)
        ...     key = store.put(kv)
        ...     torch.equal(store.get(key, "fp").keys, kv.keys)
        True
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__()
        self.root = Path(root)

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

    def _get(self, key: str) -> ChunkKV | None:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        return decode_entry(data)

    def _put(self, key: str, kv: ChunkKV) -> None:
        path = self._path(key)
        data = encode_entry(kv)
        tmp_path: str | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Same directory as the target so os.replace is an atomic rename.
            fd, tmp_path = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".part", dir=path.parent)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())  # content is durable before the name points at it
            os.chmod(tmp_path, 0o644)  # mkstemp makes 0600; let other readers share the cache
            os.replace(tmp_path, path)
            tmp_path = None
        except OSError as exc:
            raise StoreWriteError(f"cannot write cache entry to {path}: {exc}") from exc
        finally:
            if tmp_path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp_path)

    def _delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def _entry_files(self) -> Iterator[tuple[str, Path]]:
        if not self.root.is_dir():
            return
        for shard in sorted(self.root.iterdir()):
            if len(shard.name) != 2 or not shard.is_dir():
                continue
            for path in sorted(shard.iterdir()):
                # Skips temp files of in-flight writes and anything not named by a key.
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
                stat = path.stat()
                fingerprint = _peek_fingerprint(path)
            except FileNotFoundError:  # deleted meanwhile
                continue
            yield EntryInfo(key, stat.st_size, stat.st_mtime, fingerprint)

    @property
    def nbytes(self) -> int:
        """Total size of the entry files, in bytes."""
        total = 0
        for _, path in self._entry_files():
            with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                total += path.stat().st_size
        return total

    def verify(self) -> dict[str, int]:
        """Decode every entry, delete the unusable ones and count both kinds.

        An entry is bad if it fails ``decode_entry`` or its content hashes to a key
        other than its file name. Fingerprints are not checked (any model's entry
        is fine here). ``stats`` are not touched.

        Returns:
            ``{"ok": n, "bad": m}``.
        """
        counts = {"ok": 0, "bad": 0}
        for key, path in list(self._entry_files()):
            try:
                kv = decode_entry(path.read_bytes())
                if kv.key != key:
                    raise CacheEntryError("entry is stored under another key")
            except FileNotFoundError:  # deleted meanwhile: nothing to count
                continue
            except (CacheEntryError, OSError) as exc:
                logger.warning("cache entry %s is bad (%s); deleted", key[:16], exc)
                self._safe_delete(key)
                counts["bad"] += 1
                continue
            counts["ok"] += 1
        return counts


def _peek_fingerprint(path: Path) -> str | None:
    """The fingerprint in the file's header, or ``None`` if the header is unreadable."""
    with open(path, "rb") as handle:
        try:
            size = header_length(handle.read(8))
            if size > _MAX_HEADER:
                return None
            handle.seek(0)
            return read_metadata(handle.read(8 + size))["fingerprint"]
        except CacheEntryError:
            return None
