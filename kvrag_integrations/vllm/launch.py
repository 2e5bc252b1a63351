"""How vLLM is started with the connector: in this process, as an OpenAI server, or joined.

One recipe for both (``engine_args``): the engine arguments of
``VLLMEngine.from_pretrained`` (``start_local``) and of ``python -m
kvrag_integrations.vllm.serve`` (``server_command``) come from one place, so
an engine and a server on one store key entries alike (the compute dtype is
part of the key). ``join_server`` is the client side of a running server.
Each returns the parts a ``VLLMEngine`` is made of; the engine's own
options (``cache_prefix``, ``on_miss``, ``cache_salt``, ...) are the engine's.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from typing import Any

from kvrag_integrations.engine.modeling.layout import ModelLayout
from kvrag_integrations.engine.modeling.model import checkpoint_folder, eos_token_ids
from kvrag_integrations.store import DiskKVStore, KVStore
from kvrag_integrations.vllm.backend import Backend
from kvrag_integrations.vllm.config import DEFAULT_MEMORY_TIER_BYTES, transfer_config

GATEWAY = "kvrag_integrations.vllm.gateway.TenantGateway"
INSTALLER = "kvrag_integrations.vllm.startup.ReuseInstaller"

# vLLM on a CPU, as it ran fastest here (issue 34): float32 and no graph capture.
# Every vLLM this package starts gets them, and a KV cache of an eighth of the
# host's available memory (``cpu_kv_cache_bytes``); an engine argument given by
# name overrides one.
CPU_ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
}
# vLLM's CPU default sizes the cache as a share of the memory node's total less
# what the worker holds, which fails on hosts whose node 0 is small (a VM whose
# memory was hot-plugged): a size in bytes does not.
_CPU_KV_SHARE = 8
_CPU_KV_BOUNDS = (512 * 2**20, 4 * 2**30)
# vLLM's CPU backend keeps cores for itself unless told; on a small machine every
# core serving the model is fastest.
CPU_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def served_checkpoint(model: str | os.PathLike | None) -> tuple[str, str]:
    """``(folder, name)`` vLLM serves for ``model`` (``checkpoint_folder``: a
    ``.gguf`` as its safetensors copy), its architecture checked here, before
    vLLM starts, rather than in a worker.

    Raises:
        UnsupportedModelError: an architecture reuse is not verified for.
    """
    from transformers import AutoConfig

    folder, name = checkpoint_folder(model)
    ModelLayout.of_config(AutoConfig.from_pretrained(folder))
    return folder, name


def platform_engine_args() -> dict[str, Any]:
    """The engine arguments this package gives vLLM on this machine (``CPU_ENGINE_ARGS``
    and ``kv_cache_memory_bytes`` on a CPU; none on CUDA, where vLLM's own are right)."""
    if _has_cuda():
        return {}
    return {**CPU_ENGINE_ARGS, "kv_cache_memory_bytes": cpu_kv_cache_bytes()}


def cpu_kv_cache_bytes() -> int:
    """The KV cache vLLM gets on a CPU: an eighth of the available host memory,
    between 512 MiB and 4 GiB."""
    from kvrag_integrations.store.budget import FALLBACK_BYTES, available_host_memory

    available = available_host_memory() or FALLBACK_BYTES
    low, high = _CPU_KV_BOUNDS
    return max(low, min(high, available // _CPU_KV_SHARE))


def platform_env() -> dict[str, str]:
    """The environment variables vLLM is started with on this machine (``CPU_ENV``
    on a CPU), as defaults: one already set wins."""
    return {} if _has_cuda() else dict(CPU_ENV)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def engine_args(
    model: str | os.PathLike | None,
    transfer: dict[str, Any],
    *,
    dtype: str | None = None,
    **vllm_args: Any,
) -> dict[str, Any]:
    """vLLM's engine arguments for ``model`` with the connector's ``transfer``
    config: the one recipe of ``from_pretrained`` and ``serve`` (the compute
    dtype is part of the store's key, so an engine and a server on one store
    must agree on it to share entries).

    ``dtype`` None: this machine's default (float32 on a CPU, the checkpoint's
    own on CUDA: vLLM's ``"auto"``). ``vllm_args`` override any of them.

    Raises:
        UnsupportedModelError: an architecture reuse is not verified for.
    """
    folder, name = served_checkpoint(model)
    args: dict[str, Any] = {
        "model": folder,
        "tokenizer": folder,
        "served_model_name": name,
        "enable_prefix_caching": True,
        "kv_transfer_config": transfer,
        **platform_engine_args(),
    }
    if dtype is not None:
        args["dtype"] = dtype
    args.update(vllm_args)
    return args


def start_local(
    model: str | os.PathLike | None = None,
    *,
    store: str | KVStore | None = None,
    cache_precision: str = "float16",
    dtype: str | None = None,
    memory_tier_bytes: int = DEFAULT_MEMORY_TIER_BYTES,
    max_store_bytes: int | str = "auto",
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
        **vllm_args: more of vLLM's engine arguments (``max_model_len``,
            ``tensor_parallel_size``, ``kv_cache_memory_bytes``, ...).

    Raises:
        UnsupportedModelError: an architecture reuse is not verified for (before
            vLLM starts).
    """
    from transformers import AutoTokenizer

    from kvrag_integrations.vllm.local import LocalBackend

    # This process is the only client: its requests are the operator's own.
    transfer = _transfer(store, cache_precision, memory_tier_bytes, max_store_bytes)
    args = engine_args(model, transfer, dtype=dtype, disable_log_stats=True, **vllm_args)
    for variable, value in platform_env().items():  # read as vLLM starts its engine core
        os.environ.setdefault(variable, value)
    from vllm.config import KVTransferConfig

    args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
    folder, name = args["model"], args["served_model_name"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return LocalBackend(args, name), tokenizer, eos_token_ids(folder, tokenizer)


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

    from kvrag_integrations.vllm.remote import ServerBackend

    backend = ServerBackend(base_url, model, api_key, timeout)
    source = tokenizer if tokenizer is not None else backend.model_root
    if isinstance(source, (str, os.PathLike)):
        tok = AutoTokenizer.from_pretrained(source)
        return backend, tok, eos_token_ids(source, tok)
    return backend, source, None


def server_command(model: str | None, store: str, rest: list[str], **settings: Any) -> list[str]:
    """The vLLM OpenAI server's command line for ``model`` with the connector on
    ``store`` (``settings``: the connector's, ``ConnectorSettings``), the engine
    arguments ``start_local`` uses, cached-token counts in the usage, the
    gateway (API keys and grants) and the installer of the server's hook
    (anonymous requests' own salts; detection of stored passages)."""
    args = engine_args(model, transfer_config(store, **settings))
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    command += [*_flags(args), "--enable-prompt-tokens-details"]
    command += ["--middleware", GATEWAY, "--middleware", INSTALLER]
    return command + rest


def plain_server_command(model: str | None, rest: list[str]) -> list[str]:
    """vLLM's own OpenAI server for ``model`` as ``server_command`` starts it, without
    the connector (prefix caching on): what a server with it is compared with."""
    args = engine_args(model, {})
    args.pop("kv_transfer_config")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    return [*command, *_flags(args), "--enable-prompt-tokens-details", *rest]


def wait_until_serving(url: str, process: Any, timeout: float = 600.0) -> bool:
    """Whether the OpenAI server at ``url`` (started as ``process``, a ``Popen``)
    answers ``/v1/models`` within ``timeout`` seconds (False: it exited or did not)."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return False


def _flags(engine_args: dict[str, Any]) -> list[str]:
    """Engine arguments as the server's flags (``enforce_eager=True`` -> ``--enforce-eager``)."""
    flags: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, dict):
            value = json.dumps(value, separators=(",", ":"))
        flags += [flag] if value is True else [flag, str(value)]
    return flags


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
    store: str | KVStore | None, precision: str, tier: int, max_store_bytes: int | str
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
    )
