"""Redis store: self-verifying safetensors values, split into parts when large."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import time
from collections.abc import Iterator
from typing import Any

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.errors import CacheEntryError, StoreWriteError
from kvrag_integrations.store.base import EntryInfo
from kvrag_integrations.store.codec import header_length, read_metadata
from kvrag_integrations.store.encoded import EncodedKVStore
from kvrag_integrations.store.redis_client import (
    check_prefix,
    down_errors,
    is_cluster,
    open_client,
    slot_key,
)

try:  # the optional ``redis`` extra: the package imports without it
    import redis as redis_lib
except ImportError:  # pragma: no cover - exercised only where redis is not installed
    redis_lib = None

logger = logging.getLogger(__name__)

_KEY_RE = re.compile(r"[0-9a-f]{64}")  # used with fullmatch: "$" would accept a final "\n"
# A split entry's main value starts with this; a safetensors blob never does (its
# first 8 bytes are a little-endian header length, these would mean ~5e18 bytes).
_MANIFEST_MAGIC = b"KVRAG-PARTS-V1\n"
_MANIFEST_PEEK = 1024  # bytes read to tell a manifest from a blob without fetching the blob
_REDIS_MAX_VALUE = 512 * 2**20  # Redis refuses bulk values above this (proto-max-bulk-len)
_MAX_PARTS = 65_536  # 4 TiB at the default part size: far beyond any chunk cache
# Parts of an overwritten split entry expire after this grace period instead of at
# once, so a reader that already holds the old manifest can still fetch them.
_STALE_PART_GRACE_MS = 60_000
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")
_WRITE_ATTEMPTS = 3  # transactions tried before a write that keeps conflicting fails


class RedisKVStore(EncodedKVStore):
    """Entries live in Redis under ``prefix + key``, as ``store.codec`` bytes.

    Shared by every worker that points at the same server, so a chunk encoded by
    one is reused by all. On a Redis Cluster (a ``redis+cluster://`` URL, or a
    ``redis.cluster.RedisCluster`` client) the key is ``prefix + "{" + key + "}"``:
    the hash tag keeps an entry, its parts and their transaction in one slot,
    and entries spread over the primaries by it. Values are checked exactly as
    on disk (checksum, fingerprint, key); keys are 64-hex hashes only, never
    user text. An entry
    larger than ``max_value_bytes`` is split: its parts are written first (under
    ``prefix + key + ":part:<sha256[:16]>:<i>"``), then a small manifest under the
    entry's key recording the part count, sizes and the sha256 of the whole; a
    missing or damaged part makes the entry a miss. Every value gets the same TTL
    (``ttl_s``; a private entry, one request's own, at most
    ``namespaces.PRIVATE_TTL_S``).
    A write is one optimistic transaction (redis-py's ``client.transaction``: WATCH,
    then MULTI/EXEC, retried on conflict), so concurrent writers of one entry
    leave one whole entry and no orphaned parts; the parts of an overwritten
    entry expire a minute later (readers may still hold them). A delete is one
    transaction too, so it never strands the parts of an entry written meanwhile.
    A writer killed mid-write leaves nothing: the server drops a transaction
    whose connection closes before EXEC.

    A dead or unreachable server never hangs a request (1 s socket timeouts, one
    retry): ``get`` is then a miss and ``contains`` is False, ``put`` raises
    ``StoreWriteError`` (``keys``, ``delete`` and ``len`` raise redis' own
    errors). The client reconnects by itself once the server is back. On a
    cluster the same holds per node: a primary that fails, is slow, or moves
    slots makes its entries misses (never damaged entries) until redis-py's
    slot map follows the failover or the migration.

    Args:
        url: the server, ``redis://host:port/db``, or a cluster,
            ``redis+cluster://host:port[,host:port...]`` (``store.redis_client``;
            connected and checked at once). Ignored when ``client`` is given.
        client: a ready ``redis.Redis`` or ``RedisCluster`` (``decode_responses=False``).
        prefix: put before every Redis key, e.g. one per deployment (no braces
            on a cluster).
        ttl_s: seconds an entry lives after it is written, or ``None`` for ever.
        max_value_bytes: the largest single Redis value; bigger entries are split.
        socket_timeout: seconds to wait on the server (connect and each read/write).
        secret: sign entries with HMAC-SHA256 under this key and refuse unsigned or
            foreign-signed ones (default: ``$KVRAG_STORE_SECRET``, else none): what
            a Redis that others can write to needs (see docs/deployment.md).

    Examples:
        >>> import torch
        >>> from kvrag_integrations.chunk_kv import ChunkKV
        >>> kv = ChunkKV(torch.arange(3), torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), "fp")
        >>> store = RedisKVStore("redis://127.0.0.1:6379/0", ttl_s=3600)  # doctest: +SKIP
        >>> key = store.put(kv)  # doctest: +SKIP
        >>> torch.equal(store.get(key, "fp").keys, kv.keys)  # doctest: +SKIP
        True
    """

    parallel_reads = True

    def __init__(
        self,
        url: str = "redis://localhost:6379/0",
        *,
        client: Any = None,
        prefix: str = "kvrag:",
        ttl_s: float | None = None,
        max_value_bytes: int = 64 * 2**20,
        socket_timeout: float = 1.0,
        secret: str | bytes | None = None,
    ) -> None:
        super().__init__(secret=secret)
        if redis_lib is None:
            raise ImportError(
                "RedisKVStore needs the redis client: pip install 'kvrag-integrations[redis]'"
            )
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        if isinstance(max_value_bytes, bool) or not 0 < max_value_bytes <= _REDIS_MAX_VALUE:
            raise ValueError(f"max_value_bytes must be in [1, {_REDIS_MAX_VALUE}]")
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.max_value_bytes = int(max_value_bytes)
        self._owns_client = client is None
        client = open_client(url, socket_timeout) if client is None else client
        self.client = client
        self.cluster = is_cluster(client)
        check_prefix(prefix, cluster=self.cluster)
        self._down = down_errors()
        # (size, fingerprint) of each entry this store wrote or ``entries`` read: an
        # entry never changes in place, and reading its header (GETRANGE) resets its
        # idle time, which is the store's least-recently-used order
        self._described: dict[str, tuple[int, str | None]] = {}

    # ------------------------------------------------------------- keys
    def _rkey(self, key: str) -> str:
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise ValueError(f"invalid cache key {key!r}: expected 64 lowercase hex characters")
        return slot_key(self.prefix, key, cluster=self.cluster)

    def _entry_key(self, name: str) -> str | None:
        """The cache key a Redis key under ``prefix`` holds an entry of (None: a part,
        the index log, or someone else's key)."""
        name = name[len(self.prefix) :]
        if self.cluster:
            if not (name.startswith("{") and name.endswith("}")):
                return None
            name = name[1:-1]
        return name if _KEY_RE.fullmatch(name) else None

    def _part_keys(self, rkey: str, digest: str, count: int) -> list[str]:
        return [f"{rkey}:part:{digest[:16]}:{i}" for i in range(count)]

    # ------------------------------------------------------- manifests
    def _manifest(self, blob: bytes, rkey: str) -> tuple[dict[str, Any], list[str]]:
        """Parse a manifest value; raise ``CacheEntryError`` if it is malformed."""
        try:
            meta = json.loads(blob[len(_MANIFEST_MAGIC) :])
            size, part, count, digest = (meta[k] for k in ("size", "part", "count", "sha256"))
        except (ValueError, TypeError, KeyError) as exc:
            raise CacheEntryError(f"split-entry manifest is malformed: {exc}") from exc
        ints_ok = all(isinstance(v, int) and v > 0 for v in (size, part, count))
        if not ints_ok or not isinstance(digest, str) or not _KEY_RE.fullmatch(digest):
            raise CacheEntryError("split-entry manifest has invalid fields")
        # A damaged manifest must not make us build or fetch millions of keys.
        if count != -(-size // part) or count > _MAX_PARTS or part > _REDIS_MAX_VALUE:
            raise CacheEntryError("split-entry manifest sizes are inconsistent or too large")
        return meta, self._part_keys(rkey, digest, count)

    def _old_parts(self, client: Any, rkey: str) -> list[str]:
        """Part keys of the split entry now under ``rkey`` (reads only its first bytes)."""
        head = client.getrange(rkey, 0, _MANIFEST_PEEK - 1)
        if not head or not head.startswith(_MANIFEST_MAGIC):
            return []
        try:
            return self._manifest(client.get(rkey) or b"", rkey)[1]
        except CacheEntryError:
            return []

    # ---------------------------------------------------------- KVStore
    def get(self, key: str, fingerprint: str) -> ChunkKV | None:
        """Like ``KVStore.get``; raises ``ValueError`` for a key that is not a hash."""
        self._rkey(key)  # validate before the base class turns every error into a miss
        return super().get(key, fingerprint)

    def contains(self, key: str) -> bool:
        """Whether a value exists under ``key`` (False while the server is down)."""
        rkey = self._rkey(key)
        try:
            return bool(self.client.exists(rkey))
        except self._down as exc:
            logger.warning("redis unreachable (%s); treating %s as absent", exc, key[:16])
            return False

    def touch(self, key: str) -> None:
        """Redis's TOUCH: the entry's idle time (its ``updated_at``) starts again."""
        with contextlib.suppress(*self._down):
            self.client.touch(self._rkey(key))

    def _read_bytes(self, key: str) -> bytes | None:
        rkey = self._rkey(key)
        try:
            blob = self.client.get(rkey)
            if blob is not None and blob.startswith(_MANIFEST_MAGIC):
                blob = self._join_parts(blob, rkey)
        except self._down as exc:
            # A miss, not a bad entry: nothing to delete, the engine just recomputes.
            logger.warning("redis unreachable (%s); cache entry %s is a miss", exc, key[:16])
            return None
        return blob

    def _join_parts(self, manifest: bytes, rkey: str) -> bytes:
        meta, part_keys = self._manifest(manifest, rkey)
        parts = self.client.mget(part_keys)
        missing = [i for i, p in enumerate(parts) if p is None]
        if missing:
            raise CacheEntryError(f"split entry lacks part(s) {missing} of {len(parts)}")
        blob = b"".join(parts)
        if len(blob) != meta["size"] or hashlib.sha256(blob).hexdigest() != meta["sha256"]:
            raise CacheEntryError("split entry's parts do not match its manifest checksum")
        return blob

    def _write_bytes(self, key: str, blob: bytes, ttl_s: float | None = None) -> None:
        rkey = self._rkey(key)
        self._described.pop(key, None)
        attempts = 0
        ttls = [t for t in (self.ttl_s, ttl_s) if t is not None]
        px = max(1, round(min(ttls) * 1000)) if ttls else None  # (Redis expires it)

        def write(pipe: Any) -> None:
            """One optimistic transaction (``client.transaction`` watches ``rkey`` and
            calls this again when another writer changed it before EXEC)."""
            nonlocal attempts
            attempts += 1
            # Same key means same tokens and model, so an entry another writer left
            # meanwhile is as good as ours: adding ours too would only orphan parts.
            if attempts > 1 and pipe.exists(rkey):
                pipe.unwatch()
                return
            if attempts > _WRITE_ATTEMPTS:
                raise StoreWriteError(
                    f"cannot write cache entry {key[:16]}: writers kept conflicting"
                )
            self._queue_write(pipe, rkey, blob, px)

        try:
            self.client.transaction(write, rkey)
        except (redis_lib.RedisError, *self._down) as exc:  # a cluster's are not all RedisError
            raise StoreWriteError(f"cannot write cache entry {key[:16]} to redis: {exc}") from exc
        self._described[key] = self._describe(rkey, blob, len(blob))  # (listed unread)

    def _queue_write(self, pipe: Any, rkey: str, blob: bytes, px: int | None) -> None:
        """Queue parts first, then the manifest (or the blob) on a watching ``pipe``
        (each with the expiry ``px``, in ms)."""
        old_parts = self._old_parts(pipe, rkey)  # read before MULTI, under the watch
        pipe.multi()
        new_parts: list[str] = []
        if len(blob) <= self.max_value_bytes:
            pipe.set(rkey, blob, px=px)
        else:
            # Part names come from the blob's sha256: a reader that got an older
            # manifest never reads parts of this one.
            digest = hashlib.sha256(blob).hexdigest()
            size, part = len(blob), self.max_value_bytes
            new_parts = self._part_keys(rkey, digest, -(-size // part))
            view = memoryview(blob)
            for i, part_key in enumerate(new_parts):
                pipe.set(part_key, view[i * part : (i + 1) * part], px=px)
            meta = {"size": size, "part": part, "count": len(new_parts), "sha256": digest}
            pipe.set(rkey, _MANIFEST_MAGIC + json.dumps(meta).encode(), px=px)
        for part_key in set(old_parts) - set(new_parts):
            pipe.pexpire(part_key, _STALE_PART_GRACE_MS)

    def _delete(self, key: str) -> None:
        rkey = self._rkey(key)
        self._described.pop(key, None)

        def delete(pipe: Any) -> None:
            """Read the parts and delete them with the manifest in one transaction on
            ``rkey``: a writer that replaced the entry in between makes EXEC fail and
            this run again, so its new parts never outlive their manifest (without a
            TTL they would stay for ever, listed by nothing)."""
            parts = self._old_parts(pipe, rkey)
            pipe.multi()
            pipe.delete(rkey, *parts)

        self.client.transaction(delete, rkey)

    def keys(self) -> Iterator[str]:
        """Iterate over the entry keys under ``prefix`` (SCAN: no server stall)."""
        pattern = _GLOB_SPECIAL.sub(r"\\\1", self.prefix) + "*"
        for raw in self.client.scan_iter(match=pattern, count=1000):  # (every primary's)
            key = self._entry_key(raw.decode() if isinstance(raw, bytes) else raw)
            if key is not None:  # skips parts and foreign keys
                yield key

    def entries(self) -> Iterator[EntryInfo]:
        """Describe each entry from its length, idle time and header (tensors are not read).

        ``updated_at`` is the entry's last access (Redis ``OBJECT IDLETIME``; ``None``
        under an LFU ``maxmemory-policy``, where Redis does not keep it). A split
        entry's size is the whole blob's, read from its manifest. Listing is no use
        of an entry (a read would reset its idle time, Redis's LRU clock): the size
        and fingerprint of an entry this store wrote or listed before are kept, and
        only ``OBJECT`` and ``EXISTS`` (which touch nothing) are sent for it; an
        entry another writer wrote is read once, its idle time first.
        """
        keys = list(self.keys())
        described, seen = self._described, {}
        for start in range(0, len(keys), 256):
            batch = keys[start : start + 256]
            with self.client.pipeline(transaction=False) as pipe:
                for key in batch:
                    rkey = self._rkey(key)
                    pipe.object("idletime", rkey)  # first: the reads below reset it
                    if key in described:
                        pipe.exists(rkey)
                    else:
                        pipe.strlen(rkey)
                        pipe.getrange(rkey, 0, _MANIFEST_PEEK - 1)
                replies = iter(pipe.execute(raise_on_error=False))
            now = time.time()
            for key in batch:
                idle = next(replies)
                if key in described:
                    if next(replies) != 1:  # deleted meanwhile
                        continue
                    size, fingerprint = described[key]
                else:
                    size, head = next(replies), next(replies)
                    if not head or isinstance(head, Exception):  # deleted meanwhile
                        continue
                    size, fingerprint = self._describe(self._rkey(key), head, int(size or 0))
                seen[key] = (size, fingerprint)
                updated = now - idle if isinstance(idle, int) else None
                yield EntryInfo(key, size, updated, fingerprint)
        for key in set(keys) - seen.keys():  # gone since: forgotten
            self._described.pop(key, None)
        self._described.update(seen)

    def _describe(self, rkey: str, head: bytes, size: int) -> tuple[int, str | None]:
        """``(size, fingerprint)`` of the entry whose value starts with ``head``."""
        try:
            if head.startswith(_MANIFEST_MAGIC):
                meta, part_keys = self._manifest(self.client.get(rkey) or b"", rkey)
                size, rkey = meta["size"], part_keys[0]
                head = self.client.getrange(rkey, 0, _MANIFEST_PEEK - 1) or b""
            need = 8 + header_length(head)
            if need > len(head) and need <= _MANIFEST_PEEK * 1024:
                head = self.client.getrange(rkey, 0, need - 1) or b""
            return size, read_metadata(head)["fingerprint"]
        except CacheEntryError:
            return size, None

    def shard_of(self, key: str) -> str:
        """The primary (``host:port``) whose slot holds ``key`` now, by the client's
        slot map (no round trip); ``""`` on a single server."""
        if not self.cluster:
            return ""
        return str(self.client.get_node_from_key(self._rkey(key)).name)

    def ttl(self, key: str) -> float | None:
        """Seconds left before the entry under ``key`` expires (``None``: no TTL or absent)."""
        ms = self.client.pttl(self._rkey(key))
        return ms / 1000 if ms >= 0 else None

    def close(self) -> None:
        """Close the connections this store opened (a given ``client`` is left open)."""
        if self._owns_client:
            self.client.close()
