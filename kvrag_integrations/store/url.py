"""Open a store from a one-string URL: ``disk:DIR``, ``redis://host:port/db``,
``redis+cluster://host:port[,host:port...]`` or ``memory``."""

from __future__ import annotations

import re

from kvrag_integrations.errors import StoreURLError
from kvrag_integrations.store.base import KVStore
from kvrag_integrations.store.disk import DiskKVStore
from kvrag_integrations.store.memory import MemoryKVStore
from kvrag_integrations.store.redis import RedisKVStore
from kvrag_integrations.store.redis_client import CLUSTER_SCHEMES

STORE_URL_FORMS = (
    "disk:DIR, redis://host:port/db, rediss://..., redis+cluster://host:port[,host:port...], "
    "rediss+cluster://... or memory"
)
_REDIS_SCHEMES = ("redis://", "rediss://", *(f"{scheme}://" for scheme in CLUSTER_SCHEMES))


def open_store(url: str) -> KVStore:
    """The store a URL names (what the command line's ``--store`` takes).

    Args:
        url: ``disk:DIR`` (a ``DiskKVStore`` at ``DIR``), ``redis://host:port/db``
            or ``rediss://...`` (a ``RedisKVStore``; needs the ``redis`` extra),
            ``redis+cluster://host:port[,host:port...]`` or ``rediss+cluster://...``
            (a ``RedisKVStore`` on a Redis Cluster, by any of its nodes; the same
            options as ``redis://``) or ``memory`` (a ``MemoryKVStore``: gone
            when the process ends).

    Returns:
        The store; nothing is written to until it is used, and nothing connected
        to but a cluster (whose slot map is read and checked here).

    Raises:
        StoreURLError: the URL has another form, ``disk:`` has no directory, or
            the cluster a URL names is down, incomplete or not one cluster.

    Examples:
        >>> open_store("disk:./kv").root.as_posix()
        'kv'
        >>> type(open_store("memory")).__name__
        'MemoryKVStore'
        >>> open_store("s3://bucket")
        Traceback (most recent call last):
        ...
        kvrag_integrations.errors.StoreURLError: unknown store URL 's3://bucket'; \
expected disk:DIR, redis://host:port/db, rediss://..., redis+cluster://host:port[,host:port...], \
rediss+cluster://... or memory
    """
    kind, rest = parse_store_url(url)
    if kind == "memory":
        return MemoryKVStore()
    if kind == "disk":
        return DiskKVStore(rest)
    try:
        return RedisKVStore(rest)
    except ValueError as exc:  # redis-py's own URL parsing, or the cluster's checks
        raise StoreURLError(f"redis store {redact_url(url)!r}: {redact_url(str(exc))}") from None


def parse_store_url(url: str) -> tuple[str, str]:
    """``(kind, rest)`` of a store URL, its form checked, nothing opened:
    ``("memory", "")``, ``("disk", DIR)`` or ``("redis", URL)``.

    Raises:
        StoreURLError: the URL has another form, or ``disk:`` has no directory.

    Examples:
        >>> parse_store_url("disk:///srv/kv")
        ('disk', '/srv/kv')
        >>> parse_store_url("/srv/kv")
        Traceback (most recent call last):
        ...
        kvrag_integrations.errors.StoreURLError: unknown store URL '/srv/kv'; \
expected disk:DIR, redis://host:port/db, rediss://..., redis+cluster://host:port[,host:port...], \
rediss+cluster://... or memory
    """
    if not isinstance(url, str):
        raise StoreURLError(f"a store URL must be a string, got {type(url).__name__}")
    text = url.strip()
    if text == "memory":
        return "memory", ""
    if text.startswith("disk:"):
        root = text[len("disk:") :]
        if root.startswith("//"):  # disk:///abs/path
            root = root[2:]
        if not root:
            raise StoreURLError(f"store URL {url!r} names no directory; expected disk:DIR")
        return "disk", root
    if text.lower().startswith(_REDIS_SCHEMES):
        return "redis", text
    raise StoreURLError(f"unknown store URL {redact_url(url)!r}; expected {STORE_URL_FORMS}")


# scheme://userinfo@ and password=... query parameters (redis URLs take both).
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/@]*@")
_SECRET_PARAM = re.compile(r"(?i)\b(password|passwd|pass|token|secret)=[^&\s'\"]*")


def redact_url(text: str) -> str:
    """``text`` with the credentials of every URL in it replaced by ``***``.

    Used on everything the package prints or logs that may hold a store URL.

    Examples:
        >>> redact_url("redis://user:secret@127.0.0.1:6379/0")
        'redis://***@127.0.0.1:6379/0'
        >>> redact_url("cannot reach rediss://h:1/0?password=secret&db=1")
        'cannot reach rediss://h:1/0?password=***&db=1'
        >>> redact_url("disk:./kv")
        'disk:./kv'
    """
    text = _USERINFO.sub(r"\1***@", str(text))
    return _SECRET_PARAM.sub(r"\1=***", text)
