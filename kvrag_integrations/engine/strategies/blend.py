"""CacheBlend (arXiv 2405.16444): reuse chunk caches, recompute the tokens that deviate.

Layout as for turbo. Two passes of the model's own forward over the prompt
cache. The selection pass runs every token through the first ``check_layer``
layers (layer 0's K/V depend only on token and position, so this costs no
fidelity and gives every token a context-aware input to the check layer) and
stops once the check layer has projected its K/V. There the fresh K/V of each
cached token are compared with its stored ones; the ``recompute_ratio`` share
with the largest squared-L2 deviation (plus every uncached token) is selected.
The second pass runs only the selected tokens through every layer, writing
fresh K/V over the stored entries; everything else is reused as stored.

``selection="query"`` (ProphetKV arXiv 2602.02579, A3 arXiv 2511.17560)
replaces the first pass: the uncached text runs over the reused caches as in
turbo, and the chunk tokens the question's last rows attend to most, summed
over ``query_layers``, are the ones recomputed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.modeling.attention_mass import attention_mass
from kvrag_integrations.engine.modeling.forward import PromptKV, run_tokens
from kvrag_integrations.engine.modeling.model import LoadedModel
from kvrag_integrations.engine.prompting.segments import TokenizedPrompt
from kvrag_integrations.engine.strategies.base import PrefillOutput
from kvrag_integrations.engine.strategies.reuse import ChunkReuse, output, with_last
from kvrag_integrations.errors import UnsupportedModelError

DEVIATIONS = ("value", "key", "both")
SELECTIONS = ("auto", "deviation", "query")


class CacheBlend(ChunkReuse):
    """Selective KV recompute on top of reused chunk caches.

    Args:
        recompute_ratio: share of cached chunk tokens to recompute, in [0, 1]
            (0 reproduces turbo, 1 reproduces full prefill).
        check_layer: the layer where deviations are measured (>= 1 keeps
            ``recompute_ratio=0`` equal to turbo; 0 selects on layer-0 K/V).
        deviation: ``"value"`` (the CacheBlend reference), ``"key"`` (LMCache), or
            ``"both"``.
        recompute_first: also recompute the first N tokens of every chunk (EPIC's
            answer to each chunk's spurious attention sink).
        keep_chunk_starts: never recompute the first N tokens of every chunk (each
            chunk's attention sink when it was encoded alone; see
            docs/benchmarks.md, "CacheBlend on this model").
        refresh_check_layer: also keep the check layer's fresh K/V of the tokens
            that are not selected (computed anyway and exact at that layer); then
            ``recompute_ratio=0`` is no longer turbo.
        positions: ``"reordered"`` or ``"composite"``, as for turbo.
        selection: ``"deviation"`` (CacheBlend: K/V drift at ``check_layer``),
            ``"query"`` (the tokens the question attends to most over the reused
            caches, summed over ``query_layers``; ``check_layer``, ``deviation``
            and ``refresh_check_layer`` do not apply), or ``"auto"`` (default):
            ``"query"`` where the prompt's chunks were encoded behind a sink
            (``KVRAGEngine(chunk_context="sink")``), else ``"deviation"``. Over
            sink-encoded chunks query-driven selection gave 0.34x-0.79x
            deviation's KL to full in all four measured runs (two models, two
            prompt shapes). Over chunks encoded alone it was no better than
            deviation: their first tokens draw the question's attention as
            spurious sinks (docs/benchmarks.md, "CacheBlend").
        query_layers: the layers whose attention ``"query"`` sums (default: from
            a quarter of the depth on, where attention depends on content more
            than on position).
        chunk_context: the entries it reads (``ChunkReuse``; None: the engine's).

    Examples:
        >>> CacheBlend(recompute_ratio=0.15).name
        'blend'
    """

    name = "blend"

    def __init__(
        self,
        recompute_ratio: float = 0.15,
        check_layer: int = 1,
        deviation: str = "value",
        recompute_first: int = 0,
        positions: str = "reordered",
        keep_chunk_starts: int = 0,
        refresh_check_layer: bool = False,
        selection: str = "auto",
        query_layers: Sequence[int] | None = None,
        chunk_context: str | None = None,
    ) -> None:
        super().__init__(positions, chunk_context)
        if isinstance(recompute_ratio, bool) or not isinstance(recompute_ratio, (int, float)):
            raise TypeError("recompute_ratio must be a number in [0, 1]")
        if not 0.0 <= float(recompute_ratio) <= 1.0 or math.isnan(recompute_ratio):
            raise ValueError(f"recompute_ratio must be in [0, 1], got {recompute_ratio}")
        if not isinstance(check_layer, int) or check_layer < 0:
            raise ValueError(f"check_layer must be an int >= 0, got {check_layer!r}")
        if deviation not in DEVIATIONS:
            raise ValueError(f"deviation must be one of {DEVIATIONS}, got {deviation!r}")
        if not isinstance(recompute_first, int) or recompute_first < 0:
            raise ValueError("recompute_first must be an int >= 0")
        if not isinstance(keep_chunk_starts, int) or keep_chunk_starts < 0:
            raise ValueError("keep_chunk_starts must be an int >= 0")
        if not isinstance(refresh_check_layer, bool):
            raise TypeError("refresh_check_layer must be a bool")
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
        if query_layers is not None and (
            isinstance(query_layers, (str, bytes))
            or not query_layers
            or not all(isinstance(i, int) and i >= 0 for i in query_layers)
        ):
            raise ValueError(f"query_layers must be layer indices >= 0, got {query_layers!r}")
        self.recompute_ratio = float(recompute_ratio)
        self.check_layer = check_layer
        self.deviation = deviation
        self.recompute_first = recompute_first
        self.keep_chunk_starts = keep_chunk_starts
        self.refresh_check_layer = refresh_check_layer
        self.selection = selection
        self.query_layers = None if query_layers is None else tuple(query_layers)

    def prefill(
        self, model: LoadedModel, prompt: TokenizedPrompt, chunk_kvs: Sequence[ChunkKV]
    ) -> PrefillOutput:
        n_layers = model.layout.num_layers
        if self.check_layer >= n_layers:
            raise ValueError(f"check_layer {self.check_layer} >= the model's {n_layers} layers")
        kv, uncached = self.assemble(model, prompt, chunk_kvs)
        todo = with_last(uncached, kv.num_tokens)
        # A cached leading prefix is exact (nothing precedes it): never a candidate.
        candidates = torch.ones(kv.num_tokens, dtype=torch.bool, device=kv.device)
        candidates[uncached] = False
        if prompt.pieces and prompt.pieces[0].is_prefix:
            candidates[: prompt.pieces[0].ids.numel()] = False
        if self.keep_chunk_starts:
            candidates &= ~self._chunk_starts(prompt, kv, self.keep_chunk_starts)
        keep = torch.zeros_like(candidates)
        keep[todo] = True
        if self.recompute_first:
            keep |= self._chunk_starts(prompt, kv, self.recompute_first)
        # The ratio's share of the candidates, picked among those not computed anyway:
        # the rows recomputed are then known before the selection runs.
        n_keep = round(self.recompute_ratio * int(candidates.sum()))
        pool = candidates & ~keep

        if self.selection_for(prompt) == "query":
            keep |= self.pick_by_query(model, kv, todo, candidates, pool, n_keep)
        else:

            def select(layer: int, fresh_k, fresh_v, rows: torch.Tensor) -> torch.Tensor | None:
                if layer < self.check_layer:
                    return None  # every token's fresh K/V (CacheBlend's full first layers)
                keep[rows] |= self.pick(kv, layer, fresh_k, fresh_v, rows, pool[rows], n_keep)
                return None if self.refresh_check_layer else keep[rows]

            every = torch.arange(kv.num_tokens, device=kv.device)
            run_tokens(model.model, model.layout, kv, every, select, stop_after=self.check_layer)
        computed = keep.nonzero().flatten()
        logits = run_tokens(model.model, model.layout, kv, computed)
        return output(kv, logits, uncached, computed)

    def pick(
        self,
        kv: PromptKV,
        layer: int,
        fresh_k: torch.Tensor,
        fresh_v: torch.Tensor,
        rows: torch.Tensor,
        cached: torch.Tensor,
        n_keep: int,
    ) -> torch.Tensor:
        """Keep-mask over ``rows``: the ``n_keep`` of ``cached`` that deviate most."""
        keep = torch.zeros_like(cached)
        n_keep = min(n_keep, int(cached.sum()))
        if n_keep == 0:
            return keep
        dev = torch.zeros(fresh_k.shape[:2], device=rows.device)  # [kv_heads, n]
        if self.deviation in ("value", "both"):
            dev += _sq_dist(fresh_v, kv.values[layer][:, rows])
        if self.deviation in ("key", "both"):
            dev += _sq_dist(fresh_k, kv.keys[layer][:, rows])
        score = dev.sum(dim=0)
        score[~cached] = float("-inf")
        keep[torch.topk(score, n_keep).indices] = True
        return keep

    def selection_for(self, prompt: TokenizedPrompt) -> str:
        """``selection``, with ``"auto"`` resolved for this prompt's chunks."""
        if self.selection != "auto":
            return self.selection
        return "query" if any(p.stored_at for p in prompt.chunk_pieces) else "deviation"

    def pick_by_query(
        self,
        model: LoadedModel,
        kv: PromptKV,
        todo: torch.Tensor,
        candidates: torch.Tensor,
        pool: torch.Tensor,
        n_keep: int,
    ) -> torch.Tensor:
        """Keep-mask over the prompt: the ``n_keep`` of ``pool`` (candidates not computed
        anyway) the question attends to most, the uncached text computed over the
        reused caches (turbo's prefill; its K/V are computed again after)."""
        keep = torch.zeros_like(candidates)
        n_keep = min(n_keep, int(pool.sum()))
        if n_keep == 0:
            return keep
        n_layers = model.layout.num_layers
        layers = self.query_layers or range(n_layers // 4, n_layers)
        if max(layers) >= n_layers:
            raise ValueError(f"query_layers {max(layers)} >= the model's {n_layers} layers")
        # The question: the computed rows after the last candidate token.
        # (At least the last row, which is always computed: a prompt may end in a chunk.)
        tail = max(1, int((todo > int(candidates.nonzero().max())).sum()))
        with attention_mass(model.model, set(layers), tail) as mass:
            # A plug-in keeps the rows in one forward, so "last rows" is the question.
            run_tokens(model.model, model.layout, kv, todo, on_update=_write_all)
        if mass.mass is None:  # the model's attention bypasses transformers' interface
            raise UnsupportedModelError(
                f"{model.layout.architecture}: selection='query' needs attention that "
                "goes through transformers' AttentionInterface"
            )
        score = mass.mass[: kv.num_tokens].clone()
        score[~pool] = float("-inf")
        keep[torch.topk(score, n_keep).indices] = True
        return keep

    def _chunk_starts(self, prompt: TokenizedPrompt, kv: PromptKV, n: int) -> torch.Tensor:
        """Mask of the first ``n`` tokens of every chunk (not the cached leading text)."""
        starts = torch.zeros(kv.num_tokens, dtype=torch.bool, device=kv.device)
        offset = 0
        for piece in prompt.pieces:
            if piece.is_chunk:
                starts[offset : offset + min(n, piece.ids.numel())] = True
            offset += piece.ids.numel()
        return starts


def _write_all(*_: object) -> None:
    return None


def _sq_dist(fresh: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """Per-head, per-token squared L2 distance: ``[heads, n, d] -> [heads, n]``."""
    return (fresh.float() - stored.float()).pow(2).sum(dim=-1)
