"""Running blocking engine work from asyncio without blocking the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import AsyncIterator, Iterator
from typing import TypeVar

T = TypeVar("T")

_DONE = object()


async def iterate_in_thread(items: Iterator[T]) -> AsyncIterator[T]:
    """Iterate a blocking iterator on one dedicated thread, yielding asynchronously.

    One thread for the whole iteration (not ``asyncio.to_thread`` per item): a
    generator is then never resumed from two threads, and a thread hand-off per
    item is saved. The engine takes its lock per forward, so a paused consumer
    holds nothing. If the consumer stops early, the worker stops after the item
    in flight and closes the iterator on its own thread.

    Examples:
        >>> async def collect():
        ...     return [x async for x in iterate_in_thread(iter([1, 2, 3]))]
        >>> asyncio.run(collect())
        [1, 2, 3]
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[object, BaseException | None]] = asyncio.Queue()
    stop = threading.Event()

    def send(item: object, error: BaseException | None = None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody listens
            loop.call_soon_threadsafe(queue.put_nowait, (item, error))

    def work() -> None:
        try:
            for item in items:
                send(item)
                if stop.is_set():
                    break
        except BaseException as exc:
            send(_DONE, exc)
            return
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()
        send(_DONE)

    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(work,), daemon=True).start()
    try:
        while True:
            item, error = await queue.get()
            if item is _DONE:
                if error is not None:
                    raise error
                return
            yield item  # type: ignore[misc]
    finally:
        stop.set()
