"""Mistral calls, in the two forms Mistral's tokenizers write them.

As vLLM's ``mistral`` parser reads them, the text before the first
``[TOOL_CALLS]`` control token is the content, and after it:

- before v11 (Mistral-7B-Instruct-v0.3): a JSON list of call objects,
  ``[TOOL_CALLS][{"name": .., "arguments": .., "id": ..}, ..]``; what follows
  the list is dropped;
- v11 and later (Mistral-Small-3.1/3.2, Ministral, Devstral): one marker per
  call, ``[TOOL_CALLS]name[ARGS]{..}``, or ``name{..}`` without ``[ARGS]``, with
  ``[CALL_ID]id`` between name and arguments where the model writes one.

The form is read from what follows the marker, so one family serves both.
Mistral's templates take only 9-character call ids ("Tool call IDs should be
alphanumeric strings with length 9!"): a call's own such id is kept, others are
made in that form, and ids going back into the template are mapped onto it
(``template_call_id``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection
from typing import Any, ClassVar

from kvrag_integrations.engine.tools.calls import hashed_id
from kvrag_integrations.engine.tools.family import ToolFamily, call_items, read_call_objects
from kvrag_integrations.engine.tools.json_text import decode_json

TOOL_CALLS = "[TOOL_CALLS]"
ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"
# v11+: a call's name, its id where written, then [ARGS] or the arguments' brace
_NAMED_CALL = re.compile(
    r"\s*(?P<name>[A-Za-z0-9_.:-]{1,128})\s*"
    r"(?:\[CALL_ID\]\s*(?P<id>[A-Za-z0-9]{1,64})\s*)?(?:\[ARGS\])?(?=\s*\{)"
)
_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def mistral_call_id(call_id: str) -> str:
    """``call_id`` as Mistral's templates take it: 9 letters or digits. Another id
    (OpenAI's ``call_...``) maps onto one by its hash, so a call and the tool
    message answering it keep the same id.

    Examples:
        >>> mistral_call_id("a1B2c3D4e"), len(mistral_call_id("call_0123456789abcdef"))
        ('a1B2c3D4e', 9)
    """
    if _ID.fullmatch(call_id):
        return call_id
    digest = hashlib.sha256(call_id.encode()).digest()
    return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:9])


class MistralFamily(ToolFamily):
    """``[TOOL_CALLS]`` and a JSON list of calls with 9-character ids."""

    name: ClassVar[str] = "mistral"
    markers: ClassVar[tuple[str, ...]] = (TOOL_CALLS,)
    opening: ClassVar[str] = TOOL_CALLS + "["
    closing: ClassVar[str] = "]"
    call_markup: ClassVar[tuple[str, ...]] = (CALL_ID, ARGS)
    markup: ClassVar[tuple[str, ...]] = (
        TOOL_CALLS,
        "[TOOL_RESULTS]",
        "[/TOOL_RESULTS]",
        "[AVAILABLE_TOOLS]",
        "[/AVAILABLE_TOOLS]",
        ARGS,
        CALL_ID,
    )

    @classmethod
    def matches(cls, template: str) -> bool:
        return TOOL_CALLS in template

    def _lead_scan(self, names: Collection[str]) -> None:
        return None  # every call is marked

    def _marked(
        self, text: str, marker: str, names: Collection[str]
    ) -> tuple[list[dict[str, Any]], list[tuple[str | None, str, str]]]:
        body = text[len(marker) :]
        while body.lstrip().startswith(TOOL_CALLS):  # repeated markers count as one
            body = body.lstrip()[len(TOOL_CALLS) :]
        if body.lstrip().startswith(("[", "{")) or not body.strip():
            found = decode_json(body)  # the first JSON value is the calls, the rest dropped
            body = body[: found[1]] if found else body
            return read_call_objects(body, names, ("arguments",), text, TOOL_CALLS)
        return _named_calls(text, names)

    def call_id(self, seed: bytes, index: int) -> str:
        return hashed_id(seed, index, _ALNUM, 9)

    def valid_own_id(self, call_id: Any) -> bool:
        return isinstance(call_id, str) and _ID.fullmatch(call_id) is not None

    def template_call_id(self, call_id: str) -> str:
        return mistral_call_id(call_id)


def _named_calls(
    text: str, names: Collection[str]
) -> tuple[list[dict[str, Any]], list[tuple[str | None, str, str]]]:
    """v11+ calls, ``[TOOL_CALLS]name[ARGS]{..}`` each: all of them, or one invalid
    call carrying ``text``. Markers with nothing between count as one; text after
    a call's arguments is dropped, as vLLM drops it."""
    items: list[dict[str, Any]] = []
    for segment in text.split(TOOL_CALLS)[1:]:
        if not segment.strip():
            continue
        head = _NAMED_CALL.match(segment)
        if head is None:
            return [], [(None, text, f"{TOOL_CALLS} holds no name{ARGS}{{...}} call")]
        name = head.group("name")
        found = decode_json(segment, head.end())
        if found is None:
            return [], [(name, text, f"{TOOL_CALLS} calls {name!r} with no JSON object")]
        items.append({"name": name, "arguments": found[0], "id": head.group("id")})
    if not items:
        return [], [(None, text, f"{TOOL_CALLS} holds no call")]
    return call_items(items, names, ("arguments",), text, TOOL_CALLS)
