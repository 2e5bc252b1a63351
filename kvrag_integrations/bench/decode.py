"""Decoding speed at batch 1 after a turbo prefill: the engine beside HF's own ``generate``.

Three columns per length: the engine as it decodes by default (the static
decode, ``engine/modeling/static_decode.py``, where it takes the model and
device: CUDA graphs per bucket on CUDA), the engine with the static decode off
(eager ``DynamicCache`` steps, as before issue 46), and HF's ``generate``. The
engine's column says how it decoded (``static, bucket N, CUDA graph`` or
``eager: why``), each step's last capture in seconds (``8192``: the decode step
of the 8k bucket, ``8192/tail 32``: a prompt tail's) and the decoder's counts
(captures, recaptures, failures, released buckets). On CPU the static decode
is opt-in (``--static-on-cpu`` times it there).

``--filled`` times the decode step alone at several filled lengths inside one
bucket (the smallest holding the longest): ms per step, replayed on CUDA, with
the attention the engine runs (the split-KV kernel where Triton is) and with
masked SDPA over the whole bucket. The kernel's column grows with the filled
length; SDPA's with the bucket.

For each prompt length (chunks of ``chunk_tokens`` tokens after the chat
template, a question after them), ms per decoded token is
``(t(N tokens) - t(1 token)) / (generated - 1)``: the prefill (and TTFT) cancel
out, what is left is the decoding steps. The engine answers with turbo over its
stored chunks (``generate(strategy="turbo")``); HF's own ``generate`` (greedy,
``min_new_tokens`` so it never stops early) runs on the same prompt's token ids,
from its own prefill. Both are medians of ``repeats`` runs after a warm-up.

The ``gpu`` preset is ~4k and ~16k prompt tokens (16 and 64 chunks of 256
tokens) with 65 new tokens: what issue 46 measures (the Llama-3.1-8B shape,
``--dummy-weights``, bfloat16); its files are ``gpu-decode-<model>``.

Examples:
    python -m kvrag_integrations.bench decode --lengths 1024,4096
    python -m kvrag_integrations.bench decode --quick --static-on-cpu
    python -m kvrag_integrations.bench decode --preset gpu --model llama-3.1-8b --dummy-weights
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from kvrag_integrations.bench.common import RagItem, chunk_pool, markdown_table, sync, timed
from kvrag_integrations.engine.modeling import filled_attention
from kvrag_integrations.engine.modeling.static_buckets import Step

QUICK = {"lengths": [48, 96], "chunk_tokens": 16, "max_new_tokens": 5, "repeats": 1, "items": 2}
PRESETS: dict[str, Any] = {"gpu": None}  # sizes only (PRESET_OPTIONS)
PRESET_OPTIONS = {
    "gpu": {"lengths": [4096, 16384], "chunk_tokens": 256, "max_new_tokens": 65,
            "repeats": 3, "items": 20, "filled": [4096, 16384, 31744]},
}  # fmt: skip
QUICK_PRESET = {
    "gpu": {
        "lengths": [48, 96],
        "chunk_tokens": 16,
        "items": 2,
        "filled": [32, 96, 500],
        "filled_repeats": 4,
    },
}


def _per_token_ms(t1: float, tn: float, generated: int) -> float:
    return (tn - t1) / max(generated - 1, 1) * 1000


@contextmanager
def static_devices(engine: Any, devices: Sequence[str] | None) -> Iterator[Any]:
    """Within the block, the engine decodes statically on ``devices`` (``()``: never;
    None: its default); yields its ``StaticDecoder``."""
    decoder = engine.loaded.decoder
    before = decoder.devices
    if devices is not None:
        decoder.devices = tuple(devices)
    try:
        yield decoder
    finally:
        decoder.devices = before


def engine_decode(
    engine: Any,
    question: str,
    chunks: list[str],
    new_tokens: int,
    repeats: int,
    devices: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The engine's ms per decoded token after turbo over ``chunks`` (stored first),
    decoding statically on ``devices`` (see ``static_devices``), and how it decoded."""
    with static_devices(engine, devices) as decoder:
        point = _engine_decode(engine, question, chunks, new_tokens, repeats)
        point["path"] = decoder.last
        point["capture_s"] = {k: round(v, 3) for k, v in decoder.capture_s.items()}
        point["stats"] = dict(decoder.stats)
    return point


def _engine_decode(
    engine: Any, question: str, chunks: list[str], new_tokens: int, repeats: int
) -> dict[str, Any]:
    engine.encode_chunks(chunks, show_progress=False)
    request = dict(question=question, chunks=chunks, strategy="turbo")

    def answer(n: int) -> Any:  # min_new_tokens: random weights do not stop early
        result = engine.generate(max_new_tokens=n, min_new_tokens=n, **request)
        sync(engine)
        return result

    t1, _ = timed(lambda: answer(1), repeats)
    tn, result = timed(lambda: answer(new_tokens), repeats)
    generated = int(result.generated_tokens)
    return {"ms_per_token": _per_token_ms(t1, tn, generated), "generated": generated,
            "ttft_ms": t1 * 1000}  # fmt: skip


@torch.no_grad()
def hf_decode(engine: Any, ids: torch.Tensor, new_tokens: int, repeats: int) -> dict[str, Any]:
    """HF ``generate``'s ms per decoded token on the prompt ``ids`` (greedy, no early stop)."""
    lm, loaded = engine.model, engine.loaded
    prompt = ids.to(engine.device)[None]
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer is not None else None

    def answer(n: int) -> int:
        with loaded.lock:
            out = lm.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad,
            )
        sync(engine)
        return int(out.shape[1] - prompt.shape[1])

    t1, _ = timed(lambda: answer(1), repeats)
    tn, generated = timed(lambda: answer(new_tokens), repeats)
    return {"ms_per_token": _per_token_ms(t1, tn, generated), "generated": generated}


@torch.no_grad()
def filled_steps(
    engine: Any, filled: list[int], steps: int = 32, static_on_cpu: bool = False
) -> dict[str, Any]:
    """ms per decode step at each of the ``filled`` lengths inside one bucket (the
    smallest holding the longest): the step as the engine runs it, and the same
    step with masked SDPA over the whole bucket (each a graph on CUDA)."""
    devices = ("cpu", "cuda") if static_on_cpu else None
    lm = engine.model
    with engine.exclusive(), static_devices(engine, devices) as decoder:
        length = decoder.length(lm, max(filled) + 1)
        why = decoder.refusal(lm, engine.device, max(filled), 1)
        if why is not None or length is None:
            return {"refused": why or f"past the largest bucket ({decoder.buckets[-1]})"}
        bucket = decoder.store.take(lm, engine.loaded.dtype, engine.device, length)
        if bucket is None:
            return {"refused": "out of memory"}
        columns: dict[str, list[float]] = {}
        for backend in ("auto", "torch"):
            before, filled_attention.BACKEND = filled_attention.BACKEND, backend
            try:
                step = Step(bucket, lm, 1)  # its own graph: the attention is captured in it
                step.set_token(5, filled[0], filled[0])
                decoder.ready(step)
                columns[backend] = [_step_ms(engine, step, n, steps) for n in filled]
            finally:
                filled_attention.BACKEND = before
    kernel = filled_attention.kernel_available(engine.device)
    return {"bucket": length, "filled": list(filled), "steps": steps,
            "engine_attention": "split-KV Triton kernel" if kernel else "masked SDPA",
            "engine_ms": columns["auto"], "masked_sdpa_ms": columns["torch"]}  # fmt: skip


def _step_ms(engine: Any, step: Step, filled: int, steps: int) -> float:
    step.set_token(5, filled, filled)
    step.run()  # a first replay at this length (not timed)
    sync(engine)
    started = time.perf_counter()
    for _ in range(steps):
        step.run()
    sync(engine)
    return (time.perf_counter() - started) / steps * 1000


def run(
    engine: Any,
    items: list[RagItem],
    *,
    lengths: list[int] | None = None,
    chunk_tokens: int = 256,
    max_new_tokens: int = 65,
    repeats: int = 3,
    hf: bool = True,
    static_on_cpu: bool = False,
    filled: list[int] | None = None,
    filled_repeats: int = 32,
) -> dict[str, Any]:
    """ms per decoded token at each prompt length, the engine's and HF's.

    Args:
        engine: a loaded ``KVRAGEngine``.
        items: MuSiQue-style items: their passages are the chunks, the first
            one's question the question.
        lengths: target prompt lengths in tokens (default 4096 and 16384); one
            over the context window, or beyond the passages at hand, is skipped.
        chunk_tokens: tokens per chunk.
        max_new_tokens: tokens decoded in the long run (the short one decodes 1).
        repeats: timed runs per measurement, after one warm-up.
        hf: also time HF's ``generate`` on the same prompt.
        static_on_cpu: time the static decode on CPU too (else the engine's
            default: CUDA only, so on CPU the first column is eager as well).
        filled: also time the decode step alone at these filled lengths inside
            one bucket (``filled_steps``), ``filled_repeats`` replays each.
    """
    static = ("cpu", "cuda") if static_on_cpu else None
    question = items[0].question
    pool = chunk_pool(engine.tokenizer, items, chunk_tokens)
    limit = engine.context_window - max_new_tokens
    points = []
    for target in [4096, 16384] if lengths is None else lengths:
        n = max(1, round(target / chunk_tokens))
        chunks = pool[:n]
        prompt = engine.tokenize(engine.build_segments(question=question, chunks=chunks))
        if len(chunks) < n or prompt.num_tokens > limit:
            continue  # too few passages that long, or over the window
        point = {
            "target_tokens": target,
            "prompt_tokens": prompt.num_tokens,
            "n_chunks": n,
            "engine": engine_decode(engine, question, chunks, max_new_tokens, repeats, static),
            "eager": engine_decode(engine, question, chunks, max_new_tokens, repeats, ()),
        }
        if hf:
            point["hf"] = hf_decode(engine, prompt.input_ids, max_new_tokens, repeats)
            point["engine_over_hf"] = point["engine"]["ms_per_token"] / point["hf"]["ms_per_token"]
        points.append(point)
    payload = {"chunk_tokens": chunk_tokens, "max_new_tokens": max_new_tokens,
               "repeats": repeats, "static_on_cpu": static_on_cpu, "points": points}  # fmt: skip
    if filled:
        payload["filled"] = filled_steps(engine, filled, filled_repeats, static_on_cpu)
    return payload


def table(payload: dict[str, Any]) -> str:
    """ms per decoded token (median), engine and HF ``generate``, per prompt length
    (``max_new_tokens`` decoded: the report's setup line says how many)."""
    rows = []
    for p in payload["points"]:
        hf = p.get("hf", {}).get("ms_per_token")
        eager = p.get("eager", {}).get("ms_per_token")
        captures = p["engine"].get("capture_s") or {}
        rows.append([
            int(p["prompt_tokens"]), p["n_chunks"], round(p["engine"]["ttft_ms"], 1),
            round(p["engine"]["ms_per_token"], 2), p["engine"]["generated"],
            p["engine"].get("path") or "-",
            ", ".join(f"{k}: {v:.2f}" for k, v in captures.items()) or "-",
            "-" if eager is None else round(eager, 2),
            "-" if hf is None else round(hf, 2),
            "-" if hf is None else f"{p['engine_over_hf']:.2f}x",
        ])  # fmt: skip
    headers = ["prompt tokens", "chunks", "engine TTFT (turbo, ms)", "engine ms/token",
               "engine tokens", "engine decoded", "captures (s, per step)",
               "engine eager ms/token", "HF generate ms/token", "engine / HF"]  # fmt: skip
    text = markdown_table(headers, rows)
    steps = payload.get("filled") or {}
    if "engine_ms" in steps:
        text += (
            f"\n\nOne decode step inside the {steps['bucket']}-slot bucket, by filled length "
            f"(ms per step, {steps['steps']} replays):\n\n"
        )
        text += markdown_table(
            ["filled slots", f"engine ({steps['engine_attention']})", "masked SDPA"],
            [[n, round(a, 3), round(b, 3)]
             for n, a, b in zip(steps["filled"], steps["engine_ms"], steps["masked_sdpa_ms"])],
        )  # fmt: skip
    return text
