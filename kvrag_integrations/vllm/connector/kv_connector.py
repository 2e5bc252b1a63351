"""KVRAGConnector: this package's chunk caches in vLLM, through its KV-connector API (v1).

vLLM loads it by module path (``config.transfer_config``): one instance in the
scheduler process (``SchedulerSide``: lookups and per-step plans) and one in
each worker (``WorkerSide``: the paged cache in and out). This class only
adapts vLLM's calls to those two and holds what both need: the settings, the
store, and the fingerprint of the weights served (``identity``).

Loads are synchronous: a step that loads writes its pieces before its forward
(a disk or memory-tier read of a prompt's entries is a small part of the
prefill it replaces). Saves happen after the forward of the step that
completes a prompt, before its output is returned, so a client that sees an
encode request finish finds its entry stored.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvrag_integrations.store import KVStore, TieredKVStore, open_store
from kvrag_integrations.store.quotas import Quotas
from kvrag_integrations.store.sizing import store_budget
from kvrag_integrations.store.write_budget import StoreBudget
from kvrag_integrations.vllm.config import (
    AUTO_BUDGET,
    LOAD_FAILURE_POLICY,
    NO_BUDGET,
    ConnectorSettings,
)
from kvrag_integrations.vllm.connector.messages import KVRAGConnectorMetadata, KVRAGWorkerMetadata
from kvrag_integrations.vllm.connector.scheduler_side import SchedulerSide
from kvrag_integrations.vllm.connector.worker_side import WorkerSide
from kvrag_integrations.vllm.identity import connector_fingerprints, model_folder, rank_layout

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class KVRAGConnector(KVConnectorBase_V1):
    """Reuse of stored chunk caches (TurboRAG) inside vLLM, and chunk encoding by vLLM."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        policy = getattr(transfer, "kv_load_failure_policy", LOAD_FAILURE_POLICY)
        if policy != LOAD_FAILURE_POLICY:
            raise ValueError(
                f"KVRAGConnector needs kv_load_failure_policy={LOAD_FAILURE_POLICY!r} (a "
                "missing or corrupt entry is then recomputed, not an error); use "
                "kvrag_integrations.vllm.transfer_config(...) to build the config"
            )
        self.settings = ConnectorSettings.from_extra(transfer.kv_connector_extra_config)
        precision = self.settings.cache_precision
        self._fingerprints = connector_fingerprints(vllm_config, precision)
        tp_size = len(self._fingerprints)
        self._backend: KVStore = open_store(self.settings.store)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            from kvrag_integrations.vllm.keys import KeyRing

            policy = self.settings.policy(KeyRing.from_env())
            self._scheduler = SchedulerSide(
                self._fingerprints,
                self._backend.contains,
                self._request_blocks,
                policy,
                lossless=precision == "model",
            )
        else:
            from vllm.distributed import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank() if tp_size > 1 else 0
            model = vllm_config.model_config
            layout = rank_layout(model_folder(model.model, model.revision), tp_size)
            tier = self.settings.memory_tier_bytes
            store = TieredKVStore(self._backend, max_bytes=tier) if tier else self._backend
            budget = self._budget()
            index_log = None
            if self.settings.detect and rank == 0:  # one rank announces each entry
                from kvrag_integrations.matching import index_log_for

                index_log = index_log_for(self._backend)  # the store's own connection
            self._worker = WorkerSide(
                store, self._fingerprints[rank], precision, layout, budget, index_log
            )
            self._worker.scheduler_block_size = vllm_config.cache_config.block_size
        logger.info(
            "KVRAGConnector (%s): store %s, precision %s, fingerprint %s",
            role.name.lower(),
            type(self._backend).__name__,
            precision,
            self._fingerprints[0][:12],
        )

    def _budget(self) -> StoreBudget | None:
        """The store's budget (sized from the store where ``"auto"``), its namespaces'
        quotas, and the index log it counts and compacts."""
        from kvrag_integrations.matching import index_log_for

        settings = self.settings
        limit = settings.max_store_bytes
        if limit == NO_BUDGET:
            logger.warning("KVRAGConnector: the store has no budget (max_store_bytes none)")
            return None
        why = "given"
        if limit == AUTO_BUDGET:
            limit, why = store_budget(self._backend)
        logger.info(
            "KVRAGConnector: store budget %d bytes (%s); each namespace at most %.0f%% "
            "of it, %d key namespaces with their own quota",
            limit,
            why,
            100 * settings.namespace_share,
            sum(1 for quota in settings.namespace_quotas.values() if quota),
        )
        quotas = Quotas(settings.namespace_share, dict(settings.namespace_quotas))
        return StoreBudget(
            self._backend, int(limit), quotas=quotas, index_log=index_log_for(self._backend)
        )

    # ============================================================ scheduler side
    def _request_blocks(self, request_id: str) -> list[int]:
        assert self._kv_cache_manager is not None  # bound by the scheduler at start
        return list(self._kv_cache_manager.get_block_ids(request_id)[0])

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """vLLM (scheduler, each time a waiting request may be scheduled): how many
        prompt tokens beyond ``num_computed_tokens`` (vLLM's own prefix-cache hit)
        the connector can load, and whether it loads them asynchronously. Only
        tokens whose K/V is available now may count.

        Here: the request's admission is checked (``SchedulerSide``), and its
        load run's stored prefix, less the last prompt token, counts; loads are
        synchronous (``False``)."""
        assert self._scheduler is not None
        matched = self._scheduler.matched_tokens(request, num_computed_tokens)
        if matched and getattr(request, "skip_reading_prefix_cache", False):
            # A request reading prompt log-probabilities skips vLLM's prefix cache
            # (its lookup has run: nothing hit), and vLLM would drop our load too. An
            # admitted load is exact and the rows after it are computed: keep it
            # (the reranker's query likelihood reads only those rows), but only for
            # ids-only requests: the loaded rows have no log-probabilities, and
            # detokenizing them fails (the OpenAI server always detokenizes; such a
            # request then loads nothing and is computed whole).
            params = getattr(request, "sampling_params", None)
            if getattr(params, "detokenize", True):
                return 0, False
            request.skip_reading_prefix_cache = False
        return matched, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """vLLM (scheduler): blocks are allocated for the request, and
        ``num_external_tokens`` of them are to be loaded (0: none, whatever
        ``blocks`` holds). Here: the load is noted for the next step's metadata."""
        assert self._scheduler is not None
        self._scheduler.allocated(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """vLLM (scheduler, once per step): what the workers transfer this step; it
        must not change ``scheduler_output``. Here: the loads of blocks just
        allocated (before the forward) and the saves of prompts this step
        completes (after it), each piece keyed by its entry's ids and namespace."""
        assert self._scheduler is not None
        counts = scheduler_output.num_scheduled_tokens
        scheduled = [
            (r.req_id, r.num_computed_tokens, counts.get(r.req_id, 0))
            for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled += [
            (req_id, cached.num_computed_tokens[i], counts.get(req_id, 0))
            for i, req_id in enumerate(cached.req_ids)
        ]
        return KVRAGConnectorMetadata(self._scheduler.step(scheduled))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """vLLM (scheduler, after each step): what the workers reported. Here: the
        requests whose load failed, and where vLLM recomputes each from (their
        replies and cached-token counts lose those tokens)."""
        assert self._scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        for request_id, position in getattr(meta, "failed_loads", {}).items():
            self._scheduler.load_failed(request_id, position)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM (scheduler, exactly once per request, before its blocks are freed):
        whether the connector still needs the blocks (True: it frees them later),
        and the ``kv_transfer_params`` of the request's output. Here: nothing is
        held (saves finish within their step), and the reply (``params.Reply``)."""
        assert self._scheduler is not None
        reply = self._scheduler.finished(request.request_id)
        return False, reply.as_params() if reply is not None else None

    # =============================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM (worker, once at start): each attention layer's paged cache by layer
        name. Here: noted by decoder layer, with vLLM's attention layer of each
        (their write op is probed at the first load)."""
        assert self._worker is not None
        attention = self._vllm_config.compilation_config.static_forward_context
        self._worker.register(kv_caches, attention)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """vLLM (worker, before each step's forward): start the loads the step's
        metadata names; those its forward reads must be in place before it runs.
        Here: every load is written whole before returning (a piece that cannot be
        read is reported by ``get_block_ids_with_load_errors``)."""
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVRAGConnectorMetadata)
        for op in meta.ops.loads:
            self._worker.load(op)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """vLLM (worker, in each attention layer): block until that layer's load is
        in the paged cache. Here: nothing to wait for (``start_load_kv`` is done)."""
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """vLLM (worker, in each attention layer): start saving that layer. Here:
        nothing; an entry is saved whole in ``wait_for_save``, once its prompt is
        prefilled (a long prompt arrives over several steps)."""
        return

    def wait_for_save(self) -> None:
        """vLLM (worker, once per step, after the forward, metadata still bound):
        submit the step's saves; a save that outlives the call must keep its
        blocks until it reports done. Here: each entry is read out of the cache
        and stored before returning (a learned prompt's copy is stored by a writer
        thread: its blocks are not read again)."""
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVRAGConnectorMetadata)
        for op in meta.ops.saves:
            self._worker.save(op)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM (worker, after a step): the blocks whose load failed in it (for
        synchronous loads, in the step that found it); vLLM recomputes them
        (``kv_load_failure_policy="recompute"``)."""
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """vLLM (worker, after a step): what to tell the scheduler side (ranks'
        metadata aggregate). Here: the requests whose load failed, and where."""
        failed = self._worker.take_failed_loads() if self._worker is not None else {}
        return KVRAGWorkerMetadata(failed) if failed else None
