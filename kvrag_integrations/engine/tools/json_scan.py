r"""Where a JSON object ends in a growing text, read once: the streaming detectors' scanner.

A streamed answer grows a few characters at a time. ``ObjectScan`` reads the
JSON object an answer starts with as it grows, keeping its place (the open
containers, an open string, number or word) between calls, so a stream of any
length is read in time linear in its length; an explicit stack, no recursion.
It tells a valid unfinished prefix from text that cannot be an object, checks
the top-level keys against those allowed (escaped keys read as what they
decode to: ``"n\u0061me"`` is ``"name"``), and notes where the first top-level
``"name"`` value starts. ``json_object_end`` is one such reading of a whole
text (the forced call's constraint uses it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from kvrag_integrations.engine.tools.json_text import FAILED, json_string_prefix, load_json

_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_NUMBER_CHARS = re.compile(r"[-+0-9.eE]*")
# a string's characters up to a quote, an escape or a control character
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]*')
_WS_RUN = re.compile(r"[ \t\n\r]*")
_LITERALS = ("true", "false", "null")


def _finite_number(text: str) -> bool:
    """Whether a JSON number's text is one a float holds (``1e999`` is not)."""
    if not _NUMBER.fullmatch(text):
        return False
    return text.lstrip("-").isdigit() or math.isfinite(float(text))


def key_may_be(raw: str, keys: Sequence[str], closed: bool) -> bool:
    """Whether the JSON string ``raw`` (from its opening quote; ``closed``: to its
    closing one) is, or may still become, one of ``keys``: escapes are read as
    what they decode to, an escape cut short at the end as what may follow."""
    if closed:
        key = load_json(raw)
        return key is not FAILED and key in keys
    prefix = json_string_prefix(raw[1:])
    return prefix is not None and any(k.startswith(prefix) for k in keys)


class ObjectScan:
    """The JSON object ``text[start:]`` begins, read as ``text`` grows (``feed``).

    Each ``feed`` reads only what was added since the last one: the text it is
    given must extend the last one fed. ``one_key``: the object holds one key
    (a second is invalid). ``keys``: its top-level keys must be among these
    (None: any; empty: only ``{}``).

    Attributes:
        name_at: where the value of the first top-level ``"name"`` key starts
            (-1 until it is read).
        name_end: the index past that value once it is read whole (-1 before).
    """

    def __init__(
        self, start: int = 0, one_key: bool = False, keys: Sequence[str] | None = None
    ) -> None:
        self.one_key, self.keys = one_key, keys
        self.stack: list[str] = []
        self.expect = "value"
        self.i = start  # the next character to read, or the open token's start
        self.token = ""  # an open token: "string", "key", "number" or "word"
        self.j = start  # where reading inside the open token goes on
        self.end: int | None = None  # decided: the index past the object, or -1
        self.top_key: object = None  # the last top-level key read
        self.name_at = self.name_end = -1

    def feed(self, text: str) -> int | None:
        """The index past the object's ``}``; None while ``text`` is a valid
        unfinished prefix of one; -1 if it cannot be one."""
        if self.end is None:
            self.end = self._read(text)
        return self.end

    def _read(self, text: str) -> int | None:
        n = len(text)
        while True:
            if self.token:
                closed = self._token(text, n)
                if closed is None or closed == -1:
                    return closed
            self.i = _WS_RUN.match(text, self.i).end()
            if self.i >= n:
                return None
            done = self._step(text[self.i], text)
            if done is not None:
                return done

    def _step(self, c: str, text: str) -> int | None:
        """Read the character ``c`` at ``self.i``; an end (or -1) once decided."""
        expect, stack = self.expect, self.stack
        if expect in ("value", "value_or_close"):
            if not stack and c != "{":
                return -1
            if len(stack) == 1 and self.top_key == "name" and self.name_at < 0:
                self.name_at = self.i  # the first top-level "name" value, whatever it is
            if c == "]" and expect == "value_or_close":
                stack.pop()
                self.i += 1
                self.expect = "after"
            elif c in "{[":
                stack.append(c)
                self.i += 1
                self.expect = "key_or_close" if c == "{" else "value_or_close"
                return None
            else:
                self.token = "string" if c == '"' else "number" if c in "-0123456789" else "word"
                self.j = self.i + (c == '"')
                return None
        elif expect in ("key", "key_or_close"):
            if c == "}" and expect == "key_or_close":
                stack.pop()
                self.i += 1
                self.expect = "after"
            elif c == '"':
                self.token, self.j = "key", self.i + 1
                return None
            else:
                return -1
        elif expect == "colon":
            if c != ":":
                return -1
            self.i += 1
            self.expect = "value"
            return None
        else:  # after a value: a comma or the container's close
            top = stack[-1]
            if c == "," and self.one_key and len(stack) == 1:
                return -1
            if c == ",":
                self.i += 1
                self.expect = "key" if top == "{" else "value"
                return None
            if c != ("}" if top == "{" else "]"):
                return -1
            stack.pop()
            self.i += 1
            self.expect = "after"
        if self.expect == "after":
            if not stack:
                return self.i
            self.expect = "comma_after"
        return None

    def _token(self, text: str, n: int) -> int | None:
        """Read on in the open token: 0 once it closed (``self.i`` past it), None
        while it is open at the end of ``text``, -1 where it is invalid."""
        token, start = self.token, self.i
        if token in ("string", "key"):
            j = self.j
            while True:
                j = _STRING_RUN.match(text, j).end() if j < n else j
                if j >= n:
                    self.j = j
                    if token == "key" and not self._key_ok(text[start:n], closed=False):
                        return -1
                    return None
                c = text[j]
                if c == '"':
                    j += 1
                    break
                if c != "\\":
                    return -1  # a raw control character
                j += 2
            if token == "key":
                if not self._key_ok(text[start:j], closed=True):
                    return -1
                if len(self.stack) == 1:
                    self.top_key = load_json(text[start:j])
                self.expect = "colon"
            else:
                self.expect = "after"
        elif token == "number":
            j = _NUMBER_CHARS.match(text, self.j).end()
            if j >= n:
                self.j = j
                return None
            if not _finite_number(text[start:j]):
                return -1
            self.expect = "after"
        else:
            word = next((w for w in _LITERALS if text.startswith(w, start)), None)
            if word is None:
                return None if any(w.startswith(text[start:n]) for w in _LITERALS) else -1
            j = start + len(word)
            self.expect = "after"
        if len(self.stack) == 1 and start == self.name_at:
            self.name_end = j
        self.token, self.i = "", j
        if self.expect == "after" and self.stack:
            self.expect = "comma_after"
        return 0

    def _key_ok(self, raw: str, closed: bool) -> bool:
        return self.keys is None or len(self.stack) != 1 or key_may_be(raw, self.keys, closed)


def json_object_end(
    text: str, one_key: bool = False, keys: Sequence[str] | None = None
) -> int | None:
    r"""Where the JSON object that ``text`` starts with ends (index past its ``}``);
    None while ``text`` is a valid unfinished prefix of one; -1 if it cannot be one.
    ``one_key``: the object holds one key (a second is invalid). ``keys``: the
    object's keys must be among these (None: any; empty: only ``{}``).

    Examples:
        >>> json_object_end('{"q": [1, "a"]} tail'), json_object_end('{"q": tr')
        (15, None)
        >>> json_object_end("["), json_object_end('{"q": 01}'), json_object_end('{"q": 1e999}')
        (-1, -1, -1)
        >>> json_object_end('{"x', keys=["q"]), json_object_end("{}", keys=[])
        (-1, 2)
        >>> json_object_end('{"\\u0071": 1}', keys=["q"])  # an escaped key: what it decodes to
        13
    """
    return ObjectScan(0, one_key, keys).feed(text)
