"""Open a store from a one-string URL: ``disk:DIR``, ``redis://host:port/db`` or ``memory``."""

from __future__ import annotations

from kvrag_integrations.errors import StoreURLError
from kvrag_integrations.store.base import KVStore
from kvrag_integrations.store.disk import DiskKVStore
from kvrag_integrations.store.memory import MemoryKVStore
from kvrag_integrations.store.redis import RedisKVStore

STORE_URL_FORMS = "disk:DIR, redis://host:port/db, rediss://... or memory"


def open_store(url: str) -> KVStore:
    """The store a URL names (what the command line's ``--store`` takes).

    Args:
        url: ``disk:DIR`` (a ``DiskKVStore`` at ``DIR``), ``redis://host:port/db``
            or ``rediss://...`` (a ``RedisKVStore``; needs the ``redis`` extra) or
            ``memory`` (a ``MemoryKVStore``: gone when the process ends).

    Returns:
        The store; nothing is written or connected to until it is used.

    Raises:
        StoreURLError: the URL has another form, or ``disk:`` has no directory.

    Examples:
        >>> open_store("disk:./kv").root.as_posix()
        'kv'
        >>> type(open_store("memory")).__name__
        'MemoryKVStore'
        >>> open_store("s3://bucket")
        Traceback (most recent call last):
        ...
        kvrag_integrations.errors.StoreURLError: unknown store URL 's3://bucket'; \
expected disk:DIR, redis://host:port/db, rediss://... or memory
    """
    if not isinstance(url, str):
        raise StoreURLError(f"a store URL must be a string, got {type(url).__name__}")
    text = url.strip()
    if text == "memory":
        return MemoryKVStore()
    if text.startswith("disk:"):
        root = text[len("disk:") :]
        if root.startswith("//"):  # disk:///abs/path
            root = root[2:]
        if not root:
            raise StoreURLError(f"store URL {url!r} names no directory; expected disk:DIR")
        return DiskKVStore(root)
    if text.startswith(("redis://", "rediss://")):
        try:
            return RedisKVStore(text)
        except ValueError as exc:  # redis-py's own URL parsing
            raise StoreURLError(f"bad redis URL {url!r}: {exc}") from exc
    raise StoreURLError(f"unknown store URL {url!r}; expected {STORE_URL_FORMS}")
