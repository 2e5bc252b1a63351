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
from collections.abc import Sequence
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


def json_object_end(text: str, one_key: bool = False) -> int | None:
    """Where the JSON object that ``text`` starts with ends (index past its ``}``);
    None while ``text`` is a valid unfinished prefix of one; -1 if it cannot be one.
    ``one_key``: the object holds one key (a second is invalid).

    Examples:
        >>> json_object_end('{"q": [1, "a"]} tail'), json_object_end('{"q": tr')
        (15, None)
        >>> json_object_end("["), json_object_end('{"q": 01}')
        (-1, -1)
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
                if end is None or end == -1:
                    return end
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


def call_state(text: str, heads: Sequence[str], one_key: bool = False) -> str:
    """``"done"``, ``"more"`` (a valid prefix) or ``"bad"``: is ``text`` one of
    ``heads``, then a JSON object, then ``}``?

    Examples:
        >>> heads = ['search", "arguments": ']
        >>> call_state('sea', heads), call_state('search", "arguments": {"q": 1}}', heads)
        ('more', 'done')
        >>> call_state('find', heads)
        'bad'
    """
    for head in heads:
        if len(text) <= len(head):
            if head.startswith(text):
                return _MORE
            continue
        if not text.startswith(head):
            continue
        rest = text[len(head) :]
        end = json_object_end(rest, one_key)
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
    """

    def __init__(
        self,
        tokenizer: Any,
        heads: Sequence[str],
        greedy: bool,
        written: str = "",
        one_key: bool = False,
        width: int = 64,
    ) -> None:
        self.one_key = one_key
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
                if call_state(self.text + piece, self.heads, self.one_key) != _BAD:
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
        self.done = call_state(self.text, self.heads, self.one_key) == _DONE
        return self.done


def close_call(text: str) -> str:
    """A forced call cut short (``max_new_tokens``) closed into valid JSON: the open
    string and containers closed (a dangling key gets ``null``); ``text`` as is
    when it is not a JSON prefix this can close.

    Examples:
        >>> close_call('{"name": "f", "arguments": {"q": "abc')
        '{"name": "f", "arguments": {"q": "abc"}}'
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
    for attempt in (head + closers, head + ": null" + closers, bare + closers):
        try:
            json.loads(attempt)
        except json.JSONDecodeError:
            continue
        return attempt
    return text
