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
  any backend that has the op;
- where that map is affine (the CPU backend's is) and the op, tried on random
  values, is a plain copy to those places, a load's whole blocks are written
  by one strided copy per layer side (``PagedLayout.write``): the op's
  per-token loop costs 2-3x more over thousands of tokens. Partial blocks,
  and every write elsewhere, go through the op.

Slots are ``block_id * block_size + offset`` in the scheduler's blocks; a
backend whose kernel blocks are smaller than the scheduler's splits each block
into consecutive kernel blocks, so the same slot numbers address both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from kvrag_integrations.errors import PagedLayoutError

_DIGIT = 16  # probe values per pass: exact in every float dtype, bfloat16 included
Strides = tuple[int, int, int, int]  # offset, then token, head and dim strides in a block
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(name: str) -> int:
    """The decoder layer of an attention layer's name (``model.layers.3.self_attn.attn``):
    how vLLM names each layer's paged cache."""
    match = _LAYER_INDEX.search(name)
    if match is None:
        raise ValueError(f"cannot tell the decoder layer of {name!r}")
    return int(match.group(1))


@dataclass(frozen=True)
class PagedLayout:
    """Where each (token, head, dim) of one block sits, for keys and for values.

    Attributes:
        block_size: tokens per (kernel) block.
        key_pos, value_pos: ``[block_size, kv_heads, head_dim]`` flat positions in
            a block's ``[kv_heads, block_size, content]`` elements.
        direct: ``(offset, token stride, head stride, dim stride)`` of keys and of
            values in a block, where the op is a plain copy to affine places
            (whole blocks are then written by strided copies); None: the op only.
    """

    block_size: int
    key_pos: torch.Tensor
    value_pos: torch.Tensor
    direct: tuple[Strides, Strides] | None = None

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
        layout = cls(block, key_pos, value_pos)
        keys, values = _affine(key_pos), _affine(value_pos)
        if keys is None or values is None:
            return layout
        direct = cls(block, key_pos, value_pos, (keys, values))
        return direct if direct._copies_as_the_op(layer, kv_cache) else layout

    def _copies_as_the_op(self, layer: Any, kv_cache: torch.Tensor) -> bool:
        """Whether a strided write of random K/V leaves a block exactly as the op does
        (not so for an op that scales or quantizes: the direct path is then off)."""
        _, heads, block, content = kv_cache.shape
        shape = (block, heads, self.key_pos.shape[2])
        generator = torch.Generator().manual_seed(0)
        keys, values = (torch.randn(shape, generator=generator) for _ in range(2))
        keys, values = (t.to(device=kv_cache.device, dtype=kv_cache.dtype) for t in (keys, values))
        by_op, by_copy = (
            torch.zeros((2, heads, block, content), dtype=kv_cache.dtype, device=kv_cache.device)
            for _ in range(2)
        )
        slots = torch.arange(block, 2 * block, device=kv_cache.device)  # the second block
        layer.impl.do_kv_cache_update(layer, keys, values, by_op, slots)
        self._copy_blocks(by_copy, torch.tensor([1], device=kv_cache.device), keys, values)
        return bool(torch.equal(by_op, by_copy))

    def write(
        self,
        layer: Any,
        kv_cache: torch.Tensor,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Write ``keys`` / ``values`` ``[n, kv_heads, head_dim]`` at ``slots``: the
        whole blocks by strided copies (``direct``), the rest with the op."""
        device, dtype = kv_cache.device, kv_cache.dtype
        keys, values = (t.to(device=device, dtype=dtype).contiguous() for t in (keys, values))
        slots = slots.to(device=device, dtype=torch.long)
        size, n = self.block_size, slots.numel()
        head = -int(slots[0]) % size if n else 0  # tokens before the first block boundary
        count = (n - head) // size if self.direct is not None and kv_cache.is_contiguous() else 0
        body = slots[head : head + count * size].view(count, size)
        whole = body[:, :1] + torch.arange(size, device=device)
        if count == 0 or not (torch.equal(body, whole) and bool((body[:, 0] % size == 0).all())):
            write(layer, kv_cache, slots, keys, values)  # not whole blocks in order: the op
            return
        rows = slice(head, head + count * size)
        self._copy_blocks(kv_cache, body[:, 0] // size, keys[rows], values[rows])
        for part in (slice(0, head), slice(head + count * size, n)):  # partial blocks: the op
            if part.stop > part.start:
                write(layer, kv_cache, slots[part], keys[part], values[part])

    def _copy_blocks(
        self, kv_cache: torch.Tensor, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Keys and values ``[len(blocks) * block_size, kv_heads, head_dim]`` (in the
        cache's dtype) into whole ``blocks`` of a contiguous cache, one copy each."""
        assert self.direct is not None
        count, size = blocks.numel(), self.block_size
        shape = (kv_cache.shape[0], size, *self.key_pos.shape[1:])
        for strides, rows in zip(self.direct, (keys, values)):
            offset, *within = strides
            view = kv_cache.as_strided(
                shape, (kv_cache.stride(0), *within), kv_cache.storage_offset() + offset
            )
            view.index_copy_(0, blocks, rows.reshape(count, *shape[1:]))

    def read(
        self, kv_cache: torch.Tensor, slots: torch.Tensor, *, to_host: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[n, kv_heads, head_dim]`` of the tokens at ``slots``, on
        the host (to store them) or, ``to_host=False``, where the cache is."""
        device = kv_cache.device
        slots = slots.to(device=device, dtype=torch.long)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        unique, which = torch.unique(blocks, return_inverse=True)
        n, shape = slots.numel(), tuple(self.key_pos.shape[1:])
        if self.direct is not None and kv_cache.is_contiguous():
            # whole blocks through strided views, then the rows asked for: one gather
            # of rows, not of every element (a blend reads a run's K/V per layer)
            size = self.block_size
            rows = which * size + offsets
            out = []
            for offset, *within in self.direct:
                view = kv_cache.as_strided(
                    (kv_cache.shape[0], size, *shape),
                    (kv_cache.stride(0), *within),
                    kv_cache.storage_offset() + offset,
                )
                picked = view[unique].reshape(-1, *shape)[rows]
                out.append(picked.cpu() if to_host else picked)
            return out[0], out[1]
        flat = kv_cache[unique].reshape(unique.numel(), -1)  # each block once
        rows = which.unsqueeze(1)
        out = []
        for pos in (self.key_pos, self.value_pos):
            picked = flat[rows, pos.to(device)[offsets].reshape(n, -1)]
            picked = picked.reshape(n, *shape)
            out.append(picked.cpu() if to_host else picked)
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


def _affine(pos: torch.Tensor) -> Strides | None:
    """``pos`` as an offset and non-negative strides, if it is one (else None)."""
    block, heads, dim = pos.shape
    base = int(pos[0, 0, 0])
    strides = (
        int(pos[1, 0, 0]) - base if block > 1 else 0,
        int(pos[0, 1, 0]) - base if heads > 1 else 0,
        int(pos[0, 0, 1]) - base if dim > 1 else 0,
    )
    if min(strides) < 0:
        return None
    grid = torch.meshgrid(*(torch.arange(n) for n in pos.shape), indexing="ij")
    if not torch.equal(pos, base + sum(g * s for g, s in zip(grid, strides))):
        return None
    return (base, *strides)


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
