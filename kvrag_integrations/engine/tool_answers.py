"""A request with tools: its answer read by the request's tool family, text streamed
as soon as it cannot be a call.

``EngineFrontend.open_request`` wraps each engine's job with ``with_tool_calls``
when the request has tools. The answer is read from its token ids, which both
engines fill as they come (``result.token_ids``), decoded with the family's
markup tokens kept (``AnswerText``: Mistral's and Llama's markers, and
Mistral's ``[ARGS]``, are special tokens that plain text skips) and cut at the
request's stop strings. While it decodes, the family's detector
(``ToolFamily.detector``, fed the growing text, reading each character once)
says how much of it is text whatever follows; that much streams at once. At
the end the family parses it (``ToolFamily.parse``) into the text, the calls
and the invalid calls. The detector never releases text the parse would not
keep, so the streamed pieces are a prefix of the final text and the rest
follows: a stream equals ``generate`` on the same seed, calls and their ids
included (ids drawn from the prompt and answer). Under a forced choice nothing
streams: the answer is the call, closed if ``max_new_tokens`` cut it short.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from kvrag_integrations.engine.modeling.generate import StopScanner, TextDecoder
from kvrag_integrations.engine.request import Request
from kvrag_integrations.engine.results import GenerationResult
from kvrag_integrations.engine.streaming import Job
from kvrag_integrations.engine.tools.calls import Parsed
from kvrag_integrations.engine.tools.plan import ToolPlan

logger = logging.getLogger("kvrag_integrations.engine.engine")


class AnswerText:
    """An answer's text from its token ids as they come: special tokens skipped but
    the family's markup (``marker_ids``), decoded incrementally."""

    def __init__(self, tokenizer: Any, markup: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.marker_ids = _marker_ids(tokenizer, markup)
        self._done = ""  # text up to the last marker, marker included
        self._decoder = TextDecoder(tokenizer)
        self._run = ""  # text of the ids after it
        self._seen = 0

    def text(self, ids: Sequence[int], final: bool = False) -> str:
        """The text of ``ids`` (a longer list each call: the same answer growing)."""
        for token in list(ids[self._seen :]):
            marker = self.marker_ids.get(token)
            if marker is None:
                self._run += self._decoder.push(token)
                continue
            self._done += self._run + self._decoder.flush() + marker
            self._decoder, self._run = TextDecoder(self.tokenizer), ""
        self._seen = len(ids)
        if final:
            self._run += self._decoder.flush()
        return self._done + self._run


def _marker_ids(tokenizer: Any, markers: Sequence[str]) -> dict[int, str]:
    """The ids of markers that are one added token each (their text: special ones
    are skipped by plain decoding)."""
    vocab = getattr(tokenizer, "get_added_vocab", dict)()
    return {vocab[m]: m for m in markers if m in vocab}


class _StopCut:
    """A growing answer up to its first stop string, each text searched only where
    it is new (and the tail before it that may hold a stop's start)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.scanner = StopScanner(stops)
        self.searched = 0
        self.at = -1  # where the first stop string starts, once found

    def __call__(self, text: str) -> tuple[str, int]:
        """``text`` up to its first stop string, and how long an end of it may begin one."""
        if self.at < 0:
            self.at = self.scanner.find(text, max(0, self.searched - self.scanner.hold))
            self.searched = len(text)
        if self.at >= 0:
            return text[: self.at], 0
        return text, len(text) - self.scanner.safe_len(text, 0)


def with_tool_calls(job: Job, request: Request, result: GenerationResult, tokenizer: Any) -> Job:
    """``job`` with its answer read by the request's tool family (module docstring)."""
    plan = request.tools
    assert plan is not None
    family = plan.family

    def run(cancel: threading.Event) -> Iterator[str]:
        answer = AnswerText(tokenizer, family.answer_markup)
        stop_cut = _StopCut(request.sampling.stop)
        detector = family.detector(plan.names)  # both read each character once
        emitted = ""
        for _ in job(cancel):
            if plan.forced:
                continue
            text, held = stop_cut(answer.text(result.token_ids))
            end = min(detector.end(text), len(text) - held)
            if end > len(emitted):
                piece = text[len(emitted) : end]
                emitted += piece
                yield piece
        text, _ = stop_cut(answer.text(result.token_ids, final=True))
        parsed = _read(plan, request, result, text)
        result.text = parsed.content
        result.tool_calls = list(parsed.calls)
        result.invalid_tool_calls = list(parsed.invalid)
        if not parsed.content.startswith(emitted):  # the detector's contract broken
            logger.warning("streamed tool-answer text is no prefix of the parsed text")
        elif len(parsed.content) > len(emitted):
            yield parsed.content[len(emitted) :]

    return run


def _read(plan: ToolPlan, request: Request, result: GenerationResult, text: str) -> Parsed:
    """The answer parsed by the plan's family (a forced call closed and read), the
    calls cut to the first where ``parallel_tool_calls`` is False."""
    seed = _seed(request, result.token_ids)
    if plan.forced:
        forced = plan.family.forced_call(request.lead + text, plan.forced, seed)
        parsed = forced if forced is not None else Parsed(text)  # cut short: as text
    else:
        parsed = plan.family.parse(text, plan.names, seed)
    if plan.parallel or len(parsed.calls) + len(parsed.invalid) <= 1:
        return parsed
    if parsed.calls:
        return Parsed(parsed.content, parsed.calls[:1])
    return Parsed(parsed.content, (), parsed.invalid[:1])


def _seed(request: Request, answer: Sequence[int]) -> bytes:
    """What a request's call ids are drawn from: its prompt and answer ids."""
    digest = hashlib.sha256(request.prompt.input_ids.numpy().tobytes())
    digest.update(b"|" + ",".join(map(str, answer)).encode())
    return digest.digest()
