"""The unit of reuse: one chunk's KV cache, encoded alone from position 0."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

# The metadata field where framework adapters record a chunk's cache key.
CACHE_KEY_FIELD = "kvrag_cache_key"


def cache_key(fingerprint: str, token_ids: torch.Tensor | list[int]) -> str:
    """Return the store key of a chunk: sha256 over the model fingerprint and ids.

    The key never contains user text, so it is safe as a file name or Redis key.

    Examples:
        >>> cache_key("fp", [1, 2, 3])[:12]
        '8a3b917b34bd'
    """
    ids = torch.as_tensor(token_ids, dtype=torch.int64).cpu().contiguous()
    digest = hashlib.sha256()
    digest.update(fingerprint.encode("utf-8"))
    digest.update(b"\x00")
    digest.update(ids.numpy().astype("<i8").tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class ChunkKV:
    """Per-layer keys and values of one chunk, prefilled alone from position 0.

    Attributes:
        token_ids: int64 tensor ``[n]``: the chunk's own token ids.
        keys: ``[layers, kv_heads, n, head_dim]``, RoPE applied at positions 0..n-1.
        values: same shape as ``keys``.
        fingerprint: the model fingerprint that made it (see ``engine.model``).
    """

    token_ids: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    fingerprint: str

    def __post_init__(self) -> None:
        if self.keys.shape != self.values.shape or self.keys.dim() != 4:
            raise ValueError(
                f"keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} "
                "must both be [layers, kv_heads, tokens, head_dim]"
            )
        if self.token_ids.dim() != 1 or self.token_ids.numel() != self.keys.shape[2]:
            raise ValueError("token_ids must be 1-D with one id per cached position")

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def key(self) -> str:
        """The store key: ``cache_key(fingerprint, token_ids)``."""
        return cache_key(self.fingerprint, self.token_ids)

    @property
    def nbytes(self) -> int:
        return (
            self.keys.numel() * self.keys.element_size()
            + self.values.numel() * self.values.element_size()
            + self.token_ids.numel() * 8
        )

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> ChunkKV:
        """Return a copy on ``device`` (and ``dtype`` for K/V), or self if unchanged."""
        dtype = dtype or self.keys.dtype
        if self.keys.device == torch.device(device) and self.keys.dtype == dtype:
            return self
        return ChunkKV(
            token_ids=self.token_ids.cpu(),
            keys=self.keys.to(device=device, dtype=dtype),
            values=self.values.to(device=device, dtype=dtype),
            fingerprint=self.fingerprint,
        )
