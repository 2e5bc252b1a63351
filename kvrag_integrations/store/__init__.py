"""Where precomputed chunk KV caches live: in memory (LRU) or on disk (safetensors)."""

from __future__ import annotations

from kvrag_integrations.store.base import KVStore, StoreStats
from kvrag_integrations.store.codec import FORMAT_VERSION, decode_entry, encode_entry
from kvrag_integrations.store.disk import DiskKVStore
from kvrag_integrations.store.memory import MemoryKVStore

__all__ = [
    "FORMAT_VERSION",
    "DiskKVStore",
    "KVStore",
    "MemoryKVStore",
    "StoreStats",
    "decode_entry",
    "encode_entry",
]
