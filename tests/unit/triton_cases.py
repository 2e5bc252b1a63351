"""The Triton kernel's cases, run by tests/unit/test_filled_attention.py in a
subprocess with ``TRITON_INTERPRET=1`` (Triton reads it as it defines its own
functions, and torch imports Triton early when it is installed), printing one
JSON object: each case's largest difference from SDPA and whether its output
is finite (the slots past the last row hold NaN: never read).

Run alone: ``TRITON_INTERPRET=1 python -m tests.unit.triton_cases``.
"""

from __future__ import annotations

import dataclasses
import json

import torch

# heads, kv heads, head size, rows, bucket length, first row's slot
SHAPES = [
    (4, 2, 16, 1, 64, 10),  # a decode step, GQA 2
    (8, 2, 64, 1, 512, 300),  # GQA 4, several splits
    (6, 6, 32, 3, 128, 70),  # no grouping, three rows
    (12, 4, 96, 17, 512, 200),  # a head size that is not a power of two, a tail
    (4, 1, 128, 1, 1024, 1023),  # the last slot (multi-query)
    (8, 8, 16, 16, 64, 0),  # rows from slot 0
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (each launch takes ~0.4 s interpreted: bfloat16 on the shapes that differ most)
CASES = [(shape, "fp32") for shape in SHAPES] + [(SHAPES[i], "bf16") for i in (1, 3, 4)]


def case_id(shape: tuple, dtype: str) -> str:
    return "-".join(map(str, shape)) + f"-{dtype}"


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """SDPA per row over exactly its keys (float64, K/V repeated per query group)."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(groups, 1) for x in (k, v))
    rows = [
        torch.nn.functional.scaled_dot_product_attention(
            q[:, :, t : t + 1].double(), k[:, :, : s + 1], v[:, :, : s + 1]
        )
        for t, s in enumerate(slots)
    ]
    return torch.cat(rows, 2).transpose(1, 2)  # [1, T, heads, d]


def case(shape: tuple, dtype: torch.dtype, poison: bool) -> tuple:
    """``(q [1, heads, T, d] as transformers passes it, k, v, slots)``; ``poison``:
    NaN in every slot past the last row's."""
    heads, kv_heads, dim, rows, length, first = shape
    gen = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(1, rows, heads, dim, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(1, kv_heads, length, dim, generator=gen).to(dtype)
    v = torch.randn(1, kv_heads, length, dim, generator=gen).to(dtype)
    slots = list(range(first, first + rows))
    if poison:
        k[:, :, first + rows :] = float("nan")
        v[:, :, first + rows :] = float("nan")
    return q, k, v, slots


def kernel_cases() -> dict[str, dict]:
    from kvrag_integrations.engine.modeling import triton_attention

    out = {}
    for shape, name in CASES:
        q, k, v, slots = case(shape, DTYPES[name], poison=True)
        got = triton_attention.filled_attention_triton(
            q, k, v, torch.tensor(slots), q.shape[-1] ** -0.5
        )
        want = reference(q, k.nan_to_num(), v.nan_to_num(), slots)
        out[case_id(shape, name)] = {
            "supported": triton_attention.supports(q, k, v),
            "dtype_shape": [str(got.dtype), list(got.shape)],
            "max_diff": (got.double() - want).abs().max().item(),
            "finite": bool(torch.isfinite(got).all()),
        }
    return out


def engine_case() -> dict:
    """The static decode through the kernel (``BACKEND="triton"``) on the tiny model:
    turbo's tail and 2 decode steps against the eager path."""
    from kvrag_integrations import KVRAGEngine, MemoryKVStore
    from kvrag_integrations.engine.modeling import filled_attention
    from kvrag_integrations.engine.modeling.static_decode import StaticDecoder
    from tests.unit.conftest import smollm2_tokenizer, tiny_llama

    loaded = tiny_llama(smollm2_tokenizer())
    fast = dataclasses.replace(loaded)
    fast.decoder = StaticDecoder(fast.layout, buckets=(128, 256), devices=("cpu",))
    kw = dict(store=MemoryKVStore(), on_miss="encode", cache_precision="model")
    request = dict(question="Who built the tower?", chunks=["The tower was built by Bob."],
                   strategy="turbo", max_new_tokens=3, min_new_tokens=3)  # fmt: skip
    want = KVRAGEngine(loaded, **kw).generate(**request)
    filled_attention.BACKEND = "triton"
    calls = []
    real = filled_attention._load_kernel().filled_attention_triton

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)

    filled_attention._kernel.filled_attention_triton = counted
    got = KVRAGEngine(fast, **kw).generate(**request)
    steps = sorted(next(iter(fast.decoder.store.held.values())).steps)
    return {
        "same_tokens": got.token_ids == want.token_ids and len(want.token_ids) == 3,
        "first_logits_diff": (got.first_token_logits - want.first_token_logits).abs().max().item(),
        "kernel_calls": len(calls),
        "steps": steps,
        "path": fast.decoder.last,
    }


if __name__ == "__main__":
    print(json.dumps({"kernel": kernel_cases(), "engine": engine_case()}))
