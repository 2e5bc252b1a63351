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

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from kvrag_integrations.engine.results import PrefillResult
from kvrag_integrations.engine.sampling import SAMPLING_ARGS, SamplingParams
from kvrag_integrations.engine.segments import Segment, TokenizedPrompt, cache_leading_text
from kvrag_integrations.engine.strategies import DEFAULT_STRATEGY, Strategy, make_strategy

if TYPE_CHECKING:
    from kvrag_integrations.engine.engine import KVRAGEngine

ON_MISS = ("defer", "encode")


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


def check_on_miss(on_miss: str) -> str:
    if on_miss not in ON_MISS:
        raise ValueError(f"on_miss must be one of {ON_MISS}, got {on_miss!r}")
    return on_miss


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
    """Read (or, with ``on_miss="encode"``, encode) the prompt's chunk caches;
    return the prefill forward to run (it takes the forward lock)."""
    strat, prompt, started = request.strategy, request.prompt, request.started
    if not strat.uses_chunk_caches:
        return partial(_run, engine, strat, prompt, [], set(), started)
    cached = cache_leading_text(prompt) if engine.cache_prefix else prompt
    found, missing = engine.caches.lookup(cached)
    if request.on_miss == "defer" and any(not m.is_prefix for m in missing.values()):
        # Never slower than no reuse: encoding the misses first and then
        # reusing them costs more than one plain prefill. Answer by the
        # model's own forward; the misses are encoded off the request path,
        # chunks first (if the queue is nearly full, they matter more).
        misses = dict(sorted(missing.items(), key=lambda km: km[1].is_prefix))
        return partial(_run, engine, make_strategy("full"), prompt, [], set(), started, misses)
    # Only the leading text missing (its cache is what a full prefill computes
    # anyway), or on_miss="encode": encode now and reuse.
    found.update(engine.caches.encode_missing(missing))
    kvs = engine.caches.on_device(cached, found)
    return partial(_run, engine, strat, cached, kvs, set(missing), started)


def _run(
    engine: KVRAGEngine,
    strat: Strategy,
    prompt: TokenizedPrompt,
    kvs: list[Any],
    lazy: set[str],
    started: float,
    misses: dict[str, Any] | None = None,
) -> PrefillResult:
    with engine.exclusive():
        output = strat.prefill(engine.loaded, prompt, kvs)
    elapsed = time.perf_counter() - started
    pre = PrefillResult(output, prompt, strat.name, lazy, engine.fingerprint, elapsed)
    if misses is not None:  # uncached chunks: answered by plain prefill
        pre.fallback, pre.misses = "uncached", misses
    return pre
