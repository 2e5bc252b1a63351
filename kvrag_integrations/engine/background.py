"""Encoding missed chunks off the request path: one worker thread, a bounded queue.

A request whose chunks are not cached answers by plain prefill (the engine's
``on_miss="defer"``) and hands the missed chunks here; the worker encodes and
stores them, so the next request that shows them reuses their caches. The
worker takes the weights' forward lock (``LoadedModel.lock``) per batch
(``ChunkCaches.encode_and_store`` does), so it never runs a forward at the same
time as a request of any engine on those weights; between batches a waiting
request gets the lock.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Mapping

import torch

from kvrag_integrations.store import KVStore

logger = logging.getLogger(__name__)

Job = tuple[str, torch.Tensor, KVStore]  # (cache key, token ids, where to store it)

_LIVE: weakref.WeakSet[BackgroundEncoder] = weakref.WeakSet()


class BackgroundEncoder:
    """A bounded queue of chunks to encode and one daemon thread working it.

    The thread starts on the first ``submit`` and exits after ``idle_s`` seconds
    with nothing to do (so an engine that is dropped leaves no thread behind).
    ``submit`` never blocks: past ``max_pending`` queued chunks, new ones are
    dropped (counted in ``dropped``) and will simply be deferred again by a
    later request.

    Args:
        encode: encodes and stores ``[(ids, store), ...]`` (one batch).
        max_pending: most chunks queued at once.
        batch_size: chunks per ``encode`` call.
        idle_s: seconds the worker waits for work before exiting.
    """

    def __init__(
        self,
        encode: Callable[[list[tuple[torch.Tensor, KVStore]]], None],
        *,
        max_pending: int = 256,
        batch_size: int = 8,
        idle_s: float = 5.0,
    ) -> None:
        if max_pending < 1 or batch_size < 1:
            raise ValueError("max_pending and batch_size must be >= 1")
        self._encode = encode
        self.max_pending = max_pending
        self.batch_size = batch_size
        self.idle_s = idle_s
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._pending: set[str] = set()  # queued or being encoded
        self._thread: threading.Thread | None = None
        self.encoded = 0
        self.dropped = 0
        self.failed = 0
        self._closed = False
        _LIVE.add(self)

    @property
    def pending(self) -> int:
        """Chunks queued or being encoded now."""
        with self._cond:
            return len(self._pending)

    def submit(self, jobs: Mapping[str, tuple[torch.Tensor, KVStore]]) -> set[str]:
        """Queue ``{key: (ids, store)}``; returns the keys queued (now or already)."""
        accepted: set[str] = set()
        with self._cond:
            if self._closed:
                return accepted
            for key, (ids, store) in jobs.items():
                if key in self._pending:
                    accepted.add(key)
                    continue
                if len(self._queue) >= self.max_pending:
                    self.dropped += 1
                    continue
                self._queue.append((key, ids, store))
                self._pending.add(key)
                accepted.add(key)
            if self._queue and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(
                    target=self._work, name="kvrag-background-encoder", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()
        if len(accepted) < len(jobs):
            logger.info(
                "background encoding queue full: %d chunk(s) dropped", len(jobs) - len(accepted)
            )
        return accepted

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or being encoded; False if ``timeout`` ran out."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Drop what is queued, let the batch in flight finish, stop the worker.

        Runs at interpreter exit for every live encoder: a daemon thread killed in
        the middle of a forward can abort the process.
        """
        with self._cond:
            self._closed = True
            for key, _, _ in self._queue:
                self._pending.discard(key)
            self.dropped += len(self._queue)
            self._queue.clear()
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._closed:
                    self._cond.wait_for(lambda: bool(self._queue) or self._closed, self.idle_s)
                if not self._queue or self._closed:
                    self._thread = None
                    return
                n = min(self.batch_size, len(self._queue))
                batch = [self._queue.popleft() for _ in range(n)]
            try:
                self._encode([(ids, store) for _, ids, store in batch])
                done, failed = len(batch), 0
            except Exception:  # the request already answered; log and go on
                logger.exception("background chunk encoding failed")
                done, failed = 0, len(batch)
            with self._cond:
                self._pending.difference_update(key for key, _, _ in batch)
                self.encoded += done
                self.failed += failed
                self._cond.notify_all()


@atexit.register
def _close_all() -> None:
    for encoder in list(_LIVE):
        encoder.close()
