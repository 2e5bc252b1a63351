"""What a chunk's store entry holds, and how a prompt's chunk pieces point at it.

An entry is a chunk's ids followed by the engine's chunk suffix's
(``DEFAULT_CHUNK_SUFFIX``), encoded in the engine's chunk encoding context
(``CHUNK_CONTEXTS``: alone from position 0, or behind the model's BOS as an
attention sink whose rows are dropped). ``attach_suffix`` points each chunk
piece of a tokenized prompt at its entry and, where the text after the chunk
starts with the suffix, moves those tokens into the chunk piece so their K/V
are read instead of computed. ``Miss`` and ``Fetched`` record what
a lookup did not find and what ``ChunkCaches.fetch_or_encode`` read or encoded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.prompting.segments import (
    CHUNK_CONTEXTS,
    DEFAULT_CHUNK_CONTEXT,
    Piece,
    TokenizedPrompt,
)
from kvrag_integrations.store import KVStore

# Encoded after every chunk: the separator our prompts, LlamaIndex's and
# LangChain's documented ones put between retrieved chunks. Its K/V then come
# with the chunk's (TurboRAG stores each document with its own formatting)
# instead of being computed per request at every chunk boundary.
DEFAULT_CHUNK_SUFFIX = "\n\n"


@dataclass(frozen=True)
class ChunkRef:
    """Where a chunk's cache lives: its store key and token count."""

    key: str
    num_tokens: int


def context_ids(tokenizer: object, context: str) -> torch.Tensor:
    """The ids a chunk is encoded behind (empty for ``"alone"``).

    Raises:
        ValueError: an unknown context, or ``"sink"`` with a tokenizer without BOS.
    """
    if context not in CHUNK_CONTEXTS:
        raise ValueError(f"chunk_context must be one of {CHUNK_CONTEXTS}, got {context!r}")
    if context == "alone":
        return torch.zeros(0, dtype=torch.long)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        raise ValueError("chunk_context='sink' needs a tokenizer with a BOS token")
    return torch.tensor([int(bos)], dtype=torch.long)


def context_tag(context: str, ids: torch.Tensor) -> str:
    """The context's part of the storage fingerprint (empty for ``"alone"``)."""
    if not ids.numel():
        return ""
    return context + ":" + ",".join(str(int(i)) for i in ids)


def entry_ids(chunk_ids: torch.Tensor, suffix_ids: torch.Tensor) -> torch.Tensor:
    """What a chunk's entry encodes: its ids, then the chunk suffix's.

    The key is over these ids, so engines with different suffixes never share
    an entry unless it holds the same tokens. The chunk's own rows are what it
    would have alone: nothing after a token changes its K/V.
    """
    return torch.cat([chunk_ids, suffix_ids]) if suffix_ids.numel() else chunk_ids


def encoded_at(prompt: TokenizedPrompt, stored_at: int) -> TokenizedPrompt:
    """``prompt`` with its chunk pieces pointed at entries encoded from position
    ``stored_at`` (another encoding context's: its length); the same prompt when
    they already are."""
    if all(p.stored_at == stored_at for p in prompt.chunk_pieces):
        return prompt
    return TokenizedPrompt(
        [replace(p, stored_at=stored_at) if p.is_chunk else p for p in prompt.pieces]
    )


def attach_suffix(
    prompt: TokenizedPrompt, suffix_ids: torch.Tensor, suffix: str = "", stored_at: int = 0
) -> TokenizedPrompt:
    """Point each chunk piece at its entry (its ids, then ``suffix_ids``, encoded
    from position ``stored_at``); where the text after a chunk starts with
    ``suffix_ids``, those tokens move into the chunk piece, so their K/V are read
    with the chunk's instead of computed."""
    k = suffix_ids.numel()
    prompt = encoded_at(prompt, stored_at)
    if not k:
        return prompt
    pieces: list[Piece] = []
    for piece in prompt.pieces:
        prev = pieces[-1] if pieces else None
        if (
            prev is not None
            and prev.stored_ids is not None
            and prev.ids.numel() < prev.stored_ids.numel()
            and not piece.is_cached
            and piece.ids.numel() >= k
            and torch.equal(piece.ids if piece.ids.numel() == k else piece.ids[:k], suffix_ids)
        ):
            pieces[-1] = replace(prev, ids=prev.stored_ids)
            if piece.ids.numel() > k:
                rest = piece.text.removeprefix(suffix)
                pieces.append(replace(piece, ids=piece.ids[k:], text=rest))
            continue
        if piece.is_chunk and piece.stored_ids is None:
            piece = replace(piece, stored_ids=entry_ids(piece.ids, suffix_ids))
        pieces.append(piece)
    return TokenizedPrompt(pieces)


@dataclass(frozen=True)
class Miss:
    """A prompt chunk with no stored cache: its ids, the store it belongs in and
    the encoding context its entry is encoded in (``CHUNK_CONTEXTS``). It is
    also the job that encodes it (``ChunkCaches.encode_jobs``).

    ``evicted``: this engine stored the entry before (evicted or lost since).
    """

    ids: torch.Tensor
    store: KVStore
    is_prefix: bool = False
    evicted: bool = False
    context: str = DEFAULT_CHUNK_CONTEXT


@dataclass(frozen=True)
class Fetched:
    """What ``ChunkCaches.fetch_or_encode`` found and encoded."""

    keys: list[str]  # one per input ids, in order
    caches: dict[str, ChunkKV]  # every input's cache, by key (storage form)
    encoded: list[str]  # distinct keys encoded and stored by this call
    encode_s: float  # seconds in encoding forwards

    @property
    def reused(self) -> int:
        """Distinct caches read from the store."""
        return len(self.caches) - len(self.encoded)
