"""JSON read from a model's output, never raising: complete values, prefixes, cut calls.

A model's output is untrusted text: a number past 4,300 digits makes
``json.loads`` raise ``ValueError``, a thousand nested ``[`` raise
``RecursionError``. ``load_json`` and ``decode_json`` catch both and bound the
nesting before decoding; ``json_object_end`` tells a valid unfinished prefix of
an object from text that cannot be one (the streaming detectors and the forced
call's constraint use it; an explicit stack, no recursion); ``close_call``
closes a forced call cut short.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 64  # nesting a call's JSON may have (deeper is not a call)
_FAILED = object()
_WS = " \t\n\r"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is no JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is past what a float holds")
    return value


_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)


def _too_deep(text: str) -> bool:
    """Whether brackets outside strings nest deeper than ``MAX_DEPTH`` in ``text``."""
    depth = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
            if depth > MAX_DEPTH:
                return True
        elif c in "}]":
            depth -= 1
    return False


def decode_json(text: str, start: int = 0) -> tuple[Any, int] | None:
    """The JSON value at ``text[start:]`` (whitespace skipped) and the index past it;
    None where there is none (malformed, too deep, a number past Python's digit limit).

    Examples:
        >>> decode_json('  {"a": [1]} tail')
        ({'a': [1]}, 12)
        >>> decode_json("[" * 1000) is None, decode_json("9" * 5000) is None
        (True, True)
        >>> decode_json("[NaN]") is None, decode_json("-Infinity") is None, decode_json("1e999")
        (True, True, None)
    """
    while start < len(text) and text[start] in _WS:
        start += 1
    if _too_deep(text[start:]):
        return None
    try:
        value, end = _DECODER.raw_decode(text, start)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return None
    return value, end


def load_json(text: str) -> Any:
    """``text`` as one JSON value (surrounding whitespace allowed), or ``FAILED``.

    Examples:
        >>> load_json(' {"q": 1} '), load_json('{"q": 1} x') is FAILED
        ({'q': 1}, True)
    """
    found = decode_json(text)
    if found is None or text[found[1] :].strip(_WS):
        return FAILED
    return found[0]


FAILED: Any = _FAILED
"""What ``load_json`` returns for text that is not one JSON value."""


# an escape cut short at the end of a string: an odd run of backslashes, maybe u and hex
_CUT_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*(\\(?:u[0-9a-fA-F]{0,3})?)\Z")


def drop_cut_escape(body: str) -> str:
    r"""A JSON string's body cut short, less an escape cut short at its end.

    Examples:
        >>> drop_cut_escape("se\\u00"), drop_cut_escape("a\\"), drop_cut_escape("a\\\\")
        ('se', 'a', 'a\\\\')
    """
    cut = _CUT_ESCAPE.search(body)
    return body[: cut.start(1)] if cut else body


def json_string_prefix(body: str) -> str | None:
    r"""What a JSON string's body cut short (no quotes) decodes to as far as it is
    read; None where it is no string's body (a raw control character, a bad escape).
    A high surrogate at the end is dropped: its pair may follow.

    Examples:
        >>> json_string_prefix("se\\u0061r"), json_string_prefix("se\\u00")
        ('sear', 'se')
        >>> json_string_prefix("\\x") is None
        True
    """
    value = load_json('"' + drop_cut_escape(body) + '"')
    if not isinstance(value, str):
        return None
    return value[:-1] if value and "\ud800" <= value[-1] <= "\udbff" else value


def close_call(text: str) -> str:
    """A forced call cut short (``max_new_tokens``) closed into valid JSON: the open
    string and containers closed (a dangling key gets ``null``, or ``{}`` at the
    call's level: its arguments); ``text`` as is when it is not a JSON prefix
    this can close.

    Examples:
        >>> close_call('{"name": "f", "arguments": {"q": "abc')
        '{"name": "f", "arguments": {"q": "abc"}}'
        >>> close_call('{"name": "f", "arguments": {"q": {"n":')
        '{"name": "f", "arguments": {"q": {"n": null}}}'
        >>> close_call('{"name": "f", "arguments": ')
        '{"name": "f", "arguments": {}}'
        >>> close_call('{"name": "f", "argu')  # cut inside a key: dropped
        '{"name": "f"}'
        >>> close_call('{"name": "f", "arguments": {"q": 1, "lo')
        '{"name": "f", "arguments": {"q": 1}}'
    """
    stack: list[str] = []
    in_string = escaped = False
    last = ""  # the last character outside strings, spaces aside
    key_at = -1  # where the open string starts, if it is an object's key
    for i, c in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string, key_at, last = False, -1, '"'
        elif c == '"':
            in_string = True
            key_at = i if stack and stack[-1] == "{" and last in "{," else -1
        elif c in "{[":
            stack.append(c)
        elif c in "}]" and stack:
            stack.pop()
        if not in_string and not c.isspace():
            last = c
    if in_string and key_at >= 0:
        # cut inside a key: no key yet (a prefix of one the schema allows is no
        # key of it); what came before closes
        return close_call(text[:key_at].rstrip().rstrip(","))
    closers = "".join("}" if c == "{" else "]" for c in reversed(stack))
    head = drop_cut_escape(text) + '"' if in_string else text
    bare = head.rstrip().rstrip(",:").rstrip()
    # A key without its value: the call's own (its arguments) an object, others null.
    value = "{}" if len(stack) == 1 else "null"
    attempts = (f"{head}: {value}", f"{head.rstrip()} {value}", bare)
    for attempt in (head + closers, *(a + closers for a in attempts)):
        if load_json(attempt) is not FAILED:
            return attempt
    return text
