"""Callers' shares of the engine (``shares``): a caller's heavy prefills one at a
time while others have requests in flight; light requests never held.

Through the server's hook with an engine client whose prefill takes a while, as
the gateway hands requests on (``arrival.ARRIVAL``, ``caller`` from the client's
address), and the gateway's caller of an ASGI scope.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace
from typing import Any

from test_vllm_detection import PASSAGES, Stored
from test_vllm_reuse_hook import gateway_arrival, policy

from kvrag_integrations.vllm.server.arrival import ARRIVAL, Arrival, current
from kvrag_integrations.vllm.server.gateway import POLICY_STATE, TenantGateway
from kvrag_integrations.vllm.server.reuse_hook import ReuseHook
from kvrag_integrations.vllm.server.shares import HEAVY_TOKENS, MIN_CALLS, ComputeShares, caller_of
from kvrag_integrations.vllm.trust import Grant

PREFILL_S = 0.05


class SlowEngine:
    """``generate`` whose prefill (before its first output) takes ``PREFILL_S``; it
    counts each caller's prefills running at once, and the most of them."""

    def __init__(self) -> None:
        self.prefilling: Counter[str] = Counter()
        self.most: Counter[str] = Counter()

    async def generate(self, prompt, sampling_params, request_id, **kwargs):
        caller = current().caller
        self.prefilling[caller] += 1
        self.most[caller] = max(self.most[caller], self.prefilling[caller])
        await asyncio.sleep(PREFILL_S)
        self.prefilling[caller] -= 1
        for _ in range(3):  # decoding: no longer the caller's prefill
            yield SimpleNamespace(request_id=request_id)
            await asyncio.sleep(PREFILL_S)


def send(hook: ReuseHook, caller: str, ids: list[int]):
    """One request of ``caller`` through the hook, as the gateway hands it on."""
    arrival = gateway_arrival(hook.policy, None)
    arrival = Arrival(None, None, arrival.admission, caller=caller)

    async def go() -> None:
        token = ARRIVAL.set(arrival)
        try:
            prompt = {"type": "token", "prompt_token_ids": list(ids)}
            params = SimpleNamespace(extra_args=None, prompt_logprobs=None)
            async for _ in hook.generate(prompt, params, f"r-{id(prompt)}"):
                pass
        finally:
            ARRIVAL.reset(token)

    return go()


async def beside(hook: ReuseHook, caller: str, at_once: int, ids, flood: list) -> None:
    """``caller``'s requests of ``ids``, ``at_once`` of them in flight from before the
    ``flood`` comes in until it is done: each one's next is sent as it ends, in the
    same step of the loop, so the caller is never without one in flight (a gap
    between two would rightly let the flood's held requests start)."""
    flood_done = asyncio.Event()

    async def one_after_another() -> None:
        await send(hook, caller, ids)
        while not flood_done.is_set():
            await send(hook, caller, ids)

    keeping = [asyncio.ensure_future(one_after_another()) for _ in range(at_once)]
    await asyncio.sleep(0)  # (they are in flight)
    await asyncio.gather(*flood)
    flood_done.set()
    await asyncio.gather(*keeping)


def unknown(n: int, seed: int) -> list[int]:
    """``n`` ids nothing stored holds (computed whole: heavy past ``HEAVY_TOKENS``)."""
    return [7000 + (seed * 131 + i * 17) % 900 for i in range(n)]


def hook_with(stored: Stored) -> tuple[ReuseHook, SlowEngine]:
    engine = SlowEngine()
    return ReuseHook(engine.generate, stored.detector(), policy(), SimpleNamespace), engine


def test_a_flooders_heavy_prefills_run_one_at_a_time_beside_another_callers_requests() -> None:
    hook, engine = hook_with(Stored())

    async def main() -> None:
        flood = [send(hook, "addr:10.0.0.9", unknown(HEAVY_TOKENS + 200, i)) for i in range(5)]
        await beside(hook, "addr:10.0.0.1", 6, unknown(40, 1), flood)

    asyncio.run(main())
    assert engine.most["addr:10.0.0.9"] == 1  # held: one prefill at a time
    assert engine.most["addr:10.0.0.1"] == 6  # light: never held
    assert hook.shares.held_total >= 4


def test_a_caller_alone_is_held_in_nothing_and_light_requests_never() -> None:
    hook, engine = hook_with(Stored())

    async def alone() -> None:
        await asyncio.gather(*(send(hook, "addr:a", unknown(400, i)) for i in range(4)))

    asyncio.run(alone())
    assert engine.most["addr:a"] == 4 and hook.shares.held_total == 0


def test_a_request_whose_passages_are_loaded_is_light() -> None:
    """Stored passages are loaded, not computed: beside a flood, such requests of
    one caller all prefill at once (what reuse makes of a request never waits)."""
    stored = Stored()
    for passage in PASSAGES:
        stored.put(passage)
    hook, engine = hook_with(stored)
    reused = [t for p in PASSAGES for t in p] + [5, 6, 7]
    assert len(reused) > HEAVY_TOKENS

    async def main() -> None:
        flood = [send(hook, "addr:f", unknown(HEAVY_TOKENS + 50, i)) for i in range(3)]
        await beside(hook, "addr:l", 4, reused, flood)

    asyncio.run(main())
    assert engine.most["addr:l"] == 4
    assert engine.most["addr:f"] == 1


def test_shares_let_the_next_heavy_one_start_at_the_first_output() -> None:
    shares = ComputeShares(heavy_tokens=10)
    order: list[str] = []

    async def heavy(name: str, hold: asyncio.Event) -> None:
        async with shares.lane("f", 100) as lane:
            order.append(f"{name} starts")
            await hold.wait()
            lane.release()
            order.append(f"{name} decodes")
            await asyncio.sleep(0.01)

    async def main() -> None:
        first, second = asyncio.Event(), asyncio.Event()
        async with shares.active("other"):
            a = asyncio.create_task(heavy("a", first))
            await asyncio.sleep(0)
            b = asyncio.create_task(heavy("b", second))
            await asyncio.sleep(0.01)
            assert order == ["a starts"]  # b held behind a's prefill
            first.set()
            second.set()
            await asyncio.gather(a, b)

    asyncio.run(main())
    assert order[:3] == ["a starts", "a decodes", "b starts"]


def test_a_cancelled_waiter_takes_no_turn() -> None:
    shares = ComputeShares(heavy_tokens=10)

    async def main() -> None:
        async with shares.active("other"):
            async with shares.lane("f", 100):
                waiting = asyncio.create_task(shares.lane("f", 100).__aenter__())
                await asyncio.sleep(0.01)
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
            async with shares.lane("f", 100) as lane:  # nothing left held
                assert lane.heavy

    asyncio.run(asyncio.wait_for(main(), 5))


def test_the_gateway_names_the_caller_by_its_key_or_its_address() -> None:
    seen: list[Arrival | None] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(current())

    gateway = TenantGateway(app)
    state = SimpleNamespace(**{POLICY_STATE: policy()})

    async def call(client: tuple[str, int]) -> None:
        body = b'{"prompt": "hi"}'
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "headers": [(b"content-type", b"application/json")],
            "client": client,
            "app": SimpleNamespace(state=state),
        }

        async def receive() -> dict:
            return {"type": "http.request", "body": body, "more_body": False}

        await gateway(scope, receive, None)

    asyncio.run(call(("192.0.2.5", 4000)))
    asyncio.run(call(("2001:db8:1:2:aaaa::1", 4000)))
    asyncio.run(call(("2001:db8:1:2:bbbb::9", 4001)))
    assert [a.caller for a in seen] == ["addr:192.0.2.5", *["addr:2001:db8:1:2::/64"] * 2]
    assert caller_of({"client": ("::ffff:192.0.2.5", 1)}, None) == "addr:192.0.2.5"
    assert caller_of({"client": ("192.0.2.5", 1)}, Grant("", "read", holder="h")) == "key:h"


def test_an_anonymous_requests_texts_computed_in_its_load_count_as_computed() -> None:
    """Texts a private request brings (here a long made-up prefix before stored
    passages), computed in its load's step (``in_place``), are prefill like any
    other: such requests are heavy and run one at a time beside another caller.
    (Before, counted as loaded, the flooder's were light: 4 at once, each an
    unsliced ~800-token forward in a step of everyone's: the load's TTFT p50 5.8x.)"""
    stored = Stored()
    for passage in PASSAGES:
        stored.put(passage)
    hook, engine = hook_with(stored)
    hook.in_place = True
    passages = [t for p in PASSAGES for t in p]
    reused = [*passages, 5, 6, 7]

    async def main() -> None:
        flood = [send(hook, "addr:f", [*unknown(HEAVY_TOKENS + 100, i), *reused]) for i in range(3)]
        await beside(hook, "addr:l", 4, reused, flood)

    asyncio.run(main())
    assert engine.most["addr:l"] == 4
    assert engine.most["addr:f"] == 1
    assert hook.shares.held_total >= 2


def test_a_burst_in_a_gap_between_anothers_requests_runs_one_at_a_time() -> None:
    """Another caller that had a request in flight within ``recent_s`` is still
    around: a burst of heavy requests sent in the gap runs one prefill at a time
    (before, all at once, and each kept its slice of every step for its whole
    prefill after the other came back); once the other has been quiet for
    ``recent_s``, the caller is alone again and held in nothing."""
    hook, engine = hook_with(Stored())
    hook.shares.recent_s = 0.5

    async def main() -> None:
        await send(hook, "addr:l", unknown(40, 1))  # the other caller, then a gap
        await asyncio.gather(*(send(hook, "addr:f", unknown(400, i)) for i in range(3)))
        first = engine.most["addr:f"]
        await asyncio.sleep(0.6)  # quiet for longer than recent_s: alone
        engine.most.clear()
        await asyncio.gather(*(send(hook, "addr:f", unknown(400, i)) for i in range(3)))
        return first

    assert asyncio.run(main()) == 1
    assert engine.most["addr:f"] == 3


def test_a_held_request_starts_once_the_others_have_been_quiet_long_enough() -> None:
    """A heavy request held while another caller is around starts when that caller
    has been quiet for ``recent_s``, with no other event to wake it."""
    shares = ComputeShares(recent_s=0.3)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        async with shares.active("addr:l"):
            pass  # (the other caller's request ended just now)
        async with shares.lane("addr:f", HEAVY_TOKENS + 1):  # the first: not held
            started = loop.time()
            async with shares.lane("addr:f", HEAVY_TOKENS + 1):  # held until then
                return loop.time() - started

    waited = asyncio.run(asyncio.wait_for(main(), 5))
    assert 0.25 < waited < 2.0 and shares.held_total == 1


def test_a_caller_has_no_more_calls_in_the_engine_than_the_busiest_other() -> None:
    """Light calls fill a step too (a beam search's, one per beam and step): beside
    another caller's calls, one has at most as many calls in the engine as the
    busiest other caller, and at least ``MIN_CALLS``; alone, or beside a caller
    with none in the engine now (around, but idle), as many as it sends."""
    hook, engine = hook_with(Stored())
    running: Counter[str] = Counter()
    most: Counter[str] = Counter()
    inner = engine.generate

    async def counting(prompt, sampling_params, request_id, **kwargs):
        caller = current().caller
        running[caller] += 1
        most[caller] = max(most[caller], running[caller])
        try:
            async for output in inner(prompt, sampling_params, request_id, **kwargs):
                yield output
        finally:
            running[caller] -= 1

    hook.generate_inner = counting

    async def main(others: int) -> None:
        flood = [send(hook, "addr:f", unknown(40, i)) for i in range(16)]
        if others:
            await beside(hook, "addr:l", others, unknown(40, 1), flood)
        else:
            await asyncio.gather(*flood)

    for others, cap in ((2, MIN_CALLS), (MIN_CALLS + 2, MIN_CALLS + 2), (0, 16)):
        most.clear()
        hook.shares.recent_s = 0.0  # (each case on its own)
        asyncio.run(main(others))
        assert most["addr:f"] == cap, (others, most)
        if others:
            assert most["addr:l"] == others
    hook.shares.recent_s = 30.0  # the other caller is around (it just sent), but idle
    most.clear()
    asyncio.run(main(0))
    assert most["addr:f"] == 16
