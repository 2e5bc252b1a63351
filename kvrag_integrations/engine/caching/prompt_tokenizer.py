"""PromptTokenizer: a prompt's segments to pieces, each chunk pointed at its entry.

What an engine's prompts and its entries must agree on, in one object that
needs no model and no store: the tokenizer, the chunk suffix encoded after
every chunk, the chunk encoding context, the remembered chunk ids
(``ChunkTokens``) and the chunk texts seen (``ChunkIndex``, to find them in
flat prompts). ``KVRAGEngine`` (through ``ChunkCaches``) and the vLLM engine
each hold one, so both lay a prompt out token for token alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvrag_integrations.engine.caching.chunk_tokens import ChunkTokens
from kvrag_integrations.engine.caching.entries import (
    DEFAULT_CHUNK_CONTEXT,
    DEFAULT_CHUNK_SUFFIX,
    attach_suffix,
    context_ids,
    context_tag,
    entry_ids,
)
from kvrag_integrations.engine.prompting.segments import (
    Piece,
    Segment,
    TokenizedPrompt,
    validate_chunk_text,
)
from kvrag_integrations.engine.prompting.spans import ChunkIndex
from kvrag_integrations.engine.prompting.tokenize import tokenize_segments, tokenize_text
from kvrag_integrations.errors import check_fits

_NO_IDS = torch.zeros(0, dtype=torch.long)


class PromptTokenizer:
    """Tokenizes prompts as turbo and blend read them, and chunks as their entries hold them.

    Args:
        tokenizer: the model's tokenizer.
        suffix: text encoded after every chunk, in its entry (``""``: none).
        context: what chunks are encoded behind (``entries.CHUNK_CONTEXTS``).

    Examples:
        >>> tok = lambda text, add_special_tokens=False: {"input_ids": [len(text)]}
        >>> prompts = PromptTokenizer(tok, suffix="")
        >>> prompts.chunk("four")[1].tolist()
        [4]
    """

    def __init__(
        self,
        tokenizer: Any,
        suffix: str = DEFAULT_CHUNK_SUFFIX,
        context: str = DEFAULT_CHUNK_CONTEXT,
    ) -> None:
        if not isinstance(suffix, str):
            raise TypeError(f"chunk_suffix must be a string, got {type(suffix).__name__}")
        self.tokenizer = tokenizer
        self.suffix = suffix
        self.suffix_ids = tokenize_text(tokenizer, suffix) if suffix else _NO_IDS
        self.context = context
        self.context_ids = context_ids(tokenizer, context)
        self.tokens = ChunkTokens(tokenizer, self.suffix_ids)
        self.index = ChunkIndex()

    @property
    def context_tag(self) -> str:
        """The encoding context's part of the storage fingerprint (empty: alone)."""
        return context_tag(self.context, self.context_ids)

    def chunk(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chunk ids, entry ids)`` of chunk ``text``, remembered."""
        return self.tokens.get(text)

    def chunks_to_encode(
        self, texts: Sequence[str], max_tokens: int | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``chunk`` of each text an engine is asked to encode, checked first (a list
        of non-empty strings, none longer than ``max_tokens``: a bad one raises
        before anything is encoded) and noted in ``index``."""
        if isinstance(texts, str):
            raise TypeError("chunks must be a list of strings, not one string")
        pairs = [self.chunk(validate_chunk_text(text)) for text in texts]
        if max_tokens is not None:
            check_fits(max((len(ids) for ids, _ in pairs), default=0), max_tokens, "a chunk")
        for text in texts:
            self.index.add(text)
        return pairs

    def entry_ids(self, chunk_ids: torch.Tensor) -> torch.Tensor:
        """``entries.entry_ids`` with this chunk suffix."""
        return entry_ids(chunk_ids, self.suffix_ids)

    def piece_entry_ids(self, piece: Piece) -> torch.Tensor:
        """The ids of the entry a cached piece reads (a prompt not passed through
        ``tokenize`` too: its chunks read the same entries)."""
        if piece.stored_ids is None and piece.is_chunk:
            return self.entry_ids(piece.ids)
        return piece.entry_ids

    def tokenize(self, segments: Sequence[Segment]) -> TokenizedPrompt:
        """Tokenize segments (each alone) into the prompt as turbo and blend read it:
        each chunk piece points at its entry, and takes the chunk suffix after it
        where the text continues with it (``entries.attach_suffix``). A known
        chunk is not tokenized again (``tokens``)."""
        pieces = tokenize_segments(self.tokenizer, segments, self.tokens.get)
        return attach_suffix(pieces, self.suffix_ids, self.suffix, self.context_ids.numel())

    def remember(self, prompt: TokenizedPrompt) -> None:
        """Note the prompt's chunk texts in ``index`` (found in later flat prompts)."""
        for piece in prompt.chunk_pieces:
            self.index.add(piece.text)
