"""KVRAGConnector: this package's chunk caches in vLLM, through its KV-connector API (v1).

vLLM loads it by module path (``config.transfer_config``): one instance in the
scheduler process (``SchedulerSide``: lookups and per-step plans) and one in
each worker (``WorkerSide``: the paged cache in and out). This class only
adapts vLLM's calls to those two and holds what both need: the settings, the
store, and the fingerprint of the weights served (``identity``).

Loads are synchronous: a step that loads writes its pieces before its forward
(a disk or memory-tier read of a prompt's entries is a small part of the
prefill it replaces). A blend load then recomputes part of them with the
model's own weights (``blend``), which the workers get at start
(``attach_model``, called through ``worker_extension``).

Saves happen after the forward of the step that completes a prompt, before its
output is returned, so a client that sees an encode request finish finds its
entry stored.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvrag_integrations.engine.blend_settings import REREAD_S, Calibrations
from kvrag_integrations.engine.modeling.checkpoint_identity import MODEL_TAG, folder_fingerprint
from kvrag_integrations.store import KVStore, RedisKVStore, TieredKVStore, open_store
from kvrag_integrations.store.quotas import Quotas
from kvrag_integrations.store.records import records_for
from kvrag_integrations.store.redis_client import check_eviction_policy
from kvrag_integrations.store.sizing import store_budget
from kvrag_integrations.store.write_budget import StoreBudget
from kvrag_integrations.vllm.config import (
    AUTO_BUDGET,
    LOAD_FAILURE_POLICY,
    NO_BUDGET,
    ConnectorSettings,
)
from kvrag_integrations.vllm.connector import stats
from kvrag_integrations.vllm.connector.messages import KVRAGConnectorMetadata, KVRAGWorkerMetadata
from kvrag_integrations.vllm.connector.scheduler_side import SchedulerSide
from kvrag_integrations.vllm.connector.worker_side import WorkerSide
from kvrag_integrations.vllm.identity import connector_fingerprints, model_folder, rank_layout
from kvrag_integrations.vllm.logs import log_beside_vllm

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
        log_beside_vllm(unless_configured=True)  # (refusals among them, in the server's log)
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
        if isinstance(self._backend, RedisKVStore):  # (the budget evicts, never Redis)
            check_eviction_policy(self._backend.client)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            from kvrag_integrations.vllm.keys import KeyRing

            policy = self.settings.policy(KeyRing.from_env())
            calibrations = self._calibrations(vllm_config)
            self._scheduler = SchedulerSide(
                self._fingerprints,
                self._backend.contains,
                self._request_blocks,
                policy,
                lossless=precision == "model",
                reuse=self.settings.reuse,
                # (never waits on the store in the engine step: a thread reads it)
                blend_settings=partial(calibrations.settings_for, read=False),
                bos_id=getattr(vllm_config.model_config.hf_config, "bos_token_id", None),
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
            self._fingerprints[0],  # (whole: ``kvrag store prune --foreign --fingerprint``)
        )

    def _calibrations(self, vllm_config: VllmConfig) -> Calibrations:
        """The served model's calibrated blend settings (``engine.blend_settings``),
        kept current by a thread (read once now, then every minute)."""
        model = vllm_config.model_config
        folder = model_folder(model.model, model.revision)
        identity = folder_fingerprint(folder, MODEL_TAG, canonical=True)
        calibrations = Calibrations(identity, str(model.served_model_name or folder.name))
        with contextlib.suppress(ValueError):  # a store without records: bundled ones only
            calibrations.shelf = records_for(self._backend)
        if self.settings.reuse == "blend":
            calibrations.current()
            threading.Thread(
                target=_refresh, args=(calibrations,), name="kvrag-calibration", daemon=True
            ).start()
        return calibrations

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
        quotas = self._quotas()
        logger.info(
            "KVRAGConnector: store budget %d bytes (%s); each namespace at most %.0f%% "
            "of it, %d key namespaces with their own quota (now: the key file is read "
            "again as it changes)",
            limit,
            why,
            100 * settings.namespace_share,
            sum(1 for quota in quotas().named.values() if quota),
        )
        return StoreBudget(
            self._backend, int(limit), quotas=quotas, index_log=index_log_for(self._backend)
        )

    def _quotas(self) -> Callable[[], Quotas]:
        """The namespaces' quotas as the key file says now: its ``quota_bytes`` are
        read again as it changes, in every process alike (``keys.KeyRing``)."""
        from kvrag_integrations.vllm.keys import KeyRing, namespace_quotas

        share, given = self.settings.namespace_share, dict(self.settings.namespace_quotas)
        ring = KeyRing.from_env()
        made: dict[int, Quotas] = {}  # by the key file read (one object while unchanged)

        def current() -> Quotas:
            file = ring.current() if ring is not None else None
            if id(file) not in made:
                named = {**given, **(namespace_quotas(file) if file is not None else {})}
                made.clear()
                made[id(file)] = Quotas(share, named)
            return made[id(file)]

        return current

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
            # accepted load is exact and the rows after it are computed: keep it
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
        for request_id, count in getattr(meta, "blended", {}).items():
            self._scheduler.recomputed_by_blend(request_id, count)

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

    def attach_model(self, model: Any) -> str:
        """Ours (worker, once at start, through ``worker_extension``): the model blend
        recomputes with; "" where it can, else why not (nothing is attached)."""
        assert self._worker is not None
        from kvrag_integrations.vllm.connector.blend import BlendRunner, check_model

        worker = self._worker
        why = check_model(model, worker.layers, self._vllm_config)
        if why:
            logger.warning("KVRAGConnector: blend cannot run on this model: %s", why)
            return why
        tp = self._vllm_config.parallel_config.tensor_parallel_size
        worker.blender = BlendRunner(
            model,
            self._vllm_config,
            worker.caches,
            worker.layers,
            worker.names,
            worker.paged_layout(),
            tp,
        )
        logger.info("KVRAGConnector: blend attached to %s", type(model).__name__)
        return ""

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
        self._worker.compute_texts()  # (the loads' computed pieces, in one forward)

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
        and stored before returning (a deferred save's copy is stored by a writer
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

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """vLLM (each worker after a step, the scheduler after it reads the step's
        outputs): the connector's counts since the last call, or None. Here: the
        budget's refused writes (by kind of namespace) and evictions, the refused
        requests (``stats``: the server logs them and ``/metrics`` counts them)."""
        if self._worker is not None:
            return stats.counted(stats.budget_counts(self._worker.writes.budget))
        return stats.counted(self._scheduler.take_stats()) if self._scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        """vLLM (the API server): our counts from their payload."""
        return stats.KVRAGStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, *args: Any) -> KVConnectorPromMetrics:
        """vLLM (the API server, once; its config, metric types, label names and each
        engine's label values): the connector's Prometheus metrics."""
        return stats.KVRAGPromMetrics(*args)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """vLLM (worker, after a step): what to tell the scheduler side (ranks'
        metadata aggregate). Here: the requests whose load failed, and where."""
        if self._worker is None:
            return None
        failed, blended = self._worker.take_failed_loads(), self._worker.take_blended()
        return KVRAGWorkerMetadata(failed, blended) if failed or blended else None


def _refresh(calibrations: Calibrations) -> None:
    """Read the calibration record every minute (off vLLM's engine step)."""
    while True:
        time.sleep(REREAD_S)
        try:
            calibrations.current()
        except Exception:  # a store that cannot be reached now: the last one stays
            logger.exception("the calibration record was not read")
