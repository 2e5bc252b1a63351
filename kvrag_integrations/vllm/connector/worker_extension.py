"""What the connector needs of vLLM's workers beyond its API: the model.

vLLM mixes a worker extension class into its workers (the engine argument
``worker_extension_cls``) and calls its methods by name on every worker
(``collective_rpc``): that is how blend's recompute (``connector.blend``), and
a load's computed pieces (an anonymous request's own texts, on any server), get
the weights vLLM serves, with no second copy and no edit of vLLM. The server's
startup hook (``server.startup``) and ``VLLMEngine.from_pretrained`` call
``kvrag_attach_model`` once, after the engine starts.
"""

from __future__ import annotations


class BlendWorkerExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``)."""

    def kvrag_attach_model(self) -> str:
        """Hand this worker's model to the KV connector; "" where blend can run on it,
        else why not (the caller refuses to serve blend, naming it)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return "vLLM runs without a KV connector"
        attach = getattr(get_kv_transfer_group(), "attach_model", None)
        if attach is None:
            return "vLLM's KV connector is not the KVRAGConnector"
        return str(attach(self.get_model()))  # type: ignore[attr-defined]
