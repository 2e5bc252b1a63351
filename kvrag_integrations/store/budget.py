"""How many bytes an in-memory tier of chunk caches may hold: a share of what is free.

A fixed 2 GiB held about 16k tokens of an 8B model's caches (128 KiB per token
at float16), so beyond one long prompt's worth every request evicted the chunks
it needed and answered by full prefill. The default engine's store and the
memory tier of ``TieredKVStore`` are therefore sized when made from the memory
free where they keep entries: a quarter of the host's available memory, or
half of a CUDA device's free memory (measured after the weights are loaded; the
other half is for prompt caches and activations).
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

#: The share of available host memory an in-memory store takes.
HOST_FRACTION = 0.25
#: The share of a CUDA device's free memory a store of device entries takes.
DEVICE_FRACTION = 0.5
#: Never less than this, whatever is free (a store must hold a few prompts).
MIN_BYTES = 256 * 2**20
#: When free memory cannot be read.
FALLBACK_BYTES = 2 * 2**30


def memory_budget(device: str | torch.device | None = None) -> int:
    """Bytes for a memory store keeping entries on ``device`` (None: the host).

    Examples:
        >>> memory_budget("cpu") >= MIN_BYTES
        True
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        share = DEVICE_FRACTION
    else:
        free = available_host_memory()
        share = HOST_FRACTION
    if free is None:
        logger.debug("free memory unknown; memory store bounded at %d bytes", FALLBACK_BYTES)
        return FALLBACK_BYTES
    return max(MIN_BYTES, int(free * share))


def available_host_memory() -> int | None:
    """Bytes the host can give without swapping (``MemAvailable``), or less where a
    cgroup (a container's memory limit) leaves less; None when unknown."""
    available = _meminfo_available()
    limit = _cgroup_room()
    if available is None or limit is None:
        return available if limit is None else limit
    return min(available, limit)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_room() -> int | None:
    """cgroup v2's ``memory.max - memory.current`` (None: no limit, or not v2)."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as f:
            return max(0, int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        return None


__all__ = ["memory_budget"]
