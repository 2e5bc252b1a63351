"""Encoding missed chunks off the request path, and every encoding of a key done once.

A request whose chunks are not cached may answer by plain prefill and hand the
missed chunks here (``on_miss="defer"``, or ``"auto"`` when that is cheaper);
one worker thread encodes and stores them, so the next request that shows them
reuses their caches. The encoder keeps its encodings on an ``EncodeLedger``
(``ledger.py``, the one ``VLLMEngine`` uses too), each a ``Flight`` (a future):
a key is *queued* (waiting for the worker) or *in flight* (being encoded, by
the worker or by a request), and ``claim`` hands a request the queued keys it
needs (taken off the queue: it encodes them itself) and the flights it must
wait for. Nothing is encoded twice, whoever gets there first.

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
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.scheduling.ledger import EncodeLedger

logger = logging.getLogger(__name__)

Job = Any  # what one key's encoding needs: opaque here (the caller's encode reads it)

_LIVE: weakref.WeakSet[BackgroundEncoder] = weakref.WeakSet()


class Flight(Future):
    """One key's encoding: queued for the worker, then in flight (the worker's or
    a request's); its result is the cache (None if the encoding failed).

    ``queued``: the key came off the queue (encoding an earlier request deferred).
    """

    def __init__(self, key: str, job: Job, queued: bool = False) -> None:
        super().__init__()
        self.key, self.job, self.queued = key, job, queued

    @property
    def kv(self) -> ChunkKV | None:
        """The cache, once encoded (None: not done, failed or cancelled)."""
        return self.result() if self.done() and not self.cancelled() else None


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
    later request. Its queue and flights are one ``EncodeLedger`` (``ledger``).

    Args:
        encode: encodes and stores ``[job, ...]`` (one unit), returning
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
        self.ledger: EncodeLedger[str] = EncodeLedger(max_pending)
        self.batch_size = batch_size
        self.idle_s = idle_s
        self._lock = lock
        self._model = model
        self._cond = self.ledger.cond  # one lock for the queue, the flights and the worker
        self._finished = 0  # encodings finished so far (see Claim.stale)
        self._thread: threading.Thread | None = None
        self.encoded = 0
        self.failed = 0
        self.taken_over = 0
        self._cancelled = 0  # queued chunks dropped by close
        self._closed = False
        _LIVE.add(self)

    @property
    def max_pending(self) -> int:
        """The most chunks queued at once."""
        return self.ledger.max_pending

    @property
    def dropped(self) -> int:
        """Chunks not encoded: the queue was full, or the encoder closed."""
        return self.ledger.dropped + self._cancelled

    @property
    def pending(self) -> int:
        """Chunks queued or being encoded now."""
        return len(self.ledger)

    def _flight(self, key: str) -> Flight | None:
        flight = self.ledger.get(key)
        return flight if isinstance(flight, Flight) else None

    def state(self, keys: Iterable[str]) -> tuple[dict[str, str], int]:
        """``{key: "queued" | "in flight"}`` for those of ``keys`` that are, and
        the count of finished encodings (pass it to ``claim``)."""
        with self._cond:
            pending = self.ledger.pending(keys)
            found = {k: "in flight" if f.running() else "queued" for k, f in pending.items()}
            return found, self._finished

    def claim(self, jobs: Mapping[str, Job], seen: int | None = None) -> Claim:
        """Take ``{key: job}`` over: queued keys leave the queue and, with
        new ones, become the caller's flights; keys in flight are to be waited for.

        Every key of ``mine`` must be passed to ``finish`` (in a ``finally``).
        ``seen``: the finished count from ``state`` (None: assume stale).
        """
        mine: dict[str, Flight] = {}
        theirs: dict[str, Flight] = {}
        with self._cond:
            for key, job in jobs.items():
                flight = self._flight(key)
                if flight is not None and flight.running():
                    theirs[key] = flight
                    continue
                if flight is not None and flight.set_running_or_notify_cancel():
                    flight.queued = True  # taken off the queue
                    self.taken_over += 1
                else:
                    flight = Flight(key, job)
                    flight.set_running_or_notify_cancel()
                    self.ledger.add(key, flight)
                mine[key] = flight
            stale = seen is None or seen != self._finished
        return Claim(mine, theirs, stale)

    def finish(self, flights: Iterable[Flight], kvs: Mapping[str, ChunkKV]) -> None:
        """End ``flights`` (their caches from ``kvs``; a missing one failed)."""
        with self._cond:
            for flight in flights:
                self._finished += 1
                flight.set_result(kvs.get(flight.key))  # leaves the ledger
            self._cond.notify_all()

    def await_flights(
        self, flights: Mapping[str, Flight], timeout: float | None = None
    ) -> dict[str, ChunkKV | None]:
        """Wait for ``flights`` (encoded elsewhere) and return their caches
        (None: failed or not done in time). Background work may run meanwhile."""
        waiting = self._lock.waiting_on_others() if self._lock is not None else nullcontext()
        with waiting:
            wait_futures(list(flights.values()), timeout)
        return {key: f.kv for key, f in flights.items()}

    def encode_once(
        self, jobs: Mapping[str, Job], encode: Callable[[list[Job]], Mapping[str, Any]]
    ) -> None:
        """Have ``jobs`` encoded, each once: ``encode(jobs)`` encodes (and stores) the
        keys claimed here (queued or new); keys in flight elsewhere are waited for,
        unless the caller holds the forward lock (they could not end)."""
        claim = self.claim(jobs)
        done: Mapping[str, Any] = {}
        try:
            done = encode([f.job for f in claim.mine.values()])
        finally:
            self.finish(claim.mine.values(), done)
        if claim.theirs and not (self._lock is not None and self._lock.held()):
            self.await_flights(claim.theirs)

    def submit(self, jobs: Mapping[str, Job]) -> set[str]:
        """Queue ``{key: job}``; returns the keys queued (now or already)
        or in flight."""
        accepted: set[str] = set()
        with self._cond:
            if self._closed:
                return accepted
            for key, job in jobs.items():
                if self.ledger.get(key) is not None or self.ledger.add(key, Flight(key, job)):
                    accepted.add(key)  # queued or in flight already, or queued now
            if self.ledger.queued() and (self._thread is None or not self._thread.is_alive()):
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
        return self.ledger.wait(None, timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Drop what is queued, let the unit in flight finish, stop the worker.

        Runs at interpreter exit for every live encoder: a daemon thread killed in
        the middle of a forward can abort the process.
        """
        with self._cond:
            self._closed = True
            self._cancelled += self.ledger.close()
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
        ledger = self.ledger
        with self._cond:
            if not ledger.queued() and not self._closed:
                self._cond.wait_for(lambda: bool(ledger.queued()) or self._closed, self.idle_s)
            if not ledger.queued() or self._closed:
                self._thread = None
                return False
        # The unit leaves the queue only once the forward lock is free for
        # background work: until then a request can still take it over.
        with self._lock if self._lock is not None else nullcontext(), self._cond:
            unit = []
            for key in ledger.queued()[: self.batch_size]:
                flight = self._flight(key)
                if flight is not None and flight.set_running_or_notify_cancel():
                    flight.queued = True
                    unit.append(flight)
        if not unit:  # requests took it all over meanwhile
            return True
        kvs: Mapping[str, ChunkKV] = {}
        try:
            done = self._encode([f.job for f in unit])
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
