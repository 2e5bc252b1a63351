"""The unit of reuse: one chunk's KV cache, encoded alone from position 0.

Framework-free (torch only): the engine makes ``ChunkKV`` entries and the stores
keep them, and neither imports the other through this module.

A ``ChunkKV`` holds its K/V in *storage form* (see :data:`PRECISIONS`): float
(float32, float16 or bfloat16), or int8 KIVI-style (uint8 codes with float16
scales and zero points: keys per channel, values per token). ``to(device, dtype)``
gives float K/V in the compute dtype.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

# The layout of stored caches; part of every model fingerprint and of every
# encoded entry. Bump it when either changes: old entries then miss.
FORMAT_VERSION = "kvrag-chunk-v3"

# The metadata field where framework adapters record a chunk's cache key.
CACHE_KEY_FIELD = "kvrag_cache_key"

# How chunk caches are stored (``KVRAGEngine(cache_precision=...)``): "model" keeps
# the compute dtype (full precision).
PRECISIONS = ("float16", "bfloat16", "int8", "model")
# Every entry point's default (both engines, the CLI, the server): half the bytes of
# float32 at no measurable cost in answers (docs/benchmarks.md, "quality").
DEFAULT_PRECISION = "float16"

# The largest finite float16; a larger magnitude would become inf.
FLOAT16_MAX = 65504.0

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The tensors an int8 entry carries beside its codes (the codec stores them too).
QUANT_NAMES = ("key_scale", "key_zero", "value_scale", "value_zero")


def cache_key(fingerprint: str, token_ids: torch.Tensor | list[int]) -> str:
    """Return the store key of a chunk: sha256 over the fingerprint and ids.

    The key never contains user text, so it is safe as a file name or Redis key.

    Examples:
        >>> cache_key("fp", [1, 2, 3])[:12]
        '8a3b917b34bd'
    """
    ids = token_ids
    # Keys are computed per request and chunk: no torch op for ids already in form.
    if not (isinstance(ids, torch.Tensor) and ids.dtype == torch.int64 and not ids.is_cuda):
        ids = torch.as_tensor(ids, dtype=torch.int64).cpu()
    ids = ids.contiguous()
    digest = hashlib.sha256()
    digest.update(fingerprint.encode("utf-8"))
    digest.update(b"\x00")
    digest.update(ids.numpy().astype("<i8").tobytes())
    return digest.hexdigest()


def check_precision(precision: str) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else ``ValueError``."""
    if precision not in PRECISIONS:
        raise ValueError(f"cache_precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


def storage_fingerprint(model_fingerprint: str, precision: str, context: str = "") -> str:
    """The fingerprint chunk caches are keyed and checked by: the model's plus the
    storage precision and the encoding context (empty: chunks encoded alone), so
    engines that store differently never read each other's entries.

    Examples:
        >>> storage_fingerprint("abc", "int8")
        'abc+kv-int8'
        >>> storage_fingerprint("abc", "float16", "sink:1")
        'abc+kv-float16+ctx-sink:1'
    """
    base = f"{model_fingerprint}+kv-{check_precision(precision)}"
    return f"{base}+ctx-{context}" if context else base


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ChunkKV:
    """Per-layer keys and values of one chunk, prefilled alone from position 0
    (or behind its engine's encoding context, whose rows are not kept: see
    ``ChunkCaches``; the context is part of ``fingerprint``).

    Attributes:
        token_ids: int64 tensor ``[n]``: the chunk's own token ids.
        keys: ``[layers, kv_heads, n, head_dim]``, RoPE applied at positions 0..n-1:
            float, or uint8 codes when quantized.
        values: same shape as ``keys`` (and the same dtype).
        fingerprint: the fingerprint that made it (the engine's storage
            fingerprint: model and precision, see :func:`storage_fingerprint`).
        key_scale, key_zero: int8 entries only: float16 ``[layers, kv_heads, 1,
            head_dim]``, one per channel over the chunk's tokens.
        value_scale, value_zero: int8 entries only: float16 ``[layers, kv_heads, n,
            1]``, one per token over the head dim.
    """

    token_ids: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    fingerprint: str
    key_scale: torch.Tensor | None = None
    key_zero: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None
    value_zero: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # Per-layer views by row count (``layer_rows``) and the key, made once
        # and kept with the entry: not fields, not compared.
        object.__setattr__(self, "_layer_rows", {})
        if self.keys.shape != self.values.shape or self.keys.dim() != 4:
            raise ValueError(
                f"keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} "
                "must both be [layers, kv_heads, tokens, head_dim]"
            )
        if self.token_ids.dim() != 1 or self.token_ids.numel() != self.keys.shape[2]:
            raise ValueError("token_ids must be 1-D with one id per cached position")
        quant = [getattr(self, name) for name in QUANT_NAMES]
        if all(q is None for q in quant):
            if self.keys.dtype not in _FLOAT_DTYPES or self.values.dtype != self.keys.dtype:
                raise ValueError(
                    f"float keys/values must share a float dtype, got "
                    f"{self.keys.dtype}/{self.values.dtype}"
                )
            return
        if any(q is None for q in quant):
            raise ValueError(f"a quantized entry needs all of {', '.join(QUANT_NAMES)}")
        if self.keys.dtype != torch.uint8 or self.values.dtype != torch.uint8:
            raise ValueError("quantized keys/values must be uint8 codes")
        layers, heads, n, dim = self.keys.shape
        expected = {
            "key_scale": (layers, heads, 1, dim),
            "key_zero": (layers, heads, 1, dim),
            "value_scale": (layers, heads, n, 1),
            "value_zero": (layers, heads, n, 1),
        }
        for name, shape in expected.items():
            q = getattr(self, name)
            if q.dtype != torch.float16 or tuple(q.shape) != shape:
                raise ValueError(
                    f"{name} must be float16 {list(shape)}, got {q.dtype} {list(q.shape)}"
                )

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def key(self) -> str:
        """The store key: ``cache_key(fingerprint, token_ids)`` (computed once: every
        store read checks it, and an entry's fields never change)."""
        key = self.__dict__.get("_key")
        if key is None:
            key = cache_key(self.fingerprint, self.token_ids)
            object.__setattr__(self, "_key", key)
        return key

    @property
    def is_quantized(self) -> bool:
        return self.key_scale is not None

    @property
    def precision(self) -> str:
        """The storage form: ``"int8"``, or the float dtype's name (``"float16"``...)."""
        return "int8" if self.is_quantized else dtype_name(self.keys.dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor held, by name (the quantization ones only when quantized)."""
        named = {"token_ids": self.token_ids, "keys": self.keys, "values": self.values}
        if self.is_quantized:
            named.update({name: getattr(self, name) for name in QUANT_NAMES})
        return named

    @property
    def nbytes(self) -> int:
        """Bytes really held: codes, scales and zero points, and token ids."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Float ``(keys, values)`` in ``dtype`` (computed in float32, then cast)."""
        if not self.is_quantized:
            return self.keys.to(dtype), self.values.to(dtype)
        keys = self.keys.float() * self.key_scale.float() + self.key_zero.float()
        values = self.values.float() * self.value_scale.float() + self.value_zero.float()
        return keys.to(dtype), values.to(dtype)

    def layer_rows(self, rows: int) -> dict[str, tuple[torch.Tensor, ...]]:
        """Every stored tensor's first ``rows`` token rows, split per layer (views).

        ``{"keys": (layer 0, layer 1, ...), "values": ...}``, each ``[kv_heads,
        rows, head_dim]``; an int8 entry adds its scales and zero points, the keys'
        (one per channel) expanded to ``rows``. Made once per entry and row count
        and kept with it: assembling layer ``l`` of many chunks is then one ``cat``
        over these, with no op per chunk (a prompt reads an entry's rows with or
        without its chunk suffix: at most two row counts per entry).
        """
        cached = self._layer_rows.get(rows)  # type: ignore[attr-defined]
        if cached is not None:
            return cached
        if not 0 <= rows <= self.num_tokens:
            raise ValueError(f"rows must be in [0, {self.num_tokens}], got {rows}")
        full = rows == self.num_tokens
        out = {}
        for name, t in self.tensors().items():
            if name == "token_ids":
                continue
            if name in ("key_scale", "key_zero"):
                t = t.expand(-1, -1, rows, -1)
            elif not full:
                t = t[:, :, :rows]
            out[name] = t.unbind(0)
        self._layer_rows[rows] = out  # type: ignore[attr-defined]
        return out

    def pin_memory(self) -> ChunkKV:
        """A copy in page-locked host memory (self if pinned or not on the CPU): a
        CUDA engine copies it to the device asynchronously (``non_blocking``)."""
        if self.keys.device.type != "cpu" or self.keys.is_pinned():
            return self
        pinned = {n: t.pin_memory() for n, t in self.tensors().items() if n != "token_ids"}
        return ChunkKV(self.token_ids, fingerprint=self.fingerprint, **pinned)

    def to(
        self,
        device: torch.device | str,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
    ) -> ChunkKV:
        """Return a copy on ``device``, or self if unchanged.

        With ``dtype`` the copy holds float K/V in it (an int8 entry is
        dequantized on ``device``); without, the storage form is kept.
        ``non_blocking``: copies from pinned memory to a CUDA device return at
        once (the device's stream orders them before any use there).
        """
        device = torch.device(device)
        here = _same_device(self.keys.device, device)
        if self.is_quantized:
            if dtype is None and here:
                return self
            moved = {
                n: t.to(device, non_blocking=non_blocking)
                for n, t in self.tensors().items()
                if n != "token_ids"
            }
            on_device = ChunkKV(self.token_ids.cpu(), fingerprint=self.fingerprint, **moved)
            if dtype is None:
                return on_device
            keys, values = on_device.dequantize(dtype)
            return ChunkKV(self.token_ids.cpu(), keys, values, self.fingerprint)
        dtype = dtype or self.keys.dtype
        if here and self.keys.dtype == dtype:
            return self
        return ChunkKV(
            token_ids=self.token_ids.cpu(),
            keys=self.keys.to(device=device, dtype=dtype, non_blocking=non_blocking),
            values=self.values.to(device=device, dtype=dtype, non_blocking=non_blocking),
            fingerprint=self.fingerprint,
        )

    def stored_as(self, precision: str) -> ChunkKV:
        """This entry in storage form ``precision`` (one of :data:`PRECISIONS`).

        ``"model"`` keeps it as it is. ``"float16"`` falls back to bfloat16 when any
        value exceeds the float16 range: the cast would turn it into inf, which
        attention turns into NaN for the whole prompt; bfloat16 has float32's range
        (at a coarser mantissa). ``"int8"`` falls back the same way when a zero
        point would not fit its float16.
        """
        check_precision(precision)
        if precision == "model":
            return self
        if self.is_quantized:
            raise ValueError("an int8 entry cannot be stored in another precision")
        if precision == "bfloat16":
            return self.to(self.keys.device, torch.bfloat16)
        if _exceeds_float16(self.keys) or _exceeds_float16(self.values):
            return self.to(self.keys.device, torch.bfloat16)
        if precision == "float16":
            return self.to(self.keys.device, torch.float16)
        key_codes, key_scale, key_zero = quantize_uint8(self.keys, dim=2)
        value_codes, value_scale, value_zero = quantize_uint8(self.values, dim=3)
        return ChunkKV(
            token_ids=self.token_ids,
            keys=key_codes,
            values=value_codes,
            fingerprint=self.fingerprint,
            key_scale=key_scale,
            key_zero=key_zero,
            value_scale=value_scale,
            value_zero=value_zero,
        )


def _same_device(have: torch.device, want: torch.device) -> bool:
    """``have`` is ``want`` (``"cuda"`` without an index is the current CUDA device)."""
    if have == want:
        return True
    if have.type != want.type or want.index is not None or want.type != "cuda":
        return False
    return have.index == torch.cuda.current_device()


def _exceeds_float16(x: torch.Tensor) -> bool:
    return x.numel() > 0 and bool(x.detach().abs().amax().float() > FLOAT16_MAX)


def _round_half(x: torch.Tensor, up: bool) -> torch.Tensor:
    """``x`` (float32) as float16, rounded towards +inf (``up``) or -inf."""
    half = x.half()
    toward = torch.full_like(half, float("inf") if up else float("-inf"))
    wrong = half.float() < x if up else half.float() > x
    return torch.where(wrong, torch.nextafter(half, toward), half)


def quantize_uint8(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric uint8 codes of ``x`` with one float16 scale and zero point per slice
    reduced over ``dim``: ``x ~= codes * scale + zero``.

    The zero point is the minimum rounded down to float16 and the scale the range
    over 255 rounded up, so every value lies in ``[zero, zero + 255 * scale]`` and
    is reconstructed within ``scale / 2`` (plus float rounding).

    Returns:
        ``(codes, scale, zero)``; ``scale`` and ``zero`` keep ``dim`` with size 1.
    """
    x = x.detach().float()
    if x.shape[dim] == 0:
        shape = list(x.shape)
        shape[dim] = 1
        ones = torch.ones(shape, dtype=torch.float16, device=x.device)
        return x.to(torch.uint8), ones, torch.zeros_like(ones)
    zero = _round_half(x.amin(dim=dim, keepdim=True), up=False)
    spread = x.amax(dim=dim, keepdim=True) - zero.float()
    scale = _round_half(spread / 255.0, up=True)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant slice
    codes = ((x - zero.float()) / scale.float()).round_().clamp_(0, 255).to(torch.uint8)
    return codes, scale, zero


__all__ = [
    "CACHE_KEY_FIELD",
    "FLOAT16_MAX",
    "FORMAT_VERSION",
    "PRECISIONS",
    "QUANT_NAMES",
    "ChunkKV",
    "cache_key",
    "check_precision",
    "quantize_uint8",
    "storage_fingerprint",
]
