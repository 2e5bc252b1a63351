"""A turbo request on vLLM: what the connector is asked to load, what vLLM may run,
and what the result says.

``load_run`` is the prompt's leading run of stored pieces (the cached leading
text, then chunks back to back) as ``PieceSpec``s; ``check_strategy`` refuses
at the call what vLLM cannot run; ``account`` fills a ``GenerationResult``'s
token accounting from vLLM's own count of cached prompt tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrag_integrations.engine.caching.prompt_tokenizer import PromptTokenizer
from kvrag_integrations.engine.prompting.segments import TokenizedPrompt
from kvrag_integrations.engine.request import RequestOptions
from kvrag_integrations.engine.results import GenerationResult
from kvrag_integrations.errors import UnsupportedInputError
from kvrag_integrations.vllm.params import PieceSpec


def load_run(prompts: PromptTokenizer, prompt: TokenizedPrompt) -> tuple[PieceSpec, ...]:
    """The prompt's leading run of stored pieces (the cached leading text, then
    chunks back to back), as the connector reads them."""
    run = []
    position = 0
    for piece in prompt.pieces:
        if not piece.is_cached:
            break
        rows = piece.ids.numel()
        entry = prompts.piece_entry_ids(piece)
        run.append(PieceSpec(position, rows, tuple(entry[rows:].tolist())))
        position += rows
    return tuple(run)


def check_strategy(options: RequestOptions) -> None:
    """Refuse what vLLM cannot run (a clear error at the call, never a wrong answer)."""
    if not isinstance(options.strategy, str):
        raise UnsupportedInputError("VLLMEngine takes a strategy by name ('turbo' or 'full')")
    name = options.strategy
    if name == "blend":
        raise UnsupportedInputError(
            'strategy="blend" is not available on VLLMEngine: recomputing chosen tokens needs '
            "attention inside vLLM that its KV-connector API does not expose; use "
            '"turbo" (stored caches reused) or "full" here, or KVRAGEngine for blend'
        )
    if options.strategy_options:
        raise UnsupportedInputError(
            f"VLLMEngine runs {name!r} with its defaults; strategy options "
            f"{sorted(options.strategy_options)} need KVRAGEngine"
        )


def account(
    result: GenerationResult,
    prompt: TokenizedPrompt,
    run: Sequence[PieceSpec],
    cached: int | None,
    on_miss: str,
) -> list[PieceSpec]:
    """Fill ``result``'s token accounting from vLLM's count of cached prompt tokens
    (the connector's plus its own prefix-cache hits); return the run's pieces
    vLLM had to compute (not stored, or refused by a worker)."""
    total = prompt.num_tokens
    reused = min(cached or 0, total)
    result.prompt_tokens, result.reused_tokens = total, reused
    result.prefilled_tokens = total - reused
    result.miss_policy = on_miss
    head = prompt.pieces[0] if prompt.pieces else None
    prefix = head.ids.numel() if head is not None and head.is_prefix else 0
    result.reused_prefix_tokens = min(reused, prefix)
    result.reused_chunk_tokens = reused - result.reused_prefix_tokens
    kinds = [p.kind for p in prompt.cached_pieces][: len(run)]
    result.reused_chunks = sum(
        kind == "chunk" and piece.end <= reused for kind, piece in zip(kinds, run)
    )
    if not run:
        result.miss_reason = f"strategy {result.strategy!r} reads no chunk caches"
        return []
    limit = min(run[-1].end, total - 1)  # vLLM computes the last prompt token itself
    missing = [p for p in run if min(p.end, limit) > reused]
    if not missing:
        result.miss_reason = "every chunk cache was stored"
        return []
    result.fallback = "uncached"
    result.miss_reason = (
        f"{len(missing)} piece(s) not stored: vLLM computed them in the request; "
        "encoding them in the background for the next"
    )
    return missing
