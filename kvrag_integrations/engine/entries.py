"""What a chunk's store entry holds, and how a prompt's chunk pieces point at it.

An entry is a chunk's ids followed by the engine's chunk suffix's
(``DEFAULT_CHUNK_SUFFIX``), encoded after the chunk alone. ``attach_suffix``
points each chunk piece of a tokenized prompt at its entry and, where the text
after the chunk starts with the suffix, moves those tokens into the chunk piece
so their K/V are read instead of computed. ``Miss`` and ``Fetched`` record what
a lookup did not find and what ``ChunkCaches.fetch_or_encode`` read or encoded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.segments import Piece, TokenizedPrompt
from kvrag_integrations.store import KVStore

# Encoded after every chunk: the separator our prompts, LlamaIndex's and
# LangChain's documented ones put between retrieved chunks. Its K/V then come
# with the chunk's (TurboRAG stores each document with its own formatting)
# instead of being computed per request at every chunk boundary.
DEFAULT_CHUNK_SUFFIX = "\n\n"


def entry_ids(chunk_ids: torch.Tensor, suffix_ids: torch.Tensor) -> torch.Tensor:
    """What a chunk's entry encodes: its ids, then the chunk suffix's.

    The key is over these ids, so engines with different suffixes never share
    an entry unless it holds the same tokens. The chunk's own rows are what it
    would have alone: nothing after a token changes its K/V.
    """
    return torch.cat([chunk_ids, suffix_ids]) if suffix_ids.numel() else chunk_ids


def attach_suffix(
    prompt: TokenizedPrompt, suffix_ids: torch.Tensor, suffix: str = ""
) -> TokenizedPrompt:
    """Point each chunk piece at its entry (its ids, then ``suffix_ids``); where
    the text after a chunk starts with ``suffix_ids``, those tokens move into the
    chunk piece, so their K/V are read with the chunk's instead of computed."""
    k = suffix_ids.numel()
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
            and torch.equal(piece.ids[:k], suffix_ids)
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
    """A prompt chunk with no stored cache: its ids and the store it belongs in."""

    ids: torch.Tensor
    store: KVStore
    is_prefix: bool = False


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
