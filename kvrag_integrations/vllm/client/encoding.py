"""VLLMEngine's chunk encoding: vLLM's own prefill of each entry, stored by the connector.

One prefill-only request per entry, all in flight at once (vLLM batches them),
each saved by the connector; what a request found missing is encoded in the
background (each entry once, bounded: an ``EncodeLedger``, as the in-process
engine's), and a request waits for the background encodes of its own pieces.
A mixin of ``VLLMEngine``, whose state it uses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from tqdm.auto import tqdm

from kvrag_integrations.engine.caching.entries import ChunkRef
from kvrag_integrations.engine.caching.prompt_tokenizer import PromptTokenizer
from kvrag_integrations.engine.prompting.segments import TokenizedPrompt
from kvrag_integrations.engine.scheduling.ledger import EncodeLedger
from kvrag_integrations.errors import ConnectorMissingError, TransferParamsError
from kvrag_integrations.vllm.client.backend import Backend, BackendRequest
from kvrag_integrations.vllm.params import PieceSpec, TransferParams
from kvrag_integrations.vllm.reply import Reply

logger = logging.getLogger(__name__)

_ENCODE = {"max_tokens": 1, "temperature": 0.0}  # a prefill-only request
_MAX_PREFIXES = 256  # leading texts remembered as encoded
# A request waits this long at most for the background encodes of its pieces (a
# chunk's prefill takes well under a second; a stuck server must not hold it).
_AWAIT_ENCODE_S = 30.0


class VLLMEncoding:
    """Encoding entries through vLLM (a mixin of ``VLLMEngine``)."""

    backend: Backend
    prompts: PromptTokenizer
    tenant_salt: str
    context_window: int
    model_name: str
    _fingerprint: str | None
    _pool: ThreadPoolExecutor
    _background: EncodeLedger[tuple[int, ...]]
    _prefixes: dict[tuple[int, ...], None]
    _lock: threading.Lock

    def encode_chunks(
        self,
        chunks: Sequence[str],
        *,
        batch_size: int = 32,
        show_progress: bool = True,
        overwrite: bool = False,
    ) -> list[ChunkRef]:
        """Have vLLM prefill each chunk alone and the connector store its cache.

        Stored ones cost a one-token request and are not written again (unless
        ``overwrite``). ``batch_size``: encode requests in flight at once (vLLM
        batches what is in flight). Returns one ``ChunkRef`` per chunk, in order.
        """
        pairs = self.prompts.chunks_to_encode(chunks, self.context_window)
        entries = list(dict.fromkeys(tuple(entry.tolist()) for _, entry in pairs))
        params = TransferParams(overwrite=overwrite, tenant_salt=self.tenant_salt)
        keys: dict[tuple[int, ...], str] = {}
        step = max(1, batch_size)
        with tqdm(
            total=len(entries), desc="Encoding chunk caches", disable=not show_progress
        ) as bar:
            for start in range(0, len(entries), step):
                batch = entries[start : start + step]
                replies = self._pool.map(partial(self._encode, params=params), batch)
                for entry, reply in zip(batch, replies):
                    keys[entry] = reply.keys[0]
                    bar.update(1)
        return [ChunkRef(keys[tuple(entry.tolist())], len(ids)) for ids, entry in pairs]

    def _encode(self, entry: Sequence[int], params: TransferParams) -> Reply:
        save = TransferParams((), (PieceSpec(0, len(entry)),), params.overwrite, self.tenant_salt)
        return self._run_encode(list(entry), save)

    def _run_encode(self, ids: list[int], params: TransferParams) -> Reply:
        """One prefill-only request; the connector's reply.

        Raises:
            ConnectorMissingError: vLLM runs without the connector.
            TransferParamsError: the connector refused it (the reply says why).
        """
        request = BackendRequest(
            ids, dict(_ENCODE), params.salt(), params.as_request(), stream=False
        )
        reply = None
        for event in self.backend.submit(request, threading.Event()):
            reply = event.reply or reply
        if reply is None:
            raise ConnectorMissingError(
                f"{self.model_name}: vLLM answered without the KVRAGConnector's reply; start it "
                "with kvrag_integrations.vllm.transfer_config(...) as its kv_transfer_config"
            )
        if reply.refused:
            raise TransferParamsError(f"the KV connector refused the request: {reply.refused}")
        self._fingerprint = reply.fingerprint
        return reply

    def encode_in_background(self, entries: Sequence[Sequence[int]]) -> int:
        """Queue encode requests for entries (by ids) not queued yet; how many were
        (past ``max_pending`` waiting, the rest are skipped)."""
        params = TransferParams(tenant_salt=self.tenant_salt)
        return sum(
            self._background.submit(entry, partial(self._pool.submit, self._encode, entry, params))
            for entry in map(tuple, entries)
        )

    def wait_for_encoding(self, timeout: float | None = None) -> bool:
        """Wait for background encodes; False if ``timeout`` (s) ran out first."""
        return self._background.wait(None, timeout)

    def _await_background(self, prompt: TokenizedPrompt, run: Sequence[PieceSpec]) -> int:
        """Wait for the background encodes of ``run``'s pieces (in flight in vLLM:
        what this request needs to reuse them); how many chunks were awaited."""
        ids = prompt.input_ids.tolist()
        kinds = [p.kind for p in prompt.cached_pieces]
        entries = [(kind, tuple(piece.entry_ids(ids))) for kind, piece in zip(kinds, run)]
        pending = self._background.pending(entry for _, entry in entries)
        if not self._background.wait(pending, timeout=_AWAIT_ENCODE_S):
            logger.warning(
                "background encodes still running after %.0f s; vLLM computes "
                "what they have not stored",
                _AWAIT_ENCODE_S,
            )
        return sum(kind == "chunk" and entry in pending for kind, entry in entries)

    def _ensure_prefix(self, prompt: TokenizedPrompt, head: PieceSpec) -> None:
        """Encode the cached leading text the first time it is seen: the whole run
        loads only from it on (a few dozen tokens, one small request per template)."""
        entry = tuple(head.entry_ids(prompt.input_ids.tolist()))
        with self._lock:
            known = entry in self._prefixes
        if not known:
            self._encode(entry, TransferParams(tenant_salt=self.tenant_salt))
            with self._lock:
                self._prefixes[entry] = None
                while len(self._prefixes) > _MAX_PREFIXES:
                    self._prefixes.pop(next(iter(self._prefixes)))

    def _encode_all(self, prompt: TokenizedPrompt, run: Sequence[PieceSpec]) -> None:
        ids = prompt.input_ids.tolist()
        entries = list(dict.fromkeys(tuple(p.entry_ids(ids)) for p in run))
        params = TransferParams(tenant_salt=self.tenant_salt)
        list(self._pool.map(partial(self._encode, params=params), entries))
