"""Reading a prompt's chunk caches: concurrently, and ahead of the request when asked.

A disk or Redis read waits on I/O, and verifying and decoding an entry runs in
code that releases the GIL (xxh3 / HMAC over the payload, torch copies), so a
prompt's chunks are read on a few threads at once rather than one after another.
Stores that answer from process memory are read inline: a thread would only add
overhead.

``prefetch`` starts those reads before the request needs them: when a retriever
returns its nodes (the adapters' hooks call it), the caches load while the
framework formats the prompt. A request then takes what is staged for its keys
(waiting for a read still in flight rather than starting a second one). Staged
reads are bounded (``max_staged``, the oldest dropped) and expire after
``ttl_s`` if no request takes them, so a prefetch nobody uses holds no memory
for long. A prefetched entry is exactly what the store's ``get`` returns, so
prefetch never changes an answer.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.store import KVStore

_LIVE: weakref.WeakSet[ChunkLoader] = weakref.WeakSet()

StagedKey = tuple[int, str, str]  # (id(store), fingerprint, cache key)


class ChunkLoader:
    """Reads chunk caches from a store, several at a time, and ahead of time.

    Args:
        max_workers: threads reading at once.
        max_staged: most prefetched reads held (in flight or done, not yet taken).
        ttl_s: seconds a prefetched read waits for a request before it is dropped.
    """

    def __init__(self, max_workers: int = 4, max_staged: int = 64, ttl_s: float = 10.0) -> None:
        if max_workers < 1 or max_staged < 0 or ttl_s <= 0:
            raise ValueError("max_workers must be >= 1, max_staged >= 0 and ttl_s > 0")
        self.max_workers = max_workers
        self.max_staged = max_staged
        self.ttl_s = ttl_s
        self._pool: ThreadPoolExecutor | None = None
        self._staged: OrderedDict[StagedKey, tuple[float, Future]] = OrderedDict()
        self._lock = threading.Lock()
        self.prefetched = 0  # reads started by prefetch
        self.taken = 0  # prefetched reads a request used
        self.expired = 0  # prefetched reads dropped unused (too old, or over max_staged)
        _LIVE.add(self)

    @property
    def staged(self) -> int:
        """Prefetched reads held now (in flight or done)."""
        with self._lock:
            return len(self._staged)

    def prefetch(self, store: KVStore, fingerprint: str, keys: Sequence[str]) -> int:
        """Start reading ``keys`` from ``store`` in the background; returns how many started.

        Only stores whose reads wait on I/O (``store.parallel_reads``) are read
        ahead; keys already staged are not read twice.
        """
        if not store.parallel_reads or self.max_staged == 0:
            return 0
        started = 0
        with self._lock:
            self._expire(time.monotonic())
            for key in dict.fromkeys(keys):
                staged_key = (id(store), fingerprint, key)
                if staged_key in self._staged:
                    continue
                while len(self._staged) >= self.max_staged:
                    self._drop_oldest()
                future = self._executor().submit(store.get, key, fingerprint)
                self._staged[staged_key] = (time.monotonic(), future)
                started += 1
            self.prefetched += started
        return started

    def get_many(
        self, store: KVStore, fingerprint: str, keys: Sequence[str]
    ) -> dict[str, ChunkKV | None]:
        """``{key: store.get(key, fingerprint)}`` for ``keys``: staged reads first, the
        rest concurrently where the store's reads wait on I/O."""
        keys = list(dict.fromkeys(keys))
        futures: dict[str, Future] = {}
        with self._lock:
            self._expire(time.monotonic())  # a request also drops what nobody took
            for key in keys:
                item = self._staged.pop((id(store), fingerprint, key), None)
                if item is not None:
                    futures[key] = item[1]
                    self.taken += 1
        rest = [k for k in keys if k not in futures]
        if store.parallel_reads and len(rest) > 1:
            pool = self._executor()
            futures.update({k: pool.submit(store.get, k, fingerprint) for k in rest})
            rest = []
        found = {k: store.get(k, fingerprint) for k in rest}
        found.update({k: f.result() for k, f in futures.items()})
        return {k: found[k] for k in keys}

    def close(self) -> None:
        """Drop staged reads and stop the threads (reads in flight finish)."""
        with self._lock:
            while self._staged:
                self._drop_oldest()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="kvrag-loader")
        return self._pool

    def _expire(self, now: float) -> None:
        while self._staged:
            started, _ = next(iter(self._staged.values()))
            if now - started < self.ttl_s:
                return
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, (_, future) = self._staged.popitem(last=False)
        future.cancel()  # not started yet: never read; done: its entry is freed with it
        self.expired += 1


@atexit.register
def _close_all() -> None:
    for loader in list(_LIVE):
        loader.close()
