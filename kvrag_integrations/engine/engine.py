"""KVRAGEngine: the framework-free entry point (load, encode, generate, stream)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch

from kvrag_integrations.chunk_kv import DEFAULT_PRECISION, check_precision
from kvrag_integrations.engine import registry
from kvrag_integrations.engine.blend_settings import Calibrations, median_chunk_tokens
from kvrag_integrations.engine.caching.chunk_caches import ChunkCaches
from kvrag_integrations.engine.caching.entries import (
    DEFAULT_CHUNK_CONTEXT,
    DEFAULT_CHUNK_SUFFIX,
    ChunkRef,
)
from kvrag_integrations.engine.doc_scoring import InProcessScoring
from kvrag_integrations.engine.frontend import EngineFrontend
from kvrag_integrations.engine.in_process import answer, plan_prefill
from kvrag_integrations.engine.modeling.checkpoint_identity import model_identity
from kvrag_integrations.engine.modeling.model import LoadedModel
from kvrag_integrations.engine.modeling.sampling import SamplingParams
from kvrag_integrations.engine.prompting.segments import Chunk, Segment, Text, TokenizedPrompt
from kvrag_integrations.engine.request import ON_MISS, Request, RequestOptions, check_on_miss
from kvrag_integrations.engine.results import GenerationResult, PrefillResult
from kvrag_integrations.engine.scheduling.background import BackgroundEncoder
from kvrag_integrations.engine.scheduling.miss_policy import DEFAULT_ON_MISS
from kvrag_integrations.engine.strategies import DEFAULT_STRATEGY, Strategy
from kvrag_integrations.engine.streaming import AsyncGenerationStream, GenerationStream, Job
from kvrag_integrations.store import KVStore, MemoryKVStore
from kvrag_integrations.store.budget import memory_budget
from kvrag_integrations.store.records import records_for

logger = logging.getLogger(__name__)

__all__ = [
    "ON_MISS",
    "AsyncGenerationStream",
    "Chunk",
    "ChunkRef",
    "GenerationStream",
    "KVRAGEngine",
    "PrefillResult",
    "Text",
]


class KVRAGEngine(registry.EngineLoading, InProcessScoring, EngineFrontend):
    """Generates answers over retrieved chunks, reusing their precomputed KV caches.

    ``from_pretrained`` loads a model and ``shared`` finds the process's shared
    engine (``registry.EngineLoading``); prompts, ``generate``, ``stream`` and
    ``astream`` are the ones every engine shares (``frontend.EngineFrontend``).

    Examples:
        >>> engine = KVRAGEngine.from_pretrained()  # doctest: +SKIP
        >>> engine.encode_chunks(["Paris is the capital of France."])  # doctest: +SKIP
        >>> engine.generate(question="What is the capital of France?",
        ...                 chunks=["Paris is the capital of France."]).text  # doctest: +SKIP
        'Paris'
    """

    def __init__(
        self,
        loaded: LoadedModel,
        store: KVStore | None = None,
        *,
        cache_prefix: bool = True,
        on_miss: str = DEFAULT_ON_MISS,
        max_pending: int = 256,
        cache_precision: str = DEFAULT_PRECISION,
        chunk_suffix: str = DEFAULT_CHUNK_SUFFIX,
        chunk_context: str = DEFAULT_CHUNK_CONTEXT,
    ) -> None:
        """Wrap a loaded model.

        Args:
            loaded: the model (``load_model``).
            store: where chunk caches live (default: an in-memory LRU bounded at a
                share of the memory free on the model's device when the engine is
                made: ``store.budget.memory_budget``).
            cache_prefix: cache the prompt's leading text like a chunk.
            on_miss: what a request does about chunks of its prompt with no cache
                (``engine.scheduling.miss_policy``): ``"auto"`` (default) encodes them and
                reuses them when that is estimated (``loaded.costs``, measured) to
                cost no more than a full prefill, else defers; ``"defer"``
                answers by plain prefill and encodes them in the background for
                the next request; ``"encode"`` encodes them, then reuses them.
                Chunks queued for the background or in flight are taken over or
                waited for: nothing is encoded twice.
            max_pending: the most chunks queued for background encoding (more
                are dropped: a later request defers them again).
            cache_precision: how chunk caches are stored: ``"float16"`` (default;
                an entry with a value beyond float16's range is stored as
                bfloat16), ``"bfloat16"``, ``"int8"`` (KIVI-style: keys quantized
                per channel, values per token, float16 scales; about a quarter of
                float32) or ``"model"`` (the compute dtype: full precision, what
                exactness tests use). Caches are cast back to the compute dtype on
                read. The precision is part of the entries' fingerprint
                (``fingerprint``): engines that store differently never read each
                other's entries, even in one shared store.
            chunk_suffix: text encoded after every chunk, in its entry (default
                ``"\\n\\n"``, what our prompts and LlamaIndex's and LangChain's
                put between chunks). Where a prompt continues a chunk with it,
                those tokens' K/V come from the entry (computed after the chunk
                alone, like the chunk's own) instead of being computed per
                request; elsewhere the chunk's rows alone are used. ``""``
                encodes chunks alone. Part of the entries' keys.
            chunk_context: what a chunk is encoded behind: ``"alone"`` (default,
                from position 0) or ``"sink"`` (behind the model's BOS token,
                whose K/V are dropped, so no chunk token acts as an attention
                sink the full prompt does not have; see docs/benchmarks.md,
                "CacheBlend"). Part of the entries' fingerprint.
        """
        self.loaded = loaded
        self.cache_prefix = cache_prefix
        self.on_miss = check_on_miss(on_miss)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.caches = ChunkCaches(
            loaded,
            # Sized from the memory free where entries live (the model's device:
            # chunks are encoded there): store.budget.memory_budget.
            store if store is not None else MemoryKVStore(memory_budget(loaded.device)),
            cache_precision,
            chunk_suffix,
            chunk_context,
        )
        # One chunk per background unit on CPU: a request finds its chunks queued
        # (taken over) rather than in one batch in flight.
        self.encoder = BackgroundEncoder(
            self.caches.encode_jobs,
            max_pending=max_pending,
            batch_size=1 if loaded.device.type == "cpu" else 8,
            lock=loaded.lock,
            model=loaded.model,
        )
        self.caches.ledger = self.encoder
        self.prompts = self.caches.prompts
        self._calibrations: Calibrations | None = None
        self.strategies_in_use: set[str] = {DEFAULT_STRATEGY}
        registry.note_engine(self)

    def __repr__(self) -> str:
        store = type(self.caches.store).__name__
        return f"<KVRAGEngine {self.loaded.name} on {self.device}, {store} at {id(self):#x}>"

    # ----------------------------------------------------------------- facts
    @property
    def fingerprint(self) -> str:
        """What chunk caches are keyed and checked by: the model's fingerprint
        (``loaded.fingerprint``) plus ``cache_precision`` and ``chunk_context``."""
        return self.caches.fingerprint

    @property
    def cache_precision(self) -> str:
        """How chunk caches are stored (see ``KVRAGEngine``); assignable: entries
        stored in another precision are then simply other keys."""
        return self.caches.precision

    @cache_precision.setter
    def cache_precision(self, precision: str) -> None:
        self.caches.precision = check_precision(precision)

    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype of the weights (``loaded.dtype``)."""
        return self.loaded.dtype

    def exclusive(self) -> AbstractContextManager[Any]:
        """Hold the weights' forward lock (``loaded.lock``) for a block of forwards.

        Every forward on the model, by this engine or any other engine on the
        same ``LoadedModel``, runs under this lock; code that runs its own
        forwards on ``engine.model`` (the reranker) does so inside
        ``with engine.exclusive():``. Re-entrant. Background encoding yields
        to whoever waits for it (``engine.scheduling.forward_lock.ForwardLock``).
        """
        return self.loaded.lock

    @property
    def context_window(self) -> int:
        """``loaded.context_window``: the most prompt and answer tokens."""
        return self.loaded.context_window

    @property
    def eos_token_ids(self) -> list[int]:
        """``loaded.eos_token_ids``: the ids that end an answer."""
        return self.loaded.eos_token_ids

    # ---------------------------------------------------------- calibration
    @property
    def calibrations(self) -> Calibrations:
        """The model's calibrated blend settings (``engine.blend_settings``): the
        store's record under the checkpoint's identity, else the bundled one."""
        if self._calibrations is None:
            try:
                shelf = records_for(self.store)
            except ValueError:  # a store of another kind keeps no records
                shelf = None
            self._calibrations = Calibrations(model_identity(self.loaded), self.loaded.name, shelf)
        return self._calibrations

    def blend_options(self, prompt: TokenizedPrompt) -> dict[str, Any]:
        """The calibrated blend settings for ``prompt``'s chunk length (none: the
        model was never calibrated, and ``CacheBlend``'s defaults apply)."""
        self.strategies_in_use.add("blend")
        settings = self.calibrations.settings_for(median_chunk_tokens(prompt))
        return {} if settings is None else settings.strategy_options()

    def use_strategy(self, strategy: str) -> None:
        """Note that requests will use ``strategy``: ``encode_chunks`` then stores the
        entries it reads too (blend's calibrated encoding context may differ from
        the engine's). The adapters call it with their strategy; a request does."""
        self.strategies_in_use.add(strategy)

    def entry_contexts(self) -> tuple[str, ...]:
        """The encoding contexts ``encode_chunks`` stores entries in: the engine's,
        and blend's calibrated ones once blend is in use."""
        contexts = [self.caches.context]
        if "blend" in self.strategies_in_use:
            contexts += self.calibrations.contexts()
        return tuple(dict.fromkeys(contexts))

    # -------------------------------------------------------------- chunks
    @property
    def store(self) -> KVStore:
        """Where chunk caches live (``caches.store``); assignable."""
        return self.caches.store

    @store.setter
    def store(self, store: KVStore) -> None:
        self.caches.store = store
        self._calibrations = None  # the new store's records

    @property
    def prefix_store(self) -> KVStore:
        """In-process caches of prompts' leading text (``caches.prefix_store``)."""
        return self.caches.prefix_store

    def chunk_key(self, text: str) -> str:
        """The store key the chunk ``text`` has under this model."""
        return self.caches.key(text)

    def prefetch(self, chunks: Sequence[str]) -> int:
        """Start loading the stored caches of ``chunks`` before the request that needs them.

        The adapters call it when a retriever returns its documents, so a disk or
        Redis read overlaps with what the framework does before calling the LLM.
        Never changes an answer; reads nobody takes expire (``caches.loader``).

        Returns:
            How many reads started (0 for an in-memory store).
        """
        return self.caches.prefetch(chunks)

    def encode_chunks(
        self,
        chunks: Sequence[str],
        *,
        batch_size: int = 8,
        show_progress: bool = True,
        overwrite: bool = False,
    ) -> list[ChunkRef]:
        """Precompute and store each chunk's KV cache (already stored ones are skipped).

        Args:
            chunks: chunk texts, exactly as they will appear in prompts.
            batch_size: chunks prefilled per forward (sorted by length to limit padding).
            show_progress: a tqdm progress bar.
            overwrite: recompute even when an intact entry exists.

        Entries are stored in the engine's encoding context, and in blend's
        calibrated one where it differs once blend is in use (``use_strategy``).

        Returns:
            One ``ChunkRef`` per input chunk, in order.
        """
        return self.caches.encode(
            chunks,
            batch_size=batch_size,
            show_progress=show_progress,
            overwrite=overwrite,
            max_tokens=self.context_window,
            contexts=self.entry_contexts(),
        )

    # -------------------------------------------------------------- prefill
    def prefill(
        self,
        segments: Sequence[Segment] | None = None,
        *,
        strategy: str | Strategy = DEFAULT_STRATEGY,
        question: str | None = None,
        chunks: Sequence[str] | None = None,
        messages: Sequence[dict[str, Any]] | None = None,
        known_chunks: Sequence[str] = (),
        system_prompt: str | None = None,
        chat_template: bool = True,
        max_new_tokens: int = 0,
        on_miss: str | None = None,
        queue_misses: bool = True,
        **strategy_options: Any,
    ) -> PrefillResult:
        """Build the prompt cache and the first token's logits with ``strategy``.

        The lower-level half of ``generate``: benchmarks and exactness tests compare
        ``result.logits`` across strategies. ``on_miss`` overrides the engine's
        for this call: with ``"defer"``, a prompt with uncached chunks is
        prefilled in full (``result.fallback == "uncached"``, ``strategy ==
        "full"``) and its misses are queued for background encoding; with
        ``queue_misses=False`` they are queued only by ``queue_deferred(result)``
        (a stream does it when decoding ends, so the worker never takes the
        forward lock between a request's prefill and its first token).
        """
        sampling = SamplingParams(max_new_tokens=max_new_tokens)
        options = RequestOptions(strategy, strategy_options, sampling, on_miss)
        request = self.prepare(
            options,
            segments=segments,
            question=question,
            chunks=chunks,
            messages=messages,
            known_chunks=known_chunks,
            system_prompt=system_prompt,
            chat_template=chat_template,
        )
        with self.loaded.lock.request():  # background encoding pauses meanwhile
            pre = plan_prefill(self, request)()
        if queue_misses:
            self.queue_deferred(pre)
        return pre

    def queue_deferred(self, pre: PrefillResult) -> int:
        """Queue a fallback's missed chunks for background encoding (once).

        Returns how many chunks (the leading text not counted) are queued; also
        set as ``pre.deferred_chunks``.
        """
        misses, pre.misses = pre.misses, {}
        if misses:
            queued = self.encoder.submit(misses)
            pre.deferred_chunks = sum(not m.is_prefix for k, m in misses.items() if k in queued)
            logger.debug("%d chunk(s) left to background encoding", pre.deferred_chunks)
        return pre.deferred_chunks

    def wait_for_encoding(self, timeout: float | None = None) -> bool:
        """Wait until chunks deferred by earlier requests are encoded and stored.

        Returns False if ``timeout`` (seconds) ran out first. Tests and
        benchmarks call it to make "the next request reuses them" deterministic.
        """
        return self.encoder.wait(timeout)

    # ------------------------------------------------------------- generate
    def request_job(self, request: Request, result: GenerationResult) -> Job:
        """The request's work on this engine: ``in_process.answer`` (caches read,
        then prefill and decoding under the forward lock)."""
        return partial(answer, self, request, result)
