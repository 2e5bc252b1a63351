"""A running vLLM OpenAI server (started with the connector), over HTTP.

Requests go to ``/v1/completions`` with the prompt as token ids (the engine
tokenized it, chunks intact) and vLLM's extensions: ``cache_salt``,
``kv_transfer_params``, ``return_token_ids`` and token-id logprobs. Answers
stream as server-sent events; the last one carries the usage, whose
``prompt_tokens_details.cached_tokens`` (the server started with
``--enable-prompt-tokens-details``) is vLLM's own count of prompt tokens it did
not compute. Chunk encoding is not streamed: its response carries the
connector's reply (the entry keys). Closing a stream closes its connection,
which aborts the request in vLLM.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx

from kvrag_integrations.errors import ServerError
from kvrag_integrations.vllm.client.backend import BackendEvent, BackendRequest
from kvrag_integrations.vllm.reply import Reply

_MAX_WHOLE = 32


class ServerBackend:
    """The client of one vLLM OpenAI server (see ``backend.Backend``).

    Args:
        base_url: the server, e.g. ``"http://127.0.0.1:8000"`` (``/v1`` is added).
        model: the served model's name (default: the server's first model).
        api_key: sent as a bearer token when the server was started with one.
        timeout: seconds to wait for a connection or a piece of an answer.
    """

    # The API detokenizes every prompt row, those a load left uncomputed too (garbage
    # ids: a 500): query likelihood with loads scores token by token (vllm.scoring).
    prompt_rows_after_load = False

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = 600.0,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        root = base_url.rstrip("/").removesuffix("/v1")
        self._client = httpx.Client(base_url=f"{root}/v1", headers=headers, timeout=timeout)
        # Whole answers in flight at once (the reranker sends many): more made httpx
        # fail with EBADF under a few hundred threads; vLLM batches what is in flight.
        self._slots = threading.BoundedSemaphore(_MAX_WHOLE)
        try:
            models = self._client.get("/models")
            models.raise_for_status()
        except httpx.HTTPError as exc:
            self._client.close()
            raise ServerError(f"cannot reach the vLLM server at {root}: {exc}") from exc
        served = models.json().get("data", [])
        info = next((m for m in served if model is None or m.get("id") == model), None)
        if info is None:
            self._client.close()
            names = [m.get("id") for m in served]
            raise ServerError(f"the server at {root} serves {names}, not {model!r}")
        self.model_name = str(info["id"])
        self.model_root = str(info.get("root") or info["id"])  # the checkpoint it serves
        self.context_window = int(info.get("max_model_len") or 2048)

    def submit(self, request: BackendRequest, cancel: threading.Event) -> Iterator[BackendEvent]:
        """Stream one request (or answer it whole: ``request.stream`` false)."""
        body = self._body(request)
        if not request.stream or request.prompt_logprobs:
            yield self._whole(body, request)
            return
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        try:
            with self._client.stream("POST", "/completions", json=body) as response:
                _raise_for(response)
                first = True
                for line in response.iter_lines():
                    if cancel.is_set():
                        return  # leaving the block closes the connection: vLLM aborts
                    event = _sse_event(line, first)
                    if event is not None:
                        first = first and not event.token_ids
                        yield event
        except httpx.HTTPError as exc:
            raise ServerError(f"the vLLM server failed the request: {exc}") from exc

    def _whole(self, body: dict[str, Any], request: BackendRequest) -> BackendEvent:
        try:
            with self._slots:
                response = self._client.post("/completions", json=body)
        except httpx.HTTPError as exc:
            raise ServerError(f"the vLLM server failed the request: {exc}") from exc
        _raise_for(response)
        data = response.json()
        choice = data["choices"][0]
        details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
        event = BackendEvent(
            text=choice.get("text") or "",
            token_ids=list(choice.get("token_ids") or []),
            cached_tokens=details.get("cached_tokens"),
            finish_reason=choice.get("finish_reason"),
            reply=Reply.from_output(data.get("kv_transfer_params")),
        )
        top = (choice.get("logprobs") or {}).get("top_logprobs") or []
        if top and top[0]:
            event.logprobs = {_token_id(t): float(lp) for t, lp in top[0].items()}
        rows = choice.get("prompt_logprobs")
        if request.prompt_logprobs and rows is not None:
            event.prompt_logprobs = [
                _row_logprob(row, token) for row, token in zip(rows, request.prompt_ids)
            ]
        return event

    def _body(self, request: BackendRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model_name,
            "prompt": list(request.prompt_ids),
            "return_token_ids": True,
            **{k: v for k, v in request.sampling.items() if v is not None},
        }
        if request.salt is not None:
            body["cache_salt"] = request.salt
        if request.params:
            body["kv_transfer_params"] = request.params
        if request.logprobs or request.logprob_token_ids:
            body["logprobs"] = request.logprobs or 1
            body["return_tokens_as_token_ids"] = True
        if request.logprob_token_ids:
            body["logprob_token_ids"] = list(request.logprob_token_ids)
        if request.prompt_logprobs:
            body["prompt_logprobs"] = 0
        if request.json_schema is not None:  # a forced tool call: vLLM's own constraint
            body["structured_outputs"] = {"json": request.json_schema}
        return body

    def close(self) -> None:
        self._client.close()


def _raise_for(response: httpx.Response) -> None:
    if response.status_code >= 400:
        response.read()
        raise ServerError(f"the vLLM server answered {response.status_code}: {response.text}")


def _sse_event(line: str, first: bool) -> BackendEvent | None:
    """One server-sent event as a ``BackendEvent`` (None: not an event of ours)."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if payload == "[DONE]":
        return None
    data = json.loads(payload)
    event = BackendEvent()
    usage = data.get("usage")
    if usage:
        details = usage.get("prompt_tokens_details") or {}
        event.cached_tokens = details.get("cached_tokens")
    for choice in data.get("choices") or []:
        event.text += choice.get("text") or ""
        event.token_ids += list(choice.get("token_ids") or [])
        event.finish_reason = choice.get("finish_reason") or event.finish_reason
        logprobs = choice.get("logprobs") or {}
        top = logprobs.get("top_logprobs") or []
        if first and top:
            event.logprobs = {_token_id(t): float(lp) for t, lp in top[0].items()}
    return event


def _token_id(token: str) -> int:
    """``"token_id:123"`` (``return_tokens_as_token_ids``) -> 123."""
    return int(token.rsplit(":", 1)[-1])


def _row_logprob(row: Any, token: int) -> float | None:
    """The log-probability of ``token`` in one row of a response's ``prompt_logprobs``."""
    if not isinstance(row, dict):
        return None
    for key, value in row.items():
        if _token_id(str(key)) == token:
            logprob = value.get("logprob") if isinstance(value, dict) else value
            return float(logprob) if isinstance(logprob, (int, float)) else None
    return None
