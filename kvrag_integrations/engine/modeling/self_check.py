"""Exact or refused: at load, reuse must reproduce the model's own forward.

The engine reaches into transformers' extension points (``engine.modeling.hf_compat``),
and a new transformers or torch release can change one of them so that reuse
runs but answers wrongly. :func:`check_reuse` catches that on the user's own
model before any request: a few dozen tokens, a leading chunk's cache (turbo is
exact there: the chunk is the prompt's own prefix) and the text after it
computed over the prompt cache, then one decoding step, each compared with the
model's own forward of the whole sequence (three forwards in all). The forwards
run through the first few decoder layers only (the shortest prefix with every
layer type, at least two) and score the first 1024 tokens of the vocabulary:
every layer goes through the same extension points, and on a CPU a full-depth,
full-vocabulary check would cost a third of the load. Anything that disagrees beyond
the dtype's rounding, or raises, is an ``UnsupportedModelError`` naming the
versions; ``strategy="full"`` does not use any of it and still works.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import torch

from kvrag_integrations.engine.modeling.forward import PromptKV, run_tokens
from kvrag_integrations.engine.modeling.generate import to_dynamic_cache
from kvrag_integrations.engine.modeling.hf_compat import (
    DynamicCache,
    cache_argument,
    cache_layers,
    output_cache,
    shallow_model,
    versions,
)
from kvrag_integrations.engine.modeling.layout import ModelLayout
from kvrag_integrations.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

CHUNK_TOKENS = 24
TEXT_TOKENS = 12
VOCAB = 1024  # logits compared over the first VOCAB tokens

# Largest |reuse - reference| allowed, as a fraction of the reference logits'
# largest magnitude: float rounding of a different kernel path stays orders of
# magnitude below it (float32 ~1e-6, bfloat16 ~1e-2 on real models), a cache
# that loses or misplaces K/V lands far above it.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 6e-2}


@torch.no_grad()
def check_reuse(lm: Any, layout: ModelLayout, *, seed: int = 0) -> float:
    """Turbo with a leading chunk, and a decoding step after it, against the model's forward.

    Returns:
        the larger relative logit error of the two comparisons.

    Raises:
        UnsupportedModelError: reuse disagrees with the model's own forward, or
            raises inside it (named with the transformers and torch versions).
    """
    started = time.perf_counter()
    depth = check_depth(layout)
    with shallow_model(lm, depth, VOCAB):
        error = _compare(lm, replace(layout, num_layers=depth), seed)
    logger.debug(
        "reuse self-check passed over %d layers: error %.2e in %.1f ms",
        depth,
        error,
        (time.perf_counter() - started) * 1e3,
    )
    return error


def check_depth(layout: ModelLayout) -> int:
    """The first layers the check runs: a prefix holding every layer type, >= 2."""
    first = {t: layout.layer_types.index(t) for t in layout.layer_types}
    return min(layout.num_layers, max(2, 1 + max(first.values())))


def _compare(lm: Any, layout: ModelLayout, seed: int) -> float:
    device = lm.device
    dtype = next(lm.parameters()).dtype
    vocab = min(VOCAB, int(lm.config.vocab_size))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (CHUNK_TOKENS + TEXT_TOKENS + 1,), generator=gen)
    prompt, extra = ids[:-1], ids[-1:]
    n = int(prompt.numel())
    try:
        out = lm(
            input_ids=ids[None].to(device),
            use_cache=True,
            logits_to_keep=2,
            **cache_argument(lm, DynamicCache()),
        )
        reference = out.logits[0].float()
        # The chunk's K/V as the model computed them: a causal prefix is encoded
        # alone, so they are what encoding the chunk would store.
        kv = PromptKV.empty(layout, torch.arange(n), prompt, dtype, device)
        for layer, (keys, values) in enumerate(cache_layers(output_cache(out))):
            kv.keys[layer][:, :CHUNK_TOKENS] = keys[0, :, :CHUNK_TOKENS]
            kv.values[layer][:, :CHUNK_TOKENS] = values[0, :, :CHUNK_TOKENS]
        prefill = run_tokens(lm, layout, kv, torch.arange(CHUNK_TOKENS, n))
        step = lm(
            input_ids=extra[None].to(device),
            position_ids=torch.tensor([[n]], device=device),
            use_cache=True,
            logits_to_keep=1,
            **cache_argument(lm, to_dynamic_cache(kv)),
        ).logits[0, -1]
    except UnsupportedModelError:
        raise
    except Exception as exc:  # a release that moved an extension point
        raise _refusal(f"reuse raised {type(exc).__name__}: {exc}") from exc
    if prefill is None:
        raise _refusal("reuse returned no logits")
    scale = float(reference.abs().max().clamp_min(1e-6))
    error = max(
        float((prefill - reference[0]).abs().max()) / scale,
        float((step.float() - reference[1]).abs().max()) / scale,
    )
    tolerance = TOLERANCE.get(dtype, 6e-2)
    if not error <= tolerance:  # NaN fails too
        raise _refusal(
            f"reuse differs from the model's own forward by {error:.2e} of the logits' scale "
            f"(tolerance {tolerance:.0e} for {dtype})"
        )
    return error


def _refusal(why: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"KV reuse failed its load-time self-check on this model ({why}) with {versions()}; "
        "this combination is not supported for reuse (see docs/troubleshooting.md for the "
        'tested versions); strategy="full" (plain prefill, no reuse) still works'
    )
