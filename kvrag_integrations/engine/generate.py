"""Decoding on top of any strategy's prompt cache: sampling, stops, streaming."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvrag_integrations.engine.layers import PromptKV


@dataclass
class SamplingParams:
    """How the next token is chosen. ``temperature=0`` means greedy.

    Examples:
        >>> SamplingParams(temperature=0.7, top_p=0.9).greedy
        False
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer in range(kv.keys.shape[0]):
        cache.update(kv.keys[layer].unsqueeze(0), kv.values[layer].unsqueeze(0), layer)
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
) -> Iterator[str]:
    """Decode from a prompt cache, yielding text increments; fills ``result``.

    ``result.ttft_s`` is set when the first token is chosen.
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
