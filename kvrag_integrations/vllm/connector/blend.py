"""CacheBlend inside vLLM: the loaded run's chosen tokens recomputed by vLLM's own model.

After a blend request's stored pieces are written into its blocks (turbo's
load), the worker recomputes the tokens that matter over them, as the
in-process ``CacheBlend`` does, with the weights vLLM serves (no second copy)
and vLLM's own model code (its projections, norms, rotary, MLPs; any family):

- ``model(input_ids, positions)`` is called on just the rows to compute, under a
  ``ForwardContext`` of our own (vLLM's ``override_forward_context``, eager:
  ``skip_compiled``) whose attention layers are proxies: vLLM's attention custom
  op looks the layer up there and calls our ``attend`` with the queries, keys
  and values the model built. Nothing of vLLM is edited or patched;
- ``attend`` writes the rows' fresh K/V into the request's own blocks (with the
  backend's write op, ``PagedLayout``) and attends over the run's K/V read back
  from them, each row seeing the keys at positions <= its own (and within the
  layer's sliding window), softcapped where the layer is;
- selection as in process: by the K/V deviation at the check layer (every row
  through the first layers, stopped there), or by the question's attention over
  the run (the prompt's rows after the run, computed over it with their
  attention recorded, their K/V kept aside: vLLM computes them afterwards);
  then the selected rows (and every text row of the run, always) run through
  every layer, writing over the stored K/V.

A turbo load's computed pieces (``PieceSpec.computed``: an anonymous request's
own texts, read from no entry) run through the same forward, each text over
itself only (``compute_alone``), as its entry would have been encoded: every
load's of a step in one forward, their K/V written where they sit.

The model comes from the worker through ``worker_extension.BlendWorkerExtension``
(vLLM's ``--worker-extension-cls``, called once at start); ``check_model``
refuses, naming it, a model whose attention this cannot reproduce (ALiBi,
attention sinks, layers sharing their cache, non-decoder or MLA attention,
pipeline parallelism).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvrag_integrations.vllm.connector.messages import BlendOp
from kvrag_integrations.vllm.connector.paged import PagedLayout
from kvrag_integrations.vllm.connector.row_attention import rows_attention, rows_mass

logger = logging.getLogger(__name__)

CHECK_LAYER = 1  # CacheBlend's: every row through layer 0, deviation measured at layer 1


class StopPass(Exception):
    """Ends a selection pass once the check layer is measured (the rest is not needed)."""


@dataclass
class _Pass:
    """One forward of the rows ``positions`` (sorted; those >= ``run`` are the
    question's, kept aside), and what its attention does."""

    positions: torch.Tensor  # [R] prompt positions of the rows computed
    slots: torch.Tensor  # [run] cache slots of the run's positions
    run: int  # the loaded run's length
    write_from: int  # layers from here on write the run rows' fresh K/V (0: all)
    stop_at: int | None = None  # the deviation check layer (selection by deviation)
    candidates: torch.Tensor | None = None  # [R] rows that may be picked at stop_at
    n_keep: int = 0
    picked: torch.Tensor | None = None  # [R] the rows picked at stop_at
    mass_layers: frozenset[int] = frozenset()  # layers whose attention of the tail is summed
    tail_rows: int = 0  # the question's rows (the last ones): whose attention is summed
    mass: torch.Tensor | None = None  # [run] the question's attention per run position
    alone: torch.Tensor | None = None  # [R] each row's text (rows that see only their own)


@dataclass(frozen=True)
class _Proxy:
    """What vLLM's attention op finds under a layer's name during our forward."""

    impl: Any
    kv_cache: torch.Tensor


class _Attend:
    """The proxies' ``impl``: vLLM's op calls ``impl.forward(layer, q, k, v, ...)``."""

    def __init__(self, runner: BlendRunner, index: int) -> None:
        self.runner, self.index = runner, index

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: Any,
        attn_metadata: Any,
        output: torch.Tensor | None = None,
        **_: Any,
    ) -> torch.Tensor:
        assert output is not None, "vLLM's attention op passes the output buffer"
        self.runner.attend(self.index, query, key, value, output)
        return output


def check_model(model: Any, layers: dict[int, Any], vllm_config: Any) -> str:
    """Why blend cannot run on this model in vLLM ("" : it can)."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backend import AttentionType

    name = type(model).__name__
    params = inspect.signature(model.forward).parameters
    if not {"input_ids", "positions"} <= set(params):
        return f"{name}'s forward takes no input_ids and positions"
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        return "pipeline parallelism (each stage holds only some layers)"
    for index, layer in sorted(layers.items()):
        if not isinstance(layer, Attention):
            return f"{name} layer {index}: {type(layer).__name__} is not vLLM's Attention"
        if getattr(layer, "kv_sharing_target_layer_name", None):
            return f"{name} layer {index} shares another layer's KV cache"
        if getattr(layer, "has_sink", False) or getattr(layer.impl, "sinks", None) is not None:
            return f"{name} layer {index} has attention sinks"
        if getattr(layer.impl, "alibi_slopes", None) is not None:
            return f"{name} layer {index} uses ALiBi"
        if getattr(layer, "attn_type", AttentionType.DECODER) != AttentionType.DECODER:
            return f"{name} layer {index} is {layer.attn_type} attention, not a decoder's"
        if not hasattr(layer.impl, "scale"):
            return f"{name} layer {index}'s attention has no scale"
    return ""


class BlendRunner:
    """Recomputes a blend load's chosen rows with vLLM's model (see the module docstring).

    Args:
        model: vLLM's model (``worker.get_model()``).
        vllm_config: the worker's config (its forward contexts are made from it).
        caches: each decoder layer's paged cache.
        layers: each decoder layer's vLLM ``Attention``.
        names: each decoder layer's attention layer name (what vLLM's op looks up).
        paged: how K/V sit in a block (``PagedLayout``).
        tp_group_size: tensor-parallel ranks (selection scores are summed over them,
            so every rank recomputes the same rows).
    """

    def __init__(
        self,
        model: Any,
        vllm_config: Any,
        caches: dict[int, torch.Tensor],
        layers: dict[int, Any],
        names: dict[int, str],
        paged: PagedLayout,
        tp_group_size: int = 1,
    ) -> None:
        self.model = model
        self.vllm_config = vllm_config
        self.caches, self.layers, self.names, self.paged = caches, layers, names, paged
        self.tp = tp_group_size
        self.num_layers = len(caches)
        self._pass: _Pass | None = None
        self.device = next(iter(caches.values())).device
        windows = {i: getattr(layer, "sliding_window", None) for i, layer in layers.items()}
        self.windows = {i: int(w) if w else None for i, w in windows.items()}

    # ------------------------------------------------------------------ a request
    @torch.inference_mode()
    def run(self, op: BlendOp, ids: torch.Tensor, slots: torch.Tensor) -> int:
        """Recompute ``op``'s rows over the run ``ids`` (its K/V already at ``slots``);
        return how many run rows were recomputed."""
        run = ids.numel()
        device = self.device
        ids = ids.to(device)
        slots = slots.to(device)
        settings = op.settings
        candidates = torch.zeros(run, dtype=torch.bool, device=device)
        for lo, hi in op.chunks:
            candidates[lo:hi] = True
        texts = torch.zeros(run, dtype=torch.bool, device=device)
        for lo, hi in op.texts:  # text between pieces: always computed, as in process
            texts[lo:hi] = True
        candidates &= ~texts
        keep = texts.clone()
        if settings.recompute_first:
            for lo, hi in op.chunks:
                keep[lo : min(hi, lo + settings.recompute_first)] = True
        # the ratio's share of the chunk rows, among those not computed anyway
        # (``BlendOp.recomputed``: the count the scheduler reports)
        n_keep = round(settings.recompute_ratio * int(candidates.sum()))
        pool = candidates & ~keep
        if n_keep and settings.selection == "query" and op.tail:
            keep |= self._by_query(ids, slots, pool, texts, n_keep, op.tail)
        elif n_keep:
            keep |= self._by_deviation(ids, slots, pool, op.exact, n_keep)
        rows = keep.nonzero().flatten()
        if rows.numel():
            self._forward(ids[rows], _Pass(rows, slots, run, write_from=0))
        return int(rows.numel())

    @torch.inference_mode()
    def compute_alone(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, texts: torch.Tensor
    ) -> None:
        """Compute rows of texts (``texts [R]``: which text each row is of), each text
        over itself only, as its entry would have been encoded alone (at its prompt
        positions: rotary is relative), writing their K/V at ``slots``: a turbo
        load's computed pieces, every load's of a step in one forward."""
        device = self.device
        step = _Pass(positions.to(device), slots.to(device), 0, write_from=0)
        step.alone = texts.to(device)
        self._forward(ids.to(device), step)

    def _by_query(
        self,
        ids: torch.Tensor,
        slots: torch.Tensor,
        candidates: torch.Tensor,
        texts: torch.Tensor,
        n_keep: int,
        tail: Sequence[int],
    ) -> torch.Tensor:
        """The candidates the question (the rows after the run) attends to most, summed
        from a quarter of the depth on; the run's text rows are computed first, as turbo
        computes them (as the in-process engine's selection pass does)."""
        run = ids.numel()
        device = self.device
        rows = texts.nonzero().flatten()
        tail_ids = torch.as_tensor(list(tail), dtype=torch.long, device=device)
        positions = torch.cat([rows, torch.arange(run, run + tail_ids.numel(), device=device)])
        layers = frozenset(range(self.num_layers // 4, self.num_layers))
        step = _Pass(positions, slots, run, write_from=0, mass_layers=layers)
        step.tail_rows = tail_ids.numel()
        self._forward(torch.cat([ids[rows], tail_ids]), step)
        score = self._reduced(step.mass if step.mass is not None else torch.zeros(run))
        score = score.to(device)
        score[~candidates] = float("-inf")
        picked = torch.zeros(run, dtype=torch.bool, device=device)
        picked[torch.topk(score, min(n_keep, int(candidates.sum()))).indices] = True
        return picked

    def _by_deviation(
        self,
        ids: torch.Tensor,
        slots: torch.Tensor,
        candidates: torch.Tensor,
        exact: int,
        n_keep: int,
    ) -> torch.Tensor:
        """The candidates whose values at the check layer, computed over the run, differ
        most from the stored ones (every row after the exact prefix through the first
        layers, the first written fresh: CacheBlend's selection pass)."""
        run = ids.numel()
        rows = torch.arange(exact, run, device=self.device)
        step = _Pass(rows, slots, run, write_from=0, stop_at=min(CHECK_LAYER, self.num_layers - 1))
        step.candidates, step.n_keep = candidates[rows], n_keep
        with contextlib.suppress(StopPass):  # (the pass stops at the check layer)
            self._forward(ids[rows], step)
        picked = torch.zeros(run, dtype=torch.bool, device=self.device)
        if step.picked is not None:
            picked[rows[step.picked]] = True
        return picked

    # ------------------------------------------------------------------ forward
    def _forward(self, ids: torch.Tensor, step: _Pass) -> None:
        from vllm.forward_context import create_forward_context, override_forward_context

        proxies = {self.names[i]: _Proxy(_Attend(self, i), self.caches[i]) for i in self.caches}
        context = create_forward_context(None, self.vllm_config, skip_compiled=True)
        context = dataclasses.replace(context, no_compile_layers=proxies)
        self._pass = step
        try:
            with override_forward_context(context):
                self.model(input_ids=ids, positions=step.positions.to(ids.device))
        finally:
            self._pass = None

    def attend(
        self,
        index: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """One layer of our forward: fresh K/V written, attention over the run's."""
        step = self._pass
        assert step is not None
        cache, layer = self.caches[index], self.layers[index]
        positions = step.positions.to(self.device)
        if step.alone is not None:  # texts computed alone: each row sees its own text's
            self.paged.write(layer, cache, step.slots, key, value)
            visible = step.alone[None, :] == step.alone[:, None]
            self._attend_rows(index, query, key, value, positions, positions, visible, output)
            return
        in_run = positions < step.run  # (query, key, value: [rows, heads, head_dim])
        if step.stop_at == index:
            self._pick(step, cache, layer, positions, key, value)
            raise StopPass
        if index >= step.write_from and bool(in_run.any()):
            where = step.slots[positions[in_run]]
            self.paged.write(layer, cache, where, key[in_run], value[in_run])
        keys, values = self.paged.read(cache, step.slots, to_host=False)
        key_positions = torch.arange(step.run, device=self.device)
        if not bool(in_run.all()):  # the question's rows: their K/V kept aside, not written
            keys = torch.cat([keys, key[~in_run].to(keys.dtype)])
            values = torch.cat([values, value[~in_run].to(values.dtype)])
            key_positions = torch.cat([key_positions, positions[~in_run]])
        visible = self._attend_rows(
            index, query, keys, values, positions, key_positions, None, output
        )
        if index in step.mass_layers:
            impl = layer.impl
            softcap = getattr(impl, "logits_soft_cap", None) or None
            rows = slice(query.shape[0] - step.tail_rows, None)  # the question's rows
            mass = rows_mass(query[rows], keys, visible[rows], float(impl.scale), softcap)
            mass = mass[: step.run].float().cpu()
            step.mass = mass if step.mass is None else step.mass + mass

    def _attend_rows(
        self,
        index: int,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        key_positions: torch.Tensor,
        visible: torch.Tensor | None,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """``query``'s rows over the keys at positions up to theirs (within ``visible``
        and the layer's sliding window), softcapped where the layer is, into
        ``output``; the mask used."""
        causal = key_positions[None, :] <= positions[:, None]
        visible = causal if visible is None else visible & causal
        window = self.windows.get(index)
        if window:
            visible &= key_positions[None, :] > positions[:, None] - window
        impl = self.layers[index].impl
        softcap = getattr(impl, "logits_soft_cap", None) or None
        out = rows_attention(query, keys, values, visible, float(impl.scale), softcap)
        output.copy_(out.reshape(output.shape).to(output.dtype))
        return visible

    def _pick(
        self,
        step: _Pass,
        cache: torch.Tensor,
        layer: Any,
        positions: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        """At the check layer: rank the candidates by their values' squared distance to
        the stored ones, keep the top ``n_keep`` and write only their fresh K/V."""
        assert step.candidates is not None
        _, stored = self.paged.read(cache, step.slots[positions], to_host=False)
        score = (value.float() - stored.float()).pow(2).sum(dim=(1, 2))
        score = self._reduced(score.cpu()).to(self.device)
        score[~step.candidates] = float("-inf")
        picked = torch.zeros_like(step.candidates)
        n = min(step.n_keep, int(step.candidates.sum()))
        if n:
            picked[torch.topk(score, n).indices] = True
        step.picked = picked
        if bool(picked.any()):
            where = step.slots[positions[picked]]
            self.paged.write(layer, cache, where, key[picked], value[picked])

    def _reduced(self, score: torch.Tensor) -> torch.Tensor:
        """``score`` summed over tensor-parallel ranks (each holds some heads), so every
        rank picks the same rows."""
        if self.tp == 1:
            return score
        from vllm.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce(score.to(self.device)).cpu()
