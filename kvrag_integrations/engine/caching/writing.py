"""Writing a model's chunk entries: encoding chunks alone (or behind an encoding
context) and storing them, each key encoded once (``ChunkCaches``' write half).

``ChunkCaches`` is made of this and its read half (``chunk_caches``: keys, lookups,
a prompt's caches on the device); this half encodes what ingestion, a request's
misses, the background worker and the reranker's document prefixes need, through
the engine's ledger so that no key is encoded twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from kvrag_integrations.chunk_kv import ChunkKV, cache_key
from kvrag_integrations.engine.caching.chunks import encode_chunk_batch
from kvrag_integrations.engine.caching.entries import ChunkRef, Fetched, Miss
from kvrag_integrations.engine.caching.loader import ChunkLoader
from kvrag_integrations.engine.caching.prompt_tokenizer import PromptTokenizer
from kvrag_integrations.engine.caching.residency import Residency
from kvrag_integrations.engine.modeling.model import LoadedModel
from kvrag_integrations.engine.scheduling.forward_lock import is_background_thread
from kvrag_integrations.errors import StoreWriteError
from kvrag_integrations.store import KVStore

logger = logging.getLogger(__name__)


class EntryWriting:
    """Encoding and storing chunk entries (a mixin of ``ChunkCaches``, whose state it uses)."""

    loaded: LoadedModel
    prompts: PromptTokenizer
    store: KVStore
    prefix_store: KVStore
    precision: str
    loader: ChunkLoader
    residency: Residency
    ledger: Any

    if TYPE_CHECKING:  # (``ChunkCaches``' own)

        @property
        def context(self) -> str: ...

        def fingerprint_for(self, context: str | None) -> str: ...

        def context_ids(self, context: str | None) -> torch.Tensor: ...

    def encode(
        self,
        chunks: Sequence[str],
        *,
        batch_size: int = 8,
        show_progress: bool = True,
        overwrite: bool = False,
        max_tokens: int | None = None,
        contexts: Sequence[str] = (),
    ) -> list[ChunkRef]:
        """Precompute and store each chunk's cache (intact stored ones are skipped).

        ``max_tokens``: the context window; a longer chunk raises
        ``ContextWindowExceededError`` before anything is encoded. ``contexts``:
        encoding contexts whose entries are made too (a strategy's own, beside the
        engine's). Other arguments as in ``KVRAGEngine.encode_chunks``.

        Returns:
            One ``ChunkRef`` per chunk, in order: its entry in the engine's context.
        """
        pairs = self.prompts.chunks_to_encode(chunks, max_tokens)
        lengths = [len(i) for i, _ in pairs]
        ids = [entry for _, entry in pairs]
        refs: list[ChunkRef] = []
        for context in dict.fromkeys([self.context, *contexts]):
            fingerprint = self.fingerprint_for(context)
            keys = [cache_key(fingerprint, i) for i in ids]
            todo = {}
            for key, tok in zip(keys, ids):
                # A verified read, not just existence: a truncated or tampered entry is
                # dropped by get() and encoded again here.
                if key not in todo and (overwrite or self.store.get(key, fingerprint) is None):
                    todo[key] = Miss(tok, self.store, context=context)
            self._encode_claimed(todo, batch_size, show_progress)
            refs = refs or [ChunkRef(k, n) for k, n in zip(keys, lengths)]
        return refs

    def _encode_claimed(self, todo: dict[str, Miss], batch_size: int, show_progress: bool) -> None:
        """Encode and store ``todo`` (ingestion), through the ledger when there is one."""
        encode = partial(self._encode_jobs, batch_size=batch_size, show_progress=show_progress)
        if self.ledger is None:
            encode(list(todo.values()))
            return
        self.ledger.encode_once(todo, encode)

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
        context: str | None = None,
    ) -> dict[str, ChunkKV]:
        """Encode ``ids`` alone (batched, longest first; chunk entries in encoding
        ``context``, None the engine's) and write them to ``store``: the one path
        of ingestion, a request's misses and the background worker.

        Chunk caches are converted to the storage precision first (the returned
        caches too, so a lazily encoded chunk answers as a stored one would);
        ``prefix_store`` entries stay at model precision.
        Ingestion raises ``StoreWriteError`` when a write fails. A lazy fill
        (``lazy``: chunks missing at query time) only logs it and returns the
        caches: the answer matters more than storing them.
        """
        fingerprint = self.fingerprint_for(context)
        return self._encode_and_store(
            ids, batch_size, show_progress, store, lazy, fingerprint, context=context
        )[0]

    def _encode_jobs(
        self,
        jobs: Sequence[Miss],
        *,
        batch_size: int = 8,
        show_progress: bool = False,
        lazy: bool = False,
        skip_stored: bool = False,
    ) -> dict[str, ChunkKV]:
        """Encode and store ``jobs``, grouped by store and encoding context;
        ``skip_stored``: not those stored meanwhile (the background worker's)."""
        done: dict[str, ChunkKV] = {}
        groups: dict[tuple[int, str], list[Miss]] = {}
        for job in jobs:
            groups.setdefault((id(job.store), job.context), []).append(job)
        for group in groups.values():
            store, context = group[0].store, group[0].context
            fingerprint = self.fingerprint_for(context)
            todo = [
                job.ids
                for job in group
                if not (skip_stored and store.contains(cache_key(fingerprint, job.ids)))
            ]
            if todo:
                done.update(
                    self.encode_and_store(todo, batch_size, show_progress, store, lazy, context)
                )
        return done

    def _encode_and_store(
        self,
        ids: list[torch.Tensor],
        batch_size: int,
        show_progress: bool,
        store: KVStore | None,
        lazy: bool,
        fingerprint: str | None = None,
        precision: str | None = None,
        context: str | None = None,
    ) -> tuple[dict[str, ChunkKV], float]:
        """``encode_and_store`` in key space ``fingerprint`` and storage ``precision``
        (chunk entries: in encoding ``context``, None the engine's); also returns the
        seconds spent in encoding forwards (lock wait included)."""
        store = store if store is not None else self.store
        fingerprint = fingerprint if fingerprint is not None else self.fingerprint_for(context)
        if precision is None:
            precision = "model" if store is self.prefix_store else self.precision
        # Only chunk entries have an encoding context; leading text (exact from
        # position 0) and other callers' key spaces are encoded alone.
        chunk_entries = store is self.store and fingerprint == self.fingerprint_for(context)
        behind = self.context_ids(context)
        behind = behind if chunk_entries and behind.numel() else None
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
                    kvs = encode_chunk_batch(self.loaded.model, batch, fingerprint, pad_id, behind)
                    forward_s = time.perf_counter() - begun
                seconds += time.perf_counter() - started
                if not is_background_thread():  # (background: fewer threads, pauses)
                    width = max(len(i) for i in batch) + (0 if behind is None else len(behind))
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

    def encode_missing(self, missing: dict[str, Miss]) -> dict[str, ChunkKV]:
        """Encode and store ``missing`` now (a lazy fill: a failed write only logs)."""
        return self._encode_jobs(list(missing.values()), lazy=True)

    def encode_jobs(self, jobs: list[Miss]) -> dict[str, ChunkKV]:
        """Encode ``jobs`` not stored yet (the background worker's unit, one forward);
        returns the caches encoded."""
        return self._encode_jobs(jobs, batch_size=len(jobs), lazy=True, skip_stored=True)
