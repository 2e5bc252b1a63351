"""What the vLLM tests compare (exact references, log-probability distances) and the
servers they start."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kvrag_integrations.bench.common import RagItem
from kvrag_integrations.engine.modeling.sampling import SamplingParams
from kvrag_integrations.vllm.client.backend import BackendRequest, sampling_args
from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine
from kvrag_integrations.vllm.launch import wait_until_serving

TOP = 20  # log-probabilities compared per first token
# Each vLLM of the tests gets a KV cache of this size (several run at once).
KV_CACHE_BYTES = 768 * 2**20

# The servers modules share (``pytest.mark.vllm_server(*flags)``, conftest.py), by flags.
# As the README starts it: ``python -m kvrag_integrations.vllm.serve --store disk:DIR``.
README_SERVER: tuple[str, ...] = ()
# vLLM's tool calling as docs/openai-clients.md starts it, with the packaged ChatML tool
# template (the bundled SmolLM2's own has no tools)...
TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
TOOL_FLAGS += ("--chat-template", "chatml-tools", "--tool-strict-level", "parameter")
# ...with entries at model precision: one server for the agent-tool tests (the flags)
# and the reranker over HTTP (the precision: scores compared with float32 tolerances).
TOOLS_SERVER = (*TOOL_FLAGS, "--cache-precision", "model")


def needs_vllm() -> None:
    """Skip the calling test module where vLLM is not installed."""
    pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM lane of .ci/run has it)")


def exact_reference(
    engine: VLLMEngine, ids: list[int], max_new_tokens: int = 32, salt: str | None = "fresh"
) -> tuple[list[int], dict[int, float], int]:
    """vLLM's own answer to ``ids``: greedy tokens, first-token top log-probabilities
    and its cached-token count. A salt of its own (default) keeps every block any
    earlier request cached out of it: computed afresh, as a new vLLM would."""
    if salt == "fresh":
        salt = f"reference-{uuid.uuid4().hex}"
    tokens: list[int] = []
    first: dict[int, float] = {}
    cached = 0
    for event in send(engine, ids, salt=salt, max_new_tokens=max_new_tokens):
        tokens += event.token_ids
        first = first or (event.logprobs or {})
        cached = event.cached_tokens if event.cached_tokens is not None else cached
    if tokens and tokens[-1] in engine.eos_token_ids:
        tokens.pop()  # as the engines report answers: without their end token
    return tokens, first, cached


def send(
    engine: VLLMEngine,
    ids: list[int],
    *,
    salt: str | None,
    params: dict | None = None,
    max_new_tokens: int = 1,
) -> list:
    """One request straight to the engine's vLLM (no engine logic): its events. Without
    ``params`` it opts out of a server's detection of stored passages (an exact request)."""
    sampling = sampling_args(SamplingParams(max_new_tokens=max_new_tokens), engine.eos_token_ids)
    if params is None:
        params = {"kvrag": {"detect": False}}
    request = BackendRequest(ids, sampling, salt, params, TOP)
    return list(engine.backend.submit(request, threading.Event()))


def max_logprob_gap(got: dict[int, float], want: dict[int, float]) -> float:
    """The largest |difference| over the tokens both top lists hold (most of them)."""
    common = got.keys() & want.keys()
    assert len(common) >= TOP // 2, f"the top-{TOP} lists share only {len(common)} tokens"
    return max(abs(got[i] - want[i]) for i in common)


def logprobs_of(logits: torch.Tensor, ids: list[int]) -> dict[int, float]:
    """Log-probabilities of ``ids`` under the in-process engine's first-token logits."""
    lp = torch.log_softmax(logits.float().reshape(-1), dim=-1)
    return {i: float(lp[i]) for i in ids}


STOP_GRACE_S = 5.0


class VLLMServer:
    """``python -m kvrag_integrations.vllm.serve`` on a free port, until stopped.
    Started through the fixtures of conftest.py, which count each start."""

    def __init__(self, store: str, workdir: Path, port: int, extra: Sequence[str] = ()) -> None:
        self.url, self.store = f"http://127.0.0.1:{port}", store
        self.log = workdir / f"vllm-{port}.log"
        args = [sys.executable, "-m", "kvrag_integrations.vllm.serve", "--store", store]
        args += ["--port", str(port), "--max-model-len", "4096"]
        args += ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES), *extra]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 300.0) -> VLLMServer:
        if wait_until_serving(self.url, self.proc, timeout):
            return self
        self.stop()
        raise RuntimeError(f"vLLM server did not start:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the server and what it started after
        ``STOP_GRACE_S``: vLLM aborts its engine at once, and uvicorn then waits
        for a request in flight (a client's background encode), which the
        aborted engine fails only ~25 s later."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                import psutil  # (vLLM's dependency)

                with contextlib.suppress(psutil.Error):
                    for child in psutil.Process(self.proc.pid).children(recursive=True):
                        child.kill()
                self.proc.kill()
                self.proc.wait()


class Corpus:
    """Questions with their passages: MuSiQue where the shared evaluation data is
    beside the checkout, else the bundled sample corpus. ``item(i)`` wraps around;
    ``chunks(i, n, tag)`` are passages of item ``i`` marked with ``tag``, so each
    test that needs chunks never encoded before gets texts of its own."""

    def __init__(self, items: list[RagItem]) -> None:
        self.items = items

    def item(self, i: int) -> RagItem:
        return self.items[i % len(self.items)]

    def chunks(self, i: int, n: int, tag: str = "", chars: int | None = None) -> list[str]:
        """Item ``i``'s first ``n`` passages (MuSiQue's: ~600 tokens), marked with
        ``tag``; each cut at a word to at most ``chars`` characters where given (a
        test whose point is not length: 480 characters are ~110 tokens)."""
        passages = self.item(i).chunks
        picked = [passages[k % len(passages)] for k in range(n)]
        marked = [f"({tag}) {text}" if tag else text for text in picked]
        if chars is None:
            return marked
        return [text if len(text) <= chars else text[:chars].rsplit(" ", 1)[0] for text in marked]

    def unseen(self, i: int, n: int, tag: str, words: int | None = None) -> list[str]:
        """``chunks(i, n)`` (each its first ``words`` words where given) with ``tag``
        between every 6 words: no run of 16 tokens of them is in another test's
        passages (MuSiQue's items share passages, and detection finds a passage
        inside any entry that holds it)."""
        out = []
        for text in self.chunks(i, n):
            kept = text.split()[:words]
            parts = [" ".join(kept[k : k + 6]) for k in range(0, len(kept), 6)]
            out.append(f" ({tag}) ".join(parts))
        return out
