"""One class per tool-calling format: ``ToolFamily``, and picking one from a template.

As transformers' ``cache_utils`` has one class per kind of layer, each format
a model writes calls in is one ``ToolFamily`` subclass, in one module with its
markup: ``hermes`` (Qwen2.5/Qwen3, Hermes, and the fallback prompt for
templates without tools), ``llama`` (Llama 3.1+ JSON, ``<|python_tag|>``),
``mistral`` (``[TOOL_CALLS]``) and ``pythonic`` (Gemma 3 / vLLM's pythonic
list). A family owns:

- its markers (text that opens calls anywhere in an answer) and, for formats
  whose calls are the whole answer (a bare JSON object, a Python list), the
  leading form (``_lead_scan``: calls, "maybe" while a prefix, or no call);
- its parser (``parse``): calls to bound tools, the text besides them, and
  ``InvalidToolCall``s where its markup opens something that is no valid call;
  it never raises, whatever the model wrote;
- its streaming detector (``detector``, ``detect.ContentDetector``): how much
  of a partial answer is text whatever follows (streamed at once), so streamed
  text is always a prefix of ``parse``'s content; it reads each character of a
  stream once;
- its call-id rule and the ids its template takes (``template_call_id``);
- its forced call: the markup a forced call opens with and the JSON call
  object the constraint (``constraint.ForcedCall``) keeps valid.

``family_for`` picks the class once per request from the call syntax of the
tokenizer's chat template (``matches``); nothing is guessed from the answer.
Adding a format is adding a subclass to ``FAMILIES``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

from kvrag_integrations.engine.tools.bare import BareCalls
from kvrag_integrations.engine.tools.calls import (
    InvalidToolCall,
    Parsed,
    ToolCall,
    call_arguments,
    call_object,
    hashed_id,
)
from kvrag_integrations.engine.tools.detect import MAYBE, ContentDetector, LeadScan
from kvrag_integrations.engine.tools.json_text import close_call, decode_json, load_json

_HEX = "0123456789abcdef"


class ToolFamily:
    """A tool-call format (this base: bare JSON call objects, the whole answer).

    Attributes:
        name: the family's name (logs, tests).
        native: the chat template renders tools itself (else the fallback prompt).
        args_key: the arguments' key in the call object the model writes.
        markers: text that opens calls anywhere in an answer.
        opening: what a forced call starts with (the prompt ends with it).
        closing: what closes a call the family writes as text.
        arg_keys: keys a call object may hold besides ``name``.
        call_markup: markup inside a call, after its marker (Mistral's
            ``[ARGS]``): an answer keeps it as text (``answer_markup``).
        markup: every string of this format's markup (markers, result and tool
            list wrappers): an added token with one of them is structural, never
            produced by literal text (``prompting.tokenize.structural_tokens``).
    """

    name: ClassVar[str] = "json"
    native: ClassVar[bool] = True
    args_key: ClassVar[str] = "arguments"
    markers: ClassVar[tuple[str, ...]] = ()
    opening: ClassVar[str] = ""
    closing: ClassVar[str] = ""
    arg_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")
    call_markup: ClassVar[tuple[str, ...]] = ()
    markup: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def matches(cls, template: str) -> bool:
        """Whether a chat template (one with ``tools``) writes or asks for calls in
        this format: its call syntax, not a word it may hold for another reason
        (this base: any template, the last tried)."""
        return True

    @property
    def answer_markup(self) -> tuple[str, ...]:
        """The markup an answer's text keeps where it is one special token (which
        plain decoding skips): the markers and the markup inside a call."""
        return self.markers + self.call_markup

    # ------------------------------------------------------------- parsing
    def parse(self, text: str, names: Collection[str], seed: bytes = b"") -> Parsed:
        """``text`` read as this family writes calls; never raises.

        A leading form (``_leading``) that is calls makes the whole answer calls;
        else the first marker splits the text before it (the content, trailing
        whitespace dropped) from the calls after it (``_marked``); text with
        neither is all content. ``seed`` draws the calls' ids.
        """
        lead = self._leading(text, names)
        if isinstance(lead, tuple):
            calls, invalid = lead
            return self._ided("", calls, invalid, seed)
        at, marker = self._first_marker(text)
        if marker is None:
            return Parsed(text)
        calls, invalid = self._marked(text[at:], marker, names)
        return self._ided(text[:at].rstrip(), calls, invalid, seed)

    def content_end(self, text: str, names: Collection[str]) -> int:
        """How much of the partial answer ``text`` is content whatever follows
        (a fresh ``detector``'s answer for the whole text)."""
        return self.detector(names).end(text)

    def detector(self, names: Collection[str]) -> ContentDetector:
        """A streaming detector for one answer: nothing while a leading form may
        still be calls; else up to the first marker, or the end less what may
        begin a marker; trailing whitespace held (dropped before a call)."""
        return ContentDetector(self.markers, lambda: self._lead_scan(names))

    def _lead_scan(self, names: Collection[str]) -> LeadScan | None:
        """The whole answer as this family's bare calls, read as it grows (None:
        the family has no leading form). This base: JSON call objects naming
        bound tools, ``;``-separated (``bare.BareCalls``)."""
        return BareCalls(names, self.arg_keys)

    def _leading(
        self, text: str, names: Collection[str]
    ) -> tuple[list[dict[str, Any]], list[tuple[str | None, str, str]]] | str | None:
        """The whole answer as this family's bare calls: ``(calls, invalid)`` where
        it is that; ``MAYBE`` while a prefix of it; None where it cannot be."""
        scan = self._lead_scan(names)
        state = None if scan is None else scan.feed(text)
        if state is None or state == MAYBE:
            return state
        assert scan is not None
        return scan.result(text)

    def _marked(
        self, text: str, marker: str, names: Collection[str]
    ) -> tuple[list[dict[str, Any]], list[tuple[str | None, str, str]]]:
        """Calls from ``text`` (which starts with ``marker``); this base has none."""
        return [], [(None, text, f"{self.name} calls have no marker {marker!r}")]

    def _first_marker(self, text: str) -> tuple[int, str | None]:
        hits = [(text.find(m), m) for m in self.markers if m in text]
        return min(hits) if hits else (len(text), None)

    def _ided(
        self,
        content: str,
        calls: Sequence[Mapping[str, Any]],
        invalid: Sequence[tuple[str | None, str, str]],
        seed: bytes,
    ) -> Parsed:
        out = []
        for i, call in enumerate(calls):
            own = call.get("id")
            call_id = own if self.valid_own_id(own) else self.call_id(seed, i)
            out.append(ToolCall(call["name"], call["arguments"], call_id))
        bad = tuple(
            InvalidToolCall(name, raw, self.call_id(seed, len(calls) + i), error)
            for i, (name, raw, error) in enumerate(invalid)
        )
        return Parsed(content, tuple(out), bad)

    # ------------------------------------------------------------- ids
    def call_id(self, seed: bytes, index: int) -> str:
        """A call's id where the model wrote none: ``call_`` and 24 hex digits drawn
        from the request and answer (``seed``), so a streamed answer's ids equal
        its invoked twin's."""
        return "call_" + hashed_id(seed, index, _HEX, 24)

    def valid_own_id(self, call_id: Any) -> bool:
        """Whether an id the model wrote in a call is kept (this base: none is)."""
        return False

    def template_call_id(self, call_id: str) -> str:
        """A call id in the form this family's template takes (this base: as given)."""
        return call_id

    def template_ids(self, extra: Mapping[str, Any]) -> dict[str, Any]:
        """A message's ``tool_calls`` ids and ``tool_call_id`` as the template takes them."""
        out = dict(extra)
        if isinstance(out.get("tool_call_id"), str):
            out["tool_call_id"] = self.template_call_id(out["tool_call_id"])
        if "tool_calls" in out:
            out["tool_calls"] = [
                {**c, "id": self.template_call_id(c["id"])} if isinstance(c.get("id"), str) else c
                for c in out["tool_calls"]
            ]
        return out

    # ------------------------------------------------------------- writing
    def call_text(self, calls: Sequence[Mapping[str, Any]]) -> str:
        """Earlier calls written as this family writes them (templates that render
        no ``tool_calls``: the calls become the message's text)."""
        parts = []
        for call in calls:
            function = call.get("function", call)
            args = call_arguments(function.get("arguments"))
            body = json.dumps({"name": function.get("name"), self.args_key: args})
            parts.append(f"{self.opening}{body}{self.closing}")
        return "\n".join(parts)

    # ------------------------------------------------------------- forced calls
    def forced_start(
        self, forced: Sequence[str], schemas: Mapping[str, Any]
    ) -> tuple[str, list[str], str]:
        """A forced call's JSON start written into the prompt after ``opening``, what
        may follow it before the arguments, and the arguments' start it wrote
        (``constraint.ForcedCall`` checks the rest).

        One tool: ``{"name": "<tool>", "<args key>": `` and, where its schema
        requires properties, ``{"<first>": `` (and ``"`` if it is a string: a
        small model then fills in a value rather than copying the schema);
        several: ``{"name": "`` and each ``<tool>", "<args key>": ``.

        Examples:
            >>> schema = {"properties": {"q": {"type": "string"}}, "required": ["q"]}
            >>> ToolFamily().forced_start(["search"], {"search": schema})
            ('{"name": "search", "arguments": {"q": "', [''], '{"q": "')
        """
        key = self.args_key
        heads = [f'{json.dumps(name)[1:-1]}", "{key}": ' for name in forced]
        if len(heads) > 1:
            return '{"name": "', heads, ""
        schema = schemas.get(forced[0]) or {}
        required = schema.get("required") if isinstance(schema, Mapping) else None
        args = ""
        if isinstance(required, list) and required and isinstance(required[0], str):
            args = "{" + json.dumps(required[0]) + ": "
            prop = (schema.get("properties") or {}).get(required[0])
            if isinstance(prop, Mapping) and prop.get("type") == "string":
                args += '"'  # a string value: its quote written, the model writes the text
        return '{"name": "' + heads[0] + args, [""], args

    def forced_call(self, written: str, forced: Collection[str], seed: bytes) -> Parsed | None:
        """The call a forced decode wrote (``written``: the JSON call object from its
        start, maybe cut short by ``max_new_tokens``, then closed); None when it
        cannot be closed into one."""
        value = load_json(close_call(written))
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            # the constraint writes only forced names: one cut short is the one it begins
            begun = [name for name in forced if name.startswith(value["name"])]
            if value["name"] not in forced and len(begun) == 1:
                value["name"] = begun[0]
        call = call_object(value, forced, (self.args_key,), bare=False)  # cut: maybe no arguments
        return None if call is None else self._ided("", [call], [], seed)


def read_call_objects(
    body: str,
    names: Collection[str],
    arg_keys: Sequence[str],
    raw: str,
    what: str,
    prose_after: bool = False,
) -> tuple[list[dict[str, Any]], list[tuple[str | None, str, str]]]:
    """A marked body: JSON call objects (or lists of them), ``;`` or whitespace
    between; all calls, or one invalid call carrying ``raw`` (``what``: the
    family's markup, named in the error). ``prose_after``: markup with no
    closing one, after whose calls text that opens no JSON value is dropped, as
    vLLM drops it."""
    calls: list[dict[str, Any]] = []
    rest = body.strip()
    while rest:
        if prose_after and calls and not rest.startswith(("{", "[")):
            break
        found = decode_json(rest)
        if found is None:
            return [], [(_name_in(rest), raw, f"{what} holds no valid JSON call object")]
        value, end = found
        found_calls, invalid = call_items(
            value if isinstance(value, list) else [value], names, arg_keys, raw, what
        )
        if invalid:
            return [], invalid
        calls += found_calls
        rest = rest[end:].lstrip().lstrip(";").lstrip()
    if not calls:
        return [], [(None, raw, f"{what} holds no call")]
    return calls, []


def call_items(
    items: Sequence[Any], names: Collection[str], arg_keys: Sequence[str], raw: str, what: str
) -> tuple[list[dict[str, Any]], list[tuple[str | None, str, str]]]:
    """``items`` (call objects a family's markup holds) as calls to bound tools: all
    of them, or one invalid call carrying ``raw`` that says why the first is none."""
    calls: list[dict[str, Any]] = []
    for item in items:
        call = call_object(item, names, arg_keys, bare=False)
        if call is None:
            return [], [(_name_of(item), raw, _why_not(item, names, what))]
        calls.append(call)
    return calls, []


def _name_of(item: Any) -> str | None:
    name = item.get("name") if isinstance(item, dict) else None
    return name if isinstance(name, str) else None


def _name_in(text: str) -> str | None:
    """The call's name where a malformed object shows one (``"name": "x"``)."""
    match = re.search(r'"name"\s*:\s*"([A-Za-z0-9_.:-]{1,128})"', text[:4096])
    return match.group(1) if match else None


def _why_not(item: Any, names: Collection[str], what: str) -> str:
    name = _name_of(item)
    if name is None:
        return f"{what} holds a value that is no call object with a name"
    if name not in names:
        return f"{what} calls {name!r}, which is not among the bound tools {sorted(names)}"
    return f"{what} calls {name!r} with arguments that are no JSON object"
