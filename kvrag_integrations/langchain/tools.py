"""ChatKVRAG's tool calling: tools bound as OpenAI schemas, calls back as LangChain's.

``bind_tools`` converts any tool LangChain takes (``BaseTool``, functions,
pydantic models, dicts) with ``convert_to_openai_tool`` and binds them with the
``tool_choice`` as call options; the engine renders them (the chat template's
``tools=``, or its fallback tool prompt) and parses the calls
(``GenerationResult.tool_calls``), which become ``AIMessage.tool_calls`` or,
streamed, ``tool_call_chunks`` of the last chunk; output in the model's call
format that is no valid call becomes ``invalid_tool_calls`` (streamed: a chunk
whose raw text LangChain's partial-JSON reading keeps invalid), as LangChain's
own OpenAI integration reports it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import InvalidToolCall, ToolCall, ToolCallChunk
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.utils.function_calling import convert_to_openai_tool

from kvrag_integrations.engine.results import GenerationResult
from kvrag_integrations.engine.tools.calls import message_tool_fields as engine_tool_fields


def bind_tools(model: Any, tools: Sequence[Any], tool_choice: Any, kwargs: dict[str, Any]) -> Any:
    """``model.bind(tools=[OpenAI schemas], tool_choice=...)``; no tools and no
    choice: ``model`` itself (an agent built with ``tools=[]``)."""
    if not tools and not tool_choice:
        return model
    schemas = [convert_to_openai_tool(tool) for tool in tools]
    if tool_choice is True:
        tool_choice = "required"
    elif tool_choice is False:
        tool_choice = None
    if tool_choice is not None:
        kwargs = {**kwargs, "tool_choice": tool_choice}
    return model.bind(tools=schemas, **kwargs)


def tool_calls(result: GenerationResult) -> list[ToolCall]:
    """The result's calls as ``AIMessage.tool_calls``."""
    return [tool_call(name=c.name, args=c.arguments, id=c.id) for c in result.tool_calls]


def invalid_tool_calls(result: GenerationResult) -> list[InvalidToolCall]:
    """The result's invalid calls as ``AIMessage.invalid_tool_calls``."""
    return [
        invalid_tool_call(name=c.name, args=c.arguments, id=c.id, error=c.error)
        for c in result.invalid_tool_calls
    ]


def tool_call_chunks(result: GenerationResult) -> list[ToolCallChunk]:
    """The result's calls, then its invalid ones, as ``AIMessageChunk.tool_call_chunks``
    (one whole call each; merged, they are ``invoke``'s ``tool_calls`` and
    ``invalid_tool_calls``, the latter with no ``error``, as LangChain merges them)."""
    chunks = [
        tool_call_chunk(name=c.name, args=json.dumps(c.arguments), id=c.id, index=i)
        for i, c in enumerate(result.tool_calls)
    ]
    start = len(chunks)
    chunks += [
        tool_call_chunk(name=c.name, args=c.arguments, id=c.id, index=start + i)
        for i, c in enumerate(result.invalid_tool_calls)
    ]
    return chunks


def message_tool_fields(message: Any) -> dict[str, Any]:
    """An AI message's ``tool_calls`` or a tool message's ``tool_call_id`` and ``name``,
    as the engine's message keys (``tools.calls.message_tool_fields``)."""
    call_id = getattr(message, "tool_call_id", None)
    name = getattr(message, "name", None) if call_id else None
    return engine_tool_fields(getattr(message, "tool_calls", None), call_id, name)
