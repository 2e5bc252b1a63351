"""Disk temp files name their writer; dead writers' are reclaimed at once, live ones' never.

A "dead writer on this host" here is a temp file named for this kernel whose lock
nobody holds (what the kernel leaves when a writer dies); a "live writer" is one
whose lock another descriptor holds, as another process's would. Real SIGKILLs
and SIGSTOPs are in test_store_killed_writers.py.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.cli import main
from kvrag_integrations.store import DiskKVStore, TieredKVStore, tempfiles
from kvrag_integrations.store.maintenance import prune, summarize
from kvrag_integrations.store.tempfiles import BOOT_ID, HOST, Writer, safe_host, writer_of

FP = "fp-temp"
OTHER_BOOT = "0" * 12 if BOOT_ID != "0" * 12 else "1" * 12


def make_kv(seed: int = 0) -> ChunkKV:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, 2, 16, 8)
    keys, values = (torch.randn(shape, generator=gen) for _ in range(2))
    return ChunkKV(torch.randint(0, 32000, (16,), generator=gen), keys, values, FP)


def plant(store: DiskKVStore, nbytes: int, *, boot: str = BOOT_ID, pid: int = 4_194_305) -> Path:
    """A temp file of writer ``pid`` (beyond Linux's pid_max) on the kernel ``boot``."""
    shard = store.root / "ab"
    shard.mkdir(parents=True, exist_ok=True)
    path = shard / f".tmp-{HOST}-{boot}-{pid}-k2q9a_x7.part"
    path.write_bytes(b"x" * nbytes)
    return path


def age(path: Path, seconds: float) -> None:
    stamp = time.time() - seconds
    os.utime(path, (stamp, stamp))


@pytest.fixture()
def store(tmp_path: Path) -> DiskKVStore:
    return DiskKVStore(tmp_path / "kv")


@pytest.fixture()
def held(store: DiskKVStore) -> Iterator[Callable[[Path], None]]:
    """Lock a temp file as its (live) writer in another process would."""
    fds: list[int] = []

    def hold(path: Path) -> None:
        fds.append(os.open(path, os.O_RDONLY))
        fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)

    yield hold
    for fd in fds:
        os.close(fd)


def test_a_temp_file_names_its_writer_in_safe_characters(store: DiskKVStore) -> None:
    store.root.mkdir()
    fd, path = tempfiles.create(store.root)
    try:
        name = Path(path).name
        assert writer_of(name) == Writer(HOST, BOOT_ID, os.getpid())
        assert os.stat(path).st_mode & 0o777 == 0o644  # other users can test its lock
    finally:
        os.unlink(path)
        tempfiles.done(fd)
    for host in ("a/b", "..", "node-1.example.com", "x" * 300, "", "a\\b c\n"):
        safe = safe_host(host)
        assert 0 < len(safe) <= 64 and "/" not in safe and "-" not in safe
        assert writer_of(f".tmp-{safe}-{BOOT_ID}-7-abc.part") == Writer(safe, BOOT_ID, 7)


LISTINGS: dict[str, Callable[[DiskKVStore], object]] = {
    "keys": lambda s: list(s.keys()),
    "entries": lambda s: list(s.entries()),
    "len": len,
    "nbytes": lambda s: s.nbytes,
    "verify": lambda s: s.verify(),
    "temp_files": lambda s: s.temp_files(),
}


@pytest.mark.parametrize("listing", LISTINGS)
def test_every_listing_reclaims_a_dead_writers_temp_file_at_once(
    store: DiskKVStore, listing: str
) -> None:
    kv = make_kv()
    store.put(kv)
    dead = plant(store, 1000)  # fresh: no grace for a writer known dead
    LISTINGS[listing](store)
    assert not dead.exists() and store.get(kv.key, FP) is not None
    assert (store.stats.temp_files_reclaimed, store.stats.temp_bytes_reclaimed) == (1, 1000)
    assert store.reclaim_temp_files() == (1, 1000)  # reported once, whoever removed it
    assert store.reclaim_temp_files() == (0, 0)


def test_the_next_summary_reports_what_a_listing_reclaimed(store: DiskKVStore) -> None:
    store.put(make_kv())
    plant(store, 1000)
    assert len(store) == 1  # removes it
    summary = summarize(store)
    assert (summary.temp_files_reclaimed, summary.temp_bytes_reclaimed) == (1, 1000)
    assert summarize(store).temp_files_reclaimed == 0


def test_get_does_not_list_the_directory(store: DiskKVStore) -> None:
    kv = make_kv()
    store.put(kv)
    dead = plant(store, 10)
    assert store.get(kv.key, FP) is not None and dead.exists()


def test_a_live_writers_temp_file_is_kept_listed_and_counted_toward_max_bytes(
    store: DiskKVStore, held: Callable[[Path], None]
) -> None:
    kvs = [make_kv(i) for i in range(3)]
    for i, kv in enumerate(kvs):
        store.put(kv)
        age(store.root / kv.key[:2] / f"{kv.key}.safetensors", 300 - i)  # kvs[0] oldest
    entry = store.nbytes // 3
    live = plant(store, entry // 2, pid=1234)
    held(live)
    age(live, 3600)
    store.temp_grace_s = 0  # the lock, not the age, says it is alive
    summary = summarize(store)
    assert (summary.temp_files, summary.temp_bytes) == (1, entry // 2)
    assert summary.nbytes == 3 * entry and summary.temp_files_reclaimed == 0
    (info,) = store.temp_files()
    assert (info.name, info.nbytes) == (f"ab/{live.name}", entry // 2)
    assert (info.writer, info.alive) == (f"{HOST} pid 1234", True)

    result = prune(store, max_bytes=3 * entry)  # fits without the temp file, not with it
    assert [i.key for i in result] == [kvs[0].key]
    assert (result.temp_files, result.temp_bytes) == (1, entry // 2) and live.exists()
    result = prune(store, max_bytes=0)
    assert len(result) == 2 and len(store) == 0 and live.exists()


def test_a_writer_that_dies_is_reclaimed_by_the_next_listing(
    store: DiskKVStore, tmp_path: Path
) -> None:
    path = plant(store, 100, pid=1234)
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    assert [t.alive for t in store.temp_files()] == [True]
    os.close(fd)  # what the kernel does when the writer dies
    assert store.temp_files() == [] and not path.exists()
    assert store.reclaim_temp_files() == (1, 100)


def test_another_hosts_or_an_unnamed_writers_temp_file_waits_out_the_grace(
    store: DiskKVStore, held: Callable[[Path], None]
) -> None:
    remote = plant(store, 100, boot=OTHER_BOOT)
    unnamed = store.root / "ab" / ".tmp-x7k2q9a_.part"
    unnamed.write_bytes(b"y" * 10)
    infos = {t.name: t for t in store.temp_files()}
    assert {t.alive for t in infos.values()} == {None}
    assert infos[f"ab/{unnamed.name}"].writer is None
    assert infos[f"ab/{remote.name}"].writer == f"{HOST} pid 4194305"
    assert summarize(store).temp_bytes == 110 and prune(store, max_bytes=0) == []
    assert remote.exists() and unnamed.exists()

    locked_remote = plant(store, 7, boot=OTHER_BOOT, pid=99)
    held(locked_remote)  # a filesystem that shares locks: proof of life anywhere
    for path in (remote, unnamed, locked_remote):
        age(path, store.temp_grace_s + 1)
    assert [t.name for t in store.temp_files()] == [f"ab/{locked_remote.name}"]
    assert store.reclaim_temp_files() == (2, 110) and locked_remote.exists()


def test_this_process_in_flight_write_is_never_reclaimed(store: DiskKVStore) -> None:
    shard = store.root / "ab"
    shard.mkdir(parents=True)
    fd, path = tempfiles.create(shard)
    try:
        tempfiles.write_all(fd, b"z" * 50)
        age(Path(path), 3600)
        store.temp_grace_s = 0
        result = prune(store, max_bytes=0)
        assert (result.temp_files, result.temp_bytes, result.temp_files_reclaimed) == (1, 50, 0)
        assert Path(path).exists()
        (info,) = store.temp_files()
        assert (info.writer, info.alive) == (f"{HOST} pid {os.getpid()}", True)
    finally:
        os.unlink(path)
        tempfiles.done(fd)


def test_a_writer_whose_new_temp_file_a_sweep_took_makes_another(
    store: DiskKVStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between create and lock a temp file looks like a dead writer's; if a sweep
    removes it then, the writer notices (the file has no name) and makes another."""
    mkstemp, taken = tempfiles.tempfile.mkstemp, []

    def mkstemp_then_sweep(**kwargs: str) -> tuple[int, str]:
        fd, path = mkstemp(**kwargs)
        if not taken:
            taken.append(path)
            assert DiskKVStore(store.root).reclaim_temp_files() == (1, 0)
        return fd, path

    monkeypatch.setattr(tempfiles.tempfile, "mkstemp", mkstemp_then_sweep)
    kv = make_kv()
    store.put(kv)
    assert taken and store.get(kv.key, FP) is not None
    assert not list(store.root.glob("??/.tmp-*"))


def test_a_tiered_store_reports_its_backends_temp_files(store: DiskKVStore) -> None:
    tiered = TieredKVStore(store, max_bytes=1 << 20)
    tiered.put(make_kv())
    plant(store, 1000)
    plant(store, 10, boot=OTHER_BOOT)
    summary = summarize(tiered)
    assert (summary.temp_files, summary.temp_bytes) == (1, 10)
    assert (summary.temp_files_reclaimed, summary.temp_bytes_reclaimed) == (1, 1000)


def test_the_store_commands_report_temp_files_apart_and_reclaimed(
    capsys: pytest.CaptureFixture[str], store: DiskKVStore, held: Callable[[Path], None]
) -> None:
    url = f"disk:{store.root}"
    store.put(make_kv())
    entry = store.nbytes
    held(plant(store, 300, pid=1234))
    plant(store, 1000, pid=5678)
    assert main(["store", "stats", "--store", url]) == 0
    out = capsys.readouterr().out
    assert f"bytes {entry} (" in out and "temp files 1, 300 bytes (300 B)" in out
    assert "reclaimed 1 temp files of dead writers, 1000 bytes (1000 B)" in out

    plant(store, 2000, pid=5678)
    assert main(["store", "verify", "--store", url]) == 0
    out = capsys.readouterr().out
    assert f"300 bytes (300 B), writer {HOST} pid 1234: alive" in out
    assert "reclaimed 1 temp files of dead writers, 2000 bytes" in out

    plant(store, 4000, pid=5678)
    assert main(["store", "prune", "--store", url, "--max-bytes", str(entry)]) == 0
    out = capsys.readouterr().out
    assert "reclaimed 1 temp files of dead writers, 4000 bytes" in out
    assert "kept 1 temp files of writes in flight, 300 bytes (300 B) (counted toward" in out
    assert "evicted 1 entries" in out and "0 entries remain" in out
