"""Each tool family's parser and streaming detector on untrusted model output.

Property tests (Hypothesis) feed every family random text, text built from the
format's own pieces, truncated calls, deep nesting and huge numbers, and call
objects in each family's format whose name and arguments are any JSON value,
with names and keys escaped, non-finite numbers and prose after the calls.
Whatever the model wrote: parsing never raises (the bound names a tuple or a
set); a call names a bound tool with a JSON object of arguments, written back
as strict JSON; an invalid call's raw text never reads as a call to
LangChain's partial-JSON parser (so a streamed chunk stays invalid, as invoke
reports it); the text the detector releases from any prefix is a prefix of the
parsed text (what makes streaming equal invoke), and a detector reading on
from where it stopped says what a fresh one says. Canned outputs pin the
crashes issues 51 and 58 found.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langchain_core.utils.json import parse_partial_json

from kvrag_integrations.engine.tools.calls import (
    Parsed,
    ToolCall,
    call_arguments,
    template_tool_calls,
)
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


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is no JSON")


def strict_json(text: str) -> object:
    """``text`` read as strict JSON: NaN and Infinity raise."""
    return json.loads(text, parse_constant=_no_constant)


def _check(family: ToolFamily, text: str) -> None:
    parsed = family.parse(text, NAMES, b"seed")
    assert family.parse(text, frozenset(NAMES), b"seed") == parsed  # any collection of names
    for call in parsed.calls:
        assert call.name in NAMES and isinstance(call.arguments, dict)
        strict_json(call.as_openai()["function"]["arguments"])  # strict JSON, back again
    for bad in parsed.invalid:
        assert bad.error and isinstance(bad.arguments, str)
        try:
            read = parse_partial_json(bad.arguments)
        except Exception:  # whatever LangChain raises: it stays invalid
            read = None
        assert not isinstance(read, dict), bad.arguments
    # Streaming: what the detector releases from any prefix is a prefix of the text,
    # and one detector fed the prefixes in turn (reading on where it stopped, as a
    # stream does) says what a fresh one says of each.
    cuts = sorted({*range(0, len(text) + 1, max(1, len(text) // 40)), len(text)})
    detector = family.detector(NAMES)
    for cut in cuts:
        end = family.content_end(text[:cut], NAMES)
        assert detector.end(text[:cut]) == end, (cut, text[:cut])
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
# fewer examples: each costs up to 0.2 s at the largest sizes (five parses with
# 40 cuts each of ~18k characters), and six openers by two sizes is a small space
@settings(SETTINGS, max_examples=30)
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


# Call objects in each family's format, as odd as a model writes them (issue 58).
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e999", "-1e400"]
PROSE = ["", " Thanks!", "\n\nThe tower is 330 m tall.", " I hope this helps. (1)"]


def _json_string(text: str, escape: list[bool]) -> str:
    """``text`` as a JSON string, the characters ``escape`` marks written as \\uXXXX."""
    out = [
        f"\\u{ord(c):04x}"
        if i < len(escape) and escape[i] and ord(c) < 0x10000
        else json.dumps(c)[1:-1]
        for i, c in enumerate(text)
    ]
    return '"' + "".join(out) + '"'


@st.composite
def odd_calls(draw: st.DrawFn, family: str) -> tuple[str, str, bool]:
    """A call in ``family``'s format whose name and arguments may be any JSON value,
    names and keys maybe escaped, a non-finite number maybe among the arguments,
    prose maybe after it; the same call written plainly (no escapes, no prose);
    whether prose follows."""
    name = draw(st.sampled_from(NAMES) | json_values)
    args = draw(st.dictionaries(st.sampled_from(["q", "k"]), json_values, max_size=2) | json_values)
    bad_number = draw(st.none() | st.sampled_from(NON_FINITE))
    prose = draw(st.sampled_from(PROSE))
    mask = draw(st.lists(st.booleans(), max_size=12))

    def obj(escape: list[bool]) -> str:
        key = "parameters" if family == "llama" else "arguments"
        name_text = _json_string(name, escape) if isinstance(name, str) else json.dumps(name)
        args_text = json.dumps(args)
        if bad_number is not None and isinstance(args, dict):
            args_text = args_text[:-1] + (", " if args else "") + f'"n": {bad_number}}}'
        head = f"{_json_string('name', escape)}: {name_text}"
        return f"{{{head}, {_json_string(key, escape)}: {args_text}}}"

    if family == "pythonic":
        ident = name if isinstance(name, str) and name.isidentifier() else "search"
        kwargs = args if isinstance(args, dict) else {"q": args}
        inner = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        if bad_number is not None:
            inner += (", " if inner else "") + "n=1e999"
        plain = f"[{ident}({inner})]"
        return plain + prose, plain, bool(prose)
    wrap = {
        "hermes": "<tool_call>\n{}\n</tool_call>",
        "fallback": "<tool_call>\n{}\n</tool_call>",
        "llama": draw(st.sampled_from(["{}", "<|python_tag|>{}"])),
        "mistral": "[TOOL_CALLS][{}]",
        "json": "{}",
    }[family]
    return wrap.format(obj(mask)) + prose, wrap.format(obj([])), bool(prose)


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
@SETTINGS
@given(data=st.data())
def test_call_objects_of_any_json_escaped_non_finite_or_with_prose(
    family: ToolFamily, data: st.DataObject
) -> None:
    text, plain, prose = data.draw(odd_calls(family.name))
    _check(family, text)  # every call's arguments strict JSON (a key may still say "NaN")
    parsed = family.parse(text, NAMES, b"s")
    if text == plain or not family.parse(plain, NAMES).calls:
        return
    # Escapes read as what they decode to; prose after marked calls dropped, while
    # it makes a whole-answer form (bare JSON, a Python list) text.
    whole_answer = not family.markers or (family.name == "llama" and not text.startswith("<|"))
    if whole_answer and prose:
        assert parsed.calls == () and parsed.content == text  # prose after: text
    else:
        assert [(c.name, c.arguments) for c in parsed.calls] == [
            (c.name, c.arguments) for c in family.parse(plain, NAMES).calls
        ]


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
@pytest.mark.parametrize("names", [NAMES, set(NAMES), frozenset(NAMES), list(NAMES)])
def test_a_name_that_is_no_string_is_no_call_and_never_raises(family: ToolFamily, names) -> None:
    for name in ('["search"]', '{"n": 1}', "1", "null"):
        obj = f'{{"name": {name}, "arguments": {{}}}}'
        for text in (
            f"<tool_call>{obj}</tool_call>",
            obj,
            f"[TOOL_CALLS][{obj}]",
            f"<|python_tag|>{obj}",
        ):
            parsed = family.parse(text, names)
            assert not parsed.calls
    bad = HermesFamily().parse(
        '<tool_call>{"name": ["search"], "arguments": {}}</tool_call>', set(NAMES)
    )
    assert bad.invalid[0].name is None and "no call object with a name" in bad.invalid[0].error


@pytest.mark.parametrize("family", [LlamaFamily(), ToolFamily()], ids=["llama", "json"])
def test_an_escaped_name_or_key_streams_as_the_call_it_parses_to(family: ToolFamily) -> None:
    key = family.args_key
    text = f'{{"name": "se\\u0061rch", "{key[0]}\\u{ord(key[1]):04x}{key[2:]}": {{"q": "tower"}}}}'
    assert [(c.name, c.arguments) for c in family.parse(text, NAMES).calls] == [
        ("search", {"q": "tower"})
    ]
    detector = family.detector(NAMES)
    assert all(detector.end(text[:cut]) == 0 for cut in range(len(text) + 1))  # none released
    # an escaped name that is no bound tool's is text as soon as it cannot be one
    other = '{"name": "\\u0041lice", "age": 30}'
    assert (
        family.content_end(other[:16], NAMES) == 16 and family.parse(other, NAMES).content == other
    )


@pytest.mark.parametrize("number", NON_FINITE)
def test_non_finite_numbers_are_no_arguments(number: str) -> None:
    args = f'{{"q": {number}}}'
    for family, text in [
        (HermesFamily(), f'<tool_call>{{"name": "search", "arguments": {args}}}</tool_call>'),
        (MistralFamily(), f'[TOOL_CALLS][{{"name": "search", "arguments": {args}}}]'),
        (MistralFamily(), f"[TOOL_CALLS]search[ARGS]{args}"),
        (LlamaFamily(), f'<|python_tag|>{{"name": "search", "parameters": {args}}}'),
    ]:
        parsed = family.parse(text, NAMES)
        assert not parsed.calls and len(parsed.invalid) == 1, text  # the markup holds no call
    for family in (LlamaFamily(), ToolFamily()):  # a bare object with one: a JSON answer
        text = f'{{"name": "search", "{family.args_key}": {args}}}'
        assert family.parse(text, NAMES).content == text
    python = PythonicFamily().parse("[search(q=1e999)]", NAMES)
    assert not python.calls and python.invalid[0].name == "search"


def test_as_openai_writes_strict_json() -> None:
    call = HermesFamily().parse(
        '<tool_call>{"name": "search", "arguments": {"q": 1e300}}</tool_call>', NAMES
    )
    assert strict_json(call.calls[0].as_openai()["function"]["arguments"]) == {"q": 1e300}
    with pytest.raises(ValueError):  # made by hand: refused rather than written as NaN
        ToolCall("search", {"q": float("nan")}).as_openai()
    # a key (or a string) that reads "NaN" is text, not a number: it stays (Hypothesis's find)
    named = LlamaFamily().parse('{"name": "search", "parameters": {"NaN": null}}', NAMES)
    assert strict_json(named.calls[0].as_openai()["function"]["arguments"]) == {"NaN": None}


@pytest.mark.parametrize("family", [LlamaFamily(), ToolFamily()], ids=["llama", "json"])
def test_a_bare_object_without_arguments_is_a_json_answer(family: ToolFamily) -> None:
    answer = '{"name": "search"}'
    assert family.parse(answer, NAMES) == Parsed(answer)
    assert family.content_end(answer, NAMES) == len(answer)  # streamed at once
    # inside the family's markup the call may leave its arguments out
    if family.markers:
        assert family.parse("<|python_tag|>" + answer, NAMES).calls[0].arguments == {}


def test_prose_after_mistral_calls_is_dropped_in_both_forms() -> None:
    v3 = '[TOOL_CALLS][{"name": "search", "arguments": {"q": "tower"}}] Let me know!'
    v11 = '[TOOL_CALLS]search[ARGS]{"q": "tower"} Let me know!'
    for text in (v3, v11):
        parsed = MistralFamily().parse("Sure." + text, NAMES)
        assert parsed.content == "Sure." and not parsed.invalid
        assert [(c.name, c.arguments) for c in parsed.calls] == [("search", {"q": "tower"})]
    # <|python_tag|> calls likewise; a second call after them is still read
    llama = '<|python_tag|>{"name": "search", "parameters": {}}; '
    llama += '{"name": "get_weather", "parameters": {}} Done.'
    assert [c.name for c in LlamaFamily().parse(llama, NAMES).calls] == ["search", "get_weather"]
