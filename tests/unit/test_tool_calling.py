"""Tool calling in the engine: rendering per template, parsing per family, forced calls.

Rendering uses the tiny model's tokenizer with Qwen2.5's real template
(``tool_templates.QWEN25``) and with no tools in its template (the fallback
prompt); parsing takes canned outputs of each family; a forced call on the
random tiny model must still parse (constrained decoding). Each family's own
template on a model of its architecture: test_tool_families.py.
"""

from __future__ import annotations

import copy
import json

import pytest
from corpus import SEARCH_TOOL, TOWER
from tool_templates import QWEN25

from kvrag_integrations import Chunk, KVRAGEngine
from kvrag_integrations.engine.tools.family import ToolFamily
from kvrag_integrations.engine.tools.hermes import FallbackFamily, HermesFamily
from kvrag_integrations.engine.tools.json_text import close_call
from kvrag_integrations.engine.tools.llama import LlamaFamily
from kvrag_integrations.engine.tools.mistral import MistralFamily
from kvrag_integrations.engine.tools.plan import family_for, plan_tools
from kvrag_integrations.engine.tools.pythonic import PythonicFamily

HISTORY = [
    {"role": "user", "content": "When was the tower built?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": f"Source: {{}}\nContent: {TOWER}"},
]


@pytest.mark.parametrize(
    ("family", "text"),
    [
        (
            HermesFamily,
            '<tool_call>\n{"name": "search", "arguments": {"query": "a"}}\n</tool_call>',
        ),
        (LlamaFamily, '<|python_tag|>{"name": "search", "parameters": {"query": "a"}}'),
        (LlamaFamily, '{"name": "search", "parameters": {"query": "a"}}'),
        (MistralFamily, '[TOOL_CALLS][{"name": "search", "arguments": {"query": "a"}}]'),
        (PythonicFamily, "[search(query='a')]"),
        (ToolFamily, '{"name": "search", "arguments": {"query": "a"}}'),
    ],
)
def test_each_familys_call_format_parses(family: type[ToolFamily], text: str) -> None:
    parsed = family().parse(text, ["search"])
    assert [(c.name, c.arguments) for c in parsed.calls] == [("search", {"query": "a"})]
    assert parsed.content == "" and parsed.invalid == ()


def test_text_stays_text_and_a_broken_call_is_an_invalid_call() -> None:
    hermes = HermesFamily()
    assert hermes.parse("The tower was built in 1889.", ["search"]).content == (
        "The tower was built in 1889."
    )
    broken = '<tool_call>\n{"name": "search", "arguments": {"query": </tool_call>'
    parsed = hermes.parse("Looking.\n" + broken, ["search"])
    assert (parsed.content, parsed.calls) == ("Looking.", ())
    [invalid] = parsed.invalid
    assert (invalid.name, invalid.arguments) == ("search", broken)
    assert "no valid JSON" in invalid.error


def _with_template(engine: KVRAGEngine, template: str) -> KVRAGEngine:
    tok = copy.deepcopy(engine.tokenizer)
    tok.chat_template = template
    other = copy.copy(engine)
    other.tokenizer = tok
    return other


def test_a_tool_template_renders_tools_calls_and_results_with_chunks_intact(
    engine: KVRAGEngine,
) -> None:
    qwen = _with_template(engine, QWEN25)
    assert type(family_for(qwen.tokenizer)) is HermesFamily
    segs = qwen.build_segments(messages=HISTORY, known_chunks=[TOWER], tools=_plan(qwen))
    text = "".join(s.text for s in segs)
    assert json.dumps(SEARCH_TOOL) in text  # the template's own tool list
    assert '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>' in text
    assert f"<tool_response>\nSource: {{}}\nContent: {TOWER}\n</tool_response>" in text
    assert Chunk(TOWER) in segs  # the tool's document kept as a chunk


def test_a_template_without_tools_gets_the_fallback_prompt(engine: KVRAGEngine) -> None:
    plan = _plan(engine)
    assert type(plan.family) is FallbackFamily
    segs = engine.build_segments(messages=HISTORY, known_chunks=[TOWER], tools=plan)
    text = "".join(s.text for s in segs)
    assert "<tools>\n" + json.dumps(SEARCH_TOOL) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>' in text
    assert Chunk(TOWER) in segs


def _plan(engine: KVRAGEngine):
    return plan_tools(engine.tokenizer, [SEARCH_TOOL], None)


@pytest.mark.parametrize("choice", ["required", "search"])
def test_a_forced_call_from_a_random_model_is_a_valid_call(
    engine: KVRAGEngine, choice: str
) -> None:
    for template in (None, QWEN25):
        eng = engine if template is None else _with_template(engine, template)
        result = eng.generate(
            messages=HISTORY[:1], tools=[SEARCH_TOOL], tool_choice=choice, max_new_tokens=12
        )
        assert [c.name for c in result.tool_calls] == ["search"]
        assert isinstance(result.tool_calls[0].arguments["query"], str)


def test_auto_text_streams_and_none_renders_no_tools(engine: KVRAGEngine) -> None:
    stream = engine.stream(messages=HISTORY[:1], tools=[SEARCH_TOOL], max_new_tokens=6)
    text = "".join(stream)
    assert text == stream.result.text or stream.result.tool_calls
    none = engine.build_segments(messages=HISTORY[:1])
    result = engine.generate(
        messages=HISTORY[:1], tools=[SEARCH_TOOL], tool_choice="none", max_new_tokens=1
    )
    assert result.prompt_tokens == engine.tokenize(none).num_tokens


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get weather at a location.",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["location"],
        },
    },
}
NO_ARGS_TOOL = {  # LangChain's schema of a tool without parameters
    "type": "function",
    "function": {
        "name": "magic_function_no_args",
        "description": "Calculate a magic function.",
        "parameters": {"type": "object", "properties": {}},
    },
}


@pytest.mark.parametrize("max_new_tokens", [3, 7, 16])
def test_a_forced_call_among_several_tools_parses_whenever_it_stops(
    engine: KVRAGEngine, max_new_tokens: int
) -> None:
    # "required" with several tools: the model picks the name, then the arguments;
    # cut short anywhere (even after a key's colon) it still closes into one call.
    tools = [SEARCH_TOOL, WEATHER_TOOL, NO_ARGS_TOOL]
    allowed = {t["function"]["name"]: set(t["function"]["parameters"]["properties"]) for t in tools}
    result = engine.generate(
        messages=HISTORY[:1], tools=tools, tool_choice="required", max_new_tokens=max_new_tokens
    )
    assert len(result.tool_calls) == 1
    call = result.tool_calls[0]
    assert call.name in allowed
    assert isinstance(call.arguments, dict) and set(call.arguments) <= allowed[call.name]


@pytest.mark.parametrize("choice", ["required", "magic_function_no_args"])
def test_a_forced_call_of_a_tool_without_parameters_has_empty_arguments(
    engine: KVRAGEngine, choice: str
) -> None:
    result = engine.generate(
        messages=HISTORY[:1], tools=[NO_ARGS_TOOL], tool_choice=choice, max_new_tokens=16
    )
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("magic_function_no_args", {})]


def test_a_call_cut_after_a_keys_colon_closes_into_valid_json() -> None:
    cut = '{"name": "get_weather", "arguments": {\n    "location": {\n        "name":'
    assert json.loads(close_call(cut)) == {
        "name": "get_weather",
        "arguments": {"location": {"name": None}},
    }
