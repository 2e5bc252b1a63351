"""Each caller's share of the engine: one heavy prefill at a time while others wait.

vLLM schedules first come, first served. A caller with several long prompts in
flight that the server must compute (nothing of them stored: a new salt each
time, a made-up prefix, text to save) fills every engine step with its
prefill, and everyone else's requests, mostly loaded and so light, wait
behind it: beside one anonymous flooder the other callers' TTFT p99 was 13x
its value without (``bench serve``). So the hook holds a caller's heavy
request (one computing more than ``HEAVY_TOKENS`` prompt tokens; the server's
own encodes of a request's texts are its caller's too) until the caller's
previous heavy one has its first token, whenever another caller has a request
in flight or had one within ``RECENT_S`` (``ComputeShares``): the gaps between
one client's requests let no burst of another's in, and a burst sent in a quiet
moment holds no more than one slice of each step once others are back, however
long its prefills last. Nor may a caller have more calls in the engine than
the busiest other caller with calls in it now (at least ``MIN_CALLS``;
work-conserving: an idle caller's share goes to the others): a beam search runs
one engine call per beam and step, and light calls of many kinds fill a step
as one prefill does. What reuse makes of a request is otherwise never held,
and a caller alone on the server is held in nothing. vLLM's
``long_prefill_token_threshold`` (``launch.CPU_ENGINE_ARGS``) then keeps each
step to a slice of that one prefill per caller.

A caller is who the gateway says where the request enters (``caller_of``): a
key's holder, else the client's address (an IPv6 address by its /64, which a
host is given whole). The holding waits on the API server's event loop and
blocks nothing; each API process keeps its own shares.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Any

from kvrag_integrations.vllm.trust import Grant

HEAVY_TOKENS = 128
"""A request computing more prompt tokens than this is heavy: a request whose
passages are loaded computes its question and the template's few tokens."""
RECENT_S = 30.0
"""A caller that had a request in flight this recently is still around: another's
heavy prefills run one at a time meanwhile."""
MIN_CALLS = 4
"""Engine calls a caller may have at once beside another's (more where another
caller has more in the engine: an equal share of the engine's requests)."""


def caller_of(scope: Mapping[str, Any], grant: Grant | None) -> str:
    """Who sends a request, for its share: a key's holder (or its namespace), else
    the client's address as the ASGI server gives it (uvicorn takes it from
    ``X-Forwarded-For`` only on a connection from an address
    ``$FORWARDED_ALLOW_IPS`` trusts: by default a proxy on the same host).

    Examples:
        >>> caller_of({"client": ("10.0.0.7", 5123)}, None)
        'addr:10.0.0.7'
        >>> caller_of({"client": ("2001:db8::1", 80)}, None)
        'addr:2001:db8::/64'
        >>> caller_of({}, Grant("team-a", "read", holder="ab12"))
        'key:ab12'
    """
    if grant is not None:
        return "key:" + (grant.holder or grant.key or grant.namespace)
    client = scope.get("client")
    host = str(client[0]) if client else ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return f"addr:{host}"  # (a unix socket's, or none: one caller)
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:  # (an IPv4 client of a dual-stack socket)
            return f"addr:{address.ipv4_mapped}"
        return f"addr:{ipaddress.ip_network(f'{host}/64', strict=False)}"
    return f"addr:{address}"


class ComputeShares:
    """Holds a caller's heavy requests while its previous one is in prefill and
    others wait (see the module docstring). One per API process, on its loop.

    Args:
        heavy_tokens: requests computing more prompt tokens than this are heavy.
    """

    def __init__(self, heavy_tokens: int = HEAVY_TOKENS, recent_s: float = RECENT_S) -> None:
        self.heavy_tokens, self.recent_s = heavy_tokens, recent_s
        self.held_total = 0  # heavy requests that had to wait (logs, tests)
        self._active: Counter[str] = Counter()  # requests in flight, by caller
        self._left: dict[str, float] = {}  # when each caller's last request ended
        self._heavy: Counter[str] = Counter()  # heavy ones in prefill, by caller
        self._calls: Counter[str] = Counter()  # calls in the engine, by caller
        self._changed: asyncio.Event | None = None

    @contextlib.asynccontextmanager
    async def active(self, caller: str) -> AsyncIterator[None]:
        """``async with``: ``caller`` has a request in flight for the block."""
        self._active[caller] += 1
        try:
            yield
        finally:
            self._left[caller] = _now()
            self._count_down(self._active, caller)

    def lane(self, caller: str, computed_tokens: int) -> Lane:
        """``async with``: the block runs one engine call computing ``computed_tokens``
        prompt tokens for ``caller``, after waiting its turn where it is heavy or
        past the caller's share of calls; ``release`` once its prefill is done (its
        first output)."""
        return Lane(self, caller, computed_tokens > self.heavy_tokens)

    def _others_around(self, caller: str) -> float:
        """Seconds until no other caller counts as around (0: none is; inf: one has
        a request in flight)."""
        if any(n for other, n in self._active.items() if other != caller):
            return float("inf")
        now = _now()
        for other in [o for o, left in self._left.items() if now - left >= self.recent_s]:
            del self._left[other]  # (gone: forgotten)
        lefts = [left for other, left in self._left.items() if other != caller]
        return max(lefts) + self.recent_s - now if lefts else 0.0

    async def _acquire(self, caller: str, heavy: bool) -> None:
        """Wait until ``caller`` may start one more call (``heavy``: a heavy one)."""
        waited = False
        while (around := self._others_around(caller)) > 0 and self._over(caller, heavy):
            if not waited:
                self.held_total += 1
                waited = True
            if self._changed is None:
                self._changed = asyncio.Event()
            changed = self._changed.wait()
            with contextlib.suppress(asyncio.TimeoutError):  # (the others went quiet meanwhile)
                await asyncio.wait_for(changed, None if around == float("inf") else around)
        self._calls[caller] += 1
        if heavy:
            self._heavy[caller] += 1

    def _over(self, caller: str, heavy: bool) -> bool:
        """Whether another call of ``caller`` would be more than its share: a second
        heavy one, or more calls than the busiest caller with calls in the engine
        now (an idle one leaves its share to the others)."""
        if heavy and self._heavy[caller]:
            return True
        others = [n for other, n in self._calls.items() if other != caller]
        return bool(others) and self._calls[caller] >= max([MIN_CALLS, *others])

    def _release(self, caller: str) -> None:
        self._count_down(self._heavy, caller)

    def _end_call(self, caller: str) -> None:
        self._count_down(self._calls, caller)

    def _count_down(self, counts: Counter[str], caller: str) -> None:
        """One of ``caller``'s fewer in ``counts`` (none left: no key), and every
        waiter checks its turn again (a new event for the next change)."""
        counts[caller] -= 1
        if not counts[caller]:
            del counts[caller]
        if self._changed is not None:
            self._changed.set()
            self._changed = None


def _now() -> float:
    return asyncio.get_running_loop().time()


class Lane:
    """One request's turn (``ComputeShares.lane``)."""

    def __init__(self, shares: ComputeShares, caller: str, heavy: bool) -> None:
        self.shares, self.caller, self.heavy = shares, caller, heavy
        self._held = False

    async def __aenter__(self) -> Lane:
        await self.shares._acquire(self.caller, self.heavy)
        self._held = self.heavy
        return self

    def release(self) -> None:
        """The request's prefill is done: the caller's next heavy one may start."""
        if self._held:
            self._held = False
            self.shares._release(self.caller)

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.release()
        self.shares._end_call(self.caller)
