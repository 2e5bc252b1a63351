"""The in-process engine's job: a request's caches read, then prefill and decoding.

``answer`` is what ``KVRAGEngine`` runs for a prepared ``Request`` (the
frontend prepares it on the caller's thread; a stream's worker, or
``generate``'s caller, runs this): ``plan_prefill`` reads the prompt's chunk
caches (no lock: disk and Redis reads overlap other requests' forwards),
decides about missing ones (``miss_policy.decide``) and returns the prefill
forward; ``answer`` runs it and decodes under the weights' forward lock.

Typed against ``InProcessEngine`` (what this path uses of an engine), not the
engine class, which imports this module.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from functools import partial
from typing import Any, Protocol

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.caching.chunk_caches import ChunkCaches
from kvrag_integrations.engine.caching.entries import Miss
from kvrag_integrations.engine.modeling.generate import decode, top_logprobs
from kvrag_integrations.engine.modeling.model import LoadedModel
from kvrag_integrations.engine.prompting.segments import TokenizedPrompt, cache_leading_text
from kvrag_integrations.engine.request import Request
from kvrag_integrations.engine.results import ChunkSources, GenerationResult, PrefillResult
from kvrag_integrations.engine.scheduling.background import BackgroundEncoder
from kvrag_integrations.engine.scheduling.miss_policy import Misses, decide
from kvrag_integrations.engine.strategies import Strategy, make_strategy
from kvrag_integrations.engine.streaming import acquire
from kvrag_integrations.engine.tools.constraint import ForcedCall, schema_keys
from kvrag_integrations.store import KVStore

logger = logging.getLogger("kvrag_integrations.engine.request")  # the name docs give it

__all__ = ["InProcessEngine", "answer", "gather_missing", "plan_prefill"]


class InProcessEngine(Protocol):
    """What this path uses of an engine (``KVRAGEngine`` has it)."""

    loaded: LoadedModel
    caches: ChunkCaches
    encoder: BackgroundEncoder
    cache_prefix: bool
    model: Any
    tokenizer: Any

    @property
    def fingerprint(self) -> str: ...

    @property
    def store(self) -> KVStore: ...

    @property
    def eos_token_ids(self) -> list[int]: ...

    def exclusive(self) -> AbstractContextManager[Any]: ...

    def queue_deferred(self, pre: PrefillResult) -> int: ...


def answer(
    engine: InProcessEngine, request: Request, result: GenerationResult, cancel: threading.Event
) -> Iterator[str]:
    """One request: its caches read, then prefill and decoding under the forward lock.

    The request counts as foreground work on the forward lock from its planning
    on (background encoding pauses for it), and the lock is released before the
    fallback's missed chunks are queued for background encoding, so the encoder
    never runs between prefill and decoding. ``request.logprobs``: the first
    token's top log-probabilities, from the prefill's logits.
    """
    lock = engine.loaded.lock
    pre = None
    try:
        with lock.request():  # from here on, background encoding pauses for this request
            prefill = plan_prefill(engine, request)
            if not acquire(lock, cancel):
                result.finish_reason = "cancelled"
                return
            try:
                # The request's static decode bucket, reserved before the prefill: the
                # strategy lays the prompt out in it, decoding starts there (no copy).
                sizes = (request.prompt.num_tokens, request.sampling.max_new_tokens)
                with engine.loaded.decoder.reserve(engine.model, *sizes):
                    pre = prefill()
                    pre.fill(result)
                    if request.logprobs is not None:  # before decoding: a stream has them early
                        result.first_token_logprobs = top_logprobs(pre.logits, request.logprobs)
                    yield from decode(
                        engine.model,
                        engine.tokenizer,
                        pre.output.kv,
                        pre.output.logits,
                        request.sampling,
                        result,
                        request.started,
                        engine.eos_token_ids,
                        cancel,
                        _constraint(engine, request),
                        engine.loaded.decoder,
                    )
                    if request.logprobs is not None and result.token_ids:
                        # The sampled token too, even outside the top k (as vLLM reports it).
                        first = result.token_ids[:1]
                        result.first_token_logprobs = top_logprobs(
                            pre.logits, request.logprobs, first
                        )
            finally:
                lock.release()
    finally:
        if pre is not None:  # misses of a fallback: encoded once this request is answered
            result.deferred_chunks = engine.queue_deferred(pre)


def _constraint(engine: InProcessEngine, request: Request) -> ForcedCall | None:
    """A forced tool call's decoding constraint (None: the model writes freely)."""
    plan = request.tools
    if plan is None or not plan.forced:
        return None
    _, heads, written = plan.forced_start()
    schema = plan.schemas[plan.forced[0]] if len(plan.forced) == 1 else {}
    one_key = len(schema.get("properties") or {}) == 1
    keys = [schema_keys(plan.schemas[name]) for name in plan.forced]  # one per head
    greedy = request.sampling.greedy
    return ForcedCall(engine.tokenizer, heads, greedy, written, one_key, keys=keys)


def plan_prefill(engine: InProcessEngine, request: Request) -> Callable[[], PrefillResult]:
    """Read the prompt's chunk caches, decide what to do about missing ones
    (``miss_policy.decide``), take over or encode them if reusing, and return the
    prefill forward to run (it takes the forward lock)."""
    strat, prompt, started = request.strategy, request.prompt, request.started
    sources = ChunkSources(policy=request.on_miss)
    if not strat.uses_chunk_caches:
        sources.reason = f"strategy {strat.name!r} reads no chunk caches"
        return partial(_run, engine, strat, prompt, [], started, sources)
    context = strat.chunk_context  # the entries it reads (None: the engine's)
    cached = cache_leading_text(prompt) if engine.cache_prefix else prompt
    cached = engine.caches.in_context(cached, context)
    found, missing = engine.caches.lookup(cached, context)
    status, seen = engine.encoder.state(missing)
    misses = Misses(
        *(
            [len(m.ids) for k, m in missing.items() if not m.is_prefix and status.get(k) == kind]
            for kind in (None, "queued", "in flight")
        )
    )
    plan = decide(
        request.on_miss,
        misses,
        engine.loaded.costs,
        strategy=strat.name,
        prompt_tokens=prompt.num_tokens,
        computed_tokens=_computed_tokens(strat, cached),
        can_wait=not engine.loaded.lock.held(),
    )
    sources.evicted = sum(m.evicted for m in missing.values())
    sources.reason = plan.reason
    if sources.evicted:
        sources.reason += f" ({sources.evicted} of them stored before: evicted since)"
    if not plan.reuse:
        logger.debug("full prefill: %s", plan.reason)
        # Chunks first in the queue (if it is nearly full, they matter more).
        deferred = dict(sorted(missing.items(), key=lambda km: km[1].is_prefix))
        return partial(_run, engine, make_strategy("full"), prompt, [], started, sources, deferred)
    logger.debug("reuse: %s", plan.reason)
    chunk_keys = {k for k in found if k not in missing} - _prefix_keys(engine, cached, context)
    sources.reused = len(chunk_keys)
    got, lazy, taken = gather_missing(engine, missing, seen, sources)
    found.update(got)
    kvs = engine.caches.on_device(cached, found, context)
    _check_residency(engine, cached, kvs, sources)
    return partial(_run, engine, strat, cached, kvs, started, sources, None, lazy, taken)


def gather_missing(
    engine: InProcessEngine, missing: dict[str, Miss], seen: int | None, sources: ChunkSources
) -> tuple[dict[str, ChunkKV], set[str], set[str]]:
    """The caches of ``missing``, each encoded once whoever else needs it.

    Claims every missing key on the engine's ledger (``BackgroundEncoder.claim``):
    queued ones are taken off the queue and, with new ones, encoded here (under
    the forward lock); ones in flight elsewhere are waited for. Counts them in
    ``sources`` (chunks only). Returns the caches by key, the keys encoded for
    this request alone (prefilled) and the keys taken over from the queue.
    """
    ledger = engine.encoder
    claim = ledger.claim(missing, seen)
    got: dict[str, ChunkKV] = {}
    stored: dict[str, ChunkKV] = {}
    todo: dict[str, Miss] = {}
    try:
        if claim.stale:  # an encoding ended since the lookup: it may be stored now
            stored = _read(engine, {k: missing[k] for k, f in claim.mine.items() if not f.queued})
        todo = {k: missing[k] for k in claim.mine if k not in stored}
        got.update(stored)
        got.update(engine.caches.encode_missing(todo))
    finally:
        ledger.finish(claim.mine.values(), got)
    taken = {k for k in todo if claim.mine[k].queued}
    lazy = set(todo) - taken
    chunk = {k for k, m in missing.items() if not m.is_prefix}
    sources.encoded += len(lazy & chunk)
    sources.taken_over += len(taken & chunk)
    sources.reused += len(stored.keys() & chunk)
    if claim.theirs and engine.loaded.lock.held():
        # The caller holds the forward lock, which those encodings need: they
        # cannot end while it waits, so it encodes them too (the one exception).
        more, more_lazy, _ = _encode_now(engine, {k: missing[k] for k in claim.theirs})
        got.update(more)
        lazy |= more_lazy
        sources.encoded += len(more_lazy & chunk)
    elif claim.theirs:
        done = ledger.await_flights(claim.theirs)
        ok = {k: kv for k, kv in done.items() if kv is not None}
        failed = {k: missing[k] for k in done if k not in ok}
        ok.update(_read(engine, failed))  # failed there, or stored without handing it over
        got.update(ok)
        sources.awaited += len(ok.keys() & chunk)
        again = {k: m for k, m in failed.items() if k not in ok}
        if again:  # failed elsewhere: this request encodes them
            more, more_lazy, more_taken = gather_missing(engine, again, None, sources)
            got.update(more)
            lazy |= more_lazy
            taken |= more_taken
    return got, lazy, taken


def _encode_now(
    engine: InProcessEngine, missing: dict[str, Miss]
) -> tuple[dict[str, ChunkKV], set[str], set[str]]:
    """Encode ``missing`` outside the ledger (see ``gather_missing``)."""
    return engine.caches.encode_missing(missing), set(missing), set()


def _read(engine: InProcessEngine, missing: dict[str, Miss]) -> dict[str, ChunkKV]:
    """Those of ``missing`` stored now (each from its own store, in its own context)."""
    caches = engine.caches
    read = {k: m.store.get(k, caches.fingerprint_for(m.context)) for k, m in missing.items()}
    return {k: kv for k, kv in read.items() if kv is not None}


def _prefix_keys(engine: InProcessEngine, prompt: TokenizedPrompt, context: str | None) -> set[str]:
    return {engine.caches.piece_key(p, context) for p in prompt.cached_pieces if p.is_prefix}


def _computed_tokens(strat: Strategy, prompt: TokenizedPrompt) -> int:
    """Tokens a reuse strategy computes: the text, the last token, and blend's share."""
    cached = sum(p.ids.numel() for p in prompt.cached_pieces)
    ratio = float(getattr(strat, "recompute_ratio", 0.0) or 0.0)
    chunks = sum(p.ids.numel() for p in prompt.chunk_pieces)
    return prompt.num_tokens - cached + 1 + int(ratio * chunks)


def _check_residency(
    engine: InProcessEngine, prompt: TokenizedPrompt, kvs: list[ChunkKV], sources: ChunkSources
) -> None:
    """Warn (once per engine) when the prompt's chunk caches cannot all stay in the store."""
    chunks = [kv for kv, p in zip(kvs, prompt.cached_pieces) if not p.is_prefix]
    nbytes = sum(kv.nbytes for kv in {id(kv): kv for kv in chunks}.values())
    reason = engine.caches.residency.check(engine.store, nbytes, len(chunks))
    if reason is not None:
        sources.reason += f"; {reason}"


def _run(
    engine: InProcessEngine,
    strat: Strategy,
    prompt: TokenizedPrompt,
    kvs: list[Any],
    started: float,
    sources: ChunkSources,
    misses: dict[str, Miss] | None = None,
    lazy: set[str] = frozenset(),  # type: ignore[assignment]
    taken: set[str] = frozenset(),  # type: ignore[assignment]
) -> PrefillResult:
    with engine.exclusive():
        begun = time.perf_counter()
        output = strat.prefill(engine.loaded, prompt, kvs)
        forward_s = time.perf_counter() - begun
    _record(engine, strat, prompt, output, forward_s)
    elapsed = time.perf_counter() - started
    fingerprint = engine.caches.fingerprint_for(strat.chunk_context)  # its entries' key space
    pre = PrefillResult(output, prompt, strat.name, set(lazy), fingerprint, elapsed)
    pre.sources, pre.taken_keys = sources, set(taken)
    if misses is not None:  # uncached chunks: answered by plain prefill
        evicted = any(m.evicted for m in misses.values())
        pre.fallback, pre.misses = ("evicted" if evicted else "uncached"), misses
    return pre


def _record(
    engine: InProcessEngine, strat: Strategy, prompt: TokenizedPrompt, output: Any, seconds: float
) -> None:
    """Feed the measured forward to the cost model (``on_miss="auto"`` decides by it)."""
    costs = engine.loaded.costs
    if not strat.uses_chunk_caches:
        costs.record_full(prompt.num_tokens, seconds)
        return
    _, recomputed, prefilled = output.token_counts()
    costs.record_reuse(strat.name, prompt.num_tokens, recomputed + prefilled, seconds)
