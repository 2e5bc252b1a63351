"""What turbo and blend share: laying stored chunk caches out in prompt order."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.forward import PromptKV
from kvrag_integrations.engine.model import LoadedModel
from kvrag_integrations.engine.segments import TokenizedPrompt
from kvrag_integrations.engine.strategies.base import PrefillOutput, Strategy

POSITION_MODES = ("reordered", "composite")


def check_positions(positions: str) -> str:
    if positions not in POSITION_MODES:
        raise ValueError(f"positions must be one of {POSITION_MODES}, got {positions!r}")
    return positions


class ChunkReuse(Strategy):
    """Base of the strategies that start from the stored chunk caches.

    Args:
        positions: ``"reordered"`` (contiguous, TurboRAG's choice) moves each chunk
            to where it sits in the prompt; ``"composite"`` (the paper's ablation)
            leaves every chunk at 0 and continues text after the longest chunk.
    """

    def __init__(self, positions: str = "reordered") -> None:
        self.positions = check_positions(positions)

    def assemble(
        self, model: LoadedModel, prompt: TokenizedPrompt, chunk_kvs: Sequence[ChunkKV]
    ) -> tuple[PromptKV, torch.Tensor]:
        """Lay the chunk caches out in prompt order, keys moved to their positions.

        Returns:
            ``(kv, uncached)``: the buffer (text tokens' slots not yet written) and
            the sequence indices of the text tokens still to compute.
        """
        layout = model.layout
        n_tokens = prompt.num_tokens
        pos = torch.empty(n_tokens, dtype=torch.long)
        # How far each token's stored key moves (entries are stored from position
        # ``piece.stored_at``: 0, or after the chunk encoding context).
        delta = torch.zeros(n_tokens, dtype=torch.long)
        placed: list[tuple[slice, tuple[torch.Tensor, torch.Tensor]]] = []
        uncached = []
        start = next_pos = 0
        chunk_iter = iter(chunk_kvs)
        for piece in prompt.pieces:
            n = piece.ids.numel()
            span = slice(start, start + n)
            if piece.is_cached:
                at = next_pos if self.positions == "reordered" else 0
                placed.append((span, stored_kv(next(chunk_iter))))
                pos[span] = torch.arange(at, at + n)
                delta[span] = at - piece.stored_at
                next_pos = max(next_pos, at + n)
            else:
                pos[span] = torch.arange(next_pos, next_pos + n)
                next_pos += n
                uncached.append(torch.arange(start, start + n))
            start += n
        kv = PromptKV.empty(layout, pos, prompt.input_ids, model.dtype, model.device)
        # Text tokens' slots are written by the forward before any layer reads them;
        # the rotation below runs over them too (cheaper than skipping), harmlessly.
        moved = delta.nonzero()
        lo, hi = (int(moved[0]), int(moved[-1]) + 1) if moved.numel() else (0, 0)
        rotations = {}
        for layer, (keys, values) in enumerate(zip(kv.keys, kv.values)):
            # The cast from the storage dtype happens here, in the copy into the
            # buffer that assembly makes anyway (no float copy of each chunk first).
            # An entry may hold more rows than its piece (a chunk suffix the
            # prompt does not continue with): the piece takes the first ones.
            for span, (chunk_keys, chunk_values) in placed:
                n = span.stop - span.start
                keys[:, span] = chunk_keys[layer][:, :n]
                values[:, span] = chunk_values[layer][:, :n]
            if hi > lo:
                rotary = layout.rotary_of(layer)
                if id(rotary) not in rotations:  # one cos/sin per rotary, not per layer
                    rotations[id(rotary)] = rotary.rotation(delta[lo:hi], kv.device)
                rotary.rotate(keys[:, lo:hi], *rotations[id(rotary)], out=keys[:, lo:hi])
        todo = torch.cat(uncached) if uncached else torch.zeros(0, dtype=torch.long)
        return kv, todo.to(kv.device)


def stored_kv(chunk: ChunkKV) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's float K/V in their storage dtype (int8 entries dequantized to float32)."""
    if chunk.is_quantized:
        return chunk.dequantize(torch.float32)
    return chunk.keys, chunk.values


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
