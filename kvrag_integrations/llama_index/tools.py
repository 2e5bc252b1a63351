"""KVRAGLLM's function calling: LlamaIndex tools as OpenAI schemas, calls back as
``ToolSelection``s.

As llama-index-llms-openai does: ``prepare_chat_with_tools`` turns the tools
into OpenAI function schemas (``ToolMetadata.to_openai_tool``) and
``tool_required`` into ``tool_choice="required"``; a response's calls are in
``message.additional_kwargs["tool_calls"]`` (OpenAI's form) and an earlier
assistant message's calls and a tool message's ``tool_call_id`` go back to the
engine, which renders them with the model's chat template. Output in the
model's call format that is no valid call is in
``additional_kwargs["invalid_tool_calls"]``; asked for a call and given only
such output, ``get_tool_calls_from_response`` raises ``ToolCallError`` naming why.
``allow_parallel_tool_calls=False`` (LlamaIndex's default) keeps the first call
only (the engine's ``parallel_tool_calls``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.llms.llm import ToolSelection

from kvrag_integrations.engine.tools.calls import (
    InvalidToolCall,
    ToolCall,
    call_arguments,
)
from kvrag_integrations.engine.tools.calls import message_tool_fields as engine_tool_fields
from kvrag_integrations.errors import ToolCallError

logger = logging.getLogger("kvrag_integrations.llama_index")


def prepare_chat_with_tools(
    tools: Sequence[Any],
    user_msg: str | ChatMessage | None,
    chat_history: list[ChatMessage] | None,
    tool_required: bool,
    kwargs: dict[str, Any],
    allow_parallel_tool_calls: bool = True,
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
        out["parallel_tool_calls"] = allow_parallel_tool_calls
    return out


def tool_selections(message: ChatMessage, error_on_no_tool_call: bool) -> list[ToolSelection]:
    """The calls in a response's message (``additional_kwargs["tool_calls"]``)."""
    calls = message.additional_kwargs.get("tool_calls") or []
    if not calls and error_on_no_tool_call:
        invalid = message.additional_kwargs.get("invalid_tool_calls") or []
        if invalid:
            raise ToolCallError(f"the model's tool call is not valid: {invalid[0]['error']}")
        raise ToolCallError(f"expected at least one tool call, got none: {message.content!r}")
    out = []
    for call in calls:
        function = call["function"]
        kwargs = call_arguments(function.get("arguments"))
        if not isinstance(kwargs, dict):  # an earlier turn's malformed arguments
            logger.warning("tool call %s has arguments that are no JSON object", call.get("id"))
            kwargs = {}
        name = function["name"]
        out.append(ToolSelection(tool_id=call["id"], tool_name=name, tool_kwargs=kwargs))
    return out


def openai_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """The engine's calls as OpenAI ``tool_calls`` dicts (a message's additional_kwargs)."""
    return [call.as_openai() for call in calls]


def invalid_calls(calls: Sequence[InvalidToolCall]) -> list[dict[str, Any]]:
    """The engine's invalid calls as dicts (``additional_kwargs["invalid_tool_calls"]``,
    LangChain's keys)."""
    return [{"name": c.name, "args": c.arguments, "id": c.id, "error": c.error} for c in calls]


def message_tool_fields(message: ChatMessage) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` or a tool message's ``tool_call_id`` and
    ``name``, as the engine's message keys (``tools.calls.message_tool_fields``)."""
    extra = message.additional_kwargs
    return engine_tool_fields(extra.get("tool_calls"), extra.get("tool_call_id"), extra.get("name"))
