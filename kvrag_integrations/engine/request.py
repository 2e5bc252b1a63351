"""A request's path to its prompt cache: options merged, checked and tokenized, caches read.

``RequestOptions`` is how a request is answered (strategy and its options,
sampling, miss policy) and the one place where a call's options are merged
with defaults: the engine's own, or an adapter's instance settings.
``prepare`` checks every argument and tokenizes the prompt (on the caller's
thread, so a bad request fails where it is made); ``plan_prefill`` reads the
prompt's chunk caches (no lock: disk and Redis reads overlap other requests'
forwards) and returns the prefill forward, run under the weights' forward lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.caching.entries import Miss
from kvrag_integrations.engine.modeling.sampling import SAMPLING_ARGS, SamplingParams
from kvrag_integrations.engine.prompting.segments import (
    Segment,
    TokenizedPrompt,
    cache_leading_text,
)
from kvrag_integrations.engine.results import ChunkSources, PrefillResult
from kvrag_integrations.engine.scheduling.miss_policy import ON_MISS, Misses, check_on_miss, decide
from kvrag_integrations.engine.strategies import DEFAULT_STRATEGY, Strategy, make_strategy

if TYPE_CHECKING:
    from kvrag_integrations.engine.engine import KVRAGEngine

logger = logging.getLogger(__name__)

__all__ = ["ON_MISS", "Request", "RequestOptions", "check_on_miss", "plan_prefill", "prepare"]


@dataclass(frozen=True)
class RequestOptions:
    """How one request is answered: its strategy (with options), sampling and miss policy.

    ``RequestOptions()`` holds the engine's defaults. Everything that answers
    requests merges into them with ``merged``: the engine a call's keywords, an
    adapter its instance settings and then each call's options, having
    translated its framework's names (LangChain's ``max_tokens``, ...) to the
    engine's. Every instance is checked when made, before any retrieval or
    forward: a bad sampling value raises ``TypeError`` or ``ValueError`` naming
    the argument (``SamplingParams``), an unknown strategy
    ``UnknownStrategyError``, an option the strategy does not take
    ``TypeError`` (``make_strategy``), a bad ``on_miss`` ``ValueError``.
    ``on_miss=None`` is the engine's own policy.

    Examples:
        >>> blend = RequestOptions().merged(
        ...     {"strategy": "blend", "strategy_options": {"recompute_ratio": 0.3}}
        ... )
        >>> blend.merged({"temperature": 0.5}).strategy_options
        {'recompute_ratio': 0.3}
        >>> blend.merged({"strategy": "turbo"}).strategy_options  # not blend's options
        {}
        >>> blend.merged({"check_layer": 2}).as_kwargs()["check_layer"]
        2
        >>> RequestOptions().merged({"top_p": 0.0})
        Traceback (most recent call last):
        ...
        ValueError: top_p must be in (0, 1], got 0.0
    """

    strategy: str | Strategy = DEFAULT_STRATEGY
    strategy_options: dict[str, Any] = field(default_factory=dict)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    on_miss: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(self.sampling).__name__}")
        if self.on_miss is not None:
            check_on_miss(self.on_miss)
        object.__setattr__(self, "strategy_options", _option_dict(self.strategy_options))
        make_strategy(self.strategy, **self.strategy_options)

    def merged(self, call: Mapping[str, Any]) -> RequestOptions:
        """These options overridden by ``call`` (the engine's argument names).

        ``strategy``, ``on_miss`` and the sampling arguments (``SAMPLING_ARGS``)
        replace their values (None too: an adapter whose framework means "not
        given" by None leaves the key out). ``strategy_options`` (a mapping;
        None: none given) and every other key are strategy options: they update
        the inherited ones, which are these options' when ``call`` keeps this
        strategy and none when it names another (a default's options belong to
        the default's strategy).
        """
        call = dict(call)
        given = call.pop("strategy_options", None)
        sampling = {name: call.pop(name) for name in SAMPLING_ARGS if name in call}
        changed = {name: call.pop(name) for name in ("strategy", "on_miss") if name in call}
        sampling_params = replace(self.sampling, **sampling)  # sampling is checked first
        strategy = changed.get("strategy", self.strategy)
        options = dict(self.strategy_options) if strategy == self.strategy else {}
        options.update(_option_dict(given) if given is not None else {})
        options.update(call)  # what is left: strategy options passed as keywords
        return replace(self, **changed, strategy_options=options, sampling=sampling_params)

    def as_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``engine.generate`` / ``stream`` / ``astream``:
        the strategy, its options as keywords, the sampling arguments and ``on_miss``."""
        kwargs: dict[str, Any] = {"strategy": self.strategy, **self.strategy_options}
        kwargs.update({name: getattr(self.sampling, name) for name in SAMPLING_ARGS})
        kwargs["on_miss"] = self.on_miss
        return kwargs


def _option_dict(options: Any) -> dict[str, Any]:
    """``strategy_options`` as a new dict; anything but a mapping is a ``TypeError``."""
    if not isinstance(options, Mapping):
        raise TypeError(
            f"strategy_options must be a mapping of option names, got {type(options).__name__}"
        )
    return dict(options)


@dataclass
class Request:
    """A checked request: its strategy, tokenized prompt, miss policy and start time."""

    strategy: Strategy
    prompt: TokenizedPrompt
    on_miss: str
    started: float


def prepare(
    engine: KVRAGEngine,
    options: RequestOptions,
    *,
    segments: Sequence[Segment] | None = None,
    question: str | None = None,
    chunks: Sequence[str] | None = None,
    messages: Sequence[dict[str, Any]] | None = None,
    known_chunks: Sequence[str] = (),
    system_prompt: str | None = None,
    chat_template: bool = True,
) -> Request:
    """Tokenize a request's prompt (no store read, no forward); ``options`` are checked."""
    started = time.perf_counter()
    strat = make_strategy(options.strategy, **options.strategy_options)
    segs = engine.build_segments(
        question=question,
        chunks=chunks,
        segments=segments,
        messages=messages,
        known_chunks=known_chunks,
        system_prompt=system_prompt,
        chat_template=chat_template,
    )
    prompt = engine.tokenize(segs)
    if prompt.num_tokens == 0:
        raise ValueError("the prompt is empty")
    engine.check_fits(prompt.num_tokens, "the prompt", options.sampling.max_new_tokens)
    on_miss = engine.on_miss if options.on_miss is None else options.on_miss
    return Request(strat, prompt, on_miss, started)


def plan_prefill(engine: KVRAGEngine, request: Request) -> Callable[[], PrefillResult]:
    """Read the prompt's chunk caches, decide what to do about missing ones
    (``miss_policy.decide``), take over or encode them if reusing, and return the
    prefill forward to run (it takes the forward lock)."""
    strat, prompt, started = request.strategy, request.prompt, request.started
    sources = ChunkSources(policy=request.on_miss)
    if not strat.uses_chunk_caches:
        sources.reason = f"strategy {strat.name!r} reads no chunk caches"
        return partial(_run, engine, strat, prompt, [], started, sources)
    cached = cache_leading_text(prompt) if engine.cache_prefix else prompt
    found, missing = engine.caches.lookup(cached)
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
    chunk_keys = {k for k in found if k not in missing} - _prefix_keys(engine, cached)
    sources.reused = len(chunk_keys)
    got, lazy, taken = gather_missing(engine, missing, seen, sources)
    found.update(got)
    kvs = engine.caches.on_device(cached, found)
    _check_residency(engine, cached, kvs, sources)
    return partial(_run, engine, strat, cached, kvs, started, sources, None, lazy, taken)


def gather_missing(
    engine: KVRAGEngine, missing: dict[str, Miss], seen: int | None, sources: ChunkSources
) -> tuple[dict[str, ChunkKV], set[str], set[str]]:
    """The caches of ``missing``, each encoded once whoever else needs it.

    Claims every missing key on the engine's ledger (``BackgroundEncoder.claim``):
    queued ones are taken off the queue and, with new ones, encoded here (under
    the forward lock); ones in flight elsewhere are waited for. Counts them in
    ``sources`` (chunks only). Returns the caches by key, the keys encoded for
    this request alone (prefilled) and the keys taken over from the queue.
    """
    ledger = engine.encoder
    claim = ledger.claim({k: (m.ids, m.store) for k, m in missing.items()}, seen)
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
    engine: KVRAGEngine, missing: dict[str, Miss]
) -> tuple[dict[str, ChunkKV], set[str], set[str]]:
    """Encode ``missing`` outside the ledger (see ``gather_missing``)."""
    return engine.caches.encode_missing(missing), set(missing), set()


def _read(engine: KVRAGEngine, missing: dict[str, Miss]) -> dict[str, ChunkKV]:
    """Those of ``missing`` stored now (each from its own store)."""
    fp = engine.fingerprint
    read = {k: m.store.get(k, fp) for k, m in missing.items()}
    return {k: kv for k, kv in read.items() if kv is not None}


def _prefix_keys(engine: KVRAGEngine, prompt: TokenizedPrompt) -> set[str]:
    return {engine.caches.piece_key(p) for p in prompt.cached_pieces if p.is_prefix}


def _computed_tokens(strat: Strategy, prompt: TokenizedPrompt) -> int:
    """Tokens a reuse strategy computes: the text, the last token, and blend's share."""
    cached = sum(p.ids.numel() for p in prompt.cached_pieces)
    ratio = float(getattr(strat, "recompute_ratio", 0.0) or 0.0)
    chunks = sum(p.ids.numel() for p in prompt.chunk_pieces)
    return prompt.num_tokens - cached + 1 + int(ratio * chunks)


def _check_residency(
    engine: KVRAGEngine, prompt: TokenizedPrompt, kvs: list[ChunkKV], sources: ChunkSources
) -> None:
    """Warn (once per engine) when the prompt's chunk caches cannot all stay in the store."""
    chunks = [kv for kv, p in zip(kvs, prompt.cached_pieces) if not p.is_prefix]
    nbytes = sum(kv.nbytes for kv in {id(kv): kv for kv in chunks}.values())
    reason = engine.caches.residency.check(engine.store, nbytes, len(chunks))
    if reason is not None:
        sources.reason += f"; {reason}"


def _run(
    engine: KVRAGEngine,
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
    pre = PrefillResult(output, prompt, strat.name, set(lazy), engine.fingerprint, elapsed)
    pre.sources, pre.taken_keys = sources, set(taken)
    if misses is not None:  # uncached chunks: answered by plain prefill
        evicted = any(m.evicted for m in misses.values())
        pre.fallback, pre.misses = ("evicted" if evicted else "uncached"), misses
    return pre


def _record(
    engine: KVRAGEngine, strat: Strategy, prompt: TokenizedPrompt, output: Any, seconds: float
) -> None:
    """Feed the measured forward to the cost model (``on_miss="auto"`` decides by it)."""
    costs = engine.loaded.costs
    if not strat.uses_chunk_caches:
        costs.record_full(prompt.num_tokens, seconds)
        return
    _, recomputed, prefilled = output.token_counts()
    costs.record_reuse(strat.name, prompt.num_tokens, recomputed + prefilled, seconds)
