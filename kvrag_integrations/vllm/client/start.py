"""Where a ``VLLMEngine`` gets its vLLM: started in this process, or a running server joined.

Each returns the parts a ``VLLMEngine`` is made of (its backend, the model's
tokenizer and end-of-answer ids); the engine's own options (``cache_prefix``,
``on_miss``, ``cache_salt``, ...) are the engine's. The engine arguments are
``launch.engine_args``' (the one recipe a server uses too).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any

from kvrag_integrations.chunk_kv import DEFAULT_PRECISION
from kvrag_integrations.engine.modeling.model import eos_token_ids
from kvrag_integrations.store import DiskKVStore, KVStore
from kvrag_integrations.vllm.client.backend import Backend
from kvrag_integrations.vllm.config import (
    AUTO_BUDGET,
    DEFAULT_MEMORY_TIER_BYTES,
    WORKER_EXTENSION,
    transfer_config,
)
from kvrag_integrations.vllm.launch import check_architecture, engine_args, platform_env


def start_local(
    model: str | os.PathLike | None = None,
    *,
    store: str | KVStore | None = None,
    cache_precision: str = DEFAULT_PRECISION,
    dtype: str | None = None,
    memory_tier_bytes: int = DEFAULT_MEMORY_TIER_BYTES,
    max_store_bytes: int | str = AUTO_BUDGET,
    reuse: str = "blend",
    **vllm_args: Any,
) -> tuple[Backend, Any, list[int]]:
    """Start vLLM in this process with the connector: its backend, the model's
    tokenizer and end-of-answer ids.

    Args:
        model: HF id, local directory or ``.gguf`` file (None: the bundled
            SmolLM2-135M-Instruct, converted once to a safetensors folder: vLLM
            reads no GGUF).
        store: where chunk caches live: a ``DiskKVStore``, or a URL (``disk:DIR``,
            ``redis://host:port/db``). vLLM's scheduler and worker processes each
            open it (a Redis store's signing secret: ``$KVRAG_STORE_SECRET``).
            Default: a private temporary directory, removed when the process ends.
        cache_precision: how entries are stored (as ``KVRAGEngine``'s).
        dtype: vLLM's compute dtype (default: float32 on a CPU, the checkpoint's
            own on CUDA; as ``python -m kvrag_integrations.vllm.serve``).
        memory_tier_bytes: the worker's in-memory tier in front of ``store``.
        max_store_bytes: the store's budget: bytes, ``"auto"`` (sized from the
            store) or ``"none"`` (see ``ConnectorSettings``).
        reuse: ``"blend"`` (default: turbo and blend both run; the workers get the
            model for blend's recompute through vLLM's ``worker_extension_cls``,
            and a model blend cannot run on serves turbo only, saying why) or
            ``"turbo"`` (turbo only).
        **vllm_args: more of vLLM's engine arguments (``max_model_len``,
            ``tensor_parallel_size``, ``kv_cache_memory_bytes``, ...).

    Raises:
        UnsupportedModelError: an architecture reuse is not verified for (before
            vLLM starts).
    """
    from transformers import AutoTokenizer

    from kvrag_integrations.vllm.client.local import LocalBackend

    # This process is the only client: its requests are the operator's own.
    transfer = _transfer(store, cache_precision, memory_tier_bytes, max_store_bytes, reuse)
    if reuse == "blend":
        vllm_args.setdefault("worker_extension_cls", WORKER_EXTENSION)
    args = engine_args(model, transfer, dtype=dtype, disable_log_stats=True, **vllm_args)
    check_architecture(args["model"])
    for variable, value in platform_env().items():  # read as vLLM starts its engine core
        os.environ.setdefault(variable, value)
    from vllm.config import KVTransferConfig

    args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
    folder, name = args["model"], args["served_model_name"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    backend = LocalBackend(args, name)
    if reuse == "blend":
        backend.attach_blend()
    return backend, tokenizer, eos_token_ids(folder, tokenizer)


def join_server(
    base_url: str,
    *,
    tokenizer: Any = None,
    model: str | None = None,
    api_key: str | None = None,
    timeout: float = 600.0,
) -> tuple[Backend, Any, list[int] | None]:
    """The client of a running vLLM OpenAI server started with the connector: its
    backend, the served model's tokenizer and end-of-answer ids (None: the
    tokenizer's).

    Args:
        base_url: e.g. ``"http://127.0.0.1:8000"``.
        tokenizer: the served model's tokenizer, or its HF id or folder (prompts
            are tokenized here, chunks intact). Default: the checkpoint the server
            serves (its folder or HF id), where this machine can read it.
        model: which served model (default: the server's first).
        api_key: the server's API key, if it has one (a key the server maps to a
            tenant decides the namespace).
        timeout: seconds to wait for a connection or a piece of an answer.
    """
    from transformers import AutoTokenizer

    from kvrag_integrations.vllm.client.remote import ServerBackend

    backend = ServerBackend(base_url, model, api_key, timeout)
    source = tokenizer if tokenizer is not None else backend.model_root
    if isinstance(source, (str, os.PathLike)):
        tok = AutoTokenizer.from_pretrained(source)
        return backend, tok, eos_token_ids(source, tok)
    return backend, source, None


def store_url(store: str | KVStore) -> str:
    """The URL every vLLM process opens the store by."""
    if isinstance(store, str):
        return store
    if isinstance(store, DiskKVStore):
        return f"disk:{store.root.resolve()}"
    raise TypeError(
        f"the vLLM engine's store is opened by every vLLM process from a URL: pass a "
        f"DiskKVStore or a URL (disk:DIR, redis://host:port/db), not a {type(store).__name__}"
    )


def _transfer(
    store: str | KVStore | None,
    precision: str,
    tier: int,
    max_store_bytes: int | str,
    reuse: str,
) -> dict[str, Any]:
    if store is None:
        folder = tempfile.mkdtemp(prefix="kvrag-vllm-")
        atexit.register(shutil.rmtree, folder, True)
        store = f"disk:{folder}"
    return transfer_config(
        store_url(store),
        cache_precision=precision,
        memory_tier_bytes=tier,
        max_store_bytes=max_store_bytes,
        trusted_clients=True,
        reuse=reuse,
    )
