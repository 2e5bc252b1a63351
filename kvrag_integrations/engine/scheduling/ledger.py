"""EncodeLedger: the encodings an engine has started or queued, one future per key.

Both engines encode chunks off the request path and must not encode one twice:
``KVRAGEngine``'s ``BackgroundEncoder`` (its worker thread and the requests that
take its queue over) and ``VLLMEngine`` (encode requests on a thread pool). Each
keeps its encodings here: a key (a store key, or an entry's token ids) holds the
``concurrent.futures.Future`` of its encoding until that ends. A future not
started yet is *queued* (its owner may still take it over or cancel it); a
running one is *in flight* (wait for it).

Bounded: past ``max_pending`` queued encodings a new one is skipped (counted in
``dropped``; a later request asks again), never an error. ``wait`` takes a
timeout; ``cancel`` and ``close`` drop what has not started.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from functools import partial
from typing import Any, Generic, TypeVar

logger = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)

__all__ = ["EncodeLedger"]


class EncodeLedger(Generic[K]):
    """Encodings by key: at most one per key at a time, at most ``max_pending`` queued.

    Thread-safe. ``cond`` is the ledger's (re-entrant) condition: an owner that
    reads and changes several entries as one step holds it (``BackgroundEncoder``
    does); it is notified whenever an entry is added or ends.

    Examples:
        >>> from concurrent.futures import Future
        >>> ledger = EncodeLedger(max_pending=1)
        >>> ledger.add("a", Future()), ledger.add("a", Future()), ledger.add("b", Future())
        (True, False, False)
        >>> ledger.dropped, ledger.wait(timeout=0.01), ledger.cancel(), len(ledger)
        (1, False, 1, 0)
    """

    def __init__(self, max_pending: int = 256) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self.dropped = 0  # encodings skipped: the ledger was full
        self.cond = threading.Condition(threading.RLock())
        self._futures: dict[K, Future[Any]] = {}  # in the order they were added
        self._closed = False

    def __len__(self) -> int:
        """Encodings queued or in flight."""
        with self.cond:
            return len(self._futures)

    def get(self, key: K) -> Future[Any] | None:
        """``key``'s encoding if it is queued or in flight, else None."""
        with self.cond:
            future = self._futures.get(key)
            return None if future is None or future.done() else future

    def queued(self) -> list[K]:
        """Keys whose encoding has not started, oldest first."""
        with self.cond:
            return [k for k, f in self._futures.items() if not (f.running() or f.done())]

    def pending(self, keys: Iterable[K]) -> dict[K, Future[Any]]:
        """Those of ``keys`` whose encoding is queued or in flight, with its future."""
        with self.cond:
            return {k: f for k in keys if (f := self.get(k)) is not None}

    def add(self, key: K, future: Future[Any]) -> bool:
        """Hold ``future`` as ``key``'s encoding until it ends. False (nothing held)
        if ``key`` has one already, the ledger is closed, or ``future`` has not
        started and ``max_pending`` encodings are queued (``dropped``)."""
        return self.submit(key, lambda: future, queued=not (future.running() or future.done()))

    def submit(self, key: K, start: Callable[[], Future[Any]], *, queued: bool = True) -> bool:
        """``add(key, start())``, calling ``start`` (which starts or queues the
        encoding: an executor's ``submit``) only if the ledger takes it.
        ``queued=False``: it starts at once, whatever is queued (not capped)."""
        with self.cond:
            if self._closed or self.get(key) is not None:
                return False
            if queued and len(self.queued()) >= self.max_pending:
                self.dropped += 1
                return False
            future = start()
            self._futures[key] = future
            self.cond.notify_all()
        future.add_done_callback(partial(self._ended, key))  # now, if it has ended
        return True

    def wait(self, keys: Iterable[K] | None = None, timeout: float | None = None) -> bool:
        """Wait until the encodings of ``keys`` (None: every one, added meanwhile
        too) have ended; False if ``timeout`` (seconds) ran out first."""
        if keys is None:
            with self.cond:
                return self.cond.wait_for(lambda: not self._futures, timeout)
        _, left = wait_futures(list(self.pending(keys).values()), timeout)
        return not left

    def cancel(self, keys: Iterable[K] | None = None) -> int:
        """Cancel the queued encodings of ``keys`` (None: all); how many were.
        Encodings in flight run on."""
        with self.cond:
            chosen = list(self._futures) if keys is None else list(keys)
            futures = [f for k in chosen if (f := self._futures.get(k)) is not None]
            return sum(f.cancel() for f in futures)

    def close(self) -> int:
        """Take no more encodings and cancel the queued ones; how many were."""
        with self.cond:
            self._closed = True
            return self.cancel()

    def _ended(self, key: K, future: Future[Any]) -> None:
        with self.cond:
            if self._futures.get(key) is future:
                del self._futures[key]
            self.cond.notify_all()
        if not future.cancelled() and future.exception() is not None:
            # A failed encoding leaves its chunk a miss: say why, once.
            logger.warning("background chunk encoding failed: %s", future.exception())
