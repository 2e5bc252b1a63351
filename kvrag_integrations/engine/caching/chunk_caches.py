"""ChunkCaches: one model's chunk caches, encoded alone (or behind the encoding
context), stored and found for prompts.

What an entry holds and how a prompt points at it (``attach_suffix``, ``Miss``,
``Fetched``, ``DEFAULT_CHUNK_SUFFIX``) is in ``engine.caching.entries``, re-exported here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from kvrag_integrations.chunk_kv import (
    ChunkKV,
    cache_key,
    check_precision,
    dtype_name,
    storage_fingerprint,
)
from kvrag_integrations.engine.caching.chunks import encode_chunk_batch
from kvrag_integrations.engine.caching.entries import (
    DEFAULT_CHUNK_CONTEXT,
    DEFAULT_CHUNK_SUFFIX,
    ChunkRef,
    Fetched,
    Miss,
    attach_suffix,
)
from kvrag_integrations.engine.caching.loader import ChunkLoader
from kvrag_integrations.engine.caching.prompt_tokenizer import PromptTokenizer
from kvrag_integrations.engine.caching.residency import Residency
from kvrag_integrations.engine.modeling.model import LoadedModel
from kvrag_integrations.engine.prompting.segments import (
    Piece,
    TokenizedPrompt,
)
from kvrag_integrations.engine.scheduling.forward_lock import is_background_thread
from kvrag_integrations.errors import StoreWriteError
from kvrag_integrations.store import KVStore, MemoryKVStore

logger = logging.getLogger(__name__)


class ChunkCaches:
    """Encodes chunks alone, writes their caches to a store and finds them for prompts.

    ``store`` holds chunk caches (shared, possibly on disk or in Redis);
    ``prefix_store`` holds caches of prompts' leading text (system prompt,
    template header, instruction): a few entries per template, kept in process.
    ``index`` remembers chunk texts seen here, to find them inside flat prompts.

    Chunk caches are stored in ``precision`` (see ``KVRAGEngine``): converted
    right after encoding, before any ``store.put``, and keyed and checked by
    ``fingerprint`` (the model's plus the precision), so engines storing
    differently never read each other's entries. Leading-text caches in
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
        precision: str = "float16",
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
    def fingerprint(self) -> str:
        """The storage fingerprint: the model's plus the storage precision and the
        chunk encoding context."""
        return storage_fingerprint(
            self.loaded.fingerprint, self.precision, self.prompts.context_tag
        )

    def key(self, text: str) -> str:
        """The store key the chunk ``text`` has under this model."""
        return self.prompts.tokens.key(self.fingerprint, text, self.prompts.tokens.get(text)[1])

    def entry_ids(self, chunk_ids: torch.Tensor) -> torch.Tensor:
        """``entries.entry_ids`` with this engine's chunk suffix."""
        return self.prompts.entry_ids(chunk_ids)

    def piece_key(self, piece: Piece) -> str:
        ids = self.prompts.piece_entry_ids(piece)
        if piece.is_chunk:  # remembered with the chunk's ids
            return self.prompts.tokens.key(self.fingerprint, piece.text, ids)
        return cache_key(self.fingerprint, ids)

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

    def encode(
        self,
        chunks: Sequence[str],
        *,
        batch_size: int = 8,
        show_progress: bool = True,
        overwrite: bool = False,
        max_tokens: int | None = None,
    ) -> list[ChunkRef]:
        """Precompute and store each chunk's cache (intact stored ones are skipped).

        ``max_tokens``: the context window; a longer chunk raises
        ``ContextWindowExceededError`` before anything is encoded. Other
        arguments as in ``KVRAGEngine.encode_chunks``.
        """
        pairs = self.prompts.chunks_to_encode(chunks, max_tokens)
        lengths = [len(i) for i, _ in pairs]
        ids = [entry for _, entry in pairs]
        keys = [cache_key(self.fingerprint, i) for i in ids]
        todo = {}
        for key, tok in zip(keys, ids):
            # A verified read, not just existence: a truncated or tampered entry is
            # dropped by get() and encoded again here.
            if key not in todo and (overwrite or self.store.get(key, self.fingerprint) is None):
                todo[key] = tok
        self._encode_claimed(todo, batch_size, show_progress)
        return [ChunkRef(k, n) for k, n in zip(keys, lengths)]

    def _encode_claimed(
        self, todo: dict[str, torch.Tensor], batch_size: int, show_progress: bool
    ) -> None:
        """Encode and store ``todo`` (ingestion), through the ledger when there is one."""
        if self.ledger is None:
            self.encode_and_store(list(todo.values()), batch_size, show_progress)
            return
        jobs = {k: (ids, self.store) for k, ids in todo.items()}
        self.ledger.encode_once(
            jobs, lambda ids: self.encode_and_store(ids, batch_size, show_progress)
        )

    def fetch_or_encode(
        self,
        ids: Sequence[torch.Tensor],
        *,
        store: KVStore | None = None,
        fingerprint: str | None = None,
        precision: str | None = None,
        batch_size: int = 8,
    ) -> Fetched:
        """Each of ``ids``' cache: read from ``store``, or encoded alone and stored.

        The one fetch-or-encode path for callers outside prompts (the reranker's
        document prefixes). Reads go through ``loader`` (concurrent for disk and
        Redis); the distinct missing ids are encoded as ``encode_and_store`` does
        and a failed write raises ``StoreWriteError``.

        Args:
            ids: token ids, one tensor per cache (duplicates are read or encoded once).
            store: where the caches live (default: ``store``).
            fingerprint: the key space (default: ``fingerprint``, this engine's
                chunk caches); a caller with its own prompts uses its own.
            precision: the storage precision of encoded caches (default: as
                ``encode_and_store``); ``"model"`` keeps the compute dtype.
            batch_size: ids encoded per forward.
        """
        store = store if store is not None else self.store
        fingerprint = fingerprint if fingerprint is not None else self.fingerprint
        keys = [cache_key(fingerprint, i) for i in ids]
        read = self.loader.get_many(store, fingerprint, keys)
        found = {k: kv for k, kv in read.items() if kv is not None}
        missing = {k: i for k, i in zip(keys, ids) if k not in found}
        done, seconds = self._encode_and_store(
            list(missing.values()), batch_size, False, store, False, fingerprint, precision
        )
        found.update(done)
        return Fetched(keys, found, list(missing), seconds)

    def encode_and_store(
        self,
        ids: list[torch.Tensor],
        batch_size: int = 8,
        show_progress: bool = False,
        store: KVStore | None = None,
        lazy: bool = False,
    ) -> dict[str, ChunkKV]:
        """Encode ``ids`` alone (batched, longest first) and write them to ``store``.

        Chunk caches are converted to the storage precision first (the returned
        caches too, so a lazily encoded chunk answers as a stored one would);
        ``prefix_store`` entries stay at model precision.
        Ingestion raises ``StoreWriteError`` when a write fails. A lazy fill
        (``lazy``: chunks missing at query time) only logs it and returns the
        caches: the answer matters more than storing them.
        """
        return self._encode_and_store(ids, batch_size, show_progress, store, lazy)[0]

    def _encode_and_store(
        self,
        ids: list[torch.Tensor],
        batch_size: int,
        show_progress: bool,
        store: KVStore | None,
        lazy: bool,
        fingerprint: str | None = None,
        precision: str | None = None,
    ) -> tuple[dict[str, ChunkKV], float]:
        """``encode_and_store`` in key space ``fingerprint`` and storage ``precision``;
        also returns the seconds spent in encoding forwards (lock wait included)."""
        store = store if store is not None else self.store
        fingerprint = fingerprint if fingerprint is not None else self.fingerprint
        if precision is None:
            precision = "model" if store is self.prefix_store else self.precision
        # Only this engine's chunk entries have its encoding context; leading text
        # (exact from position 0) and other callers' key spaces are encoded alone.
        chunk_entries = store is self.store and fingerprint == self.fingerprint
        context = self.prompts.context_ids
        context = context if chunk_entries and context.numel() else None
        done: dict[str, ChunkKV] = {}
        seconds = 0.0
        writable = True
        order = sorted(ids, key=len, reverse=True)
        bar = tqdm(
            total=len(order), desc="Encoding chunk caches", unit="chunk", disable=not show_progress
        )
        pad_id = int(self.loaded.tokenizer.pad_token_id)
        step = max(1, batch_size)
        with bar:
            for start in range(0, len(order), step):
                batch = order[start : start + step]
                started = time.perf_counter()
                with self.loaded.lock:  # one forward at a time on these weights
                    begun = time.perf_counter()
                    kvs = encode_chunk_batch(self.loaded.model, batch, fingerprint, pad_id, context)
                    forward_s = time.perf_counter() - begun
                seconds += time.perf_counter() - started
                if not is_background_thread():  # (background: fewer threads, pauses)
                    width = max(len(i) for i in batch) + (0 if context is None else len(context))
                    self.loaded.costs.record_encode(len(batch), width, forward_s)
                for kv in kvs:
                    kv = kv.stored_as(precision)
                    done[kv.key] = kv
                    try:
                        if writable:  # after one failure, don't wait on every other put
                            store.put(kv)
                            if store is self.store:
                                self.residency.stored(kv.key)
                    except StoreWriteError as exc:
                        if not lazy:
                            raise
                        writable = False
                        logger.warning("chunk caches not stored (%s); answering uncached", exc)
                bar.update(len(batch))
        return done, seconds

    def lookup(self, prompt: TokenizedPrompt) -> tuple[dict[str, ChunkKV], dict[str, Miss]]:
        """The prompt's stored caches by key, and its misses (nothing is encoded).

        A cached leading text (``piece.is_prefix``) lives in ``prefix_store``.
        Chunk texts are remembered in ``index`` whether found or not.
        """
        found: dict[str, ChunkKV] = {}
        missing: dict[str, Miss] = {}
        pieces = [(self.piece_key(p), p) for p in prompt.cached_pieces]
        stored = self.loader.get_many(
            self.store, self.fingerprint, [k for k, p in pieces if not p.is_prefix]
        )
        for key, piece in pieces:
            if key in found or key in missing:
                continue
            store = self.prefix_store if piece.is_prefix else self.store
            kv = store.get(key, self.fingerprint) if piece.is_prefix else stored[key]
            if not piece.is_prefix:
                self.prompts.index.add(piece.text)
            if kv is not None and not (self.fits_layout(kv) and self.fits_precision(kv, store)):
                logger.warning("cache entry %s has the wrong shape or precision", key[:16])
                store.delete(key)
                kv = None
            if kv is None:
                evicted = not piece.is_prefix and self.residency.was_stored(key)
                missing[key] = Miss(
                    self.prompts.piece_entry_ids(piece), store, piece.is_prefix, evicted
                )
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

    def encode_missing(self, missing: dict[str, Miss]) -> dict[str, ChunkKV]:
        """Encode and store ``missing`` now (a lazy fill: a failed write only logs)."""
        done: dict[str, ChunkKV] = {}
        for store in {id(m.store): m.store for m in missing.values()}.values():
            todo = [m.ids for m in missing.values() if m.store is store]
            done.update(self.encode_and_store(todo, 8, False, store, lazy=True))
        return done

    def encode_jobs(self, jobs: list[tuple[torch.Tensor, KVStore]]) -> dict[str, ChunkKV]:
        """Encode ``[(ids, store), ...]`` not stored yet (the background worker's unit);
        returns the caches encoded."""
        done: dict[str, ChunkKV] = {}
        for store in {id(s): s for _, s in jobs}.values():
            todo = [
                ids
                for ids, s in jobs
                if s is store and not store.contains(cache_key(self.fingerprint, ids))
            ]
            if todo:
                done.update(self.encode_and_store(todo, len(todo), False, store, lazy=True))
        return done

    def on_device(self, prompt: TokenizedPrompt, found: dict[str, ChunkKV]) -> list[ChunkKV]:
        """The prompt's chunk caches in chunk order, on the model's device, in their
        storage form (the strategies' assembly casts or dequantizes them)."""
        device = self.loaded.device
        keys = [self.piece_key(p) for p in prompt.cached_pieces]
        # Host entries reach a CUDA device asynchronously: from pinned memory (the
        # tiered store's host tier pins them) the copies overlap; the device's
        # stream orders them before assembly reads them.
        cuda = device.type == "cuda"
        return [found[k].to(device, non_blocking=cuda) for k in keys]

    def for_prompt(self, prompt: TokenizedPrompt) -> tuple[list[ChunkKV], set[str]]:
        """Stored caches of the prompt's chunks; missing ones are encoded and stored.

        Returns the caches in chunk order, on the model's device (storage form),
        and the keys that were encoded here (lazily).
        """
        found, missing = self.lookup(prompt)
        found.update(self.encode_missing(missing))
        return self.on_device(prompt, found), set(missing)


__all__ = [
    "DEFAULT_CHUNK_CONTEXT",
    "DEFAULT_CHUNK_SUFFIX",
    "ChunkCaches",
    "Fetched",
    "Miss",
    "attach_suffix",
]
