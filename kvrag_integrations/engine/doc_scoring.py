"""``KVRAGEngine``'s side of ``protocol.DocumentScorer``: document-first prompts scored
in batches over their stored prefix caches (the decoder reranker's forward).

Candidates are scored in batches with a static padded layout over their cached
prefixes (``rerank.scoring``: inputs, mask, batch cache and the two scores):
only the suffix of each prompt runs through the model.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.modeling.hf_compat import cache_argument
from kvrag_integrations.engine.protocol import DocumentScores
from kvrag_integrations.errors import UnsupportedModelError
from kvrag_integrations.rerank.scoring import batch_cache, batch_inputs, judge, query_likelihood


class InProcessScoring:
    """The ``DocumentScorer`` methods of ``KVRAGEngine`` (a mixin: it reads the
    engine's model, caches, lock and store)."""

    fingerprint: str
    store: Any
    tokenizer: Any

    def scoring_fingerprint(self, key_space: str) -> str:
        """Prefix caches live in their own key space: ``<fingerprint>|rerank|<space>``."""
        return f"{self.fingerprint}|rerank|{key_space}"

    def encode_documents(
        self,
        prefixes: Sequence[Sequence[int]],
        *,
        key_space: str = "",
        store: Any = None,
        batch_size: int = 16,
    ) -> DocumentScores:
        out = DocumentScores()
        self._document_caches(
            [torch.as_tensor(list(p)) for p in prefixes], key_space, store, batch_size, out
        )
        return out

    def score_documents(
        self,
        prefixes: Sequence[Sequence[int]],
        suffix: Sequence[int],
        *,
        n_query: int = 0,
        answer_ids: tuple[Sequence[int], Sequence[int]] = ((), ()),
        reuse: bool = True,
        key_space: str = "",
        store: Any = None,
        batch_size: int = 16,
    ) -> DocumentScores:
        out = DocumentScores()
        heads = [torch.as_tensor(list(p), dtype=torch.long) for p in prefixes]
        tail = torch.as_tensor(list(suffix), dtype=torch.long)
        if not heads:
            return out
        self._check_rerank_fits(max(p.numel() for p in heads) + tail.numel())
        kvs = self._document_caches(heads, key_space, store, batch_size, out) if reuse else None
        answers = (list(answer_ids[0]), list(answer_ids[1]))
        out.scores = [0.0] * len(heads)
        # Longest first, so the rows of one batch have similar lengths (less padding).
        order = sorted(range(len(heads)), key=lambda i: -heads[i].numel())
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            if kvs is None:
                ids, lens, batch = [torch.cat([heads[i], tail]) for i in rows], None, None
            else:
                ids, batch = [tail] * len(rows), [kvs[i] for i in rows]
                lens = [kv.num_tokens for kv in batch]
            values = self._score_forward(ids, lens, batch, n_query, answers, out)
            for i, value in zip(rows, values, strict=True):
                out.scores[i] = value
        return out

    def _check_rerank_fits(self, n_tokens: int) -> None:
        engine: Any = self
        engine.check_fits(n_tokens, "a rerank prompt")
        windows = [w for w in engine.loaded.layout.windows if w is not None]
        window = min(windows, default=None)
        # Our explicit 4D mask is full attention; a sliding-window layer would see
        # more than it was trained to, so refuse instead of scoring silently wrong.
        if window is not None and n_tokens > window:
            raise UnsupportedModelError(
                f"a rerank prompt of {n_tokens} tokens exceeds the sliding window ({window})"
            )

    def _document_caches(
        self,
        prefixes: list[torch.Tensor],
        key_space: str,
        store: Any,
        batch_size: int,
        out: DocumentScores,
    ) -> list[ChunkKV]:
        """Stored prefix caches, in order; missing ones are encoded (batched) and stored:
        the engine's ``caches.fetch_or_encode`` in the key space, at the model's precision."""
        engine: Any = self
        fetched = engine.caches.fetch_or_encode(
            prefixes,
            store=store if store is not None else self.store,
            fingerprint=self.scoring_fingerprint(key_space),
            precision="model",
            batch_size=batch_size,
        )
        out.reused += fetched.reused
        out.forward_s += fetched.encode_s
        out.encoded += len(fetched.encoded)
        device, dtype = engine.device, engine.dtype
        return [fetched.caches[k].to(device, dtype) for k in fetched.keys]

    @torch.no_grad()
    def _score_forward(
        self,
        ids: list[torch.Tensor],
        prefix_lens: list[int] | None,
        kvs: list[ChunkKV] | None,
        n_query: int,
        answers: tuple[list[int], list[int]],
        out: DocumentScores,
    ) -> list[float]:
        """One batched forward; each row's score at its last token.

        Row ``r`` has ``prefix_lens[r]`` cached tokens (from ``kvs``) at positions
        ``0..P_r-1`` and computes ``ids[r]`` at positions ``P_r..`` (no cache: ``P_r = 0``;
        layout: ``scoring.batch_inputs``).
        """
        engine: Any = self
        prefix_lens = prefix_lens or [0] * len(ids)
        device = engine.device
        pad_id = int(self.tokenizer.pad_token_id)
        input_ids, positions, mask = batch_inputs(ids, prefix_lens, pad_id, engine.dtype)
        cache = batch_cache(kvs, max(prefix_lens)) if kvs is not None else None
        started = time.perf_counter()
        with engine.exclusive():
            result = engine.model(
                input_ids=input_ids.to(device),
                position_ids=positions.to(device),
                attention_mask=mask.to(device) if mask is not None else None,
                **cache_argument(engine.model, cache),
                use_cache=cache is not None,
                logits_to_keep=n_query + 1 if n_query else 1,
            )
        out.forward_s += time.perf_counter() - started
        if n_query:
            return query_likelihood(result.logits, input_ids, n_query)
        return judge(result.logits, answers[0], answers[1])


__all__ = ["InProcessScoring"]
