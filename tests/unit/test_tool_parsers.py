"""Each tool family's parser and streaming detector on untrusted model output.

Property tests (Hypothesis) feed every family random text, text built from the
format's own pieces, truncated calls, deep nesting and huge numbers. Whatever
the model wrote: parsing never raises; a call names a bound tool with a JSON
object of arguments; an invalid call's raw text never reads as a call to
LangChain's partial-JSON parser (so a streamed chunk stays invalid, as invoke
reports it); and the text the detector releases from any prefix is a prefix of
the parsed text (what makes streaming equal invoke). Canned outputs pin the
crashes issue 51 found.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langchain_core.utils.json import parse_partial_json

from kvrag_integrations.engine.tools.calls import call_arguments, template_tool_calls
from kvrag_integrations.engine.tools.family import ToolFamily
from kvrag_integrations.engine.tools.hermes import FallbackFamily, HermesFamily
from kvrag_integrations.engine.tools.llama import LlamaFamily
from kvrag_integrations.engine.tools.mistral import MistralFamily
from kvrag_integrations.engine.tools.pythonic import PythonicFamily

NAMES = ("search", "get_weather")
FAMILIES = [HermesFamily(), FallbackFamily(), LlamaFamily(), MistralFamily(), PythonicFamily()]
FAMILIES.append(ToolFamily())
IDS = [f.name for f in FAMILIES]

# One valid call in each family's own format.
HERMES_CALL = (
    '<tool_call>\n{"name": "search", "arguments": {"q": "tower", "k": [1, 2]}}\n</tool_call>'
)
CALL = {
    "hermes": HERMES_CALL,
    "fallback": HERMES_CALL,
    "llama": '<|python_tag|>{"name": "search", "parameters": {"q": "tower", "k": [1, 2]}}',
    "mistral": '[TOOL_CALLS][{"name": "search", "arguments": {"q": "tower", "k": [1, 2]}}]',
    "pythonic": '[search(q="tower", k=[1, 2])]',
    "json": '{"name": "search", "arguments": {"q": "tower", "k": [1, 2]}}',
}
FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]",
    "```", "{", "}", "[", "]", "(", ")", '"', "'", ":", ",", ";", "=", "\\", "\n", " ",
    '"name"', '"search"', '"Alice"',
    '"arguments"', '"parameters"', '"q"', "search", "get_weather", "q", "1", "9" * 50, "-", ".",
    "true", "null", "The tower", "é", "\u2028",
]  # fmt: skip
fragment_text = st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join)
any_text = st.one_of(st.text(max_size=120), fragment_text)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check(family: ToolFamily, text: str) -> None:
    parsed = family.parse(text, NAMES, b"seed")
    for call in parsed.calls:
        assert call.name in NAMES and isinstance(call.arguments, dict)
        json.loads(call.as_openai()["function"]["arguments"])  # serialisable, back again
    for bad in parsed.invalid:
        assert bad.error and isinstance(bad.arguments, str)
        try:
            read = parse_partial_json(bad.arguments)
        except Exception:  # whatever LangChain raises: it stays invalid
            read = None
        assert not isinstance(read, dict), bad.arguments
    # Streaming: what the detector releases from any prefix is a prefix of the text.
    cuts = sorted({*range(0, len(text) + 1, max(1, len(text) // 40)), len(text)})
    for cut in cuts:
        end = family.content_end(text[:cut], NAMES)
        assert 0 <= end <= cut
        assert parsed.content.startswith(text[:end]), (cut, text[:end], parsed.content)


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
@SETTINGS
@given(text=any_text)
def test_any_output_parses_without_raising_and_streams_a_prefix(
    family: ToolFamily, text: str
) -> None:
    _check(family, text)


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
@SETTINGS
@given(cut=st.integers(min_value=0, max_value=200), lead=st.sampled_from(["", "Sure. ", " "]))
def test_truncated_calls(family: ToolFamily, cut: int, lead: str) -> None:
    text = lead + CALL[family.name]
    _check(family, text[:cut])
    _check(family, text + text[:cut])  # a second call cut short


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
@SETTINGS
@given(
    depth=st.integers(min_value=1, max_value=3000),
    opener=st.sampled_from(["[", "{", '{"a":', "(", "[search(q=", "search(q=["]),
    digits=st.integers(min_value=1, max_value=6000),
)
def test_deep_and_huge_outputs(family: ToolFamily, depth: int, opener: str, digits: int) -> None:
    body = opener * depth
    number = "9" * digits
    for marker in ("", "<tool_call>", "<|python_tag|>", "[TOOL_CALLS]"):
        _check(family, marker + body)
    call = CALL[family.name].replace("[1, 2]", number)
    _check(family, call)


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_the_familys_call_parses_after_text_where_it_has_markup(family: ToolFamily) -> None:
    parsed = family.parse(CALL[family.name], NAMES)
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("search", {"q": "tower", "k": [1, 2]})
    ]
    assert parsed.content == ""
    if family.markers:
        parsed = family.parse("Let me look.\n" + CALL[family.name], NAMES)
        assert parsed.content == "Let me look." and len(parsed.calls) == 1


# The crashes issue 51 reproduced, each now calls, text or an invalid call.
@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_a_json_answer_with_tools_bound_is_text(family: ToolFamily) -> None:
    answer = '{"name": "Alice", "age": 30}'
    parsed = family.parse(answer, NAMES)
    assert (parsed.content, parsed.calls, parsed.invalid) == (answer, (), ())
    assert family.content_end(answer, NAMES) == len(answer)  # streamed at once


@pytest.mark.parametrize(
    ("family", "text", "name"),
    [
        (LlamaFamily(), '{"name": "search", "parameters": {"q": ' + "1" * 4301 + "}}", None),
        (HermesFamily(), "<tool_call>" + "[" * 1000 + "</tool_call>", None),
        (MistralFamily(), "[TOOL_CALLS]" + "[" * 1000, None),
        (PythonicFamily(), "[search(q={[1]:2})]", "search"),
        (PythonicFamily(), "[search(q=" + "[" * 1000 + "]" * 1000 + ")]", "search"),
        (PythonicFamily(), "[search(q=" + "9" * 5000 + ")]", "search"),
    ],
    ids=["4301-digit number", "1000 nested [ in a call", "mistral nesting", "unhashable key",
         "nesting in python", "5000-digit literal"],
)  # fmt: skip
def test_the_issues_crashing_outputs_now_parse(family: ToolFamily, text: str, name: str) -> None:
    parsed = family.parse(text, NAMES)
    assert parsed.calls == ()
    if parsed.invalid:  # the family's format was used: a clear invalid call
        assert parsed.invalid[0].name == name and parsed.invalid[0].arguments
    else:
        assert parsed.content == text


def test_a_call_to_an_unbound_tool_in_markup_is_invalid_and_bare_is_text() -> None:
    marked = '<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>'
    [bad] = HermesFamily().parse(marked, NAMES).invalid
    assert bad.name == "delete_all" and "not among the bound tools" in bad.error
    assert PythonicFamily().parse("[delete_all()]", NAMES).content == "[delete_all()]"


@pytest.mark.parametrize(
    ("family", "answer"),
    [
        (PythonicFamily(), "[1] The tower was built in 1889."),
        (PythonicFamily(), "[Note] see below"),
        (LlamaFamily(), '{"results": [1, 2, 3]}'),
        (HermesFamily(), "```python\nprint(1)\n```"),
        (LlamaFamily(), "```json\n{}\n```"),
    ],
)
def test_answers_starting_like_a_call_stream_as_soon_as_they_cannot_be_one(
    family: ToolFamily, answer: str
) -> None:
    # released within a few characters of the start, not held to the end
    early = next(cut for cut in range(len(answer) + 1) if family.content_end(answer[:cut], NAMES))
    assert early <= 12
    assert family.parse(answer, NAMES).content == answer


def test_mistral_keeps_its_own_ids_and_makes_nine_character_ones() -> None:
    mistral = MistralFamily()
    own = '[TOOL_CALLS][{"name": "search", "arguments": {}, "id": "a1B2c3D4e"}]'
    assert mistral.parse(own, NAMES).calls[0].id == "a1B2c3D4e"
    made = mistral.parse('[TOOL_CALLS][{"name": "search", "arguments": {}}]', NAMES, b"s")
    assert len(made.calls[0].id) == 9 and made.calls[0].id.isalnum()
    # ids are drawn from the seed: the same answer gets the same ids
    assert made == mistral.parse('[TOOL_CALLS][{"name": "search", "arguments": {}}]', NAMES, b"s")


# Mistral's v11+ form: one marker per call, name, [CALL_ID] id (v11 only), [ARGS]
MISTRAL_V11 = '[TOOL_CALLS]search[CALL_ID]a1B2c3D4e[ARGS]{"q": "tower", "k": [1, 2]}'
MISTRAL_V13 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'


def test_mistral_reads_the_v11_form_one_marker_per_call() -> None:
    mistral = MistralFamily()
    parsed = mistral.parse("Let me look." + MISTRAL_V11 + MISTRAL_V13, NAMES, b"s")
    assert parsed.content == "Let me look." and not parsed.invalid
    got = [(c.name, c.arguments, c.id) for c in parsed.calls]
    assert got[0] == ("search", {"q": "tower", "k": [1, 2]}, "a1B2c3D4e")  # its own id kept
    assert got[1][:2] == ("get_weather", {"city": "Paris"}) and len(got[1][2]) == 9
    # without [ARGS] (the brace starts the arguments), repeated markers as one
    assert mistral.parse('[TOOL_CALLS][TOOL_CALLS]search{"q": 1}', NAMES).calls[0].arguments == {
        "q": 1
    }
    # an unbound name, cut arguments, or no call after the marker: invalid, never a call
    for text in ('[TOOL_CALLS]Alice[ARGS]{"age": 30}', '[TOOL_CALLS]search[ARGS]{"q": '):
        bad = mistral.parse(text, NAMES)
        assert not bad.calls and bad.invalid[0].arguments == text
    assert mistral.parse("[TOOL_CALLS] I think not", NAMES).invalid
    assert mistral.parse("[TOOL_CALLS]Alice[ARGS]{}", NAMES).invalid[0].name == "Alice"


@SETTINGS
@given(cut=st.integers(min_value=0, max_value=120), lead=st.sampled_from(["", "Sure. "]))
def test_mistral_v11_calls_cut_anywhere(cut: int, lead: str) -> None:
    text = lead + MISTRAL_V11 + MISTRAL_V13
    _check(MistralFamily(), text[:cut])
    _check(MistralFamily(), MISTRAL_V11 + text[:cut])


def test_earlier_turns_malformed_arguments_are_tolerated() -> None:
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": '}},
        {"name": "search", "args": None, "id": "c2"},  # LangChain's form
    ]
    out = template_tool_calls(calls)
    assert out[0]["function"]["arguments"] == '{"q": '  # kept as the model wrote it
    assert out[1]["function"]["arguments"] == {}
    assert call_arguments("9" * 5000) == "9" * 5000  # past the digit limit: kept as text
    text = HermesFamily().call_text(out)  # the fallback writes them back as text
    assert json.loads(text.split("\n")[1])["arguments"] == '{"q": '


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(["search", "get_weather", "magic_function_no_args"]),
    args=st.dictionaries(st.sampled_from(["query", "location", "days"]), st.text(max_size=8)),
    data=st.data(),
)
def test_a_forced_call_cut_anywhere_closes_into_one_call(name, args, data) -> None:
    """A forced decode (the constraint writes a forced name, then arguments) cut short
    by max_new_tokens anywhere after its name began, even inside a key, is one call
    to that tool with only whole keys of what it wrote."""
    whole = json.dumps({"name": name, "arguments": args})
    begun = len('{"name": "') + 1
    cut = whole[: data.draw(st.integers(begun, len(whole)))]
    forced = ("search", "get_weather", "magic_function_no_args")
    parsed = HermesFamily().forced_call(cut, forced, b"")
    assert parsed is not None, cut
    (call,) = parsed.calls
    assert call.name == name
    assert set(call.arguments) <= set(args)
