"""A bucket of the static decode: fixed K/V buffers and its fixed-shape steps.

A bucket holds every layer's K/V for ``length`` cache slots
(``[1, kv_heads, length, head_dim]``, zeroed: the masked fallback reads every
slot). A request's prompt lies in slots ``0 .. n-1`` (laid out there by the
strategy, no copy: ``StaticDecoder.claim``); its answer's tokens follow.

A step (:class:`Step`) is one forward of ``rows`` tokens at ascending slots
over the bucket, all its inputs in static device tensors (token ids, RoPE
positions, slots, the row whose logits are kept), its attention through
``filled_attention`` (row ``t`` reads only slots ``0 .. slots[t]``). One row is
a decode step; 16 to 128 rows are what a prompt computes over its reused
chunks (turbo's question, the text between chunks), padded past the prompt to
the step's row count (padding rows write slots the answer overwrites before
reading them). On CUDA a step is
captured once as a CUDA graph (:func:`record`) and replayed; elsewhere its
warm-up runs and it then runs eagerly.

The cache is ours (``index_copy_`` at the slots, the write transformers'
``StaticLayer.update`` does), not transformers' ``StaticCache``: its write index
moved from ``cache_position`` (5.17) to an internal counter (5.24), and turbo's
RoPE positions are not cache slots.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any

import torch

from kvrag_integrations.engine.modeling.hf_compat import ForwardCache, cache_argument
from kvrag_integrations.engine.modeling.layout import ModelLayout
from kvrag_integrations.engine.modeling.lower_right import lower_right_forward, placeholder

__all__ = ["Bucket", "BucketStore", "Step", "is_out_of_memory", "preparing", "record"]

_local = threading.local()


def preparing() -> bool:
    """Whether this thread is inside a step's warm-up or capture (where, on CUDA,
    an op that syncs with the host makes the capture fail)."""
    return getattr(_local, "preparing", False)


class _SlotCache(ForwardCache):
    """Fixed K/V buffers; each layer writes its fresh tokens at ``slots`` and
    hands attention the whole buffer (``filled_attention`` reads the filled part)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], slots: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.slots = keys, values, slots

    def write(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.slots, key_states)
        values.index_copy_(2, self.slots, value_states)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.keys[0].shape[2])


def record(step: Any, device: torch.device, pool: Any) -> Any:
    """Capture ``step()`` as a CUDA graph into ``pool`` (torch's recipe: warm-up
    on a side stream, then capture there). Raises what the capture raises; the
    thread is back on its own stream whatever happens (``torch.cuda.graph``'s
    exit skips that when ``capture_end`` raises, so the stream is entered here)."""
    torch.cuda.synchronize(device)
    own = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(own)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        for _ in range(2):  # Triton compiles, cuBLAS picks its kernels: not in the graph
            step()
        side.synchronize()
        # thread_local: other threads' CUDA work meanwhile (a tiered store's
        # copies, which take no forward lock) does not void the capture
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            try:
                step()
            finally:
                graph.capture_end()
        except BaseException:
            unwind_capture(graph, device, pool)
            raise
    own.wait_stream(side)
    return graph


def unwind_capture(graph: Any, device: torch.device, pool: Any) -> None:
    """Undo what a failed capture leaves behind. torch (2.11 measured on an
    H200) undoes only a capture whose end succeeded (pytorch#190308): otherwise
    the allocator keeps routing to the capture's pool, so every later capture
    into it fails ("already recording to mempool_id"), and the CUDA generator
    stays in capture mode, so every later random op on the device fails
    ("Offset increment outside graph capture"). Each undo is skipped where
    torch already did it; the caller also takes a fresh pool for the next
    capture, so a pool left marked cannot fail it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    # best effort, each on its own: the capture's error is what the caller sees
    with contextlib.suppress(Exception):
        graph.reset()
    with contextlib.suppress(Exception):  # "not currently recording": nothing to undo
        torch._C._cuda_endAllocateToPool(index, pool)
    with contextlib.suppress(Exception):
        # a fresh state of the same seed and offset, out of capture mode (our
        # graphs draw no random numbers: none needs the state it registered)
        generator = torch.cuda.default_generators[index]
        generator.graphsafe_set_state(generator.clone_state())


class Step:
    """One fixed-shape forward of ``rows`` tokens over a bucket, and its graph."""

    def __init__(self, bucket: Bucket, lm: Any, rows: int) -> None:
        dev = bucket.device
        self.bucket, self.lm, self.rows = bucket, lm, rows
        self.ids = torch.zeros((1, rows), dtype=torch.long, device=dev)
        self.positions = torch.zeros((1, rows), dtype=torch.long, device=dev)
        self.slots = torch.zeros(rows, dtype=torch.long, device=dev)
        # the row whose logits are kept (a tail shorter than ``rows``: its last)
        self.keep = torch.zeros(1, dtype=torch.long, device=dev) if rows > 1 else None
        self.mask = placeholder(rows, bucket.length, bucket.dtype, dev)
        self.logits: torch.Tensor | None = None
        self.graph: Any = None
        self.prepared = False  # warmed up (and captured, unless that failed)
        self.failed = False  # its last preparation raised
        self.tried = -1  # the request that last prepared it

    @torch.no_grad()  # writes the bucket in place: never part of an autograd graph
    def forward(self) -> None:
        """The step of fixed shapes: what the graph holds."""
        bucket = self.bucket
        cache = _SlotCache(bucket.keys, bucket.values, self.slots)
        with lower_right_forward(self.lm, slots=self.slots):
            out = self.lm(
                input_ids=self.ids,
                position_ids=self.positions,
                attention_mask=self.mask,
                **cache_argument(self.lm, cache),
                use_cache=True,
                logits_to_keep=1 if self.keep is None else self.keep,
            )
        if self.logits is None:
            self.logits = torch.empty_like(out.logits[0, -1])
        self.logits.copy_(out.logits[0, -1])

    def prepare(self, pool: Any, graphs: bool) -> float:
        """Warm up (and on CUDA with ``graphs`` capture) with the inputs as set:
        a capture writes the K/V of those rows, so set them first. Returns the
        seconds it took; raises what the warm-up or capture raises."""
        started = time.perf_counter()
        self.prepared, self.failed, self.graph = True, True, None
        _local.preparing = True
        try:
            if graphs and self.bucket.device.type == "cuda":
                self.graph = record(self.forward, self.bucket.device, pool)
                torch.cuda.synchronize(self.bucket.device)
            else:
                for _ in range(2):
                    self.forward()
        finally:
            _local.preparing = False
        self.failed = False
        return time.perf_counter() - started

    def set_token(self, token: int, position: int, slot: int) -> None:
        self.ids.fill_(token)
        self.positions.fill_(position)
        self.slots.fill_(slot)

    def set_rows(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, end: int
    ) -> None:
        """``n <= rows`` tokens (``ids``, ``positions``) at ascending ``slots``, all
        before ``end``; the padding rows take slots ``end ..`` and continue the
        positions (any id: their K/V lie past the prompt, their logits unkept)."""
        n = ids.numel()
        self.ids[0, :n].copy_(ids)
        self.positions[0, :n].copy_(positions)
        self.slots[:n].copy_(slots)
        if n < self.rows:
            pad = torch.arange(self.rows - n, device=self.slots.device)
            self.ids[0, n:].zero_()
            self.positions[0, n:].copy_(positions[-1] + 1 + pad)
            self.slots[n:].copy_(end + pad)
        assert self.keep is not None
        self.keep.fill_(n - 1)

    def run(self) -> torch.Tensor:
        """The logits of the kept row, for the inputs as set (a copy)."""
        if self.graph is not None:
            with torch.cuda.device(self.bucket.device):
                self.graph.replay()
        else:
            self.forward()
        assert self.logits is not None
        return self.logits.clone()  # the next step overwrites the buffer


class Bucket:
    """One bucket's K/V buffers and its steps (one per row count)."""

    def __init__(
        self, layout: ModelLayout, length: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.length, self.dtype, self.device = length, dtype, torch.device(device)
        shape = (1, layout.kv_heads, length, layout.head_dim)
        # zeros: the masked fallback reads every slot (0 x NaN would leak in)
        self.keys = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.steps: dict[int, Step] = {}
        self.tenant: Any = None  # weakref to the PromptKV laid out in it

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def step(self, lm: Any, rows: int) -> Step:
        """The step of ``rows`` tokens (made, not yet prepared, on first use)."""
        if rows not in self.steps:
            self.steps[rows] = Step(self, lm, rows)
        return self.steps[rows]

    def views(self, tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer ``[kv_heads, tokens, head_dim]`` views of slots ``0 .. tokens-1``."""
        return [k[0, :, :tokens] for k in self.keys], [v[0, :, :tokens] for v in self.values]

    @torch.no_grad()
    def fill(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Copy a prompt's K/V (per layer ``[kv_heads, n, head_dim]``) into slots
        ``0..n-1``: for a prompt cache not laid out in the bucket."""
        for layer, (k, v) in enumerate(zip(keys, values)):
            n = k.shape[1]
            self.keys[layer][0, :, :n].copy_(k)
            self.values[layer][0, :, :n].copy_(v)


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation that failed (CUDA's OutOfMemoryError, the CPU allocator's error)."""
    return isinstance(exc, torch.OutOfMemoryError) or "allocate memory" in str(exc)


class BucketStore:
    """The buckets kept between requests, for one model: least recently used
    released first, at most ``max_bytes`` of K/V (None: a quarter of the GPU's
    memory, 1 GiB elsewhere; a bucket larger than that alone is still made).
    ``stats`` counts ``released`` buckets and ``out_of_memory`` failures."""

    def __init__(self, layout: ModelLayout, max_bytes: int | None, stats: dict[str, int]) -> None:
        self.layout, self.max_bytes, self.stats = layout, max_bytes, stats
        self.held: OrderedDict[int, Bucket] = OrderedDict()
        self._model: Any = None  # weakref to the model the held buckets belong to

    def take(self, lm: Any, dtype: torch.dtype, device: torch.device, length: int) -> Bucket | None:
        """The bucket of ``length`` for ``lm``, made on first use (None: it could not
        be allocated, even after releasing the kept ones)."""
        if self._model is None or self._model() is not lm:  # another model: not its graphs
            self.release()
            self._model = weakref.ref(lm)
        held = self.held.get(length)
        if held is not None and held.dtype == dtype and held.device == torch.device(device):
            self.held.move_to_end(length)
            return held
        if held is not None:
            self._drop(length)
        for attempt in range(2):
            self._make_room(length, dtype, device)
            try:
                made = Bucket(self.layout, length, dtype, device)
            except RuntimeError as exc:
                if not is_out_of_memory(exc):
                    raise
                self.stats["out_of_memory"] += 1
                self.release()  # then once more, with nothing else kept
                if attempt:
                    return None
            else:
                self.held[length] = made
                return made
        return None

    def holding(self, kv: Any) -> Bucket | None:
        """The held bucket the prompt cache ``kv`` is laid out in (None: none)."""
        return next(
            (b for b in self.held.values() if b.tenant is not None and b.tenant() is kv), None
        )

    def _make_room(self, length: int, dtype: torch.dtype, device: torch.device) -> None:
        layout = self.layout
        per_slot = 2 * layout.num_layers * layout.kv_heads * layout.head_dim
        need = per_slot * length * torch.empty((), dtype=dtype).element_size()
        cap = self.max_bytes if self.max_bytes is not None else _default_max_bytes(device)
        while self.held and sum(b.nbytes for b in self.held.values()) + need > cap:
            self._drop(next(iter(self.held)))

    def _drop(self, length: int) -> None:
        self.held.pop(length)
        self.stats["released"] += 1

    def release(self, idle_only: bool = False) -> None:
        """Release the kept buckets and their graphs (``idle_only``: those no live
        prompt cache is laid out in), and hand the memory back to the device."""
        for length in list(self.held):
            tenant = self.held[length].tenant
            if not idle_only or tenant is None or tenant() is None:
                self._drop(length)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _default_max_bytes(device: torch.device) -> int:
    """A quarter of the GPU's memory; 1 GiB elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 4
    return 1 << 30
