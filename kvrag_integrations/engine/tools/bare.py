"""Bare JSON calls: the whole answer JSON call objects, ``;`` between, read as it grows.

The leading form of the bare-JSON and Llama families (``ToolFamily._lead_scan``).
Each object names a bound tool, holds its arguments and no keys but ``name``,
``id`` and the arguments' key; anything else is text, so a user who asked for
JSON gets it: ``{"name": "Alice", "age": 30}``, ``{"name": "search"}`` with no
arguments, calls followed by prose. The first top-level ``"name"`` decides as
soon as it is read: a string that cannot become a bound tool's name (its
escapes decoded) makes the answer text at once, streamed or not.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from typing import Any

from kvrag_integrations.engine.tools.calls import call_object
from kvrag_integrations.engine.tools.detect import CALLS, MAYBE, LeadScan
from kvrag_integrations.engine.tools.json_scan import ObjectScan
from kvrag_integrations.engine.tools.json_text import json_string_prefix, load_json

_WS_RUN = re.compile(r"[ \t\n\r]*")


class BareCalls(LeadScan):
    """The answer as bare call objects to ``names``."""

    def __init__(self, names: Collection[str], arg_keys: Sequence[str]) -> None:
        self.names, self.arg_keys = names, tuple(arg_keys)
        self.keys = ("name", "id", *self.arg_keys)
        self.calls: list[dict[str, Any]] = []
        self.at = 0  # where reading goes on between objects
        self.scan: ObjectScan | None = None  # the object being read
        self.obj_at = 0  # where it starts
        self.name_ok: bool | None = None  # its first name, once read whole
        self.after = False  # a call was read: ";" or the end follow

    def result(self, text: str) -> tuple[list[dict[str, Any]], list[tuple[str | None, str, str]]]:
        return self.calls, []

    def _read(self, text: str) -> str | None:
        n = len(text)
        while True:
            if self.scan is None:
                self.at = _WS_RUN.match(text, self.at).end()
                if self.at == n:
                    return CALLS if self.after else MAYBE
                if self.after:  # a call, then ";" and the next one
                    if text[self.at] != ";":
                        return None
                    self.at += 1
                    self.after = False
                    continue
                if text[self.at] != "{":
                    return None
                self.obj_at, self.name_ok = self.at, None
                self.scan = ObjectScan(self.at, keys=self.keys)
            end = self.scan.feed(text)
            if end == -1 or not self._name_may_be(text):
                return None
            if end is None:
                return MAYBE
            call = call_object(load_json(text[self.obj_at : end]), self.names, self.arg_keys, True)
            if call is None:
                return None
            self.calls.append(call)
            self.at, self.scan, self.after = end, None, True

    def _name_may_be(self, text: str) -> bool:
        """Whether the object's first top-level ``"name"``, as far as read, may be a
        bound tool's (True until it is read)."""
        scan = self.scan
        assert scan is not None
        if self.name_ok is not None:
            return self.name_ok
        if scan.name_at < 0:
            return True
        if text[scan.name_at] != '"':  # a name that is no string names no tool
            self.name_ok = False
            return False
        if scan.name_end >= 0:
            name = load_json(text[scan.name_at : scan.name_end])
            self.name_ok = isinstance(name, str) and name in self.names
            return self.name_ok
        prefix = json_string_prefix(text[scan.name_at + 1 :])
        return prefix is not None and any(name.startswith(prefix) for name in self.names)
