"""Chunk texts' token ids, remembered: a request over known chunks tokenizes only
the text around them.

Re-tokenizing every retrieved chunk on every request cost 65 ms of a 16.5k-token
prompt (64 chunks) on an 8B model's tokenizer. A chunk's ids depend only on its
text and the tokenizer (``tokenize.tokenize_text``: the text alone, literal, no
special tokens added), and its entry's ids on those and the engine's chunk
suffix, so both are kept per text in a bounded LRU owned by the engine's
``ChunkCaches``: the same tokenizer, the same rule, the same ids (the cache key
derives from them, so they must be identical; ``tests/unit/test_chunk_tokens.py``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch

from kvrag_integrations.chunk_kv import cache_key
from kvrag_integrations.engine.caching.entries import entry_ids
from kvrag_integrations.engine.prompting.segments import validate_chunk_text
from kvrag_integrations.engine.prompting.tokenize import tokenize_text

# About 4M token ids (chunk and entry ids together, int64: 64 MiB at most):
# 16k chunks of 256 tokens, more than any memory tier of chunk caches holds.
DEFAULT_MAX_TOKENS = 1 << 22


class ChunkTokens:
    """``text -> (chunk ids, entry ids)`` for chunk texts, LRU-bounded in token ids,
    with the entry ids' store key per fingerprint.

    Thread-safe; a text is tokenized outside the lock (two threads missing the
    same text both tokenize it, with the same result). The tensors returned are
    shared between requests: callers never write to them.

    Args:
        tokenizer: the engine's tokenizer.
        suffix_ids: the engine's chunk suffix ids (``entries.entry_ids``).
        max_tokens: the bound on ids held (chunk and entry ids counted).

    Examples:
        >>> tok = lambda text, add_special_tokens=False: {"input_ids": [len(text)]}
        >>> tokens = ChunkTokens(tok, torch.tensor([9]))
        >>> ids, entry = tokens.get("four")
        >>> ids.tolist(), entry.tolist(), tokens.misses
        ([4], [4, 9], 1)
        >>> tokens.get("four")[0] is ids, tokens.hits
        (True, 1)
    """

    def __init__(
        self, tokenizer: Any, suffix_ids: torch.Tensor, max_tokens: int = DEFAULT_MAX_TOKENS
    ) -> None:
        self.tokenizer = tokenizer
        self.suffix_ids = suffix_ids
        self.max_tokens = max_tokens
        self.hits = 0
        self.misses = 0
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._held)

    def ids(self, text: str) -> torch.Tensor:
        """The chunk's own token ids (``tokenize_text(tokenizer, text)``)."""
        return self.get(text)[0]

    def get(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chunk ids, entry ids)`` of chunk ``text`` (checked: ``InvalidChunkError``)."""
        with self._lock:
            held = self._held.get(text)
            if held is not None:
                self._held.move_to_end(text)
                self.hits += 1
                return held.ids, held.entry
        ids = tokenize_text(self.tokenizer, validate_chunk_text(text))
        new = _Held(ids, entry_ids(ids, self.suffix_ids))
        with self._lock:
            self.misses += 1
            held = self._held.get(text)
            if held is not None or new.size > self.max_tokens:
                return (held.ids, held.entry) if held is not None else (new.ids, new.entry)
            self._held[text] = new
            self._tokens += new.size
            while self._tokens > self.max_tokens:
                self._tokens -= self._held.popitem(last=False)[1].size
        return new.ids, new.entry

    def key(self, fingerprint: str, text: str, ids: torch.Tensor) -> str:
        """``cache_key(fingerprint, ids)``: remembered when ``ids`` are the entry ids
        held for ``text`` (the very tensor ``get`` gave), as a request reads each
        chunk's key more than once (its lookup, then its caches in prompt order)."""
        with self._lock:
            held = self._held.get(text)
        if held is None or held.entry is not ids:
            return cache_key(fingerprint, ids)
        key = held.keys.get(fingerprint)
        if key is None:
            key = held.keys[fingerprint] = cache_key(fingerprint, ids)
        return key


class _Held:
    """One chunk text's ids, entry ids and their store key per fingerprint."""

    __slots__ = ("entry", "ids", "keys", "size")

    def __init__(self, ids: torch.Tensor, entry: torch.Tensor) -> None:
        self.ids = ids
        self.entry = entry
        self.keys: dict[str, str] = {}
        self.size = ids.numel() + (0 if entry is ids else entry.numel())
