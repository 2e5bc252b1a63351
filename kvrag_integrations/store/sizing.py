"""The budget of a server's shared store when none is given: a share of what it has.

A server started without ``--max-store-bytes`` is bounded all the same
(``store_budget``): half of what its disk could give a disk store (free space
plus what the store holds), 80% of Redis's ``maxmemory`` for a Redis store (a
quarter of the Redis host's memory where ``maxmemory`` is 0), summed over the
primaries of a Redis Cluster (``redis_capacities``: each primary's own bound).
"""

from __future__ import annotations

import contextlib
import shutil

from kvrag_integrations.store.budget import FALLBACK_BYTES, HOST_FRACTION
from kvrag_integrations.store.disk import DiskKVStore
from kvrag_integrations.store.memory import MemoryKVStore
from kvrag_integrations.store.redis import RedisKVStore
from kvrag_integrations.store.redis_client import primaries_memory
from kvrag_integrations.store.tiered import TieredKVStore

#: The share of its disk a disk store may hold (of free space plus what it holds).
DISK_FRACTION = 0.5
#: The share of Redis's ``maxmemory`` a Redis store may hold (the rest: Redis's
#: own overhead per key, and whatever else the server holds).
REDIS_FRACTION = 0.8


def store_budget(store: object) -> tuple[int, str]:
    """A budget for ``store`` in bytes, and how it was chosen (for the log).

    - ``DiskKVStore``: ``DISK_FRACTION`` of the free space on its file system
      plus what the store (and its index log) already holds there, so that a
      restart over a full store finds the same budget;
    - ``RedisKVStore``: ``REDIS_FRACTION`` of the server's ``maxmemory``; where
      that is 0 (no limit: Redis grows until the host runs out),
      ``HOST_FRACTION`` of the server host's memory (``INFO``'s
      ``total_system_memory``); ``FALLBACK_BYTES`` if neither can be read. On
      a Redis Cluster, the sum of that over its primaries;
    - a memory store: its own bound; a tiered store: its backend's.

    No floor: a budget past what the store can give would fail its writes.
    """
    if isinstance(store, TieredKVStore):
        return store_budget(store.backend)
    if isinstance(store, DiskKVStore):
        nbytes, why = _disk_budget(store)
    elif isinstance(store, RedisKVStore):
        nbytes, why = _redis_budget(store)
    elif isinstance(store, MemoryKVStore) and store.max_bytes:
        nbytes, why = store.max_bytes, "the memory store's own bound"
    else:
        nbytes, why = FALLBACK_BYTES, f"a fixed default (a {type(store).__name__} cannot tell)"
    return max(1, nbytes), why


def _disk_budget(store: DiskKVStore) -> tuple[int, str]:
    root = store.root
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    held = 0
    if root.is_dir():
        for path in root.rglob("*"):
            with contextlib.suppress(OSError):
                if path.is_file():
                    held += path.stat().st_size
    nbytes = int(DISK_FRACTION * (free + held))
    why = f"{DISK_FRACTION:.0%} of {existing}'s {free} free bytes plus the store's {held}"
    return nbytes, why


def _redis_budget(store: RedisKVStore) -> tuple[int, str]:
    try:
        capacities = redis_capacities(store)
    except Exception as exc:  # unreachable: the connector's writes will say so too
        return FALLBACK_BYTES, f"a fixed default (redis unreachable: {exc})"
    if len(capacities) == 1:
        return next(iter(capacities.values()))
    total = sum(nbytes for nbytes, _ in capacities.values())
    each = "; ".join(f"{name}: {why}" for name, (_, why) in sorted(capacities.items()))
    return total, f"the sum over {len(capacities)} cluster primaries ({each})"


def redis_capacities(store: RedisKVStore) -> dict[str, tuple[int, str]]:
    """Each primary's bound (one for a single server, by node name ``host:port``
    on a cluster), with how it was chosen; raises redis' errors when unreachable.

    Primaries without ``maxmemory`` on one host share its ``HOST_FRACTION``.
    """
    memory = primaries_memory(store.client)
    unbounded: dict[str, int] = {}
    for name, info in memory.items():
        if info["maxmemory"] <= 0:
            host = name.rpartition(":")[0]
            unbounded[host] = unbounded.get(host, 0) + 1
    out = {}
    for name, info in memory.items():
        maxmemory, system = info["maxmemory"], info["total_system_memory"]
        if maxmemory > 0:
            why = f"{REDIS_FRACTION:.0%} of redis maxmemory {maxmemory}"
            out[name] = (int(REDIS_FRACTION * maxmemory), why)
        elif system > 0:
            sharing = unbounded[name.rpartition(":")[0]]
            why = f"{HOST_FRACTION:.0%} of the redis host's {system} bytes (redis maxmemory is 0)"
            if sharing > 1:
                why += f", shared by {sharing} primaries"
            out[name] = (int(HOST_FRACTION * system / sharing), why)
        else:
            why = "a fixed default (redis reports no maxmemory nor host memory)"
            out[name] = (FALLBACK_BYTES, why)
    return out
