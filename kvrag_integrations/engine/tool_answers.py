"""A request with tools: its text held back while it may be a call, its calls parsed.

``EngineFrontend.open_request`` wraps each engine's job with ``with_tool_calls``
when the request has tools: the model's text streams as usual once it cannot
be a call; while it may be one (it starts like a call's markup or JSON, and
always under a forced choice) it is held back. At the end the generated ids
are decoded with their special tokens (Mistral's ``[TOOL_CALLS]``, Llama's
``<|python_tag|>``), behind the forced start the prompt ended with, and parsed
(``prompting.tool_parsing``) into ``GenerationResult.tool_calls``; ``text``
is then what the model wrote besides them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from kvrag_integrations.engine.modeling.tool_constraint import close_call
from kvrag_integrations.engine.prompting.tool_parsing import parse_tool_calls
from kvrag_integrations.engine.request import Request
from kvrag_integrations.engine.results import GenerationResult
from kvrag_integrations.engine.streaming import Job

# How a call's text may begin (special tokens are skipped in streamed text).
_CALL_STARTS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "```", "{", "[")


def may_be_call(text: str) -> bool:
    """Whether ``text`` may still turn out to be a tool call (held back meanwhile).

    Examples:
        >>> may_be_call("  <tool"), may_be_call('{"name"'), may_be_call("Paris is")
        (True, True, False)
    """
    head = text.lstrip()
    return any(head.startswith(s) or s.startswith(head) for s in _CALL_STARTS)


def with_tool_calls(job: Job, request: Request, result: GenerationResult, tokenizer: Any) -> Job:
    """``job`` with its text held back while it may be a call, and its calls parsed."""
    plan = request.tools
    assert plan is not None

    def run(cancel: threading.Event) -> Iterator[str]:
        text, holding = "", True
        for piece in job(cancel):
            text += piece
            if holding and (plan.forced or may_be_call(text)):
                continue
            yield text if holding else piece
            holding = False
        generated = tokenizer.decode(result.token_ids, skip_special_tokens=False)
        if plan.forced:  # a call cut short by max_new_tokens is closed
            call = close_call(request.lead + generated)
            generated = plan.prompt_tail + call + plan.format.closing
        content, calls = parse_tool_calls(generated)
        if calls:
            result.tool_calls = calls
            result.text = content
        elif plan.forced:  # cut short (max_new_tokens): what was written, as text
            result.text = generated
        if holding and result.text:
            yield result.text

    return run
