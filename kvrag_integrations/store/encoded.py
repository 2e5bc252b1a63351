"""The encoded-entry layer: stores that keep ``store.codec`` bytes (disk, Redis).

Encoding, verification (integrity code, key, the store's secret) and the
scrub of bad entries live here once; a backend only moves bytes: it reads an
entry's bytes (``None`` when absent), writes them atomically, deletes them and
lists keys. Backends keep their own transport concerns (safe file reads, split
Redis values, timeouts) and nothing of the format.
"""

from __future__ import annotations

import logging
from abc import abstractmethod

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.errors import CacheEntryError
from kvrag_integrations.store.base import KVStore
from kvrag_integrations.store.codec import decode_entry, encode_entry, store_secret
from kvrag_integrations.store.namespaces import expires_in

logger = logging.getLogger(__name__)


class EncodedKVStore(KVStore):
    """A ``KVStore`` whose entries are self-verifying bytes (see ``store.codec``).

    Args:
        secret: sign entries with HMAC-SHA256 under this key and refuse unsigned or
            foreign-signed ones (default: ``$KVRAG_STORE_SECRET``, else none).
    """

    def __init__(self, *, secret: str | bytes | None = None) -> None:
        super().__init__()
        self._secret = store_secret(secret)

    @property
    def secret(self) -> bytes | None:
        """The key entries (and records: ``store.records``) are signed with, if any."""
        return self._secret

    def _get(self, key: str) -> ChunkKV | None:
        data = self._read_bytes(key)
        return None if data is None else decode_entry(data, self._secret)

    def _put(self, key: str, kv: ChunkKV) -> None:
        self._write_bytes(key, encode_entry(kv, self._secret), expires_in(kv.fingerprint))

    def verify(self) -> dict[str, int]:
        """Decode every entry, delete the unusable ones and count both kinds.

        An entry is bad if it fails ``decode_entry`` or its content hashes to a key
        other than the one it is stored under. Fingerprints are not checked (any
        model's entry is fine here). ``stats`` are not touched.

        Returns:
            ``{"ok": n, "bad": m}``.
        """
        counts = {"ok": 0, "bad": 0}
        for key in list(self.keys()):
            try:
                kv = self._get(key)
                if kv is None:  # deleted meanwhile: nothing to count
                    continue
                if kv.key != key:
                    raise CacheEntryError("entry is stored under another key")
            except (CacheEntryError, OSError) as exc:
                logger.warning("cache entry %s is bad (%s); deleted", key[:16], exc)
                self._safe_delete(key)
                counts["bad"] += 1
                continue
            counts["ok"] += 1
        return counts

    @abstractmethod
    def _read_bytes(self, key: str) -> bytes | bytearray | None:
        """The entry's bytes, ``None`` if absent; raise ``CacheEntryError`` if unreadable."""

    @abstractmethod
    def _write_bytes(self, key: str, data: bytes, ttl_s: float | None = None) -> None:
        """Write the entry's bytes atomically (readers see all of them or none);
        ``ttl_s``: the entry expires that long after (a private one: a store that
        keeps no expiry of its own sweeps them, ``maintenance.expired_private``)."""
