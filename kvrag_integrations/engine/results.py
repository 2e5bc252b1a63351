"""What the engine hands back: chunk references and prompt caches (streams: streaming.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvrag_integrations.chunk_kv import cache_key
from kvrag_integrations.engine.modeling.generate import GenerationResult
from kvrag_integrations.engine.prompting.segments import TokenizedPrompt
from kvrag_integrations.engine.strategies import PrefillOutput


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
