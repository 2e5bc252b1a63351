"""RedisKVStore's write transaction on redis-py's ``client.transaction``, without a server.

The client is a stand-in whose ``transaction`` is redis-py's own, over a pipeline
that records commands and fails EXEC with ``WatchError`` as told.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

redis = pytest.importorskip("redis")

from kvrag_integrations.errors import StoreWriteError  # noqa: E402
from kvrag_integrations.store.redis import RedisKVStore  # noqa: E402

KEY = "ab" * 32


class FakePipe:
    def __init__(self, client: FakeClient) -> None:
        self.client = client
        self.queued: list[tuple[str, Any]] = []
        self.watching = False

    def __enter__(self) -> FakePipe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.queued.clear()

    def watch(self, *keys: str) -> None:
        self.client.watched.append(keys)
        self.watching = True

    def unwatch(self) -> None:
        self.client.unwatched += 1
        self.watching = False

    def exists(self, key: str) -> int:
        return int(key in self.client.data)

    def getrange(self, key: str, start: int, end: int) -> bytes:
        return self.client.data.get(key, b"")[start : end + 1]

    def get(self, key: str) -> bytes | None:
        return self.client.data.get(key)

    def multi(self) -> None:
        self.queued.clear()

    def set(self, key: str, value: Any, px: int | None = None) -> None:
        self.queued.append((key, bytes(value)))

    def delete(self, *keys: str) -> None:
        self.queued.extend((key, None) for key in keys)

    def pexpire(self, key: str, ms: int) -> None:
        pass

    def execute(self) -> list[Any]:
        if not self.queued and not self.watching:
            return []  # as redis-py: nothing to send
        self.client.executed += 1
        if self.client.conflicts:
            self.client.conflicts -= 1
            self.queued.clear()
            if callable(self.client.other_writer):
                self.client.other_writer(self.client.data)
            elif self.client.other_writer:
                self.client.data["kvrag:" + KEY] = b"theirs"
            raise redis.WatchError("watched key changed")
        for key, value in self.queued:  # a value of None: a DEL
            if value is None:
                self.client.data.pop(key, None)
            else:
                self.client.data[key] = value
        done, self.queued = self.queued, []
        return [True] * len(done)


class FakeClient:
    transaction = redis.Redis.transaction  # redis-py's retry loop, as is

    def __init__(self, conflicts: int, other_writer: bool | Callable[[dict], None]) -> None:
        self.data: dict[str, bytes] = {}
        self.conflicts, self.other_writer = conflicts, other_writer
        self.watched: list[tuple[str, ...]] = []
        self.executed = self.unwatched = 0

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> FakePipe:
        return FakePipe(self)


def test_a_write_without_conflict_runs_one_transaction() -> None:
    client = FakeClient(conflicts=0, other_writer=False)
    RedisKVStore(client=client)._write_bytes(KEY, b"ours")
    assert client.data == {"kvrag:" + KEY: b"ours"}
    assert client.executed == 1 and client.watched == [("kvrag:" + KEY,)]


def test_an_entry_another_writer_left_is_kept() -> None:
    client = FakeClient(conflicts=1, other_writer=True)
    RedisKVStore(client=client)._write_bytes(KEY, b"ours")
    assert client.data == {"kvrag:" + KEY: b"theirs"}  # same key: as good as ours
    assert client.executed == 1 and client.unwatched == 1


def test_a_conflict_that_left_nothing_is_retried() -> None:
    client = FakeClient(conflicts=2, other_writer=False)
    RedisKVStore(client=client)._write_bytes(KEY, b"ours")
    assert client.data == {"kvrag:" + KEY: b"ours"} and client.executed == 3


def test_writers_that_keep_conflicting_fail_after_three_transactions() -> None:
    client = FakeClient(conflicts=10, other_writer=False)
    with pytest.raises(StoreWriteError, match="kept conflicting"):
        RedisKVStore(client=client)._write_bytes(KEY, b"ours")
    assert client.executed == 3


def test_a_delete_never_strands_the_parts_of_an_entry_written_meanwhile() -> None:
    """Another writer replaces a split entry between the delete's read of its parts and
    its DEL: the transaction conflicts and runs again, deleting the new parts too."""
    client = FakeClient(conflicts=0, other_writer=False)
    store = RedisKVStore(client=client, max_value_bytes=4)
    store._write_bytes(KEY, b"0123456789")  # 3 parts and a manifest
    theirs = FakeClient(conflicts=0, other_writer=False)
    RedisKVStore(client=theirs, max_value_bytes=4)._write_bytes(KEY, b"abcdefghij")
    new_parts = set(theirs.data) - {"kvrag:" + KEY}
    assert len(new_parts) == 3 and not new_parts & set(client.data)
    client.conflicts, client.other_writer = 1, lambda data: data.update(theirs.data)
    client.executed = 0
    store._delete(KEY)
    assert client.executed == 2 and client.watched[-2:] == [("kvrag:" + KEY,)] * 2
    assert "kvrag:" + KEY not in client.data and not new_parts & set(client.data)
