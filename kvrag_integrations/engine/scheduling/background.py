"""Encoding missed chunks off the request path, and every encoding of a key done once.

A request whose chunks are not cached may answer by plain prefill and hand the
missed chunks here (``on_miss="defer"``, or ``"auto"`` when that is cheaper);
one worker thread encodes and stores them, so the next request that shows them
reuses their caches. The encoder is also the engine's ledger of encodings: a
key is *queued* (waiting for the worker) or *in flight* (being encoded, by the
worker or by a request, each a ``Flight``), and ``claim`` hands a request the
queued keys it needs (taken off the queue: it encodes them itself) and the
flights it must wait for. Nothing is encoded twice, whoever gets there first.

The worker's forwards are background work on the weights' ``ForwardLock``:
they start only while no request runs, pause between decoder layers as soon as
one arrives, and run with fewer threads on CPU. Its unit of work is
``batch_size`` chunks (the engine uses one on CPU, so a request finds most of
its chunks still claimable rather than in flight).
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.store import KVStore

logger = logging.getLogger(__name__)

Job = tuple[torch.Tensor, KVStore]  # (entry token ids, where to store it)

_LIVE: weakref.WeakSet[BackgroundEncoder] = weakref.WeakSet()


@dataclass(eq=False)
class Flight:
    """One key being encoded (by the worker or a request); waiters get its cache.

    ``queued``: the key was taken off the queue (encoding an earlier request
    deferred). ``kv`` is set when ``done`` is (None if the encoding failed).
    """

    key: str
    ids: torch.Tensor
    store: KVStore
    queued: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    kv: ChunkKV | None = None


@dataclass
class Claim:
    """A request's share of the ledger for its missing keys (see ``BackgroundEncoder.claim``).

    ``mine``: keys the caller now encodes (``Flight.queued`` for those taken off
    the queue); ``theirs``: keys in flight elsewhere, to wait for; ``stale``:
    whether some encoding finished since the caller's ``state`` (a key of
    ``mine`` not taken off the queue may be stored now: read it first).
    """

    mine: dict[str, Flight]
    theirs: dict[str, Flight]
    stale: bool


class BackgroundEncoder:
    """A bounded queue of chunks to encode, one daemon thread working it, and the
    ledger of keys in flight.

    The thread starts on the first ``submit`` and exits after ``idle_s`` seconds
    with nothing to do (so an engine that is dropped leaves no thread behind).
    ``submit`` never blocks: past ``max_pending`` queued chunks, new ones are
    dropped (counted in ``dropped``) and will simply be deferred again by a
    later request.

    Args:
        encode: encodes and stores ``[(ids, store), ...]`` (one unit), returning
            ``{key: ChunkKV}`` of what it encoded (anything else: waiters read
            the store).
        max_pending: most chunks queued at once.
        batch_size: chunks per ``encode`` call.
        idle_s: seconds the worker waits for work before exiting.
        lock: the weights' ``ForwardLock``: the worker's forwards run as its
            background work (they yield to requests).
        model: the weights (the lock's pause points go on its decoder layers).
    """

    def __init__(
        self,
        encode: Callable[[list[Job]], Any],
        *,
        max_pending: int = 256,
        batch_size: int = 8,
        idle_s: float = 5.0,
        lock: Any = None,
        model: Any = None,
    ) -> None:
        if max_pending < 1 or batch_size < 1:
            raise ValueError("max_pending and batch_size must be >= 1")
        self._encode = encode
        self.max_pending = max_pending
        self.batch_size = batch_size
        self.idle_s = idle_s
        self._lock = lock
        self._model = model
        self._cond = threading.Condition()
        self._queue: OrderedDict[str, Job] = OrderedDict()
        self._flights: dict[str, Flight] = {}
        self._finished = 0  # encodings finished so far (see Claim.stale)
        self._thread: threading.Thread | None = None
        self.encoded = 0
        self.dropped = 0
        self.failed = 0
        self.taken_over = 0
        self._closed = False
        _LIVE.add(self)

    @property
    def pending(self) -> int:
        """Chunks queued or being encoded now."""
        with self._cond:
            return len(self._queue) + len(self._flights)

    def state(self, keys: Iterable[str]) -> tuple[dict[str, str], int]:
        """``{key: "queued" | "in flight"}`` for those of ``keys`` that are, and
        the count of finished encodings (pass it to ``claim``)."""
        with self._cond:
            found = {}
            for key in keys:
                if key in self._queue:
                    found[key] = "queued"
                elif key in self._flights:
                    found[key] = "in flight"
            return found, self._finished

    def claim(self, jobs: Mapping[str, Job], seen: int | None = None) -> Claim:
        """Take ``{key: (ids, store)}`` over: queued keys leave the queue and, with
        new ones, become the caller's flights; keys in flight are to be waited for.

        Every key of ``mine`` must be passed to ``finish`` (in a ``finally``).
        ``seen``: the finished count from ``state`` (None: assume stale).
        """
        mine: dict[str, Flight] = {}
        theirs: dict[str, Flight] = {}
        with self._cond:
            for key, (ids, store) in jobs.items():
                if key in self._flights:
                    theirs[key] = self._flights[key]
                    continue
                queued = self._queue.pop(key, None) is not None
                self.taken_over += queued
                mine[key] = self._flights[key] = Flight(key, ids, store, queued)
            stale = seen is None or seen != self._finished
        return Claim(mine, theirs, stale)

    def finish(self, flights: Iterable[Flight], kvs: Mapping[str, ChunkKV]) -> None:
        """End ``flights`` (their caches from ``kvs``; a missing one failed)."""
        with self._cond:
            for flight in flights:
                flight.kv = kvs.get(flight.key)
                if self._flights.get(flight.key) is flight:
                    del self._flights[flight.key]
                self._finished += 1
                flight.done.set()
            self._cond.notify_all()

    def await_flights(
        self, flights: Mapping[str, Flight], timeout: float | None = None
    ) -> dict[str, ChunkKV | None]:
        """Wait for ``flights`` (encoded elsewhere) and return their caches
        (None: failed or not done in time). Background work may run meanwhile."""
        waiting = self._lock.waiting_on_others() if self._lock is not None else nullcontext()
        with waiting:
            for flight in flights.values():
                flight.done.wait(timeout)
        return {key: f.kv if f.done.is_set() else None for key, f in flights.items()}

    def encode_once(
        self, jobs: Mapping[str, Job], encode: Callable[[list[torch.Tensor]], Mapping[str, Any]]
    ) -> None:
        """Have ``jobs`` encoded, each once: ``encode(ids)`` encodes (and stores) the
        keys claimed here (queued or new); keys in flight elsewhere are waited for,
        unless the caller holds the forward lock (they could not end)."""
        claim = self.claim(jobs)
        done: Mapping[str, Any] = {}
        try:
            done = encode([f.ids for f in claim.mine.values()])
        finally:
            self.finish(claim.mine.values(), done)
        if claim.theirs and not (self._lock is not None and self._lock.held()):
            self.await_flights(claim.theirs)

    def submit(self, jobs: Mapping[str, Job]) -> set[str]:
        """Queue ``{key: (ids, store)}``; returns the keys queued (now or already)
        or in flight."""
        accepted: set[str] = set()
        with self._cond:
            if self._closed:
                return accepted
            for key, (ids, store) in jobs.items():
                if key in self._queue or key in self._flights:
                    accepted.add(key)
                    continue
                if len(self._queue) >= self.max_pending:
                    self.dropped += 1
                    continue
                self._queue[key] = (ids, store)
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
            return self._cond.wait_for(lambda: not self._queue and not self._flights, timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Drop what is queued, let the unit in flight finish, stop the worker.

        Runs at interpreter exit for every live encoder: a daemon thread killed in
        the middle of a forward can abort the process.
        """
        with self._cond:
            self._closed = True
            self.dropped += len(self._queue)
            self._queue.clear()
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _work(self) -> None:
        background = self._lock.background(self._model) if self._lock is not None else None
        with background or nullcontext():
            while self._work_one():
                pass

    def _work_one(self) -> bool:
        """Encode one unit; False when the worker should exit."""
        with self._cond:
            if not self._queue and not self._closed:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed, self.idle_s)
            if not self._queue or self._closed:
                self._thread = None
                return False
        # The unit leaves the queue only once the forward lock is free for
        # background work: until then a request can still take it over.
        with self._lock if self._lock is not None else nullcontext(), self._cond:
            unit = []
            for _ in range(min(self.batch_size, len(self._queue))):
                key, (ids, store) = self._queue.popitem(last=False)
                unit.append(self._flights.setdefault(key, Flight(key, ids, store, True)))
        if not unit:  # requests took it all over meanwhile
            return True
        kvs: Mapping[str, ChunkKV] = {}
        try:
            done = self._encode([(f.ids, f.store) for f in unit])
            kvs = done if isinstance(done, Mapping) else {}
            encoded, failed = len(unit), 0
        except Exception:  # the request already answered; log and go on
            logger.exception("background chunk encoding failed")
            encoded, failed = 0, len(unit)
        self.finish(unit, kvs)
        with self._cond:
            self.encoded += encoded
            self.failed += failed
        return True


@atexit.register
def _close_all() -> None:
    for encoder in list(_LIVE):
        encoder.close()
