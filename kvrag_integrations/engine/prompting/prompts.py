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
from kvrag_integrations.engine.tools.calls import template_tool_calls
from kvrag_integrations.engine.tools.hermes import FallbackFamily
from kvrag_integrations.engine.tools.plan import ToolPlan, family_for

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
    tools: ToolPlan | None = None,
) -> list[Segment]:
    """The prompt as segments, with the chat template applied if asked
    (``EngineFrontend.build_segments`` calls it with the engine's own).

    ``tools``: rendered by the template (``tools=``) where it takes them, else
    as the fallback tool prompt in the system message (``tool_calls`` of
    earlier assistant messages then written as the model writes calls).

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
    extras: list[dict[str, Any]] = []
    if system_prompt is not None:
        chat.append(("system", [Text(check_text(system_prompt, "system_prompt"))]))
        extras.append({})
    if messages is not None:
        family = tools.family if tools is not None else family_for(tokenizer)
        for m in messages:
            message, extra = _message(m, chunk_index, known_chunks)
            extra = family.template_ids(extra)
            if "tool_calls" in extra and not (chat_template and family.native):
                calls = family.call_text(extra.pop("tool_calls"))
                content = list(message[1])
                message = (message[0], [*content, Text(("\n" if content else "") + calls)])
            chat.append(message)
            extras.append(extra)
    elif segments is not None:
        bad = [type(x).__name__ for x in segments if not isinstance(x, (Text, Chunk))]
        if bad:
            raise TypeError(f"segments must be Text or Chunk, got {bad[0]}")
        chat.append(("user", list(segments)))
    else:
        chat.append(("user", rag_user_segments(question, list(chunks or []), instruction)))
    if tools is not None and not tools.family.native:  # the template has no tools
        chat, extras = _with_tool_prompt(chat, extras, FallbackFamily.system_text(tools.tools))
    while len(extras) < len(chat):
        extras.append({})
    if chat_template and not getattr(tokenizer, "chat_template", None):
        logger.info("tokenizer has no chat template; using the plain prompt")
        chat_template = False
    if chat_template:
        native = tools.tools if tools is not None and tools.family.native else None
        try:
            return render_chat(tokenizer, chat, native, extras)
        except (ValueError, TypeError):
            raise
        except Exception:  # the template refused a role (jinja2's TemplateError)
            plain = None if native else _user_turn_roles(chat)
            if plain is None:
                raise
            return render_chat(tokenizer, plain, None, [{} for _ in plain])
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


def _with_tool_prompt(
    chat: list[Message], extras: list[dict[str, Any]], text: str
) -> tuple[list[Message], list[dict[str, Any]]]:
    """``text`` added to the system message (a new one first if there is none)."""
    if chat and chat[0][0] == "system":
        content = list(chat[0][1])
        lead = [*content, Text("\n\n")] if content else []
        return [("system", [*lead, Text(text)]), *chat[1:]], extras
    return [("system", [Text(text)]), *chat], [{}, *extras]


def _user_turn_roles(chat: list[Message]) -> list[Message] | None:
    """``chat`` in the roles any template takes, for a template without tools that
    refused it (Gemma's: no system role, only alternating user and model turns).

    The system text leads the first user turn, and tool results become user
    turns of tool-response blocks as the fallback prompt's format
    (Qwen2.5's) writes them; adjacent user turns are merged. None: ``chat``
    has no system or tool message, so there is nothing to change.
    """
    if not any(role in ("system", "tool") for role, _ in chat):
        return None
    system: list[Segment] = []
    out: list[tuple[str, list[Segment]]] = []
    result_open, result_close = FallbackFamily.result_wrapping()
    for role, content in chat:
        if role == "system":
            system += [*(Text("\n\n") for _ in system[:1]), *content]
            continue
        if role == "tool":
            role = "user"
            content = [Text(result_open), *content, Text(result_close)]
        if role == "user" and out and out[-1][0] == "user":
            out[-1][1].extend([Text("\n"), *content])
        else:
            out.append((role, list(content)))
    if system:
        if out and out[0][0] == "user":
            out[0] = ("user", [*system, Text("\n\n"), *out[0][1]])
        else:
            out.insert(0, ("user", system))
    return list(out)


# Keys of a message dict, besides role and content, that chat templates read.
_TOOL_KEYS = ("tool_call_id", "name")


def _message(
    message: dict[str, Any], chunk_index: ChunkIndex, known_chunks: Sequence[str]
) -> tuple[Message, dict[str, Any]]:
    if not isinstance(message, dict) or "role" not in message or "content" not in message:
        raise TypeError('each message must be a dict with "role" and "content"')
    role = message["role"]
    if not isinstance(role, str):
        raise TypeError(f"a message role must be a str, got {type(role).__name__}")
    if not _ROLE_RE.fullmatch(role):  # the template writes roles as markup
        raise ValueError(f"a message role must be a plain name like 'user', got {role!r}")
    extra: dict[str, Any] = {k: message[k] for k in _TOOL_KEYS if message.get(k) is not None}
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, (list, tuple)) or not all(isinstance(c, dict) for c in calls):
            raise TypeError("tool_calls must be a list of OpenAI tool call dicts")
        extra["tool_calls"] = template_tool_calls(calls)
    content = message["content"]
    if content is None and not calls:  # None is legitimate only beside tool calls
        raise TypeError("message content must be a string (None only with tool_calls)")
    segments = message_segments("" if content is None else content, chunk_index, known_chunks)
    return (role, segments), extra
