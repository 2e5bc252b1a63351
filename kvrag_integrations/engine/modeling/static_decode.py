"""Decoding at the hardware's pace: a static cache of a bucket's length, fixed-shape
steps captured as CUDA graphs, the prompt laid out in the bucket, no copy.

After any strategy's prefill, decoding one token is a small forward: on a GPU
its time goes to launching ~10 kernels per layer from Python, not to reading
the weights. As in SGLang's and vLLM's decode graphs, each step here is one
function of fixed shapes over static buffers (``static_buckets.Step``),
captured once with ``torch.cuda.CUDAGraph`` and replayed per token; attention
runs inside the graph and reads only the filled slots (``filled_attention``:
a split-KV Triton kernel, masked SDPA without Triton). Sampling, stops,
streaming and logprobs stay outside: a step returns the logits
(``generate.decode`` calls it through its one step hook).

**Buckets:** cache lengths of 4k, 8k, 16k, 32k, 64k and 128k tokens (capped at
the model's context window); a request takes the smallest that holds its
prompt and ``max_new_tokens``. Buckets stay allocated for the next requests,
least recently used released first, at most ``max_bytes`` of them (default a
quarter of the GPU's memory); all graphs share one memory pool.

**One copy of the prompt's K/V:** a request (``in_process.answer``) reserves
its bucket before its prefill (``reserve``); the strategy then lays the prompt
out in the bucket's buffers (``claim``, through ``LoadedModel.prompt_kv``), and
decoding starts there. A prompt cache made elsewhere is copied in (``fill``).

**The tail:** over a claimed bucket, the forward of up to 128 tokens over the
reused chunks (turbo's question, the text between chunks) runs as a step of 16,
32, 64 or 128 rows, a graph each (``tail``, which ``forward.run_tokens`` calls).

**Failures never end a request:** a bucket that cannot be allocated (out of
memory: the kept buckets are released and it is tried once more) leaves the
request on the eager path; a step that cannot be captured runs eagerly over the
bucket for that request, and the next request tries again (after
``max_capture_failures`` failures in a row, not any more: steps run eagerly);
a step that fails eagerly hands decoding to the eager ``DynamicCache`` steps
over the slots filled so far. Each reason is named once in the log; ``stats``
counts captures, recaptures (a step captured again after its bucket was
released), failures and releases.

What runs eagerly as before (the ``DynamicCache`` loop), named in the log once
per reason: ``KVRAG_FAST_PATH=0``; a device outside ``devices`` (default CUDA
only: on CPU the static step is no faster, see docs/benchmarks.md); attention
other than SDPA; sliding-window or hybrid layer types; a model whose reuse is
refused or spread over devices; a prompt plus ``max_new_tokens`` past the
largest bucket. On CPU the same steps run eagerly over the same buffers when a
caller opts in (``devices=("cpu", "cuda")``): everything but the capture and
replay is tested there.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from kvrag_integrations.engine.modeling.forward import PromptKV
from kvrag_integrations.engine.modeling.generate import dynamic_steps
from kvrag_integrations.engine.modeling.layout import ModelLayout
from kvrag_integrations.engine.modeling.lower_right import can_take
from kvrag_integrations.engine.modeling.static_buckets import (
    Bucket,
    BucketStore,
    Step,
    is_out_of_memory,
)

logger = logging.getLogger(__name__)

__all__ = ["BUCKETS", "TAILS", "StaticDecoder", "StaticSteps", "bucket_for"]

BUCKETS: tuple[int, ...] = tuple(4096 << i for i in range(6))  # 4k .. 128k tokens
TAILS: tuple[int, ...] = (16, 32, 64, 128)  # row counts of a prompt tail's steps


def bucket_for(needed: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding ``needed`` cache slots (None: none does)."""
    return next((b for b in sorted(buckets) if b >= needed), None)


class StaticSteps:
    """One request's decode steps over a bucket: ``steps(token, position) -> logits``.

    A prompt cache laid out in the bucket decodes there; any other is copied in
    on the first step, so a request that stops at its first token pays nothing.
    A step that fails hands the rest of the request to the eager steps.
    """

    def __init__(self, decoder: StaticDecoder, lm: Any, kv: PromptKV, length: int) -> None:
        self.decoder, self.lm, self.kv, self.length = decoder, lm, kv, length
        self.bucket: Bucket | None = decoder.holding(kv)
        self.filled = self.bucket is not None
        self.slot = kv.num_tokens
        self.eager: Any = None  # the eager steps, once the static ones failed

    def __call__(self, token: int, position: int) -> torch.Tensor:
        if self.eager is None:
            try:
                logits = self._static(token, position)
            except Exception as exc:
                self.decoder.failed("decode step", exc)
                self.eager = self._eager_from_here()
            else:
                self.slot += 1
                return logits
        logits = self.eager(token, position)
        self.slot += 1
        return logits

    def _static(self, token: int, position: int) -> torch.Tensor:
        if self.bucket is None:
            self.bucket = self.decoder.store.take(
                self.lm, self.kv.dtype, self.kv.device, self.length
            )
            if self.bucket is None:
                raise RuntimeError("no bucket (out of memory)")
        if not self.filled:
            self.bucket.fill(self.kv.keys, self.kv.values)
            self.filled = True
        step = self.bucket.step(self.lm, 1)
        step.set_token(token, position, self.slot)
        self.decoder.ready(step)
        return step.run()

    def _eager_from_here(self) -> Any:
        """Eager steps over what is filled: the prompt, and the answer's tokens so far
        (in the bucket's slots ``n .. slot-1``)."""
        kv = self.kv
        if self.bucket is not None and self.filled and self.slot > kv.num_tokens:
            keys, values = self.bucket.views(self.slot)
            kv = PromptKV(keys, values, kv.positions, kv.input_ids)
        return dynamic_steps(self.lm, kv)


class StaticDecoder:
    """The static decode of one model's weights: its buckets, graphs and refusals.

    Used under the weights' forward lock (``LoadedModel.lock``), like every forward.

    Args:
        layout: the model's layout (its windows and whether reuse is refused).
        buckets: cache lengths to choose from (capped at the context window).
        devices: device types that decode statically (CUDA: captured as graphs).
        max_bytes: most bytes of K/V buffers kept between requests, least recently
            used released first (None: a quarter of the GPU's memory; 1 GiB
            elsewhere). A bucket larger than that alone is still made.
        graphs: capture CUDA graphs on CUDA (False: the static steps run eagerly).
        tails: row counts of the prompt-tail steps (``()``: tails run eagerly).
        max_capture_failures: requests in a row with a failed capture after which
            steps run eagerly for good (named in the log).
    """

    def __init__(
        self,
        layout: ModelLayout,
        buckets: Sequence[int] = BUCKETS,
        devices: Sequence[str] = ("cuda",),
        max_bytes: int | None = None,
        graphs: bool = True,
        tails: Sequence[int] = TAILS,
        max_capture_failures: int = 3,
    ) -> None:
        self.layout = layout
        self.buckets = tuple(sorted(buckets))
        self.devices = tuple(devices)
        self.graphs = graphs
        self.tails = tuple(sorted(tails))
        self.max_capture_failures = max_capture_failures
        self.capture_s: dict[str, float] = {}  # "bucket" or "bucket/tail rows" -> last capture
        self.stats = dict.fromkeys(
            ("captures", "recaptures", "capture_failures", "step_failures", "out_of_memory",
             "released"), 0,
        )  # fmt: skip
        self.last: str | None = None  # how the last request decoded (benchmarks report it)
        self.store = BucketStore(layout, max_bytes, self.stats)
        self._pool: Any = None
        self._failures = 0  # requests in a row whose capture failed
        self._failed_in = -1  # the last of them
        self._no_graphs: str | None = None  # why steps run eagerly for good
        self._captured: set[str] = set()
        self._named: set[str] = set()
        self._reserved: tuple[int, Bucket, int] | None = None  # (thread, bucket, tokens)
        self._request = 0  # counts requests (a failed capture is retried by the next)
        self._skip: int | None = None  # the request whose bucket could not be allocated

    # -- what decodes statically ---------------------------------------------------------------

    def refusal(
        self, lm: Any, device: torch.device, tokens: int, max_new_tokens: int
    ) -> str | None:
        """Why a request decodes eagerly (None: it decodes statically)."""
        if not can_take(lm):  # the switch, or attention other than SDPA
            return "KVRAG_FAST_PATH=0 or attention other than sdpa"
        kind = torch.device(device).type
        if kind not in self.devices:
            return f"device {kind} (static decode on {', '.join(self.devices) or 'none'})"
        if any(w is not None for w in self.layout.windows):
            return "sliding-window or hybrid layer types"
        if self.layout.reuse_refused:
            return "a model whose reuse is refused"
        if len(set((getattr(lm, "hf_device_map", None) or {}).values())) > 1:
            return "a model spread over devices"
        if self.length(lm, tokens + max_new_tokens) is None:
            return f"prompt and max_new_tokens past the largest bucket ({self.buckets[-1]})"
        return None

    def length(self, lm: Any, needed: int) -> int | None:
        """The bucket for ``needed`` slots, capped at the model's context window."""
        cap = int(getattr(lm.config, "max_position_embeddings", 0) or 0)
        sizes = {min(b, cap) if cap else b for b in self.buckets}
        return bucket_for(needed, sizes)

    def _refused(self, lm: Any, why: str | None) -> bool:
        self.last = f"eager: {why}" if why else None
        if why is not None and why not in self._named:
            self._named.add(why)
            logger.info("%s decodes eagerly: %s", type(lm).__name__, why)
        return why is not None

    def _path(self, length: int, device: torch.device) -> str:
        graphed = self.graphs and device.type == "cuda" and self._no_graphs is None
        return f"static, bucket {length}" + (", CUDA graph" if graphed else ", eager step")

    # -- a request: its bucket reserved, the prompt laid out in it, decoding -------------------

    @contextmanager
    def reserve(self, lm: Any, tokens: int, max_new_tokens: int) -> Iterator[None]:
        """Within the block (one request's prefill and decoding, under the forward
        lock), this thread's first prompt buffer of at most ``tokens`` is laid out in
        the request's bucket (``claim``). Nothing is reserved where the request
        decodes eagerly or the bucket cannot be allocated."""
        self._request += 1
        device = torch.device(getattr(lm, "device", "cpu"))
        bucket = None
        if not self._refused(lm, self.refusal(lm, device, tokens, max_new_tokens)):
            length = self.length(lm, tokens + max_new_tokens)
            assert length is not None
            bucket = self.store.take(lm, lm.dtype, device, length)
            self.last = self._path(length, device) if bucket else "eager: out of memory"
            self._skip = None if bucket else self._request
        self._reserved = None if bucket is None else (threading.get_ident(), bucket, tokens)
        try:
            yield
        finally:
            self._reserved, self._skip = None, None

    def claim(
        self, layout: ModelLayout, positions: torch.Tensor, input_ids: torch.Tensor
    ) -> PromptKV | None:
        """The reserved bucket's slots ``0 .. n-1`` as the prompt buffer of
        ``input_ids`` (n tokens), once per reservation and only on its thread;
        None: lay the prompt out in fresh memory."""
        held = self._reserved
        n = int(input_ids.numel())
        if held is None or held[0] != threading.get_ident() or n > held[2] or n == 0:
            return None
        _, bucket, _ = held
        if (layout.num_layers, layout.kv_heads, layout.head_dim) != (
            len(bucket.keys),
            bucket.keys[0].shape[1],
            bucket.keys[0].shape[3],
        ):
            return None
        self._reserved = None
        keys, values = bucket.views(n)
        kv = PromptKV(keys, values, positions.to(bucket.device), input_ids.to(bucket.device))
        kv.home = self
        bucket.tenant = weakref.ref(kv)
        return kv

    def holding(self, kv: PromptKV) -> Bucket | None:
        """The held bucket ``kv`` is laid out in (None: none)."""
        if kv.home is not self:
            return None
        return self.store.holding(kv)

    def steps(self, lm: Any, kv: PromptKV, max_new_tokens: int) -> StaticSteps | None:
        """The static steps for a request, or None (decode eagerly; the reason is
        logged once per reason)."""
        bucket = self.holding(kv)
        if bucket is None:
            if self._skip == self._request:  # its bucket could not be allocated
                return None
            self._request += 1  # a request that reserved nothing
        if self._refused(lm, self.refusal(lm, kv.device, kv.num_tokens, max_new_tokens)):
            return None
        length = (
            bucket.length if bucket is not None else self.length(lm, kv.num_tokens + max_new_tokens)
        )
        assert length is not None
        self.last = self._path(length, kv.device)
        return StaticSteps(self, lm, kv, length)

    def tail(self, lm: Any, kv: PromptKV, rows: torch.Tensor) -> torch.Tensor | None:
        """float32 logits of the last of ``rows`` (sorted, distinct sequence indices,
        at most the largest tail step's count: what a prompt computes over its
        reused chunks) computed over ``kv``'s bucket as a tail step, their K/V
        written into the bucket; None where it does not apply (the caller runs
        the forward as usual)."""
        bucket = self.holding(kv)
        n, count = kv.num_tokens, int(rows.numel())
        size = bucket_for(count, self.tails) if bucket is not None and count > 1 else None
        if size is None or not can_take(lm) or n + size - count > bucket.length:
            return None
        step = bucket.step(lm, size)
        step.set_rows(kv.input_ids[rows], kv.positions[rows], rows, n)
        try:
            self.ready(step)
            return step.run().float()
        except Exception as exc:
            self.failed("tail step", exc)
            if not is_out_of_memory(exc):  # an eager forward that fails will fail again
                self.tails = ()
            return None

    # -- buckets and graphs --------------------------------------------------------------------

    def ready(self, step: Step) -> None:
        """Prepare ``step`` (capture its graph) if not yet; a failure leaves it eager
        for this request and is tried again by the next one."""
        graphs = self.graphs and self._no_graphs is None
        retry = step.failed and step.tried != self._request and graphs
        if step.prepared and not retry:
            return
        key = f"{step.bucket.length}" + (f"/tail {step.rows}" if step.rows > 1 else "")
        step.tried = self._request
        try:
            seconds = step.prepare(self._pool_for(step), graphs)
        except Exception as exc:
            # the next capture takes a fresh pool: torch may leave this one
            # marked as recording (see unwind_capture), failing every capture into it
            self._pool = None
            self.failed(f"capture of {key}", exc, capture=True)
            return
        if graphs or step.bucket.device.type != "cuda":  # elsewhere a capture is its warm-up
            if self._failed_in != self._request:
                self._failures = 0
            self.stats["captures"] += 1
            if key in self._captured:
                self.stats["recaptures"] += 1
                self._name(
                    f"step {key} captured again (its bucket was released)", level=logging.DEBUG
                )
            self._captured.add(key)
            self.capture_s[key] = seconds

    def _pool_for(self, step: Step) -> Any:
        if self._pool is None and step.bucket.device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def failed(self, what: str, exc: BaseException, capture: bool = False) -> None:
        """Count and name (once per reason) a failure the request survives."""
        if is_out_of_memory(exc):
            self.stats["out_of_memory"] += 1
            self.store.release(idle_only=True)
        elif capture:
            self.stats["capture_failures"] += 1
            if self._failed_in != self._request:  # requests with a failed capture, in a row
                self._failed_in = self._request
                self._failures += 1
            if self._failures >= self.max_capture_failures and self._no_graphs is None:
                self._no_graphs = f"{self._failures} captures failed in a row"
                self._name(f"steps run eagerly from now on: {self._no_graphs}")
        else:
            self.stats["step_failures"] += 1
        self._name(f"{what} failed, this request goes on eagerly ({exc})"[:300])

    def _name(self, what: str, level: int = logging.INFO) -> None:
        if what not in self._named:
            self._named.add(what)
            logger.log(level, "static decode: %s", what)
