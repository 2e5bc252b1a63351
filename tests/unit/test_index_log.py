"""The index log (records, disk, memory) and SyncedIndex across replicas and restarts."""

from __future__ import annotations

import logging
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest

from kvrag_integrations.matching import (
    ContentIndex,
    DiskIndexLog,
    MemoryIndexLog,
    RedisIndexLog,
    SyncedIndex,
    open_index_log,
)
from kvrag_integrations.matching.records import RecordError, encode_record, parse_records


def ids(seed: int, n: int = 40) -> list[int]:
    return np.random.default_rng(seed).integers(0, 49152, n).tolist()


def plain(records: list[tuple[str, np.ndarray]]) -> list[tuple[str, list[int]]]:
    return [(namespace, arr.tolist()) for namespace, arr in records]


def test_records_round_trip_and_refuse_what_cannot_be_written() -> None:
    data = encode_record("model-ü", [0, 5, 2**31 - 1]) + encode_record("m", ids(1))
    records, used, skipped = parse_records(data)
    assert plain(records) == [("model-ü", [0, 5, 2**31 - 1]), ("m", ids(1))]
    assert (used, skipped) == (len(data), 0)
    for bad in ([], [-1], [2**31], [1.0]):
        with pytest.raises(RecordError):
            encode_record("m", bad)
    with pytest.raises(RecordError):
        encode_record("m" * 5000, [1])


def test_two_replicas_on_one_folder_see_each_others_records(tmp_path: Path) -> None:
    a, b = DiskIndexLog(tmp_path), DiskIndexLog(tmp_path)
    assert a.read_new() == [] and b.read_new() == []  # no file yet
    a.append("m", [1, 2, 3])
    assert plain(b.read_new()) == [("m", [1, 2, 3])]
    assert b.read_new() == []  # nothing new: one stat, nothing read
    b.append("n", [4])
    a.append("m", [5, 6])
    assert plain(a.read_new()) == [("m", [1, 2, 3]), ("n", [4]), ("m", [5, 6])]
    assert plain(b.read_new()) == [("n", [4]), ("m", [5, 6])]
    restarted = DiskIndexLog(tmp_path)  # after a restart: everything, once
    assert len(restarted.read_new()) == 3 and restarted.read_new() == []
    assert a.path == tmp_path / "_index" / "records.log"
    for log in (a, b, restarted):
        log.close()


def test_a_torn_trailing_record_is_read_once_complete(tmp_path: Path) -> None:
    log = DiskIndexLog(tmp_path)
    log.append("m", [1, 2])
    second = encode_record("m", ids(2))
    with open(log.path, "ab") as f:
        f.write(second[:23])  # a writer caught mid-record
    assert plain(log.read_new()) == [("m", [1, 2])]
    assert log.read_new() == []
    with open(log.path, "ab") as f:
        f.write(second[23:])
    assert plain(log.read_new()) == [("m", ids(2))]


@pytest.mark.parametrize("damage", ["body", "length", "magic"])
def test_a_damaged_middle_record_is_skipped(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    log = DiskIndexLog(tmp_path)
    for seed in (1, 2, 3):
        log.append("m", ids(seed))
    raw = bytearray(log.path.read_bytes())
    size = len(raw) // 3
    at = {"body": size + 30, "length": size + 8, "magic": size}[damage]
    raw[at] ^= 0xFF
    log.path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        got = plain(DiskIndexLog(tmp_path).read_new())
    assert got == [("m", ids(1)), ("m", ids(3))]
    assert "damaged" in caplog.text


def test_a_damaged_tail_waits_for_what_follows(tmp_path: Path) -> None:
    log = DiskIndexLog(tmp_path)
    log.append("m", [1])
    with open(log.path, "ab") as f:
        f.write(b"KVIX" + b"\xff" * 40)  # garbage at the end, no valid record after it
    assert plain(log.read_new()) == [("m", [1])]
    log.append("m", [2])
    assert plain(log.read_new()) == [("m", [2])]


def test_a_replaced_file_is_read_anew(tmp_path: Path) -> None:
    log = DiskIndexLog(tmp_path)
    log.append("m", [1])
    assert len(log.read_new()) == 1
    os.unlink(log.path)  # the store was wiped and started again
    assert log.read_new() == []
    DiskIndexLog(tmp_path).append("m", [2])
    assert plain(log.read_new()) == [("m", [2])]
    os.unlink(log.path)
    log.append("m", [3])  # the writer follows the new file too
    assert plain(DiskIndexLog(tmp_path).read_new()) == [("m", [3])]


def _append_many(root: str, worker: int) -> None:
    log = DiskIndexLog(root)
    for i in range(150):
        log.append(f"w{worker}", list(range(i + 1)))
    log.close()


def test_concurrent_appenders_in_several_processes_interleave_whole_records(
    tmp_path: Path,
) -> None:
    context = multiprocessing.get_context("fork")
    procs = [context.Process(target=_append_many, args=(str(tmp_path), w)) for w in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    records = plain(DiskIndexLog(tmp_path).read_new())
    assert len(records) == 450
    for worker in range(3):
        mine = [r for ns, r in records if ns == f"w{worker}"]
        assert mine == [list(range(i + 1)) for i in range(150)]


def test_the_disk_store_never_lists_or_sweeps_the_index_folder(tmp_path: Path) -> None:
    import torch

    from kvrag_integrations.chunk_kv import ChunkKV
    from kvrag_integrations.store import DiskKVStore
    from kvrag_integrations.store.maintenance import prune

    store = DiskKVStore(tmp_path)
    key = store.put(ChunkKV(torch.arange(3), torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), "f"))
    log = DiskIndexLog(tmp_path)
    log.append("m", [1, 2, 3])
    store.temp_grace_s = 0
    assert list(store.keys()) == [key] and len(store) == 1
    assert [e.key for e in store.entries()] == [key] and store.temp_files() == []
    prune(store, max_bytes=0)
    assert len(store) == 0 and log.path.is_file()
    assert plain(DiskIndexLog(tmp_path).read_new()) == [("m", [1, 2, 3])]


def test_memory_log_readers_share_records() -> None:
    log = MemoryIndexLog()
    log.append("m", [1])
    other = log.reader()
    log.append("m", [2])
    assert plain(log.read_new()) == [("m", [1]), ("m", [2])] and log.read_new() == []
    assert plain(other.read_new()) == [("m", [1]), ("m", [2])]


def test_open_index_log_follows_the_store_url(tmp_path: Path) -> None:
    log = open_index_log(f"disk:{tmp_path}")
    assert isinstance(log, DiskIndexLog) and log.path == tmp_path / "_index" / "records.log"
    assert isinstance(open_index_log("memory"), MemoryIndexLog)
    pytest.importorskip("redis")
    redis_log = open_index_log("redis://127.0.0.1:1/3")  # connects only when used
    assert isinstance(redis_log, RedisIndexLog) and redis_log.key == "kvrag:index"
    assert redis_log.client.connection_pool.connection_kwargs["db"] == 3
    redis_log.close()
    for bad in ("s3://bucket", "disk:"):
        with pytest.raises(ValueError):
            open_index_log(bad)


def test_synced_replicas_share_entries_and_survive_a_restart(tmp_path: Path) -> None:
    entry = ids(10, 60)
    a = SyncedIndex(DiskIndexLog(tmp_path), refresh_s=0)
    b = SyncedIndex(DiskIndexLog(tmp_path), refresh_s=3600)
    assert a.add("m", entry) and not a.add("m", entry)
    assert len(a) == 1
    assert b.cover("m", entry)[0].entry == tuple(entry)  # first cover reads the log
    a.add("m", ids(11, 60))
    assert b.cover("m", ids(11, 60)) == []  # refresh_s not yet passed
    assert b.refresh() == 1 and len(b.cover("m", ids(11, 60))) == 1
    assert b.remove("m", entry) and b.cover("m", entry) == []  # local only
    assert len(a.cover("m", entry)) == 1
    restarted = SyncedIndex(DiskIndexLog(tmp_path))
    assert len(restarted.cover("m", entry)) == 1 and len(restarted) == 2
    with open(a.log.path, "rb") as f:
        assert len(parse_records(f.read())[0]) == 2  # one record per entry
    for synced in (a, b, restarted):
        synced.close()


def test_replicas_add_in_log_order() -> None:
    """Ties break alike everywhere: each replica applies records in log order."""
    shared = ids(20, 50)
    log = MemoryIndexLog()
    a, b = SyncedIndex(log, refresh_s=3600), SyncedIndex(log.reader(), refresh_s=3600)
    b.add("m", [1, *shared])  # appended first
    a.add("m", [*shared, 2])  # a applies b's record before its own
    assert a.cover("m", shared)[0].entry == b.cover("m", shared)[0].entry == (1, *shared)


def test_max_bytes_bounds_the_live_index_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = MemoryIndexLog()
    for seed in range(5):
        log.append("m", ids(seed))
    one = ContentIndex().cost(40)
    synced = SyncedIndex(log.reader(), max_bytes=3 * one)
    with caplog.at_level(logging.WARNING):
        synced.refresh()
        assert not synced.add("m", ids(99))
        log.append("m", ids(98))
        synced.refresh()
    assert len(synced) == 3 and ("m", ids(99)) not in synced.index
    assert synced.index.live_nbytes <= 3 * one
    assert caplog.text.count(f"max_bytes={3 * one}") == 1
    # entries found evicted (removed) no longer count: new ones are indexed again
    for seed in range(3):
        assert synced.remove("m", ids(seed))
    assert synced.add("m", ids(99)) and ("m", ids(99)) in synced


def test_churn_never_fills_a_restarted_index(tmp_path: Path) -> None:
    """Entries come and go (the store evicts, the log is compacted): a server that
    restarts replays what is live and indexes new entries, however long it ran."""
    writer = DiskIndexLog(tmp_path)
    one = ContentIndex().cost(40)
    for round_ in range(10):
        batch = [ids(seed) for seed in range(round_ * 10, round_ * 10 + 10)]
        for entry in batch:
            writer.append("m", entry)
        live = {tuple(entry) for entry in batch[5:]}  # the store keeps the 5 newest
        writer.compact(lambda namespace, arr, live=live: tuple(arr.tolist()) in live)
        restarted = SyncedIndex(DiskIndexLog(tmp_path), max_bytes=8 * one)
        assert restarted.refresh() == 5  # the replay reads what is live only
        assert restarted.add("m", ids(1000 + round_))  # and a new entry is indexed
        restarted.close()
    writer.compact(lambda namespace, arr: tuple(arr.tolist()) in live)
    assert writer.nbytes() == 5 * len(encode_record("m", ids(0)))
    writer.close()


def test_compaction_keeps_the_first_live_record_and_readers_rebuild(tmp_path: Path) -> None:
    for log in (DiskIndexLog(tmp_path), MemoryIndexLog()):
        reader = SyncedIndex(
            log.reader() if isinstance(log, MemoryIndexLog) else DiskIndexLog(tmp_path), refresh_s=0
        )
        for seed in (1, 2, 3, 2):
            log.append("m", ids(seed))
        assert reader.refresh() == 3
        assert log.compact(lambda namespace, arr: arr.tolist() != ids(1)) == (2, 2)
        assert log.compact(lambda namespace, arr: True) == (2, 0)  # nothing left to drop
        log.append("m", ids(4))
        assert reader.refresh() == 3  # rebuilt from the live records, then the new one
        assert len(reader) == 3 and ("m", ids(1)) not in reader
        assert [r.entry for r in reader.cover("m", ids(2))] == [tuple(ids(2))]
        assert log.nbytes() == 3 * len(encode_record("m", ids(1)))
        reader.close()
        log.close()


def _append_records(root: str, worker: int, count: int) -> None:
    log = DiskIndexLog(root)
    for i in range(count):
        log.append(f"w{worker}", ids(worker * 100_000 + i, 20))
        log.append("gone", ids(worker * 100_000 + i, 20))  # each compaction drops some
    log.close()


def test_compaction_loses_no_record_appended_by_other_processes(tmp_path: Path) -> None:
    """Two processes append while this one compacts again and again (dropping only
    records of namespace "gone"): every appended record survives, once."""
    log = DiskIndexLog(tmp_path)
    for seed in range(50):
        log.append("gone", ids(seed, 20))
    context = multiprocessing.get_context("fork")
    workers = [
        context.Process(target=_append_records, args=(str(tmp_path), w, 400)) for w in (1, 2)
    ]
    for process in workers:
        process.start()
    compactions = 0
    while any(p.is_alive() for p in workers) or compactions < 3:
        log.compact(lambda namespace, arr: namespace != "gone")
        compactions += 1
    for process in workers:
        process.join()
        assert process.exitcode == 0
    records = DiskIndexLog(tmp_path).read_new()
    names = sorted((namespace, tuple(arr.tolist())) for namespace, arr in records)
    want = sorted((f"w{w}", tuple(ids(w * 100_000 + i, 20))) for w in (1, 2) for i in range(400))
    assert names == want
    log.close()


class _BrokenLog(MemoryIndexLog):
    def read_new(self) -> list:
        raise ConnectionError("redis is down")

    def append(self, namespace: str, ids: object) -> None:
        raise ConnectionError("redis is down")


def test_a_failing_log_never_fails_a_request(caplog: pytest.LogCaptureFixture) -> None:
    log = _BrokenLog()
    synced = SyncedIndex(log, refresh_s=0)
    calls = []
    log.read_new = lambda: calls.append(1) or _BrokenLog.read_new(log)  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING):
        assert synced.add("m", ids(1))  # indexed locally
        assert len(synced.cover("m", ids(1))) == 1
        assert synced.add("m", ids(2)) and len(synced.cover("m", ids(2))) == 1
    assert caplog.text.count("redis is down") == 3  # the first read, each append
    assert len(calls) == 1  # then add and cover leave the log alone for RETRY_S
    with pytest.raises(ValueError):
        synced.add("m", [-1])


def test_a_log_that_is_no_regular_file_is_refused_at_once_and_named(tmp_path: Path) -> None:
    """Issue 59 hole 10: a FIFO in place of ``_index/records.log`` hung the server at
    "Waiting for application startup" with nothing logged (the log was opened
    blocking, with no regular-file check). Reading, appending and compacting it
    now refuse it at once, naming it; an entry file the same way."""
    import threading

    from kvrag_integrations.errors import NotRegularFileError
    from kvrag_integrations.store.disk import read_entry_file

    log = DiskIndexLog(tmp_path)
    log.path.parent.mkdir(parents=True)
    os.mkfifo(log.path)
    entry = tmp_path / "ab" / ("ab" + "0" * 62 + ".safetensors")
    entry.parent.mkdir()
    os.mkfifo(entry)
    calls = {
        "read": log.read_new,
        "append": lambda: log.append("ns", [1, 2, 3]),
        "compact": lambda: log.compact(lambda namespace, ids: True),
        "entry": lambda: read_entry_file(entry),
    }
    for name, call in calls.items():
        raised: list[BaseException] = []

        def run(call=call, raised=raised) -> None:
            try:
                call()
            except BaseException as exc:
                raised.append(exc)

        worker = threading.Thread(target=run, daemon=True)  # (a hang must not hang the run)
        worker.start()
        worker.join(10)
        assert not worker.is_alive(), f"{name}: blocked on the FIFO"
        assert raised and isinstance(raised[0], NotRegularFileError), (name, raised)
        named = str(log.path) if name != "entry" else str(entry)
        assert named in str(raised[0]) and "regular file" in str(raised[0])
