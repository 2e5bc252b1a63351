"""Typed errors raised by kvrag_integrations.

Every error derives from :class:`KVRAGError`; errors about bad arguments also
derive from :class:`ValueError` so that callers who catch ``ValueError`` keep
working.
"""

from __future__ import annotations


class KVRAGError(Exception):
    """Base class of every error this package raises on purpose."""


class UnsupportedModelError(KVRAGError, ValueError):
    """The model lacks a part that KV reuse needs (named in the message)."""


class UnknownStrategyError(KVRAGError, ValueError):
    """A strategy name that no registered strategy answers to."""


class InvalidChunkError(KVRAGError, ValueError):
    """A chunk that cannot be cached: not a string, empty or whitespace only."""


class UnsupportedInputError(KVRAGError, ValueError):
    """Input the text-only model cannot take (an image, audio or file block), named.

    Adapters raise it instead of dropping the part silently.
    """


class ToolCallError(KVRAGError, ValueError):
    """A tool call was asked for and the model's answer holds none that is valid
    (LlamaIndex's ``get_tool_calls_from_response``; LangChain reports such output
    in ``invalid_tool_calls`` instead)."""


class UnsupportedEngineError(KVRAGError, TypeError):
    """An engine lacks what a component needs (the message names the members)."""


class ContextWindowExceededError(KVRAGError, ValueError):
    """The prompt plus the tokens to generate do not fit the model's context."""


def check_fits(n_tokens: int, context_window: int, what: str, new_tokens: int = 0) -> None:
    """Raise ``ContextWindowExceededError`` when ``what`` does not fit the context.

    Examples:
        >>> check_fits(10, 8192, "the prompt", new_tokens=24)
        >>> try:
        ...     check_fits(9000, 8192, "a chunk")
        ... except ContextWindowExceededError as exc:
        ...     print(exc)
        a chunk has 9000 tokens (+0 to generate), over the model's context window of 8192
    """
    if n_tokens + new_tokens > context_window:
        raise ContextWindowExceededError(
            f"{what} has {n_tokens} tokens (+{new_tokens} to generate), over the "
            f"model's context window of {context_window}"
        )


class CacheEntryError(KVRAGError):
    """A stored cache entry that must not be used: corrupt, truncated or foreign.

    Stores raise it internally and turn it into a miss; it reaches users only
    from explicit verification calls.
    """


class NotRegularFileError(CacheEntryError, OSError):
    """A store's file (an entry, the content index's log) that is not a regular file:
    a FIFO, a device, a symlink where none is taken. Refused without blocking; the
    message names it."""


class CalibrationError(KVRAGError, ValueError):
    """A calibration record is malformed, or a calibration cannot run or be stored."""


class StoreWriteError(KVRAGError, OSError):
    """A store could not write an entry (disk full, read-only directory, ...)."""


class StoreURLError(KVRAGError, ValueError):
    """A store URL that names no known backend or lacks a part (see ``open_store``)."""


# ----------------------------------------------------------------- vLLM
class ServerError(KVRAGError, RuntimeError):
    """A vLLM server refused a request or could not be reached (its message included)."""


class TransferParamsError(KVRAGError, ValueError):
    """A request's ``kv_transfer_params["kvrag"]`` is malformed or not allowed (the
    connector then ignores them: vLLM computes the request as if it carried none)."""


class PagedLayoutError(KVRAGError, RuntimeError):
    """A vLLM layer's paged cache is not one the connector can read and write."""


class ConnectorMissingError(KVRAGError, RuntimeError):
    """vLLM answered without the KVRAGConnector's reply: it was not started with
    ``kvrag_integrations.vllm.transfer_config(...)`` as its ``kv_transfer_config``."""
