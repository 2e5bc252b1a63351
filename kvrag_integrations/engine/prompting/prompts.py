"""A request's prompt as segments: question and chunks, segments or messages, templated.

``build_segments`` is what every engine's ``build_segments`` runs (with its
tokenizer and chunk index; it knows no engine): it checks which
form the prompt came in, splits messages' strings at known chunks
(``spans.message_segments``) and renders the chat template around them
(``chat_template.render_chat``), chunks intact.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from kvrag_integrations.engine.prompting.chat_template import Message, render_chat
from kvrag_integrations.engine.prompting.segments import (
    DEFAULT_INSTRUCTION,
    Chunk,
    Segment,
    Text,
    check_text,
    rag_user_segments,
)
from kvrag_integrations.engine.prompting.spans import ChunkIndex, message_segments

logger = logging.getLogger("kvrag_integrations.engine.engine")

_ROLE_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")

PROMPT_ARGS = ("segments", "messages", "known_chunks", "system_prompt", "chat_template")
"""The keyword arguments of ``generate`` / ``stream`` / ``astream`` that make the
prompt (with ``question`` and ``chunks``); the others are its ``RequestOptions``."""


def build_segments(
    tokenizer: Any,
    chunk_index: ChunkIndex,
    *,
    question: str | None = None,
    chunks: Sequence[str] | None = None,
    segments: Sequence[Segment] | None = None,
    messages: Sequence[dict[str, Any]] | None = None,
    known_chunks: Sequence[str] = (),
    system_prompt: str | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
    chat_template: bool = True,
) -> list[Segment]:
    """The prompt as segments, with the chat template applied if asked
    (``EngineFrontend.build_segments`` calls it with the engine's own).

    Exactly one of:

    - ``question`` (with optional ``chunks``): the default RAG layout;
    - ``segments``: the user message (or, with ``chat_template=False``, the
      whole prompt) as ``Text`` / ``Chunk`` segments;
    - ``messages``: ``{"role", "content"}`` dicts whose content is a string
      or a list of strings and segments. Strings are split where a known
      chunk appears: one the engine has encoded (``chunk_index``), or
      one of ``known_chunks`` (``spans.message_segments``).
    """
    if sum(x is not None for x in (question, segments, messages)) != 1:
        raise ValueError("pass exactly one of question (with chunks), segments or messages")
    if chunks is not None and question is None:
        raise ValueError("chunks go with question; use segments or messages otherwise")
    if isinstance(chunks, str):
        raise TypeError("chunks must be a list of strings, not one string")
    chat: list[Message] = []
    if system_prompt is not None:
        chat.append(("system", [Text(check_text(system_prompt, "system_prompt"))]))
    if messages is not None:
        chat += [_message(m, chunk_index, known_chunks) for m in messages]
    elif segments is not None:
        bad = [type(x).__name__ for x in segments if not isinstance(x, (Text, Chunk))]
        if bad:
            raise TypeError(f"segments must be Text or Chunk, got {bad[0]}")
        chat.append(("user", list(segments)))
    else:
        chat.append(("user", rag_user_segments(question, list(chunks or []), instruction)))
    if chat_template and not getattr(tokenizer, "chat_template", None):
        logger.info("tokenizer has no chat template; using the plain prompt")
        chat_template = False
    if chat_template:
        return render_chat(tokenizer, chat)
    flat: list[Segment] = []
    if segments is None:  # a prompt we lay out (``segments`` are the prompt as given)
        bos = leading_bos(tokenizer)
        if bos is not None:
            flat.append(Text(bos, markup=True))
    for role, content in chat:
        flat += content
        if role == "system":
            flat.append(Text("\n\n"))
    if question is not None:
        flat.append(Text(PLAIN_ANSWER_CUE))  # a base model continues from here
    return flat


# Ends the plain (no chat template) RAG prompt, as LlamaIndex's default QA prompt
# ends with "Answer: ": without it a base model continues the question.
PLAIN_ANSWER_CUE = "\nAnswer:"


def leading_bos(tokenizer: Any) -> str | None:
    """The BOS token string if the tokenizer starts every text with it (Gemma,
    Llama base models: ``tokenizer(text)`` adds it), else None.

    Chat templates write BOS themselves where the model wants it; a prompt laid
    out without one needs it added, or the model (Gemma above all) answers from
    a prompt it never saw in training.
    """
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if bos is None or bos_id is None:
        return None
    try:
        ids = tokenizer("a")["input_ids"]
    except Exception:  # a tokenizer that cannot say: add nothing
        return None
    return bos if ids and ids[0] == bos_id else None


def _message(
    message: dict[str, Any], chunk_index: ChunkIndex, known_chunks: Sequence[str]
) -> Message:
    if not isinstance(message, dict) or "role" not in message or "content" not in message:
        raise TypeError('each message must be a dict with "role" and "content"')
    role = message["role"]
    if not isinstance(role, str):
        raise TypeError(f"a message role must be a str, got {type(role).__name__}")
    if not _ROLE_RE.fullmatch(role):  # the template writes roles as markup
        raise ValueError(f"a message role must be a plain name like 'user', got {role!r}")
    return role, message_segments(message["content"], chunk_index, known_chunks)
