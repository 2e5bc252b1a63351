"""vLLM in this process: ``AsyncLLM`` on an event loop of its own, fed from any thread.

vLLM batches whatever requests are in flight (continuous batching), so the
engine is asynchronous: each request is a coroutine on the backend's loop
thread, and the caller's thread (a stream's worker) reads its outputs from a
queue, as with the in-process engine. Cancelling aborts the request in vLLM.
vLLM starts its engine core in a subprocess: scripts that create one need the
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

from kvrag_integrations.vllm.client.backend import BackendEvent, BackendRequest
from kvrag_integrations.vllm.config import ATTACH_METHOD
from kvrag_integrations.vllm.reply import Reply

_DONE = object()
_IDS = itertools.count()
logger = logging.getLogger(__name__)


class LocalBackend:
    """An ``AsyncLLM`` serving ``BackendRequest``s (see ``backend.Backend``).

    Args:
        engine_args: ``vllm.AsyncEngineArgs`` keyword arguments (``model``,
            ``dtype``, ``kv_transfer_config``, ...).
        name: the model name reported to the adapters.
    """

    # Prompt log-probabilities are read without text: rows a load left uncomputed
    # are never decoded (vllm.scoring reads only the computed rows).
    prompt_rows_after_load = True
    # Why blend does not run here ("" : it does; set by ``attach_blend``).
    blend_refused = "vLLM was started without blend (reuse='turbo')"

    def __init__(self, engine_args: dict[str, Any], name: str) -> None:
        self.model_name = name
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvrag-vllm-loop", daemon=True
        )
        self._thread.start()
        try:
            self._engine = self._call(_start(engine_args))
        except BaseException:
            self._stop_loop()
            raise
        self.context_window = int(self._engine.model_config.max_model_len)

    def _call(self, coroutine: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def attach_blend(self) -> None:
        """Hand each worker's model to the connector for blend's recompute (vLLM's
        ``collective_rpc`` on the worker extension); a model blend cannot run on
        keeps turbo only, and ``blend_refused`` says why."""
        reasons = self._call(self._engine.collective_rpc(ATTACH_METHOD), timeout=600)
        refused = [str(r) for r in reasons if r]
        self.blend_refused = "; ".join(dict.fromkeys(refused))
        if refused:
            logger.warning("blend refused on %s: %s", self.model_name, self.blend_refused)

    def submit(self, request: BackendRequest, cancel: threading.Event) -> Iterator[BackendEvent]:
        """Run ``request`` on the loop; yield its events as they come."""
        out: queue.Queue[Any] = queue.Queue()
        request_id = f"kvrag-{next(_IDS)}"
        future = asyncio.run_coroutine_threadsafe(self._run(request, request_id, out), self._loop)
        try:
            while True:
                try:
                    item = out.get(timeout=0.05)
                except queue.Empty:
                    if cancel.is_set():
                        future.cancel()  # the generator's close aborts it in vLLM
                        return
                    continue
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not future.done():
                future.cancel()

    async def _run(self, request: BackendRequest, request_id: str, out: queue.Queue) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        extra = {"kv_transfer_params": request.params} if request.params else None
        scoring: dict[str, Any] = {}
        if request.logprob_token_ids:
            scoring["logprob_token_ids"] = list(request.logprob_token_ids)
        if request.prompt_logprobs:  # rows not computed are left as they are: no text
            scoring.update(prompt_logprobs=0, detokenize=False)
        if request.json_schema is not None:  # a forced tool call: vLLM's own constraint
            scoring["structured_outputs"] = StructuredOutputsParams(json=request.json_schema)
        params = SamplingParams(
            **request.sampling,
            **scoring,
            logprobs=request.logprobs,
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra,
        )
        prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_ids)}
        if request.salt is not None:
            prompt["cache_salt"] = request.salt
        first = True
        try:
            async for output in self._engine.generate(prompt, params, request_id):
                event = _event(output, first)
                if first and request.prompt_logprobs:
                    event.prompt_logprobs = _prompt_logprobs(output, request.prompt_ids)
                out.put(event)
                first = False
        except Exception as exc:  # raised again on the caller's thread, same type
            out.put(exc)
        finally:
            out.put(_DONE)

    def close(self) -> None:
        """Shut vLLM down (its engine core process too) and stop the loop."""
        engine = getattr(self, "_engine", None)
        if engine is not None:
            self._engine = None
            with contextlib.suppress(Exception):
                self._call(_shutdown(engine), timeout=60)
        self._stop_loop()

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


async def _start(engine_args: dict[str, Any]) -> Any:
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))


async def _shutdown(engine: Any) -> None:
    """Stop reading outputs, then stop vLLM (in that order, on the loop: its output
    reader would otherwise report the engine it waits on as dead)."""
    handler = getattr(engine, "output_handler", None)
    if handler is not None:
        handler.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await handler
    engine.shutdown()


def _event(output: Any, first: bool) -> BackendEvent:
    completion = output.outputs[0]
    event = BackendEvent(
        text=completion.text,
        token_ids=list(completion.token_ids),
        cached_tokens=output.num_cached_tokens,
        finish_reason=completion.finish_reason,
    )
    if output.finished:
        event.reply = Reply.from_output(output.kv_transfer_params)
    if first and completion.logprobs:
        event.logprobs = {int(i): float(lp.logprob) for i, lp in completion.logprobs[0].items()}
    return event


def _prompt_logprobs(output: Any, prompt_ids: list[int]) -> list[float | None] | None:
    rows = output.prompt_logprobs
    if rows is None:
        return None
    out: list[float | None] = []
    for row, token in zip(rows, prompt_ids):
        logprob = row.get(token) if row else None
        out.append(None if logprob is None else float(logprob.logprob))
    return out
