"""Decoding at the hardware's pace: a static cache of a bucket's length, one step
of fixed shapes, captured as a CUDA graph per bucket on CUDA.

After any strategy's prefill, decoding one token is a small forward: on a GPU
its time goes to launching ~10 kernels per layer from Python, not to reading
the weights. As in SGLang's and vLLM's decode graphs, each step here is one
function of fixed shapes over static buffers (the token id ``[1, 1]``, its RoPE
position ``[1, 1]``, the cache slot it is written to ``[1]``, the K/V of every
layer ``[1, kv_heads, bucket, head_dim]``), so it can be captured once with
``torch.cuda.CUDAGraph`` and replayed per token; attention runs inside the
graph, over the whole bucket with an additive mask built in the graph from the
slot (the unfilled tail is masked out, as transformers' ``StaticCache`` masks
it by ``cache_position``). Sampling, stops, streaming and logprobs stay
outside: the step returns the logits (``generate.decode`` calls it through its
one step hook).

Buckets: cache lengths of 4k, 8k, 16k, 32k, 64k and 128k tokens (6, capped at
the model's context window); a request takes the smallest bucket that holds
its prompt and ``max_new_tokens``. A bucket's buffers and graph are made on its
first use (the capture's seconds are kept in ``StaticDecoder.capture_s``) and
the last ``keep`` (2) used buckets are kept: one graph memory pool is shared
by all of them (as SGLang shares one across batch sizes).

The cache is ours (a ``ForwardCache`` writing with ``index_copy_`` at the slot
tensor, the write transformers' ``StaticLayer.update`` does), not
transformers' ``StaticCache``: its write index moved from ``cache_position``
(5.17) to an internal counter (5.24), and turbo's RoPE positions are not cache
slots. The attention of the step is SDPA with the query heads packed onto
their K/V heads (``lower_right``'s function), so no K/V copy per query group.

What runs eagerly as before (the ``DynamicCache`` loop), named in the log once
per model and reason: ``KVRAG_FAST_PATH=0``; a device outside ``devices``
(default CUDA only: on CPU the static step is no faster, see
docs/benchmarks.md); attention other than SDPA; sliding-window or hybrid layer
types; a model whose reuse is refused or spread over devices; a prompt plus
``max_new_tokens`` past the largest bucket; a model whose step cannot be
captured (the capture's error). On CPU the same step runs eagerly over the same
buffers when a caller opts in (``devices=("cpu", "cuda")``): everything but the
capture and replay is tested there.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from kvrag_integrations.engine.modeling.forward import PromptKV
from kvrag_integrations.engine.modeling.hf_compat import ForwardCache, cache_argument
from kvrag_integrations.engine.modeling.layout import ModelLayout
from kvrag_integrations.engine.modeling.lower_right import can_take, lower_right_forward

logger = logging.getLogger(__name__)

__all__ = ["BUCKETS", "StaticDecoder", "StaticSteps", "bucket_for"]

BUCKETS: tuple[int, ...] = tuple(4096 << i for i in range(6))  # 4k .. 128k tokens


def bucket_for(needed: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding ``needed`` cache slots (None: none does)."""
    return next((b for b in sorted(buckets) if b >= needed), None)


class _SlotCache(ForwardCache):
    """Fixed K/V buffers; each layer writes its one fresh token at ``slot`` and
    attends over the whole buffer (the step's mask hides unwritten slots)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], slot: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.slot = keys, values, slot

    def write(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.slot, key_states)
        values.index_copy_(2, self.slot, value_states)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.keys[0].shape[2])


class _Bucket:
    """One bucket's static buffers and its step (a CUDA graph, or eager)."""

    def __init__(self, lm: Any, kv: PromptKV, length: int) -> None:
        dev, dtype = kv.device, kv.dtype
        self.lm, self.length, self.device = lm, length, dev
        shape = [(1, k.shape[0], length, k.shape[2]) for k in kv.keys]
        # zeros: masked slots must hold finite values (0 * NaN would leak in)
        self.keys = [torch.zeros(s, dtype=dtype, device=dev) for s in shape]
        self.values = [torch.zeros(s, dtype=dtype, device=dev) for s in shape]
        self.ids = torch.zeros((1, 1), dtype=torch.long, device=dev)
        self.position = torch.zeros((1, 1), dtype=torch.long, device=dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self.keys_at = torch.arange(length, device=dev)
        self.open = torch.zeros((), dtype=dtype, device=dev)
        self.shut = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=dev)
        self.cache = _SlotCache(self.keys, self.values, self.slot)
        self.logits: torch.Tensor | None = None
        self.graph: Any = None

    def _step(self) -> None:
        """The step of fixed shapes: what the graph holds."""
        mask = torch.where(self.keys_at <= self.slot, self.open, self.shut)[None, None, None]
        with lower_right_forward(self.lm):
            out = self.lm(
                input_ids=self.ids,
                position_ids=self.position,
                attention_mask=mask,
                **cache_argument(self.lm, self.cache),
                use_cache=True,
                logits_to_keep=1,
            )
        if self.logits is None:
            self.logits = torch.empty_like(out.logits[0, -1])
        self.logits.copy_(out.logits[0, -1])

    def capture(self, pool: Any) -> None:
        """Record the step as a CUDA graph (torch's documented warm-up on a side
        stream, then capture into the shared pool). Writes slot 0: call before
        ``fill``."""
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads' CUDA work meanwhile (a tiered store's
            # copies, which take no forward lock) does not void the capture
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._step()
        self.graph = graph

    def fill(self, kv: PromptKV) -> None:
        """Copy the prompt's K/V into slots ``0..tokens-1`` (later slots are masked)."""
        n = kv.num_tokens
        for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
            self.keys[layer][0, :, :n].copy_(k)
            self.values[layer][0, :, :n].copy_(v)

    def run(self, token: int, position: int, slot: int) -> torch.Tensor:
        self.ids.fill_(token)
        self.position.fill_(position)
        self.slot.fill_(slot)
        if self.graph is not None:
            with torch.cuda.device(self.device):
                self.graph.replay()
        else:
            self._step()
        assert self.logits is not None
        return self.logits.clone()  # the next step overwrites the buffer


class StaticSteps:
    """One request's decode steps over a bucket: ``steps(token, position) -> logits``.

    The bucket is taken (made, captured) and filled on the first step, so a
    request that stops at its first token pays nothing.
    """

    def __init__(self, decoder: StaticDecoder, lm: Any, kv: PromptKV, length: int) -> None:
        self.decoder, self.lm, self.kv, self.length = decoder, lm, kv, length
        self.bucket: _Bucket | None = None
        self.slot = kv.num_tokens

    def __call__(self, token: int, position: int) -> torch.Tensor:
        if self.bucket is None:
            self.bucket = self.decoder.bucket(self.lm, self.kv, self.length)
            self.bucket.fill(self.kv)
        logits = self.bucket.run(token, position, self.slot)
        self.slot += 1
        return logits


class StaticDecoder:
    """The static decode of one model's weights: its buckets, graphs and refusals.

    Used under the weights' forward lock (``LoadedModel.lock``), like every forward.

    Args:
        layout: the model's layout (its windows and whether reuse is refused).
        buckets: cache lengths to choose from (capped at the context window).
        devices: device types that decode statically (CUDA: captured as graphs).
        keep: how many buckets' buffers and graphs stay allocated.
        graphs: capture CUDA graphs on CUDA (False: the static step runs eagerly).
    """

    def __init__(
        self,
        layout: ModelLayout,
        buckets: Sequence[int] = BUCKETS,
        devices: Sequence[str] = ("cuda",),
        keep: int = 2,
        graphs: bool = True,
    ) -> None:
        self.layout = layout
        self.buckets = tuple(sorted(buckets))
        self.devices = tuple(devices)
        self.keep = keep
        self.graphs = graphs
        self.capture_s: dict[int, float] = {}  # bucket -> seconds of its first capture
        self._held: OrderedDict[int, _Bucket] = OrderedDict()
        self._model: int | None = None  # id of the model the held buckets belong to
        self._pool: Any = None
        self._broken: str | None = None  # a capture failed: the reason
        self._named: set[str] = set()
        self.last: str | None = None  # how the last request decoded (benchmarks report it)

    def refusal(self, lm: Any, kv: PromptKV, max_new_tokens: int) -> str | None:
        """Why this request decodes eagerly (None: it decodes statically)."""
        if not can_take(lm):  # the switch, or attention other than SDPA
            return "KVRAG_FAST_PATH=0 or attention other than sdpa"
        if kv.device.type not in self.devices:
            return f"device {kv.device.type} (static decode on {', '.join(self.devices) or 'none'})"
        if any(w is not None for w in self.layout.windows):
            return "sliding-window or hybrid layer types"
        if self.layout.reuse_refused:
            return "a model whose reuse is refused"
        if len(set((getattr(lm, "hf_device_map", None) or {}).values())) > 1:
            return "a model spread over devices"
        if self._broken:
            return self._broken
        if self.length(lm, kv.num_tokens + max_new_tokens) is None:
            return f"prompt and max_new_tokens past the largest bucket ({self.buckets[-1]})"
        return None

    def length(self, lm: Any, needed: int) -> int | None:
        """The bucket for ``needed`` slots, capped at the model's context window."""
        cap = int(getattr(lm.config, "max_position_embeddings", 0) or 0)
        sizes = {min(b, cap) if cap else b for b in self.buckets}
        return bucket_for(needed, sizes)

    def steps(self, lm: Any, kv: PromptKV, max_new_tokens: int) -> StaticSteps | None:
        """The static steps for a request, or None (decode eagerly; the reason is
        logged once per reason)."""
        why = self.refusal(lm, kv, max_new_tokens)
        self.last = f"eager: {why}" if why else None
        if why is not None:
            if why not in self._named:
                self._named.add(why)
                logger.info("%s decodes eagerly: %s", type(lm).__name__, why)
            return None
        length = self.length(lm, kv.num_tokens + max_new_tokens)
        assert length is not None
        graphed = self.graphs and kv.device.type == "cuda"
        self.last = f"static, bucket {length}" + (", CUDA graph" if graphed else ", eager step")
        return StaticSteps(self, lm, kv, length)

    def bucket(self, lm: Any, kv: PromptKV, length: int) -> _Bucket:
        """The bucket of ``length`` for ``lm``, made (and captured) on first use."""
        if self._model != id(lm):
            self._held.clear()
            self._model = id(lm)
        held = self._held.get(length)
        if held is not None and held.keys[0].dtype == kv.dtype:
            self._held.move_to_end(length)
            return held
        while len(self._held) >= max(self.keep, 1):
            self._held.popitem(last=False)
        made = _Bucket(lm, kv, length)
        if self.graphs and kv.device.type == "cuda":
            self._capture(made, length)
        self._held[length] = made
        return made

    def _capture(self, bucket: _Bucket, length: int) -> None:
        started = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            bucket.capture(self._pool)
        except RuntimeError as exc:  # an op that cannot be captured (a host sync)
            self._broken = f"its decode step cannot be captured ({exc})"[:300]
            name = type(bucket.lm).__name__
            logger.info("%s decodes eagerly from now on: %s", name, self._broken)
            bucket.graph = None
            return
        torch.cuda.synchronize()
        self.capture_s.setdefault(length, time.perf_counter() - started)
