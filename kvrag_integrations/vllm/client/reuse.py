"""A reuse request on vLLM (turbo or blend): what the connector is asked to load,
what vLLM may run, and what the result says.

``load_run`` is the prompt's leading run of stored pieces (the cached leading
text, then chunks back to back) as ``PieceSpec``s; ``check_strategy`` refuses
at the call what vLLM cannot run; ``blend_request`` is a blend load's own part
(its options, a fresh nonce); ``account`` fills a ``GenerationResult``'s
token accounting from vLLM's own count of cached prompt tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvrag_integrations.engine.caching.prompt_tokenizer import PromptTokenizer
from kvrag_integrations.engine.prompting.segments import TokenizedPrompt
from kvrag_integrations.engine.request import RequestOptions
from kvrag_integrations.engine.results import GenerationResult
from kvrag_integrations.errors import UnsupportedInputError
from kvrag_integrations.vllm.params import BLEND_OPTIONS, BlendRequest, PieceSpec
from kvrag_integrations.vllm.reply import Reply


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


def check_strategy(options: RequestOptions, blend_refused: str = "") -> None:
    """Refuse what vLLM cannot run (a clear error at the call, never a wrong answer);
    ``blend_refused``: why this vLLM cannot blend ("" : it can, or a server decides)."""
    if not isinstance(options.strategy, str):
        raise UnsupportedInputError(
            "VLLMEngine takes a strategy by name ('turbo', 'blend' or 'full')"
        )
    name = options.strategy
    if name == "blend" and blend_refused:
        raise UnsupportedInputError(f'strategy="blend" does not run on this vLLM: {blend_refused}')
    allowed = BLEND_OPTIONS if name == "blend" else ()
    extra = sorted(set(options.strategy_options) - set(allowed))
    if extra:
        raise UnsupportedInputError(
            f"VLLMEngine runs {name!r} with the options {list(allowed)} at most; "
            f"{extra} need KVRAGEngine"
        )


def blend_request(options: Mapping[str, Any]) -> BlendRequest:
    """A blend load's own part: the call's options (over the model's calibrated
    settings, which the server applies) and a fresh nonce (its blocks are its own)."""
    return BlendRequest(options=dict(options)).with_own_nonce()


def account(
    result: GenerationResult,
    prompt: TokenizedPrompt,
    run: Sequence[PieceSpec],
    cached: int | None,
    on_miss: str,
    reply: Reply | None = None,
) -> list[PieceSpec]:
    """Fill ``result``'s token accounting from vLLM's count of cached prompt tokens
    (the connector's plus its own prefix-cache hits) and the connector's ``reply``
    (blend's recomputed tokens, a refusal); return the run's pieces vLLM had to
    compute (not stored, or refused by a worker)."""
    total = prompt.num_tokens
    loaded = min(cached or 0, total)
    blended = min(loaded, reply.blended if reply is not None else 0)
    reused = loaded - blended  # recomputed rows (blend) are not reused
    result.prompt_tokens, result.reused_tokens = total, reused
    result.recomputed_tokens = blended
    result.prefilled_tokens = total - loaded
    result.miss_policy = on_miss
    head = prompt.pieces[0] if prompt.pieces else None
    prefix = head.ids.numel() if head is not None and head.is_prefix else 0
    result.reused_prefix_tokens = min(loaded, prefix)  # (exact: never recomputed)
    result.reused_chunk_tokens = reused - result.reused_prefix_tokens
    kinds = [p.kind for p in prompt.cached_pieces][: len(run)]
    result.reused_chunks = sum(
        kind == "chunk" and piece.end <= loaded for kind, piece in zip(kinds, run)
    )
    if not run:
        result.miss_reason = f"strategy {result.strategy!r} reads no chunk caches"
        return []
    if reply is not None and reply.refused:
        result.miss_reason = f"the KV connector refused the load: {reply.refused}"
        return []
    limit = min(run[-1].end, total - 1)  # vLLM computes the last prompt token itself
    missing = [p for p in run if min(p.end, limit) > loaded]
    if not missing:
        result.miss_reason = "every chunk cache was stored"
        return []
    result.fallback = "uncached"
    result.miss_reason = (
        f"{len(missing)} piece(s) not stored: vLLM computed them in the request; "
        "encoding them in the background for the next"
    )
    return missing
