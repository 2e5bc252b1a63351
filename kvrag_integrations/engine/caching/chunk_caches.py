"""ChunkCaches: one model's chunk caches, encoded alone (or behind the encoding
context), stored and found for prompts.

What an entry holds and how a prompt points at it (``attach_suffix``, ``Miss``,
``Fetched``, ``DEFAULT_CHUNK_SUFFIX``) is in ``engine.caching.entries``, re-exported here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from kvrag_integrations.chunk_kv import (
    DEFAULT_PRECISION,
    ChunkKV,
    cache_key,
    check_precision,
    dtype_name,
    storage_fingerprint,
)
from kvrag_integrations.engine.caching.entries import (
    DEFAULT_CHUNK_CONTEXT,
    DEFAULT_CHUNK_SUFFIX,
    Fetched,
    Miss,
    attach_suffix,
    context_ids,
    context_tag,
    encoded_at,
)
from kvrag_integrations.engine.caching.loader import ChunkLoader
from kvrag_integrations.engine.caching.prompt_tokenizer import PromptTokenizer
from kvrag_integrations.engine.caching.residency import Residency
from kvrag_integrations.engine.caching.writing import EntryWriting
from kvrag_integrations.engine.modeling.model import LoadedModel
from kvrag_integrations.engine.prompting.segments import (
    Piece,
    TokenizedPrompt,
)
from kvrag_integrations.store import KVStore, MemoryKVStore

logger = logging.getLogger(__name__)


class ChunkCaches(EntryWriting):
    """Encodes chunks alone, writes their caches to a store and finds them for prompts.

    ``store`` holds chunk caches (shared, possibly on disk or in Redis);
    ``prefix_store`` holds caches of prompts' leading text (system prompt,
    template header, instruction): a few entries per template, kept in process.
    ``index`` remembers chunk texts seen here, to find them inside flat prompts.

    Chunk caches are stored in ``precision`` (see ``KVRAGEngine``): converted
    right after encoding, before any ``store.put``, and keyed and checked by
    ``fingerprint`` (the model's plus the precision and the encoding context),
    so engines storing differently never read each other's entries. Entries are
    encoded in the engine's ``context`` unless a call names another
    (``entries.CHUNK_CONTEXTS``: a strategy that reads entries of its own,
    ``ChunkReuse.chunk_context``); each context's entries are other keys, kept
    apart in one store. Leading-text caches in
    ``prefix_store`` stay at model precision. ``on_device`` moves caches to the
    model's device in their storage form; the strategies cast them while laying
    them out.

    Examples:
        >>> from kvrag_integrations import KVRAGEngine
        >>> engine = KVRAGEngine.from_pretrained()  # doctest: +SKIP
        >>> ref, = engine.caches.encode(["Paris is the capital of France."])  # doctest: +SKIP
        >>> engine.caches.store.contains(ref.key)  # doctest: +SKIP
        True
    """

    def __init__(
        self,
        loaded: LoadedModel,
        store: KVStore,
        precision: str = DEFAULT_PRECISION,
        suffix: str = DEFAULT_CHUNK_SUFFIX,
        context: str = DEFAULT_CHUNK_CONTEXT,
    ) -> None:
        self.loaded = loaded
        self.precision = check_precision(precision)
        # Suffix, context, remembered chunk ids and the chunk index: what prompts
        # and entries agree on (shared in form with the vLLM engine's).
        self.prompts = PromptTokenizer(loaded.tokenizer, suffix, context)
        self.store = store
        self.prefix_store = MemoryKVStore(max_bytes=256 * 2**20)
        self.loader = ChunkLoader()
        self.residency = Residency()
        self.ledger: Any = None  # the engine's BackgroundEncoder: no key encoded twice

    @property
    def context(self) -> str:
        """The encoding context of this engine's entries (``entries.CHUNK_CONTEXTS``)."""
        return self.prompts.context

    @property
    def fingerprint(self) -> str:
        """The storage fingerprint: the model's plus the storage precision and the
        chunk encoding context."""
        return self.fingerprint_for(None)

    def fingerprint_for(self, context: str | None) -> str:
        """The storage fingerprint of entries encoded in ``context`` (None: the engine's)."""
        ctx = self.context if context is None else context
        tag = context_tag(ctx, self.context_ids(ctx))
        return storage_fingerprint(self.loaded.fingerprint, self.precision, tag)

    def context_ids(self, context: str | None) -> torch.Tensor:
        """The ids chunks are encoded behind in ``context`` (None: the engine's)."""
        if context is None or context == self.context:
            return self.prompts.context_ids
        return context_ids(self.loaded.tokenizer, context)

    def in_context(self, prompt: TokenizedPrompt, context: str | None) -> TokenizedPrompt:
        """``prompt`` with its chunks pointed at the entries of ``context``."""
        if context is None or context == self.context:
            return prompt
        return encoded_at(prompt, self.context_ids(context).numel())

    def key(self, text: str) -> str:
        """The store key the chunk ``text`` has under this model."""
        return self.prompts.tokens.key(self.fingerprint, text, self.prompts.tokens.get(text)[1])

    def entry_ids(self, chunk_ids: torch.Tensor) -> torch.Tensor:
        """``entries.entry_ids`` with this engine's chunk suffix."""
        return self.prompts.entry_ids(chunk_ids)

    def piece_key(self, piece: Piece, context: str | None = None) -> str:
        """The store key of the entry ``piece`` reads, in ``context`` (None: the engine's)."""
        ids = self.prompts.piece_entry_ids(piece)
        fingerprint = self.fingerprint_for(context)
        if piece.is_chunk:  # remembered with the chunk's ids
            return self.prompts.tokens.key(fingerprint, piece.text, ids)
        return cache_key(fingerprint, ids)

    def prefetch(self, texts: Sequence[str]) -> int:
        """Start reading the stored caches of chunk ``texts`` (see ``ChunkLoader``).

        Returns how many reads started: none for a store that answers from
        memory, for texts already staged, or for texts that are not valid chunks.
        """
        if not self.store.parallel_reads:
            return 0
        keys = []
        for text in texts:
            try:
                keys.append(self.key(text))
            except (TypeError, ValueError):  # not a chunk we could have stored
                continue
        return self.loader.prefetch(self.store, self.fingerprint, keys)

    def lookup(
        self, prompt: TokenizedPrompt, context: str | None = None
    ) -> tuple[dict[str, ChunkKV], dict[str, Miss]]:
        """The prompt's stored caches by key, and its misses (nothing is encoded),
        in encoding ``context`` (None: the engine's).

        A cached leading text (``piece.is_prefix``) lives in ``prefix_store``.
        Chunk texts are remembered in ``index`` whether found or not.
        """
        context = self.context if context is None else context
        fingerprint = self.fingerprint_for(context)
        found: dict[str, ChunkKV] = {}
        missing: dict[str, Miss] = {}
        pieces = [(self.piece_key(p, context), p) for p in prompt.cached_pieces]
        stored = self.loader.get_many(
            self.store, fingerprint, [k for k, p in pieces if not p.is_prefix]
        )
        for key, piece in pieces:
            if key in found or key in missing:
                continue
            store = self.prefix_store if piece.is_prefix else self.store
            kv = store.get(key, fingerprint) if piece.is_prefix else stored[key]
            if not piece.is_prefix:
                self.prompts.index.add(piece.text)
            if kv is not None and not (self.fits_layout(kv) and self.fits_precision(kv, store)):
                logger.warning("cache entry %s has the wrong shape or precision", key[:16])
                store.delete(key)
                kv = None
            if kv is None:
                evicted = not piece.is_prefix and self.residency.was_stored(key)
                ids = self.prompts.piece_entry_ids(piece)
                missing[key] = Miss(ids, store, piece.is_prefix, evicted, context)
            else:
                found[key] = kv
        return found, missing

    def fits_layout(self, kv: ChunkKV) -> bool:
        """Whether an entry's K/V have this model's shape (layers, KV heads, head size):
        checked before any stored tensor reaches the model, whatever the store says."""
        layout = self.loaded.layout
        layers, heads, _, head_dim = kv.keys.shape
        return (layers, heads, head_dim) == (layout.num_layers, layout.kv_heads, layout.head_dim)

    def fits_precision(self, kv: ChunkKV, store: KVStore) -> bool:
        """Whether an entry is in the form this engine stores (the fingerprint says
        so already; this catches an entry forged under it)."""
        if store is self.prefix_store or self.precision == "model":
            expected = {dtype_name(self.loaded.dtype)}
        elif self.precision == "float16":
            expected = {"float16", "bfloat16"}  # bfloat16: an entry beyond float16's range
        else:
            expected = {self.precision}
        return kv.precision in expected

    def on_device(
        self, prompt: TokenizedPrompt, found: dict[str, ChunkKV], context: str | None = None
    ) -> list[ChunkKV]:
        """The prompt's chunk caches in chunk order, on the model's device, in their
        storage form (the strategies' assembly casts or dequantizes them)."""
        device = self.loaded.device
        keys = [self.piece_key(p, context) for p in prompt.cached_pieces]
        # Host entries reach a CUDA device asynchronously: from pinned memory (the
        # tiered store's host tier pins them) the copies overlap; the device's
        # stream orders them before assembly reads them.
        cuda = device.type == "cuda"
        return [found[k].to(device, non_blocking=cuda) for k in keys]

    def for_prompt(
        self, prompt: TokenizedPrompt, context: str | None = None
    ) -> tuple[list[ChunkKV], set[str]]:
        """Stored caches of the prompt's chunks; missing ones are encoded and stored.

        Returns the caches in chunk order, on the model's device (storage form),
        and the keys that were encoded here (lazily).
        """
        found, missing = self.lookup(prompt, context)
        found.update(self.encode_missing(missing))
        return self.on_device(prompt, found, context), set(missing)


__all__ = [
    "DEFAULT_CHUNK_CONTEXT",
    "DEFAULT_CHUNK_SUFFIX",
    "ChunkCaches",
    "Fetched",
    "Miss",
    "attach_suffix",
]
