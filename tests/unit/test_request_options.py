"""RequestOptions: the one merge of a call's options with defaults, and the one default strategy.

Model-free: the adapters' own behaviour (names, None, stop) is tested with the
real model in tests/integration/test_llama_index*.py and test_langchain*.py.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from kvrag_integrations import DEFAULT_STRATEGY, KVRAGEngine, RequestOptions, UnknownStrategyError
from kvrag_integrations.cli import build_parser
from kvrag_integrations.engine.strategies import TurboRAG
from kvrag_integrations.langchain import ChatKVRAG
from kvrag_integrations.llama_index import KVRAGLLM

BLEND = RequestOptions(strategy="blend", strategy_options={"recompute_ratio": 0.3})
SAMPLING_DEFAULTS = {
    "max_new_tokens": 256,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "repetition_penalty": 1.0,
    "seed": None,
    "stop": (),
    "stop_token_ids": (),
    "min_new_tokens": 0,
}


def test_one_default_strategy_for_every_entry_point() -> None:
    assert DEFAULT_STRATEGY == TurboRAG.name == "turbo"
    assert RequestOptions().strategy == DEFAULT_STRATEGY
    assert inspect.signature(KVRAGEngine.prefill).parameters["strategy"].default == DEFAULT_STRATEGY
    assert KVRAGLLM.model_fields["strategy"].default == DEFAULT_STRATEGY
    assert ChatKVRAG.model_fields["strategy"].default == DEFAULT_STRATEGY
    args = build_parser().parse_args(["ask", "q", "--collection", "docs"])
    assert args.strategy == DEFAULT_STRATEGY


def test_the_same_strategy_inherits_its_options() -> None:
    merged = BLEND.merged({"temperature": 0.5, "max_new_tokens": 8})
    assert merged.strategy == "blend" and merged.strategy_options == {"recompute_ratio": 0.3}
    assert (merged.sampling.temperature, merged.sampling.max_new_tokens) == (0.5, 8)
    assert BLEND.merged({"strategy": "blend"}).strategy_options == {"recompute_ratio": 0.3}


def test_another_strategy_does_not_inherit_the_defaults_options() -> None:
    assert BLEND.merged({"strategy": "turbo"}).strategy_options == {}
    full = BLEND.merged({"strategy": "full"})
    assert full.strategy == "full" and full.strategy_options == {}


def test_call_options_update_the_inherited_ones() -> None:
    given = BLEND.merged({"strategy_options": {"check_layer": 2}})
    assert given.strategy_options == {"recompute_ratio": 0.3, "check_layer": 2}
    keywords = BLEND.merged({"strategy_options": {"check_layer": 2}, "recompute_ratio": 0.5})
    assert keywords.strategy_options == {"recompute_ratio": 0.5, "check_layer": 2}
    assert BLEND.merged({"strategy_options": None}).strategy_options == {"recompute_ratio": 0.3}
    assert BLEND.merged({}) == BLEND


def test_as_kwargs_is_what_the_engine_takes() -> None:
    kwargs = BLEND.merged({"stop": ["\n"], "on_miss": "encode", "seed": 3}).as_kwargs()
    assert kwargs == {
        "strategy": "blend",
        "recompute_ratio": 0.3,
        **SAMPLING_DEFAULTS,
        "seed": 3,
        "stop": ("\n",),
        "on_miss": "encode",
    }
    defaults = RequestOptions().as_kwargs()
    assert defaults == {"strategy": "turbo", **SAMPLING_DEFAULTS, "on_miss": None}


def test_values_are_normalized_and_none_stop_is_none() -> None:
    options = RequestOptions().merged({"stop": None, "temperature": 1})
    assert options.sampling.stop == () and isinstance(options.sampling.temperature, float)
    assert RequestOptions().merged({"stop": "END"}).sampling.stop == ("END",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.strategy = "full"  # type: ignore[misc]


def test_instance_settings_merge_into_the_engines_defaults() -> None:
    """What the adapters do with their instance settings: the same rule as a call's."""
    settings = RequestOptions().merged({"strategy": "blend", "max_new_tokens": 8})
    assert settings.strategy_options == {} and settings.sampling.max_new_tokens == 8
    assert settings.merged({"strategy": "turbo"}).sampling.max_new_tokens == 8


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_k": 2.5}, TypeError, "top_k"),
        ({"max_new_tokens": None}, TypeError, "max_new_tokens"),
        ({"seed": "abc"}, TypeError, "seed"),
        ({"stop": [None]}, TypeError, "stop"),
        ({"repetition_penalty": 0}, ValueError, "repetition_penalty"),
        ({"on_miss": "later"}, ValueError, "on_miss"),
        ({"strategy": "nope"}, UnknownStrategyError, "unknown strategy"),
        ({"strategy": None}, UnknownStrategyError, "unknown strategy"),
        ({"strategy": "turbo", "recompute_ratio": 0.5}, TypeError, "recompute_ratio"),
        ({"bogus": 1}, TypeError, "bogus"),
        ({"strategy_options": ["recompute_ratio"]}, TypeError, "strategy_options"),
        ({"recompute_ratio": 2.0}, ValueError, "recompute_ratio"),
    ],
    ids=repr,
)
def test_bad_options_are_typed_errors(call, error, match) -> None:
    with pytest.raises(error, match=match):
        BLEND.merged(call)


def test_bad_defaults_fail_when_made() -> None:
    with pytest.raises(TypeError, match="recompute_ratio"):
        RequestOptions(strategy="turbo", strategy_options={"recompute_ratio": 0.5})
    with pytest.raises(TypeError, match="options go to the strategy"):
        RequestOptions(strategy=TurboRAG(), strategy_options={"positions": "composite"})
    with pytest.raises(TypeError, match="sampling"):
        RequestOptions(sampling={"temperature": 0.5})  # type: ignore[arg-type]
    assert RequestOptions(strategy=TurboRAG()).merged({}).strategy_options == {}
