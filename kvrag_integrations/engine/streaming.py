"""Streams: one worker thread decodes, the consumer reads a queue (sync or async).

As transformers' ``TextIteratorStreamer`` does, a request runs on its own
worker thread: it takes the weights' forward lock (``LoadedModel.lock``), runs
the prefill and every decoding step, releases the lock, and puts text pieces,
then the end (or the exception, with its own type) into a ``Channel``. The
consumer reads the channel holding nothing: a consumer that is slow or idle
blocks no other request (the worker runs on to the end of the answer and
frees the lock), and one that stops reading (``close()``/``aclose()``, leaving
a ``for`` loop over a temporary stream, or dropping the stream) sets the
cancel event: the worker stops before the next token's forward and releases
the lock.

``GenerationStream`` reads the channel by blocking; ``AsyncGenerationStream``
awaits it (the worker wakes the event loop with ``call_soon_threadsafe``), so
the adapters' async paths need no thread of their own. What a worker runs is
a ``Job``: the engine's answer to one request (``EngineFrontend.open_request``),
whichever engine it is.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from typing import Any

from kvrag_integrations.engine.results import GenerationResult

_TEXT, _DONE, _ERROR = "text", "done", "error"

Job = Callable[[threading.Event], Iterator[str]]
"""A request's work: given the cancel event, yields text pieces (runs on the worker)."""


class Channel:
    """What a worker sends to one consumer, read by blocking or by awaiting."""

    def __init__(self) -> None:
        self._items: deque[tuple[str, Any]] = deque()
        self._ready = threading.Condition(threading.Lock())
        self._wake: Callable[[], None] | None = None

    def put(self, kind: str, value: Any = None) -> None:
        with self._ready:
            self._items.append((kind, value))
            self._ready.notify()
            wake = self._wake
        if wake is not None:
            wake()

    def get(self) -> tuple[str, Any]:
        with self._ready:
            while not self._items:
                self._ready.wait()
            return self._items.popleft()

    async def aget(self) -> tuple[str, Any]:
        loop = asyncio.get_running_loop()
        while True:
            with self._ready:
                if self._items:
                    self._wake = None
                    return self._items.popleft()
                arrived = asyncio.Event()
                self._wake = partial(_call_soon, loop, arrived.set)
            await arrived.wait()


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], Any]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
        loop.call_soon_threadsafe(callback)


def acquire(lock: Any, cancel: threading.Event, poll_s: float = 0.05) -> bool:
    """Take ``lock`` unless ``cancel`` is set first (a request cancelled while
    waiting for its turn leaves the line). True if taken."""
    while not lock.acquire(timeout=poll_s):
        if cancel.is_set():
            return False
    if cancel.is_set():
        lock.release()
        return False
    return True


# Every worker thread still alive, with its cancel event: exit stops them
# between tokens and waits for them to end (a daemon thread killed mid-forward,
# or while it drops its prompt cache, aborts the process).
_WORKERS: weakref.WeakKeyDictionary[threading.Thread, threading.Event] = weakref.WeakKeyDictionary()
_WORKERS_LOCK = threading.Lock()


def _work(job: Job, channel: Channel, cancel: threading.Event) -> None:
    # Holds no reference to the stream object: dropping it cancels the request.
    try:
        for piece in job(cancel):
            channel.put(_TEXT, piece)
    except BaseException as exc:  # raised again in the consumer, same type
        channel.put(_ERROR, exc)
    else:
        channel.put(_DONE)


@atexit.register
def _stop_all(timeout: float = 30.0) -> None:
    with _WORKERS_LOCK:
        workers = list(_WORKERS.items())
    for _, cancel in workers:
        cancel.set()
    for thread, _ in workers:
        thread.join(timeout)


class _Stream:
    def __init__(self, job: Job, result: GenerationResult) -> None:
        self.result = result
        self._channel = Channel()
        self._cancel = threading.Event()
        self._finished = False
        context = contextvars.copy_context()  # callbacks and tracing see the caller's
        self._worker = threading.Thread(
            target=context.run,
            args=(_work, job, self._channel, self._cancel),
            name="kvrag-decode",
            daemon=True,
        )
        with _WORKERS_LOCK:
            _WORKERS[self._worker] = self._cancel
        self._worker.start()

    def _take(self, message: tuple[str, Any]) -> str:
        kind, value = message
        if kind == _TEXT:
            return value
        self._finished = True
        if kind == _ERROR:
            raise value
        raise StopIteration

    def cancel(self) -> None:
        """Ask the worker to stop before its next forward (returns at once)."""
        self._cancel.set()

    def __del__(self) -> None:  # a consumer that dropped the stream stops the worker
        cancel = getattr(self, "_cancel", None)
        if cancel is not None:
            cancel.set()


class GenerationStream(_Stream):
    """An iterator of text pieces; ``result`` holds the stats once it is exhausted.

    The request runs on a worker thread that holds the forward lock for the
    prefill and every decoding step; this object only reads what it sends, so
    a consumer that is slow, idle or on another thread blocks nothing for
    longer than the answer takes. ``close()`` (or the context manager, or
    dropping the stream) stops the worker before its next token: it releases
    the lock and frees the prompt cache. An error in the worker is raised here
    with its own type. ``result.finish_reason`` is ``"cancelled"`` for a stream
    closed early.
    """

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self._finished:
            raise StopIteration
        return self._take(self._channel.get())

    def close(self, timeout: float | None = 60.0) -> None:
        """Stop decoding and wait (up to ``timeout`` s) for the worker to let go."""
        self._cancel.set()
        if self._worker is not threading.current_thread():
            self._worker.join(timeout)

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGenerationStream(_Stream):
    """``GenerationStream`` for asyncio: ``async for piece in stream``.

    Awaiting a piece never blocks the event loop. ``aclose()`` (or ``async
    with``, or dropping the stream) stops the worker before its next token.

    Examples:
        >>> async def answer(engine):  # doctest: +SKIP
        ...     stream = engine.astream(question="Who?", chunks=["Ada wrote it."])
        ...     text = "".join([piece async for piece in stream])
        ...     return text, stream.result.ttft_s
    """

    def __aiter__(self) -> AsyncIterator[str]:
        return self

    async def __anext__(self) -> str:
        if self._finished:
            raise StopAsyncIteration
        try:
            return self._take(await self._channel.aget())
        except StopIteration:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        """Stop decoding (the worker releases the lock before its next forward)."""
        self._cancel.set()

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
