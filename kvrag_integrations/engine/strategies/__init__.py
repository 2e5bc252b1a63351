"""Prompt-cache strategies, one class each, behind one interface.

Examples:
    >>> make_strategy("turbo").name
    'turbo'
"""

from __future__ import annotations

from typing import Any

from kvrag_integrations.engine.strategies.base import PrefillOutput, Strategy
from kvrag_integrations.engine.strategies.blend import CacheBlend
from kvrag_integrations.engine.strategies.full import FullPrefill
from kvrag_integrations.engine.strategies.turbo import TurboRAG
from kvrag_integrations.errors import UnknownStrategyError

STRATEGIES: dict[str, type[Strategy]] = {
    FullPrefill.name: FullPrefill,
    TurboRAG.name: TurboRAG,
    CacheBlend.name: CacheBlend,
}

DEFAULT_STRATEGY = TurboRAG.name
"""The strategy of every entry point that is not told one (engine, adapters, CLI, demo).

On the published figures (docs/benchmarks.md: the bundled model, 2 CPU threads)
turbo cuts TTFT about 38x against full prefill and blend@0.15 about 4x, at
about 10x turbo's TTFT: turbo is the default, blend the option when fidelity
matters more than latency. On an engine with ``chunk_context="sink"`` blend
selects by the question's attention (``selection="auto"``), and its first-token
KL to full is 0.26x turbo's on whole passages and 0.64x on short chunks with the
bundled model, 0.15x on Gemma-3's short chunks; on Gemma-3's whole passages the
default engine's blend is better (docs/benchmarks.md, "CacheBlend: what helps
and what hurts, on two models").
"""


def make_strategy(strategy: str | Strategy, **options: Any) -> Strategy:
    """Return a strategy instance from a name (with options) or pass one through.

    Raises:
        UnknownStrategyError: no strategy has that name.
        TypeError: an option the strategy does not take.
    """
    if isinstance(strategy, Strategy):
        if options:
            raise TypeError("options go to the strategy's constructor, not with an instance")
        return strategy
    cls = STRATEGIES.get(strategy) if isinstance(strategy, str) else None
    if cls is None:
        raise UnknownStrategyError(
            f"unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)}"
        )
    return cls(**options)


__all__ = [
    "DEFAULT_STRATEGY",
    "STRATEGIES",
    "CacheBlend",
    "FullPrefill",
    "PrefillOutput",
    "Strategy",
    "TurboRAG",
    "make_strategy",
]
