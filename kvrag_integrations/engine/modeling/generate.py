"""Decoding on top of any strategy's prompt cache: stops, incremental text, log-probabilities.

The result it fills (``GenerationResult``) lives with the other result types in
``engine/results.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvrag_integrations.engine.modeling.forward import PromptKV
from kvrag_integrations.engine.modeling.hf_compat import cache_argument, layered_cache

# Sampling arguments and their checks live in sampling.py; imported from here too.
from kvrag_integrations.engine.modeling.sampling import (
    SAMPLING_ARGS,
    SamplingParams,
    check_int,
    choose_token,
    logits_processors,
    sampling_params,
)

if TYPE_CHECKING:
    from transformers import StopStringCriteria

    from kvrag_integrations.engine.results import GenerationResult

__all__ = [
    "SAMPLING_ARGS",
    "SamplingParams",
    "StepSource",
    "Steps",
    "TextDecoder",
    "check_int",
    "choose_token",
    "decode",
    "dynamic_steps",
    "logits_processors",
    "sampling_params",
    "stop_string_criteria",
    "to_dynamic_cache",
    "top_logprobs",
]


def top_logprobs(logits: torch.Tensor, k: int, also: Sequence[int] = ()) -> dict[int, float]:
    """``{token id: log-probability}`` of the ``k`` likeliest tokens under ``logits``
    (a log-softmax in float32 of the raw logits: before temperature or penalties,
    as vLLM's logprobs), and of the tokens in ``also``."""
    logprobs = torch.log_softmax(logits.detach().float().reshape(-1), dim=-1)
    values, ids = logprobs.topk(min(k, logprobs.numel()))
    top = dict(zip(ids.tolist(), values.tolist()))
    top.update({int(i): float(logprobs[int(i)]) for i in also if int(i) not in top})
    return top


def to_dynamic_cache(kv: PromptKV) -> Any:
    """A transformers DynamicCache holding the prompt K/V (views, no copy)."""
    return layered_cache([k[None] for k in kv.keys], [v[None] for v in kv.values])


def dynamic_steps(lm: Any, kv: PromptKV) -> Steps:
    """Eager decode steps, ``(token, position) -> logits``, over a ``DynamicCache``
    made from the prompt cache on the first step (every model, every device)."""
    cache = None

    def step(token: int, position: int) -> torch.Tensor:
        nonlocal cache
        if cache is None:
            cache = to_dynamic_cache(kv)
        out = lm(
            input_ids=torch.tensor([[token]], device=lm.device),
            position_ids=torch.tensor([[position]], device=lm.device),
            **cache_argument(lm, cache),
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1]

    return step


Steps = Callable[[int, int], torch.Tensor]  # (token, its position) -> the next logits


class StepSource(Protocol):
    """Where ``decode`` takes its steps from when not eager (the static decode,
    ``static_decode.StaticDecoder``): None refuses the request."""

    def steps(self, lm: Any, kv: PromptKV, max_new_tokens: int) -> Steps | None: ...


_CRITERIA: dict[tuple[int, tuple[str, ...]], tuple[Any, StopStringCriteria | None]] = {}
_CRITERIA_LOCK = threading.Lock()


def stop_string_criteria(tokenizer: Any, stops: Sequence[str]) -> StopStringCriteria | None:
    """transformers' ``StopStringCriteria`` for ``stops``, built once per tokenizer.

    Building one reads the whole vocabulary (~0.2 s for a 49k vocabulary), so
    the last 64 are kept. None when there are no stop strings or transformers
    cannot match one (a character the vocabulary cannot produce): the text
    check alone then finds them.
    """
    stops = tuple(s for s in stops if s)
    if not stops:
        return None
    key = (id(tokenizer), stops)
    with _CRITERIA_LOCK:
        held = _CRITERIA.get(key)
    if held is not None and held[0] is tokenizer:
        return held[1]
    from transformers import StopStringCriteria

    try:
        criteria: StopStringCriteria | None = StopStringCriteria(tokenizer, list(stops))
    except (ValueError, TypeError, AttributeError):
        criteria = None
    with _CRITERIA_LOCK:
        while len(_CRITERIA) >= 64:
            _CRITERIA.pop(next(iter(_CRITERIA)))
        _CRITERIA[key] = (tokenizer, criteria)
    return criteria


class TextDecoder:
    """Incremental detokenization: each token decodes a short window, not every id.

    As in TGI and vLLM: the window starts at the previous emission's first
    token (context for tokenizers that drop a leading space), and text is
    emitted only once it does not end in an incomplete UTF-8 sequence (U+FFFD).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids up to here are emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """Add a token; return the new complete text (maybe empty)."""
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end)."""
        return self._advance(final=True) if self._read < len(self.ids) else ""

    def _advance(self, *, final: bool) -> str:
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""


class StopScanner:
    """Finds stop strings in streamed text, holding back what might start one.

    No occurrence can start in text already emitted: text is emitted only when
    no tail of it could begin a stop string (``safe_len``).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) - 1 for s in self.stops), default=0)

    def find(self, text: str, start: int = 0) -> int:
        """Where the first stop string in ``text[start:]`` begins, or -1."""
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits, default=-1)

    def cut(self, text: str) -> str:
        """``text`` up to its first stop string."""
        at = self.find(text)
        return text if at < 0 else text[:at]

    def safe_len(self, text: str, emitted: int) -> int:
        """How much of ``text`` can be emitted without hiding a partial stop."""
        for k in range(min(self.hold, len(text) - emitted), 0, -1):
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
    cancel: threading.Event | None = None,
    constraint: Any = None,
    static: StepSource | None = None,
) -> Iterator[str]:
    """Decode from a prompt cache, yielding text increments; fills ``result``.

    The caller holds the forward lock (``LoadedModel.lock``) for the whole
    iteration (the stream's worker thread does). ``result.ttft_s`` is set when
    the first token is chosen. Sampling is transformers' logits processors
    (``logits_processors``); a stop string ends decoding when transformers'
    ``StopStringCriteria`` sees it complete at the token level, or when the
    decoded text shows it (a tokenizer whose decoding rewrites text); the text
    is cut where it starts. ``cancel`` set stops decoding before the next
    forward (``finish_reason == "cancelled"``). ``constraint`` (a
    ``tools.constraint.ForcedCall``) masks each step's logits and ends decoding
    (``"stop"``) once the text it checks is complete. ``static`` (the weights'
    ``StaticDecoder``) runs each step over a static cache, as a CUDA graph on
    CUDA, where it takes the model and request; else steps run eagerly.
    """
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    processors = logits_processors(params)
    stops = set(eos_ids) | set(params.stop_token_ids)
    held = torch.tensor(sorted(stops), dtype=torch.long)  # masked before min_new_tokens
    if params.min_new_tokens and held.numel():
        held = held.to(first_logits.device)
    scanner = StopScanner(params.stop)
    criteria = stop_string_criteria(tokenizer, params.stop)
    detok = TextDecoder(tokenizer)
    step_fn = None
    position = kv.next_position
    logits = first_logits
    ids = detok.ids
    result.token_ids = ids  # live while decoding: a request with tools reads them (tool_answers)
    text, emitted = "", 0
    result.finish_reason = "length"
    for step in range(params.max_new_tokens):
        if constraint is not None:
            logits = constraint.mask(logits)
        if step < params.min_new_tokens and held.numel():
            logits = logits.index_fill(-1, held, float("-inf"))
        token = choose_token(logits, params, generator, ids, processors)
        if step == 0:
            result.ttft_s = time.perf_counter() - started
        if token in stops:
            result.finish_reason = "stop"
            break
        text += detok.push(token)
        hit = criteria is not None and bool(criteria(_tail(ids, criteria), None)[0])
        if constraint is not None and constraint.push(token):
            result.finish_reason = "stop"
            break
        if hit or scanner.find(text, emitted) >= 0:
            result.finish_reason = "stop"
            break
        ready = scanner.safe_len(text, emitted)
        if ready > emitted:
            yield text[emitted:ready]
            emitted = ready
        if step + 1 == params.max_new_tokens:
            break
        if cancel is not None and cancel.is_set():
            result.finish_reason = "cancelled"
            break
        if step_fn is None:  # the one step hook: static (graphs) or eager
            fast = static.steps(lm, kv, params.max_new_tokens) if static is not None else None
            step_fn = fast if fast is not None else dynamic_steps(lm, kv)
        logits = step_fn(token, position)
        position += 1
    if params.max_new_tokens == 0:
        result.ttft_s = time.perf_counter() - started
    # One full decode at the end (the text every tokenizer agrees on); the
    # streamed pieces are its prefix.
    final = scanner.cut(tokenizer.decode(ids, skip_special_tokens=True))
    if not final.startswith(text[:emitted]):  # a tokenizer decoding windows differently
        final = scanner.cut(text + detok.flush())
    if len(final) > emitted:
        yield final[emitted:]
    result.text = final
    result.token_ids = list(ids)
    result.generated_tokens = len(ids)
    result.total_s = time.perf_counter() - started


def _tail(ids: list[int], criteria: StopStringCriteria) -> torch.Tensor:
    """The last ids a stop string can span, as the ``[1, n]`` tensor criteria take."""
    return torch.tensor([ids[-criteria.maximum_token_len :]], dtype=torch.long)
