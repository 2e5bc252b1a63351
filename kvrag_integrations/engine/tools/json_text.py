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
import re
from collections.abc import Sequence
from typing import Any

MAX_DEPTH = 64  # nesting a call's JSON may have (deeper is not a call)
_DECODER = json.JSONDecoder()
_FAILED = object()
_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_LITERALS = ("true", "false", "null")


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


def _string_end(text: str, i: int) -> int | None:
    """Index past the JSON string starting at ``text[i]`` (a quote); None: not closed
    yet; -1: a raw control character (invalid JSON)."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        if ord(c) < 0x20:
            return -1
        j += 1
    return None


def _key_ok(raw: str, keys: Sequence[str] | None) -> bool:
    """Whether the JSON string ``raw`` (closed or still open) is, or begins, one of
    ``keys`` (None: any key)."""
    if keys is None:
        return True
    if raw.endswith('"') and len(raw) > 1:
        key = load_json(raw)
        return isinstance(key, str) and key in keys
    return any(json.dumps(k, ensure_ascii=a).startswith(raw) for k in keys for a in (True, False))


def json_object_end(
    text: str, one_key: bool = False, keys: Sequence[str] | None = None
) -> int | None:
    """Where the JSON object that ``text`` starts with ends (index past its ``}``);
    None while ``text`` is a valid unfinished prefix of one; -1 if it cannot be one.
    ``one_key``: the object holds one key (a second is invalid). ``keys``: the
    object's keys must be among these (None: any; empty: only ``{}``).

    Examples:
        >>> json_object_end('{"q": [1, "a"]} tail'), json_object_end('{"q": tr')
        (15, None)
        >>> json_object_end("["), json_object_end('{"q": 01}')
        (-1, -1)
        >>> json_object_end('{"x', keys=["q"]), json_object_end("{}", keys=[])
        (-1, 2)
    """
    stack: list[str] = []
    expect = "value"
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in _WS:
            i += 1
            continue
        if expect in ("value", "value_or_close"):
            if not stack and c != "{":
                return -1
            if c == "]" and expect == "value_or_close":
                stack.pop()
                i += 1
                expect = "after"
            elif c in "{[":
                stack.append(c)
                expect = "key_or_close" if c == "{" else "value_or_close"
                i += 1
                continue
            elif c == '"':
                end = _string_end(text, i)
                if end is None or end == -1:
                    return end
                i, expect = end, "after"
            elif c in "-0123456789":
                j = i
                while j < n and text[j] in "+-0123456789.eE":
                    j += 1
                if j == n:
                    return None
                if not _NUMBER.fullmatch(text[i:j]):
                    return -1
                i, expect = j, "after"
            else:
                word = next((w for w in _LITERALS if text.startswith(w, i)), None)
                if word is None:
                    return None if any(w.startswith(text[i:]) for w in _LITERALS) else -1
                i, expect = i + len(word), "after"
        elif expect in ("key", "key_or_close"):
            if c == "}" and expect == "key_or_close":
                stack.pop()
                i += 1
                expect = "after"
            elif c == '"':
                end = _string_end(text, i)
                if end == -1:
                    return end
                top_key = keys is not None and len(stack) == 1
                if top_key and not _key_ok(text[i : end or n], keys):
                    return -1
                if end is None:
                    return None
                i, expect = end, "colon"
            else:
                return -1
        elif expect == "colon":
            if c != ":":
                return -1
            i, expect = i + 1, "value"
        else:  # after a value: a comma or the container's close
            top = stack[-1]
            if c == "," and one_key and len(stack) == 1:
                return -1
            if c == ",":
                i, expect = i + 1, "key" if top == "{" else "value"
            elif c == ("}" if top == "{" else "]"):
                stack.pop()
                i, expect = i + 1, "after"
            else:
                return -1
        if expect == "after":
            if not stack:
                return i
            expect = "comma_after"
    return None


_OPEN_UNICODE = re.compile(r"(\\+)u[0-9a-fA-F]{0,3}$")


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
    head = text[:-1] if escaped else text
    cut = _OPEN_UNICODE.search(head) if in_string else None
    if cut and len(cut.group(1)) % 2:  # a \uXXXX escape cut short: dropped
        head = head[: cut.end(1) - 1]
    head += '"' if in_string else ""
    bare = head.rstrip().rstrip(",:").rstrip()
    # A key without its value: the call's own (its arguments) an object, others null.
    value = "{}" if len(stack) == 1 else "null"
    attempts = (f"{head}: {value}", f"{head.rstrip()} {value}", bare)
    for attempt in (head + closers, *(a + closers for a in attempts)):
        if load_json(attempt) is not FAILED:
            return attempt
    return text
