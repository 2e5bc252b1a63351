"""Opening a store's files without trusting what is there: only regular files.

A store's directory can be reached by others (a shared disk): a FIFO or a device
where an entry or the content index's log should be would block a reader's
``open`` for ever, or feed it without end. ``open_regular`` refuses them at
once, naming the file. The store's entries and ``matching``'s index log (which
imports it lazily: it imports no torch) share it.
"""

from __future__ import annotations

import os
import stat

from kvrag_integrations.errors import NotRegularFileError


def open_regular(
    path: str | os.PathLike[str],
    flags: int = os.O_RDONLY,
    mode: int = 0o644,
    *,
    follow: bool = False,
    what: str = "entry file",
) -> tuple[int, int]:
    """``(fd, size)`` of ``path`` opened with ``flags`` if it is a regular file (not a
    FIFO or device; nor a symlink unless ``follow``), the descriptor blocking.

    O_NOFOLLOW refuses a symlink and O_NONBLOCK keeps a FIFO from blocking the
    open (a reader's open of a FIFO waits for a writer, and the other way round);
    fstat then checks what was opened.

    Raises:
        FileNotFoundError: no such file (and no ``O_CREAT``).
        NotRegularFileError: anything else than a regular file, named.
    """
    nofollow = 0 if follow else getattr(os, "O_NOFOLLOW", 0)
    extra = nofollow | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | extra, mode)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP for a symlink, ENXIO for a FIFO no one reads, ...
        why = f"the {what} {path} is not a regular file one can open safely: {exc}"
        raise NotRegularFileError(why) from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise NotRegularFileError(f"the {what} {path} is not a regular file: refused")
    os.set_blocking(fd, True)
    return fd, info.st_size
