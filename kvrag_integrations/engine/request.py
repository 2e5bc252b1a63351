"""A request's path to its prompt cache: checked and tokenized, caches read, prefill run.

``prepare`` checks every argument and tokenizes the prompt (on the caller's
thread, so a bad request fails where it is made); ``plan_prefill`` reads the
prompt's chunk caches (no lock: disk and Redis reads overlap other requests'
forwards) and returns the prefill forward, run under the weights' forward lock.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from kvrag_integrations.engine.chat_template import Message, render_chat
from kvrag_integrations.engine.results import PrefillResult
from kvrag_integrations.engine.sampling import check_int
from kvrag_integrations.engine.segments import (
    DEFAULT_INSTRUCTION,
    Chunk,
    Segment,
    Text,
    TokenizedPrompt,
    cache_leading_text,
    check_text,
    rag_user_segments,
)
from kvrag_integrations.engine.spans import ChunkIndex, message_segments
from kvrag_integrations.engine.strategies import Strategy, make_strategy

if TYPE_CHECKING:
    from kvrag_integrations.engine.engine import KVRAGEngine

logger = logging.getLogger("kvrag_integrations.engine.engine")

_ROLE_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")

ON_MISS = ("defer", "encode")


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
    *,
    strategy: str | Strategy = "turbo",
    max_new_tokens: int = 0,
    on_miss: str | None = None,
    segments: Sequence[Segment] | None = None,
    question: str | None = None,
    chunks: Sequence[str] | None = None,
    messages: Sequence[dict[str, Any]] | None = None,
    known_chunks: Sequence[str] = (),
    system_prompt: str | None = None,
    chat_template: bool = True,
    **strategy_options: Any,
) -> Request:
    """Check a request and tokenize its prompt (no store read, no forward)."""
    started = time.perf_counter()
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=0)
    strat = make_strategy(strategy, **strategy_options)
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
    engine.check_fits(prompt.num_tokens, "the prompt", max_new_tokens)
    on_miss = engine.on_miss if on_miss is None else check_on_miss(on_miss)
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


def build_segments(
    tokenizer: Any,
    chunk_index: ChunkIndex,
    *,
    question: str | None = None,
    chunks: Sequence[str] | None = None,
    segments: Sequence[Segment] | None = None,
    messages: Sequence[dict[str, Any]] | None = None,
    known_chunks: Sequence[str] = (),
    system_prompt: str | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
    chat_template: bool = True,
) -> list[Segment]:
    """``KVRAGEngine.build_segments`` (``chunk_index`` finds chunks in strings)."""
    if sum(x is not None for x in (question, segments, messages)) != 1:
        raise ValueError("pass exactly one of question (with chunks), segments or messages")
    if chunks is not None and question is None:
        raise ValueError("chunks go with question; use segments or messages otherwise")
    if isinstance(chunks, str):
        raise TypeError("chunks must be a list of strings, not one string")
    chat: list[Message] = []
    if system_prompt is not None:
        chat.append(("system", [Text(check_text(system_prompt, "system_prompt"))]))
    if messages is not None:
        chat += [_message(m, chunk_index, known_chunks) for m in messages]
    elif segments is not None:
        bad = [type(x).__name__ for x in segments if not isinstance(x, (Text, Chunk))]
        if bad:
            raise TypeError(f"segments must be Text or Chunk, got {bad[0]}")
        chat.append(("user", list(segments)))
    else:
        chat.append(("user", rag_user_segments(question, list(chunks or []), instruction)))
    if chat_template and not getattr(tokenizer, "chat_template", None):
        logger.info("tokenizer has no chat template; using the plain prompt")
        chat_template = False
    if chat_template:
        return render_chat(tokenizer, chat)
    flat: list[Segment] = []
    for role, content in chat:
        flat += content
        if role == "system":
            flat.append(Text("\n\n"))
    return flat


def _message(
    message: dict[str, Any], chunk_index: ChunkIndex, known_chunks: Sequence[str]
) -> Message:
    if not isinstance(message, dict) or "role" not in message or "content" not in message:
        raise TypeError('each message must be a dict with "role" and "content"')
    role = message["role"]
    if not isinstance(role, str):
        raise TypeError(f"a message role must be a str, got {type(role).__name__}")
    if not _ROLE_RE.fullmatch(role):  # the template writes roles as markup
        raise ValueError(f"a message role must be a plain name like 'user', got {role!r}")
    return role, message_segments(message["content"], chunk_index, known_chunks)
