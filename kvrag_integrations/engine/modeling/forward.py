"""The model's own forward over a prompt cache, computing only chosen tokens.

Every strategy that reuses caches ends here. The prompt's K/V buffer
(:class:`PromptKV`) holds each token's keys and values, cached or not yet
computed; :func:`run_tokens` runs the chosen tokens (by sequence index) through
the model's own forward (embedding and its scaling, every decoder layer with
its norms, multipliers, softcapping, MoE routing, QK-norms; final norm, logit
scaling) with three things of ours:

- :class:`PromptCache`, a transformers ``Cache`` whose ``update()`` writes the
  computed tokens' fresh K/V into the buffer at their sequence indices and
  hands back the whole buffer, so each layer attends over cached and fresh K/V;
- explicit position ids (each token's RoPE position, which need not be its
  sequence index);
- a 4D additive mask per layer type, by sequence index: a computed token sees
  exactly the keys at indices <= its own, within the layer's window. (The
  reference CacheBlend code aligns the causal mask bottom-right, which lets a
  mid-sequence token see later keys.) Where the computed rows are a contiguous
  tail, that is exactly lower-right causal: layer types whose window does not
  cut in then get no mask tensor, and SDPA runs lower-right
  (``engine.modeling.lower_right``, on SDPA models).

A per-layer plug-in (``on_update``) sees each layer's fresh K/V before they
are written and says which to write; ``stop_after`` ends the forward once a
layer has written (CacheBlend's selection pass stops at its check layer).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from kvrag_integrations.engine.modeling.hf_compat import (
    ForwardCache,
    RecordingDynamicCache,
    cache_argument,
    model_mask,
)
from kvrag_integrations.engine.modeling.layout import ModelLayout
from kvrag_integrations.engine.modeling.lower_right import (
    can_take,
    lower_right_forward,
    placeholder,
)
from kvrag_integrations.errors import UnsupportedModelError


@dataclass
class PromptKV:
    """The prompt's KV cache in sequence order, one tensor per layer.

    Per layer, not one ``[layers, ...]`` block: a prompt-sized block is over
    malloc's mmap threshold, so on CPU every request would page-fault ~100 MB
    in afresh (~20 ms per 100 MB); per-layer tensors are recycled by the
    allocator, and the model's cache wants them per layer anyway.

    Attributes:
        keys: per layer, ``[kv_heads, tokens, head_dim]`` post-RoPE keys.
        values: same shapes.
        positions: ``[tokens]`` RoPE position of each token.
        input_ids: ``[tokens]`` token ids.
        home: the static decode (``StaticDecoder``) whose bucket the keys and
            values are views of (``LoadedModel.prompt_kv``), else None. Its tail
            forward then runs there (``run_tokens``), and decoding starts there.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: torch.Tensor
    input_ids: torch.Tensor
    home: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def empty(
        cls,
        layout: ModelLayout,
        positions: torch.Tensor,
        input_ids: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> PromptKV:
        """A buffer for ``input_ids`` (slots unwritten: callers fill every one)."""
        shape = (layout.kv_heads, input_ids.numel(), layout.head_dim)
        keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)]
        values = [torch.empty_like(k) for k in keys]
        return cls(keys, values, positions.to(device), input_ids.to(device))

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[layers, kv_heads, tokens, head_dim]`` copies of the keys and values
        (for inspection; writing to them changes nothing)."""
        return torch.stack(self.keys), torch.stack(self.values)

    @property
    def next_position(self) -> int:
        """Position of the first generated token."""
        return int(self.positions.max().item()) + 1 if self.num_tokens else 0


class StopForward(Exception):
    """Ends a forward once layer ``stop_after`` has written its K/V (nothing later runs)."""


# on_update(layer, fresh_keys, fresh_values, rows) -> bool mask over rows of the K/V
# to write (None: all of them). Fresh K/V are [kv_heads, n, head_dim] post-RoPE, for
# the tokens at sequence indices rows; the buffer still holds the previous ones.
OnUpdate = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


class _BufferWriter:
    """Writes each layer's fresh K/V of the computed rows into the prompt buffer."""

    def __init__(
        self, kv: PromptKV, rows: torch.Tensor, on_update: OnUpdate | None, stop_after: int | None
    ) -> None:
        self.kv = kv
        self.rows = rows
        self.end = int(rows.max()) + 1
        self.on_update = on_update
        self.stop_after = stop_after

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        keys, values = self.kv.keys[layer_idx], self.kv.values[layer_idx]
        fresh_k, fresh_v = key_states[0], value_states[0]
        write = None
        if self.on_update is not None:
            write = self.on_update(layer_idx, fresh_k, fresh_v, self.rows)
        if write is None:
            keys[:, self.rows] = fresh_k
            values[:, self.rows] = fresh_v
        elif write.numel():
            keys[:, self.rows[write]] = fresh_k[:, write]
            values[:, self.rows[write]] = fresh_v[:, write]
        if layer_idx == self.stop_after:
            raise StopForward


class PromptCache(ForwardCache):
    """A transformers cache over a :class:`PromptKV` buffer, for one forward.

    The forward computes the tokens at sequence indices ``rows``; each layer's
    ``update()`` writes their K/V there and returns the buffer up to the last
    computed row (nothing later is visible to any of them).
    """

    def __init__(self, writer: _BufferWriter) -> None:
        super().__init__()
        self.writer = writer
        self.end = writer.end

    def write(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.writer.write(key_states, value_states, layer_idx)
        keys, values = self.writer.kv.keys[layer_idx], self.writer.kv.values[layer_idx]
        return keys[None, :, : self.end], values[None, :, : self.end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.end


def _whole_prefix_cache(writer: _BufferWriter) -> RecordingDynamicCache:
    """For rows ``0..n-1``, every token from the first: nothing cached is visible,
    so this is the model's own prefill (its masks, its fused causal kernel) on a
    config-less ``DynamicCache`` (every token kept on sliding layers too), each
    layer's K/V written to the prompt buffer and not kept (no second copy)."""
    return RecordingDynamicCache(writer.write, keep=False)


def visible(rows: torch.Tensor, total: int, window: int | None) -> torch.Tensor:
    """Bool ``[len(rows), total]``: which keys each computed row may attend to."""
    keys = torch.arange(total, device=rows.device)
    mask = keys[None, :] <= rows[:, None]
    if window is not None:
        mask &= keys[None, :] > rows[:, None] - window
    return mask


def additive_masks(
    layout: ModelLayout,
    rows: torch.Tensor,
    total: int,
    dtype: torch.dtype,
    skip: set[str] | frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """One 4D additive mask ``[1, 1, rows, total]`` per layer type (sdpa and eager
    take it), but for the types in ``skip``."""
    masks = {}
    for layer_type, window in dict(zip(layout.layer_types, layout.windows)).items():
        if layer_type in skip:
            continue
        seen = visible(rows, total, window)
        mask = torch.zeros(seen.shape, dtype=dtype, device=rows.device)
        masks[layer_type] = mask.masked_fill_(~seen, torch.finfo(dtype).min)[None, None]
    return masks


@torch.no_grad()
def run_tokens(
    lm: Any,
    layout: ModelLayout,
    kv: PromptKV,
    rows: torch.Tensor,
    on_update: OnUpdate | None = None,
    stop_after: int | None = None,
) -> torch.Tensor | None:
    """Compute the tokens at sequence indices ``rows`` over ``kv`` with the model's forward.

    Args:
        lm: the causal LM.
        layout: its :class:`ModelLayout`.
        kv: the prompt buffer; computed tokens' K/V are written into it in place.
        rows: sorted sequence indices to compute; the last one's logits are returned.
        on_update: optional per-layer plug-in (see :data:`OnUpdate`).
        stop_after: end the forward once this layer has written its K/V.

    Returns:
        float32 logits ``[vocab]`` of the last row, or None when stopped early.
    """
    if layout.reuse_refused:
        raise UnsupportedModelError(layout.reuse_refused)
    rows = rows.to(kv.device)
    if kv.home is not None and on_update is None and stop_after is None:
        logits = kv.home.tail(lm, kv, rows)  # a short tail over a static bucket: its graph
        if logits is not None:
            return logits
    # A row depends only on earlier rows, so a large scattered set can run as
    # blocks in sequence order, each over keys up to its own last row: less
    # masked-out attention than one rectangle. Two blocks: more would cost more
    # in smaller matmuls than they save (blend@0.15, 3k tokens, CPU). A plug-in
    # that selects across all rows (blend's check layer) needs them in one pass.
    blocks = _BLOCKS if on_update is None and rows.numel() >= _BLOCK_MIN_ROWS else 1
    logits = None
    for part in rows.tensor_split(blocks):
        if part.numel():
            logits = _forward(lm, layout, kv, part, on_update, stop_after)
    return logits


_BLOCKS = 2
_BLOCK_MIN_ROWS = 128


@torch.no_grad()
def prefill(lm: Any, layout: ModelLayout, kv: PromptKV) -> torch.Tensor:
    """The model's own prefill of every token of ``kv`` in one forward (its masks,
    its causal kernel), each layer's K/V written into ``kv`` and not kept
    elsewhere; float32 logits of the last token. Full prefill into a buffer laid
    out in advance (a static decode's bucket)."""
    if layout.reuse_refused:
        raise UnsupportedModelError(layout.reuse_refused)
    every = torch.arange(kv.num_tokens, device=kv.device)
    logits = _forward(lm, layout, kv, every, None, None)
    assert logits is not None
    return logits


def _forward(
    lm: Any,
    layout: ModelLayout,
    kv: PromptKV,
    rows: torch.Tensor,
    on_update: OnUpdate | None,
    stop_after: int | None,
) -> torch.Tensor | None:
    writer = _BufferWriter(kv, rows, on_update, stop_after)
    if writer.end == rows.numel():  # rows are 0..n-1: a plain prefill
        cache, mask, lower_right = _whole_prefix_cache(writer), None, False
    else:
        cache = PromptCache(writer)
        mask, lower_right = _masks(lm, layout, rows, writer.end, kv.dtype)
    try:
        with lower_right_forward(lm) if lower_right else nullcontext():
            out = lm(
                input_ids=kv.input_ids.to(rows.device)[rows][None],
                position_ids=kv.positions.to(rows.device)[rows][None],
                attention_mask=mask,
                **cache_argument(lm, cache),
                use_cache=True,
                logits_to_keep=1,
            )
    except StopForward:
        return None
    return out.logits[0, -1].float()


def _masks(
    lm: Any, layout: ModelLayout, rows: torch.Tensor, end: int, dtype: torch.dtype
) -> tuple[Any, bool]:
    """The forward's ``attention_mask`` and whether any layer type runs lower-right.

    Rows ``end-n..end-1`` (a contiguous tail) see exactly the keys at indices <=
    their own: lower-right causal, unless a layer's window cuts in (some row
    farther than its window from key 0): that type keeps its additive mask.
    """
    n = rows.numel()
    tail = end - n == int(rows[0])  # rows are sorted and distinct
    exact = {t for t, w in zip(layout.layer_types, layout.windows) if w is None or w >= end}
    if not (tail and exact and can_take(lm)):
        return model_mask(additive_masks(layout, rows, end, dtype)), False
    masks = additive_masks(layout, rows, end, dtype, skip=exact)
    for layer_type in exact:
        masks[layer_type] = placeholder(n, end, dtype, rows.device)
    return model_mask(masks), True
