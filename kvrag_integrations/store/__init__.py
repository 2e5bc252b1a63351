"""Where precomputed chunk KV caches live: memory (LRU), disk, Redis, or tiered.

``RedisKVStore`` is always importable; constructing one needs the ``redis``
extra (``pip install 'kvrag-integrations[redis]'``).
"""

from __future__ import annotations

from kvrag_integrations.store.base import EntryInfo, KVStore, StoreStats, TempFileInfo
from kvrag_integrations.store.codec import FORMAT_VERSION, decode_entry, encode_entry
from kvrag_integrations.store.disk import DiskKVStore
from kvrag_integrations.store.encoded import EncodedKVStore
from kvrag_integrations.store.memory import MemoryKVStore
from kvrag_integrations.store.redis import RedisKVStore
from kvrag_integrations.store.tiered import TieredKVStore
from kvrag_integrations.store.url import open_store

__all__ = [
    "FORMAT_VERSION",
    "DiskKVStore",
    "EncodedKVStore",
    "EntryInfo",
    "KVStore",
    "MemoryKVStore",
    "RedisKVStore",
    "StoreStats",
    "TempFileInfo",
    "TieredKVStore",
    "decode_entry",
    "encode_entry",
    "open_store",
]
