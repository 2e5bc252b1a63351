"""The forward lock of one model's weights: requests first, background work yields.

Every forward on a model's weights runs under its ``ForwardLock``
(``LoadedModel.lock``): one forward at a time, however many engines share the
weights. It is re-entrant like ``threading.RLock`` and used the same way
(``with lock:``, ``acquire(timeout=...)``, ``release()``), and it knows who is
waiting:

- *Foreground* work (a request, ingestion, the reranker: any thread not marked
  as background) is counted from the moment it asks for the lock, and a
  request from its planning on (``request()``), before it needs the lock.
- *Background* work (the background encoder's thread, inside ``background()``)
  only takes the lock while no foreground work is counted (or all of it waits on
  background work), and gives it back
  between two decoder layers as soon as some is: a forward pre-hook on every
  decoder layer (there only while background work holds the lock) pauses it
  there, the lock released, until the foreground work is done. A request
  therefore waits at most one decoder layer of background work, never a whole
  batch.
- A request that waits for an encoding someone else has in flight says so
  (``waiting()``): background work resumes while every foreground request is
  waiting on it, and then runs with the foreground's thread count.
- On CPU a background forward runs with fewer intra-op threads than the
  foreground's (half, at least one; ``engine.scheduling.threads``), on its own thread only.

Pausing inside a forward is safe because the model's forward keeps its state in
the call (activations, its own cache, context variables), not on the modules,
and the paused forward resumes only once no foreground work holds the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvrag_integrations.engine.scheduling.threads import set_thread_threads

_local = threading.local()  # .background: this thread does background work


def is_background_thread() -> bool:
    """Whether the calling thread is inside ``ForwardLock.background()``."""
    return getattr(_local, "background", None) is not None


class ForwardLock:
    """A re-entrant lock for one model's forwards that lets requests go first.

    Args:
        device: the model's device; background forwards get fewer threads on CPU.

    Attributes:
        foreground: foreground work counted now (requests in flight, threads
            waiting for or holding the lock).
        waiting: foreground work blocked on an encoding in flight elsewhere.
        pauses: how often a background forward paused for foreground work.
        foreground_threads: the intra-op thread count of the latest foreground
            holder (what a background forward gets back when a request waits on it).
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        self._counted = False  # the holder is counted in ``foreground``
        self._state = threading.Condition()
        self.foreground = 0
        self.waiting = 0
        self.pauses = 0
        self.cpu = torch.device(device).type == "cpu" if device is not None else True
        self.foreground_threads = torch.get_num_threads()
        self._model: Any = None
        self._hooks: list[Any] = []  # pause points, there while background work holds the lock

    # ------------------------------------------------------------ RLock's API
    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return True
        if is_background_thread():
            return self._acquire_background(blocking, timeout)
        self._count(foreground=1)
        if not self._lock.acquire(blocking, timeout):
            self._count(foreground=-1)
            return False
        self._owner, self._depth, self._counted = me, 1, True
        if self.cpu:
            self.foreground_threads = torch.get_num_threads()
        return True

    def release(self) -> None:
        if self._owner != threading.get_ident():
            raise RuntimeError("cannot release un-acquired lock")
        self._depth -= 1
        if self._depth:
            return
        if not self._counted:  # background work ends its turn: forwards run hook-free again
            self._remove_pause_points()
        counted, self._owner, self._counted = self._counted, None, False
        self._lock.release()
        if counted:
            self._count(foreground=-1)

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def held(self) -> bool:
        """Whether the calling thread holds the lock."""
        return self._owner == threading.get_ident()

    # threading.Condition(lock) uses these (a wait releases every level).
    def _is_owned(self) -> bool:
        return self.held()

    def _release_save(self) -> tuple[int, bool]:
        state = (self._depth, self._counted)
        self._owner, self._depth, self._counted = None, 0, False
        self._lock.release()
        if state[1]:
            self._count(foreground=-1)
        return state

    def _acquire_restore(self, state: tuple[int, bool]) -> None:
        depth, counted = state
        if counted:
            self._count(foreground=1)
        self._lock.acquire()
        self._owner, self._depth, self._counted = threading.get_ident(), depth, counted

    # ------------------------------------------------- foreground / background
    @contextmanager
    def request(self) -> Iterator[None]:
        """Count a request as foreground work for the block (its planning, store
        reads and waits included): background work starts nothing meanwhile."""
        self._count(foreground=1)
        try:
            yield
        finally:
            self._count(foreground=-1)

    @contextmanager
    def waiting_on_others(self) -> Iterator[None]:
        """The calling foreground work waits for an encoding in flight elsewhere:
        background work may resume (at the foreground's thread count) meanwhile.
        Never while holding the lock (that encoding may need it)."""
        if self.held():
            raise RuntimeError("waiting for another encoding while holding the forward lock")
        self._count(waiting=1)
        try:
            yield
        finally:
            self._count(waiting=-1)

    @contextmanager
    def background(self, model: Any = None) -> Iterator[None]:
        """Mark the calling thread's forwards in the block as background work.

        ``model``: the weights, whose decoder layers get the pause points.
        """
        if model is not None:
            self._model = model
        previous = getattr(_local, "background", None)
        _local.background = self
        try:
            yield
        finally:
            _local.background = previous
            if previous is None:  # the thread's own count back, for what it does next
                self._set_threads(background=False)

    def _count(self, foreground: int = 0, waiting: int = 0) -> None:
        with self._state:
            self.foreground += foreground
            self.waiting += waiting
            self._state.notify_all()

    def _acquire_background(self, blocking: bool, timeout: float) -> bool:
        """Take the lock only while all foreground work counted waits on encodings
        in flight elsewhere (none, mostly; else possibly this thread's)."""
        me = threading.get_ident()
        wait = None if timeout is None or timeout < 0 else timeout
        while True:
            with self._state:
                if not blocking and self.foreground > self.waiting:
                    return False
                if not self._state.wait_for(lambda: self.foreground <= self.waiting, wait):
                    return False
            if not self._lock.acquire(blocking, timeout):
                return False
            if self.foreground <= self.waiting:
                break
            self._lock.release()  # foreground work arrived meanwhile: it goes first
        self._owner, self._depth, self._counted = me, 1, False
        self._install_pause_points()
        self._set_threads(background=self.waiting == 0)
        return True

    def _set_threads(self, background: bool) -> None:
        """This thread's intra-op threads: half the foreground's in the background."""
        current = getattr(_local, "threads", None)
        if not self.cpu or (current is None and not background):  # never lowered here
            return
        n = self.foreground_threads
        n = max(1, n // 2) if background else n
        if current != n and set_thread_threads(n):
            _local.threads = n

    def _install_pause_points(self) -> None:
        """A forward pre-hook on each decoder layer, while background work holds the
        lock (added and removed under it: no other forward runs meanwhile)."""
        if self._hooks or self._model is None:
            return
        layers = getattr(getattr(self._model, "model", None), "layers", None)
        self._hooks = [layer.register_forward_pre_hook(self._pause_point) for layer in layers or ()]

    def _remove_pause_points(self) -> None:
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.remove()

    def _pause_point(self, module: Any, args: Any) -> None:
        if getattr(_local, "background", None) is self and self._owner == threading.get_ident():
            self.yield_to_foreground()

    def yield_to_foreground(self) -> None:
        """In a background forward: pause, the lock released, while foreground work
        that does not wait on background work is counted."""
        if self.foreground <= self.waiting:
            self._set_threads(background=self.waiting == 0)
            return
        self.pauses += 1
        depth = self._depth
        while True:
            self._owner, self._depth = None, 0
            self._lock.release()
            with self._state:
                self._state.wait_for(lambda: self.foreground <= self.waiting)
            self._lock.acquire()
            self._owner, self._depth = threading.get_ident(), depth
            if self.foreground <= self.waiting:
                break
        # Resumed: for a request waiting on it (full threads), or as idle work.
        self._set_threads(background=self.waiting == 0)
