"""Small named records beside a store's entries (a model's calibrated settings).

A record is a few kilobytes of JSON text that every process on the store reads:
a file under a disk store's ``_records`` folder (the store lists only its
two-character shards), a Redis key beside the entries (``<prefix>record:<name>``,
never a 64-hex entry key; hash-tagged on a cluster), a dict on a memory store
(the processes that share it: this one). ``records_for(store)`` finds the shelf
of any store, a tiered store's backend's.

Records are read as untrusted bytes: a name is checked, a file must be regular
and at most ``MAX_RECORD_BYTES``, and where the store has a secret
(``KVRAG_STORE_SECRET``) each record is signed with it (HMAC-SHA256 over its
name and text) and one without a valid signature is not returned. A damaged or
foreign record is None, never an exception: its reader falls back.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import stat
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from kvrag_integrations.errors import StoreWriteError

logger = logging.getLogger(__name__)

RECORDS_DIR = "_records"
MAX_RECORD_BYTES = 1 << 20
_NAME = re.compile(r"[a-z0-9][a-z0-9._:-]{0,127}")


def check_name(name: str) -> str:
    """``name`` if it is a record name (lowercase letters, digits, ``._:-``; at most 128)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"invalid record name {name!r}")
    return name


class RecordShelf(ABC):
    """Where one store keeps its records (see the module docstring)."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret

    def get(self, name: str) -> str | None:
        """The record's text, or None (absent, unreadable, or not signed by the secret).

        Raises:
            ValueError: not a record name (``check_name``).
        """
        check_name(name)
        try:
            raw = self._read(name)
        except Exception as exc:  # a store that cannot be reached, a bad file: absent
            logger.warning("record %s not read (%s)", name, exc)
            return None
        if raw is None:
            return None
        return self._open(name, raw)

    def put(self, name: str, text: str) -> None:
        """Write the record (replacing it).

        Raises:
            StoreWriteError: the store refused the write.
            ValueError: a bad name, or a text over ``MAX_RECORD_BYTES``.
        """
        data = self._seal(check_name(name), text)
        if len(data) > MAX_RECORD_BYTES:
            raise ValueError(f"a record has at most {MAX_RECORD_BYTES} bytes")
        try:
            self._write(name, data)
        except StoreWriteError:
            raise
        except Exception as exc:
            raise StoreWriteError(f"cannot write record {name}: {exc}") from exc

    def _mac(self, name: str, text: str) -> str:
        assert self._secret is not None
        message = name.encode() + b"\0" + text.encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def _seal(self, name: str, text: str) -> bytes:
        sealed: dict[str, Any] = {"record": text}
        if self._secret is not None:
            sealed["mac"] = self._mac(name, text)
        return json.dumps(sealed).encode()

    def _open(self, name: str, raw: bytes) -> str | None:
        try:
            sealed = json.loads(raw)
            text = sealed["record"]
            if not isinstance(text, str):
                raise TypeError("the record is not text")
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("record %s is damaged (%s); ignored", name, exc)
            return None
        if self._secret is not None:
            mac = sealed.get("mac")
            if not isinstance(mac, str) or not hmac.compare_digest(mac, self._mac(name, text)):
                logger.warning("record %s is not signed with the store's secret; ignored", name)
                return None
        return text

    @abstractmethod
    def _read(self, name: str) -> bytes | None: ...

    @abstractmethod
    def _write(self, name: str, data: bytes) -> None: ...


class DiskRecords(RecordShelf):
    """``root/_records/<name>.json``, written atomically (a temp file renamed)."""

    def __init__(self, root: str | os.PathLike[str], secret: bytes | None = None) -> None:
        super().__init__(secret)
        self.folder = Path(root) / RECORDS_DIR

    def _read(self, name: str) -> bytes | None:
        path = self.folder / f"{name}.json"
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ValueError(f"{path} is not a regular file")
            if info.st_size > MAX_RECORD_BYTES:
                raise ValueError(f"{path} has {info.st_size} bytes, over {MAX_RECORD_BYTES}")
            return os.read(fd, MAX_RECORD_BYTES + 1)
        finally:
            os.close(fd)

    def _write(self, name: str, data: bytes) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{name}.json"
        tmp = self.folder / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()


class RedisRecords(RecordShelf):
    """The key ``<prefix>record:<name>`` (``{record:<name>}`` on a cluster)."""

    def __init__(self, client: Any, prefix: str, secret: bytes | None = None) -> None:
        super().__init__(secret)
        from kvrag_integrations.store.redis_client import is_cluster, slot_key

        self.client = client
        self._key = lambda name: slot_key(prefix, f"record:{name}", cluster=is_cluster(client))

    def _read(self, name: str) -> bytes | None:
        key = self._key(name)
        if int(self.client.strlen(key) or 0) > MAX_RECORD_BYTES:
            raise ValueError(f"{key} is over {MAX_RECORD_BYTES} bytes")
        value = self.client.get(key)
        return None if value is None else bytes(value)

    def _write(self, name: str, data: bytes) -> None:
        self.client.set(self._key(name), data)


class MemoryRecords(RecordShelf):
    """A dict kept on the memory store itself (every engine on that store sees it)."""

    def __init__(self, shelf: dict[str, bytes]) -> None:
        super().__init__(None)
        self._shelf = shelf

    def _read(self, name: str) -> bytes | None:
        return self._shelf.get(name)

    def _write(self, name: str, data: bytes) -> None:
        self._shelf[name] = data


def records_for(store: Any) -> RecordShelf:
    """The record shelf of ``store`` (a tiered store's backend's).

    Raises:
        ValueError: a store of another kind.
    """
    from kvrag_integrations.store import DiskKVStore, MemoryKVStore, RedisKVStore, TieredKVStore

    if isinstance(store, TieredKVStore):
        return records_for(store.backend)
    if isinstance(store, DiskKVStore):
        return DiskRecords(store.root, store.secret)
    if isinstance(store, RedisKVStore):
        return RedisRecords(store.client, store.prefix, store.secret)
    if isinstance(store, MemoryKVStore):
        return MemoryRecords(store.records)
    raise ValueError(f"no records for a {type(store).__name__}")
