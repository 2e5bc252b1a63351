"""Decoding on top of any strategy's prompt cache: sampling, stops, streaming."""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from kvrag_integrations.engine.forward import PromptKV


@dataclass
class SamplingParams:
    """How the next token is chosen. ``temperature=0`` means greedy.

    Every check on sampling arguments lives here, and every entry point (engine,
    adapters, command line) builds one before any forward: a bad value is a
    ``TypeError`` (wrong type) or ``ValueError`` (out of range, NaN) naming the
    argument. ``stop`` and ``stop_token_ids`` may be None (none) and are kept as
    tuples.

    Examples:
        >>> SamplingParams(temperature=0.7, top_p=0.9).greedy
        False
        >>> SamplingParams(stop=None).stop
        ()
        >>> SamplingParams(temperature=float("nan"))
        Traceback (most recent call last):
        ...
        ValueError: temperature must be a finite number >= 0, got nan
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: Sequence[str] | None = ()
    stop_token_ids: Sequence[int] | None = ()

    def __post_init__(self) -> None:
        self.max_new_tokens = check_int("max_new_tokens", self.max_new_tokens, minimum=0)
        self.top_k = check_int("top_k", self.top_k, minimum=0)
        temperature = _real("temperature", self.temperature)
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        top_p = _real("top_p", self.top_p)
        if not 0 < top_p <= 1:  # False for NaN too
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        penalty = _real("repetition_penalty", self.repetition_penalty)
        if not (math.isfinite(penalty) and penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {penalty}")
        self.temperature, self.top_p, self.repetition_penalty = temperature, top_p, penalty
        if self.seed is not None:
            self.seed = check_int("seed", self.seed)
            try:
                torch.Generator().manual_seed(self.seed)
            except (RuntimeError, ValueError, OverflowError) as exc:
                raise ValueError(f"seed {self.seed} is out of range: {exc}") from None
        self.stop = _items("stop", self.stop, str)
        self.stop_token_ids = tuple(
            check_int("stop_token_ids", i, minimum=0)
            for i in _items("stop_token_ids", self.stop_token_ids, int)
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


SAMPLING_ARGS = tuple(f.name for f in fields(SamplingParams))


def sampling_params(options: dict[str, Any]) -> SamplingParams:
    """The ``SamplingParams`` of a request's options (other keys are ignored).

    Adapters call it when they merge a call's options, so that bad values fail
    before any retrieval or forward.

    Examples:
        >>> sampling_params({"temperature": 0.5, "strategy": "turbo"}).temperature
        0.5
    """
    return SamplingParams(**{k: options[k] for k in SAMPLING_ARGS if k in options})


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` as an int (bools and floats refused), at least ``minimum``.

    Examples:
        >>> check_int("top_k", 2.5)
        Traceback (most recent call last):
        ...
        TypeError: top_k must be an int, got float 2.5
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def _items(name: str, value: Any, kind: type) -> tuple[Any, ...]:
    """A tuple of ``kind`` items from None (empty), one ``kind`` value or a sequence."""
    if value is None:
        return ()
    if kind is str and isinstance(value, str):
        return (value,)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list of {kind.__name__}, got {type(value).__name__}")
    items = tuple(value)
    for item in items:
        bad = isinstance(item, bool) or not isinstance(item, kind)
        if kind is int:
            bad = isinstance(item, bool) or not isinstance(item, numbers.Integral)
        if bad:
            raise TypeError(
                f"{name} must hold only {kind.__name__} values, got {type(item).__name__} {item!r}"
            )
    return items


@dataclass
class GenerationResult:
    """One answer and what it cost.

    Attributes:
        text: the generated text (stop string excluded).
        ttft_s: seconds from the request to the first token's logits.
        reused_tokens: prompt tokens whose stored K/V were used as is: chunk tokens
            plus the cached leading text (``reused_chunk_tokens +
            reused_prefix_tokens``).
        recomputed_tokens: cached tokens computed again (CacheBlend).
        prefilled_tokens: prompt tokens computed from scratch.
        generated_tokens: tokens decoded.
        prompt_tokens: all prompt tokens.
        strategy: the strategy's name.
        finish_reason: ``"stop"`` (EOS or stop string) or ``"length"``.
        total_s: seconds for the whole request.
        token_ids: the generated ids.
        reused_prefix_tokens: the part of ``reused_tokens`` that is the prompt's
            cached leading text (system prompt, template header, instruction).
        reused_chunk_tokens: the part of ``reused_tokens`` that is retrieved chunks.
        lazily_encoded_chunks: chunks encoded on the request path (``on_miss="encode"``).
        fallback: ``"uncached"`` when the prompt's chunks were not cached and it
            was answered by plain prefill (``on_miss="defer"``), else None.
        deferred_chunks: chunks queued for background encoding by this request.
        first_token_logits: float32 logits of the first generated token.
    """

    text: str = ""
    ttft_s: float = 0.0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    strategy: str = ""
    finish_reason: str = "length"
    total_s: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    first_token_logits: torch.Tensor | None = field(default=None, repr=False)
    lazily_encoded_chunks: int = 0
    reused_prefix_tokens: int = 0
    reused_chunk_tokens: int = 0
    fallback: str | None = None
    deferred_chunks: int = 0

    @property
    def stats(self) -> dict[str, Any]:
        """The numbers as a plain dict (for logs and framework metadata)."""
        return {
            "strategy": self.strategy,
            "ttft_s": self.ttft_s,
            "total_s": self.total_s,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "generated_tokens": self.generated_tokens,
            "lazily_encoded_chunks": self.lazily_encoded_chunks,
            "reused_prefix_tokens": self.reused_prefix_tokens,
            "reused_chunk_tokens": self.reused_chunk_tokens,
            "fallback": self.fallback,
            "deferred_chunks": self.deferred_chunks,
            "finish_reason": self.finish_reason,
        }


def to_dynamic_cache(kv: PromptKV) -> Any:
    """A transformers DynamicCache holding the prompt K/V (views, no copy)."""
    return layered_cache([k[None] for k in kv.keys], [v[None] for v in kv.values])


def layered_cache(
    keys: Sequence[torch.Tensor] | torch.Tensor, values: Sequence[torch.Tensor] | torch.Tensor
) -> Any:
    """A transformers DynamicCache of per-layer K/V, each ``[batch, kv_heads, tokens,
    head_dim]`` (a list, or a tensor stacked by layer; views, no copy)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, layer)
    return cache


def choose_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    previous: Sequence[int] = (),
) -> int:
    """Pick the next token from ``[vocab]`` float32 logits."""
    logits = logits.float().clone()
    if params.repetition_penalty != 1.0 and previous:
        seen = torch.tensor(sorted(set(previous)), device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(
            vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty
        )
    if params.greedy:
        return int(torch.argmax(logits).item())
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits[logits < kth] = float("-inf")
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) > params.top_p
        logits[order[drop]] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


class _StopScanner:
    """Finds stop strings in streamed text, holding back what might start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) - 1 for s in self.stops), default=0)

    def cut(self, text: str) -> tuple[str, bool]:
        """Return (text up to the first stop string, whether one was found)."""
        hits = [text.find(s) for s in self.stops if s in text]
        return (text[: min(hits)], True) if hits else (text, False)

    def safe_len(self, text: str) -> int:
        """How much of ``text`` can be emitted without hiding a partial stop."""
        if not self.stops:
            return len(text)
        for k in range(min(self.hold, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return len(text) - k
        return len(text)


@torch.no_grad()
def decode(
    lm: Any,
    tokenizer: Any,
    kv: PromptKV,
    first_logits: torch.Tensor,
    params: SamplingParams,
    result: GenerationResult,
    started: float,
    eos_ids: Sequence[int],
    lock: AbstractContextManager[Any] | None = None,
) -> Iterator[str]:
    """Decode from a prompt cache, yielding text increments; fills ``result``.

    ``result.ttft_s`` is set when the first token is chosen. ``lock`` (the
    engine's) is held for each forward only, never across a ``yield``: a consumer
    that stops reading holds nothing, and other requests' forwards interleave
    with this one's steps (each request has its own cache, so answers do not
    change).
    """
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    stops = set(eos_ids) | set(params.stop_token_ids)
    scanner = _StopScanner(params.stop)
    cache = None
    position = kv.next_position
    logits = first_logits
    ids: list[int] = []
    emitted = 0
    result.finish_reason = "length"
    for step in range(params.max_new_tokens):
        token = choose_token(logits, params, generator, ids)
        if step == 0:
            result.ttft_s = time.perf_counter() - started
        if token in stops:
            result.finish_reason = "stop"
            break
        ids.append(token)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        text, hit = scanner.cut(text)
        if hit:
            result.finish_reason = "stop"
            if len(text) > emitted:
                yield text[emitted:]
            emitted = len(text)
            break
        # An incomplete UTF-8 sequence decodes to U+FFFD: wait for the next token.
        ready = scanner.safe_len(text.rstrip("\ufffd"))
        if ready > emitted:
            yield text[emitted:ready]
            emitted = ready
        if step + 1 == params.max_new_tokens:
            break
        if cache is None:
            cache = to_dynamic_cache(kv)
        with lock if lock is not None else nullcontext():
            out = lm(
                input_ids=torch.tensor([[token]], device=lm.device),
                position_ids=torch.tensor([[position]], device=lm.device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        position += 1
        logits = out.logits[0, -1]
    else:
        text = ""
    if params.max_new_tokens == 0:
        result.ttft_s = time.perf_counter() - started
    final = tokenizer.decode(ids, skip_special_tokens=True)
    final, _ = scanner.cut(final)
    if len(final) > emitted:
        yield final[emitted:]
    result.text = final
    result.token_ids = ids
    result.generated_tokens = len(ids)
    result.total_s = time.perf_counter() - started
