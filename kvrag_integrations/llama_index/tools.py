"""KVRAGLLM's function calling: LlamaIndex tools as OpenAI schemas, calls back as
``ToolSelection``s.

As llama-index-llms-openai does: ``prepare_chat_with_tools`` turns the tools
into OpenAI function schemas (``ToolMetadata.to_openai_tool``) and
``tool_required`` into ``tool_choice="required"``; a response's calls are in
``message.additional_kwargs["tool_calls"]`` (OpenAI's form) and an earlier
assistant message's calls and a tool message's ``tool_call_id`` go back to the
engine, which renders them with the model's chat template.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.llms.llm import ToolSelection

from kvrag_integrations.engine.prompting.tools import ToolCall


def prepare_chat_with_tools(
    tools: Sequence[Any],
    user_msg: str | ChatMessage | None,
    chat_history: list[ChatMessage] | None,
    tool_required: bool,
    kwargs: dict[str, Any],
) -> dict[str, Any]:
    """``chat`` keywords: the messages, the tools as OpenAI schemas, the choice."""
    messages = list(chat_history or [])
    if isinstance(user_msg, str):
        user_msg = ChatMessage(role="user", content=user_msg)
    if user_msg is not None:
        messages.append(user_msg)
    schemas = [tool.metadata.to_openai_tool() for tool in tools]
    choice = kwargs.pop("tool_choice", None)
    if tool_required and choice is None:
        choice = "required"
    out: dict[str, Any] = {"messages": messages, **kwargs}
    if schemas:
        out["tools"] = schemas
        if choice is not None:
            out["tool_choice"] = choice
    return out


def tool_selections(message: ChatMessage, error_on_no_tool_call: bool) -> list[ToolSelection]:
    """The calls in a response's message (``additional_kwargs["tool_calls"]``)."""
    calls = message.additional_kwargs.get("tool_calls") or []
    if not calls and error_on_no_tool_call:
        raise ValueError(f"expected at least one tool call, got none: {message.content!r}")
    out = []
    for call in calls:
        function = call["function"]
        args = function.get("arguments") or "{}"
        kwargs = json.loads(args) if isinstance(args, str) else dict(args)
        name = function["name"]
        out.append(ToolSelection(tool_id=call["id"], tool_name=name, tool_kwargs=kwargs))
    return out


def openai_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """The engine's calls as OpenAI ``tool_calls`` dicts (a message's additional_kwargs)."""
    return [call.as_openai() for call in calls]


def message_tool_fields(message: ChatMessage) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` or a tool message's ``tool_call_id`` and
    ``name``, as the engine's message keys (objects with ``model_dump`` too)."""
    extra = message.additional_kwargs
    calls = extra.get("tool_calls")
    if calls:
        dumped = [c.model_dump() if hasattr(c, "model_dump") else dict(c) for c in calls]
        return {"tool_calls": dumped}
    out: dict[str, Any] = {}
    if extra.get("tool_call_id"):
        out["tool_call_id"] = extra["tool_call_id"]
        if extra.get("name"):
            out["name"] = extra["name"]
    return out
