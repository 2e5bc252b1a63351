"""How TTFT grows with the number of chunks and with chunk length, per strategy.

Two sweeps over the same chunk pool (MuSiQue passages cut to an exact token
length): TTFT against the number of chunks at a fixed chunk length (doubling
up to what fits in the context window), and against the chunk length at a
fixed number of chunks. Full prefill grows super-linearly (attention over the
whole prompt); turbo should stay near the **query-only floor**: the time to
compute only the prompt's trailing text (the question and the chat template's
end) through every layer over an already assembled cache, measured with the
engine's own ``run_tokens`` on the full-prefill cache of the same prompt (in
a static decode bucket where a request would use one: the tail's CUDA graph). What
turbo adds over it is tokenization, store reads, cache assembly (key
re-rotation) and the short separators between chunks.

The ``gpu`` preset (``--preset gpu``) is the count sweep at 16, 64 and 128 chunks
of 256 tokens: full, turbo from the engine's memory store (entries on the
device), turbo from a tiered store (disk behind a host memory tier: pinned
entries copied to the device per request), blend@0.15 and the floor. It writes
``gpu-scaling-<model>.json`` and ``.md`` (into ``docs/bench`` on a CUDA device,
where ``bench report`` renders them); with ``--dummy-weights`` ``--model`` names
a shape (``bench/shapes.py``) built with random weights.

Examples:
    python -m kvrag_integrations.bench scaling --counts 1,2,4,8,16 --lengths 64,128,256,512
    python -m kvrag_integrations.bench scaling --preset gpu --model llama-3.1-8b --dummy-weights
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvrag_integrations.bench import plots
from kvrag_integrations.bench.common import RagItem, chunk_pool, markdown_table, sync, timed
from kvrag_integrations.bench.rows import label, request_options
from kvrag_integrations.engine.engine import KVRAGEngine
from kvrag_integrations.engine.modeling.forward import run_tokens
from kvrag_integrations.store import DiskKVStore, TieredKVStore

STRATEGIES: list[tuple[str, dict[str, Any]]] = [
    ("full", {}),
    ("turbo", {}),
    ("blend", {"recompute_ratio": 0.15}),
]
QUICK = {"counts": [1, 2], "lengths": [16, 32], "n_chunks": 2, "chunk_tokens": 16,
         "questions": 1, "repeats": 1, "strategies": STRATEGIES[:2]}  # fmt: skip
# Turbo per store: the engine's own (memory) and a tiered one (host tier, disk).
GPU = [("full", {}), ("turbo", {}), ("turbo", {"store": "tiered"}), *STRATEGIES[2:]]
PRESETS = {"default": STRATEGIES, "gpu": GPU}
# Sizes a preset sets (before --quick's and the command line's); "items": questions
# loaded, enough passages of 256 tokens for 128 chunks.
PRESET_OPTIONS = {
    "gpu": {"counts": [16, 64, 128], "chunk_tokens": 256, "lengths": [], "questions": 1,
            "items": 20, "repeats": 5},
}  # fmt: skip
QUICK_PRESET = {
    "gpu": {"counts": [2, 4], "chunk_tokens": 16, "lengths": [], "items": 2, "repeats": 1},
}


def _prompt_tokens(engine: Any, question: str, chunks: list[str]) -> int:
    return engine.tokenize(engine.build_segments(question=question, chunks=chunks)).num_tokens


def default_counts(engine: Any, question: str, pool: list[str]) -> list[int]:
    """1, 2, 4, ... while the prompt fits, plus the largest count that fits."""
    limit = engine.context_window - 8  # room for the first generated tokens
    lo, hi = 0, len(pool)  # prompt length grows with n: bisect the largest that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _prompt_tokens(engine, question, pool[:mid]) <= limit:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return []
    counts = [1 << k for k in range(lo.bit_length()) if (1 << k) <= lo]
    return counts + ([lo] if counts[-1] != lo else [])


def floor_time(engine: Any, question: str, chunks: list[str], repeats: int) -> tuple[float, int]:
    """Median time to compute only the trailing text over the prompt's full cache,
    as a request runs it: where the static decode takes the model, the cache is
    laid out in a bucket and the tail runs as its step (a CUDA graph on CUDA).

    Returns ``(seconds, trailing tokens)``.
    """
    tokens = _prompt_tokens(engine, question, chunks)
    with engine.exclusive(), engine.loaded.decoder.reserve(engine.model, tokens, 1):
        pre = engine.prefill(question=question, chunks=chunks, strategy="full")
        kv, tail = pre.output.kv, pre.prompt.pieces[-1]
        total = kv.num_tokens
        idx = torch.arange(total - tail.ids.numel(), total, device=kv.device)

        def tail_only() -> None:
            run_tokens(engine.model, engine.loaded.layout, kv, idx)
            sync(engine)

        seconds, _ = timed(tail_only, repeats)
    return seconds, int(tail.ids.numel())


def measure_point(
    engine: Any,
    questions: list[str],
    chunks: list[str],
    strategies: list[tuple[str, dict[str, Any]]],
    repeats: int,
    runners: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Median over questions of the median TTFT per strategy, and the floor.

    A strategy's ``store`` option names its engine in ``runners`` (same weights,
    another store); without, ``engine`` answers.
    """
    runners = {"memory": engine, **(runners or {})}
    for runner in runners.values():
        runner.encode_chunks(chunks, show_progress=False)
    per: dict[str, list[float]] = {}
    floors, tails, tokens = [], [], []
    for question in questions:
        for name, options in strategies:
            options = dict(options)
            store = {"store": options.pop("store")} if "store" in options else {}
            runner = runners[store.get("store", "memory")]
            request = dict(
                question=question, chunks=chunks, strategy=name, **request_options(name, options)
            )

            def answer(e: Any = runner, r: dict[str, Any] = request) -> None:
                e.generate(max_new_tokens=1, **r)
                sync(e)

            ttft, _ = timed(answer, repeats)
            per.setdefault(label(name, {**options, **store}), []).append(ttft)
        floor, tail = floor_time(engine, question, chunks, repeats)
        floors.append(floor)
        tails.append(tail)
        tokens.append(_prompt_tokens(engine, question, chunks))
    ttft_ms = {name: statistics.median(v) * 1000 for name, v in per.items()}
    floor_ms = statistics.median(floors) * 1000
    point = {
        "prompt_tokens": statistics.median(tokens),
        "question_tokens": statistics.median(tails),
        "ttft_ms": ttft_ms,
        "floor_ms": floor_ms,
    }
    if "turbo" in ttft_ms:
        point["turbo_over_floor"] = ttft_ms["turbo"] / floor_ms
    if "full" in ttft_ms:
        point["speedup"] = {n: ttft_ms["full"] / v for n, v in ttft_ms.items()}
    return point


def run(
    engine: Any,
    items: list[RagItem],
    *,
    counts: list[int] | None = None,
    lengths: list[int] | None = None,
    n_chunks: int = 8,
    chunk_tokens: int = 128,
    questions: int = 2,
    repeats: int = 3,
    strategies: list[tuple[str, dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Both sweeps.

    Args:
        engine: a loaded ``KVRAGEngine``.
        items: MuSiQue-style items: their passages form the chunk pool, the first
            ``questions`` of them give the questions.
        counts: chunk counts for the first sweep (None: doubling up to the window).
        lengths: chunk lengths in tokens for the second sweep (None: 64..512).
        n_chunks: chunks per prompt in the length sweep.
        chunk_tokens: chunk length in the count sweep.
        questions: questions per point (median over them).
        repeats: timed runs per measurement, after one warm-up.
        strategies: ``(name, options)`` pairs (default full, turbo, blend@0.15).
    """
    strategies = strategies or STRATEGIES
    qs = [it.question for it in items[: max(1, questions)]]
    pool = chunk_pool(engine.tokenizer, items, chunk_tokens)
    if counts is None:
        counts = default_counts(engine, qs[0], pool)
    limit = engine.context_window - 8  # room for the first generated token
    counts = [
        n for n in counts if n <= len(pool) and _prompt_tokens(engine, qs[0], pool[:n]) <= limit
    ]
    with tempfile.TemporaryDirectory(prefix="kvrag-scaling-") as tmp:
        runners = store_engines(engine, strategies, Path(tmp))
        by_count = []
        for n in counts:
            point = measure_point(engine, qs, pool[:n], strategies, repeats, runners)
            by_count.append({"n_chunks": n, **point})
        by_length = []
        for length in [64, 128, 256, 512] if lengths is None else lengths:
            chunks = chunk_pool(engine.tokenizer, items, length)[:n_chunks]
            if len(chunks) < n_chunks or _prompt_tokens(engine, qs[0], chunks) > limit:
                continue  # too few passages that long, or over the window
            point = measure_point(engine, qs, chunks, strategies, repeats, runners)
            by_length.append({"chunk_tokens": length, **point})
    return {
        "questions": len(qs),
        "repeats": repeats,
        "chunk_tokens": chunk_tokens,
        "n_chunks": n_chunks,
        "strategies": [label(n, o) for n, o in strategies],
        "chunks": by_count,
        "length": by_length,
    }


def store_engines(
    engine: Any, strategies: list[tuple[str, dict[str, Any]]], workdir: Path
) -> dict[str, Any]:
    """Engines over ``engine``'s weights for the stores the strategies name:
    ``"tiered"`` is disk behind a memory tier kept on the host (pinned on CUDA,
    so each request copies its chunks to the device)."""
    names = {o["store"] for _, o in strategies if o.get("store", "memory") != "memory"}
    unknown = names - {"tiered"}
    if unknown:
        raise ValueError(f"unknown store {sorted(unknown)}; scaling knows memory and tiered")
    runners = {}
    if "tiered" in names:
        store = TieredKVStore(DiskKVStore(workdir / "tiered"), device="cpu")
        runners["tiered"] = KVRAGEngine(
            engine.loaded, store=store, cache_precision=engine.cache_precision
        )
    return runners


def _rows(points: list[dict[str, Any]], x_key: str, names: list[str]) -> list[list[Any]]:
    rows = []
    for p in points:
        row = [p[x_key], int(p["prompt_tokens"])]
        row += [round(p["ttft_ms"][n], 1) for n in names]
        row += [round(p["floor_ms"], 1), f"{p.get('turbo_over_floor', float('nan')):.2f}x"]
        rows.append(row)
    return rows


def table(payload: dict[str, Any]) -> str:
    """TTFT (ms, median) per chunk count, and per chunk length when measured."""
    names = payload["strategies"]
    tail = [*names, "query-only floor", "turbo / floor"]
    parts = [
        f"TTFT (ms) vs number of chunks ({payload['chunk_tokens']} tokens each):",
        "",
        markdown_table(
            ["chunks", "prompt tokens", *tail], _rows(payload["chunks"], "n_chunks", names)
        ),
    ]
    if payload["length"]:
        parts += [
            "",
            f"TTFT (ms) vs chunk length ({payload['n_chunks']} chunks):",
            "",
            markdown_table(
                ["tokens/chunk", "prompt tokens", *tail],
                _rows(payload["length"], "chunk_tokens", names),
            ),
        ]
    return "\n".join(parts)


def plot(payload: dict[str, Any], out_dir: Path, name: str = "scaling") -> list[Path]:
    """``<name>-chunks.png`` and ``<name>-length.png``."""
    paths = []
    if payload["chunks"]:
        paths.append(plots.scaling_lines(payload, out_dir / f"{name}-chunks.png", "chunks"))
    if payload["length"]:
        paths.append(plots.scaling_lines(payload, out_dir / f"{name}-length.png", "length"))
    return paths
