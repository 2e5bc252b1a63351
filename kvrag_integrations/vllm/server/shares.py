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
in flight (``ComputeShares``). Light requests (what reuse makes of a request)
are never held, and a caller alone on the server is held in nothing. vLLM's
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

    def __init__(self, heavy_tokens: int = HEAVY_TOKENS) -> None:
        self.heavy_tokens = heavy_tokens
        self.held_total = 0  # heavy requests that had to wait (logs, tests)
        self._active: Counter[str] = Counter()  # requests in flight, by caller
        self._heavy: Counter[str] = Counter()  # heavy ones in prefill, by caller
        self._changed: asyncio.Event | None = None

    @contextlib.asynccontextmanager
    async def active(self, caller: str) -> AsyncIterator[None]:
        """``async with``: ``caller`` has a request in flight for the block."""
        self._active[caller] += 1
        try:
            yield
        finally:
            self._count_down(self._active, caller)

    def lane(self, caller: str, computed_tokens: int) -> Lane:
        """``async with``: the block runs a request computing ``computed_tokens``
        prompt tokens for ``caller``, after waiting its turn where it is heavy;
        ``release`` once its prefill is done (its first output)."""
        return Lane(self, caller, computed_tokens > self.heavy_tokens)

    def _others_active(self, caller: str) -> bool:
        return any(n for other, n in self._active.items() if other != caller)

    async def _acquire(self, caller: str) -> None:
        waited = False
        while self._heavy[caller] and self._others_active(caller):
            if not waited:
                self.held_total += 1
                waited = True
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()
        self._heavy[caller] += 1

    def _release(self, caller: str) -> None:
        self._count_down(self._heavy, caller)

    def _count_down(self, counts: Counter[str], caller: str) -> None:
        """One of ``caller``'s fewer in ``counts`` (none left: no key), and every
        waiter checks its turn again (a new event for the next change)."""
        counts[caller] -= 1
        if not counts[caller]:
            del counts[caller]
        if self._changed is not None:
            self._changed.set()
            self._changed = None


class Lane:
    """One request's turn (``ComputeShares.lane``)."""

    def __init__(self, shares: ComputeShares, caller: str, heavy: bool) -> None:
        self.shares, self.caller, self.heavy = shares, caller, heavy
        self._held = False

    async def __aenter__(self) -> Lane:
        if self.heavy:
            await self.shares._acquire(self.caller)
            self._held = True
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
