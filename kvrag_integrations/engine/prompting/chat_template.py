"""Rendering a model's chat template around slots: the one place sentinels are used.

A chat template is a program over message strings, so where a piece of content
lands in its output is only known by rendering. Content that must keep its own
token ids (a chunk, a reranked document, a query) goes in as a slot: a sentinel
string carrying a random nonce drawn per call (no text can forge one), and the
rendered text is cut at the sentinels. ``render_slots`` does that for any
caller; ``render_chat`` turns the engine's messages of ``Text`` / ``Chunk``
segments into prompt segments with it.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any, Final

from kvrag_integrations.engine.prompting.segments import Chunk, Segment, Text
from kvrag_integrations.engine.prompting.tokenize import control_token_strings


class _Slot:
    def __repr__(self) -> str:
        return "SLOT"


SLOT: Final = _Slot()
"""Marks a slot in ``render_slots`` message content."""

SlottedMessage = tuple[str, Sequence["str | _Slot"]]  # (role, texts written in place and slots)
Message = tuple[str, Sequence[Segment]]  # (role, content segments)


def _sentinel(nonce: str, i: int) -> str:
    # Letters and digits only, so that templates that trim or JSON-escape
    # content (``| trim``, ``| tojson``) keep it; the random nonce makes it
    # unforgeable, the closing "y" keeps slot 1 from matching slot 10.
    return f"kvrag{nonce}x{i}y"


class SlotAlteredError(ValueError):
    """The chat template dropped, repeated, altered or reordered a slot
    (``slot``: the first one lost; None: reordered)."""

    def __init__(self, message: str, slot: int | None) -> None:
        super().__init__(message)
        self.slot = slot


def render_slots(
    tokenizer: Any,
    messages: Sequence[SlottedMessage],
    tools: Sequence[dict[str, Any]] | None = None,
    extras: Sequence[dict[str, Any]] | None = None,
) -> list[str]:
    """Render ``messages`` with the chat template and cut the result at the slots.

    Each message's content is its strings written in place with a sentinel for
    every ``SLOT``; the generation prompt for the assistant is appended.

    Args:
        tokenizer: a tokenizer with ``chat_template``.
        messages: ``(role, content)`` pairs; content items are strings or ``SLOT``.
        tools: OpenAI function tools, passed as the template's ``tools``.
        extras: per message, more keys of its dict (an assistant's ``tool_calls``,
            a tool message's ``tool_call_id`` / ``name``).

    Returns:
        The rendered text around the slots: one more string than there are slots.

    Raises:
        SlotAlteredError: (a ``ValueError``) the template dropped, repeated,
            altered or reordered a slot.

    Examples:
        >>> class Tok:
        ...     def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        ...         return "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        >>> render_slots(Tok(), [("user", ["Doc: ", SLOT, " Q: ", SLOT])])
        ['<user>Doc: ', ' Q: ', '</>']
    """
    nonce = secrets.token_hex(16)
    count = 0
    dicts = []
    for role, content in messages:
        text = ""
        for item in content:
            if item is SLOT:
                text += _sentinel(nonce, count)
                count += 1
            else:
                text += item
        dicts.append({"role": role, "content": text})
    for message, extra in zip(dicts, extras or ()):
        message.update(extra)
    more = {"tools": list(tools)} if tools else {}
    rendered = tokenizer.apply_chat_template(
        dicts, tokenize=False, add_generation_prompt=True, **more
    )
    parts: list[str] = []
    rest = rendered
    for i in range(count):
        before, found, rest = rest.partition(_sentinel(nonce, i))
        if not found or _sentinel(nonce, i) in rest:
            raise SlotAlteredError(
                "the chat template dropped, repeated or altered a placeholder", i
            )
        parts.append(before)
    if f"kvrag{nonce}x" in rest:
        raise SlotAlteredError("the chat template reordered the message placeholders", None)
    parts.append(rest)
    return parts


def render_chat(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: Sequence[dict[str, Any]] | None = None,
    extras: Sequence[dict[str, Any]] | None = None,
) -> list[Segment]:
    """Render chat messages with the model's template, keeping chunks intact.

    Every piece of message content (text and chunks) goes into the template as a
    slot (``render_slots``): the template's own text comes back as markup (its
    control tokens are real), the messages' text and chunks as literal
    segments, and chunks keep the ids of their stored caches. The generation
    prompt for the assistant is appended.

    A template that rewrites message text (``| trim``, say) is detected by
    rendering the plain text too; it is then rendered the old way (text in place,
    chunks as slots), and text holding a control-token string is refused since
    it could not be kept literal there.

    Args:
        tokenizer: a tokenizer with ``chat_template``.
        messages: ``(role, segments)`` pairs, e.g. ``[("user", [Text("Q"), Chunk(c)])]``.
        tools: JSON-schema tools the template renders, as ``render_slots``'s.
        extras: extra template variables, as ``render_slots``'s.
    """
    slotted: list[SlottedMessage] = []
    slots: list[Segment] = []
    for role, content in messages:
        filled = [seg for seg in content if seg.text]
        slotted.append((role, [SLOT] * len(filled)))
        slots += filled
    plain = [(role, ["".join(seg.text for seg in content)]) for role, content in messages]
    plain_text = render_slots(tokenizer, plain, tools, extras)[0]
    try:
        out = _between(render_slots(tokenizer, slotted, tools, extras), slots)
    except SlotAlteredError:  # the template rewrites some content (``| tojson``)
        out = None
    if out is not None and "".join(seg.text for seg in out) == plain_text:
        return out
    return _render_in_place(tokenizer, messages, tools, extras, plain_text)


def _render_in_place(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: Sequence[dict[str, Any]] | None,
    extras: Sequence[dict[str, Any]] | None,
    plain_text: str,
) -> list[Segment]:
    """Fallback for templates that rewrite text: only chunks are slots, and only
    in messages whose chunks the template keeps as they are (``plain_text``:
    the template's rendering of the plain messages)."""
    controls = control_token_strings(tokenizer)
    slotted_messages = set(range(len(messages)))  # messages whose chunks are slots
    while True:
        chunks: list[Segment] = []
        owners: list[int] = []
        slotted: list[SlottedMessage] = []
        for m, (role, content) in enumerate(messages):
            items: list[str | _Slot] = []
            for seg in content:
                if isinstance(seg, Chunk) and m in slotted_messages:
                    items.append(SLOT)
                    chunks.append(seg)
                    owners.append(m)
                    continue
                if not getattr(seg, "markup", False) and any(c in seg.text for c in controls):
                    raise ValueError(
                        "this chat template rewrites message text, so a control-token "
                        f"string in it ({next(c for c in controls if c in seg.text)!r}) "
                        "cannot be kept literal; remove it or pass it inside a chunk"
                    )
                items.append(seg.text)
            slotted.append((role, items))
        if not chunks:
            return _between(render_slots(tokenizer, slotted, tools, extras), [])
        try:
            out = _between(render_slots(tokenizer, slotted, tools, extras), chunks)
        except SlotAlteredError as err:  # that message's chunks: written in place
            slotted_messages -= {owners[err.slot]} if err.slot is not None else set(owners)
            continue
        if "".join(seg.text for seg in out) == plain_text:
            return out
        slotted_messages -= set(owners)  # a chunk's text changed around its slot


def _between(parts: Sequence[str], slots: Sequence[Segment]) -> list[Segment]:
    """The template's text (markup ``Text``) around the slots' segments, empty text dropped."""
    out: list[Segment] = []
    for before, seg in zip(parts, slots):
        out += [Text(before, markup=True), seg]
    out.append(Text(parts[-1], markup=True))
    return [s for s in out if not (isinstance(s, Text) and not s.text)]
