"""Split-KV attention over the filled part of a static cache, as a Triton kernel.

What ``filled_attention`` runs on CUDA where Triton is importable (and on CPU
under ``TRITON_INTERPRET=1``, how the unit tier tests it). The query rows are
``T`` tokens at ascending cache slots ``slots`` (a device tensor, so a CUDA
graph's shapes stay fixed while the filled length moves); row ``t`` sees the
keys at slots ``0 .. slots[t]``. Nothing past the last row's slot is read: a
bucket's unfilled tail costs memory, not time.

Flash-decoding (the split-KV decode kernels of vLLM, SGLang and LightLLM): one
query token alone cannot fill a GPU, so the filled length is cut into
``splits`` equal parts, each program attends its query tile over one part
(online softmax in float32) and writes its normalized output and log-sum-exp; a
second kernel combines the parts per row. The split length is computed in the
kernel from the last slot: every split does a share of the filled keys, whatever
the bucket. Grouped-query attention: each program takes the query heads of one
K/V head as rows of one tile (``t * groups + g``), so each K/V block is read
once per tile and multiplied as a matrix (``tl.dot``), not once per query head.

Why a kernel of ours: torch's SDPA takes the keys as a tensor of fixed shape,
so over a bucket it reads every slot through a mask (and with a mask no flash
kernel runs); FlexAttention takes a length in a tensor but measured 2.54 ms
per layer against SDPA flash's 0.07 ms for a 32-token tail over 16.5k keys of
the 8B shape (H100, ``../shared/gpu/tail_probe.py``, 2026-11-26), and its
block mask skips unfilled blocks only when rebuilt per length.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["filled_attention_triton", "supports"]

_BLOCK_N = 64
_MAX_SPLITS = 64


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in float32. IEEE: float32 inputs without TF32
    rounding. UPCAST: float32 operands (Triton's interpreter multiplies
    bfloat16 operands wrongly; the values are the same, rounded as on the GPU)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _split_kernel(
    Q, K, V, Slots, PartO, PartL,
    sq_h, sq_t, sk_h, sk_n, sv_h, sv_n, spo_h, spo_m, spo_s, spl_h, spl_m,
    scale, T, M,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    kv_head = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    row_ok = rows < M
    t = rows // G
    head = kv_head * G + rows % G
    limit = tl.load(Slots + t, mask=row_ok, other=0) + 1  # row t sees the keys before
    end = tl.load(Slots + T - 1) + 1
    # Each split's share of the filled keys, whole blocks of BLOCK_N.
    share = ((end + SPLITS - 1) // SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = split * share
    hi = tl.minimum(lo + share, end)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(
        Q + head[:, None] * sq_h + t[:, None] * sq_t + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        k = tl.load(
            K + kv_head * sk_h + offs_n[:, None] * sk_n + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        s = _dot(q, tl.trans(k), IEEE, UPCAST) * scale
        s = tl.where((offs_n[None, :] < limit[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + kv_head * sv_h + offs_n[:, None] * sv_n + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, UPCAST)
        m_i = m_new
    # Every split writes (an empty one: weight 0): the buffers are reused.
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(
        PartO + kv_head * spo_h + rows[:, None] * spo_m + split * spo_s + offs_d[None, :],
        out,
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(PartL + kv_head * spl_h + rows * spl_m + split, lse, mask=row_ok)


@triton.jit
def _combine_kernel(
    PartO, PartL, Out,
    spo_h, spo_m, spo_s, spl_h, spl_m, so_t, so_h, M,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    SPLITS: tl.constexpr,
):  # fmt: skip
    kv_head = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    lse_at = PartL + kv_head * spl_h + rows * spl_m
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(SPLITS):
        top = tl.maximum(top, tl.load(lse_at + s, mask=row_ok, other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(SPLITS):
        w = tl.exp(tl.load(lse_at + s, mask=row_ok, other=float("-inf")) - top)
        part = tl.load(
            PartO + kv_head * spo_h + rows[:, None] * spo_m + s * spo_s + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        total += w
        acc += w[:, None] * part
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    t = rows // G
    head = kv_head * G + rows % G
    tl.store(
        Out + t[:, None] * so_t + head[:, None] * so_h + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes (else the caller's torch fallback runs)."""
    return (
        query.shape[0] == 1
        and key.shape[0] == 1
        and query.shape[1] % key.shape[1] == 0
        and key.shape[-1] == value.shape[-1] == query.shape[-1] <= 256
        and query.dtype == key.dtype == value.dtype
        and query.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and key.stride(-1) == 1
        and value.stride(-1) == 1
        and query.stride(-1) == 1
    )


@functools.cache
def _units(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (4 for the interpreter on CPU)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _splits(programs: int, length: int, device: torch.device) -> int:
    """How many parts the filled length is cut into: enough programs for about
    two per multiprocessor, a power of two, at most one per ``_BLOCK_N`` keys of
    the bucket. Fixed per shape (a graph's launch is fixed)."""
    units = _units(device)
    want = max(1, -(-2 * units // programs))
    cap = max(1, min(_MAX_SPLITS, length // _BLOCK_N))
    return min(triton.next_power_of_2(want), triton.next_power_of_2(cap + 1) // 2)


def filled_attention_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of ``query`` ``[1, heads, T, d]`` over ``key``/``value``
    ``[1, kv_heads, L, d]`` where row ``t`` sees slots ``0 .. slots[t]``;
    returns ``[1, T, heads, d]`` (the layout transformers' attention functions
    return)."""
    _, heads, rows_t, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    m = rows_t * groups
    block_m = 16 if m <= 16 else 64
    tiles = triton.cdiv(m, block_m)
    splits = _splits(kv_heads * tiles, length, query.device)
    block_d = max(16, triton.next_power_of_2(dim))
    part_o = torch.empty((kv_heads, m, splits, dim), dtype=torch.float32, device=query.device)
    part_l = torch.empty((kv_heads, m, splits), dtype=torch.float32, device=query.device)
    out = torch.empty((1, rows_t, heads, dim), dtype=query.dtype, device=query.device)
    ieee = query.dtype == torch.float32  # float32 models: no TF32 rounding in the dots
    upcast = query.device.type == "cpu"  # only under TRITON_INTERPRET
    _split_kernel[(kv_heads, tiles, splits)](
        query, key, value, slots, part_o, part_l,
        query.stride(1), query.stride(2), key.stride(1), key.stride(2),
        value.stride(1), value.stride(2),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l.stride(0), part_l.stride(1),
        float(scale), rows_t, m,
        G=groups, D=dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=_BLOCK_N,
        SPLITS=splits, IEEE=ieee, UPCAST=upcast,
    )  # fmt: skip
    _combine_kernel[(kv_heads, tiles)](
        part_o, part_l, out,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l.stride(0), part_l.stride(1),
        out.stride(1), out.stride(2), m,
        G=groups, D=dim, BLOCK_D=block_d, BLOCK_M=block_m, SPLITS=splits,
    )  # fmt: skip
    return out
