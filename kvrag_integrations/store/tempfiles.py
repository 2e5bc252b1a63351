"""Temp files of disk writes: each names its writer and is locked by it while it lives.

``DiskKVStore`` writes an entry to ``<shard>/.tmp-<host>-<boot>-<pid>-<random>.part``
and renames it into place. A writer killed before the rename (SIGKILL, an OOM
kill, a container stop) leaves that file behind; ``sweep`` finds such files and
removes them:

- the writer ran on this kernel (same ``boot`` id) and no longer holds the
  file's lock: it is dead, and the file is removed at once;
- the writer holds the lock: it is alive (stopped, slow, or on another host of
  a filesystem that shares locks), and the file is never touched;
- otherwise (another host, a name without a writer from an older version, a
  filesystem without locks): the writer may be alive, so the file is removed
  only once it has not been written to for ``grace_s`` seconds.

Why a lock rather than pid + process start time: the kernel drops an
``flock`` when its holder dies, whatever killed it, so a reused pid never
looks alive; the lock is kernel-wide, so it also holds across pid namespaces
(containers on one host sharing a volume, where a pid names another process
or none, and ``/proc/<pid>`` cannot be read); and a held lock proves life
even where the filesystem shares locks between hosts. The pid and host in the
name are for people (``kvrag store verify`` lists them); the boot id says
whether this kernel's locks are authoritative for the file. (A child forked
during a write inherits the lock: the file then lives until both exit.)
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvrag_integrations.store.base import TempFileInfo

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no locks, every temp file waits out the grace
    fcntl = None  # type: ignore[assignment]

PREFIX = ".tmp-"
SUFFIX = ".part"
# A writer that may still be alive (another host) finishes a write in well under this.
STALE_TEMP_S = 600.0

_NAME_RE = re.compile(
    r"\.tmp-(?P<host>[A-Za-z0-9._]{1,64})-(?P<boot>[0-9a-f]{12})-(?P<pid>[0-9]{1,10})-"
    r"[a-z0-9_]+\.part"
)


def safe_host(name: str) -> str:
    """``name`` fit for a file name field: ``[A-Za-z0-9._]`` only, at most 64 characters.

    Examples:
        >>> safe_host("node-1.example/../x y")
        'node_1.example_.._x_y'
    """
    return re.sub(r"[^A-Za-z0-9.]", "_", name)[:64] or "host"


def _boot_id() -> str:
    """This kernel's boot id (12 hex digits): the same in every container on it, new
    at each boot. Without one (no ``/proc``: macOS), a random id of this process:
    then no other writer counts as on this kernel, and theirs wait out the grace
    (a host name could be shared by machines whose locks are not)."""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")
        if re.fullmatch(r"[0-9a-f]{32}", boot):
            return boot[:12]
    return secrets.token_hex(6)


HOST = safe_host(socket.gethostname())
BOOT_ID = _boot_id()

# (device, inode) of the temp files this process is writing now. A sweep never
# opens our own: where flock is emulated with POSIX locks (NFS), closing any
# descriptor of a file drops every lock this process holds on it.
_writing: set[tuple[int, int]] = set()
_writing_lock = threading.Lock()


@dataclass(frozen=True)
class Writer:
    """Who wrote a temp file, read from its name."""

    host: str
    boot: str
    pid: int

    def __str__(self) -> str:
        return f"{self.host} pid {self.pid}"


def writer_of(name: str) -> Writer | None:
    """The writer a temp file's name records; ``None`` for a name without one.

    Examples:
        >>> writer_of(".tmp-node_1-0123456789ab-4242-x7_k2q9a.part")
        Writer(host='node_1', boot='0123456789ab', pid=4242)
        >>> writer_of(".tmp-x7_k2q9a.part") is None  # an older version's temp file
        True
    """
    match = _NAME_RE.fullmatch(name)
    if match is None:
        return None
    return Writer(match["host"], match["boot"], int(match["pid"]))


def create(directory: Path) -> tuple[int, str]:
    """Create a temp file in ``directory`` named after this process, and lock it.

    Returns ``(fd, path)``; the lock lasts until ``fd`` is closed (or the process
    dies). Call :func:`done` with ``fd`` once the file is renamed or removed.
    """
    prefix = f"{PREFIX}{HOST}-{BOOT_ID}-{os.getpid()}-"
    for _ in range(100):
        fd, path = tempfile.mkstemp(prefix=prefix, suffix=SUFFIX, dir=directory)
        try:
            info = os.fstat(fd)
            with _writing_lock:  # this process's sweeps leave it alone from now on
                _writing.add((info.st_dev, info.st_ino))
            os.fchmod(fd, 0o644)  # mkstemp makes 0600: let other users read, and sweep
            if fcntl is not None:
                with contextlib.suppress(OSError):  # no locks here: the grace protects it
                    # Blocks only while another process's sweep holds it: the moment
                    # between our create and this lock, when it looks like a dead writer's.
                    fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink:  # not removed by such a sweep: ours
                return fd, path
        except BaseException:
            done(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        done(fd)  # a sweep took it for a dead writer's: make another
    raise OSError(f"cannot create a temp file in {directory}: each was removed meanwhile")


def done(fd: int) -> None:
    """Release the file made by :func:`create` (after its rename or removal)."""
    try:
        info = os.fstat(fd)
        with _writing_lock:
            _writing.discard((info.st_dev, info.st_ino))
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write every byte of ``data`` to ``fd`` (``os.write`` may write fewer)."""
    view, done_bytes = memoryview(data).cast("B"), 0
    while done_bytes < len(view):
        done_bytes += os.write(fd, view[done_bytes : done_bytes + (1 << 26)])


def _try_lock(fd: int) -> bool | None:
    """True: we got the lock (nobody holds it); False: a writer holds it; None: no locks."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def inspect(path: Path, name: str, *, grace_s: float, now: float) -> TempFileInfo | int | None:
    """Remove the temp file at ``path`` if its writer is gone.

    Returns the bytes removed (an ``int``), the file's ``TempFileInfo`` if it is
    kept, or ``None`` if it vanished meanwhile (its write finished).
    """
    writer = writer_of(path.name)
    here = writer is not None and writer.boot == BOOT_ID
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None
    if (info.st_dev, info.st_ino) in _writing:  # this process is writing it
        return TempFileInfo(name, info.st_size, info.st_mtime, _label(writer), True)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK | os.O_CLOEXEC
    fd: int | None = None
    try:
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            return None
        except OSError:  # a symlink, no permission: cannot test the lock
            fd = None
        info = os.fstat(fd) if fd is not None else path.lstat()
        regular = stat.S_ISREG(info.st_mode)
        lock = _try_lock(fd) if fd is not None and regular else None
        if lock is False:
            return TempFileInfo(name, info.st_size, info.st_mtime, _label(writer), True)
        # A free lock proves death only for a writer on this kernel (ours are
        # kernel-wide); elsewhere it may mean the filesystem shares no locks.
        gone = (lock is True and here) or now - info.st_mtime >= grace_s
        if not gone:
            return TempFileInfo(name, info.st_size, info.st_mtime, _label(writer), None)
        # Still under our lock: a writer that created the file but has not locked it
        # yet finds it unlinked once it gets the lock, and makes another.
        if fd is not None and path.lstat().st_ino != info.st_ino:
            return None  # the name now points at another file: leave it
        path.unlink()
        return info.st_size if regular else 0
    except FileNotFoundError:
        return None
    finally:
        if fd is not None:
            os.close(fd)


def _label(writer: Writer | None) -> str | None:
    return None if writer is None else str(writer)


def sweep(
    paths: list[tuple[Path, str]], *, grace_s: float = STALE_TEMP_S
) -> tuple[list[TempFileInfo], int, int]:
    """Inspect each ``(path, name)``; return ``(kept, files removed, bytes removed)``."""
    kept: list[TempFileInfo] = []
    removed = removed_bytes = 0
    now = time.time()
    for path, name in paths:
        try:
            outcome = inspect(path, name, grace_s=grace_s, now=now)
        except OSError:  # cannot remove it (read-only store): count it as kept
            with contextlib.suppress(OSError):
                info = path.lstat()
                kept.append(TempFileInfo(name, info.st_size, info.st_mtime, None, None))
            continue
        if isinstance(outcome, TempFileInfo):
            kept.append(outcome)
        elif outcome is not None:
            removed += 1
            removed_bytes += outcome
    return kept, removed, removed_bytes


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a temp file's (this version's or an older one's)."""
    return name.startswith(PREFIX) and name.endswith(SUFFIX)
