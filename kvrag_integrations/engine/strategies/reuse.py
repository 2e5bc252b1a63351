"""What turbo and blend share: laying stored chunk caches out in prompt order.

Assembly issues O(layers) torch operations, whatever the number of chunks: the
layout of the prompt (positions, how far each cached key moves, which rows are
text) is computed once per request from its pieces, and each layer's keys and
values of every chunk are placed by one ``cat`` over per-layer views the entries
keep (``ChunkKV.layer_rows``), then every moved key of the layer is re-rotated
by one batched rotation (cos/sin computed once per request per rotary: layers
may differ in RoPE, as Gemma3's local and global ones do). A loop over chunks
and layers issued chunks x layers x 2 copies: 4,096 kernel launches for 64
chunks on an 8B model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.modeling.forward import PromptKV
from kvrag_integrations.engine.modeling.model import LoadedModel
from kvrag_integrations.engine.prompting.segments import CHUNK_CONTEXTS, TokenizedPrompt
from kvrag_integrations.engine.strategies.base import PrefillOutput, Strategy

POSITION_MODES = ("reordered", "composite")


def check_positions(positions: str) -> str:
    if positions not in POSITION_MODES:
        raise ValueError(f"positions must be one of {POSITION_MODES}, got {positions!r}")
    return positions


@dataclass(frozen=True)
class Placement:
    """Where a prompt's stored rows go (computed once per request from its pieces).

    Attributes:
        positions: ``[tokens]`` each token's RoPE position.
        uncached: sequence indices of the text tokens still to compute.
        row_counts: rows each cached piece takes from its entry, in order.
        span: ``(lo, hi)``: the sequence indices holding every cached row.
        rows: the cached rows' sequence indices when they do not fill ``span``
            in order (text between chunks), else None.
        moved: ``(lo, hi)`` of the rows whose keys move (None: none move), and
        delta: how far each key in ``moved`` moves (0 on text rows there).
        chunk_runs: ``(start, stop)`` of each run of retrieved chunks' rows.
    """

    positions: torch.Tensor
    uncached: torch.Tensor
    row_counts: list[int]
    span: tuple[int, int]
    rows: torch.Tensor | None
    moved: tuple[int, int] | None
    delta: torch.Tensor | None
    chunk_runs: list[tuple[int, int]]


def place(prompt: TokenizedPrompt, positions: str = "reordered") -> Placement:
    """The prompt's :class:`Placement`: Python over its pieces, then a few
    tensor ops for the whole prompt (none per piece)."""
    lengths, offsets, deltas, texts = [], [], [], []
    row_counts: list[int] = []
    cached: list[tuple[int, int]] = []
    moving: list[tuple[int, int]] = []
    runs: list[tuple[int, int]] = []
    start = next_pos = 0
    for piece in prompt.pieces:
        n = piece.ids.numel()
        d = 0
        if piece.is_cached:
            at = next_pos if positions == "reordered" else 0
            # Entries are stored from position ``piece.stored_at`` (0, or after
            # the chunk encoding context): each key moves by the difference.
            d = at - piece.stored_at
            next_pos = max(next_pos, at + n)
            row_counts.append(n)
            cached.append((start, start + n))
            if d and n:
                moving.append((start, start + n))
            if piece.is_chunk and runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], start + n)
            elif piece.is_chunk:
                runs.append((start, start + n))
        else:
            at = next_pos
            next_pos += n
        lengths.append(n)
        offsets.append(at - start)
        deltas.append(d)
        texts.append(not piece.is_cached)
        start += n
    counts = torch.tensor(lengths, dtype=torch.long)
    pos = torch.arange(start) + torch.tensor(offsets, dtype=torch.long).repeat_interleave(counts)
    text = torch.tensor(texts, dtype=torch.bool).repeat_interleave(counts)
    uncached = text.nonzero().flatten()
    span = (cached[0][0], cached[-1][1]) if cached else (0, 0)
    rows = None
    if sum(b - a for a, b in cached) != span[1] - span[0]:
        rows = (~text).nonzero().flatten()
    moved = delta = None
    if moving:
        moved = (moving[0][0], moving[-1][1])
        per_token = torch.tensor(deltas, dtype=torch.long).repeat_interleave(counts)
        delta = per_token[moved[0] : moved[1]]
    return Placement(pos, uncached, row_counts, span, rows, moved, delta, runs)


class ChunkReuse(Strategy):
    """Base of the strategies that start from the stored chunk caches.

    Args:
        positions: ``"reordered"`` (contiguous, TurboRAG's choice) moves each chunk
            to where it sits in the prompt; ``"composite"`` (the paper's ablation)
            leaves every chunk at 0 and continues text after the longest chunk.
        chunk_context: read entries encoded in this context (``"alone"`` or
            ``"sink"``, ``entries.CHUNK_CONTEXTS``) instead of the engine's own
            (None): they are other entries, kept apart in the same store, and a
            missing one is encoded as the engine's miss policy says.
    """

    def __init__(self, positions: str = "reordered", chunk_context: str | None = None) -> None:
        self.positions = check_positions(positions)
        if chunk_context is not None and chunk_context not in CHUNK_CONTEXTS:
            raise ValueError(
                f"chunk_context must be one of {CHUNK_CONTEXTS} or None, got {chunk_context!r}"
            )
        self.chunk_context = chunk_context

    def assemble(
        self, model: LoadedModel, prompt: TokenizedPrompt, chunk_kvs: Sequence[ChunkKV]
    ) -> tuple[PromptKV, torch.Tensor]:
        """Lay the chunk caches out in prompt order, keys moved to their positions.

        Returns:
            ``(kv, uncached)``: the buffer (text tokens' slots not yet written) and
            the sequence indices of the text tokens still to compute.
        """
        kv, placement = self.assemble_placed(model, prompt, chunk_kvs)
        return kv, placement.uncached.to(kv.device)

    def assemble_placed(
        self, model: LoadedModel, prompt: TokenizedPrompt, chunk_kvs: Sequence[ChunkKV]
    ) -> tuple[PromptKV, Placement]:
        """:meth:`assemble`, returning the :class:`Placement` it used."""
        layout = model.layout
        placement = place(prompt, self.positions)
        ids = prompt.input_ids
        kv = model.prompt_kv(placement.positions, ids)  # a reserved bucket's slots, or fresh
        if len(chunk_kvs) != len(placement.row_counts):
            raise ValueError(
                f"{len(placement.row_counts)} cached pieces but {len(chunk_kvs)} chunk caches"
            )
        if not chunk_kvs:
            return kv, placement
        views = [c.layer_rows(n) for c, n in zip(chunk_kvs, placement.row_counts)]
        rows = None if placement.rows is None else placement.rows.to(kv.device)
        rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(layout.num_layers):
            keys, values = kv.keys[layer], kv.values[layer]
            put(keys, gather(views, "keys", layer), placement.span, rows)
            put(values, gather(views, "values", layer), placement.span, rows)
            if placement.moved is None:
                continue
            rotary = layout.rotary_of(layer)
            if id(rotary) not in rotations:  # once per rotary, not per layer
                rotations[id(rotary)] = rotary.rotation(placement.delta, kv.device)
            lo, hi = placement.moved
            # Text rows inside ``moved`` (not written yet) move by 0: harmless,
            # and the forward writes them before any layer reads them.
            rotary.rotate(keys[:, lo:hi], *rotations[id(rotary)], out=keys[:, lo:hi])
        return kv, placement


def gather(
    views: Sequence[dict[str, tuple[torch.Tensor, ...]]], name: str, layer: int
) -> list[torch.Tensor]:
    """Layer ``layer`` of every cached piece's ``name`` (``"keys"`` or ``"values"``)
    in prompt order: float views as stored, and each run of int8 entries as one
    float32 tensor dequantized at once (a few ops per layer, none per chunk).
    Forms mix: the leading text's entry is at model precision beside int8 chunks."""
    parts: list[torch.Tensor] = []
    run: list[dict[str, tuple[torch.Tensor, ...]]] = []
    for v in views:
        if "key_scale" in v:
            run.append(v)
            continue
        if run:
            parts.append(_dequantize(run, name, layer))
            run = []
        parts.append(v[name][layer])
    if run:
        parts.append(_dequantize(run, name, layer))
    return parts


def _dequantize(
    views: Sequence[dict[str, tuple[torch.Tensor, ...]]], name: str, layer: int
) -> torch.Tensor:
    """``codes * scale + zero`` over int8 entries' rows of one layer (float32, as
    ``ChunkKV.dequantize`` computes it)."""
    scale, zero = ("key_scale", "key_zero") if name == "keys" else ("value_scale", "value_zero")
    codes = _cat([v[name][layer] for v in views]).float()
    codes.mul_(_cat([v[scale][layer] for v in views])).add_(_cat([v[zero][layer] for v in views]))
    return codes


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _blocks(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """``parts`` joined into one tensor per run of equal dtype: CUDA's cat is one
    kernel only over inputs of one dtype (else one copy per input). A prompt mixes
    dtypes when its leading text is at model precision beside float16 chunks."""
    runs: list[list[torch.Tensor]] = []
    for part in parts:
        if runs and runs[-1][0].dtype == part.dtype:
            runs[-1].append(part)
        else:
            runs.append([part])
    return [_cat(run) for run in runs]


def put(
    dest: torch.Tensor,
    parts: list[torch.Tensor],
    span: tuple[int, int],
    rows: torch.Tensor | None,
    cast_in_cat: bool | None = None,
) -> None:
    """Write ``parts`` (one layer's cached rows, in order) into the layer ``dest``
    (``[kv_heads, tokens, head_dim]``), cast to its dtype: into ``span`` when the
    rows fill it, else at ``rows``. ``cast_in_cat`` (default: on CPU) lets one
    ``cat`` write the parts in place; else one block per dtype is copied."""
    if cast_in_cat is None:
        cast_in_cat = dest.device.type == "cpu"
    if cast_in_cat and rows is None and len(parts) > 1:
        # One op: on CPU cat writes each part into place with the cast (no temporary).
        torch.cat(parts, dim=1, out=dest[:, span[0] : span[1]])
        return
    blocks = _blocks(parts)
    if rows is not None:
        src = _cat([b.to(dest.dtype) for b in blocks])
        dest.index_copy_(1, rows, src)
        return
    start = span[0]
    for block in blocks:  # (one per dtype: usually the leading text's, then the chunks')
        n = block.shape[1]
        dest[:, start : start + n].copy_(block)
        start += n


def divide_chunk_keys(kv: PromptKV, placement: Placement, divisor: float) -> None:
    """Divide the retrieved chunks' keys (not the cached leading text's) by
    ``divisor`` in every layer: one op per layer and run of adjacent chunks."""
    for keys in kv.keys:
        for a, b in placement.chunk_runs:
            keys[:, a:b] /= divisor


def with_last(idx: torch.Tensor, total: int) -> torch.Tensor:
    """``idx`` plus the last prompt token, whose logits start decoding."""
    last = torch.tensor([total - 1], device=idx.device)
    return torch.unique(torch.cat([idx, last]))


def output(
    kv: PromptKV, logits: torch.Tensor, uncached: torch.Tensor, computed: torch.Tensor
) -> PrefillOutput:
    """The strategy's output, with chunk and reuse masks from what was computed."""
    chunk = torch.ones(kv.num_tokens, dtype=torch.bool, device=computed.device)
    chunk[uncached] = False
    reused = chunk.clone()
    reused[computed] = False
    return PrefillOutput(kv, logits, chunk, reused)
