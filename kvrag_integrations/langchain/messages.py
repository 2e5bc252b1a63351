"""LangChain messages to the engine's ``messages`` (roles, text and chunk segments).

The engine takes ``{"role", "content"}`` dicts whose content is a string (split
wherever a known chunk appears) or a list of ``Text`` / ``Chunk`` segments. This
module maps LangChain message classes to roles and content blocks to segments;
finding chunks inside text is the engine's (``spans.message_segments``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from kvrag_integrations.engine import CACHE_KEY_FIELD, Chunk, Segment, Text
from kvrag_integrations.engine.prompting.spans import message_segments
from kvrag_integrations.engine.protocol import RAGEngine
from kvrag_integrations.errors import UnsupportedInputError
from kvrag_integrations.langchain.hooks import recent_chunks
from kvrag_integrations.langchain.tools import message_tool_fields

# Content blocks that carry no prompt text (a text-only model skips them).
_SKIPPED_BLOCKS = {
    "reasoning",
    "tool_call",
    "tool_call_chunk",
    "invalid_tool_call",
    "server_tool_call",
    "server_tool_call_chunk",
    "server_tool_result",
    "non_standard",
}
# Content blocks this text-only model cannot take.
_MEDIA_BLOCKS = {"image", "audio", "video", "file"}
_CHAT_ROLES = {"human": "user", "ai": "assistant"}


def message_role(message: BaseMessage) -> str:
    """The chat-template role of a LangChain message.

    Examples:
        >>> message_role(HumanMessage("hi")), message_role(AIMessage("hello"))
        ('user', 'assistant')
    """
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, ToolMessage):
        return "tool"
    if isinstance(message, ChatMessage):
        return _CHAT_ROLES.get(message.role, message.role)
    raise TypeError(f"ChatKVRAG cannot take a {type(message).__name__}")


def document_texts(documents: Iterable[Document | str] | None) -> list[str]:
    """Texts of documents given explicitly (``Document`` or ``str``), empty ones dropped.

    Examples:
        >>> document_texts([Document(page_content="Ada wrote it."), "Bob ate it.", " "])
        ['Ada wrote it.', 'Bob ate it.']
    """
    if documents is None:
        return []
    if isinstance(documents, (str, Document)):
        raise TypeError("documents must be a list of Documents or strings")
    texts = [d.page_content if isinstance(d, Document) else d for d in documents]
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"documents must be Documents or strings, got {type(text).__name__}")
    return [t for t in texts if t.strip()]


def _block_cache_key(block: dict[str, Any]) -> str | None:
    extras = block.get("extras")
    if isinstance(extras, dict) and extras.get(CACHE_KEY_FIELD):
        return str(extras[CACHE_KEY_FIELD])
    key = block.get(CACHE_KEY_FIELD)  # also accepted at the top level of the block
    return str(key) if key else None


def searchable_text(message: BaseMessage) -> str:
    """The text of a message that is split at known chunks: string content, or its
    plain text blocks (document blocks are chunks already)."""
    if isinstance(message.content, str):
        return message.content
    return "".join(
        block["text"]
        for block in message.content_blocks
        if block.get("type") == "text"
        and isinstance(block.get("text"), str)
        and _block_cache_key(dict(block)) is None
    )


def content_segments(
    message: BaseMessage, engine: RAGEngine, known_chunks: Sequence[str] = ()
) -> str | list[Segment]:
    """A message's content for the engine: its string, or segments for block lists.

    String content is returned as is: the engine splits it at known chunks. In a
    block list, a ``text`` block with ``extras[CACHE_KEY_FIELD]`` and every
    ``text-plain`` block (a document) become ``Chunk`` segments; the other text
    blocks are split at known chunks by the engine (``message_segments``).

    Raises:
        UnsupportedInputError: an image, audio, video or file block (the model reads
            text only), or a block type it does not know (a ``ValueError``).
    """
    if isinstance(message.content, str):
        return message.content
    items: list[str | Segment] = []
    for block in message.content_blocks:
        kind = block.get("type")
        text = block.get("text")
        if kind == "text" or (kind == "text-plain" and isinstance(text, str)):
            document = kind == "text-plain" or _block_cache_key(dict(block)) is not None
            if document and text.strip():
                for lead in (block.get("title"), block.get("context")):
                    if lead:
                        items.append(Text(f"{lead}\n"))
                items.append(Chunk(text))
            else:
                items.append(text)
        elif kind in _MEDIA_BLOCKS or kind == "text-plain":
            raise UnsupportedInputError(f"ChatKVRAG reads text only; got a {kind!r} content block")
        elif kind not in _SKIPPED_BLOCKS:
            raise UnsupportedInputError(f"unsupported content block type {kind!r}")
    return message_segments(items, engine.chunk_index, known_chunks)


def to_engine_messages(
    messages: Sequence[BaseMessage],
    engine: RAGEngine,
    documents: Iterable[Document | str] | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """``(messages, known_chunks)`` for ``engine.generate/stream/prefill``.

    Args:
        messages: LangChain messages (system, human, AI, tool, chat).
        engine: the engine whose ``chunk_index`` finds chunks in text.
        documents: documents given explicitly; their texts become known chunks, as
            do texts any LangChain retriever returned (``langchain.hooks``) found
            verbatim in the messages.

    Examples:
        >>> msgs, known = to_engine_messages([HumanMessage("Q?")], engine)  # doctest: +SKIP
        >>> engine.prefill(messages=msgs, known_chunks=known).logits  # doctest: +SKIP
    """
    known = document_texts(documents)
    # a retrieval tool's documents (response_format="content_and_artifact"): chunks
    for message in messages:
        known += [t for t in artifact_texts(message) if t not in known]
    # texts any retriever returned in this process (langchain.hooks), found verbatim
    registry = recent_chunks()
    for message in messages:
        for text in registry.find(searchable_text(message)):
            if not any(text in chunk for chunk in known):  # inside a longer one: nothing new
                known.append(text)
    out = [
        {
            "role": message_role(m),
            "content": content_segments(m, engine, known),
            **message_tool_fields(m),
        }
        for m in messages
    ]
    return out, known


def artifact_texts(message: BaseMessage) -> list[str]:
    """The texts of the ``Document``s a tool message carries as its artifact.

    Examples:
        >>> message = ToolMessage("...", tool_call_id="1", artifact=[Document("Ada wrote it.")])
        >>> artifact_texts(message)
        ['Ada wrote it.']
    """
    artifact = getattr(message, "artifact", None)
    if not isinstance(message, ToolMessage) or not isinstance(artifact, (list, tuple)):
        return []
    docs = [d for d in artifact if isinstance(d, Document)]
    return document_texts(docs)
