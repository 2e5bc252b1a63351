"""What a benchmark table row runs: its label, the engine it runs on and its
request options (shared by the quality, ttft, scaling, peer and attention suites)."""

from __future__ import annotations

import inspect
from dataclasses import fields
from functools import cache
from typing import Any

from kvrag_integrations.engine.blend_settings import BlendSettings
from kvrag_integrations.engine.engine import KVRAGEngine
from kvrag_integrations.engine.strategies.blend import CacheBlend
from kvrag_integrations.store import MemoryKVStore

# Row options that are engine settings: such a row runs on an engine of its own
# over the same weights.
ENGINE_OPTIONS = ("cache_precision", "chunk_suffix", "chunk_context")


def recompute_ratio(name: str, options: dict[str, Any]) -> float | None:
    """Where a strategy sits on the CacheBlend axis: turbo 0, full 1, blend its ratio.

    None for variants with other options (they are not points on that curve).
    """
    if name == "turbo" and not options:
        return 0.0
    if name == "full":
        return 1.0
    if name == "blend" and set(options) == {"recompute_ratio"}:
        return float(options["recompute_ratio"])
    return None


def engine_for(
    engine: KVRAGEngine, settings: dict[str, Any], engines: dict[tuple, KVRAGEngine]
) -> KVRAGEngine:
    """``engine``, or one over its weights with other engine ``settings``."""
    current = {
        "cache_precision": engine.caches.precision,
        "chunk_suffix": engine.prompts.suffix,
        "chunk_context": engine.prompts.context,
    }
    if all(current[k] == v for k, v in settings.items()):
        return engine
    key = tuple(sorted(settings.items()))
    if key not in engines:
        engines[key] = KVRAGEngine(
            engine.loaded,
            store=MemoryKVStore(max_bytes=None),
            on_miss=engine.on_miss,
            **{**current, **settings},
        )
    return engines[key]


def request_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """A row's request options: a blend row that names options runs exactly those
    over ``CacheBlend``'s own defaults, never the model's calibrated settings (which
    fill what a call leaves out, ``engine.blend_settings``): a row's label says what
    it ran. ``chunk_context`` left None reads the row's engine's entries. Blend by
    name alone (the ``calibrated`` preset) stays as the engine serves it.

    Examples:
        >>> request_options("blend", {"recompute_ratio": 0.4})["selection"]
        'auto'
        >>> request_options("blend", {})
        {}
    """
    if name != "blend" or not options:
        return dict(options)
    return {**_blend_defaults(), **options}


@cache
def _blend_defaults() -> dict[str, Any]:
    params = inspect.signature(CacheBlend).parameters
    return {f.name: params[f.name].default for f in fields(BlendSettings)}


def label(name: str, options: dict[str, Any]) -> str:
    """``blend@0.15`` style names for table rows."""
    if name == "blend" and set(options) == {"recompute_ratio"}:
        return f"blend@{options['recompute_ratio']:g}"
    if not options:
        return name
    return name + "(" + ", ".join(f"{k}={v}" for k, v in options.items()) + ")"
