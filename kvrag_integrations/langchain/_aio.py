"""Drive a blocking iterator from asyncio: one worker thread, items through a queue."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

_ITEM, _DONE, _ERROR = "item", "done", "error"


async def aiter_in_thread(factory: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Run ``factory()`` and iterate it in one worker thread, yielding items here.

    The whole iteration stays on one thread, so a generator is never resumed
    from two threads (the engine's decode loop takes its lock per forward, never
    between items). When the consumer stops early or is cancelled, the worker
    stops after the item in progress and closes the iterator.

    Examples:
        >>> import asyncio
        >>> async def main():
        ...     return [x async for x in aiter_in_thread(lambda: iter(range(3)))]
        >>> asyncio.run(main())
        [0, 1, 2]
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
    stop = threading.Event()

    def put(kind: str, value: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            stop.set()

    def work() -> None:
        try:
            iterator = factory()
            try:
                for item in iterator:
                    if stop.is_set():
                        break
                    put(_ITEM, item)
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()
        except BaseException as exc:  # handed to the consumer, raised there
            put(_ERROR, exc)
        else:
            put(_DONE, None)

    context = contextvars.copy_context()  # callbacks and tracing see the caller's context
    threading.Thread(target=context.run, args=(work,), daemon=True, name="kvrag-aio").start()
    try:
        while True:
            kind, value = await queue.get()
            if kind == _DONE:
                return
            if kind == _ERROR:
                raise value  # type: ignore[misc]
            yield value  # type: ignore[misc]
    finally:
        stop.set()
