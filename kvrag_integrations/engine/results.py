"""What the engines hand back: answers (``GenerationResult``), prompt caches (a
strategy's ``PrefillOutput``, the engine's ``PrefillResult``) and where a
request's chunk caches came from (``ChunkSources``).

Kept apart from the model code: nothing here runs a forward, and at run time it
imports nothing of the engine (``modeling.generate`` fills ``GenerationResult``;
streams are in ``streaming.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from kvrag_integrations.chunk_kv import cache_key

if TYPE_CHECKING:  # annotations only
    from kvrag_integrations.engine.modeling.forward import PromptKV
    from kvrag_integrations.engine.prompting.segments import TokenizedPrompt
    from kvrag_integrations.engine.tools.calls import InvalidToolCall, ToolCall

__all__ = ["ChunkSources", "GenerationResult", "PrefillOutput", "PrefillResult"]

# What GenerationResult.stats leaves out: the answer itself, not numbers about it.
_NOT_STATS = frozenset(
    {
        "text",
        "token_ids",
        "first_token_logits",
        "first_token_logprobs",
        "tool_calls",
        "invalid_tool_calls",
    }
)


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
        finish_reason: ``"stop"`` (EOS or stop string), ``"length"``, or
            ``"cancelled"`` (the stream's consumer stopped reading).
        total_s: seconds for the whole request.
        token_ids: the generated ids.
        reused_prefix_tokens: the part of ``reused_tokens`` that is the prompt's
            cached leading text (system prompt, template header, instruction).
        reused_chunk_tokens: the part of ``reused_tokens`` that is retrieved chunks.
        lazily_encoded_chunks: chunks encoded on the request path (``encoded_chunks``
            plus ``taken_over_chunks``).
        fallback: ``"uncached"`` when chunks of the prompt were not cached and it
            was answered by plain prefill instead of reuse (``"evicted"``: some
            of them had been stored and were evicted since), else None.
        deferred_chunks: chunks left to background encoding by this request
            (queued by it, or already queued).
        reused_chunks: chunks whose stored cache was read.
        awaited_chunks: chunks being encoded elsewhere (the background worker,
            another request) that this request waited for and used.
        taken_over_chunks: chunks queued for background encoding (an earlier
            request deferred them) that this request took over and encoded
            itself; owed work, so their tokens count as reused.
        encoded_chunks: missing chunks encoded on the request path (a lazy fill;
            their tokens count as prefilled).
        evicted_chunks: missing chunks this engine had stored before (evicted
            from a bounded store, or lost).
        miss_policy: the ``on_miss`` policy that decided (``"auto"``, ...).
        miss_reason: why the request reused or answered by full prefill.
        first_token_logits: float32 logits of the first generated token.
        first_token_logprobs: ``{token id: log-probability}`` of the first generated
            token's likeliest tokens, where the engine reports those instead of
            logits (``VLLMEngine`` with ``logprobs=k``).
        tool_calls: the tool calls the model made (``tools.ToolCall``: name,
            arguments, id), parsed from its text by the request's tool family
            when it had ``tools``; ``text`` is then what the model wrote besides them.
        invalid_tool_calls: output in the family's call format that is no valid
            call (``tools.InvalidToolCall``: raw text, name, id, error), as
            LangChain's ``invalid_tool_calls``.
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
    reused_chunks: int = 0
    awaited_chunks: int = 0
    taken_over_chunks: int = 0
    encoded_chunks: int = 0
    evicted_chunks: int = 0
    miss_policy: str = ""
    miss_reason: str = ""
    first_token_logprobs: dict[int, float] | None = field(default=None, repr=False)
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)

    @property
    def stats(self) -> dict[str, Any]:
        """The numbers as a plain dict (for logs and framework metadata): every
        field but the text, the token ids and the logits."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_STATS}


@dataclass
class PrefillOutput:
    """What a strategy hands to the decoder.

    Attributes:
        kv: the prompt cache in sequence order, with each token's RoPE position.
        logits: float32 ``[vocab]`` logits of the last prompt token.
        chunk_mask: bool ``[tokens]``, True for tokens of cached chunks.
        reused_mask: bool ``[tokens]``, True where the stored K/V were used as is.
    """

    kv: PromptKV
    logits: torch.Tensor
    chunk_mask: torch.Tensor
    reused_mask: torch.Tensor

    def token_counts(self, lazy_mask: torch.Tensor | None = None) -> tuple[int, int, int]:
        """``(reused, recomputed, prefilled)`` prompt tokens; they sum to the prompt length.

        Args:
            lazy_mask: tokens of chunks encoded during this request (a lazy fill):
                computed here, so they count as prefilled, not reused.
        """
        reused = self.reused_mask
        if lazy_mask is not None:
            reused = reused & ~lazy_mask.to(reused.device)
        recomputed = self.chunk_mask & ~self.reused_mask
        prefilled = ~(reused | recomputed)
        return int(reused.sum()), int(recomputed.sum()), int(prefilled.sum())


@dataclass
class ChunkSources:
    """Where one request's chunk caches came from (chunks only: the cached leading
    text is not counted), and why: ``GenerationResult`` and the adapters' stats
    report these per request.

    Attributes:
        reused: read from the store.
        awaited: in flight elsewhere (the background worker, another request)
            when the request needed them; it waited and used them.
        taken_over: queued for background encoding (an earlier request deferred
            them); the request took them off the queue and encoded them itself.
        encoded: missing and not queued; encoded on the request path (their
            tokens count as prefilled: the lazy fill).
        evicted: of the missing ones, entries this engine had stored before
            (evicted from a bounded store, or lost).
        policy: the ``on_miss`` policy that decided (``"auto"``, ``"defer"``,
            ``"encode"``).
        reason: the decision in words (also logged at debug level).
    """

    reused: int = 0
    awaited: int = 0
    taken_over: int = 0
    encoded: int = 0
    evicted: int = 0
    policy: str = ""
    reason: str = ""


@dataclass
class PrefillResult:
    """A built prompt cache with the request's accounting (see ``KVRAGEngine.prefill``).

    ``fallback`` is ``"uncached"`` when chunks of the prompt had no stored cache
    and the engine answered by plain prefill instead (``strategy == "full"``),
    ``"evicted"`` when some of them had been stored by this engine and evicted
    since; ``deferred_chunks`` of them were queued for background encoding.
    ``sources`` says where the chunk caches came from and why. ``taken_keys``
    are keys taken over from the background queue: encoded here, but owed work
    an earlier request deferred, so their tokens count as reused like the
    worker's would (``lazy_keys``, chunks missing for this request alone, count
    as prefilled).
    """

    output: PrefillOutput
    prompt: TokenizedPrompt
    strategy: str
    lazy_keys: set[str]
    fingerprint: str
    prefill_s: float
    fallback: str | None = field(default=None)
    deferred_chunks: int = field(default=0)
    misses: dict[str, Any] = field(default_factory=dict, repr=False)  # not queued yet
    sources: ChunkSources = field(default_factory=ChunkSources)
    taken_keys: set[str] = field(default_factory=set, repr=False)

    @property
    def logits(self) -> torch.Tensor:
        return self.output.logits

    @property
    def lazily_encoded_chunks(self) -> int:
        """Chunks (not the cached leading text) encoded during this request: missing
        ones (``sources.encoded``) and ones taken over from the queue."""
        fp = self.fingerprint
        prefix = {cache_key(fp, p.entry_ids) for p in self.prompt.pieces if p.is_prefix}
        return len((self.lazy_keys | self.taken_keys) - prefix)

    @property
    def reused_prefix_tokens(self) -> int:
        """Tokens of the cached leading text reused from the prefix store (part of reused)."""
        head = self.prompt.pieces[0] if self.prompt.pieces else None
        if head is None or not head.is_prefix:
            return 0
        lazy = cache_key(self.fingerprint, head.entry_ids) in self.lazy_keys
        return 0 if lazy else head.ids.numel()

    def token_counts(self) -> tuple[int, int, int]:
        """``(reused, recomputed, prefilled)``; lazily encoded chunks count as prefilled."""
        lazy = torch.zeros(self.prompt.num_tokens, dtype=torch.bool)
        start = 0
        for piece in self.prompt.pieces:
            n = piece.ids.numel()
            if piece.is_cached and cache_key(self.fingerprint, piece.entry_ids) in self.lazy_keys:
                lazy[start : start + n] = True
            start += n
        return self.output.token_counts(lazy)

    def fill(self, result: GenerationResult) -> None:
        """Copy the prefill's accounting into a request's ``GenerationResult``."""
        reused, recomputed, prefilled = self.token_counts()
        result.strategy = self.strategy
        result.prompt_tokens = self.prompt.num_tokens
        result.reused_tokens = reused
        result.recomputed_tokens = recomputed
        result.prefilled_tokens = prefilled
        result.reused_prefix_tokens = self.reused_prefix_tokens
        result.reused_chunk_tokens = reused - self.reused_prefix_tokens
        result.first_token_logits = self.output.logits
        result.lazily_encoded_chunks = self.lazily_encoded_chunks
        result.fallback = self.fallback
        src = self.sources
        result.reused_chunks, result.awaited_chunks = src.reused, src.awaited
        result.taken_over_chunks, result.encoded_chunks = src.taken_over, src.encoded
        result.evicted_chunks = src.evicted
        result.miss_policy, result.miss_reason = src.policy, src.reason
