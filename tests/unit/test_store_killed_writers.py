"""Disk writers killed or stopped mid-write, for real (SIGKILL, SIGSTOP), ~46 MB entries.

One launcher process imports the package once and forks a writer per round;
each writer stores one entry whole, then a second one through a slow disk (1 MiB
per write call), during which this test kills or stops it. What must hold: the
next ``stats`` or ``prune`` removes every dead writer's temp file and reports
its bytes; a stopped (live) writer's temp file is never removed, and its entry
lands once it resumes; every complete entry verifies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrag_integrations.store import DiskKVStore
from kvrag_integrations.store.maintenance import find_corrupt, prune, summarize
from kvrag_integrations.store.tempfiles import HOST

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="forks writers and reads their state from /proc"
)
FP = "fp-killed"
ENTRY_MB = 46

LAUNCHER = r"""
import os, sys, time
import torch
torch.set_num_threads(1)  # no thread pool: the writers are forked from this process
from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.store import DiskKVStore

entry_mb, fp = float(sys.argv[1]), sys.argv[2]
layers, heads, dim = 24, 2, 64
n = int(entry_mb * 2**20) // (2 * 4 * layers * heads * dim)  # keys + values, float32
gen = torch.Generator().manual_seed(0)
keys = torch.randn(layers, heads, n, dim, generator=gen)
values = torch.randn(layers, heads, n, dim, generator=gen)

def entry(i):
    return ChunkKV(torch.arange(n) + i * n, keys, values, fp)

real_write = os.write

def slow_write(fd, data):  # a slow disk: 1 MiB per call, a moment each
    time.sleep(0.005)
    return real_write(fd, memoryview(data)[: 1 << 20])

for line in sys.stdin:  # "<round> <store root>": fork one writer
    i, root = int(line.split(" ", 1)[0]), line.rstrip("\n").split(" ", 1)[1]
    whole, partial = entry(2 * i), entry(2 * i + 1)
    pid = os.fork()
    if pid == 0:
        DiskKVStore(root).put(whole)
        os.write = slow_write
        DiskKVStore(root).put(partial)
        os._exit(0)
    print("writer", pid, whole.key, partial.key, flush=True)
    _, status = os.waitpid(pid, 0)
    print("exit", pid, os.waitstatus_to_exitcode(status), flush=True)
"""


class Launcher:
    def __init__(self) -> None:
        self.root = Path()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, str(ENTRY_MB), FP],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.rounds = 0

    def _line(self, word: str) -> list[str]:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                pytest.fail(f"the launcher died (exit {self.proc.wait()})")
            if line.startswith(word + " "):
                return line.split()[1:]

    def start_writer(self) -> tuple[int, str, str]:
        """Fork a writer; return its pid, its whole entry's key and its partial one's."""
        self.proc.stdin.write(f"{self.rounds} {self.root}\n")
        self.proc.stdin.flush()
        self.rounds += 1
        pid, whole, partial = self._line("writer")
        return int(pid), whole, partial

    def wait_writer(self, pid: int) -> int:
        """The writer's exit code (``-9``: killed by SIGKILL)."""
        got, code = self._line("exit")
        assert int(got) == pid
        return int(code)

    def landed(self, key: str) -> bool:
        return (self.root / key[:2] / f"{key}.safetensors").exists()

    def mid_write(self, pid: int, whole: str, partial: str) -> Path | None:
        """Wait until the writer stored ``whole`` and its temp file for ``partial`` grows
        (still in its first half); ``None`` if ``partial`` landed before that was seen."""
        pattern = f"{partial[:2]}/.tmp-{HOST}-*-{pid}-*.part"
        deadline, last = time.monotonic() + 120, -1
        while time.monotonic() < deadline:  # a guard against a hang, not a timing check
            if self.landed(partial):
                return None
            temps = list(self.root.glob(pattern)) if self.landed(whole) else []
            size = temps[0].stat().st_size if temps else -1
            if 0 < last < size < ENTRY_MB * 2**20 // 2:
                return temps[0]
            last = size
            time.sleep(0.002)
        pytest.fail(f"writer {pid} never got mid-write")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def shared_launcher() -> Iterator[Launcher]:
    launcher = Launcher()  # imports torch and the package once for the module
    yield launcher
    launcher.close()


@pytest.fixture()
def launcher(shared_launcher: Launcher, tmp_path: Path) -> Launcher:
    shared_launcher.root = tmp_path / "kv"
    return shared_launcher


def kill_mid_write(launcher: Launcher, rounds: int) -> tuple[list[str], dict[Path, int]]:
    """SIGKILL ``rounds`` writers mid-write; return the keys of the entries that
    landed and the temp files the writers left (path -> bytes)."""
    landed, left = [], {}
    for _ in range(3 * rounds):
        pid, whole, partial = launcher.start_writer()
        part = launcher.mid_write(pid, whole, partial)
        if part is not None:
            os.kill(pid, signal.SIGKILL)
        code = launcher.wait_writer(pid)
        landed += [key for key in (whole, partial) if launcher.landed(key)]
        if part is None or not part.exists():  # finished first (a busy machine): again
            continue
        assert code == -signal.SIGKILL and not launcher.landed(partial)
        left[part] = part.stat().st_size
        if len(left) == rounds:
            break
    assert len(left) == rounds
    return landed, left


def wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + 60  # a guard against a hang, not a timing check
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"writer {pid} did not stop"
        time.sleep(0.001)


def test_stats_and_prune_reclaim_every_temp_file_of_writers_killed_mid_write(
    launcher: Launcher,
) -> None:
    wholes, left = kill_mid_write(launcher, 10)
    assert len(left) == 10 and all(0 < size < ENTRY_MB * 2**20 for size in left.values())

    store = DiskKVStore(launcher.root)  # fresh, as `kvrag store stats` is
    summary = summarize(store)
    assert (summary.temp_files_reclaimed, summary.temp_bytes_reclaimed) == (10, sum(left.values()))
    assert (summary.temp_files, summary.temp_bytes) == (0, 0)
    assert not list(launcher.root.glob("??/.tmp-*"))
    assert summary.entries == len(wholes) and sorted(store.keys()) == sorted(wholes)
    assert find_corrupt(store) == []
    assert all(store.get(key, FP) is not None for key in wholes)
    assert summarize(store).temp_files_reclaimed == 0  # reported once

    more, left = kill_mid_write(launcher, 3)
    result = prune(DiskKVStore(launcher.root), max_bytes=10**15)
    assert result == [] and (result.temp_files, result.temp_bytes) == (0, 0)
    assert (result.temp_files_reclaimed, result.temp_bytes_reclaimed) == (3, sum(left.values()))
    assert not list(launcher.root.glob("??/.tmp-*"))
    assert find_corrupt(store) == [] and sorted(store.keys()) == sorted(wholes + more)


def test_a_stopped_writer_keeps_its_temp_file_through_prune_and_its_entry_lands(
    launcher: Launcher,
) -> None:
    for _ in range(3):
        pid, whole, partial = launcher.start_writer()
        part = launcher.mid_write(pid, whole, partial)
        if part is not None:
            break
        assert launcher.wait_writer(pid) == 0  # finished first (a busy machine): again
    assert part is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_stopped(pid)  # a write call in progress finishes first
        size = part.stat().st_size
        old = time.time() - 3600
        os.utime(part, (old, old))  # untouched for an hour: past any grace
        store = DiskKVStore(launcher.root)
        store.temp_grace_s = 0
        result = prune(store, max_bytes=0)
        assert whole in {info.key for info in result} and len(store) == 0  # not the temp file
        assert (result.temp_files, result.temp_bytes) == (1, size)
        assert result.temp_files_reclaimed == 0 and part.exists()
        (temp,) = store.temp_files()
        assert (temp.writer, temp.alive, temp.nbytes) == (f"{HOST} pid {pid}", True, size)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert launcher.wait_writer(pid) == 0
    assert not part.exists() and store.check(partial) is None
    assert store.get(partial, FP) is not None and list(store.keys()) == [partial]
    assert store.reclaim_temp_files() == (0, 0)
