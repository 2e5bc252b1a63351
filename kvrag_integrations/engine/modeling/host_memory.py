"""Keep freed host memory in the process for the next request (CPU, glibc).

Each request on CPU allocates its prompt cache (``PromptKV.empty`` in
``forward.py``: per-layer float32 tensors of a few MB, ~190 MB in all for 16
chunks of 256 tokens on SmolLM2-135M) and frees it at the end. glibc's default
thresholds are dynamic: blocks of that size are mmapped or, once freed, trimmed
back to the OS, so the next request page-faults the whole cache afresh (~20 ms
per 100 MB). Measured with ``python -m kvrag_integrations.bench scaling --items
3 --counts 16 --lengths 256 --chunk-tokens 256 --repeats 3``: turbo's TTFT was
404 ms against a 160 ms floor (2.53x) in a plain process, and 162 ms against
136 ms (1.19x) with ``MALLOC_MMAP_THRESHOLD_=33554432
MALLOC_TRIM_THRESHOLD_=17179869184``; worst after a full prefill has freed
large blocks.

:func:`keep_freed_memory` sets the same kind of fixed thresholds with
``mallopt``: blocks under 32 MiB come from the heap and the process keeps up to
1 GiB of freed memory for reuse instead of returning it to the OS (RSS stays
high after a request); blocks of 32 MiB or more are still mmapped and returned
when freed. A fixed mmap threshold also stops glibc from moving it.
``load_model`` calls it for CPU models; ``KVRAG_KEEP_FREED_MEMORY=0`` turns it
off.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from typing import Any

logger = logging.getLogger(__name__)

#: ``mallopt`` parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

#: Blocks at or over this size are mmapped (and returned to the OS when freed);
#: glibc's maximum on 64-bit.
MMAP_THRESHOLD = 32 * 1024 * 1024
#: Free memory at the top of the heap up to this size is kept, not trimmed.
TRIM_THRESHOLD = 1024 * 1024 * 1024

#: Setting this to "0" or "false" turns :func:`keep_freed_memory` off.
OPT_OUT_ENV = "KVRAG_KEEP_FREED_MEMORY"
#: glibc's own malloc settings: a user who set any of these has chosen.
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
#: The same settings as glibc tunables (``GLIBC_TUNABLES=glibc.malloc.…``).
MALLOC_TUNABLES = (
    "glibc.malloc.mmap_threshold",
    "glibc.malloc.trim_threshold",
    "glibc.malloc.top_pad",
)
#: Allocators that replace glibc's malloc when preloaded.
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

_applied = False


@functools.cache
def _libc() -> Any:
    """The process's glibc (``CDLL(None)``), or None when it is not glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    # gnu_get_libc_version is glibc's own; musl has a no-op mallopt too.
    if not (hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt")):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def _skip_reason() -> str | None:
    if os.environ.get(OPT_OUT_ENV, "").strip().lower() in ("0", "false"):
        return f"{OPT_OUT_ENV}={os.environ[OPT_OUT_ENV]}"
    for name in MALLOC_ENV:
        if name in os.environ:
            return f"{name} is set"
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    for name in MALLOC_TUNABLES:
        if name in tunables:
            return f"GLIBC_TUNABLES sets {name}"
    preload = os.environ.get("LD_PRELOAD", "").lower()
    for name in OTHER_ALLOCATORS:
        if name in preload:
            return f"LD_PRELOAD names {name}"
    return None


def keep_freed_memory() -> bool:
    """Keep freed memory below 1 GiB in the process for the next request.

    Applies once per process; later calls return True without calling
    ``mallopt`` again.

    Returns:
        True when the thresholds are in effect; False when skipped: not glibc,
        ``KVRAG_KEEP_FREED_MEMORY`` is "0" or "false", the user set glibc's
        malloc thresholds (``MALLOC_*_`` or ``GLIBC_TUNABLES``), ``LD_PRELOAD``
        names jemalloc, tcmalloc or mimalloc, or ``mallopt`` refused.
    """
    global _applied
    if _applied:
        return True
    reason = _skip_reason()
    if reason is None and _libc() is None:
        reason = "not glibc"
    if reason is not None:
        logger.debug("freed host memory not kept: %s", reason)
        return False
    libc = _libc()
    # mallopt returns 1 on success, 0 on a value out of range.
    if not libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        logger.debug("freed host memory not kept: mallopt(M_MMAP_THRESHOLD) refused")
        return False
    if not libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        logger.debug("freed host memory not kept: mallopt(M_TRIM_THRESHOLD) refused")
        return False
    _applied = True
    logger.debug(
        "keeping freed host memory: mmap threshold %d, trim threshold %d",
        MMAP_THRESHOLD,
        TRIM_THRESHOLD,
    )
    return True
