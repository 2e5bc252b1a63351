"""A forced tool call's decoding: only tokens that keep the call valid JSON.

With ``tool_choice="required"`` or a named tool, the in-process engine ends the
prompt with the call's start (``prompting.tools.forced_start``: the opening
markup, ``{"name": "`` and, for one tool, its name and the arguments' key) and
decodes the rest under ``ForcedCall``: a tool's name where several may be
called, then one JSON object (the arguments), then the closing ``}``; decoding
stops there. Each step keeps the likeliest tokens whose text continues a valid
prefix (checked on the text, so any tokenizer works); a small model then writes
a call that parses, whatever it would have written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_LITERALS = ("true", "false", "null")
_BAD, _MORE, _DONE = "bad", "more", "done"


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
        try:
            return json.loads(raw) in keys
        except json.JSONDecodeError:
            return False
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


def call_state(
    text: str,
    heads: Sequence[str],
    one_key: bool = False,
    keys: Sequence[Sequence[str] | None] | None = None,
) -> str:
    """``"done"``, ``"more"`` (a valid prefix) or ``"bad"``: is ``text`` one of
    ``heads``, then a JSON object, then ``}``? ``keys[i]``: the keys the object
    may hold after ``heads[i]`` (``schema_keys``; None: any).

    Examples:
        >>> heads = ['search", "arguments": ']
        >>> call_state('sea', heads), call_state('search", "arguments": {"q": 1}}', heads)
        ('more', 'done')
        >>> call_state('find', heads)
        'bad'
    """
    for h, head in enumerate(heads):
        allowed = keys[h] if keys is not None else None
        if len(text) <= len(head):
            if head.startswith(text):
                return _MORE
            continue
        if not text.startswith(head):
            continue
        rest = text[len(head) :]
        end = json_object_end(rest, one_key or (allowed is not None and len(allowed) == 1), allowed)
        if end is None:
            return _MORE
        if end == -1:
            continue
        tail = rest[end:].lstrip(_WS)
        if tail == "":
            return _MORE
        if tail == "}":
            return _DONE
    return _BAD


def schema_keys(schema: Any) -> tuple[str, ...] | None:
    """The keys a tool's arguments may hold: its schema's properties (none: only
    ``{}``), unless it allows additional properties; None: any keys.

    Examples:
        >>> schema_keys({"properties": {"q": {}}}), schema_keys({"properties": {}})
        (('q',), ())
        >>> schema_keys({"type": "object"}), schema_keys({"additionalProperties": True})
        (None, None)
    """
    if not isinstance(schema, Mapping):
        return None
    props = schema.get("properties")
    extra = schema.get("additionalProperties")
    if extra not in (None, False) or (props is None and extra is None):
        return None
    return tuple(props or ())


class ForcedCall:
    """Masks logits so the decoded text stays a valid call (``call_state``).

    Args:
        tokenizer: the model's tokenizer.
        heads: what may come first (``prompting.tools.forced_start``): a tool's
            name and the arguments' key, or ``""`` when the prompt holds them.
        greedy: keep only the likeliest valid token (else the valid ones of the
            ``width`` likeliest).
        written: the arguments' start the prompt already holds.
        one_key: the arguments hold one key (the tool's schema has one property).
        keys: per head, the keys its arguments may hold (``schema_keys``).
    """

    def __init__(
        self,
        tokenizer: Any,
        heads: Sequence[str],
        greedy: bool,
        written: str = "",
        one_key: bool = False,
        width: int = 64,
        keys: Sequence[Sequence[str] | None] | None = None,
    ) -> None:
        self.one_key = one_key
        self.keys = keys
        self.tokenizer = tokenizer
        self.heads = list(heads)
        self.greedy = greedy
        self.width = width
        self.text = written  # what the prompt already wrote of it
        self.done = False
        self._ref = (tokenizer.encode("a", add_special_tokens=False) or [0])[-1]
        self._ref_text = tokenizer.decode([self._ref], skip_special_tokens=False)
        self._pieces: dict[int, str] = {}

    def _piece(self, token: int) -> str:
        """A token's text as it reads after other text (sentencepiece's leading space
        kept), decoded once."""
        piece = self._pieces.get(token)
        if piece is None:
            both = self.tokenizer.decode([self._ref, token], skip_special_tokens=False)
            piece = both[len(self._ref_text) :]
            self._pieces[token] = piece
        return piece

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with every token that would break the call at ``-inf``."""
        allowed: list[int] = []
        for width in (self.width, 4096, logits.numel()):
            order = torch.topk(logits.float(), min(width, logits.numel())).indices.tolist()
            for token in order:
                piece = self._piece(token)
                if not piece or "\ufffd" in piece:
                    continue
                if call_state(self.text + piece, self.heads, self.one_key, self.keys) != _BAD:
                    allowed.append(token)
                    if self.greedy:
                        break
            if allowed:
                break
        out = torch.full_like(logits, float("-inf"))
        index = torch.tensor(allowed, dtype=torch.long, device=logits.device)
        out[index] = logits[index]
        return out

    def push(self, token: int) -> bool:
        """Record the chosen token; True once the call is complete (decoding stops)."""
        self.text += self._piece(token)
        self.done = call_state(self.text, self.heads, self.one_key, self.keys) == _DONE
        return self.done


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
    """
    stack: list[str] = []
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
            stack.append(c)
        elif c in "}]" and stack:
            stack.pop()
    closers = "".join("}" if c == "{" else "]" for c in reversed(stack))
    head = text[:-1] if escaped else text
    head += '"' if in_string else ""
    bare = head.rstrip().rstrip(",:").rstrip()
    # A key without its value: the call's own (its arguments) an object, others null.
    value = "{}" if len(stack) == 1 else "null"
    attempts = (f"{head}: {value}", f"{head.rstrip()} {value}", bare)
    for attempt in (head + closers, *(a + closers for a in attempts)):
        try:
            json.loads(attempt)
        except json.JSONDecodeError:
            continue
        return attempt
    return text
