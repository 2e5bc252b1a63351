"""Tokens' K/V in and out of vLLM's paged cache, laid out as its attention backend lays them.

vLLM hands a connector each layer's cache as a ``[blocks, kv_heads, block_size,
content]`` view, but inside a block the backend packs keys and values its own
way (the CPU backend stores a head's keys transposed, ``[head_dim, block]``,
then its values ``[block, head_dim]``; CUDA backends differ again). Rather than
assume one packing:

- writing goes through the backend's own write op (``do_kv_cache_update``, the
  one vLLM calls for the tokens it computes), so stored K/V land exactly where
  computed ones would;
- reading uses a map from (token, head, dim) to a position in the block, found
  once by writing known values into a one-block scratch cache with that same
  op (``PagedLayout.probe``), so reading is the exact inverse of writing, on
  any backend that has the op.

Slots are ``block_id * block_size + offset`` in the scheduler's blocks; a
backend whose kernel blocks are smaller than the scheduler's splits each block
into consecutive kernel blocks, so the same slot numbers address both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvrag_integrations.errors import PagedLayoutError

_DIGIT = 16  # probe values per pass: exact in every float dtype, bfloat16 included


@dataclass(frozen=True)
class PagedLayout:
    """Where each (token, head, dim) of one block sits, for keys and for values.

    Attributes:
        block_size: tokens per (kernel) block.
        key_pos, value_pos: ``[block_size, kv_heads, head_dim]`` flat positions in
            a block's ``[kv_heads, block_size, content]`` elements.
    """

    block_size: int
    key_pos: torch.Tensor
    value_pos: torch.Tensor

    @classmethod
    def probe(cls, layer: Any, kv_cache: torch.Tensor, head_dim: int) -> PagedLayout:
        """Find the packing by writing known values with ``layer``'s own write op.

        Raises:
            PagedLayoutError: the cache is not a 4D per-layer view, the layer has
                no write op, or what the op wrote is not one place per value.
        """
        if kv_cache.dim() != 4:
            raise PagedLayoutError(
                f"expected a [blocks, kv_heads, block_size, content] cache, got "
                f"{tuple(kv_cache.shape)}"
            )
        impl = getattr(layer, "impl", None)
        if not hasattr(impl, "do_kv_cache_update"):
            raise PagedLayoutError(f"{type(impl).__name__} has no do_kv_cache_update")
        _, heads, block, _ = kv_cache.shape
        grid = torch.meshgrid(
            torch.arange(block), torch.arange(heads), torch.arange(head_dim), indexing="ij"
        )
        # Each coordinate is written digit by digit (values 1.._DIGIT, keys
        # positive, values negative), so every probe value is exact in the cache's
        # dtype; the digits read back give each element's coordinate.
        found = torch.zeros((3, heads * block * kv_cache.shape[3]), dtype=torch.long)
        kinds = torch.zeros(heads * block * kv_cache.shape[3], dtype=torch.long)
        for axis, coord in enumerate(grid):
            size = (block, heads, head_dim)[axis]
            scale = 1
            while scale < max(size, 2):
                digit = ((coord // scale) % _DIGIT + 1).to(kv_cache.dtype)
                scratch = torch.zeros((1, *kv_cache.shape[1:]), dtype=kv_cache.dtype).to(
                    kv_cache.device
                )
                slots = torch.arange(block, device=kv_cache.device)
                impl.do_kv_cache_update(
                    layer, digit.to(kv_cache.device), (-digit).to(kv_cache.device), scratch, slots
                )
                flat = scratch.reshape(-1).float().cpu().round().long()
                kinds = torch.where(flat != 0, flat.sign(), kinds)
                found[axis] += (flat.abs() - 1).clamp(min=0) * scale
                scale *= _DIGIT
        key_pos = _positions(found, kinds == 1, (block, heads, head_dim))
        value_pos = _positions(found, kinds == -1, (block, heads, head_dim))
        return cls(block, key_pos, value_pos)

    def read(
        self, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[n, kv_heads, head_dim]`` of the tokens at ``slots``."""
        device = kv_cache.device
        slots = slots.to(device=device, dtype=torch.long)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        unique, which = torch.unique(blocks, return_inverse=True)
        flat = kv_cache[unique].reshape(unique.numel(), -1)  # each block once
        n, shape = slots.numel(), tuple(self.key_pos.shape[1:])
        rows = which.unsqueeze(1)
        out = []
        for pos in (self.key_pos, self.value_pos):
            picked = flat[rows, pos.to(device)[offsets].reshape(n, -1)]
            out.append(picked.reshape(n, *shape).cpu())
        return out[0], out[1]


def _positions(
    found: torch.Tensor, mask: torch.Tensor, shape: tuple[int, int, int]
) -> torch.Tensor:
    """``[block, heads, head_dim]`` -> flat position, from the probed coordinates."""
    pos = torch.full(shape, -1, dtype=torch.long)
    where = mask.nonzero().squeeze(1)
    t, h, d = (found[axis, where] for axis in range(3))
    pos[t, h, d] = where
    block, heads, head_dim = shape
    if int(where.numel()) != block * heads * head_dim or bool((pos < 0).any()):
        raise PagedLayoutError(
            "the attention backend's write op does not put each token's K/V in one place "
            "per block: the connector cannot read this cache"
        )
    return pos


def write(
    layer: Any,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """Write ``keys`` / ``values`` ``[n, kv_heads, head_dim]`` at ``slots`` with the
    layer's own write op (where vLLM writes the tokens it computes)."""
    device = kv_cache.device
    layer.impl.do_kv_cache_update(
        layer,
        keys.to(device=device, dtype=kv_cache.dtype).contiguous(),
        values.to(device=device, dtype=kv_cache.dtype).contiguous(),
        kv_cache,
        slots.to(device=device, dtype=torch.long),
    )
