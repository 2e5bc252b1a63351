"""How the next token is chosen: checked sampling arguments and transformers' processors."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import LogitsProcessorList


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
    # the end-of-answer and stop token ids are masked until this many tokens
    # (transformers' min_new_tokens, vLLM's min_tokens); stop strings still stop
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        self.max_new_tokens = check_int("max_new_tokens", self.max_new_tokens, minimum=0)
        self.min_new_tokens = check_int("min_new_tokens", self.min_new_tokens, minimum=0)
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

    Adapters merge a call's options with ``request.RequestOptions``, which
    checks these values (and the strategy) before any retrieval or forward.

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


def logits_processors(params: SamplingParams) -> LogitsProcessorList:
    """transformers' logits processors for ``params``, in ``generate()``'s order.

    Repetition penalty (over the generated tokens), then, when sampling,
    temperature, top-k and top-p. Greedy decoding with no penalty has none.
    """
    from transformers import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if not params.greedy:
        if params.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            processors.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            processors.append(TopPLogitsWarper(params.top_p))
    return processors


def choose_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    previous: Sequence[int] = (),
    processors: LogitsProcessorList | None = None,
) -> int:
    """Pick the next token from ``[vocab]`` logits (``previous``: the generated ids)."""
    processors = logits_processors(params) if processors is None else processors
    scores = logits.float()[None]
    if processors:
        ids = torch.tensor([list(previous)], dtype=torch.long, device=scores.device)
        scores = processors(ids, scores)
    if params.greedy:
        return int(torch.argmax(scores[0]).item())
    probs = torch.softmax(scores[0], dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())
